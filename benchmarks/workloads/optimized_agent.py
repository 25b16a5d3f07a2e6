"""Fig. 7 — an agent's API-call optimizations, stacked, on Pie vs the naive agent client-side.

Why: much of an agent's time goes to API plumbing, not reasoning, and the paper shows three
application-specific fixes an inferlet can make that a client of a serving API cannot:
(1) keep the API docs' KV cache across launches (`--opt-export`), (2) issue each API call as
soon as it is decoded, while the rest of the line still decodes (`--opt-early-call`), and
(3) mask the single-use API's spec out of attention once it was used and free its pages
(`--opt-mask`). Pie runs `inferlets/agent_optimized` with none, 1, 1+2 and 1+2+3; every other
system (each baseline, and "pie (client-side)": Pie's own `/v1`) runs `naive` below, the
inferlet's application without the optimizations: the same conversation (docs system turn;
spec and task user turn), the same `Action: api(` lines with their token limit and stop, the
same fallback arguments when the model does not close a call, the same tool calls (search
first, then calc) made after each line, and the whole prompt re-sent for every line.

Systems: "pie" is all three optimizations, so the report's ratios against "pie" are the
figure's speedups over the naive baselines; "pie (no opt)", "pie (+1)" and "pie (+1+2)" are
the steps in between. The docs export is made by one untimed launch before the first round
(later launches import it, as in a long-running deployment) and removed at the end; the
baselines' own prefix caches see the same docs prefix in every request.

Every API call takes `api_latency_ms` (the tool server's `?latency_ms=`, on Pie and client-side
alike), as a remote API would: local tools answer in about a millisecond, which would leave
optimization 2 no call latency to hide.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial

import httpx

from benchmarks.workloads import Bench, Result
from benchmarks.workloads.agents import (
    COUNTS,
    METRICS,
    Agent,
    Case,
    Model,
    Tools,
    arithmetic,
    chat_prompt,
    compare,
    inferlet_agent,
    observation,
    systems,
)

# The inferlet's prompts, verbatim (inferlets/agent_optimized/src/lib.rs).
DOCS = (
    "You are an agent that solves tasks by calling APIs. Write one call per line "
    "as `Action: api(arguments)  # comment`; the result comes back as `Observation: ...`.\n\n"
    "API calc(expression): evaluates an arithmetic expression and returns the number.\n"
    "Operators: + - * / // % ** and parentheses; functions: sqrt, sin, cos, tan, log, log10, exp, "
    "abs, floor, ceil; constants: pi, e. Integers are exact.\n"
    "Examples:\nAction: calc(6 * 7)  # multiply\nObservation: 42\n"
    "Action: calc((12 + 8) / 4)  # average of a sum\nObservation: 5.0\n"
    "Action: calc(2 ** 10)  # a power of two\nObservation: 1024\n"
    "Action: calc(sqrt(16) + 1)  # square root\nObservation: 5.0\n"
    "Errors come back as `Observation: error: ...`; fix the expression and call again.")
SPEC = (
    "One-time API search(query): looks up a fact in an encyclopedia of science "
    "and geography and returns the best matching sentence. Call it once, first, with a few keywords.\n"
    "Example:\nAction: search(boiling point of water)  # look up the fact\n"
    "Observation: Water boils at 100 degrees Celsius at sea level.\n")

TASKS = [
    "Find the atomic number of carbon, then multiply it by 7.",
    "Find how many bones an adult human has, then compute 206 * 2.",
    "Find the speed of sound in air, then compute 343 * 3.",
    "Find the height of Mount Everest, then compute 8849 / 1000.",
    "Find the atomic number of iron, then compute 26 + 79.",
    "Find the length of the Nile, then compute 6650 / 2.",
    "Find the distance to the Moon, then compute 384400 * 2.",
    "Find the boiling point of water, then compute 100 * 9 / 5 + 32.",
]
CONFIGS = {  # system -> the inferlet's switches
    "pie (no opt)": [],
    "pie (+1)": ["--opt-export"],
    "pie (+1+2)": ["--opt-export", "--opt-early-call"],
    "pie": ["--opt-export", "--opt-early-call", "--opt-mask"],
}
EXPORT = "benchmarks.optimized_agent.docs"


@dataclass(frozen=True)
class Settings:
    agents: int  # per round and system
    concurrency: int
    calls: int  # API calls per agent
    max_tokens: int  # per line
    api_latency_ms: int  # every API call's latency


FULL = Settings(agents=16, concurrency=8, calls=8, max_tokens=12, api_latency_ms=200)
QUICK = Settings(agents=1, concurrency=1, calls=2, max_tokens=6, api_latency_ms=10)


def call_args(text: str) -> str | None:
    """The arguments of a call whose `(` precedes `text`, if its closing `)` was decoded."""
    depth = 1
    for i, c in enumerate(text):
        depth += {"(": 1, ")": -1}.get(c, 0)
        if c == "\n":
            return None
        if depth == 0:
            return text[:i].strip() or None
    return None


def scripted_args(api: str, task: str) -> str:
    """Fallback arguments: the task's arithmetic for calc, the task itself for search."""
    if api == "calc":
        return arithmetic(task) or "0"
    return task.rstrip(".?")


async def naive(model: Model, tools: Tools, task: str, calls: int, latency_ms: int) -> Agent:
    start = time.perf_counter()
    prompt, scripted = chat_prompt(("system", DOCS), ("user", f"{SPEC}\nTask: {task}")), 0
    for step in range(calls):
        api = "search" if step == 0 else "calc"
        prompt += f"Action: {api}("
        text = (await model.line(prompt)).text
        if (args := call_args(text)) is not None:
            prompt += text
        else:
            args = scripted_args(api, task)
            prompt, scripted = prompt + f"{args})", scripted + 1
        body = await (tools.call("search", latency_ms, query=args, k=1) if api == "search"
                      else tools.call("calculator", latency_ms, expression=args))  # after the line, not during it
        prompt += f"\nObservation: {observation(body, 'text' if api == 'search' else 'result', 'error: ')}\n"
    prompt += "Final Answer:"
    prompt += (await model.line(prompt)).text
    return Agent(time.perf_counter() - start, len(prompt), scripted, model.tokens)


async def optimized(bench: Bench, s: Settings, flags: list[str], i: int) -> Agent:
    return await inferlet_agent(bench, "agent_optimized", [
        "--tools-url", bench.tools_url, "--task", TASKS[i % len(TASKS)], "--calls", str(s.calls),
        "--max-tokens", str(s.max_tokens), "--export-name", EXPORT, "--api-latency-ms", str(s.api_latency_ms),
        *flags], scripted=lambda report: sum(c["source"] == "scripted" for c in report["calls"]))


async def run(bench: Bench) -> Result:
    s = QUICK if bench.quick else FULL
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(keepalive_expiry=1.0)) as http:  # see Endpoint
        tools = Tools(bench.tools_url.rstrip("/"), http)
        pie = {name: partial(optimized, bench, s, flags) for name, flags in CONFIGS.items()}
        case = Case(f"{s.calls} API calls", s.agents, s.concurrency, systems(bench, pie, lambda e, i:
                    naive(Model(e, s.max_tokens), tools, TASKS[i % len(TASKS)], s.calls, s.api_latency_ms)))
        if bench.pie is None:
            rows = await compare(bench, tools, [case])
        else:  # the docs export, made once (untimed) and removed at the end
            await bench.launch("agent_optimized", ["--tools-url", bench.tools_url, "--task", TASKS[0],
                                                   "--calls", "0", "--max-tokens", "1", "--export-name", EXPORT,
                                                   "--opt-export"])
            try:
                rows = await compare(bench, tools, [case])
            finally:
                await bench.launch("agent_optimized", ["--unexport", "--export-name", EXPORT])
    return Result(
        workload="optimized_agent",
        title=f"Fig. 7 — agent API-call optimizations ({s.calls} calls per agent, {s.concurrency} agents at once)",
        metrics=METRICS,
        rows=rows,
        notes=[
            ("pie = agent_optimized with all three optimizations (1 export the API docs, 2 call early, "
             "3 mask the one-time spec); pie (no opt), (+1), (+1+2) the steps in between."),
            ("Every other system runs the naive agent client-side over /v1/completions: same prompts, "
             "lines, fallback and tool calls, each call after its line, the whole prompt re-sent per line."),
            "The docs export is made by one untimed launch before the first round (later launches import it).",
            f"Every API call answers after {s.api_latency_ms} ms (a remote API's latency), on every system.",
        ],
        settings={"quick": bench.quick, "rounds": bench.rounds, "export_name": EXPORT,
                  "warmup_agents": 0 if bench.quick else "concurrency", **vars(s)},
        counts=COUNTS,
    )
