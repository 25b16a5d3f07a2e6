"""The longest scoring input on a fixed memory budget (issue 18; PrefillOnly's 5x longer
inputs): the one-shot forward against `backend.mlp_chunk_tokens` (pie/backend/chunked_forward.py).

A scoring pass of T tokens: no KV kept, the log-probabilities of a few tokens at the last
position, on the default model in the backend's default dtype. For each T and each mode a
fresh process builds the backend's Engine (max_batch_tokens = T, so the pass is admitted),
warms it with a pass of min(T, 768) tokens, then measures the memory the pass needs beyond
the weights and the KV pool:

    need = the peak of tensor memory allocated during the pass (torch's allocator events,
           recorded by torch.profiler with profile_memory: deterministic, unlike the
           resident set, which glibc's arenas blur by several MiB) + the scratch pages the
           engine allocated at start-up for items that keep no KV (every layer's K/V of
           max_batch_tokens tokens in one-shot mode; two chunks' worth when chunking).

The growth of peak resident memory (VmHWM after writing 5 to /proc/self/clear_refs, freed
heap returned first with malloc_trim) in an unprofiled run of the same pass is recorded
beside it. The budget is what the
one-shot forward needs at T = --budget-at; each mode's longest input is the largest
measured T whose need fits it, measured up to the model's context length. Both modes'
log-probabilities at equal T are compared bit for bit.

    python benchmarks/max_input.py [--lengths 512,1024,...] [--budget-at 1024] [--chunk 256] [--quick] [--out FILE]

Results: benchmarks/results/max_input.json and max_input.png. `--quick` (lengths 300 and
600, chunk 256) is the smoke run tests/test_bench_scripts.py makes.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script: the `benchmarks` package is in the repository root

from benchmarks.run_info import command_line, machine_settings, write_results

RESULTS = Path(__file__).parent / "results"
LENGTHS = (512, 1024, 1536, 2048, 3072, 4096, 6144, 8192)
QUICK_LENGTHS = (300, 600)
MODEL = "smollm2-135m-instruct"
CANDIDATES = [5, 42, 1000]
WARM_UP = 768


def measure(length: int, chunk: int) -> dict:
    """One pass in this (fresh) process: its memory and log-probabilities (see module doc)."""
    import numpy as np
    import torch

    from pie.backend.engine import Engine
    from pie.backend.weights import resolve_model_dir
    from pie.config import BackendConfig, load_config
    from pie.control.passes import Output, Pass, encode

    def status(key: str) -> int:
        line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(key))
        return int(line.split()[1]) * 1024

    def scoring(tokens: int) -> object:
        ids = [(7 * i + 300) % 49_000 for i in range(tokens)]
        return encode([Pass(None, 0, 16, ids, list(range(tokens)), [], [], 0, [], 0, None,  # type: ignore[arg-type]
                            [Output(tokens - 1, logprob_ids=CANDIDATES)])])

    config = load_config()
    engine = Engine(resolve_model_dir(config.model.path, config.paths.cache), BackendConfig(num_kv_pages=8, num_embeds=8, max_batch_tokens=length,
                                                        mlp_chunk_tokens=chunk))
    engine.handle(scoring(min(length, WARM_UP)))  # kernels, threads and their buffers
    pool = engine.kv
    scratch_pages = len(pool.keys[0]) - pool.num_pages - (pool.pad_page is not None)
    scratch_bytes = scratch_pages * sum(t[0].numel() * t.element_size() for t in pool.keys + pool.values)
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # what earlier passes freed leaves the resident set
    Path("/proc/self/clear_refs").write_text("5")
    before = status("VmRSS")
    reply = engine.handle(scoring(length))
    growth = status("VmHWM") - before
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        again = engine.handle(scoring(length))  # (the profiler's own buffers would blur the resident set)
    assert again.logprobs == reply.logprobs
    with tempfile.TemporaryDirectory() as tmp:
        prof.export_chrome_trace(f"{tmp}/trace.json")
        events = json.loads(Path(f"{tmp}/trace.json").read_text())["traceEvents"]
    peak = max(e["args"]["Total Allocated"] for e in events if e.get("name") == "[memory]")
    assert not reply.errors, reply.errors
    return {"tokens": length, "chunk": chunk, "peak_bytes": peak, "rss_growth_bytes": growth,
            "scratch_bytes": scratch_bytes, "need_bytes": peak + scratch_bytes,
            "logprobs": np.frombuffer(reply.logprobs, np.float32).tolist(), "dtype": engine.config.dtype,
            "context_length": engine.model.config.max_position_embeddings, "torch_threads": torch.get_num_threads()}


def run_point(length: int, chunk: int) -> dict:
    done = subprocess.run([sys.executable, __file__, "--point", f"{length},{chunk}"], cwd=ROOT,
                          capture_output=True, text=True, check=False, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"T={length} chunk={chunk} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def longest(rows: list[dict], budget: int) -> int:
    fits = [r["tokens"] for r in rows if r["need_bytes"] <= budget]
    return max(fits) if fits else 0


def plot(data: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4))
    for mode, rows in data["modes"].items():
        ax.plot([r["tokens"] for r in rows], [r["need_bytes"] / 2**20 for r in rows], marker="o", label=mode)
    ax.axhline(data["budget_bytes"] / 2**20, color="grey", linestyle="--",
               label=f"budget (one-shot at {data['budget_at']} tokens)")
    ax.set_xlabel("scoring input (tokens)")
    ax.set_ylabel("memory the pass needs (MiB)")
    ax.set_title(f"Longest input on the budget: {data['longest_ratio']:.1f}x with chunking")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    parser.add_argument("--budget-at", type=int, default=1024, help="the one-shot forward's need at this T is the budget")
    parser.add_argument("--chunk", type=int, default=256, help="backend.mlp_chunk_tokens of the chunked mode")
    parser.add_argument("--quick", action="store_true", help="lengths 300 and 600 (the tests' smoke run)")
    parser.add_argument("--out", default=str(RESULTS / "max_input.json"))
    parser.add_argument("--point", help=argparse.SUPPRESS)  # T,chunk: measure one pass in this process
    args = parser.parse_args()
    if args.point:
        length, chunk = map(int, args.point.split(","))
        print(json.dumps(measure(length, chunk)))
        return
    lengths = list(QUICK_LENGTHS if args.quick else map(int, args.lengths.split(",")))
    budget_at = QUICK_LENGTHS[0] if args.quick else args.budget_at
    if budget_at not in lengths:
        parser.error(f"--budget-at {budget_at} must be one of the lengths")
    modes: dict[str, list[dict]] = {"one-shot": [], f"chunked ({args.chunk})": []}
    for length in lengths:
        for mode, chunk in zip(modes, (0, args.chunk)):
            row = run_point(length, chunk)
            modes[mode].append(row)
            print(f"T={length:5d} {mode:14s} needs {row['need_bytes'] / 2**20:7.1f} MiB "
                  f"(tensors {row['peak_bytes'] / 2**20:.1f}, scratch {row['scratch_bytes'] / 2**20:.1f}; "
                  f"resident growth {row['rss_growth_bytes'] / 2**20:.1f})", flush=True)
    one_shot, chunked = modes.values()
    budget = next(r["need_bytes"] for r in one_shot if r["tokens"] == budget_at)
    longest_one_shot, longest_chunked = longest(one_shot, budget), longest(chunked, budget)
    data = {
        "meta": {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "command": command_line(),
                 "quick": args.quick, "rounds": 1, "order": [list(modes)], "model": MODEL, "dtype": one_shot[0]["dtype"],
                 **machine_settings()},
        "chunk": args.chunk, "budget_at": budget_at, "budget_bytes": budget, "modes": modes,
        "context_length": one_shot[0]["context_length"],
        "longest": {"one-shot": longest_one_shot, "chunked": longest_chunked},
        "longest_ratio": longest_chunked / longest_one_shot,
        "bounded_by_context": longest_chunked == max(lengths) and max(lengths) >= one_shot[0]["context_length"],
        "identical_logprobs": all(a["logprobs"] == b["logprobs"] for a, b in zip(one_shot, chunked)),
    }
    write_results(args.out, data)
    plot(data, Path(args.out).with_suffix(".png"))


if __name__ == "__main__":
    main()
