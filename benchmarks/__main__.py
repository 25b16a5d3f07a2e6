"""`python -m benchmarks`: Pie against vLLM, llama.cpp and SGLang, every figure in one run.

Starts the tool server and every available system (same weights, same dtype, loopback),
waits until each answers, runs the chosen workloads with the systems alternating round by
round, stops everything, and writes benchmarks/results/<workload>.json + .png and
benchmarks/RESULTS.md. A system that cannot run here is reported "not run" with the reason.

    python -m benchmarks                          # everything (about an hour here)
    python -m benchmarks --workloads completion --systems pie,llamacpp
    python -m benchmarks --quick --systems pie    # smoke run (seconds of model work)
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from rich.console import Console

from benchmarks import report
from benchmarks.systems import Pie, System, all_systems
from benchmarks.workloads import Bench, Result
from pie.backend.weights import DEFAULT_MODEL_NAME

HERE = Path(__file__).resolve().parent
# Batching last: it restarts Pie with other policies, and nothing after it needs the default back.
WORKLOADS = ("completion", "agents", "optimized_agent", "techniques", "models", "batching")


class ToolServer:
    """`python -m pie.tools` on a free loopback port, for the agents' external calls."""

    def __init__(self) -> None:
        self.process = subprocess.Popen([sys.executable, "-m", "pie.tools", "--port", "0"],
                                         stdout=subprocess.PIPE, text=True)
        assert self.process.stdout is not None
        match = re.search(r"(http://\S+)", self.process.stdout.readline())
        if match is None:
            raise RuntimeError(f"the tool server exited with {self.process.wait()}")
        self.url = match.group(1)

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(10)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[2:]))
    parser.add_argument("--systems", default="pie,vllm,llamacpp,sglang",
                        help="comma-separated: pie, vllm, llamacpp, sglang (default: all)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS),
                        help=f"comma-separated, from: {', '.join(WORKLOADS)} (default: all)")
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny sizes, one round")
    parser.add_argument("--rounds", type=int, help="alternating rounds per measurement (default 3; quick 1)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                        help="the dtype every system computes in (default bfloat16)")
    parser.add_argument("--out", type=Path, help="results folder (default benchmarks/results; "
                        "quick: benchmarks/results/quick)")
    parser.add_argument("--second-model", type=Path, help="a larger local HF Llama directory for Table 4")
    parser.add_argument("--list", action="store_true", help="say which systems can run here and exit")
    args = parser.parse_args(argv)
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    known = all_systems()
    for name in args.systems:
        if name not in known:
            parser.error(f"unknown system {name!r}; choose from {', '.join(known)}")
    for name in args.workloads:
        if name not in WORKLOADS:
            parser.error(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    if args.rounds is not None and args.rounds < 1:
        parser.error("--rounds must be at least 1")
    args.rounds = args.rounds or (1 if args.quick else 3)
    args.out = args.out or HERE / "results" / ("quick" if args.quick else "")
    return args


async def main_async(args: argparse.Namespace, console: Console) -> int:
    # Ctrl-C or SIGTERM cancels the run, and the `finally` below still stops every server
    # (they run in their own sessions, so no signal reaches them otherwise).
    main_task = asyncio.current_task()
    assert main_task is not None
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, main_task.cancel)
    systems = all_systems()
    chosen = {name: systems[name] for name in args.systems}
    not_run = {s.label: reason for s in chosen.values() if (reason := s.unavailable())}
    for label, reason in not_run.items():
        console.print(f"[yellow]–[/] {label}: {reason}")
    started: dict[str, System] = {}
    endpoints = {}
    log_dir = Path(tempfile.mkdtemp(prefix="pie-bench-"))
    tools = ToolServer()
    failures = 0
    clock = time.monotonic()
    try:
        for name, system in chosen.items():
            if system.label in not_run:
                continue
            with console.status(f"starting {system.label} (logs: {log_dir}/{name}.log) …"):
                begin = time.monotonic()
                try:
                    endpoints[name] = await system.start(args.dtype, log_dir)
                except Exception as e:  # a baseline that fails to start is reported, not fatal
                    not_run[system.label] = f"failed to start: {e}"
                    console.print(f"[red]✗[/] {system.label}: {e}")
                    continue
            started[name] = system
            console.print(f"[green]✓[/] {system.label} ready in {time.monotonic() - begin:.0f} s ({system.version()})")
        pie = started.get("pie")
        bench = Bench(pie=pie.client if isinstance(pie, Pie) else None, endpoints=endpoints,
                      tools_url=tools.url, quick=args.quick, rounds=args.rounds,
                      log=lambda line: console.print(f"[dim]{time.monotonic() - clock:7.1f}s[/] {line}"),
                      second_model=args.second_model)
        if isinstance(pie, Pie):
            async def restart_pie(extra_toml: str) -> None:
                bench.pie = await pie.restart(extra_toml)
                bench.endpoints["pie"] = pie.endpoint
                bench.programs.clear()
            bench.restart_pie = restart_pie
        info = report.run_info(args.quick, args.rounds, args.dtype, DEFAULT_MODEL_NAME,
                               {s.label: s.version() for s in started.values()}, not_run)
        for workload in args.workloads:
            console.rule(workload)
            if isinstance(pie, Pie) and pie.config:  # an earlier workload changed Pie's config
                with console.status("restarting Pie with the default configuration …"):
                    await bench.restart_pie("")
            module = importlib.import_module(f"benchmarks.workloads.{workload}")
            try:
                result: Result = await module.run(bench)
            except Exception:
                failures += 1
                console.print(f"[red]✗ {workload} failed[/]\n{traceback.format_exc()}")
                continue
            result.notes += [f"{label}: {reason}" for label, reason in not_run.items()]
            path = report.write_result(result, args.out, info)
            console.print(f"[green]✓[/] {workload}: {len(result.rows)} rows → {path}")
    finally:
        with console.status("stopping systems …"):
            for system in started.values():
                await system.stop()
            tools.stop()
    # The checked-in RESULTS.md belongs to the default results folder; any other gets its own.
    results_md = HERE / "RESULTS.md" if args.out.resolve() == (HERE / "results").resolve() else args.out / "RESULTS.md"
    report.render(args.out, results_md, WORKLOADS)
    console.print(f"wrote {results_md}")
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console(stderr=True)
    if args.list:
        for system in all_systems().values():
            console.print(f"{system.label:10} {system.unavailable() or 'can run'}")
        return 0
    try:
        return asyncio.run(main_async(args, console))
    except asyncio.CancelledError:
        console.print("[yellow]interrupted[/]: every server was stopped; results so far are on disk")
        return 130


if __name__ == "__main__":
    sys.exit(main())
