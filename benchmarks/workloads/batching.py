"""Batching policies (paper Table 5): adaptive, eager, k and t at 128 concurrent inferlets.

Pie alone: the server is restarted with each `control.scheduler` policy and 128
`openai_completion` inferlets are launched at once, each generating exactly N tokens
(`--ignore-eos`). Eager dispatches every call the moment it arrives, so the backend runs
many tiny batches; adaptive batches whatever queued while the backend was busy.
"""

from __future__ import annotations

import asyncio
import statistics
import time

from benchmarks.run_info import rotated
from benchmarks.workloads import Bench, Metric, Result, Row
from benchmarks.workloads.completion import PROMPT

POLICIES = ("adaptive", "eager", "k", "t")
BATCH_K, BATCH_T_MS = 8, 10.0


async def one_policy(bench: Bench, inferlets: int, max_tokens: int) -> tuple[float, float, float]:
    """Launch `inferlets` at once; (generated tokens per second, median latency in s, the
    last launch's acknowledgement in s: how long the wave took to start)."""
    args = ["--prompt", PROMPT, "--max-tokens", str(max_tokens), "--ignore-eos"]
    start = time.perf_counter()
    runs = await asyncio.gather(*(bench.launch("openai_completion", args) for _ in range(inferlets)))
    wall = time.perf_counter() - start
    return (inferlets * max_tokens / wall, statistics.median(run.seconds for run in runs),
            max(run.acked_s for run in runs))


async def run(bench: Bench) -> Result:
    inferlets = 4 if bench.quick else 128
    max_tokens = 4 if bench.quick else 32
    result = Result("batching", f"Table 5 — batching policies at {inferlets} concurrent inferlets",
                    [Metric("tokens_per_s", "tok/s", True), Metric("latency_s", "s", False)],
                    settings={"inferlets": inferlets, "max_tokens": max_tokens, "rounds": bench.rounds,
                              "batch_k": BATCH_K, "batch_t_ms": BATCH_T_MS})
    if bench.pie is None or bench.restart_pie is None:
        result.notes.append("not run: Pie is not among the systems")
        return result
    policies = POLICIES[:2] if bench.quick else POLICIES  # each policy costs a server restart
    samples: dict[str, list[tuple[float, float, float]]] = {p: [] for p in policies}
    for r in range(bench.rounds):
        for policy in rotated(list(policies), r):  # no policy always first
            bench.log(f"batching: round {r + 1}/{bench.rounds}, policy {policy}")
            await bench.restart_pie("" if policy == "adaptive" else  # adaptive is the default
                                    f'[control]\nscheduler = "{policy}"\nbatch_k = {BATCH_K}\nbatch_t_ms = {BATCH_T_MS}\n')
            await bench.launch("openai_completion", ["--prompt", PROMPT, "--max-tokens", "2"])  # warm-up
            await bench.settle()
            samples[policy].append(await one_policy(bench, inferlets, max_tokens))
    for policy, runs in samples.items():
        result.rows.append(Row(policy, "pie", {"tokens_per_s": statistics.median(t for t, _, _ in runs),
                                               "latency_s": statistics.median(lat for _, lat, _ in runs)},
                               {"rounds": runs, "last_launch_acked_s": statistics.median(a for _, _, a in runs)}))
    result.notes.append(f"k = dispatch when {BATCH_K} calls are queued; t = dispatch every {BATCH_T_MS:g} ms.")
    result.notes.append("rounds: (tokens/s, median latency s, last launch acknowledged after s) per round; "
                        "last_launch_acked_s: their median, how long the server took to start the wave.")
    return result
