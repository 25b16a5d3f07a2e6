"""Bounded server-side buffers through a real `pie serve` (security audit, finding 3):
what a client that stops reading, a huge HTTP response, never-read subscriptions and
inboxes, and uploads spread over many connections can make the server hold; plus the
RPC frames with non-string keys, HTTP to the server's own port, and /stats per user.

Every test watches the resident memory (VmRSS) of the `pie serve` process, and afterwards
the /stats pools and the RSS must come back near where they were (`settled`). The bounds,
in MiB over the RSS before the test:

- PEAK_MIB = 32 while a test runs. The limits set below let the server hold a few MiB at
  most (an outbox of 1 MiB, backlogs of 512 KiB, HTTP bodies of 1 MiB, 12 MiB of uploads
  declared but never sent); the rest is margin for the allocator. Measured: at most +2.3
  MiB. Without the limits the same tests grew it by more: past 64 MiB within seconds for a
  client that reads nothing (3 million messages queued), +78 MiB for one 200 MB HTTP body.
- SETTLED_MIB = 16 afterwards: what the allocator may keep of what it was given back.
  Measured: at most +2 MiB per test (before the limits: +89 MiB after the HTTP test).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable

import msgpack
import pytest
import websockets

from pie.client import PieClient
from pie.control.quotas import fingerprint
from pie.server import rpc
from pie.server.rpc import RpcError

from pie_server import TOKEN, Server, ToolServer, build, read_until_closed, slow_reader

pytestmark = pytest.mark.anyio

OTHER = "other-user-token-0003"
ADMIN = "admin-token-00000004"
MIB = 2**20
PEAK_MIB = 32
SETTLED_MIB = 16
LIMITS = {
    "server": {
        "auth_tokens": [TOKEN, OTHER], "admin_tokens": [ADMIN],
        "max_message_bytes": 256 * 1024, "max_pending_bytes": 512 * 1024, "max_pending_messages": 64,
        "max_outbox_bytes": MIB, "slow_client_timeout_s": 2.0,
        "max_user_upload_bytes": 8 * MIB, "max_total_upload_bytes": 12 * MIB,
    },
    "control": {"http_max_response_bytes": MIB},
}


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = Server(tmp_path_factory.mktemp("buffers"), LIMITS)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def tools():
    tools = ToolServer()
    yield tools
    tools.stop()


@pytest.fixture(scope="module")
def program(server, tools) -> str:
    """The probe, uploaded public (every user may launch it), and the server warmed up:
    each kind of work the tests do has run once, so the RSS baseline includes it."""
    async def warm_up() -> str:
        async with PieClient(server.ws, TOKEN) as client:
            program = await client.upload(build("probe"), public=True)
            for args in (["spam", "2000"], ["http", f"{tools.url}/bytes?n=1000"], ["hold", "1"]):
                instance = await client.launch(program, args)
                if args[0] == "hold":
                    await instance.send("done")
                await instance.wait()
            return program

    return asyncio.run(warm_up())


def stats(server: Server, token: str = ADMIN) -> dict:
    status, body = server.get("/stats", token)
    assert status == 200, body
    return body


def live(server: Server) -> int:
    return stats(server)["instances"]


@pytest.fixture(autouse=True)
def settled(server, program):
    """Each test starts and ends with no instance running, full pools, and the RSS near
    where it was before the test."""
    before = server.rss_mib()
    pools = {k: v for k, v in stats(server)["resources"].items() if k != "exports"}
    yield before
    deadline = time.monotonic() + 120  # only a leak (or a hang) takes this long
    while True:
        now = stats(server)
        rss = server.rss_mib()
        done = (now["instances"] == 0 and rss - before <= SETTLED_MIB
                and {k: v for k, v in now["resources"].items() if k != "exports"} == pools)
        if done or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    print(f"RSS before {before:.0f} MiB, after {rss:.0f} MiB")  # shown with -s
    assert now["instances"] == 0
    assert {k: v for k, v in now["resources"].items() if k != "exports"} == pools
    assert rss - before <= SETTLED_MIB, f"RSS {before:.0f} MiB before the test, {rss:.0f} MiB after"


async def peak_rss(server: Server, work: Awaitable, stop_above_mib: float = PEAK_MIB):
    """Run `work` while sampling the server's RSS; (its result, the peak growth in MiB).
    Gives up on `work` once the growth passes `stop_above_mib` (then the result is None)."""
    before = server.rss_mib()
    peak = 0.0
    task = asyncio.ensure_future(work)
    while not task.done():
        peak = max(peak, server.rss_mib() - before)
        if peak > stop_above_mib:
            task.cancel()
            break
        await asyncio.wait({task}, timeout=0.05)
    print(f"RSS peak +{peak:.1f} MiB", end="; ")
    try:
        return await task, peak
    except asyncio.CancelledError:
        return None, peak


async def raw_call(ws, table: dict | bytes) -> dict:
    await ws.send(table if isinstance(table, bytes) else msgpack.packb(table))
    return msgpack.unpackb(await ws.recv())


# --- (a) a client that stops reading -----------------------------------------------------------


async def test_a_client_that_stops_reading_is_cut_off_and_memory_stays_bounded(server, program):
    """The probe sends 3 million messages to a client that reads nothing. Its sends wait
    once server.max_outbox_bytes (1 MiB) are queued; after server.slow_client_timeout_s
    (2 s) it is ended and the connection closed, saying why. The client, reading at last,
    gets what was queued, in order, then the end, then the close frame. (Before, the
    server queued every message: hundreds of MB.)"""
    async with slow_reader(server.ws) as ws:
        await raw_call(ws, {"type": "authenticate", "corr_id": 1, "token": TOKEN})
        reply = await raw_call(ws, {"type": "launch", "corr_id": 2, "program": program,
                                    "arguments": ["spam", "3000000"]})
        instance_id = reply["value"]
        start = time.monotonic()

        async def until_ended() -> float:
            while live(server):
                await asyncio.sleep(0.1)
            return time.monotonic() - start

        ended_after, peak = await peak_rss(server, asyncio.wait_for(until_ended(), 90))
        print(f"ended after {ended_after:.1f} s", end="; ")
        assert peak <= PEAK_MIB, f"the server's RSS grew by {peak:.0f} MiB for a client that reads nothing"
        # A lower bound only (the timeout it waited out); a loaded machine can only add to it.
        assert ended_after >= 2
        frames, close = await read_until_closed(ws)
    reason = ("the client stopped reading: {} bytes unread for 2 s "
              "(server.max_outbox_bytes, server.slow_client_timeout_s)")
    assert close.code == 1008 and close.reason.startswith("the client stopped reading: ")
    assert close.reason == reason.format(close.reason.split()[4])
    texts = [f["text"] for f in frames if f["type"] == "instance_message"]
    assert 0 < len(texts) < 3_000_000
    assert texts == [f"m{i}" for i in range(len(texts))]
    assert frames[-1]["type"] == "instance_terminated" and frames[-1]["instance_id"] == instance_id
    assert frames[-1]["reason"] == close.reason


async def test_large_messages_to_a_client_that_stops_reading_stay_bounded(server, program):
    """The audit's case at this server's message cap: 1,000 messages of 200 kB (200 MB; the
    audit sent 1,000 x 1 MB and the server held ~1 GB) to a client that reads nothing: the
    server holds about max_outbox_bytes, then ends the instance."""
    async with slow_reader(server.ws) as ws:
        await raw_call(ws, {"type": "authenticate", "corr_id": 1, "token": TOKEN})
        await raw_call(ws, {"type": "launch", "corr_id": 2, "program": program,
                            "arguments": ["flood", "1000", "200000"]})

        async def until_ended() -> None:
            while live(server):
                await asyncio.sleep(0.1)

        _, peak = await peak_rss(server, asyncio.wait_for(until_ended(), 90))
        assert peak <= PEAK_MIB, f"the server's RSS grew by {peak:.0f} MiB for a client that reads nothing"
        frames, close = await read_until_closed(ws)
    assert close.code == 1008 and close.reason.startswith("the client stopped reading: ")
    assert 0 < sum(f["type"] == "instance_message" for f in frames) < 1000


# --- (b) a large HTTP response ----------------------------------------------------------------


async def test_a_large_http_body_is_cut_at_the_cap_without_reading_it(server, program, tools):
    """A 200 MB body (the tool server's /bytes, streamed without a Content-Length) fails with
    an `io` error naming control.http_max_response_bytes (1 MiB) once that much has been
    read; a small one is read. (Before, the whole 200 MB was read, then decoded.)"""
    async with PieClient(server.ws, TOKEN) as client:
        small = await client.launch(program, ["http", f"{tools.url}/bytes?n=1000"])
        assert [m async for m in small] == ["200 " + "x" * 1000]

        async def fetch_big() -> list[str]:
            big = await client.launch(program, ["http", f"{tools.url}/bytes?n=200000000"])
            return [m async for m in big]

        messages, peak = await peak_rss(server, fetch_big())
    assert peak <= PEAK_MIB, f"the server's RSS grew by {peak:.0f} MiB for one HTTP response"
    [message] = messages
    assert message.startswith(f"io: GET {tools.url}/bytes?n=200000000: the response body exceeds "
                              f"control.http_max_response_bytes = {MIB} (stopped reading after ")


# --- (c) a subscription nobody reads ----------------------------------------------------------


async def test_a_subscription_nobody_reads_keeps_at_most_max_pending_bytes(server, program):
    """A detached `spam N TOPIC` subscribes, reads one broadcast, then sends messages
    until 64 are held (server.max_pending_messages) and waits for an attach, never reading
    its subscription again. Ten broadcasts of 200 KB: the subscription keeps the newest two
    (server.max_pending_bytes = 512 KiB) and drops eight, counted in /stats. (Before, it
    kept all ten: 64 unread broadcasts of up to 1 MiB each per subscription.)"""
    async with PieClient(server.ws, TOKEN) as client:
        subscriber = await client.launch(program, ["spam", "100000000", "topic-c"], detached=True)
        assert (await subscriber.recv()).text == "waiting"
        go = await client.launch(program, ["broadcast", "topic-c", "go"])
        assert await go.wait() == "finished"
        # It has read "go" (were "go" still in its backlog, it would count among the drops).
        assert (await subscriber.recv()).text == "m0"
    dropped = stats(server)["broadcasts_dropped"]
    async with PieClient(server.ws, TOKEN) as client:
        async def broadcast_ten() -> None:
            for i in range(10):
                broadcast = await client.launch(program, ["broadcast", "topic-c", f"{i}" * 200_000])
                assert await broadcast.wait() == "finished"

        _, peak = await peak_rss(server, broadcast_ten())
        assert stats(server)["broadcasts_dropped"] - dropped == 8
        again = await client.attach(subscriber.id)
        await again.terminate()
        assert await again.wait() == "terminated by client"
    assert peak <= PEAK_MIB


# --- (d) an inbox nobody reads ----------------------------------------------------------------


async def test_an_inbox_nobody_reads_holds_at_most_max_pending_bytes(server, program):
    """`subscribe` waits on a topic and never reads its inbox: two messages of 200 KB are
    taken, the third is refused with inbox_full naming server.max_pending_bytes. (Before,
    64 messages of up to 1 MiB each were taken per instance.)"""
    async with PieClient(server.ws, TOKEN) as client:
        waiting = await client.launch(program, ["subscribe", "topic-d"])
        assert (await waiting.recv()).text == "subscribed"
        for i in range(2):
            await waiting.send(f"{i}" * 200_000)
        with pytest.raises(RpcError) as e:
            await waiting.send("2" * 200_000)
        assert e.value.code == "inbox_full"
        assert e.value.message == ("the instance has 400000 bytes of unread messages; 200000 more would "
                                   "exceed server.max_pending_bytes = 524288")
        await waiting.send("small")  # what fits still goes in
        await waiting.terminate()
        assert await waiting.wait() == "terminated by client"


# --- (e) uploads spread over connections -----------------------------------------------------


async def test_uploads_in_progress_are_bounded_per_user_and_server_wide(server, program):
    """Declared uploads count against server.max_user_upload_bytes (8 MiB) over all of a
    user's connections and server.max_total_upload_bytes (12 MiB) over everyone's, until
    they end or their connection closes. (Before, each connection had its own
    max_upload_bytes: any number of connections times 64 MiB.)"""
    async with PieClient(server.ws, TOKEN) as mine, PieClient(server.ws, TOKEN) as also_mine, \
            PieClient(server.ws, OTHER) as theirs, PieClient(server.ws, ADMIN) as admins:
        await mine._call(rpc.UploadBegin, sha256="1" * 64, size=5 * MIB)
        with pytest.raises(RpcError) as e:
            await also_mine._call(rpc.UploadBegin, sha256="2" * 64, size=5 * MIB)
        assert e.value.code == "upload_too_large"
        assert "server.max_user_upload_bytes = 8388608" in e.value.message
        await theirs._call(rpc.UploadBegin, sha256="3" * 64, size=5 * MIB)
        with pytest.raises(RpcError) as e:
            await admins._call(rpc.UploadBegin, sha256="4" * 64, size=5 * MIB)
        assert e.value.code == "upload_too_large"
        assert "server.max_total_upload_bytes = 12582912" in e.value.message
        await mine.close()  # its upload is dropped and its bytes given back
        deadline = time.monotonic() + 120  # bounds a hang only
        while True:
            try:
                await admins._call(rpc.UploadBegin, sha256="4" * 64, size=5 * MIB)
                break
            except RpcError:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
        # Up to the bound exactly: 5 + 5 + 2 MiB in progress.
        await also_mine._call(rpc.UploadBegin, sha256="5" * 64, size=2 * MIB)
        assert await also_mine._call(rpc.UploadChunk, sha256="5" * 64, data=b"x" * MIB) == MIB


# --- RPC frames with non-string keys ----------------------------------------------------------


async def test_frames_with_non_string_keys_get_an_error_reply(server, program):
    async with websockets.connect(server.ws) as ws:
        reply = await raw_call(ws, msgpack.packb({"type": "authenticate", "corr_id": 1, b"token": TOKEN,
                                                  "x": 1}, use_bin_type=True))
        assert (reply["corr_id"], reply["code"]) == (1, "invalid_request")
        assert "map keys must be strings" in reply["message"]
        reply = await raw_call(ws, msgpack.packb({b"type": "authenticate", b"corr_id": 2}, use_bin_type=True))
        assert (reply["corr_id"], reply["code"]) == (None, "invalid_message")
        reply = await raw_call(ws, {"type": "authenticate", "corr_id": 3, "token": TOKEN})
        assert reply == {"type": "ok", "corr_id": 3, "value": None}
        reply = await raw_call(ws, {"type": "list_instances", "corr_id": 4})
        assert reply == {"type": "ok", "corr_id": 4, "value": []}


# --- HTTP to the server itself ----------------------------------------------------------------


async def test_http_to_the_servers_own_port_is_refused(server, program, tools):
    """Loopback is on the default control.http_allowlist (the tool server lives there), but
    not the port the Pie server listens on: an inferlet must not read /stats or reach /ws
    and /v1 of the server it runs on. (Before, `http http://127.0.0.1:PORT/stats` worked.)"""
    port = server.address.rsplit(":", 1)[1]
    async with PieClient(server.ws, TOKEN) as client:
        for url in (f"http://127.0.0.1:{port}/stats", f"http://localhost:{port}/health"):
            instance = await client.launch(program, ["http", url])
            [message] = [m async for m in instance]
            host = url.split("/")[2].split(":")[0]
            assert message == (f"permission-denied: {host}:{port} is this Pie server's own address: "
                               f"inferlets may not send requests to the server they run on "
                               f"(control.http_allowlist allows {host!r} for other ports only)")
        instance = await client.launch(program, ["http", f"{tools.url}/bytes?n=5"])
        assert [m async for m in instance] == ["200 xxxxx"]  # loopback still works


# --- /stats per user --------------------------------------------------------------------------


async def test_stats_show_a_user_only_its_own_usage(server, program):
    async with PieClient(server.ws, TOKEN) as mine, PieClient(server.ws, OTHER) as theirs:
        holders = []
        for client in (mine, theirs):
            holder = await client.launch(program, ["hold", "2"])
            assert (await holder.recv()).text == "held 2"
            holders.append(holder)
        assert set(stats(server, TOKEN)["users"]) == {fingerprint(TOKEN)}
        assert set(stats(server, OTHER)["users"]) == {fingerprint(OTHER)}
        assert {fingerprint(TOKEN), fingerprint(OTHER)} <= set(stats(server, ADMIN)["users"])
        assert stats(server, TOKEN)["instances"] == 1 and stats(server, ADMIN)["instances"] == 2
        assert server.get("/v1/models", ADMIN)[0] == 200  # an admin is a user everywhere
        for holder in holders:
            await holder.send("done")
            assert await holder.wait() == "finished"
