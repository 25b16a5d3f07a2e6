"""The backend in bf16 against fp32 on this CPU, alternating, in one run: what `backend.dtype =
auto` should pick here (pie/backend/dtype.py).

On a CPU with bf16 arithmetic bf16 is the model dtype; on one with AVX2 + FMA and no AVX-512,
bf16 means bf16 *weights* with fp32 arithmetic (csrc/bf16_gemv.cpp widens them for steps of
up to 32 tokens, an fp32 copy takes larger ones). Both dtypes run as real `pie backend`
processes side by side, driven as the control layer drives them (one fused `pass` request per
step, benchmarks/backend.py's `PieSide`); each measurement alternates them round by round.
Figures: a 512-token prefill's tokens/s, the decode step at batch 1, 8, 16, 24, 32 (context
128), each process's resident memory after loading, and the dtype `auto` picks here.

    python benchmarks/dtypes.py [--rounds 3] [--steps 6] [--quick] [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from functools import partial
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script: the `benchmarks` package is in the repository root

from benchmarks.backend import PieSide
from benchmarks.run_info import alternate, command_line, machine_settings, rotated, write_results
from pie.backend.dtype import resolve_dtype
from pie.backend.weights import DEFAULT_MODEL_NAME, resolve_model_dir
from pie.config import load_config
from pie.control.backend_link import BackendProcess

DTYPES = ("bfloat16", "float32")


def rss_mb(pid: int) -> int:
    """Resident memory of a process (MB), from /proc."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) // 1024
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=None, help="alternating rounds (default 3; quick 2)")
    parser.add_argument("--steps", type=int, default=None, help="decode steps timed per round (default 6; quick 2)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke run")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "dtypes.json"))
    args = parser.parse_args()
    rounds = args.rounds or (2 if args.quick else 3)
    steps = args.steps or (2 if args.quick else 6)
    batches, context, prefill = ((1, 2), 32, 64) if args.quick else ((1, 8, 16, 24, 32), 128, 512)

    config = load_config()
    model_dir = resolve_model_dir(config.model.path, config.paths.cache)
    settings = tempfile.NamedTemporaryFile("w", suffix=".toml", prefix="pie-bench-")
    settings.write("[backend]\n")
    settings.flush()
    processes = {d: BackendProcess(model_dir, settings.name, extra_args=["--dtype", d]) for d in DTYPES}
    order = [rotated(list(DTYPES), r) for r in range(rounds)]
    try:
        sides = {}
        for dtype, process in processes.items():
            link, hs = process.connect()
            sides[dtype] = PieSide(link, hs, steps=rounds * steps + 2)
        memory = {d: rss_mb(p.process.pid) for d, p in processes.items()}
        for side in sides.values():  # warm-up, untimed
            side.prefill(prefill)
        prefill_s = alternate(order, {d: partial(side.prefill, prefill) for d, side in sides.items()})
        prefill_tps = {d: prefill / statistics.median(v) for d, v in prefill_s.items()}
        print("prefill %d: " % prefill + "  ".join(f"{d} {v:.0f} tok/s" for d, v in prefill_tps.items()), flush=True)
        decode = []
        for batch in batches:
            for side in sides.values():
                side.prepare(batch, context)
                side.decode_step()  # warm-up, untimed
            step_s = alternate(order, {d: side.decode_step for d, side in sides.items()}, steps)
            ms = {d: 1e3 * statistics.median(v) for d, v in step_s.items()}
            decode.append({"batch": batch, "context": context, "steps": len(step_s["float32"]),
                           "bfloat16_step_ms": ms["bfloat16"], "float32_step_ms": ms["float32"],
                           "fp32_over_bf16_time": ms["float32"] / ms["bfloat16"],
                           "samples_ms": {d: [round(1e3 * s, 3) for s in v] for d, v in step_s.items()}})
            print(f"decode B={batch:2d} L={context}: bf16 {ms['bfloat16']:7.2f} ms  fp32 {ms['float32']:7.2f} ms  "
                  f"fp32/bf16 {ms['float32'] / ms['bfloat16']:.2f}x", flush=True)
    finally:
        for process in processes.values():
            process.stop()
    results = {
        "meta": {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "command": command_line(),
                 "quick": args.quick, "rounds": rounds, "order": order, "compared": list(DTYPES),
                 "dtype": resolve_dtype("auto", "cpu"),  # what backend.dtype = auto picks here
                 "model": DEFAULT_MODEL_NAME, **machine_settings()},
        "prefill": {"tokens": prefill, "bfloat16_tokens_per_s": prefill_tps["bfloat16"],
                    "float32_tokens_per_s": prefill_tps["float32"],
                    "bf16_over_fp32": prefill_tps["bfloat16"] / prefill_tps["float32"],
                    "samples_s": prefill_s},
        "memory_mb": memory,
        "decode": decode,
    }
    write_results(args.out, results)


if __name__ == "__main__":
    main()
