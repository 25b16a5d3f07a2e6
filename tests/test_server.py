"""The server layer (pie/server, pie/client.py) against a fake runtime: a real uvicorn on a
free port, the real client, and raw WebSocket frames for malformed input."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import queue
import threading
import time
import uuid
from collections.abc import Iterator

import httpx
import msgpack
import pytest
import uvicorn
import websockets

from pie.client import PieClient, PieConnectionError, ws_url
from pie.config import ServerConfig
from pie.server import rpc
from pie.server.app import ServerState, create_app, ws_max_size
from pie.server.rpc import RpcError

# The runtime's real exception and record types; only its behaviour is faked below.
from pie.runtime.runtime import (
    InstanceInfo,
    InvalidProgram,
    LaunchRefused,
    UnknownInstance,
    UnknownProgram,
)
from pie_server import read_until_closed, slow_reader

pytestmark = pytest.mark.anyio

ALICE, BOB = "alice-token-00001", "bob-token-0000001"
COMPONENT = b"\0asm" + bytes(range(256)) * 10_000  # 2.5 MB: three upload chunks


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


# --- a fake runtime ------------------------------------------------------------------------




class FakePrograms:
    def __init__(self) -> None:
        self.stored: dict[str, bytes] = {}
        self.public: set[str] = set()
        self.adds = 0

    def add(self, data: bytes, owner: str | None = None, public: bool = False) -> str:
        self.adds += 1
        if not data.startswith(b"\0asm"):
            raise InvalidProgram("not a WebAssembly component")
        digest = hashlib.sha256(data).hexdigest()
        self.stored[digest] = data
        if public:
            self.public.add(digest)
        return digest

    def exists(self, digest: str, user: str = "anonymous") -> bool:
        return digest in self.stored

    def builtin_names(self) -> list[str]:
        return sorted(FakeRuntime.BUILTINS)


class FakeRuntime:
    """The runtime's interface with toy programs, each instance on its own thread calling
    `on_event` from there: echo (echoes messages; "bye" finishes it), hello (one greeting
    with its arguments, after a log line when the client asked for logs, then finishes), trap (traps), eager (sends a message from inside
    `launch`, before it returns), flood (arguments SIZE COUNT: sends COUNT messages of SIZE
    bytes as fast as the server lets it, waiting where the runtime would). Uploaded programs
    behave like hello."""

    BUILTINS = ("echo", "hello", "trap", "eager", "flood")

    def __init__(self, max_instances: int = 8):
        self.programs = FakePrograms()
        self.max_instances = max_instances
        self.lock = threading.Lock()
        self.live: dict[str, tuple[InstanceInfo, queue.Queue]] = {}
        self.terminations: list[tuple[str, str]] = []  # terminate() calls
        self.posted: dict[str, int] = {}  # messages each instance has sent
        self.waiting: set[str] = set()  # instances now waiting for room (the backpressure)
        self.stalled: dict[str, int] = {}  # a flood's polls for room since its last message
        self.stats_for: list[str | None] = []  # the `user` of each stats() call

    def stats(self, user: str | None = None) -> dict:
        self.stats_for.append(user)
        return {"instances": len(self.live), "users": {}}

    def replica_health(self) -> list[dict]:
        return [{"replica": 0, "status": "ok"}]

    def launch(self, program, arguments, on_event, user="anonymous", on_log=None) -> InstanceInfo:
        if program not in self.BUILTINS and not self.programs.exists(program):
            raise UnknownProgram(f"no program {program!r}")
        name = program if program in self.BUILTINS else None
        info = InstanceInfo(uuid.uuid4().hex, hashlib.sha256(program.encode()).hexdigest(), name,
                            list(arguments), time.time(), user)
        inbox: queue.Queue = queue.Queue()
        with self.lock:
            if len(self.live) >= self.max_instances:
                raise LaunchRefused(f"runtime.max_instances = {self.max_instances} reached")
            self.live[info.id] = (info, inbox)
        if name == "eager":
            on_event(info.id, "message", "early")
        threading.Thread(target=self._run, args=(info, inbox, on_event, on_log), daemon=True).start()
        return info

    def _run(self, info: InstanceInfo, inbox: queue.Queue, on_event, on_log) -> None:
        reason = "finished"
        if info.name == "echo":
            while (message := inbox.get()) != "bye":
                if isinstance(message, tuple):  # ("stop", reason) from terminate()
                    reason = message[1]
                    break
                if room := on_event(info.id, "message", message):
                    self.waiting.add(info.id)
                    room.wait()  # the runtime's backpressure (held messages of a detached instance)
                    self.waiting.discard(info.id)
        elif info.name == "trap":
            reason = "trap: unreachable"
        elif info.name == "flood":
            reason = self._flood(info, inbox, on_event, int(info.arguments[0]), int(info.arguments[1]))
        elif info.name != "eager":
            if on_log is not None:  # a client that asked for the log
                on_log(info.id, "info", "about to say hello")
            on_event(info.id, "message", "hello " + " ".join(info.arguments))
        with self.lock:
            self.live.pop(info.id, None)
        on_event(info.id, "terminated", reason)

    def _flood(self, info: InstanceInfo, inbox: queue.Queue, on_event, size: int, count: int) -> str:
        def stopped() -> str | None:
            while not inbox.empty():
                if isinstance(message := inbox.get_nowait(), tuple):
                    return message[1]
            return None

        for i in range(count):
            if reason := stopped():
                return reason
            self.posted[info.id] = i + 1
            self.stalled[info.id] = 0
            room = on_event(info.id, "message", f"{i:08d}".ljust(size, "x"))
            while room is not None and not room.wait(0.02):  # waits as the runtime does
                self.stalled[info.id] += 1
                if reason := stopped():
                    return reason
        return "finished"

    def _inbox(self, instance_id: str) -> queue.Queue:
        with self.lock:
            if instance_id not in self.live:
                raise UnknownInstance(f"no live instance {instance_id!r}")
            return self.live[instance_id][1]

    def send(self, instance_id: str, message: str) -> None:
        self._inbox(instance_id).put(message)

    def terminate(self, instance_id: str, reason: str = "terminated by client") -> None:
        inbox = self._inbox(instance_id)
        self.terminations.append((instance_id, reason))
        inbox.put(("stop", reason))

    def list_instances(self) -> list[InstanceInfo]:
        with self.lock:
            return [info for info, _ in self.live.values()]

    def shutdown(self) -> None:
        for info in self.list_instances():
            self.terminate(info.id, "server shutting down")


# --- harness -------------------------------------------------------------------------------


@contextlib.contextmanager
def serving(state: ServerState) -> Iterator[str]:
    """A real uvicorn serving the app on a free port in a thread; yields its http:// URL."""
    server = uvicorn.Server(uvicorn.Config(
        create_app(state), host="127.0.0.1", port=0, lifespan="off", log_config=None,
        log_level="warning", ws_max_size=ws_max_size(state.config)))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        assert thread.is_alive(), "uvicorn did not start"
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.fixture
def fake() -> FakeRuntime:
    return FakeRuntime(max_instances=3)


@pytest.fixture
def url(fake) -> Iterator[str]:
    with serving(ServerState(ServerConfig(max_message_bytes=1000), fake, "fake-model")) as base:
        yield base


async def eventually(predicate, timeout_s: float = 120.0) -> None:
    """Until `predicate()` holds; `timeout_s` only bounds a hang (a slow machine polls longer)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


async def detached_from_every_connection(base: str, instance_id: str, token: str | None = None) -> None:
    """Until the server has seen the launching connection close: the instance is attached
    to none (a message posted before that would go to the closed connection)."""
    async with PieClient(base, token) as client:
        while {i.id: i for i in await client.list_instances()}[instance_id].attached:
            await asyncio.sleep(0.01)


async def raw_call(ws, table: dict | bytes) -> dict:
    """Send one raw frame, return the next reply as a plain map."""
    await ws.send(table if isinstance(table, bytes | str) else msgpack.packb(table))
    return msgpack.unpackb(await ws.recv())


# --- health and readiness ------------------------------------------------------------------


async def test_health_and_rpc_wait_for_the_backend_handshake():
    state = ServerState(ServerConfig())
    with serving(state) as base:
        async with httpx.AsyncClient() as http:
            response = await http.get(base + "/health")
            assert response.status_code == 503
            async with PieClient(base) as client:
                with pytest.raises(PieConnectionError, match="1013"):
                    await client.list_instances()
            state.runtime, state.model = FakeRuntime(), "fake-model"
            response = await http.get(base + "/health")
            assert response.status_code == 200
            assert response.json() == {"status": "ok", "model": "fake-model",
                                       "replicas": [{"replica": 0, "status": "ok"}]}


# --- authentication ------------------------------------------------------------------------


async def test_authentication_required_when_tokens_are_configured(fake):
    state = ServerState(ServerConfig(auth_tokens=["alpha-token-00001", "s3cret-token-0001"]), fake, "m")
    with serving(state) as base:
        async with PieClient(base) as client:
            with pytest.raises(RpcError) as e:
                await client.list_instances()
            assert e.value.code == "unauthenticated"
            with pytest.raises(RpcError) as e:
                await client._call(rpc.Authenticate, token="wrong")
            assert e.value.code == "auth_failed"
            with pytest.raises(RpcError, match="unauthenticated"):
                await client.launch("hello")
            await client._call(rpc.Authenticate, token="s3cret-token-0001")
            assert await client.list_instances() == []
        with pytest.raises(RpcError, match="auth_failed"):
            async with PieClient(base, token="nope"):
                pass
        async with PieClient(base, token="alpha-token-00001") as client:
            assert await client.program_exists("0" * 64) is False


async def test_no_tokens_means_no_authentication(url):
    async with PieClient(url, token="anything") as client:
        assert await client.list_instances() == []


# --- uploads -------------------------------------------------------------------------------


async def test_chunked_upload_is_hash_verified_and_stored_once(url, fake):
    async with PieClient(url) as client:
        digest = hashlib.sha256(COMPONENT).hexdigest()
        assert await client.program_exists(digest) is False
        assert await client.upload(COMPONENT) == digest
        assert fake.programs.stored[digest] == COMPONENT
        assert await client.program_exists(digest) is True
        assert await client.upload(COMPONENT) == digest  # already stored: not sent again
        assert fake.programs.adds == 1
        instance = await client.launch(digest, ["world"])
        assert [text async for text in instance] == ["hello world"]


async def test_oversized_upload_is_refused(fake):
    with serving(ServerState(ServerConfig(max_upload_bytes=1000), fake, "m")) as base:
        async with PieClient(base) as client:
            with pytest.raises(RpcError) as e:
                await client.upload(b"\0asm" + b"x" * 2000)
            assert e.value.code == "upload_too_large" and "max_upload_bytes = 1000" in e.value.message
            # More bytes than declared: refused and discarded.
            digest = hashlib.sha256(b"\0asm").hexdigest()
            await client._call(rpc.UploadBegin, sha256=digest, size=4)
            with pytest.raises(RpcError, match="upload_too_large"):
                await client._call(rpc.UploadChunk, sha256=digest, data=b"\0asm!")
            with pytest.raises(RpcError, match="no_upload"):
                await client._call(rpc.UploadEnd, sha256=digest)
            # Two pending uploads count together.
            await client._call(rpc.UploadBegin, sha256="a" * 64, size=600)
            with pytest.raises(RpcError, match="upload_too_large"):
                await client._call(rpc.UploadBegin, sha256="b" * 64, size=600)
    assert fake.programs.adds == 0


async def test_upload_errors_hash_mismatch_incomplete_invalid(url, fake):
    async with PieClient(url) as client:
        claimed = hashlib.sha256(b"\0asm other").hexdigest()
        actual = hashlib.sha256(b"\0asm evil").hexdigest()
        await client._call(rpc.UploadBegin, sha256=claimed, size=9)
        await client._call(rpc.UploadChunk, sha256=claimed, data=b"\0asm evil")
        with pytest.raises(RpcError) as e:
            await client._call(rpc.UploadEnd, sha256=claimed)
        assert e.value.code == "hash_mismatch"
        assert e.value.message == f"the bytes hash to {actual}, not {claimed}"

        await client._call(rpc.UploadBegin, sha256=claimed, size=10)
        await client._call(rpc.UploadChunk, sha256=claimed, data=b"\0asm")
        with pytest.raises(RpcError, match="upload_incomplete"):
            await client._call(rpc.UploadEnd, sha256=claimed)

        with pytest.raises(RpcError, match="no_upload"):
            await client._call(rpc.UploadChunk, sha256=claimed, data=b"x")
        with pytest.raises(RpcError, match="invalid_request.*64 hex digits"):
            await client._call(rpc.UploadBegin, sha256="xyz", size=1)
        with pytest.raises(RpcError) as e:
            await client.upload(b"not wasm")
        assert e.value.code == "invalid_program" and "not a WebAssembly component" in e.value.message
        assert fake.programs.stored == {}


# --- instances -----------------------------------------------------------------------------


async def test_launch_errors(url):
    async with PieClient(url) as client:
        with pytest.raises(RpcError) as e:
            await client.launch("no-such-program")
        assert e.value.code == "unknown_program" and e.value.message == "no program 'no-such-program'"
        for _ in range(3):
            await client.launch("echo")
        with pytest.raises(RpcError) as e:
            await client.launch("echo")
        assert e.value.code == "launch_refused" and "max_instances = 3" in e.value.message


async def test_send_events_list_and_terminate(url, fake):
    async with PieClient(url) as client:
        instance = await client.launch("echo", ["-x"])
        await instance.send("one")
        await instance.send("two")
        assert await instance.recv() == rpc.InstanceMessage(instance.id, "one")
        assert await instance.recv() == rpc.InstanceMessage(instance.id, "two")

        [summary] = await client.list_instances()
        assert summary.id == instance.id and summary.name == "echo" and summary.arguments == ["-x"]
        assert summary.state == "running" and abs(summary.started_at - time.time()) < 60

        with pytest.raises(RpcError) as e:
            await instance.send("x" * 1001)
        assert e.value.code == "message_too_large" and "max_message_bytes = 1000" in e.value.message
        await instance.send("é" * 500)  # 1000 bytes of UTF-8: at the limit
        assert (await instance.recv()).text == "é" * 500

        await instance.terminate()
        assert await instance.wait() == "terminated by client"
        assert await instance.recv() == rpc.InstanceTerminated(instance.id, "terminated by client")
        with pytest.raises(RpcError, match="unknown_instance"):
            await instance.send("late")
        with pytest.raises(RpcError, match="unknown_instance"):
            await instance.terminate()
        assert await client.list_instances() == []


async def test_instances_finish_or_fail_with_a_reason(url):
    async with PieClient(url) as client:
        hello = await client.launch("hello", ["a", "b"])
        assert [text async for text in hello] == ["hello a b"]
        assert await hello.wait() == "finished" and hello.logs == []  # not asked for
        lines = []
        logged = await client.launch("hello", ["c"], on_log=lambda level, text: lines.append((level, text)))
        assert [text async for text in logged] == ["hello c"]  # log lines are not messages
        assert lines == [("info", "about to say hello")]
        kept = await client.launch("hello", ["d"], logs=True)
        assert await kept.wait() == "finished" and kept.logs == [("info", "about to say hello")]
        trap = await client.launch("trap")
        assert await trap.wait() == "trap: unreachable"
        echo = await client.launch("echo")
        await echo.send("bye")
        assert await echo.wait() == "finished"


async def test_launch_reply_comes_before_the_instance_events(url):
    """`eager` emits a message inside launch(), before the server knows its id."""
    async with PieClient(url) as client:
        instance = await client.launch("eager")
        assert await asyncio.wait_for(instance.recv(), 60) == rpc.InstanceMessage(instance.id, "early")
        assert await asyncio.wait_for(instance.wait(), 60) == "finished"


async def test_instances_belong_to_their_connection(url, fake):
    async with PieClient(url) as owner, PieClient(url) as other:
        instance = await owner.launch("echo")
        with pytest.raises(RpcError) as e:
            await other.send(instance.id, "hi")
        assert e.value.code == "unknown_instance" and "attached to this connection" in e.value.message
        with pytest.raises(RpcError, match="unknown_instance"):
            await other.terminate(instance.id)
        assert [i.id for i in await other.list_instances()] == [instance.id]  # listing is global
        await instance.send("mine")
        assert (await instance.recv()).text == "mine"


async def test_closing_a_connection_terminates_its_instances(url, fake):
    async with PieClient(url) as keeper:
        kept = await keeper.launch("echo")
        async with PieClient(url) as client:
            first = await client.launch("echo")
            second = await client.launch("echo")
        await eventually(lambda: [i.id for i in fake.list_instances()] == [kept.id])
        assert sorted(fake.terminations) == sorted([(first.id, "client disconnected"),
                                                     (second.id, "client disconnected")])
        assert "closed" in await first.wait()  # client side: ended with the connection
        await kept.send("still here")
        assert (await kept.recv()).text == "still here"


async def test_detached_instance_outlives_its_connection_and_can_be_attached(fake):
    """A detached instance keeps running when its connection closes; its events are held
    (the instance's sends wait once max_pending_messages are held, so nothing is lost) and
    delivered in order to whichever connection of the same user attaches next."""
    config = ServerConfig(auth_tokens=[ALICE, BOB], max_pending_messages=3)
    with serving(ServerState(config, fake, "m")) as base:
        async with PieClient(base, token=ALICE) as first:
            detached = await first.launch("echo", detached=True)
            plain = await first.launch("echo")
            await detached.send("before")
            assert (await detached.recv()).text == "before"
            with pytest.raises(RpcError, match="not_attachable.*already attached to this connection"):
                await first.attach(detached.id)
            async with PieClient(base, token=ALICE) as second:
                with pytest.raises(RpcError, match="not_attachable.*attached to another connection"):
                    await second.attach(detached.id)
                with pytest.raises(RpcError, match="not_attachable.*not launched detached"):
                    await second.attach(plain.id)
        await eventually(lambda: [i.id for i in fake.list_instances()] == [detached.id])
        await detached_from_every_connection(base, detached.id, ALICE)
        inbox = fake._inbox(detached.id)
        for i in range(6):  # nobody attached: 3 are held, then the echo thread waits
            inbox.put(f"m{i}")
        await eventually(lambda: detached.id in fake.waiting)
        assert inbox.qsize() == 3  # it waits, holding 3: backpressure, not loss
        async with PieClient(base, token=BOB) as bob:
            with pytest.raises(RpcError, match="unknown_instance"):  # another user's
                await bob.attach(detached.id)
            assert await bob.list_instances() == []
        async with PieClient(base, token=ALICE) as third:
            [summary] = await third.list_instances()
            assert (summary.id, summary.detached, summary.attached) == (detached.id, True, False)
            again = await third.attach(detached.id)
            assert [(await again.recv()).text for _ in range(6)] == [f"m{i}" for i in range(6)]
            await again.send("bye")
            assert await again.wait() == "finished"
            assert await third.list_instances() == []
        async with PieClient(base, token=ALICE) as fourth:  # an end nobody was there to see
            ended = await fourth.launch("echo", detached=True)
        await eventually(lambda: ended.id in [i.id for i in fake.list_instances()])
        # Until the server has seen the fourth connection close: an end handed to it before
        # then goes to that (closing) connection and is not held (CI saw that race once).
        await detached_from_every_connection(base, ended.id, ALICE)
        fake.terminate(ended.id, "stopped meanwhile")
        await eventually(lambda: fake.list_instances() == [])
        async with PieClient(base, token=ALICE) as fifth:
            [summary] = await fifth.list_instances()
            assert summary.state == "terminated"
            late = await fifth.attach(ended.id)
            assert await asyncio.wait_for(late.wait(), 60) == "stopped meanwhile"
            assert await fifth.list_instances() == []


async def test_client_ends_instances_when_the_connection_is_lost(fake):
    state = ServerState(ServerConfig(), fake, "m")
    with serving(state) as base:
        client = PieClient(base)
        await client.connect()
        instance = await client.launch("echo")
    # The server is gone: the instance ends with a reason and calls fail.
    assert "closed" in await asyncio.wait_for(instance.wait(), 60)
    with pytest.raises(PieConnectionError):
        await client.list_instances()
    await client.close()


# --- malformed input -----------------------------------------------------------------------


async def test_malformed_frames_get_precise_errors_and_the_connection_survives(url):
    async with websockets.connect(ws_url(url)) as ws:
        reply = await raw_call(ws, b"\xc1 not msgpack")
        assert reply["type"] == "error" and reply["code"] == "invalid_message" and reply["corr_id"] is None
        reply = await raw_call(ws, msgpack.packb([1, 2]))
        assert reply["code"] == "invalid_message" and "must be a msgpack map" in reply["message"]
        reply = await raw_call(ws, {"type": "list_instances"})
        assert reply["code"] == "invalid_message" and "corr_id" in reply["message"]
        reply = await raw_call(ws, {"type": "fly", "corr_id": 5})
        assert (reply["corr_id"], reply["code"]) == (5, "unknown_op") and "'fly'" in reply["message"]
        reply = await raw_call(ws, {"type": "launch", "corr_id": 6, "program": "echo", "arguments": ["a", 2]})
        assert (reply["corr_id"], reply["code"]) == (6, "invalid_request")
        assert reply["message"] == "launch.arguments must be list[str], got list of int, str"
        reply = await raw_call(ws, {"type": "send", "corr_id": 7, "instance_id": 3, "message": "m"})
        assert reply["message"] == "send.instance_id must be str, got int"
        reply = await raw_call(ws, {"type": "terminate", "corr_id": 8})
        assert reply["message"] == "terminate: missing field 'instance_id'"
        reply = await raw_call(ws, {"type": "terminate", "corr_id": 9, "instance_id": "x", "force": True})
        assert reply["message"] == "terminate: unknown field(s) force"
        reply = await raw_call(ws, "a text frame")
        assert reply["code"] == "invalid_message" and "binary" in reply["message"]
        reply = await raw_call(ws, {"type": "list_instances", "corr_id": 10})
        assert reply == {"type": "ok", "corr_id": 10, "value": []}
    async with PieClient(url) as client:  # the server is fine too
        assert (await client.launch("hello")).id


def test_ws_url_accepts_http_and_ws_forms():
    assert ws_url("http://127.0.0.1:8080") == "ws://127.0.0.1:8080/ws"
    assert ws_url("https://pie.example/") == "wss://pie.example/ws"
    assert ws_url("ws://h:1/ws") == "ws://h:1/ws"
    with pytest.raises(ValueError):
        ws_url("127.0.0.1:8080")


# --- `pie serve` / `pie run` plumbing --------------------------------------------------------


def test_pie_run_finds_the_address_in_the_ready_line_of_pie_serve():
    from pie.server.local import READY
    from pie.server.serve import READY_LINE

    line = READY_LINE.format(model="smollm2", host="127.0.0.1", port=4321)
    assert READY.match(line).group(1) == "ws://127.0.0.1:4321/ws"


def test_pie_run_passes_everything_after_double_dash_to_the_inferlet():
    from pie.cli import _parse, build_parser

    args = _parse(build_parser(), ["run", "text_completion", "--server", "http://h:1", "--",
                                   "--prompt", "a -- b", "--max-tokens", "3"])
    assert (args.program, args.server) == ("text_completion", "http://h:1")
    assert args.arguments == ["--prompt", "a -- b", "--max-tokens", "3"]
    assert _parse(build_parser(), ["run", "hello", "x", "y"]).arguments == ["x", "y"]


# --- bounded buffers and /stats per user -----------------------------------------------------


async def test_a_client_that_stops_reading_is_disconnected_and_its_instances_ended(fake):
    """server.max_outbox_bytes: once that much waits for a client that reads nothing, its
    instance's sends wait; after server.slow_client_timeout_s the instance is ended and the
    connection closed, both saying why. The client gets what was queued, in order, then the
    end and the close frame. (Before the bound the flood ran to its end, the server holding
    every message.)"""
    config = ServerConfig(max_message_bytes=1000, max_outbox_bytes=20_000, slow_client_timeout_s=1.0)
    with serving(ServerState(config, fake, "m")) as base:
        async with slow_reader(base) as ws:
            reply = await raw_call(ws, {"type": "launch", "corr_id": 1, "program": "flood",
                                        "arguments": ["500", "100000"]})
            instance_id = reply["value"]
            await eventually(lambda: not fake.live)  # we read nothing meanwhile
            [(ended, reason)] = fake.terminations
            assert ended == instance_id
            assert reason.startswith("the client stopped reading: ") and reason.endswith(
                "bytes unread for 1 s (server.max_outbox_bytes, server.slow_client_timeout_s)")
            # The outbox, the socket buffers and one message in flight; not 50 MB.
            assert fake.posted[instance_id] < 40_000
            frames, close = await read_until_closed(ws)
    assert (close.code, close.reason) == (1008, reason)
    texts = [f["text"] for f in frames if f["type"] == "instance_message"]
    assert texts == [f"{i:08d}".ljust(500, "x") for i in range(len(texts))]
    assert frames[-1] == {"type": "instance_terminated", "instance_id": instance_id, "reason": reason,
                          "usage": {}}


async def test_outbox_backpressure_holds_instances_back_and_loses_nothing(fake):
    """A client that pauses for less than slow_client_timeout_s: the instance waits, then
    every message arrives, in order."""
    config = ServerConfig(max_message_bytes=1000, max_outbox_bytes=20_000, slow_client_timeout_s=10.0)
    with serving(ServerState(config, fake, "m")) as base:
        async with slow_reader(base) as ws:
            reply = await raw_call(ws, {"type": "launch", "corr_id": 1, "program": "flood",
                                        "arguments": ["1000", "12000"]})
            # We read nothing: once the socket buffers (about 4 MB) and the outbox are full
            # the flood's sends wait; 50 polls for room in a row find none.
            await eventually(lambda: fake.stalled.get(reply["value"], 0) >= 50)
            assert fake.posted[reply["value"]] < 12000  # held back, not run to its end
            texts = []
            while (frame := msgpack.unpackb(await ws.recv()))["type"] == "instance_message":
                texts.append(frame["text"])
    assert frame["reason"] == "finished"
    assert texts == [f"{i:08d}".ljust(1000, "x") for i in range(12000)]


async def test_a_client_that_sends_requests_without_reading_replies_is_disconnected(fake):
    """Replies count against max_outbox_bytes too: over it the server reads no further
    request, and after slow_client_timeout_s it closes the connection and ends its
    instances. (Before, every request was answered into an unbounded queue.)"""
    config = ServerConfig(max_outbox_bytes=2**20, slow_client_timeout_s=1.0)
    with serving(ServerState(config, fake, "m")) as base:
        async with slow_reader(base) as ws:
            for i in range(3):
                await raw_call(ws, {"type": "launch", "corr_id": i, "program": "echo",
                                    "arguments": ["a" * 300_000]})
            for i in range(200):  # each reply lists the three: ~900 KB
                await ws.send(msgpack.packb({"type": "list_instances", "corr_id": 10 + i}))
            await eventually(lambda: len(fake.terminations) == 3)
            frames, close = await read_until_closed(ws)
    assert close.code == 1008 and close.reason.startswith("the client stopped reading: ")
    assert {reason for _, reason in fake.terminations} == {close.reason}
    assert len([f for f in frames if f["type"] == "ok"]) < 60  # not 200 replies
    assert [f["reason"] for f in frames if f["type"] == "instance_terminated"] == [close.reason] * 3


async def test_uploads_in_progress_are_bounded_per_user_and_on_the_server(fake):
    """server.max_user_upload_bytes sums a user's uploads in progress over its connections,
    server.max_total_upload_bytes everyone's; bytes come back when an upload ends, fails or
    its connection closes. (Before, each connection had max_upload_bytes of its own.)"""
    config = ServerConfig(auth_tokens=[ALICE, BOB], max_upload_bytes=1000,
                          max_user_upload_bytes=1500, max_total_upload_bytes=2000)
    with serving(ServerState(config, fake, "m")) as base:
        async with PieClient(base, ALICE) as a1, PieClient(base, ALICE) as a2, \
                PieClient(base, BOB) as b1, PieClient(base, BOB) as b2:
            await a1._call(rpc.UploadBegin, sha256="a" * 64, size=800)
            with pytest.raises(RpcError) as e:
                await a2._call(rpc.UploadBegin, sha256="b" * 64, size=800)
            assert e.value.code == "upload_too_large"
            assert "plus 800 in uploads of yours in progress" in e.value.message
            assert "server.max_user_upload_bytes = 1500" in e.value.message
            await b1._call(rpc.UploadBegin, sha256="c" * 64, size=800)
            with pytest.raises(RpcError) as e:
                await b2._call(rpc.UploadBegin, sha256="d" * 64, size=600)
            assert e.value.code == "upload_too_large" and "server.max_total_upload_bytes = 2000" in e.value.message
            # A failed upload gives its bytes back...
            with pytest.raises(RpcError, match="upload_incomplete"):
                await b1._call(rpc.UploadEnd, sha256="c" * 64)
            await b2._call(rpc.UploadBegin, sha256="d" * 64, size=600)
            # ... a finished one too ...
            data = b"\0asm" + b"p" * 396
            digest = hashlib.sha256(data).hexdigest()
            await a2._call(rpc.UploadBegin, sha256=digest, size=400)  # Alice: 1200 of 1500
            await a2._call(rpc.UploadChunk, sha256=digest, data=data)
            assert await a2._call(rpc.UploadEnd, sha256=digest) == digest
            await b1._call(rpc.UploadBegin, sha256="e" * 64, size=600)  # total 2000
        # ... and so does a closed connection.
        async with PieClient(base, BOB) as b3:
            await b3._call(rpc.UploadBegin, sha256="f" * 64, size=1000)


async def test_frames_with_non_string_keys_get_an_error_reply(url):
    """A map with bytes keys once raised an uncaught TypeError (sorting mixed key types)
    and dropped the connection without a reply."""
    async with websockets.connect(ws_url(url)) as ws:
        reply = await raw_call(ws, msgpack.packb({"type": "launch", "corr_id": 3, b"x": 1, "y": 2},
                                                 use_bin_type=True))
        assert (reply["corr_id"], reply["code"]) == (3, "invalid_request")
        assert reply["message"] == "map keys must be strings, got bytes key(s) b'x'"
        reply = await raw_call(ws, msgpack.packb({b"type": "list_instances", b"corr_id": 4}, use_bin_type=True))
        assert (reply["corr_id"], reply["code"]) == (None, "invalid_message")
        reply = await raw_call(ws, msgpack.packb({"type": "terminate", "corr_id": 5, b"a": 1, 2.5: 1}))
        assert reply["code"] == "invalid_message" and "not valid msgpack" in reply["message"]  # float key
        reply = await raw_call(ws, {"type": "list_instances", "corr_id": 6})
        assert reply == {"type": "ok", "corr_id": 6, "value": []}


async def test_stats_shows_a_user_its_own_usage_and_an_admin_everyones(fake):
    admin = "admin-token-000001"
    config = ServerConfig(auth_tokens=[ALICE, BOB], admin_tokens=[admin])
    with serving(ServerState(config, fake, "m")) as base:
        async with httpx.AsyncClient() as http:
            def get(token: str | None):
                return http.get(base + "/stats", headers={"Authorization": f"Bearer {token}"} if token else {})
            assert (await get(None)).status_code == 401
            assert (await get("not-a-token-at-all")).status_code == 401
            assert (await get(ALICE)).status_code == 200
            assert (await get(admin)).status_code == 200
        async with PieClient(base, admin) as client:  # admins are users too
            assert await client.list_instances() == []
    fingerprint = "token-" + hashlib.sha256(ALICE.encode()).hexdigest()[:8]
    assert fake.stats_for == [fingerprint, None]
    with serving(ServerState(ServerConfig(), fake, "m")) as base:  # one user: sees everything
        assert httpx.get(base + "/stats").status_code == 200
    assert fake.stats_for[-1] is None


async def test_public_upload_is_passed_to_the_program_store(url, fake):
    async with PieClient(url) as client:
        private = await client.upload(COMPONENT)
        assert private not in fake.programs.public
        assert await client.upload(COMPONENT, public=True) == private  # sent again, for the grant
        assert private in fake.programs.public


async def test_a_detached_instance_holds_at_most_max_pending_bytes(fake):
    """Held messages of a detached instance nobody follows are bounded in bytes too
    (server.max_pending_bytes): beyond, its sends wait for an attach; nothing is lost."""
    config = ServerConfig(max_message_bytes=1000, max_pending_bytes=3000)
    with serving(ServerState(config, fake, "m")) as base:
        async with PieClient(base) as first:
            detached = await first.launch("echo", detached=True)
        await detached_from_every_connection(base, detached.id)  # nobody follows it now
        inbox = fake._inbox(detached.id)
        for i in range(10):
            inbox.put(f"{i}" * 1000)
        await eventually(lambda: detached.id in fake.waiting)
        assert inbox.qsize() == 7  # 3000 bytes held: its send waits
        async with PieClient(base) as second:
            again = await second.attach(detached.id)
            assert [(await again.recv()).text for _ in range(10)] == [f"{i}" * 1000 for i in range(10)]
            await again.send("bye")
            assert await again.wait() == "finished"
