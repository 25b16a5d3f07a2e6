"""Load and soak: many concurrent inferlets with mixed workloads for a bounded time.

Each of `--instances` slots runs one workload (the warm-up round: the workloads dealt out in
turn), then, once every instance has ended, workloads drawn at random back to back until
`--minutes` pass:
- `echo`: `hello`, then 5 messages that must come back in order (a lost or reordered
  message is counted);
- `complete`: `text_completion`, 8 greedy tokens of one of a few prompts (the answer must
  equal the first answer seen for that prompt);
- `fork`: `parallel_generation`, 2 seeded continuations of a shared prompt;
- `pause`: `probe pause`, 8 greedy tokens of a prompt in a swappable or discardable context,
  a wait of up to half a second on a message (the instance is paused: a short pool may swap
  or drop its pages, `control.kv_pressure`), then 8 more (must equal the first seen).
With `--kv-pages N` the private server's KV pool is that small, so the reclaimer works
(and allocations wait up to a minute for pages rather than the default second).
It reports per-workload p50/p99 latency (of the soak, not the warm-up), errors, lost
messages, whether every KV page and embed is back in the pool at the end, and whether the
server leaked threads or file descriptors: counted after the warm-up round and again after
the soak. Loopback only (it
starts its own `pie serve` unless given `--server`; the leak check needs that private
server's pid). Results: benchmarks/results/soak.json (`--out` elsewhere).

    python benchmarks/soak.py [--instances 256] [--minutes 10] [--kv-pages N] [--quick] [--out FILE]

`--quick` (6 instances for 3 seconds) is the smoke run tests/test_bench_scripts.py makes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script: `pie` and `benchmarks` are in the repository root

from pie.client import PieClient, http_url  # noqa: E402
from pie.config import is_loopback  # noqa: E402
from pie.server.local import LocalServer  # noqa: E402
from pie.toolchain import build_inferlet  # noqa: E402

from benchmarks.run_info import command_line, machine_settings, served_model  # noqa: E402

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


async def pause(client: PieClient, rng: random.Random, tally: Tally, programs: dict) -> None:
    prompt = rng.choice(PROMPTS)
    instance = await client.launch(programs["probe"], ["pause", rng.choice(["swappable", "discardable"]), prompt])
    first = (await instance.recv()).text
    await asyncio.sleep(rng.uniform(0, 0.5))
    await instance.send("go")
    answer = "|".join([first] + [m async for m in instance])
    if (reason := await instance.wait()) != "finished":
        raise RuntimeError(reason)
    tally.wrong_answers += answer != tally.answers.setdefault(f"pause: {prompt}", answer)


WORKLOADS = {"echo": echo, "complete": complete, "fork": fork, "pause": pause}


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
        programs = {name: await uploader.upload(build_inferlet(ROOT / "inferlets" / name).read_bytes())
                    for name in ("parallel_generation", "probe")}
    rngs = [random.Random(seed * 100003 + index) for index in range(instances)]

    async def slot(index: int, rng: random.Random, deadline: float | None) -> None:
        async with PieClient(url, token) as client:
            first = True
            while True:  # at least one workload: the warm-up round (deadline None) is one per slot
                # The warm-up deals the workloads out in turn, so every one has run (and grown
                # what it grows) before threads and fds are counted; the soak deals its first
                # round out the same way (a short soak on a slow machine runs only that one,
                # and every workload must have a latency); then each slot draws.
                name = list(WORKLOADS)[index % len(WORKLOADS)] if first else rng.choice(list(WORKLOADS))
                first = False
                start = time.perf_counter()
                try:
                    await asyncio.wait_for(WORKLOADS[name](client, rng, tally, programs), 600)
                    tally.record(name, time.perf_counter() - start)
                except Exception as e:  # counted, not fatal: the report says what failed
                    tally.error(name, f"{type(e).__name__}: {e}")
                if deadline is None or time.monotonic() >= deadline:
                    return

    started = time.monotonic()
    # Warm-up at full concurrency, so thread pools have grown and lazily created threads and
    # sockets exist before counting.
    await asyncio.gather(*(slot(i, rng, None) for i, rng in enumerate(rngs)))
    # Latencies are the soak's alone (the warm-up's first launches compile and grow pools);
    # its errors, lost messages and wrong answers still count.
    warmup = {k: len(v) for k, v in tally.latency.items()}
    tally.latency.clear()
    await drained(http, token)
    if pid is not None:
        threads_before, fds_before = threads(pid), open_fds(pid)
    deadline = time.monotonic() + seconds
    await asyncio.gather(*(slot(i, rng, deadline) for i, rng in enumerate(rngs)))
    elapsed = time.monotonic() - started
    stats = await drained(http, token)
    leaks = ("not measured (external server)" if pid is None
             else await leak_check(pid, threads_before, fds_before))

    def ms(values: list[float], q: float) -> float:
        return 1000 * statistics.quantiles(values, n=100)[int(q) - 1] if len(values) > 1 else 1000 * values[0]

    return {
        "instances": instances, "seconds": round(elapsed, 1),
        "warmup_completed": warmup,
        "completed": {k: len(v) for k, v in tally.latency.items()},
        "p50_ms": {k: round(ms(v, 50), 1) for k, v in tally.latency.items()},
        "p99_ms": {k: round(ms(v, 99), 1) for k, v in tally.latency.items()},
        "errors": {k: len(v) for k, v in tally.errors.items()},
        "error_examples": {k: v[:3] for k, v in tally.errors.items()},
        "lost_messages": tally.lost_messages,
        "wrong_answers": tally.wrong_answers,
        "pools_reclaimed": reclaimed(stats),
        "reclaim": stats["resources"].get("reclaim"),  # pages the short pool moved (kv_pressure)
        "leak_check": leaks,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--instances", type=int, default=None, help="concurrent slots (default 256; quick 6)")
    parser.add_argument("--minutes", type=float, default=None, help="soak length (default 10; quick 3 s)")
    parser.add_argument("--seed", type=int, default=0, help="seeds every slot's choice of workloads")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 6 instances for 3 seconds")
    parser.add_argument("--out", default=str(RESULTS / "soak.json"), help="where the JSON goes")
    parser.add_argument("--server", help="a running server's URL (loopback) instead of a private one")
    parser.add_argument("--token")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="a private server's dtype; fp32 (default) makes greedy answers "
                             "independent of batch composition, so they can be checked")
    parser.add_argument("--kv-pages", type=int, help="a private server's KV pool (default: the config's): "
                        "small, the reclaimer moves paused instances' pages")
    args = parser.parse_args()
    instances = args.instances or (6 if args.quick else 256)
    seconds = 60 * (args.minutes if args.minutes is not None else 3 / 60 if args.quick else 10.0)

    async def run() -> dict:
        if args.server:
            host = urllib.parse.urlparse(args.server).hostname or ""
            if not is_loopback(host):
                raise SystemExit(f"soak runs against loopback servers only, not {host!r}")
            return {**await soak(args.server, args.token, instances, seconds, seed=args.seed),
                    "model": served_model(args.server)}
        extra = []
        if args.kv_pages:
            config = Path(tempfile.mkdtemp(prefix="pie-soak-")) / "pool.toml"
            # Short of pages, running instances wait for the reclaimer and for each other
            # rather than fail after the default second.
            config.write_text(f"[backend]\nnum_kv_pages = {args.kv_pages}\n[control]\nalloc_wait_ms = 60000.0\n")
            extra = ["--config", str(config)]
        server = LocalServer(["--dtype", args.dtype, *extra])
        async with server as url:
            assert server.process is not None
            return {**await soak(url, None, instances, seconds, seed=args.seed, pid=server.process.pid),
                    "model": served_model(url)}

    report = asyncio.run(run())
    model = report.pop("model")
    # One round: the workloads are not compared with each other, each slot draws its next
    # one at random (seeded), so their order is a mix rather than a rotation.
    report["meta"] = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                      "command": command_line(), "quick": args.quick, "rounds": 1,
                      "order": [f"random per slot (seed {args.seed})"],
                      "dtype": None if args.server else args.dtype, "model": model,
                      "seed": args.seed, "kv_pages": args.kv_pages, **machine_settings()}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
