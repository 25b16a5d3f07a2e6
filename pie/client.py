"""Asyncio client of a Pie server (protocol: `pie/server/rpc.py`).

    async with PieClient("ws://127.0.0.1:8080/ws", token=None) as client:
        program = await client.upload(Path("app.wasm").read_bytes())  # skipped if stored
        instance = await client.launch(program, ["--prompt", "Hi"])
        async for text in instance:  # the instance's messages, until it terminates
            print(text)
        print(await instance.wait())  # "finished", "trap: ...", ...

One reader task routes every server frame: replies resolve the call that sent the request
(matched by corr_id), events go to their `Instance`. Instances launched on a client are
terminated by the server when the client disconnects.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import urllib.parse
from collections.abc import AsyncIterator, Callable
from typing import Any

import websockets
from websockets.asyncio.client import ClientConnection

from pie.server import rpc
from pie.server.rpc import RpcError

log = logging.getLogger(__name__)

# Close codes a Pie server sends without a reason.
CLOSE_CODES = {1008: "the client stopped reading", 1009: "frame larger than the server accepts",
               1012: "server shutting down"}

__all__ = ["PieClient", "Instance", "RpcError", "PieConnectionError", "ws_url"]


class PieConnectionError(ConnectionError):
    """The connection to the server closed (or never worked) while a call was waiting."""


class Instance:
    """A running inferlet launched by this client."""

    def __init__(self, client: PieClient, instance_id: str,
                 on_log: Callable[[str, str], None] | None = None):
        self.id = instance_id
        self.client = client
        # Its log lines (launched with logs=True), as (level, text): to `on_log`, else kept
        # in `logs`. They are not events: iterating over the instance yields messages only.
        self.on_log = on_log
        self.logs: list[tuple[str, str]] = []
        self.events: asyncio.Queue[rpc.Event] = asyncio.Queue()
        self.ended: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        # What it consumed (forward calls/tokens, peak KV pages, host calls), once it has ended.
        self.usage: dict[str, int] = {}

    async def send(self, text: str) -> None:
        await self.client.send(self.id, text)

    async def terminate(self) -> None:
        await self.client.terminate(self.id)

    async def recv(self) -> rpc.Event:
        """The next event; `InstanceTerminated` is the last (and is returned again after)."""
        if self.events.empty() and self.ended.done():
            return rpc.InstanceTerminated(self.id, self.ended.result())
        return await self.events.get()

    async def __aiter__(self) -> AsyncIterator[str]:
        """The instance's messages until it terminates (then `wait()` returns at once)."""
        while isinstance(event := await self.recv(), rpc.InstanceMessage):
            yield event.text

    async def wait(self) -> str:
        """The termination reason, once the instance has ended (does not consume messages)."""
        return await asyncio.shield(self.ended)

    def _push(self, event: rpc.Event) -> None:
        if isinstance(event, rpc.InstanceLog):
            if self.on_log is not None:
                self.on_log(event.level, event.text)
            else:
                self.logs.append((event.level, event.text))
            return
        self.events.put_nowait(event)
        if isinstance(event, rpc.InstanceTerminated) and not self.ended.done():
            self.usage = event.usage
            self.ended.set_result(event.reason)


class PieClient:
    def __init__(self, url: str, token: str | None = None):
        self.url = ws_url(url)
        self.token = token
        self.ws: ClientConnection | None = None
        self.reader: asyncio.Task[None] | None = None
        self.ids = itertools.count(1)
        # corr_id -> (future of the call, conversion of its value run by the reader)
        self.pending: dict[int, tuple[asyncio.Future[Any], Callable[[Any], Any] | None]] = {}
        self.instances: dict[str, Instance] = {}
        self.closed_because: str | None = None

    async def __aenter__(self) -> PieClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def connect(self) -> None:
        try:
            self.ws = await websockets.connect(self.url, max_size=None)
        except (OSError, websockets.InvalidHandshake) as e:
            raise PieConnectionError(f"cannot connect to {self.url}: {e}") from None
        self.reader = asyncio.create_task(self._read())
        if self.token is not None:
            try:
                await self._call(rpc.Authenticate, token=self.token)
            except BaseException:
                await self.close()
                raise

    async def close(self) -> None:
        if self.ws is not None:
            await self.ws.close()
        if self.reader is not None:
            await self.reader

    # --- operations ----------------------------------------------------------------------

    async def program_exists(self, sha256: str) -> bool:
        return await self._call(rpc.ProgramExists, sha256=sha256)

    async def upload(self, data: bytes, public: bool = False) -> str:
        """Store a program (component bytes) on the server unless it has it; its hash. Only
        this client's user (whoever uploaded it) may launch it, unless it is `public`: then
        every user may (sent even when stored, so that the grant reaches the server)."""
        sha256 = hashlib.sha256(data).hexdigest()
        if not public and await self.program_exists(sha256):
            return sha256
        await self._call(rpc.UploadBegin, sha256=sha256, size=len(data), public=public)
        for start in range(0, len(data), rpc.CHUNK_BYTES):
            await self._call(rpc.UploadChunk, sha256=sha256, data=data[start:start + rpc.CHUNK_BYTES])
        return await self._call(rpc.UploadEnd, sha256=sha256)

    async def launch(self, program: str, arguments: list[str] | tuple[str, ...] = (),
                     detached: bool = False, logs: bool = False,
                     on_log: Callable[[str, str], None] | None = None) -> Instance:
        """Start `program` (a hash or a built-in name). A detached instance keeps running when
        this connection closes; `attach` to it again from any connection of the same user.
        With `logs` (implied by `on_log`), the instance's log lines — its `log` calls, a Python
        inferlet's print() and stderr — come too: to `on_log(level, text)`, else to
        `instance.logs`."""
        return await self._call(rpc.Launch, lambda i: self._register(i, on_log), program=program,
                                arguments=list(arguments), detached=detached, logs=logs or on_log is not None)

    async def attach(self, instance_id: str, on_log: Callable[[str, str], None] | None = None) -> Instance:
        """Follow a detached instance: the events held since it was last followed, then live ones
        (log lines, if it was launched with logs, to `on_log` or `instance.logs`)."""
        return await self._call(rpc.Attach, lambda _: self._register(instance_id, on_log),
                                instance_id=instance_id)

    async def send(self, instance_id: str, text: str) -> None:
        await self._call(rpc.Send, instance_id=instance_id, message=text)

    async def terminate(self, instance_id: str) -> None:
        await self._call(rpc.Terminate, instance_id=instance_id)

    async def list_instances(self) -> list[rpc.InstanceSummary]:
        return [rpc.InstanceSummary(**i) for i in await self._call(rpc.ListInstances)]

    # --- plumbing ------------------------------------------------------------------------

    async def _call(self, cls: type[rpc.Request], convert: Callable[[Any], Any] | None = None,
                    **fields: Any) -> Any:
        """Send a request and wait for its reply's value; raises `RpcError` on an error reply."""
        if self.ws is None or self.closed_because is not None:
            raise PieConnectionError(self.closed_because or "not connected")
        request = cls(corr_id=next(self.ids), **fields)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.pending[request.corr_id] = (future, convert)
        try:
            try:
                await self.ws.send(rpc.encode(request))
            except websockets.ConnectionClosed:  # the reader may not have noticed yet
                if not future.done():
                    future.set_exception(PieConnectionError(self._close_description()))
            return await future
        finally:
            self.pending.pop(request.corr_id, None)

    def _register(self, instance_id: str, on_log: Callable[[str, str], None] | None = None) -> Instance:
        """Run by the reader on a launch reply, before it reads the instance's first event."""
        instance = self.instances[instance_id] = Instance(self, instance_id, on_log)
        return instance

    async def _read(self) -> None:
        assert self.ws is not None
        try:
            async for frame in self.ws:
                if isinstance(frame, bytes):
                    self._dispatch(rpc.decode_server_message(frame))
        except websockets.ConnectionClosed:
            pass
        except RpcError as e:  # a server we do not understand: stop rather than guess
            log.error("unreadable frame from the server: %s", e)
        finally:
            self._closed()

    def _dispatch(self, message: rpc.Message) -> None:
        if isinstance(message, rpc.InstanceMessage | rpc.InstanceLog | rpc.InstanceTerminated):
            instance = self.instances.get(message.instance_id)
            if instance is not None:
                instance._push(message)
                if isinstance(message, rpc.InstanceTerminated):
                    del self.instances[message.instance_id]
            return
        assert isinstance(message, rpc.Ok | rpc.Error)
        if message.corr_id is None or message.corr_id not in self.pending:
            log.warning("server reply to no pending request: %s", message)
            return
        future, convert = self.pending[message.corr_id]
        if future.done():  # the caller was cancelled
            return
        if isinstance(message, rpc.Error):
            future.set_exception(RpcError(message.code, message.message, message.corr_id))
        else:
            future.set_result(convert(message.value) if convert else message.value)

    def _closed(self) -> None:
        """Fail every waiting call and end every instance: nothing more will arrive."""
        self.closed_because = self._close_description()
        for future, _ in self.pending.values():
            if not future.done():
                future.set_exception(PieConnectionError(self.closed_because))
        for instance in self.instances.values():
            instance._push(rpc.InstanceTerminated(instance.id, self.closed_because))
        self.instances.clear()

    def _close_description(self) -> str:
        code = self.ws.close_code if self.ws is not None else None
        reason = self.ws.close_reason if self.ws is not None else ""
        if code in (None, 1000) and not reason:
            return f"connection to {self.url} closed"
        return f"connection to {self.url} closed ({code}: {reason or CLOSE_CODES.get(code, 'no reason')})"


def ws_url(url: str) -> str:
    """The RPC address for `url`: ws(s)://host:port/path as given, or http(s)://host:port
    (as printed by `pie serve`) with `/ws` appended."""
    parts = urllib.parse.urlsplit(url)
    scheme = {"http": "ws", "https": "wss"}.get(parts.scheme, parts.scheme)
    if scheme not in ("ws", "wss") or not parts.netloc:
        raise ValueError(f"not a Pie server URL: {url!r} (expected ws://host:port/ws or http://host:port)")
    path = parts.path if parts.path not in ("", "/") else "/ws"
    return urllib.parse.urlunsplit((scheme, parts.netloc, path, parts.query, ""))


def http_url(ws: str) -> str:
    """The HTTP base (for /health, /stats, /v1) of a server whose RPC address is `ws`."""
    return ws.replace("wss://", "https://", 1).replace("ws://", "http://", 1).removesuffix("/ws")
