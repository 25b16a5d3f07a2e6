"""`python -m benchmarks`: every committed figure in one run, Pie's own and Pie vs the engines.

First Pie's own scripts, one after another with nothing else running (backend vs HF,
control-layer overhead, front ends, drain, soak; each starts its own server). Then the
harness starts the tool server and every available system (same weights, each in its
fastest dtype on this CPU unless --dtype names one; loopback), waits until each answers, runs the comparison workloads with the systems
alternating round by round, stops everything, and writes benchmarks/results/<name>.json
(+ .png), results/run.json (what ran, how long) and benchmarks/RESULTS.md. A system that
cannot run here is reported "not run" with the reason.

    python -m benchmarks                          # everything (about 1.5 h here)
    python -m benchmarks --workloads completion --systems pie,llamacpp
    python -m benchmarks --quick --systems pie    # smoke run (a few minutes)
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path

from rich.console import Console

from benchmarks import report, script_tables
from benchmarks.systems import Pie, System, all_systems
from benchmarks.workloads import Bench, Result
from pie.backend.weights import DEFAULT_MODEL_NAME

HERE = Path(__file__).resolve().parent
# Batching last: it restarts Pie with other policies, and nothing after it needs the default back.
WORKLOADS = ("completion", "serving", "interference", "agents", "optimized_agent", "techniques", "models", "batching")
# Pie's own scripts (benchmarks/<name>.py), run before any system starts: each brings up its
# own server, and a baseline idling beside it would skew its figures.
SCRIPTS = tuple(script_tables.SCRIPTS)


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
    parser.add_argument("--workloads", default=",".join(SCRIPTS + WORKLOADS),
                        help=f"comma-separated, from: {', '.join(SCRIPTS + WORKLOADS)} (default: all)")
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny sizes, one round")
    parser.add_argument("--rounds", type=int, help="alternating rounds per comparison measurement (default 3; quick 1; "
                        "each script keeps its own, at least 3)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                        help="the dtype every system runs in (default auto: each its fastest on this CPU: Pie's "
                             "choice, pie/backend/dtype.py, also for llama.cpp's GGUF; for vLLM and SGLang bf16 only "
                             "with bf16 arithmetic, else fp32)")
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
        if name not in SCRIPTS + WORKLOADS:
            parser.error(f"unknown workload {name!r}; choose from {', '.join(SCRIPTS + WORKLOADS)}")
    if args.rounds is not None and args.rounds < 1:
        parser.error("--rounds must be at least 1")
    args.rounds = args.rounds or (1 if args.quick else 3)
    args.out = args.out or HERE / "results" / ("quick" if args.quick else "")
    return args


async def run_script(name: str, args: argparse.Namespace, console: Console) -> bool:
    """`benchmarks/<name>.py` (quick when the run is), its JSON into the results folder."""
    argv = [sys.executable, str(HERE / f"{name}.py"), "--out", str(args.out / f"{name}.json")]
    argv += ["--quick"] if args.quick else []
    console.print(f"[dim]$ {' '.join(argv[1:])}[/]")
    process = await asyncio.create_subprocess_exec(*argv, cwd=HERE.parent, start_new_session=True)
    try:
        code = await process.wait()
    except asyncio.CancelledError:  # Ctrl-C: the script's own cleanup stops its server
        process.send_signal(signal.SIGINT)
        await process.wait()
        raise
    if code != 0:
        console.print(f"[red]✗ {name} exited with {code}[/]")
    return code == 0


async def main_async(args: argparse.Namespace, console: Console) -> int:
    # Ctrl-C or SIGTERM cancels the run, and the `finally` below still stops every server
    # (they run in their own sessions, so no signal reaches them otherwise).
    main_task = asyncio.current_task()
    assert main_task is not None
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, main_task.cancel)
    started_at, clock = datetime.now(timezone.utc), time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    failures = 0
    for name in (w for w in args.workloads if w in SCRIPTS):
        console.rule(name)
        failures += not await run_script(name, args, console)
    if any(w in WORKLOADS for w in args.workloads):
        failures += await compare(args, console, clock)
    finished_at = datetime.now(timezone.utc)
    (args.out / report.RUN).write_text(json.dumps({
        "command": " ".join(["python -m benchmarks", *sys.argv[1:]]), "workloads": args.workloads,
        "systems": args.systems, "started": started_at.isoformat(timespec="seconds"),
        "finished": finished_at.isoformat(timespec="seconds"),
        "duration_s": round(time.monotonic() - clock), "failures": failures}, indent=2) + "\n")
    # The checked-in RESULTS.md belongs to the default results folder; any other gets its own.
    results_md = HERE / "RESULTS.md" if args.out.resolve() == (HERE / "results").resolve() else args.out / "RESULTS.md"
    report.render(args.out, results_md, WORKLOADS)
    console.print(f"wrote {results_md}")
    return 1 if failures else 0


async def compare(args: argparse.Namespace, console: Console, clock: float) -> int:
    """The comparison workloads on every chosen system; how many workloads failed."""
    failures = 0
    systems = all_systems()
    chosen = {name: systems[name] for name in args.systems}
    dtypes = {name: system.dtype_for(args.dtype) for name, system in chosen.items()}
    not_run = {s.label: reason for s in chosen.values() if (reason := s.unavailable())}
    for label, reason in not_run.items():
        console.print(f"[yellow]–[/] {label}: {reason}")
    started: dict[str, System] = {}
    endpoints = {}
    log_dir = Path(tempfile.mkdtemp(prefix="pie-bench-"))
    tools = ToolServer()
    try:
        for name, system in chosen.items():
            if system.label in not_run:
                continue
            with console.status(f"starting {system.label} (logs: {log_dir}/{name}.log) …"):
                begin = time.monotonic()
                try:
                    endpoints[name] = await system.start(dtypes[name], log_dir)
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
        ran = {started[name].label: dtypes[name] for name in started}
        dtype = (next(iter(ran.values())) if len(set(ran.values())) == 1
                 else ", ".join(f"{label} {d}" for label, d in ran.items()))
        info = report.run_info(args.quick, args.rounds, dtype, DEFAULT_MODEL_NAME,
                               {s.label: s.version() for s in started.values()}, not_run,
                               {s.label: s.settings(dtypes[name]) for name, s in started.items()})
        for workload in (w for w in args.workloads if w in WORKLOADS):
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
    return failures


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
