"""Thread placement (issue 16 item 2): where the backend's OpenMP threads and the control
process run, measured end to end.

Each variant is one child process (`--variant NAME`): it starts a real `pie backend` with
the variant's environment, the runtime and control layer in itself with the variant's
niceness or CPU affinity, then times `text_completion` waves through Pie and the same
backend driven directly (benchmarks/overhead.py's harness: batch 8 and 32, 32 tokens, one
untimed warm-up of each path). Variants run in rotated order round after round, so none
is always first. Reported per variant and batch: Pie's and the direct driver's ms per
token (medians over rounds) and each against the default.

    python benchmarks/placement.py [--rounds 3] [--quick] [--out FILE]

Variants: `default` (torch threads = cores, libgomp's default wait policy: spin a while,
then sleep), `passive` (OMP_WAIT_POLICY=PASSIVE: sleep at once), `active`
(OMP_WAIT_POLICY=ACTIVE: always spin), `bind` (OMP_PROC_BIND=close, OMP_PLACES=cores),
`control-nice` (the control process at nice 10), `control-pinned` (the control process
on the last core only), `threads-1` (backend.threads = 1, a core left to the control).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script: the `benchmarks` package is in the repository root

from benchmarks.run_info import command_line, machine_settings, rotated, write_results

RESULTS = ROOT / "benchmarks" / "results"
VARIANTS: dict[str, dict] = {
    "default": {},
    "passive": {"env": {"OMP_WAIT_POLICY": "PASSIVE"}},
    "active": {"env": {"OMP_WAIT_POLICY": "ACTIVE"}},
    "bind": {"env": {"OMP_PROC_BIND": "close", "OMP_PLACES": "cores"}},
    "control-nice": {"nice": 10},
    "control-pinned": {"pin_last_core": True},
    "threads-1": {"backend_config": "[backend]\nthreads = 1\n"},
}


def measure(variant: str, batches: list[int], tokens: int, dtype: str) -> dict:
    """One round of one variant, in this (child) process."""
    from benchmarks.overhead import per_token
    from pie.backend.weights import resolve_model_dir
    from pie.config import load_config
    from pie.control.backend_link import BackendProcess
    from pie.control.direct import DirectDriver
    from pie.control.tokenizer import TextTokenizer
    from pie.runtime.runtime import start_runtime
    from pie.toolchain import build_inferlet

    spec = VARIANTS[variant]
    config = load_config()
    config.runtime.max_instances = 512
    config.backend.dtype = dtype
    model_dir = resolve_model_dir(config.model.path, config.paths.cache)
    builtins = {"text_completion": build_inferlet(ROOT / "inferlets" / "text_completion")}
    saved = dict(os.environ)
    os.environ.update(spec.get("env", {}))
    config_file = None
    if "backend_config" in spec:
        config_file = Path(tempfile.mkstemp(suffix=".toml")[1])
        config_file.write_text(spec["backend_config"])
    backend = BackendProcess(model_dir, str(config_file) if config_file else None, extra_args=["--dtype", dtype])
    os.environ.clear()
    os.environ.update(saved)
    if spec.get("nice"):
        os.nice(spec["nice"])
    if spec.get("pin_last_core"):
        os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})
    try:
        link, hs = backend.connect()
        runtime = start_runtime(config, [backend.endpoint], hs, builtins)
        driver, tokenizer = DirectDriver(link, hs), TextTokenizer(hs)
        rows = [per_token(runtime, driver, tokenizer, hs.chat_template, batch, tokens, 1) for batch in batches]
        runtime.shutdown()
        link.close()
    finally:
        backend.stop()
        if config_file:
            config_file.unlink()
    return {"variant": variant, "rows": [{k: row[k] for k in ("batch", "pie_ms_per_token", "direct_ms_per_token",
                                                            "mean_forward_batch")} for row in rows]}


def _model_name() -> str:
    from pie.backend.weights import resolve_model_dir
    from pie.config import load_config

    config = load_config()
    return resolve_model_dir(config.model.path, config.paths.cache).name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=None, help="rounds, each running every variant once (default 3; quick 2)")
    parser.add_argument("--quick", action="store_true", help="two variants, batch 1 and 2, 4 tokens")
    parser.add_argument("--out", default=str(RESULTS / "placement.json"), help="where the JSON goes")
    parser.add_argument("--variant", choices=list(VARIANTS), help=argparse.SUPPRESS)  # a child's one round
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                        help="default auto: Pie's choice for this CPU (pie/backend/dtype.py)")
    args = parser.parse_args()
    from pie.backend.dtype import resolve_dtype

    args.dtype = resolve_dtype(args.dtype, "cpu")
    batches, tokens = ([1, 2], 4) if args.quick else ([8, 32], 32)
    if args.variant:
        print(json.dumps(measure(args.variant, batches, tokens, args.dtype)))
        return
    rounds = args.rounds or (2 if args.quick else 3)
    names = ["default", "control-nice"] if args.quick else list(VARIANTS)
    order = [rotated(names, r) for r in range(rounds)]
    samples: dict[str, list[dict]] = {name: [] for name in names}
    for r, round_names in enumerate(order):
        for name in round_names:
            done = subprocess.run([sys.executable, __file__, "--variant", name, "--dtype", args.dtype]
                                  + (["--quick"] if args.quick else []),
                                  capture_output=True, text=True, check=False, timeout=1200)
            if done.returncode != 0:
                raise SystemExit(f"variant {name} failed:\n{done.stderr[-3000:]}")
            samples[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"round {r} {name}: " + ", ".join(
                f"B={row['batch']} pie {row['pie_ms_per_token']:.1f} direct {row['direct_ms_per_token']:.1f} ms/token"
                for row in samples[name][-1]["rows"]), flush=True)

    def median(name: str, batch: int, key: str) -> float:
        return statistics.median(next(row[key] for row in s["rows"] if row["batch"] == batch) for s in samples[name])

    rows = []
    for name in names:
        for batch in batches:
            pie, direct = median(name, batch, "pie_ms_per_token"), median(name, batch, "direct_ms_per_token")
            rows.append({"variant": name, "batch": batch, "pie_ms_per_token": pie, "direct_ms_per_token": direct,
                         "pie_over_default": pie / median("default", batch, "pie_ms_per_token"),
                         "direct_over_default": direct / median("default", batch, "direct_ms_per_token"),
                         "mean_forward_batch": median(name, batch, "mean_forward_batch")})
    results = {"rows": rows, "samples": samples, "variants": {n: VARIANTS[n] for n in names}, "meta": {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "command": command_line(),
        "quick": args.quick, "rounds": rounds, "order": order, "tokens": tokens, "dtype": args.dtype,
        "model": _model_name(), **machine_settings(),
        "method": "one child process per variant and round (its own backend), rotated order; medians over rounds"}}
    write_results(args.out, results)


if __name__ == "__main__":
    main()
