"""Pie's inference layer vs HF transformers, same weights and dtype, in one run.

Measures prefill tokens/s (one 512-token prompt) and the decode step time at batch 1, 8 and
32 with contexts of 128 and 512 tokens. Pie is measured through a real `pie backend`
process over ZeroMQ (one fused `pass` request per step — embed, forward and sampling — as
the control layer issues it); HF runs in this process with its own KV cache (forward +
argmax per step) and its default attention implementation (SDPA where torch has it; the one used is recorded). Each
measurement warms both up untimed, then alternates them round by round (Pie first in even
rounds, HF first in odd ones) because this machine is noisy; medians, every round's
samples and the settings (rounds, order, dtype, CPU model and flags, torch version, HF's
attention implementation) go to benchmarks/results/backend.json (`--out` elsewhere).

    python benchmarks/backend.py [--dtype auto] [--rounds 5] [--steps 8] [--quick] [--out FILE]
        [--device cuda [--attention flashinfer] [--cuda-graphs]]

On a GPU (`--device cuda`, results to benchmarks/results/backend-cuda.json) both sides run
there: the backend with the given attention (and CUDA graphs for decode), HF on the same
device, every HF step synchronised before its clock stops. benchmarks/cuda_check.sh runs it
on a GPU machine with the tests of the CUDA path. The model is whatever `pie model path`
resolves; its `pie-source.json` goes to the results (it says when the weights are random,
as on the GPU machine, which the default weights cannot reach).

`--quick` (batch 1 and 2 at context 32, a 64-token prefill, 2 rounds of 2 steps) is the
smoke run tests/test_bench_scripts.py makes; it writes every field the full run does.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script: the `benchmarks` package is in the repository root

from benchmarks.run_info import command_line, machine_settings, rotated, write_results
from pie import protocol as P
from pie.backend.dtype import resolve_dtype
from pie.backend.weights import resolve_model_dir
from pie.config import BackendConfig, load_config
from pie.control.backend_link import BackendLink, BackendProcess
from pie.control.direct import DirectBatch

RESULTS = Path(__file__).parent / "results"
ROUNDS, QUICK_ROUNDS = 5, 2  # alternating rounds per measurement: full run, --quick


class PieSide:
    """B sequences of L cached tokens in a real backend; a decode step is the one fused
    `pass` request the control layer issues, as the direct driver makes it."""

    def __init__(self, link: BackendLink, hs: P.HandshakeReply, steps: int):
        self.link, self.hs, self.steps = link, hs, steps

    def prepare(self, batch: int, context: int) -> None:
        prompts = [[100 + (b + i) % 1000 for i in range(context)] for b in range(batch)]
        self.batch_size = batch
        self.batch = DirectBatch(self.link, self.hs, prompts, self.steps)
        self.batch.prefill()

    def decode_step(self) -> int:
        """One step; the tokens it produced (one per sequence)."""
        return len(self.batch.step())

    def prefill(self, n: int) -> None:
        batch = DirectBatch(self.link, self.hs, [[100 + i % 1000 for i in range(n)]], 1)
        batch.prefill()
        batch.step(limit=1)  # the first token, as a request would


class HfSide:
    def __init__(self, model_dir: Path, dtype: torch.dtype, device: torch.device):
        from transformers import AutoModelForCausalLM

        # HF's default attention (no attn_implementation): what an HF user gets.
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device).eval()
        self.attn_implementation = self.model.config._attn_implementation
        self.device = device

    def _sync(self) -> None:
        """On a GPU, wait for the step's kernels: the other side's reply only comes after them."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def prepare(self, batch: int, context: int) -> None:
        ids = torch.tensor([[100 + (b + i) % 1000 for i in range(context)] for b in range(batch)],
                           device=self.device)
        out = self.model(ids, use_cache=True)
        self.cache, self.next = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        self._sync()

    @torch.inference_mode()
    def decode_step(self) -> int:
        out = self.model(self.next, past_key_values=self.cache, use_cache=True)
        self.cache, self.next = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        self._sync()
        return self.next.shape[0]

    @torch.inference_mode()
    def prefill(self, n: int) -> None:
        ids = torch.tensor([[100 + i % 1000 for i in range(n)]], device=self.device)
        self.model(ids, use_cache=True).logits[:, -1].argmax(-1)
        self._sync()


def model_source(model_dir: Path) -> dict | None:
    """What `pie model pull` (or benchmarks/random_model.py) wrote about where the weights came from."""
    path = model_dir / "pie-source.json"
    return json.loads(path.read_text()) if path.is_file() else None


def timed(fn, *args) -> float:
    started = time.perf_counter()
    fn(*args)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                        help="default auto: Pie's choice for this CPU (pie/backend/dtype.py)")
    parser.add_argument("--rounds", type=int, default=None, help=f"alternating rounds per config (default {ROUNDS}; quick {QUICK_ROUNDS})")
    parser.add_argument("--steps", type=int, default=None, help="decode steps timed per round (default 8; quick 2)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke run")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where both sides run")
    parser.add_argument("--attention", default="auto", choices=["auto", "torch", "cpu-kernel", "flashinfer"],
                        help="the backend's backend.attention (default auto)")
    parser.add_argument("--cuda-graphs", action="store_true", help="backend.cuda_graphs = true (device cuda, attention flashinfer)")
    parser.add_argument("--out", default=None, help="where the JSON goes (default results/backend.json; backend-cuda.json on cuda)")
    args = parser.parse_args()
    args.dtype = resolve_dtype(args.dtype, args.device)  # one concrete dtype for every side
    out = args.out or str(RESULTS / ("backend.json" if args.device == "cpu" else "backend-cuda.json"))
    rounds = args.rounds or (QUICK_ROUNDS if args.quick else ROUNDS)
    steps = args.steps or (2 if args.quick else 8)
    prefill_tokens = 64 if args.quick else 512

    config = load_config()
    model_dir = resolve_model_dir(config.model.path, config.paths.cache)
    configs = [(1, 32), (2, 32)] if args.quick else [(b, l) for b in (1, 8, 32) for l in (128, 512)]
    order = [rotated(["pie", "hf"], r) for r in range(rounds)]
    backend = BackendConfig(device=args.device, dtype=args.dtype, attention=args.attention,
                            cuda_graphs=args.cuda_graphs)  # checked here, before a process starts
    settings = tempfile.NamedTemporaryFile("w", suffix=".toml", prefix="pie-bench-")
    settings.write(f'[backend]\ndevice = "{backend.device}"\nattention = "{backend.attention}"\n'
                   f"cuda_graphs = {str(backend.cuda_graphs).lower()}\n")
    settings.flush()
    process = BackendProcess(model_dir, settings.name, extra_args=["--dtype", args.dtype])
    try:
        link, hs = process.connect()
        pie = PieSide(link, hs, steps=rounds * steps + 2)
        hf = HfSide(model_dir, getattr(torch, args.dtype), torch.device(args.device))
        sides = {"pie": pie, "hf": hf}
        results: dict = {"prefill": {}, "decode": []}

        for side in sides.values():  # warm-up, untimed
            side.prefill(prefill_tokens)
        times: dict[str, list[float]] = {"pie": [], "hf": []}
        for names in order:
            for name in names:
                times[name].append(timed(sides[name].prefill, prefill_tokens))
        pie_tps = prefill_tokens / statistics.median(times["pie"])
        hf_tps = prefill_tokens / statistics.median(times["hf"])
        results["prefill"] = {"tokens": prefill_tokens, "pie_tokens_per_s": pie_tps,
                              "hf_tokens_per_s": hf_tps, "pie_over_hf": pie_tps / hf_tps,
                              "pie_round_s": times["pie"], "hf_round_s": times["hf"]}
        print(f"prefill {prefill_tokens}: pie {pie_tps:7.0f} tok/s   hf {hf_tps:7.0f} tok/s   "
              f"ratio {pie_tps / hf_tps:.2f}x", flush=True)

        for batch, context in configs:
            pie.prepare(batch, context)
            hf.prepare(batch, context)
            for side in sides.values():  # warm-up, untimed
                side.decode_step()
            step_s: dict[str, list[float]] = {"pie": [], "hf": []}
            tokens = {"pie": 0, "hf": 0}
            for names in order:
                for name in names:
                    for _ in range(steps):
                        started = time.perf_counter()
                        tokens[name] += sides[name].decode_step()
                        step_s[name].append(time.perf_counter() - started)
            pie_ms, hf_ms = 1e3 * statistics.median(step_s["pie"]), 1e3 * statistics.median(step_s["hf"])
            row = {"batch": batch, "context": context, "steps": len(step_s["pie"]),
                   "pie_tokens": tokens["pie"], "hf_tokens": tokens["hf"],
                   "pie_step_ms": pie_ms, "hf_step_ms": hf_ms,
                   "pie_tokens_per_s": 1e3 * batch / pie_ms, "hf_tokens_per_s": 1e3 * batch / hf_ms,
                   "hf_over_pie_time": hf_ms / pie_ms,
                   "pie_step_ms_all": [round(1e3 * s, 3) for s in step_s["pie"]],
                   "hf_step_ms_all": [round(1e3 * s, 3) for s in step_s["hf"]]}
            results["decode"].append(row)
            print(f"decode B={batch:2d} L={context:3d}: pie {pie_ms:7.2f} ms/step "
                  f"({row['pie_tokens_per_s']:6.0f} tok/s)   hf {hf_ms:7.2f} ms/step "
                  f"({row['hf_tokens_per_s']:6.0f} tok/s)   speed-up {hf_ms / pie_ms:.2f}x",
                  flush=True)
        link.close()
    finally:
        process.stop()
        settings.close()

    results["meta"] = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": command_line(), "quick": args.quick, "rounds": rounds, "order": order,
        "steps_per_round": steps, "model": model_dir.name, "model_source": model_source(model_dir),
        "device": args.device, "attention": args.attention, "cuda_graphs": args.cuda_graphs,
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None, "dtype": args.dtype,
        "pie_dtype": hs.dtype, "hf_dtype": str(next(hf.model.parameters()).dtype).removeprefix("torch."),
        "hf_attn_implementation": hf.attn_implementation, "threads": torch.get_num_threads(),
        **machine_settings(),
        "method": "medians over alternating rounds after an untimed warm-up of each side; "
                  "Pie through a real backend process over ZeroMQ, HF in this process",
    }
    write_results(out, results)


if __name__ == "__main__":
    main()
