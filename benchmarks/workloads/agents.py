"""Fig. 6 — agents: ReAct, CodeAct and Swarm on Pie as inferlets vs the same agents client-side.

Why: an agent alternates model calls with external calls. Behind an OpenAI API each model
call is a request that re-sends the whole conversation, and each tool call is a round trip
through the client; on Pie the agent is an inferlet that calls the tools itself and keeps one
KV cache across its steps. To measure only that, every system runs the *same* application:

* "pie" runs `inferlets/agent_react`, `agent_codeact` and `agent_swarm` natively;
* every other system (each baseline, and "pie (client-side)": Pie's own `/v1`) runs the
  Python twins below: the same prompt text (rendered with the model's chat template), the
  same per-line token limit and stops, the same parse-or-scripted-fallback rule, the same
  tool calls over HTTP to the tool server, each observation appended to the prompt, and the
  whole prompt re-sent for the next line, as an OpenAI client must.

ReAct: per step a `Thought:` line and an `Action: tool[input]` line (calculator or search; an
unparsable action is replaced by the scripted one), one tool call, then a `Final Answer:`
line. CodeAct: per step a `Code:` line (or the scripted `print(sum(range(10)))`) run by the
tool server's `execute`. Full runs take 8 steps: 8 external calls per agent.
Swarm: one agent is a coordinator and W workers (full: 32). The coordinator hands each worker
one task and collects the answers, so its 32 external calls are 32 task messages (and 32
answers back). On Pie, the workers and the coordinator are separate `agent_swarm` instances
talking over the server's broadcast/subscribe bus; an agent runs from its first worker's
launch to the coordinator's report. Client-side, the coordinator is a coroutine handing the
tasks to W worker coroutines, each one chat completion with the worker's token limit that
ends at the end-of-sequence token as the worker does.

C agents run at once (closed loop: the next starts when one ends). Latency is per agent;
throughput is agents / wall time of the batch. Every round runs every system, in an order
rotated per round so the machine's noise hits all alike; rows are medians.

Comparable work: greedy text differs between engines (dtype, kernels), and so do the line
lengths. The token limits are small, and the fallback keeps the plan (and the tool calls)
whatever the model writes. Lines end where the inferlets end them: at a stop, the token limit
or the end-of-sequence token. (`ignore_eos` would not equalize anything: the inferlets stop at
EOS, which the model does emit after a `Code:` line, so the client would decode more than the
inferlet, and the EOS text would land in the line.) On Pie's own endpoint the client-side twin
builds exactly the inferlet's context. Row.extra shows the work per agent: the tool calls the
tool server received (GET /stats), the steps the fallback wrote, the characters of the final
context (Swarm: of the answers), and the tokens the engine processed (Pie: forwarded;
client-side: prompt tokens sent and tokens generated).
"""

from __future__ import annotations

import asyncio
import json
import re
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import cache, partial
from typing import Any

import httpx

from benchmarks.baselines.model import pie_model_dir
from benchmarks.endpoint import Completion, Endpoint
from benchmarks.workloads import Bench, Metric, Result, Row
from pie.control.chat_template import render_chat

# The inferlets' prompts, verbatim (inferlets/agent_react and agent_codeact, src/lib.rs).
REACT_PROMPT = (
    "Answer the question with tools.\nTools:\n"
    "calculator[expression]: evaluates arithmetic, e.g. calculator[2 * (3 + 4)]\n"
    "search[query]: looks up a fact, e.g. search[capital of Japan]\n"
    "Example:\nQuestion: What is 6 * 7?\nThought: I need to multiply 6 by 7.\nAction: calculator[6 * 7]\n"
    "Observation: 42\nFinal Answer: 42\n\nQuestion: ")
CODEACT_PROMPT = (
    "Solve the task by writing Python. Each step, write one line of Python "
    'that prints a result after "Code:"; you will see what it prints after "Output:".\n'
    "Example:\nTask: What is 6 * 7?\nCode: print(6 * 7)\nOutput: 42\n\nTask: ")
CODEACT_FALLBACK = "print(sum(range(10)))"  # agent_codeact's default --fallback

QUESTIONS = [
    "What is the capital of France? Then compute 17 * 23.",
    "What is the atomic number of gold? Then compute 79 * 3.",
    "How many bones does an adult human have? Then compute 206 / 2.",
    "How fast is sound in air? Then compute 343 * 60.",
    "How high is Mount Everest? Then compute 8849 - 8000.",
    "What is the speed of light? Then compute 299792458 / 1000.",
    "How long is the Nile? Then compute 6650 / 2.",
    "What is the boiling point of water? Then compute 100 * 9 / 5 + 32.",
]
CODE_TASKS = [
    "Print the sum of the numbers from 1 to 100.",
    "Print 2 to the power 20.",
    "Print the number of hours in 7 days.",
    "Print the square of 123.",
    "Print the number of seconds in a day.",
    "Print 17 factorial.",
    "Print the average of 3, 8 and 13.",
    "Print 1000 divided by 8.",
]
SWARM_TASKS = [
    "What is the capital of France?", "Name three colors.", "What is 2 + 2?", "Name a planet.",
    "What color is the sky?", "Name the largest ocean.", "What do bees make?", "Name a fruit.",
]


@dataclass(frozen=True)
class Settings:
    agents: int  # per round, per case and system
    concurrency: int
    steps: int  # ReAct and CodeAct: tool calls per agent
    react_tokens: int  # per line
    codeact_tokens: int
    workers: int  # Swarm: task messages per agent
    worker_tokens: int
    swarm_agents: int
    swarm_concurrency: int  # C × (W + 1) instances must fit runtime.max_instances (256)


FULL = Settings(agents=16, concurrency=8, steps=8, react_tokens=16, codeact_tokens=24,
                workers=32, worker_tokens=16, swarm_agents=8, swarm_concurrency=4)
QUICK = Settings(agents=1, concurrency=1, steps=2, react_tokens=6, codeact_tokens=8,
                 workers=2, worker_tokens=6, swarm_agents=1, swarm_concurrency=1)


METRICS = [Metric("latency_s", "s", False), Metric("agents_per_s", "agents/s", True)]
# The work behind each row, tabulated in RESULTS.md: the same tool calls and (nearly) the same
# final context on every system; tokens as each engine counts them (Pie: forwarded).
COUNTS = ["tool_calls_per_agent", "scripted_steps_per_agent", "chars_per_agent", "generated_tokens_per_agent",
          "forward_tokens_per_agent"]


@dataclass
class Agent:
    """One agent's run."""

    seconds: float
    chars: int  # characters of its final context (Swarm: of its answers): engine-independent
    scripted: int = 0  # steps the fallback wrote
    tokens: dict[str, int] = field(default_factory=dict)  # what the engine processed


# --- what every client-side agent shares ------------------------------------------------------


@cache
def chat_template() -> str:
    """The template of Pie's model directory, whose weights and tokenizer every system serves."""
    return json.loads((pie_model_dir() / "tokenizer_config.json").read_text())["chat_template"]


def chat_prompt(*turns: tuple[str, str], generation: bool = True) -> str:
    """`apply_chat_template` as the inferlets' `fill_chat` renders it: (role, content) turns."""
    return render_chat(chat_template(), [{"role": r, "content": c} for r, c in turns], generation)


@dataclass
class Model:
    """A client-side agent's model: greedy lines, each a completion of the whole prompt."""

    endpoint: Endpoint
    max_tokens: int
    tokens: dict[str, int] = field(default_factory=lambda: {"prompt": 0, "generated": 0})

    async def line(self, prompt: str, stops: tuple[str, ...] = ("\n",)) -> Completion:
        [c] = await self.endpoint.complete(prompt, self.max_tokens, stop=list(stops))
        self.tokens["prompt"] += c.prompt_tokens
        self.tokens["generated"] += c.completion_tokens
        return c


@dataclass
class Tools:
    """The tool server, called from the client as the inferlets call it from the server."""

    url: str
    http: httpx.AsyncClient

    async def call(self, tool: str, latency_ms: int = 0, **arguments: Any) -> dict[str, Any]:
        """`latency_ms`: the tool server answers that much later, as a remote API would."""
        # A refused call (400) answers {"error": ...}, which the agents show to the model.
        query = f"?latency_ms={latency_ms}" if latency_ms else ""
        return (await self.http.post(f"{self.url}/tools/{tool}{query}", json=arguments)).json()

    async def calls(self) -> int:
        """Requests the tool server has received so far (all tools)."""
        return sum((await self.http.get(f"{self.url}/stats")).json()["calls"].values())


def arithmetic(text: str) -> str | None:
    """The inferlets' fallback arithmetic: the first run of digits, operators, parentheses,
    dots and spaces with a digit and an operator in it."""
    for run in re.split(r"[^0-9+\-*/(). ]", text):
        run = run.strip().rstrip(".")
        if re.search(r"\d", run) and re.search(r"[+\-*/]", run):
            return run
    return None


def observation(body: dict[str, Any], key: str, error: str = "") -> str:
    """What the inferlets read from a tool's answer: the error, else `key` (a search's first
    hit for "text"), else "no result"; at most 200 characters."""
    if "error" in body:
        value = f"{error}{body['error']}"
    elif key == "text":
        value = body["results"][0]["text"] if body.get("results") else "no result"
    else:
        value = str(body.get(key, "no result"))
    return value[:200]


# --- ReAct --------------------------------------------------------------------------------------


def parse_action(text: str) -> tuple[str, str] | None:
    """`tool[input]` with a known tool and a non-empty input."""
    name, bracket, rest = text.partition("[")
    argument, closed, _ = rest.partition("]")
    tool = name.strip().lower()
    if bracket and closed and argument.strip() and tool in ("calculator", "search"):
        return tool, argument.strip()
    return None


def scripted_action(step: int, question: str) -> tuple[str, str]:
    """The question's arithmetic on even steps (if it has any), a search for it otherwise."""
    math = arithmetic(question)
    return ("calculator", math) if math and step % 2 == 0 else ("search", question)


async def react_client(model: Model, tools: Tools, question: str, steps: int) -> Agent:
    start = time.perf_counter()
    prompt, scripted = chat_prompt(("user", REACT_PROMPT + question)), 0
    for step in range(steps):
        prompt += "Thought:"
        prompt += (await model.line(prompt)).text + "\nAction:"
        action = await model.line(prompt, ("\n", "]"))
        # The API drops the matched stop without naming it; the inferlet keeps a `]`: an open `[`
        # is taken to mean the stop was `]` (a newline inside `tool[...` would be misread).
        text = action.text + ("]" if action.finish_reason == "stop" and "[" in action.text else "")
        if parsed := parse_action(text):
            (tool, argument), prompt = parsed, prompt + text
        else:
            tool, argument = scripted_action(step, question)
            prompt, scripted = prompt + f" {tool}[{argument}]", scripted + 1
        body = await (tools.call("calculator", expression=argument) if tool == "calculator"
                      else tools.call("search", query=argument, k=1))
        prompt += f"\nObservation: {observation(body, 'result' if tool == 'calculator' else 'text')}\n"
    prompt += "Final Answer:"
    prompt += (await model.line(prompt)).text
    return Agent(time.perf_counter() - start, len(prompt), scripted, model.tokens)


async def inferlet_agent(bench: Bench, name: str, args: list[str],
                         scripted: Callable[[dict[str, Any]], int] = lambda report: report["scripted"]) -> Agent:
    """Runs an agent inferlet on Pie; the Agent from its one JSON report."""
    launch = await bench.launch(name, args)
    report = json.loads(launch.messages[0])
    return Agent(launch.seconds, len(report["context"]), scripted(report),
                 {"forward": launch.usage.get("forward_tokens", 0)})


async def react_pie(bench: Bench, s: Settings, i: int) -> Agent:
    return await inferlet_agent(bench, "agent_react", [
        "--tools-url", bench.tools_url, "--question", QUESTIONS[i % len(QUESTIONS)],
        "--steps", str(s.steps), "--max-tokens", str(s.react_tokens)])


# --- CodeAct ------------------------------------------------------------------------------------


def plausible_python(line: str) -> bool:
    """One line that prints something, with balanced parentheses and no markdown fence."""
    depth = 0
    for c in line:
        depth += {"(": 1, ")": -1}.get(c, 0)
        if depth < 0:
            return False
    return depth == 0 and "print(" in line and "```" not in line


def codeact_output(body: dict[str, Any]) -> str:
    if "error" in body:
        output = f"Error: {body['error']}"
    elif body["exit_code"] == 0:
        output = body["stdout"].rstrip()
    else:
        output = "Error: " + (body["stderr"].rstrip().splitlines() or [""])[-1]
    return output[:200]


async def codeact_client(model: Model, tools: Tools, task: str, steps: int) -> Agent:
    start = time.perf_counter()
    prompt, scripted = chat_prompt(("user", CODEACT_PROMPT + task)), 0
    for _ in range(steps):
        prompt += "Code:"
        text = (await model.line(prompt)).text
        if plausible_python(text):
            code, prompt = text.strip(), prompt + text
        else:
            code, prompt, scripted = CODEACT_FALLBACK, prompt + f" {CODEACT_FALLBACK}", scripted + 1
        prompt += f"\nOutput: {codeact_output(await tools.call('execute', code=code))}\n"
    return Agent(time.perf_counter() - start, len(prompt), scripted, model.tokens)


async def codeact_pie(bench: Bench, s: Settings, i: int) -> Agent:
    return await inferlet_agent(bench, "agent_codeact", [
        "--tools-url", bench.tools_url, "--task", CODE_TASKS[i % len(CODE_TASKS)],
        "--steps", str(s.steps), "--max-tokens", str(s.codeact_tokens)])


# --- Swarm --------------------------------------------------------------------------------------


def swarm_tasks(s: Settings, i: int) -> list[str]:
    return [SWARM_TASKS[(i + w) % len(SWARM_TASKS)] for w in range(s.workers)]


async def swarm_client(endpoint: Endpoint, s: Settings, i: int) -> Agent:
    start = time.perf_counter()

    async def worker(task: str) -> Completion:
        [c] = await endpoint.complete(chat_prompt(("user", task)), s.worker_tokens)
        return c

    answers = await asyncio.gather(*(worker(task) for task in swarm_tasks(s, i)))
    return Agent(time.perf_counter() - start, sum(len(c.text) for c in answers), 0,
                 {"prompt": sum(c.prompt_tokens for c in answers),
                  "generated": sum(c.completion_tokens for c in answers)})


async def swarm_pie(bench: Bench, s: Settings, i: int) -> Agent:
    program = await bench.program("agent_swarm")
    topic = f"bench-swarm-{uuid.uuid4().hex}"
    start = time.perf_counter()
    workers = await asyncio.gather(*(bench.pie.launch(program, [
        "--role", "worker", "--id", f"w{w}", "--topic", topic, "--max-tokens", str(s.worker_tokens)])
        for w in range(s.workers)))
    for worker in workers:  # each listens before any task is sent
        if getattr(await worker.recv(), "text", None) != "subscribed":
            raise RuntimeError(f"agent_swarm worker: {await worker.wait()}")
    tasks = [arg for w, task in enumerate(swarm_tasks(s, i)) for arg in ("--task", f"w{w}={task}")]
    coordinator = await bench.pie.launch(program, ["--role", "coordinator", "--topic", topic, *tasks])
    messages = [m async for m in coordinator]
    ends = await asyncio.gather(*(x.wait() for x in (coordinator, *workers)))
    seconds = time.perf_counter() - start
    if set(ends) != {"finished"}:
        raise RuntimeError(f"agent_swarm: {sorted(set(ends))}")
    answers = [r["answer"] for r in json.loads(messages[0])["results"]]
    return Agent(seconds, sum(map(len, answers)), 0,
                 {"forward": sum(w.usage.get("forward_tokens", 0) for w in workers)})


# --- running ------------------------------------------------------------------------------------

Run = Callable[[int], Awaitable[Agent]]  # agent index -> that agent's run


@dataclass
class Case:
    name: str
    agents: int  # per round and system
    concurrency: int
    systems: dict[str, Run]


def systems(bench: Bench, pie: dict[str, Run], client: Callable[[Endpoint, int], Awaitable[Agent]]) -> dict[str, Run]:
    """`pie` (the inferlet runs, if Pie is running), then the client-side twin on Pie's own
    endpoint as "pie (client-side)" and on every baseline."""
    out = dict(pie) if bench.pie is not None else {}
    if "pie" in bench.endpoints:
        out["pie (client-side)"] = partial(client, bench.endpoints["pie"])
    return out | {name: partial(client, endpoint) for name, endpoint in bench.baselines.items()}


async def batch(agent: Run, agents: int, concurrency: int) -> tuple[list[Agent], float]:
    """`agents` runs, `concurrency` at a time; (the runs, wall seconds)."""
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int) -> Agent:
        async with gate:
            return await agent(i)

    start = time.perf_counter()
    runs = await asyncio.gather(*(one(i) for i in range(agents)))
    return list(runs), time.perf_counter() - start


@dataclass
class Samples:
    """One (case, system)'s measurements over every round."""

    runs: list[Agent] = field(default_factory=list)
    throughputs: list[float] = field(default_factory=list)
    calls: list[float] = field(default_factory=list)  # tool calls per agent, per round

    def row(self, case: Case, system: str) -> Row:
        med = statistics.median
        latencies = [r.seconds for r in self.runs]
        keys = sorted({k for r in self.runs for k in r.tokens})
        return Row(case.name, system, {"latency_s": med(latencies), "agents_per_s": med(self.throughputs)}, {
            "agents": case.agents, "concurrency": case.concurrency, "rounds": len(self.throughputs),
            "tool_calls_per_agent": med(self.calls),
            "scripted_steps_per_agent": med(r.scripted for r in self.runs),
            "chars_per_agent": med(r.chars for r in self.runs),
            **{f"{k}_tokens_per_agent": med(r.tokens.get(k, 0) for r in self.runs) for k in keys},
            "latency_samples_s": [round(x, 3) for x in latencies]})


async def compare(bench: Bench, tools: Tools, cases: list[Case]) -> list[Row]:
    """Every round runs every case on every system, in an order rotated by the round.

    Full runs first warm every (case, system) up untimed with one wave of `concurrency`
    agents: a system's first requests pay for compiling paths and growing pools (vLLM's
    first batch of a new shape, Pie's first launch of an inferlet), which is not the
    steady state the figure is about."""
    if not bench.quick:
        for case in cases:
            for name, agent in case.systems.items():
                await bench.settle()
                _, wall = await batch(agent, case.concurrency, case.concurrency)
                bench.log(f"{case.name} on {name}: warm-up, {case.concurrency} agents in {wall:.2f} s")
    samples = {(case.name, name): Samples() for case in cases for name in case.systems}
    for round_ in range(bench.rounds):
        for case in cases:
            names = list(case.systems)
            for name in names[round_ % len(names):] + names[:round_ % len(names)]:
                await bench.settle()
                before = await tools.calls()
                runs, wall = await batch(case.systems[name], case.agents, case.concurrency)
                got = samples[case.name, name]
                got.runs += runs
                got.throughputs.append(case.agents / wall)
                got.calls.append((await tools.calls() - before) / case.agents)
                bench.log(f"{case.name} on {name}: {case.agents} agents in {wall:.2f} s, "
                          f"median {statistics.median(r.seconds for r in runs):.2f} s per agent")
    return [samples[case.name, name].row(case, name) for case in cases for name in case.systems]


async def run(bench: Bench) -> Result:
    s = QUICK if bench.quick else FULL
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(keepalive_expiry=1.0)) as http:  # see Endpoint
        tools = Tools(bench.tools_url.rstrip("/"), http)
        cases = [
            Case("ReAct", s.agents, s.concurrency, systems(bench, {"pie": partial(react_pie, bench, s)}, lambda e, i:
                 react_client(Model(e, s.react_tokens), tools, QUESTIONS[i % len(QUESTIONS)], s.steps))),
            Case("CodeAct", s.agents, s.concurrency, systems(bench, {"pie": partial(codeact_pie, bench, s)}, lambda e, i:
                 codeact_client(Model(e, s.codeact_tokens), tools, CODE_TASKS[i % len(CODE_TASKS)], s.steps))),
            Case("Swarm", s.swarm_agents, s.swarm_concurrency, systems(bench, {"pie": partial(swarm_pie, bench, s)},
                 lambda e, i: swarm_client(e, s, i))),
        ]
        if bench.pie is not None:  # built and uploaded before any clock runs
            for name in ("agent_react", "agent_codeact", "agent_swarm"):
                await bench.program(name)
        rows = await compare(bench, tools, cases)
    return Result(
        workload="agents",
        title=f"Fig. 6 — agents ({s.steps} tool calls per ReAct/CodeAct agent, {s.workers} tasks per Swarm; "
              f"{s.concurrency} agents at once, Swarm {s.swarm_concurrency})",
        metrics=METRICS,
        rows=rows,
        notes=[
            ("pie: the agent_* inferlets; every other system runs the same agent as client-side Python "
             "over /v1/completions, re-sending the whole prompt for every line."),
            ("Swarm: an agent is a coordinator handing one task to each of its workers; on Pie separate "
             "instances over broadcast/subscribe, client-side one completion per worker, all at once."),
            (f"Swarm runs {s.swarm_concurrency} agents at once: agents × (workers + 1) Pie instances must "
             "fit runtime.max_instances (256)."),
            ("extra: tool calls as counted by the tool server; chars = final context (Swarm: answers) "
             "in characters; forward / prompt / generated tokens = what the engine processed."),
        ],
        settings={"quick": bench.quick, "rounds": bench.rounds, "warmup_agents": 0 if bench.quick else "concurrency",
                  **vars(s)},
        counts=COUNTS,
    )
