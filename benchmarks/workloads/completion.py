"""Text completion: time per output token and throughput at 1, 8 and 32 concurrent requests.

Every system, Pie included, gets the same raw-prompt `POST /v1/completions` requests with
`ignore_eos`, so each generates exactly `max_tokens` whatever its numerics; on Pie each
request is an `openai_completion` inferlet. Systems alternate wave by wave so the VM's
noise falls on all of them alike.
"""

from __future__ import annotations

import asyncio
import statistics
import time

from benchmarks.run_info import rotated
from benchmarks.workloads import Bench, Metric, Result, Row

PROMPT = "Write a short story about a robot learning to paint.\n"
# Waves per round at concurrency 1: one 64-token request is ~0.7 s, and single requests
# spread 9.5-15.7 ms per token for the same Pie in one run (Zen 5, 2026-12-03); five in a
# row give each round a median.
SOLO_WAVES = 5


async def wave(endpoint, concurrency: int, max_tokens: int) -> tuple[list[float], float, int]:
    """`concurrency` requests at once: per-request ms per token, wall seconds, tokens."""
    start = time.perf_counter()
    replies = await asyncio.gather(*(endpoint.complete(PROMPT, max_tokens, ignore_eos=True)
                                     for _ in range(concurrency)))
    wall = time.perf_counter() - start
    completions = [c for reply in replies for c in reply]
    tokens = sum(c.completion_tokens for c in completions)
    if tokens != concurrency * max_tokens:
        raise RuntimeError(f"{endpoint.engine} generated {tokens} tokens, expected {concurrency * max_tokens}")
    return [1000 * c.seconds / c.completion_tokens for c in completions], wall, tokens


async def run(bench: Bench) -> Result:
    levels = (1, 2) if bench.quick else (1, 8, 32)
    max_tokens = 8 if bench.quick else 64
    solo_waves = 1 if bench.quick else SOLO_WAVES
    result = Result("completion", "Text completion — time per output token and throughput",
                    [Metric("ms_per_token", "ms", False), Metric("tokens_per_s", "tok/s", True)],
                    settings={"levels": list(levels), "max_tokens": max_tokens, "prompt": PROMPT,
                              "rounds": bench.rounds, "ignore_eos": True,
                              "warmup": "a 4-token wave at every concurrency on every system",
                              "waves_per_round_at_1": solo_waves,
                              "order": "rotated each round"})
    # Warm-up, untimed: a short wave at every concurrency on every system (vLLM compiles per
    # batch shape; Pie grows its pools at the first wide batch).
    for endpoint in bench.endpoints.values():
        for level in levels:
            await wave(endpoint, level, 4)
    per_token: dict[tuple[int, str], list[float]] = {}
    throughput: dict[tuple[int, str], list[float]] = {}
    for r in range(bench.rounds):
        for level in levels:
            for name in rotated(list(bench.endpoints), r):  # no system always first
                endpoint = bench.endpoints[name]
                bench.log(f"completion: round {r + 1}/{bench.rounds}, {level} concurrent, {name}")
                await bench.settle()
                ms, wall, tokens = [], 0.0, 0
                for _ in range(solo_waves if level == 1 else 1):
                    wave_ms, wave_wall, wave_tokens = await wave(endpoint, level, max_tokens)
                    ms, wall, tokens = ms + wave_ms, wall + wave_wall, tokens + wave_tokens
                per_token.setdefault((level, name), []).append(statistics.median(ms))
                throughput.setdefault((level, name), []).append(tokens / wall)
    for (level, name), samples in per_token.items():
        result.rows.append(Row(f"concurrency {level}", name,
                               {"ms_per_token": statistics.median(samples),
                                "tokens_per_s": statistics.median(throughput[level, name])},
                               {"ms_per_token_rounds": samples, "tokens_per_s_rounds": throughput[level, name]}))
    result.notes.append("ms per token = request latency / generated tokens (prefill of the short prompt "
                        "included); tokens/s = all generated tokens / wall time of the wave.")
    return result
