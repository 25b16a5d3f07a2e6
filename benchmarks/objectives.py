"""Scheduling by objective (issue 18; Parrot): chat sessions beside map-reduce summaries on
one `pie serve`, objective-blind vs chat marked `latency`.

Map-reduce: `--docs` documents of `--chunks` synthetic chunks (~`--chunk-words` words each;
summarising is mostly prefill, as on a real map phase), arriving `--doc-gap` s apart (a
summarisation service's stream of work); each document's chunks summarised by their own
`text_completion`s (32 tokens) at once, then the summaries reduced by one more (48
tokens). Its figures: the completion time of the whole job, and per document. Chat: `--sessions` `text_completion --turns` sessions, started
`--stagger` s apart once the map-reduce is launched, each `--turns` user turns answered
on the same context (24 tokens), `--think` s between a reply and the next message. Its
figure is Parrot's normalized latency: a turn's time from message to reply over the reply's
tokens, averaged over all turns.

The same server (default config, `control.scheduler = adaptive`) runs both systems, in
rotated order round after round: "blind" launches the chat sessions without an objective
(every queue is `throughput`), "objectives" with `--objective latency`, so the scheduler
serves them first and chunks the map-reduce's prompts around them
(`control.latency_batch_tokens`), and with `--latency-step-tokens N` caps the map-reduce's
share of each batch a chat call rides to N tokens (`control.latency_step_tokens`). Medians over rounds; targets:
chat's normalized latency >= 2x better, the map-reduce's completion time within 1.1x.

    python benchmarks/objectives.py [--rounds 3] [--docs 6] [--doc-gap 3] [--chunks 8] [--sessions 4] [--turns 5]
        [--latency-step-tokens N] [--quick] [--out FILE]

Results: benchmarks/results/objectives.json and objectives.png. `--quick` (one document of
2 short chunks, 2 sessions of 2 turns, 8 tokens each, 2 rounds) is the smoke run tests/test_bench_scripts.py
makes.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script: the `benchmarks` package is in the repository root

from benchmarks.run_info import command_line, machine_settings, rotated, write_results
from pie.backend.dtype import resolve_dtype
from pie.client import PieClient
from pie.server.local import LocalServer

RESULTS = Path(__file__).parent / "results"
SYSTEMS = ("blind", "objectives")
MODEL = "smollm2-135m-instruct"
TOKENS = {"map": 32, "reduce": 48, "chat": 24}
QUICK_TOKENS = {"map": 8, "reduce": 8, "chat": 8}
WORDS = ("river harbor council market winter engine garden letter bridge signal mountain "
         "village report season ledger captain station forest budget harvest museum canal "
         "factory school doctor library railway festival storm valley").split()


def chunk_text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)) + "."


async def completion(client: PieClient, args: list[str]) -> str:
    instance = await client.launch("text_completion", args)
    messages = [m async for m in instance]
    reason = await instance.wait()
    if reason != "finished" or not messages:
        raise RuntimeError(f"text_completion ended {reason!r}: {messages}")
    return messages[0]


async def map_reduce(client: PieClient, docs: list[list[str]], tokens: dict[str, int], gap: float,
                     start: float) -> tuple[float, list[float]]:
    """Document i arrives at i x `gap` s: its chunks summarised at once, then the summaries
    reduced. (Seconds until the last document is done, each document's completion time.)"""
    async def document(i: int, chunks: list[str]) -> float:
        await asyncio.sleep(max(0.0, start + i * gap - time.monotonic()))
        arrived = time.monotonic()
        summaries = await asyncio.gather(*(completion(client, [
            "--prompt", f"Summarize in one sentence:\n{chunk}", "--max-tokens", str(tokens["map"])])
            for chunk in chunks))
        await completion(client, ["--prompt", "Combine these summaries into one paragraph:\n"
                                  + "\n".join(summaries), "--max-tokens", str(tokens["reduce"])])
        return time.monotonic() - arrived

    each = await asyncio.gather(*(document(i, chunks) for i, chunks in enumerate(docs)))
    return time.monotonic() - start, list(each)


async def chat(client: PieClient, session: int, turns: int, think: float, delay: float,
               objective: bool, max_tokens: int, tokenizer, seed: int) -> list[dict]:
    """One session's turns: (latency, reply tokens, normalized latency) each."""
    await asyncio.sleep(delay)
    rng = random.Random(seed)
    messages = [f"Session {session}, question {t}: tell me about the {rng.choice(WORDS)} and the "
                f"{rng.choice(WORDS)} near the {rng.choice(WORDS)} in two sentences." for t in range(turns)]
    args = ["--prompt", messages[0], "--max-tokens", str(max_tokens), "--turns", str(turns)]
    sent = time.monotonic()
    instance = await client.launch("text_completion", args + (["--objective", "latency"] if objective else []))
    out = []
    for turn in range(turns):
        event = await instance.recv()
        reply = getattr(event, "text", None)
        if reply is None:
            raise RuntimeError(f"chat session {session} ended at turn {turn}: {event}")
        latency = time.monotonic() - sent
        tokens = max(1, len(tokenizer.encode(reply, add_special_tokens=False).ids))
        out.append({"session": session, "turn": turn, "latency_s": latency, "tokens": tokens,
                    "normalized_s": latency / tokens})
        if turn + 1 < turns:
            await asyncio.sleep(think)
            sent = time.monotonic()
            await instance.send(messages[turn + 1])
    if (reason := await instance.wait()) != "finished":
        raise RuntimeError(f"chat session {session} ended {reason!r}")
    return out


def make_documents(args: argparse.Namespace, seed: int) -> list[list[str]]:
    """`args.docs` documents of their own: every run prefills text no earlier run left in
    the prefix cache (with the same documents each round, later rounds took half the time)."""
    rng = random.Random(seed)
    return [[chunk_text(rng, args.chunk_words) for _ in range(args.chunks)] for _ in range(args.docs)]


async def one_run(client: PieClient, system: str, args: argparse.Namespace, tokenizer, seed: int) -> dict:
    docs = make_documents(args, seed)
    start = time.monotonic()
    chats = [chat(client, s, args.turns, args.think, args.chat_delay + s * args.stagger, system == "objectives",
                  args.tokens["chat"], tokenizer, seed=1000 * seed + s) for s in range(args.sessions)]
    (makespan, documents), *sessions = await asyncio.gather(
        map_reduce(client, docs, args.tokens, args.doc_gap, start), *chats)
    turns = [t for s in sessions for t in s]
    normalized = sorted(t["normalized_s"] for t in turns)
    return {"system": system, "map_reduce_s": makespan, "document_mean_s": statistics.mean(documents),
            "documents_s": documents, "chat_normalized_mean_s": statistics.mean(normalized),
            "chat_normalized_p90_s": normalized[int(0.9 * (len(normalized) - 1))],
            "chat_latency_mean_s": statistics.mean(t["latency_s"] for t in turns), "turns": turns,
            "wall_s": time.monotonic() - start}


def plot(data: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(8, 3.6))
    systems = list(SYSTEMS)
    left.bar(systems, [1000 * data["median"][s]["chat_normalized_mean_s"] for s in systems], color=["grey", "tab:blue"])
    left.set_ylabel("chat: ms per output token (mean)")
    left.set_title(f"chat {data['chat_speedup']:.2f}x better")
    right.bar(systems, [data["median"][s]["map_reduce_s"] for s in systems], color=["grey", "tab:blue"])
    right.set_ylabel("map-reduce completion (s)")
    right.set_title(f"map-reduce {data['map_reduce_ratio']:.2f}x the time")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


async def main_async(args: argparse.Namespace) -> dict:
    from tokenizers import Tokenizer

    from pie.backend.weights import resolve_model_dir
    from pie.config import load_config

    config = load_config()
    tokenizer = Tokenizer.from_file(str(resolve_model_dir(config.model.path, config.paths.cache) / "tokenizer.json"))
    dtype = resolve_dtype(args.dtype, "cpu")
    runs: list[dict] = []
    order: list[list[str]] = []
    tmp = Path(tempfile.mkdtemp(prefix="pie-objectives-"))
    settings = tmp / "config.toml"
    settings.write_text(f"[control]\nlatency_step_tokens = {args.latency_step_tokens}\n")
    with (tmp / "serve.log").open("ab") as log:
        async with LocalServer(["--dtype", dtype, "--config", str(settings)], stderr=log) as url, \
                PieClient(url) as client:
            # Warm-up (the first map wave after a start ran ~2x slower): one document, no chat.
            await map_reduce(client, make_documents(args, 0)[:1], args.tokens, 0.0, time.monotonic())
            for round_ in range(args.rounds):
                systems = rotated(list(SYSTEMS), round_)
                order.append(systems)
                for system in systems:
                    run = await one_run(client, system, args, tokenizer, seed=1 + len(runs))
                    run["round"] = round_
                    runs.append(run)
                    print(f"round {round_} {system:10s}: chat {1000 * run['chat_normalized_mean_s']:.0f} ms/token "
                          f"(p90 {1000 * run['chat_normalized_p90_s']:.0f}), map-reduce {run['map_reduce_s']:.2f} s",
                          flush=True)
    median = {s: {k: statistics.median(r[k] for r in runs if r["system"] == s)
                  for k in ("chat_normalized_mean_s", "chat_normalized_p90_s", "chat_latency_mean_s", "map_reduce_s",
                            "document_mean_s")}
              for s in SYSTEMS}
    return {
        "meta": {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "command": command_line(),
                 "quick": args.quick, "rounds": args.rounds, "order": order, "model": MODEL, "dtype": dtype,
                 **machine_settings()},
        "workload": {"docs": args.docs, "doc_gap_s": args.doc_gap, "chunks": args.chunks, "chunk_words": args.chunk_words,
                     "sessions": args.sessions, "turns": args.turns, "think_s": args.think,
                     "stagger_s": args.stagger, "chat_delay_s": args.chat_delay,
                     "tokens": args.tokens},
        "control": {"latency_step_tokens": args.latency_step_tokens},
        "runs": runs, "median": median,
        "chat_speedup": median["blind"]["chat_normalized_mean_s"] / median["objectives"]["chat_normalized_mean_s"],
        "map_reduce_ratio": median["objectives"]["map_reduce_s"] / median["blind"]["map_reduce_s"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--docs", type=int, default=6)
    parser.add_argument("--doc-gap", type=float, default=3.0, help="seconds between documents' arrivals")
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--chunk-words", type=int, default=350)
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--think", type=float, default=0.5, help="seconds between a reply and the next message")
    parser.add_argument("--stagger", type=float, default=0.5, help="seconds between sessions' starts")
    parser.add_argument("--chat-delay", type=float, default=0.3, help="seconds from the map-reduce's launch to the first session")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--latency-step-tokens", type=int, default=0,
                        help="the server's control.latency_step_tokens (default 0: no cap)")
    parser.add_argument("--quick", action="store_true", help="a small run (the tests' smoke run)")
    parser.add_argument("--out", default=str(RESULTS / "objectives.json"))
    args = parser.parse_args()
    args.tokens = QUICK_TOKENS if args.quick else TOKENS
    if args.quick:
        args.rounds, args.docs, args.chunks, args.chunk_words, args.sessions, args.turns = 2, 1, 2, 30, 2, 2
        args.think, args.stagger, args.doc_gap = 0.1, 0.2, 0.5
    data = asyncio.run(main_async(args))
    print(f"chat {data['chat_speedup']:.2f}x better normalized latency; map-reduce {data['map_reduce_ratio']:.2f}x the time")
    write_results(args.out, data)
    plot(data, Path(args.out).with_suffix(".png"))


if __name__ == "__main__":
    main()
