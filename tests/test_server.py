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
        self.adds = 0

    def add(self, data: bytes, owner: str | None = None, public: bool = False) -> str:
        self.adds += 1
        if not data.startswith(b"\0asm"):
            raise InvalidProgram("not a WebAssembly component")
        digest = hashlib.sha256(data).hexdigest()
        self.stored[digest] = data
        return digest

    def exists(self, digest: str, user: str = "anonymous") -> bool:
        return digest in self.stored

    def builtin_names(self) -> list[str]:
        return sorted(FakeRuntime.BUILTINS)


class FakeRuntime:
    """The runtime's interface with toy programs, each instance on its own thread calling
    `on_event` from there: echo (echoes messages; "bye" finishes it), hello (one greeting
    with its arguments, then finishes), trap (traps), eager (sends a message from inside
    `launch`, before it returns). Uploaded programs behave like hello."""

    BUILTINS = ("echo", "hello", "trap", "eager")

    def __init__(self, max_instances: int = 8):
        self.programs = FakePrograms()
        self.max_instances = max_instances
        self.lock = threading.Lock()
        self.live: dict[str, tuple[InstanceInfo, queue.Queue]] = {}
        self.terminations: list[tuple[str, str]] = []  # terminate() calls

    def launch(self, program, arguments, on_event, user="anonymous") -> InstanceInfo:
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
        threading.Thread(target=self._run, args=(info, inbox, on_event), daemon=True).start()
        return info

    def _run(self, info: InstanceInfo, inbox: queue.Queue, on_event) -> None:
        reason = "finished"
        if info.name == "echo":
            while (message := inbox.get()) != "bye":
                if isinstance(message, tuple):  # ("stop", reason) from terminate()
                    reason = message[1]
                    break
                if room := on_event(info.id, "message", message):
                    room.wait()  # the runtime's backpressure (held messages of a detached instance)
        elif info.name == "trap":
            reason = "trap: unreachable"
        elif info.name != "eager":
            on_event(info.id, "message", "hello " + " ".join(info.arguments))
        with self.lock:
            self.live.pop(info.id, None)
        on_event(info.id, "terminated", reason)

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


async def eventually(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
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
            assert response.json() == {"status": "ok", "model": "fake-model"}


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
        assert await hello.wait() == "finished"
        trap = await client.launch("trap")
        assert await trap.wait() == "trap: unreachable"
        echo = await client.launch("echo")
        await echo.send("bye")
        assert await echo.wait() == "finished"


async def test_launch_reply_comes_before_the_instance_events(url):
    """`eager` emits a message inside launch(), before the server knows its id."""
    async with PieClient(url) as client:
        instance = await client.launch("eager")
        assert await asyncio.wait_for(instance.recv(), 5) == rpc.InstanceMessage(instance.id, "early")
        assert await asyncio.wait_for(instance.wait(), 5) == "finished"


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
        inbox = fake._inbox(detached.id)
        for i in range(6):  # nobody attached: 3 are held, then the echo thread waits
            inbox.put(f"m{i}")
        await eventually(lambda: inbox.qsize() == 3)
        await asyncio.sleep(0.2)
        assert inbox.qsize() == 3  # still waiting: backpressure, not loss
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
        fake.terminate(ended.id, "stopped meanwhile")
        await eventually(lambda: fake.list_instances() == [])
        async with PieClient(base, token=ALICE) as fifth:
            [summary] = await fifth.list_instances()
            assert summary.state == "terminated"
            late = await fifth.attach(ended.id)
            assert await asyncio.wait_for(late.wait(), 5) == "stopped meanwhile"
            assert await fifth.list_instances() == []


async def test_client_ends_instances_when_the_connection_is_lost(fake):
    state = ServerState(ServerConfig(), fake, "m")
    with serving(state) as base:
        client = PieClient(base)
        await client.connect()
        instance = await client.launch("echo")
    # The server is gone: the instance ends with a reason and calls fail.
    assert "closed" in await asyncio.wait_for(instance.wait(), 10)
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
