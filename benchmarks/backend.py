"""Pie's inference layer vs HF transformers eager, same weights and dtype, in one run.

Measures prefill tokens/s (one 512-token prompt) and the decode step time at batch 1, 8 and
32 with contexts of 128 and 512 tokens. Pie is measured through a real `pie backend`
process over ZeroMQ (embed_text + forward + sample per step, as the control layer issues
them); HF runs in this process with its own KV cache (forward + argmax per step). The two
alternate round by round because this machine is noisy; medians and ratios go to
benchmarks/results/backend.json.

    python benchmarks/backend.py [--dtype bfloat16] [--rounds 5] [--steps 8] [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from pie import protocol as P
from pie.backend.weights import resolve_model_dir
from pie.config import load_config
from pie.control.backend_link import BackendLink, BackendProcess

RESULTS = Path(__file__).parent / "results"


class PieSide:
    """B sequences with L cached tokens each in a real backend; one decode step = 3 calls."""

    def __init__(self, link: BackendLink, hs: P.HandshakeReply):
        self.link, self.hs = link, hs

    def _ok(self, message: P.Message) -> P.Message:
        reply = self.link.call(message)
        assert not getattr(reply, "errors", None), reply
        return reply

    def prepare(self, batch: int, context: int) -> None:
        ps = self.hs.page_size
        self.batch, self.context = batch, context
        self.pages_each = math.ceil((context + 64) / ps)
        self.length = [0] * batch
        chunk = 512
        for start in range(0, context, chunk):
            n = min(chunk, context - start)
            for b in range(batch):
                self._ok(P.EmbedText([100 + (b + i) % 1000 for i in range(n)],
                                     list(range(start, start + n)), list(range(n))))
                self._forward([b], list(range(n)))

    def _forward(self, seqs: list[int], embeds: list[int], per_seq: int | None = None) -> None:
        ps = self.hs.page_size
        m = P.Forward([], [0], [], [], [0], [], [0], [], [], [], [0], [])
        for j, b in enumerate(seqs):
            pages = list(range(b * self.pages_each, (b + 1) * self.pages_each))
            length = self.length[b]
            own = embeds if per_seq is None else embeds[j * per_seq : (j + 1) * per_seq]
            m.kv_page_ids += pages[: math.ceil(length / ps)]
            m.kv_page_indptr.append(len(m.kv_page_ids))
            m.kv_last_page_lens.append((length - 1) % ps + 1 if length else 0)
            m.embed_ids += own
            m.embed_indptr.append(len(m.embed_ids))
            out = pages[length // ps : math.ceil((length + len(own)) / ps)]
            m.out_kv_page_ids += out
            m.out_kv_page_indptr.append(len(m.out_kv_page_ids))
            m.out_kv_offsets.append(length % ps)
            m.out_embed_ids.append(self.hs.num_embeds - 1 - b)
            m.out_token_indices.append(len(own) - 1)
            m.out_embed_indptr.append(len(m.out_embed_ids))
            m.attention_masks.append(None)
            self.length[b] += len(own)
        self._ok(m)

    def decode_step(self) -> None:
        seqs = list(range(self.batch))
        outs = [self.hs.num_embeds - 1 - b for b in seqs]
        tokens = self._ok(P.Sample(outs, [0.0] * self.batch, [0] * self.batch,
                                   [1.0] * self.batch, [-1] * self.batch)).token_ids
        self._ok(P.EmbedText(tokens, [self.length[b] for b in seqs], seqs))
        self._forward(seqs, seqs, per_seq=1)

    def prefill(self, n: int) -> None:
        self._ok(P.EmbedText([100 + i % 1000 for i in range(n)], list(range(n)), list(range(n))))
        self.length = [0]
        self.pages_each = math.ceil(n / self.hs.page_size) + 1
        self._forward([0], list(range(n)))
        self._ok(P.Sample([self.hs.num_embeds - 1], [0.0], [0], [1.0], [-1]))


class HfSide:
    def __init__(self, model_dir: Path, dtype: torch.dtype):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=dtype, attn_implementation="eager").eval()

    @torch.inference_mode()
    def prepare(self, batch: int, context: int) -> None:
        ids = torch.tensor([[100 + (b + i) % 1000 for i in range(context)] for b in range(batch)])
        out = self.model(ids, use_cache=True)
        self.cache, self.next = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)

    @torch.inference_mode()
    def decode_step(self) -> None:
        out = self.model(self.next, past_key_values=self.cache, use_cache=True)
        self.cache, self.next = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)

    @torch.inference_mode()
    def prefill(self, n: int) -> None:
        ids = torch.tensor([[100 + i % 1000 for i in range(n)]])
        self.model(ids, use_cache=True).logits[:, -1].argmax(-1)


def timed(fn, *args) -> float:
    started = time.perf_counter()
    fn(*args)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds per config")
    parser.add_argument("--steps", type=int, default=8, help="decode steps timed per round")
    parser.add_argument("--quick", action="store_true", help="batch 1 and 8 at context 128 only")
    parser.add_argument("--out", default=str(RESULTS / "backend.json"))
    args = parser.parse_args()

    config = load_config()
    model_dir = resolve_model_dir(config.model.path, config.paths.cache)
    torch.set_num_threads(torch.get_num_threads())
    configs = [(1, 128), (8, 128)] if args.quick else [
        (b, l) for b in (1, 8, 32) for l in (128, 512)]
    process = BackendProcess(model_dir, extra_args=["--dtype", args.dtype])
    try:
        link, hs = process.connect()
        pie, hf = PieSide(link, hs), HfSide(model_dir, getattr(torch, args.dtype))
        results = {"prefill": {}, "decode": []}

        pie_times, hf_times = [], []
        for _ in range(args.rounds):
            pie_times.append(timed(pie.prefill, 512))
            hf_times.append(timed(hf.prefill, 512))
        pie_tps, hf_tps = 512 / statistics.median(pie_times), 512 / statistics.median(hf_times)
        results["prefill"] = {"tokens": 512, "pie_tokens_per_s": pie_tps,
                              "hf_tokens_per_s": hf_tps, "pie_over_hf": pie_tps / hf_tps}
        print(f"prefill 512: pie {pie_tps:7.0f} tok/s   hf {hf_tps:7.0f} tok/s   "
              f"ratio {pie_tps / hf_tps:.2f}x", flush=True)

        for batch, context in configs:
            pie.prepare(batch, context)
            hf.prepare(batch, context)
            pie.decode_step(), hf.decode_step()  # warm-up
            pie_steps, hf_steps = [], []
            for _ in range(args.rounds):
                pie_steps += [timed(pie.decode_step) for _ in range(args.steps)]
                hf_steps += [timed(hf.decode_step) for _ in range(args.steps)]
            pie_ms, hf_ms = 1e3 * statistics.median(pie_steps), 1e3 * statistics.median(hf_steps)
            row = {"batch": batch, "context": context, "pie_step_ms": pie_ms, "hf_step_ms": hf_ms,
                   "pie_tokens_per_s": 1e3 * batch / pie_ms, "hf_tokens_per_s": 1e3 * batch / hf_ms,
                   "hf_over_pie_time": hf_ms / pie_ms}
            results["decode"].append(row)
            print(f"decode B={batch:2d} L={context:3d}: pie {pie_ms:7.2f} ms/step "
                  f"({row['pie_tokens_per_s']:6.0f} tok/s)   hf {hf_ms:7.2f} ms/step "
                  f"({row['hf_tokens_per_s']:6.0f} tok/s)   speed-up {hf_ms / pie_ms:.2f}x",
                  flush=True)
        link.close()
    finally:
        process.stop()

    results["meta"] = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "model": model_dir.name, "dtype": args.dtype, "threads": torch.get_num_threads(),
        "torch": torch.__version__, "cpu": platform.processor() or platform.machine(),
        "rounds": args.rounds, "steps_per_round": args.steps,
        "method": "medians over alternating rounds; Pie through a real backend process over ZeroMQ",
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
