"""Workloads: each module measures one figure or table of the paper on every running system.

A workload is `async def run(bench: Bench) -> Result`. It reads the systems from `bench`,
runs Pie's side as inferlets (`bench.pie`, native launches) and the baselines' side as
client-side Python over their OpenAI API (`bench.endpoints`), and returns rows of medians.
`benchmarks.report` turns every Result into a JSON file, a table of ratios and a plot.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.endpoint import Endpoint
from pie.toolchain import build_inferlet

INFERLETS = Path(__file__).resolve().parents[2] / "inferlets"


@dataclass
class Metric:
    name: str  # key in Row.values, e.g. "ms_per_token"
    unit: str  # e.g. "ms", "tok/s", "agents/s"
    higher_is_better: bool


@dataclass
class Row:
    case: str  # e.g. "concurrency 8", "ReAct"
    system: str  # "pie", "vllm", "llamacpp", "sglang", or a variant such as "pie (client-side)"
    values: dict[str, float]  # metric name -> median
    extra: dict[str, Any] = field(default_factory=dict)  # samples, counts, notes


@dataclass
class Result:
    workload: str  # file stem: benchmarks/results/<workload>.json
    title: str  # e.g. "Fig. 6 — agents"
    metrics: list[Metric]
    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # shown under the table (what was not run, and why)
    settings: dict[str, Any] = field(default_factory=dict)
    # Keys of Row.extra tabulated under the metrics, per case and system: the work each system
    # did (generated tokens, tool calls, ...), so that "equal work" can be read off the table.
    counts: list[str] = field(default_factory=list)


@dataclass
class Launch:
    messages: list[str]
    seconds: float
    usage: dict[str, int]
    acked_s: float = 0.0  # from the call to the server's acknowledgement of the launch


@dataclass
class Bench:
    """What a workload may use. `pie` is a connected `pie.client.PieClient` (None when Pie is
    not among the systems); `endpoints` maps every running system's name to its OpenAI
    endpoint (Pie's `/v1` included, under "pie")."""

    pie: Any
    endpoints: dict[str, Endpoint]
    tools_url: str
    quick: bool
    rounds: int  # how many times to alternate systems; medians are over rounds
    log: Callable[[str], None]  # one progress line
    restart_pie: Callable[[str], Awaitable[Any]] | None = None  # TOML fragment -> new PieClient
    second_model: Path | None = None  # Table 4: a larger local HF Llama directory, if any
    programs: dict[str, str] = field(default_factory=dict)

    async def settle(self, idle: float = 0.9, timeout_s: float = 10.0) -> None:
        """Wait until the machine is quiet before timing the next system: engines keep their
        threads spinning for a while after a burst (OpenMP, busy polls), which measured
        llama.cpp at 16 ms/token alone but 19-32 ms right after another engine's wave."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            before = _cpu_times()
            await asyncio.sleep(0.3)
            after = _cpu_times()
            busy, total = after[0] - before[0], after[1] - before[1]
            if total > 0 and 1 - busy / total >= idle:
                return

    async def program(self, name: str) -> str:
        """The server-side name of `inferlets/<name>`: built (cargo, cached) and uploaded once."""
        if name not in self.programs:
            path = await asyncio.to_thread(build_inferlet, INFERLETS / name)
            self.programs[name] = await self.pie.upload(path.read_bytes())
        return self.programs[name]

    async def launch(self, name: str, args: list[str], replies: list[str] = ()) -> Launch:
        """Run `inferlets/<name>` on Pie to its end; raises if it does not finish."""
        program = await self.program(name)
        start = time.perf_counter()
        instance = await self.pie.launch(program, args)
        acked_s = time.perf_counter() - start
        for reply in replies:
            await instance.send(reply)
        messages = [m async for m in instance]
        status = await instance.wait()
        if status != "finished":
            raise RuntimeError(f"{name} {' '.join(args)[:200]}: {status}")
        return Launch(messages, time.perf_counter() - start, instance.usage or {}, acked_s)

    @property
    def baselines(self) -> dict[str, Endpoint]:
        return {name: e for name, e in self.endpoints.items() if name != "pie"}


def _cpu_times() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs since boot, from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)
