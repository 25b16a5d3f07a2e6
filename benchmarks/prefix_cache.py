"""The prefix cache (issue 17) on a client-side conversation through Pie's own `/v1`.

One client holds a growing conversation, a new one each round: each line appends an
observation and asks for the next thought (greedy, up to 16 tokens, stop at a newline), sending the whole
conversation every time, as a client-side agent does. The same conversation runs on two
`pie serve`s, `control.prefix_cache` on and off, alternating which goes first round by
round; medians of the conversation's wall time, the speed-up, the "on" server's hit rate
from `/stats` (prompt tokens copied from cached pages rather than prefilled), and whether
both servers wrote the same text (in bf16 they may not: the cached pages were computed in
another batch shape than the recomputed ones).

    python benchmarks/prefix_cache.py [--rounds 3] [--lines 16] [--clients 1,8] [--dtype auto] [--quick] [--out FILE]

With `--clients 1,8`, once with one client, once with 8 clients holding their own
conversations at once (what client-side agents do). Results:
benchmarks/results/prefix_cache.json. `--quick` (3 lines, 2 rounds) is the smoke run
tests/test_bench_scripts.py makes.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script: the `benchmarks` package is in the repository root

from benchmarks.endpoint import Endpoint
from benchmarks.run_info import command_line, machine_settings, rotated, write_results
from pie.backend.dtype import resolve_dtype
from pie.client import http_url
from pie.server.local import LocalServer

RESULTS = Path(__file__).parent / "results"
ROUNDS, QUICK_ROUNDS = 3, 2
MODEL = "smollm2-135m-instruct"
OPENING = ("<|im_start|>system\nSession {session}. You are a careful agent. Think in one short line, "
           "then wait for the next observation.<|im_end|>\n<|im_start|>user\nTrack the values below "
           "and report their running total.<|im_end|>\n<|im_start|>assistant\n")


async def conversation(url: str, session: int, lines: int, max_tokens: int) -> tuple[float, str]:
    """The conversation's wall time and the text the server wrote. Each session starts with
    its own number: nothing of an earlier round's conversation can be reused."""
    endpoint = Endpoint(url, MODEL, "pie")
    prompt, written = OPENING.format(session=session), []
    started = time.perf_counter()
    for i in range(lines):
        prompt += f"Observation {i}: item {i} is worth {i * 37 % 101}.\nThought:"
        [c] = await endpoint.complete(prompt, max_tokens, stop=["\n"])
        prompt += c.text + "\n"
        written.append(c.text)
    seconds = time.perf_counter() - started
    await endpoint.http.aclose()
    return seconds, "\n".join(written)


async def run(args: argparse.Namespace) -> dict:
    rounds = args.rounds or (QUICK_ROUNDS if args.quick else ROUNDS)
    lines = 3 if args.quick else args.lines
    dtype = resolve_dtype(args.dtype, "cpu")
    tmp = Path(tempfile.mkdtemp(prefix="pie-prefix-"))
    servers, urls, logs = {}, {}, []
    for name, flag in (("on", "true"), ("off", "false")):
        config = tmp / f"{name}.toml"
        config.write_text(f"[control]\nprefix_cache = {flag}\n")
        logs.append((tmp / f"{name}.log").open("ab"))
        servers[name] = LocalServer(["--dtype", dtype, "--config", str(config)], stderr=logs[-1])
        urls[name] = http_url(await servers[name].__aenter__())
    try:
        for url in urls.values():  # warm-up, untimed (another conversation: nothing of it is cached)
            endpoint = Endpoint(url, MODEL, "pie")
            await endpoint.complete("<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n", 4)
            await endpoint.http.aclose()
        order = [rotated(["on", "off"], r) for r in range(rounds)]
        runs, session = [], 0
        for clients in sorted({int(c) for c in args.clients.split(",")}):
            seconds: dict[str, list[float]] = {"on": [], "off": []}
            texts: dict[str, list[list[str]]] = {"on": [], "off": []}
            for names in order:
                for name in names:  # `clients` conversations at once, each its own session
                    started = time.perf_counter()
                    done = await asyncio.gather(*(conversation(urls[name], session + c, lines, args.max_tokens)
                                                  for c in range(clients)))
                    seconds[name].append(time.perf_counter() - started)
                    texts[name].append([text for _, text in done])
                    print(f"prefix cache {name:3}, {clients} clients: {lines} lines each in "
                          f"{seconds[name][-1]:.2f} s", flush=True)
                session += clients
            on, off = statistics.median(seconds["on"]), statistics.median(seconds["off"])
            print(f"{clients} clients: on {on:.2f} s, off {off:.2f} s: {off / on:.2f}x", flush=True)
            runs.append({"clients": clients, "on_s": on, "off_s": off, "speedup": off / on,
                         "on_round_s": seconds["on"], "off_round_s": seconds["off"],
                         "same_text": texts["on"] == texts["off"]})
        async with httpx.AsyncClient() as http:
            stats = (await http.get(f"{urls['on']}/stats")).json()["resources"]["prefix_cache"]
    finally:
        for server in servers.values():
            await server.__aexit__()
        for log in logs:
            log.close()
    print(f"hit rate {stats['hit_rate']:.0%}")
    return {
        "lines": lines, "max_tokens": args.max_tokens, "runs": runs, "prefix_cache_stats": stats,
        "meta": {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "command": command_line(),
                 "quick": args.quick, "rounds": rounds, "order": order, "dtype": dtype, "model": MODEL,
                 **machine_settings(),
                 "method": "one client-side conversation through /v1 per server and round, servers "
                           "alternating; medians; hit rate over the 'on' server's whole run"},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=None, help=f"alternating rounds (default {ROUNDS}; quick {QUICK_ROUNDS})")
    parser.add_argument("--lines", type=int, default=16, help="lines of the conversation (default 16)")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens per line at most (default 16)")
    parser.add_argument("--clients", default="1,8", help="conversations at once, comma-separated runs (default 1,8)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    parser.add_argument("--quick", action="store_true", help="a smoke run")
    parser.add_argument("--out", default=str(RESULTS / "prefix_cache.json"), help="where the JSON goes")
    args = parser.parse_args()
    write_results(args.out, asyncio.run(run(args)))


if __name__ == "__main__":
    main()
