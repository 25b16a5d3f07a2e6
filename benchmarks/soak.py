"""Load and soak: many concurrent inferlets with mixed workloads for a bounded time.

Each of `--instances` slots runs one workload (the warm-up round), then, once every instance
has ended, workloads back to back until `--minutes` pass:
- `echo`: `hello`, then 5 messages that must come back in order (a lost or reordered
  message is counted);
- `complete`: `text_completion`, 8 greedy tokens of one of a few prompts (the answer must
  equal the first answer seen for that prompt);
- `fork`: `parallel_generation`, 2 seeded continuations of a shared prompt.
It reports per-workload p50/p99 latency, errors, lost messages, whether every KV page and
embed is back in the pool at the end, and whether the server leaked threads or file
descriptors: counted after the warm-up round and again after the soak. Loopback only (it
starts its own `pie serve` unless given `--server`; the leak check needs that private
server's pid). Results: benchmarks/results/soak.json.

    python benchmarks/soak.py [--instances 256] [--minutes 10]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time
import urllib.parse
import urllib.request
from datetime import datetime, timezone
from pathlib import Path

from pie.client import PieClient, http_url
from pie.config import is_loopback
from pie.server.local import LocalServer
from pie.toolchain import build_inferlet

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PROMPTS = ["What is the capital of France?", "Name a color.", "Say hi.", "What is 2 + 2?"]
# Threads or fds the server may gain over the soak without leaking: pools grow lazily up to a
# fixed size, and the warm-up round need not have grown them all the way — asyncio's default
# executor (launch, upload, terminate; up to min(32, cpus + 4) workers), anyio's workers for
# sync endpoints such as /stats, the inferlets' HTTP pool (16, unused here). A leak grows with
# the thousands of workloads of a soak, far past this.
LEAK_TOLERANCE = 8
SETTLE_S = 30.0  # bound on the waits for the last instances' teardown and exiting threads


class Tally:
    def __init__(self) -> None:
        self.latency: dict[str, list[float]] = {}
        self.errors: dict[str, list[str]] = {}
        self.lost_messages = 0
        self.answers: dict[str, str] = {}
        self.wrong_answers = 0

    def record(self, workload: str, seconds: float) -> None:
        self.latency.setdefault(workload, []).append(seconds)

    def error(self, workload: str, reason: str) -> None:
        self.errors.setdefault(workload, []).append(reason)


async def echo(client: PieClient, rng: random.Random, tally: Tally, programs: dict) -> None:
    instance = await client.launch("hello", ["soak"])
    expected = ["soak"] + [f"m{rng.randrange(10**6)}" for _ in range(5)]
    for text in expected[1:]:
        await instance.send(text)
    await instance.send("quit")
    received = [m async for m in instance]
    tally.lost_messages += sum(a != b for a, b in zip(expected, received)) + abs(len(expected) - len(received))
    if (reason := await instance.wait()) != "finished":
        raise RuntimeError(reason)


async def complete(client: PieClient, rng: random.Random, tally: Tally, programs: dict) -> None:
    prompt = rng.choice(PROMPTS)
    instance = await client.launch("text_completion", ["--prompt", prompt, "--max-tokens", "8"])
    messages = [m async for m in instance]
    if (reason := await instance.wait()) != "finished":
        raise RuntimeError(reason)
    first = tally.answers.setdefault(prompt, messages[0])
    tally.wrong_answers += messages[0] != first


async def fork(client: PieClient, rng: random.Random, tally: Tally, programs: dict) -> None:
    instance = await client.launch(programs["parallel_generation"], [
        "--prompt", rng.choice(PROMPTS), "--n", "2", "--max-tokens", "6", "--seed", str(rng.randrange(1000))])
    messages = [m async for m in instance]
    if (reason := await instance.wait()) != "finished" or len(json.loads(messages[0])["completions"]) != 2:
        raise RuntimeError(reason)


WORKLOADS = {"echo": echo, "complete": complete, "fork": fork}


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def threads(pid: int) -> int:
    return int(next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                    if line.startswith("Threads:")).split()[1])


def reclaimed(stats: dict) -> bool:
    r = stats["resources"]
    return (stats["instances"] == 0 and r["kv_pages_free"] == r["kv_pages_total"]
            and r["embeds_free"] == r["embeds_total"])


async def drained(http: str, token: str | None) -> dict:
    """/stats once no instance is left and the pools are full (teardown of the last instances
    is asynchronous), or after SETTLE_S if that never happens."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        request = urllib.request.Request(f"{http}/stats", headers={"Authorization": f"Bearer {token or ''}"})
        stats = json.loads(urllib.request.urlopen(request, timeout=10).read())
        if reclaimed(stats) or time.monotonic() >= deadline:
            return stats
        await asyncio.sleep(0.1)


async def leak_check(pid: int, threads_before: int, fds_before: int) -> dict:
    """The server's threads and fds against the counts before the soak. Polled for up to
    SETTLE_S: an ended instance's thread and idle pool workers exit a little after /stats
    shows no instance; leaked ones stay."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        threads_after, fds_after = threads(pid), open_fds(pid)
        leaked = (threads_after > threads_before + LEAK_TOLERANCE
                  or fds_after > fds_before + LEAK_TOLERANCE)
        if not leaked or time.monotonic() >= deadline:
            return {"threads_before": threads_before, "threads_after": threads_after,
                    "fds_before": fds_before, "fds_after": fds_after,
                    "tolerance": LEAK_TOLERANCE, "leaked": leaked}
        await asyncio.sleep(1)


async def soak(url: str, token: str | None, instances: int, seconds: float, seed: int = 0,
               pid: int | None = None) -> dict:
    """Run the mix on a server at `url`; the report (see the module docstring). `pid`: the
    server's process, for the leak check (None: an external server, not measured)."""
    tally = Tally()
    http = http_url(url)
    async with PieClient(url, token) as uploader:
        programs = {"parallel_generation": await uploader.upload(
            build_inferlet(ROOT / "inferlets" / "parallel_generation").read_bytes())}
    rngs = [random.Random(seed * 100003 + index) for index in range(instances)]

    async def slot(rng: random.Random, deadline: float) -> None:
        async with PieClient(url, token) as client:
            while True:  # at least one workload: the warm-up round is one per slot
                name = rng.choice(list(WORKLOADS))
                start = time.perf_counter()
                try:
                    await asyncio.wait_for(WORKLOADS[name](client, rng, tally, programs), 600)
                    tally.record(name, time.perf_counter() - start)
                except Exception as e:  # counted, not fatal: the report says what failed
                    tally.error(name, f"{type(e).__name__}: {e}")
                if time.monotonic() >= deadline:
                    return

    started = time.monotonic()
    # Warm-up at full concurrency, so thread pools have grown and lazily created threads and
    # sockets exist before counting.
    await asyncio.gather(*(slot(rng, 0.0) for rng in rngs))
    await drained(http, token)
    if pid is not None:
        threads_before, fds_before = threads(pid), open_fds(pid)
    deadline = time.monotonic() + seconds
    await asyncio.gather(*(slot(rng, deadline) for rng in rngs))
    elapsed = time.monotonic() - started
    stats = await drained(http, token)
    leaks = ("not measured (external server)" if pid is None
             else await leak_check(pid, threads_before, fds_before))

    def ms(values: list[float], q: float) -> float:
        return 1000 * statistics.quantiles(values, n=100)[int(q) - 1] if len(values) > 1 else 1000 * values[0]

    return {
        "instances": instances, "seconds": round(elapsed, 1),
        "completed": {k: len(v) for k, v in tally.latency.items()},
        "p50_ms": {k: round(ms(v, 50), 1) for k, v in tally.latency.items()},
        "p99_ms": {k: round(ms(v, 99), 1) for k, v in tally.latency.items()},
        "errors": {k: len(v) for k, v in tally.errors.items()},
        "error_examples": {k: v[:3] for k, v in tally.errors.items()},
        "lost_messages": tally.lost_messages,
        "wrong_answers": tally.wrong_answers,
        "pools_reclaimed": reclaimed(stats),
        "leak_check": leaks,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--instances", type=int, default=256)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--server", help="a running server's URL (loopback) instead of a private one")
    parser.add_argument("--token")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="a private server's dtype; fp32 (default) makes greedy answers "
                             "independent of batch composition, so they can be checked")
    args = parser.parse_args()
    seconds = args.minutes * 60

    async def run() -> dict:
        if args.server:
            host = urllib.parse.urlparse(args.server).hostname or ""
            if not is_loopback(host):
                raise SystemExit(f"soak runs against loopback servers only, not {host!r}")
            return await soak(args.server, args.token, args.instances, seconds)
        server = LocalServer(["--dtype", args.dtype])
        async with server as url:
            assert server.process is not None
            return await soak(url, None, args.instances, seconds, pid=server.process.pid)

    report = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "dtype": None if args.server else args.dtype, **asyncio.run(run())}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "soak.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
