"""A second, larger model (paper Table 4): Pie's time per token and throughput on it.

Only local weights exist here (no model hub), and the only packaged model is the default
one, so this runs when `--second-model DIR` names a local HF Llama directory and is
otherwise reported "not run". Pie is restarted on that model; the baselines keep the
default model, so they are not compared here.
"""

from __future__ import annotations

import statistics

from benchmarks.workloads import Bench, Metric, Result, Row
from benchmarks.workloads.completion import wave


async def run(bench: Bench) -> Result:
    result = Result("models", "Table 4 — a second, larger model (Pie)",
                    [Metric("ms_per_token", "ms", False), Metric("tokens_per_s", "tok/s", True)])
    if bench.second_model is None:
        result.notes.append("not run: no second model is available locally (no model hub on this machine); "
                            "pass --second-model DIR (an HF Llama directory) to run it")
        return result
    if bench.restart_pie is None:
        result.notes.append("not run: Pie is not among the systems")
        return result
    levels, max_tokens = ((1, 2), 8) if bench.quick else ((1, 8), 64)
    result.settings = {"model": str(bench.second_model), "levels": list(levels), "max_tokens": max_tokens}
    bench.log(f"models: restarting Pie on {bench.second_model}")
    await bench.restart_pie(f'[model]\npath = "{bench.second_model}"\n')
    endpoint = bench.endpoints["pie"]
    for level in levels:
        ms, wall, tokens = zip(*[await wave(endpoint, level, max_tokens) for _ in range(bench.rounds)])
        result.rows.append(Row(f"{bench.second_model.name}, concurrency {level}", "pie",
                               {"ms_per_token": statistics.median(statistics.median(m) for m in ms),
                                "tokens_per_s": statistics.median(t / w for t, w in zip(tokens, wall))}))
    result.notes.append("baselines keep the default model: start them on the second model to compare")
    return result
