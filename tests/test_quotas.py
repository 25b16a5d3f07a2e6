"""Quotas, admission and detached instances through a real `pie serve` (issue 7): what one
instance and one user (auth token) may hold and how fast it may send, the inbox cap, and
instances that outlive their connection."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest

from pie.client import PieClient
from pie.server.rpc import RpcError

from pie_server import HANG_S, TOKEN, Server, build

pytestmark = pytest.mark.anyio
OTHER = "second-user-token-0002"
QUOTAS = {
    "quota.instance": {"queues": 3},
    "quota.user": {"kv_pages": 40, "instances": 4, "messages_per_s": 20.0, "http_requests_per_s": 2.0},
    "server": {"max_pending_messages": 8, "auth_tokens": [TOKEN, OTHER]},
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = Server(tmp_path_factory.mktemp("quotas"), QUOTAS)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def probe() -> bytes:
    return build("probe")


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


def users(server: Server) -> dict:
    return server.get("/stats")[1]["users"]


async def test_user_quotas_span_instances_and_spare_other_users(server, probe):
    """quota.user.kv_pages sums over one token's instances; another token is unaffected;
    an instance's end gives its pages back; quota.user.instances refuses a launch."""
    async with PieClient(server.ws, TOKEN) as mine, PieClient(server.ws, OTHER) as theirs:
        program = await mine.upload(probe)
        await theirs.upload(probe)  # programs belong to their uploaders
        first = await mine.launch(program, ["hold", "30"])
        assert (await first.recv()).text == "held 30"
        second = await mine.launch(program, ["hold", "20"])
        refused = (await second.recv()).text
        assert refused.startswith("out-of-resources: user token-") and \
            "holds 30 kv pages and asks for 20 more: over its quota quota.user.kv_pages = 40" in refused
        other = await theirs.launch(program, ["hold", "30"])  # a user of its own
        assert (await other.recv()).text == "held 30"
        third = await mine.launch(program, ["hold", "1"])
        assert (await third.recv()).text == "held 1"
        fourth = await mine.launch(program, ["hold", "1"])
        with pytest.raises(RpcError, match="launch_refused.*quota.user.instances = 4"):
            await mine.launch(program, ["hold", "1"])
        for instance in (first, second, other, third, fourth):
            await instance.send("done")
            assert await instance.wait() == "finished"
        again = await mine.launch(program, ["hold", "39"])  # everything came back
        assert (await again.recv()).text == "held 39"
        await again.send("done")
        assert await again.wait() == "finished"
    held = users(server)
    assert all(count == 0 for account in held.values() for count in account.values()), held
    assert TOKEN not in str(held) and OTHER not in str(held)  # users are named by fingerprints


async def test_instance_queue_quota(server, probe):
    async with PieClient(server.ws, TOKEN) as client:
        instance = await client.launch(await client.upload(probe), ["queues", "5"])
        message = (await instance.recv()).text
        assert "out-of-resources" in message and "quota quota.instance.queues = 3" in message
        assert await instance.wait() == "finished"


async def test_message_rate_paces_the_sender_and_loses_nothing(server, probe):
    """20 messages/s with one second's burst: 40 messages take at least ~1 s, all arrive."""
    async with PieClient(server.ws, TOKEN) as client:
        program = await client.upload(probe)
        start = time.monotonic()
        instance = await client.launch(program, ["spam", "40"])
        messages = [m async for m in instance]
        elapsed = time.monotonic() - start
        assert messages == [f"m{i}" for i in range(40)] and await instance.wait() == "finished"
        assert elapsed >= 0.9  # a lower bound only: the pacing, not the machine's speed


async def test_http_rate_is_shared_by_the_users_instances(server, probe):
    """quota.user.http_requests_per_s = 2 with one second's burst: 4 instances making one
    request each take at least ~1 s together; every request is still made."""
    async with PieClient(server.ws, TOKEN) as client:
        program = await client.upload(probe)
        start = time.monotonic()
        instances = [await client.launch(program, ["http", "http://127.0.0.1:9/"]) for _ in range(4)]
        answers = [(await instance.recv()).text for instance in instances]
        elapsed = time.monotonic() - start
        assert all(a.startswith("io:") for a in answers), answers  # nothing listens on port 9
        assert elapsed >= 0.9  # a lower bound only: the pacing, not the machine's speed


async def test_inbox_cap_refuses_messages_an_instance_does_not_read(server, probe):
    async with PieClient(server.ws, TOKEN) as client:
        program = await client.upload(probe)
        waiting = await client.launch(program, ["subscribe", "never"])  # reads no inbox
        assert (await waiting.recv()).text == "subscribed"
        for i in range(8):
            await waiting.send(f"unread {i}")
        with pytest.raises(RpcError, match="inbox_full.*8 unread messages.*max_pending_messages = 8"):
            await waiting.send("one too many")
        await waiting.terminate()
        assert await waiting.wait() == "terminated by client"


async def test_detached_instance_survives_disconnect_and_is_attached_later(server, probe):
    """Detached: the connection closes, the instance runs on; with 8 messages held its sends
    wait (nothing is dropped); a later connection of the same user attaches and gets all of
    them in order, then the end. Another user cannot attach; a plain instance is ended."""
    async with PieClient(server.ws, TOKEN) as client:
        program = await client.upload(probe)
        # It starts sending only on a broadcast, so nothing is in flight when we disconnect.
        detached = await client.launch(program, ["spam", "30", "go-detached"], detached=True)
        assert (await detached.recv()).text == "waiting"
        plain = await client.launch(program, ["hold", "1"])
    async with PieClient(server.ws, TOKEN) as client:
        trigger = await client.launch(program, ["broadcast", "go-detached", "now"])
        assert await trigger.wait() == "finished"

        async def summary():
            return {i.id: i for i in await client.list_instances()}[detached.id]

        # It sends until 8 are held (server.max_pending_messages), then its send waits: the
        # count stops at 8 and it runs on (were messages dropped, it would end; were they
        # held without bound, the count would pass 8).
        deadline = asyncio.get_running_loop().time() + HANG_S
        while (seen := await summary()).held < 8:
            assert asyncio.get_running_loop().time() < deadline, "8 messages never held"
            await asyncio.sleep(0.05)
        assert (seen.held, seen.state, seen.attached) == (8, "running", False)
    async with PieClient(server.ws, OTHER) as stranger:
        with pytest.raises(RpcError, match="unknown_instance"):
            await stranger.attach(detached.id)
    async with PieClient(server.ws, TOKEN) as client:
        listed = {i.id: i for i in await client.list_instances()}
        assert plain.id not in listed  # ended with its connection
        assert listed[detached.id].state == "running" and not listed[detached.id].attached
        assert listed[detached.id].held == 8  # still waiting
        instance = await client.attach(detached.id)
        assert [m async for m in instance] == [f"m{i}" for i in range(30)]
        assert await instance.wait() == "finished"
        assert await client.list_instances() == []


async def test_terminate_newest_policy_frees_pages_for_older_instances(tmp_path, probe):
    """control.kv_pressure = terminate-newest (the paper's FCFS, opt-in): an older instance
    short of pages ends newer ones, which are told why; the newest one short of pages is
    not helped — it waits (bounded) and gets out-of-resources."""
    server = Server(tmp_path, {"backend": {"num_kv_pages": 64},
                               "control": {"kv_pressure": "terminate-newest", "alloc_wait_ms": 3000.0}})
    try:
        async with PieClient(server.ws, TOKEN) as client:
            program = await client.upload(probe)
            older = await client.launch(program, ["hold", "10"])
            assert (await older.recv()).text == "held 10"
            newer = await client.launch(program, ["hold", "50"])
            assert (await newer.recv()).text == "held 50"
            await older.send("20")  # 4 free: the newer instance must go
            assert (await older.recv()).text == "held 20"
            assert await newer.wait() == ("error: terminated to free kv pages for an older instance "
                                          "(control.kv_pressure = terminate-newest)")
            newest = await client.launch(program, ["hold", "40"])  # 34 free, nobody newer
            message = (await newest.recv()).text
            assert message.startswith("out-of-resources: 40 kv pages requested, 34 free of 64 after waiting")
            for instance in (older, newest):
                await instance.send("done")
                assert await instance.wait() == "finished"
        assert server.resources()["kv_pages_free"] == 64
    finally:
        server.stop()


def test_cli_run_detach_ps_and_attach(server, hf_chat):
    """`pie run --detach` prints the id and returns; `pie ps` lists it; `pie attach` prints
    its output (held while nobody followed: HF's greedy answer) and exits 0 once it finished."""
    base = [sys.executable, "-m", "pie.cli"]
    where = ["--server", f"http://{server.address}", "--token", TOKEN]
    launched = subprocess.run(base + ["run", "text_completion", *where, "--detach", "--",
                                      "--prompt", "Say hi.", "--max-tokens", "8"],
                              capture_output=True, text=True, timeout=120)
    assert launched.returncode == 0, launched.stderr
    instance_id = launched.stdout.strip()
    listing = subprocess.run(base + ["ps", *where], capture_output=True, text=True, timeout=60)
    assert listing.returncode == 0 and instance_id in listing.stdout and "text_completion" in listing.stdout
    attached = subprocess.run(base + ["attach", instance_id, *where], capture_output=True, text=True,
                              timeout=120)
    assert attached.returncode == 0, attached.stderr
    assert attached.stdout == hf_chat("Say hi.", 8) + "\n"  # the completion
    again = subprocess.run(base + ["attach", instance_id, *where], capture_output=True, text=True,
                           timeout=60)
    assert again.returncode == 1 and "unknown_instance" in again.stderr  # collected already
