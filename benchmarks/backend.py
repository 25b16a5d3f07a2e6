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
from pie.control.direct import DirectBatch

RESULTS = Path(__file__).parent / "results"


class PieSide:
    """B sequences of L cached tokens in a real backend; a decode step is the three calls
    the control layer issues (sample, embed_text, forward), as the direct driver makes them."""

    def __init__(self, link: BackendLink, hs: P.HandshakeReply, steps: int):
        self.link, self.hs, self.steps = link, hs, steps

    def prepare(self, batch: int, context: int) -> None:
        prompts = [[100 + (b + i) % 1000 for i in range(context)] for b in range(batch)]
        self.batch = DirectBatch(self.link, self.hs, prompts, self.steps)
        self.batch.prefill()

    def decode_step(self) -> None:
        self.batch.step()

    def prefill(self, n: int) -> None:
        batch = DirectBatch(self.link, self.hs, [[100 + i % 1000 for i in range(n)]], 1)
        batch.prefill()
        batch.step(limit=1)  # the first token, as a request would


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
        pie = PieSide(link, hs, steps=args.rounds * args.steps + 2)
        hf = HfSide(model_dir, getattr(torch, args.dtype))
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
