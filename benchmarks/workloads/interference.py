"""A long prompt among decoders (issue 16, chunked prefill): do the decoders keep going?

16 clients stream 64 tokens each (128-token prompts, greedy, `ignore_eos`); as soon as
every one has its first token, one request with a 2,000-token prompt arrives. An engine
that prefills it whole stalls every decoder for the whole prefill (here about two seconds);
one that chunks it spreads the prefill over several steps and keeps each step short. The
bound the issue sets: the decoders' p99 gap between streamed tokens at most 3x their
median. Figures per system: median and p99 gap, their ratio, and the long request's time
to first token (what chunking costs it).

Pie runs at its default `control.max_step_tokens` and, restarted, at the values beside
it (`STEP_TOKENS`; 4096 = the backend's max_batch_tokens, i.e. no chunking), so the
figure shows what the setting buys. Systems (and Pie's settings) alternate round by round.
"""

from __future__ import annotations

import statistics

from benchmarks.run_info import rotated
from benchmarks.workloads import Bench, Metric, Result, Row
from benchmarks.workloads.serving import interference
from pie.config import ControlConfig

DECODERS, TOKENS, LONG_TOKENS = 16, 64, 2000
DEFAULT_STEP = ControlConfig().max_step_tokens
STEP_TOKENS = tuple(sorted({64, 128, DEFAULT_STEP, 4096}))  # Pie's settings measured (4096: never chunk)
BOUND = 3.0  # the issue's: p99 gap <= 3x the median gap

METRICS = [Metric("gap_median_ms", "ms", False), Metric("gap_p99_ms", "ms", False),
           Metric("gap_p99_over_median", "×", False),
           Metric("after_gap_median_ms", "ms", False), Metric("after_gap_p99_ms", "ms", False),
           Metric("after_gap_p99_over_median", "×", False), Metric("long_ttft_ms", "ms", False)]


def _variant(step: int) -> str:
    return "pie" if step == DEFAULT_STEP else f"pie (max_step_tokens {step})"


def _settings(step: int) -> str:
    """Pie's control section for `step` tokens a batch beside decoders; the caps that must be
    at least that large (the prompt batch, the latency batch) grow with it."""
    default = ControlConfig()
    return (f"[control]\nmax_step_tokens = {step}\n"
            f"prefill_batch_tokens = {max(step, default.prefill_batch_tokens)}\n"
            f"latency_batch_tokens = {max(step, default.latency_batch_tokens)}\n")


async def run(bench: Bench) -> Result:
    decoders, tokens, long_tokens = (2, 8, 300) if bench.quick else (DECODERS, TOKENS, LONG_TOKENS)
    steps = (DEFAULT_STEP,) if bench.quick else STEP_TOKENS
    result = Result("interference", "A long prompt among decoders — chunked prefill", METRICS, settings={
        "decoders": decoders, "decode_tokens": tokens, "decoder_prompt_tokens": 128,
        "long_prompt_tokens": long_tokens, "long_max_tokens": 1, "stream": True, "temperature": 0.0,
        "pie_max_step_tokens": list(steps), "rounds": bench.rounds, "order": "rotated each round",
        "bound": f"gap p99 <= {BOUND:g} x gap median"})
    systems = [_variant(s) for s in steps if bench.restart_pie is not None]
    systems += [name for name in bench.endpoints if name != "pie"]
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in systems}
    for r in range(bench.rounds):
        for name in rotated(systems, r):
            bench.log(f"interference: round {r + 1}/{bench.rounds}, {name}")
            if name.startswith("pie"):
                step = next(s for s in steps if _variant(s) == name)
                assert bench.restart_pie is not None
                await bench.restart_pie("" if step == DEFAULT_STEP else _settings(step))
            if not bench.quick:
                await bench.settle()
            samples[name].append(await interference(bench.endpoints["pie" if name.startswith("pie") else name],
                                                    f"round {r}", decoders, tokens, long_tokens))
    for name, runs in samples.items():
        values = {m.name: statistics.median(x[m.name] for x in runs) for m in METRICS}
        result.rows.append(Row("2,000-token prompt among 16 decoders" if not bench.quick else "quick",
                               name, values, {"rounds": runs}))
    result.notes.append(f"Gap = time between two streamed tokens of one decoder, over all {decoders} decoders' "
                        f"{tokens} tokens (after_*: the gaps that end after the long request was sent, the "
                        f"ones it can lengthen; all gaps also hold the decoders' own start); the long request "
                        f"asks for one token, its TTFT is send → that token. "
                        f"Pie's rows other than `pie` name their control.max_step_tokens (4096 = no chunking).")
    return result
