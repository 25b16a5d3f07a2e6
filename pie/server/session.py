"""One client connection: its authentication, its uploads in progress, the instances it launched.

The session turns decoded requests into runtime calls and queues reply and event frames on
`outbox`, which the WebSocket endpoint drains. Requests are handled one at a time, so upload
chunks arrive in order and a disconnect is seen only after the request in progress is done.
Runtime calls that may block (compile, instantiate, terminate) run in worker threads.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import hmac
import logging
import re
from collections.abc import Callable
from typing import TYPE_CHECKING

from pie.config import ServerConfig
from pie.server import rpc
from pie.server.rpc import ErrorCode, RpcError

if TYPE_CHECKING:
    from pie.runtime.runtime import EventSink, Runtime

log = logging.getLogger(__name__)

SHA256_HEX = re.compile(r"[0-9a-f]{64}")
DISCONNECT_REASON = "client disconnected"


@dataclasses.dataclass
class _Upload:
    size: int  # declared by upload_begin
    data: bytearray = dataclasses.field(default_factory=bytearray)


class _EventGate:
    """Holds a new instance's events until the reply to its launch is queued, so a client
    never sees an event of an instance id it has not been told about yet."""

    def __init__(self, deliver: Callable[[rpc.Event], None]):
        self.deliver = deliver
        self.held: list[rpc.Event] | None = []

    def push(self, event: rpc.Event) -> None:
        if self.held is None:
            self.deliver(event)
        else:
            self.held.append(event)

    def open(self) -> None:
        held, self.held = self.held or [], None
        for event in held:
            self.deliver(event)


def token_matches(tokens: list[str], given: str) -> bool:
    """Constant-time check against every configured token (no early exit to time)."""
    matched = False
    for token in tokens:
        matched |= hmac.compare_digest(given.encode(), token.encode())
    return matched


class Session:
    def __init__(self, config: ServerConfig, runtime: Runtime, loop: asyncio.AbstractEventLoop):
        self.config = config
        self.runtime = runtime
        self.loop = loop
        self.outbox: asyncio.Queue[bytes] = asyncio.Queue()
        self.authenticated = not config.auth_tokens
        self.uploads: dict[str, _Upload] = {}
        self.instances: set[str] = set()  # launched here and not yet reported terminated
        self.closed = False

    async def handle(self, frame: bytes) -> None:
        """Answer one client frame with exactly one reply (an error if anything is wrong)."""
        try:
            request = rpc.decode_request(frame)
        except RpcError as e:
            self._send(rpc.Error(e.corr_id, e.code, e.message))
            return
        try:
            if not self.authenticated and not isinstance(request, rpc.Authenticate):
                raise RpcError(ErrorCode.UNAUTHENTICATED, "authenticate with a token first")
            await getattr(self, f"_on_{request.type}")(request)
        except RpcError as e:
            self._send(rpc.Error(request.corr_id, e.code, e.message))
        except Exception as e:
            log.exception("%s request failed", request.type)
            self._send(rpc.Error(request.corr_id, ErrorCode.INTERNAL, f"{type(e).__name__}: {e}"))

    def reject_frame(self, reason: str) -> None:
        """A frame the endpoint could not pass on (e.g. a text frame)."""
        self._send(rpc.Error(None, ErrorCode.INVALID_MESSAGE, reason))

    async def close(self) -> None:
        """The connection is gone: terminate every instance it launched."""
        self.closed = True
        self.uploads.clear()
        for instance_id in list(self.instances):
            try:
                await asyncio.to_thread(self.runtime.terminate, instance_id, DISCONNECT_REASON)
            except LookupError:
                pass  # it ended on its own meanwhile
        self.instances.clear()

    # --- requests ------------------------------------------------------------------------

    async def _on_authenticate(self, request: rpc.Authenticate) -> None:
        if self.config.auth_tokens and not token_matches(self.config.auth_tokens, request.token):
            raise RpcError(ErrorCode.AUTH_FAILED, "invalid token")
        self.authenticated = True
        self._reply(request)

    async def _on_upload_begin(self, request: rpc.UploadBegin) -> None:
        sha256 = _check_hash(request.sha256)
        if request.size < 0:
            raise RpcError(ErrorCode.INVALID_REQUEST, f"upload_begin.size must be >= 0, got {request.size}")
        pending = sum(u.size for h, u in self.uploads.items() if h != sha256)
        if pending + request.size > self.config.max_upload_bytes:
            raise RpcError(ErrorCode.UPLOAD_TOO_LARGE,
                           f"{request.size} bytes (plus {pending} pending on this connection) exceed "
                           f"server.max_upload_bytes = {self.config.max_upload_bytes}")
        self.uploads[sha256] = _Upload(request.size)
        self._reply(request)

    async def _on_upload_chunk(self, request: rpc.UploadChunk) -> None:
        sha256 = _check_hash(request.sha256)
        upload = self._upload(sha256)
        if len(upload.data) + len(request.data) > upload.size:
            del self.uploads[sha256]
            raise RpcError(ErrorCode.UPLOAD_TOO_LARGE,
                           f"more bytes than the {upload.size} declared in upload_begin; upload discarded")
        upload.data += request.data
        self._reply(request, len(upload.data))

    async def _on_upload_end(self, request: rpc.UploadEnd) -> None:
        sha256 = _check_hash(request.sha256)
        upload = self._upload(sha256)
        del self.uploads[sha256]
        if len(upload.data) != upload.size:
            raise RpcError(ErrorCode.UPLOAD_INCOMPLETE,
                           f"received {len(upload.data)} of {upload.size} bytes; upload discarded")
        actual = hashlib.sha256(upload.data).hexdigest()
        if actual != sha256:
            raise RpcError(ErrorCode.HASH_MISMATCH, f"the bytes hash to {actual}, not {sha256}")
        try:
            stored = await asyncio.to_thread(self.runtime.programs.add, bytes(upload.data))
        except ValueError as e:  # the runtime's InvalidProgram
            raise RpcError(ErrorCode.INVALID_PROGRAM, str(e)) from None
        self._reply(request, stored)

    async def _on_program_exists(self, request: rpc.ProgramExists) -> None:
        self._reply(request, self.runtime.programs.exists(_check_hash(request.sha256)))

    async def _on_launch(self, request: rpc.Launch) -> None:
        gate = _EventGate(self._deliver)
        try:
            info = await asyncio.to_thread(
                self.runtime.launch, request.program, request.arguments, self._event_sink(gate))
        except LookupError as e:  # the runtime's UnknownProgram
            raise RpcError(ErrorCode.UNKNOWN_PROGRAM, str(e)) from None
        except RuntimeError as e:  # the runtime's LaunchRefused
            raise RpcError(ErrorCode.LAUNCH_REFUSED, str(e)) from None
        self.instances.add(info.id)
        self._reply(request, info.id)
        gate.open()

    async def _on_send(self, request: rpc.Send) -> None:
        self._owned(request.instance_id)
        size = len(request.message.encode())
        if size > self.config.max_message_bytes:
            raise RpcError(ErrorCode.MESSAGE_TOO_LARGE,
                           f"{size} bytes exceed server.max_message_bytes = {self.config.max_message_bytes}")
        try:
            self.runtime.send(request.instance_id, request.message)
        except LookupError as e:  # the runtime's UnknownInstance: it has just ended
            raise RpcError(ErrorCode.UNKNOWN_INSTANCE, str(e)) from None
        self._reply(request)

    async def _on_terminate(self, request: rpc.Terminate) -> None:
        self._owned(request.instance_id)
        try:
            await asyncio.to_thread(self.runtime.terminate, request.instance_id)
        except LookupError as e:
            raise RpcError(ErrorCode.UNKNOWN_INSTANCE, str(e)) from None
        self._reply(request)

    async def _on_list_instances(self, request: rpc.ListInstances) -> None:
        instances = [
            dataclasses.asdict(rpc.InstanceSummary(i.id, i.program, i.name, list(i.arguments),
                                                   i.started_at, i.state))
            for i in self.runtime.list_instances()
        ]
        self._reply(request, instances)

    # --- helpers -------------------------------------------------------------------------

    def _upload(self, sha256: str) -> _Upload:
        upload = self.uploads.get(sha256)
        if upload is None:
            raise RpcError(ErrorCode.NO_UPLOAD, f"no upload_begin for {sha256} on this connection")
        return upload

    def _owned(self, instance_id: str) -> None:
        if instance_id not in self.instances:
            raise RpcError(ErrorCode.UNKNOWN_INSTANCE,
                           f"no live instance {instance_id!r} launched on this connection")

    def _event_sink(self, gate: _EventGate) -> EventSink:
        """The runtime's callback for one instance; it runs on instance threads, so it only
        hands the event over to the event loop."""
        loop = self.loop

        def on_event(instance_id: str, kind: str, data: str, usage: dict | None = None) -> None:
            if kind == "message":
                event: rpc.Event = rpc.InstanceMessage(instance_id, data)
            elif kind == "terminated":
                event = rpc.InstanceTerminated(instance_id, data, usage or {})
            else:
                raise ValueError(f"unknown instance event kind {kind!r}")
            try:
                loop.call_soon_threadsafe(gate.push, event)
            except RuntimeError:
                pass  # the event loop is closed: the server has stopped, nobody to tell

        return on_event

    def _deliver(self, event: rpc.Event) -> None:
        if self.closed:
            return
        if isinstance(event, rpc.InstanceTerminated):
            self.instances.discard(event.instance_id)
        self._send(event)

    def _reply(self, request: rpc.Request, value: object = None) -> None:
        self._send(rpc.Ok(request.corr_id, value))

    def _send(self, message: rpc.Message) -> None:
        self.outbox.put_nowait(rpc.encode(message))


def _check_hash(value: str) -> str:
    if not SHA256_HEX.fullmatch(value.lower()):
        raise RpcError(ErrorCode.INVALID_REQUEST, f"expected a sha256 hex digest (64 hex digits), got {value!r}")
    return value.lower()
