"""Several backend replicas behind one control layer (`backend.replicas`, issue 22 item 1):
placement, statistics merged over replicas, and one real `pie serve --replicas 2` whose
replicas each serve HF's greedy output, keep a launch near its cached prefix, and survive
one of them being killed."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
from dataclasses import dataclass

import pytest

from pie import protocol as P
from pie.client import PieClient
from pie.control.backend_link import BackendError
from pie.control.controller import merged
from pie.control.placement import BLOCK_BYTES, Placement, PrefixMemory, blocks
from pie.server.serve import common_handshake, cpu_shares
from tests.pie_server import ADMIN, TOKEN, Server, until, until_async


@dataclass
class FakeReplica:
    index: int
    live: int = 0
    serving: bool = True


def test_blocks_name_their_whole_prefix_per_program():
    a = blocks("p", ["--prompt", "x" * 200])
    assert len(a) == 4  # 209 bytes: 3 whole blocks and a part
    assert blocks("p", ["--prompt", "x" * 200 + "y"])[:3] == a[:3]
    assert blocks("p", ["--prompt", "z" + "x" * 199])[0] != a[0]
    assert blocks("q", ["--prompt", "x" * 200])[0] != a[0]  # another program's prompt is not its cache
    memory = PrefixMemory(capacity=3)
    memory.remember(a)
    assert memory.matched(a) == 3  # the 3 newest keys are kept: the tail block went first
    memory.forget()
    assert memory.matched(a) == 0


def test_least_loaded_placement_and_replicas_that_do_not_serve():
    replicas = [FakeReplica(0, live=3), FakeReplica(1, live=1), FakeReplica(2, live=1)]
    placement = Placement("least-loaded", 4, 3)
    assert placement.choose(replicas, "p", ["a"]).index == 1  # fewest, then the lowest index
    replicas[1].serving = False
    assert placement.choose(replicas, "p", ["a"]).index == 2
    for r in replicas:
        r.serving = False
    assert placement.choose(replicas, "p", ["a"]) is None


def test_cache_aware_placement_follows_the_prefix_until_load_differs_too_much():
    replicas = [FakeReplica(0), FakeReplica(1)]
    placement = Placement("cache-aware", 2, 2)
    system = ["--message", "system", "s" * (4 * BLOCK_BYTES)]
    first = placement.choose(replicas, "p", [*system, "--message", "user", "hi"])
    first.live += 1
    # A launch with the same long system prompt goes where the first one went ...
    second = placement.choose(replicas, "p", [*system, "--message", "user", "bye"])
    assert second is first
    second.live += 1
    # ... one with another prompt to the least loaded
    other = placement.choose(replicas, "p", ["--prompt", "something else"])
    assert other is not first
    # Past control.placement_imbalance live instances apart, load decides.
    first.live = 2 + other.live + 1
    assert placement.choose(replicas, "p", [*system, "--message", "user", "again"]) is other
    # That launch taught `other` the prefix too; a restarted replica's cache is empty, and
    # its remembered prefixes go with it.
    first.live = other.live = 0
    placement.forget(first.index)
    assert placement.choose(replicas, "p", [*system, "x"]) is other
    placement.forget(other.index)
    assert placement.choose(replicas, "p", [*system, "y"]).index == 0  # no match: least loaded, lowest index


def test_statistics_of_replicas_merge_into_one():
    a = {"calls": {"pass": 6}, "batches": {"pass": 3}, "mean_batch_size": 2.0, "mean_wait_ms": 1.0,
         "max_wait_ms": 5.0, "queued": {}, "steps": 3}
    b = {"calls": {"pass": 2, "copy_kvpage": 2}, "batches": {"pass": 1, "copy_kvpage": 1}, "mean_batch_size": 2.0,
         "mean_wait_ms": 4.0, "max_wait_ms": 2.0, "queued": {"pass": 1}, "steps": 1}
    m = merged([a, b])
    assert m["calls"] == {"pass": 8, "copy_kvpage": 2} and m["queued"] == {"pass": 1} and m["steps"] == 4
    assert m["max_wait_ms"] == 5.0 and m["mean_batch_size"] == 10 / 5
    assert m["mean_wait_ms"] == pytest.approx((6 * 1.0 + 4 * 4.0) / 10)
    cache = merged([{"lookup_tokens": 10, "hit_tokens": 5, "hit_rate": 0.5, "policy": "x"},
                    {"lookup_tokens": 30, "hit_tokens": 5, "hit_rate": 1 / 6, "policy": "x"}])
    assert cache == {"lookup_tokens": 40, "hit_tokens": 10, "hit_rate": 0.25, "policy": "x"}
    assert merged([a]) is a


def test_replicas_must_agree_and_pinning_needs_a_core_each():
    hello = P.HandshakeReply(
        protocol_version=P.PROTOCOL_VERSION, model_name="m", traits=[], page_size=16, num_kv_pages=8,
        num_embeds=100, vocab_size=10, hidden_size=4, max_batch_tokens=64, tokenizer_json="{}",
        eos_token_ids=[2], bos_token_id=1, chat_template="", dtype="float32", device="cpu")
    assert common_handshake([hello, hello]) is hello
    other = P.HandshakeReply(**{**dataclasses.asdict(hello), "num_kv_pages": 16})
    with pytest.raises(BackendError, match="replica 1 differs from replica 0 in num_kv_pages"):
        common_handshake([hello, other])
    cores = len(os.sched_getaffinity(0))
    assert sum(len(s) for s in cpu_shares(cores)) == cores
    with pytest.raises(BackendError, match="a core per replica"):
        cpu_shares(cores + 1)


# --- a real server with two replicas ------------------------------------------------------------

STORY = ["--prompt", "Write a long story about a dragon.", "--max-tokens", "4000"]


def replicas(server: Server) -> list[dict]:
    return server.get("/stats", ADMIN)[1]["replicas"]


def backend_pid(server: Server, replica: int) -> int:
    endpoint = replicas(server)[replica]["endpoint"]
    return next(pid for pid in server.backend_pids() if endpoint in server.cmdline(pid))


async def generate(server: Server, arguments: list[str]) -> tuple[list[str], str]:
    async with PieClient(server.ws, TOKEN) as client:
        instance = await client.launch("text_completion", arguments)
        return [m async for m in instance], await instance.wait()


def test_two_replicas_place_serve_and_survive_one_dying(tmp_path, hf_chat):
    server = Server(tmp_path, {"backend": {"replicas": 2}})
    try:
        status, health = server.get("/health")
        assert status == 200 and [r["status"] for r in health["replicas"]] == ["ok", "ok"]
        prompts = ["What is the capital of France?", "Name three colors.", "What is 2 + 2?"]

        async def three() -> list[tuple[list[str], str]]:
            return await asyncio.gather(*(generate(server, ["--prompt", p, "--max-tokens", "16"]) for p in prompts))

        for (messages, reason), prompt in zip(asyncio.run(three()), prompts):
            assert reason == "finished" and messages == [hf_chat(prompt, 16)]
        launched = [r["launched"] for r in replicas(server)]
        assert min(launched) >= 1 and sum(launched) == 3  # both replicas took launches

        # The same prompt again runs where its pages are cached: that replica's prefix cache hits.
        before = replicas(server)
        [(messages, reason)] = [asyncio.run(generate(server, ["--prompt", prompts[0], "--max-tokens", "16"]))]
        after = replicas(server)
        (where,) = [i for i in range(2) if after[i]["launched"] > before[i]["launched"]]
        assert messages == [hf_chat(prompts[0], 16)]
        assert after[where]["resources"]["prefix_cache"]["hit_tokens"] > \
            before[where]["resources"]["prefix_cache"]["hit_tokens"]

        async def one_dies() -> tuple[tuple[list[str], str], tuple[list[str], str], int]:
            async with PieClient(server.ws, TOKEN) as client:
                doomed = await client.launch("text_completion", STORY)
                placed = await until_async(lambda: [r["replica"] for r in replicas(server) if r["instances"]],
                                           what="the first instance placed")
                victim = placed[0]
                survivor = await client.launch("text_completion", ["--prompt", prompts[1], "--max-tokens", "96"])
                await until_async(lambda: all(r["instances"] == 1 for r in replicas(server)),
                                  what="one instance on each replica")
                await until_async(lambda: replicas(server)[victim]["scheduler"]["calls"].get("pass", 0)
                                  > before[victim]["scheduler"]["calls"].get("pass", 0) + 2, what="decoding")
                os.kill(backend_pid(server, victim), signal.SIGKILL)

                async def collect(instance):
                    return [m async for m in instance], await instance.wait()

                return await collect(doomed), await collect(survivor), victim

        (lost, lost_reason), (kept, kept_reason), victim = asyncio.run(one_dies())
        assert lost == [] and f"backend replica {victim} process exited" in lost_reason
        assert "restarted" in lost_reason
        assert kept_reason == "finished" and kept == [hf_chat(prompts[1], 96)]

        def back() -> bool:
            status, health = server.get("/health")
            return status == 200 and health["status"] == "ok"

        until(back, what="the killed replica restarted", interval_s=0.5)
        assert all(r["status"] == "ok" for r in replicas(server))
        [(messages, reason)] = [asyncio.run(generate(server, ["--prompt", prompts[2], "--max-tokens", "16"]))]
        assert reason == "finished" and messages == [hf_chat(prompts[2], 16)]
        def pools_full() -> list[dict] | None:
            rs = replicas(server)
            return rs if all(r["resources"]["kv_pages_free"] == r["resources"]["kv_pages_total"]
                             for r in rs) else None

        for r in until(pools_full, what="every page back in both pools"):
            assert r["resources"]["embeds_free"] == r["resources"]["embeds_total"]
    finally:
        server.stop()
