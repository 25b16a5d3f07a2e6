"""Fuzzing the client ⇄ server RPC protocol through a real `pie serve`: thousands of random,
structured-random and mutated frames, each of which must get exactly one reply and never an
internal error; afterwards the server still serves, and nothing leaked."""

from __future__ import annotations

import asyncio
import random

import msgpack
import websockets

from benchmarks.soak import LEAK_TOLERANCE, open_fds, threads
from pie.client import PieClient
from pie.server import rpc
from pie_server import TOKEN, until

CASES = 3000
SEED = 20261122


def random_value(rng: random.Random, depth: int = 0):
    """Any msgpack value, nested a little."""
    kinds = ["int", "bigint", "float", "str", "bytes", "none", "bool"] + (["list", "map"] if depth < 3 else [])
    kind = rng.choice(kinds)
    if kind == "int":
        return rng.randint(-5, 300)
    if kind == "bigint":
        return rng.choice([2**63 - 1, -(2**63), 2**64 - 1, 2**32, -1])
    if kind == "float":
        return rng.choice([0.0, -1.5, 1e308, float("inf"), float("nan")])
    if kind == "str":
        return rng.choice(["", "hello", "x" * rng.randint(1, 300), "\u0000\uffff", "../../etc/passwd", "0" * 64])
    if kind == "bytes":
        return rng.randbytes(rng.randint(0, 64))
    if kind == "none":
        return None
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "list":
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {rng.choice([1, None, "", b"k", True]) if rng.random() < 0.2 else rng.choice(FIELDS):
            random_value(rng, depth + 1) for _ in range(rng.randint(0, 5))}


REQUESTS = [cls for cls in rpc.Request.__subclasses__()]
FIELDS = sorted({f for cls in REQUESTS for f in cls.__dataclass_fields__} | {"type"})


def valid_frame(rng: random.Random, corr_id: int) -> bytes:
    """A well-formed request of a random type, with plausible values."""
    cls = rng.choice([c for c in REQUESTS if c is not rpc.Authenticate])
    values = {"corr_id": corr_id, "token": TOKEN, "sha256": rng.choice(["0" * 64, "f" * 64, "nothex"]),
              "size": rng.choice([0, 1, 100, 2**40]), "data": rng.randbytes(rng.randint(0, 32)),
              "program": rng.choice(["hello", "no-such", "0" * 64]), "arguments": ["a"],
              "instance_id": rng.choice(["", "0" * 32, "nope"]), "message": "hi"}
    body = {"type": cls.type, **{f: values[f] for f in cls.__dataclass_fields__ if f in values}}
    return msgpack.packb(body)


def mutate(rng: random.Random, frame: bytes) -> bytes:
    data = bytearray(frame)
    for _ in range(rng.randint(1, 4)):
        op = rng.random()
        if op < 0.5 and data:
            data[rng.randrange(len(data))] = rng.randrange(256)
        elif op < 0.75:
            data.insert(rng.randrange(len(data) + 1), rng.randrange(256))
        elif data:
            del data[rng.randrange(len(data))]
    return bytes(data)


def frames(rng: random.Random):
    for i in range(CASES):
        choice = rng.random()
        if choice < 0.2:
            yield rng.randbytes(rng.randint(0, 200))
        elif choice < 0.5:
            yield msgpack.packb(random_value(rng))
        elif choice < 0.7:
            value = {"type": rng.choice([c.type for c in REQUESTS] + ["nope", ""]), "corr_id": i}
            value.update({rng.choice(FIELDS): random_value(rng) for _ in range(rng.randint(0, 4))})
            yield msgpack.packb(value)
        elif choice < 0.85:
            yield valid_frame(rng, i)
        else:
            yield mutate(rng, valid_frame(rng, i))


async def fuzz(url: str) -> dict[str, int]:
    """Send every frame on one authenticated connection; count the reply codes."""
    codes: dict[str, int] = {}
    rng = random.Random(SEED)
    async with websockets.connect(url, max_size=None) as ws:
        await ws.send(rpc.encode(rpc.Authenticate(corr_id=0, token=TOKEN)))
        await ws.recv()
        for frame in frames(rng):
            await ws.send(frame)
            while True:  # skip events of instances the fuzzer launched; wait for the reply
                reply = msgpack.unpackb(await asyncio.wait_for(ws.recv(), 30))
                if reply.get("type") in ("ok", "error"):
                    break
            code = reply.get("code", "ok")
            codes[code] = codes.get(code, 0) + 1
    return codes


def test_rpc_fuzzing_gets_one_clean_reply_per_frame_and_leaks_nothing(pie_server):
    pid = pie_server.process.pid
    asyncio.run(_warm_up(pie_server.ws))
    fds, thread_count = open_fds(pid), threads(pid)
    codes = asyncio.run(fuzz(pie_server.ws))
    assert sum(codes.values()) == CASES  # exactly one reply per frame
    assert "internal" not in codes, codes  # no frame reached an unhandled server error
    assert codes.get("invalid_message", 0) > CASES // 10 and codes.get("invalid_request", 0) > 0
    # The server still serves, and everything the fuzzer touched was reclaimed.
    assert asyncio.run(_hello(pie_server.ws)) == "still here"
    status, health = pie_server.get("/health")
    assert status == 200 and health["status"] == "ok"
    # The instances the fuzzer launched end on their own; the bound only catches a hang.
    stats = until(lambda: (s := pie_server.get("/stats")[1])["instances"] == 0 and s,
                  what="the fuzzer's instances ended")
    r = stats["resources"]
    assert r["kv_pages_free"] == r["kv_pages_total"] and r["embeds_free"] == r["embeds_total"]
    # a leak would grow with the 3000 frames; a few lazily started workers do not
    assert open_fds(pid) <= fds + LEAK_TOLERANCE, fds
    assert threads(pid) <= thread_count + LEAK_TOLERANCE, thread_count


async def _hello(url: str) -> str:
    async with PieClient(url, TOKEN) as client:
        instance = await client.launch("hello", ["still", "here"])
        text = (await instance.recv()).text
        await instance.send("quit")
        await instance.wait()
        return text


async def _warm_up(url: str) -> None:
    """One normal session first, so lazily created threads and sockets exist before counting."""
    await _hello(url)


def test_host_api_fuzzing_gets_errors_not_crashes(pie_server, hf_chat):
    """The probe's `fuzz` mode: thousands of host calls with live, freed and forged ids and
    wild sizes, from two instances at once, beside a normal completion that must not notice."""
    import json

    from pie_server import build

    probe = build("probe")
    args = ["--prompt", "What is the capital of France?", "--max-tokens", "12"]
    expected = [hf_chat("What is the capital of France?", 12)]  # HF's greedy answer

    async def run() -> list:
        async with PieClient(pie_server.ws, TOKEN) as client:
            digest = await client.upload(probe)
            fuzzers = [await client.launch(digest, ["fuzz", "1500", str(seed)]) for seed in (1, 2)]
            bystander = await client.launch("text_completion", args)

            async def collect(instance):
                return [m async for m in instance], await instance.wait()
            return await asyncio.gather(*(collect(i) for i in [*fuzzers, bystander]))

    *fuzzed, (bystander, reason) = asyncio.run(run())
    assert reason == "finished" and bystander == expected
    for messages, end in fuzzed:
        assert end == "finished", end
        counts = json.loads(messages[0])
        assert counts["ok"] + counts["err"] == 1500 and counts["ok"] > 50 and counts["err"] > 500
    r = pie_server.resources()
    assert r["kv_pages_free"] == r["kv_pages_total"] and r["embeds_free"] == r["embeds_total"]
    assert r["exports"] == 0
    assert pie_server.get("/health")[0] == 200


def test_an_undeliverable_message_ends_only_its_instance(pie_server):
    """An inferlet → client message over server.max_message_bytes cannot be delivered: the
    instance ends with the limit named; one under it arrives whole."""
    from pie_server import build, run_inferlet

    probe = build("probe")
    small = run_inferlet(pie_server, probe, ["bigsend", "100000"])
    assert small.reason == "finished" and [len(m) for m in small.messages] == [100000, 5]
    big = run_inferlet(pie_server, probe, ["bigsend", str(2 * 2**20)])
    assert big.messages == []
    assert big.reason == "error: a message of 2097152 bytes exceeds server.max_message_bytes = 1048576"
    r = pie_server.resources()
    assert r["kv_pages_free"] == r["kv_pages_total"]
