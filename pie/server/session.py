"""One client connection: its user (authentication), its uploads in progress, the instances
attached to it (those it launched, and detached ones it attached to).

The session turns decoded requests into runtime calls and queues reply and event frames on
`outbox` (bounded in bytes: server.max_outbox_bytes), which the WebSocket endpoint drains.
Requests are handled one at a time, so upload chunks arrive in order and a disconnect is
seen only after the request in progress is done. Runtime calls that may block (compile,
instantiate, terminate) run in worker threads. Uploads in progress are bounded per
connection, per user and on the whole server (`UploadBudget`, one per app).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import hmac
import logging
import re
import threading
import time
from collections import Counter
from typing import TYPE_CHECKING

from pie.config import ServerConfig
from pie.control.quotas import ANONYMOUS, fingerprint
from pie.runtime.runtime import InboxFull, InvalidProgram, LaunchRefused, UnknownInstance, UnknownProgram
from pie.server import rpc
from pie.server.attachments import Attachment, Attachments, Outbox, UnknownAttachment
from pie.server.rpc import ErrorCode, RpcError

if TYPE_CHECKING:
    from pie.runtime.runtime import Runtime

log = logging.getLogger(__name__)

SHA256_HEX = re.compile(r"[0-9a-f]{64}")
DISCONNECT_REASON = "client disconnected"


@dataclasses.dataclass
class _Upload:
    size: int  # declared by upload_begin
    user: str  # charged for it in the UploadBudget
    public: bool = False  # every user may launch the program
    data: bytearray = dataclasses.field(default_factory=bytearray)


class UploadBudget:
    """Bytes of the uploads in progress (their declared sizes), per user and on the whole
    server, over every connection: server.max_user_upload_bytes, max_total_upload_bytes.
    Reserved by upload_begin, released when the upload ends, fails or its connection
    closes. One per app; used on the event loop only."""

    def __init__(self, config: ServerConfig) -> None:
        self.user_limit = config.max_user_upload_bytes
        self.total_limit = config.max_total_upload_bytes
        self.by_user: Counter[str] = Counter()
        self.total = 0

    def reserve(self, user: str, size: int) -> None:
        held = self.by_user[user]
        if held + size > self.user_limit:
            raise RpcError(ErrorCode.UPLOAD_TOO_LARGE,
                           f"{size} bytes (plus {held} in uploads of yours in progress) exceed "
                           f"server.max_user_upload_bytes = {self.user_limit}")
        if self.total + size > self.total_limit:
            raise RpcError(ErrorCode.UPLOAD_TOO_LARGE,
                           f"{size} bytes more of uploads in progress would exceed "
                           f"server.max_total_upload_bytes = {self.total_limit}; try again later")
        self.by_user[user] += size
        self.total += size

    def release(self, user: str, size: int) -> None:
        self.by_user[user] -= size
        if self.by_user[user] <= 0:
            del self.by_user[user]
        self.total -= size


def authenticate(tokens: list[str], given: str) -> str | None:
    """The user `given` stands for: a fingerprint of the token (quotas, listings and logs
    name users so, never by the token), `anonymous` on a server without tokens (where a
    token names no one: a client could pick a fresh one per quota), None if it matches no
    token. Compared in constant time against every token (no early exit to time)."""
    if not tokens:
        return ANONYMOUS
    return fingerprint(given) if _one_of(tokens, given) else None


def is_admin(config: ServerConfig, given: str) -> bool:
    """Whether `given` is one of server.admin_tokens (who may see every user's usage in
    /stats)."""
    return _one_of(config.admin_tokens, given)


def _one_of(tokens: list[str], given: str) -> bool:
    """Whether `given` is in `tokens`, compared in constant time against every one (no early
    exit to time)."""
    matched = False
    for token in tokens:
        matched |= hmac.compare_digest(given.encode(), token.encode())
    return matched


class Session:
    def __init__(self, config: ServerConfig, runtime: Runtime, attachments: Attachments,
                 budget: UploadBudget | None = None):
        self.config = config
        self.runtime = runtime
        self.attachments = attachments
        self.budget = budget or UploadBudget(config)
        self.outbox = Outbox(config.max_outbox_bytes)
        self.authenticated = not config.tokens
        self.user = ANONYMOUS
        self.uploads: dict[str, _Upload] = {}
        self.instances: dict[str, Attachment] = {}  # attached here, end not yet delivered
        # Set when the client stopped reading (see app.py): why the connection is closed.
        self.slow_reason: str | None = None

    async def handle(self, frame: bytes) -> None:
        """Answer one client frame with exactly one reply (an error if anything is wrong)."""
        try:
            request = rpc.decode_request(frame)
        except RpcError as e:
            self._send(rpc.Error(e.corr_id, e.code, e.message))
            return
        except Exception as e:  # a malformed frame the decoder did not foresee: still one reply
            log.warning("unreadable request frame: %s", type(e).__name__)
            self._send(rpc.Error(None, ErrorCode.INVALID_MESSAGE, f"unreadable frame ({type(e).__name__})"))
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
        """The connection is gone: detached instances are left to run (their events are held
        for the next attach), every other instance attached here is terminated; uploads in
        progress are dropped and what was not written is given back."""
        for sha256 in list(self.uploads):
            self._discard(sha256)
        instances, self.instances = self.instances, {}
        for attachment in instances.values():  # first: nothing more goes to the outbox
            if attachment.detached:
                attachment.detach()
            else:
                attachment.attach(lambda event: None)  # nobody is left to tell
        self.outbox.close()  # wakes the instances waiting for room in it
        for instance_id, attachment in instances.items():
            if attachment.detached:
                continue
            self.attachments.forget(instance_id)
            try:
                await asyncio.to_thread(self.runtime.terminate, instance_id, DISCONNECT_REASON)
            except UnknownInstance:
                pass  # it ended on its own meanwhile

    async def end_for_slow_client(self, reason: str, timeout_s: float = 5.0) -> None:
        """The client stopped reading: end the instances attached here with `reason`
        (detached ones are left to run, their events held) and wait, at most `timeout_s`,
        until their ends are queued behind what the client has not read."""
        ending = []
        for instance_id, attachment in list(self.instances.items()):
            if attachment.detached:
                attachment.detach()
                del self.instances[instance_id]
                continue
            try:
                await asyncio.to_thread(self.runtime.terminate, instance_id, reason)
                ending.append(instance_id)
            except UnknownInstance:
                pass  # it ended on its own meanwhile
        deadline = time.monotonic() + timeout_s
        while any(i in self.instances for i in ending) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)

    # --- requests ------------------------------------------------------------------------

    async def _on_authenticate(self, request: rpc.Authenticate) -> None:
        user = authenticate(self.config.tokens, request.token)
        if user is None:
            raise RpcError(ErrorCode.AUTH_FAILED, "invalid token")
        self.authenticated, self.user = True, user
        self._reply(request)

    async def _on_upload_begin(self, request: rpc.UploadBegin) -> None:
        sha256 = _check_hash(request.sha256)
        if request.size < 0:
            raise RpcError(ErrorCode.INVALID_REQUEST, f"upload_begin.size must be >= 0, got {request.size}")
        if sha256 in self.uploads:  # begun again: start over
            self._discard(sha256)
        pending = sum(u.size for u in self.uploads.values())
        if pending + request.size > self.config.max_upload_bytes:
            raise RpcError(ErrorCode.UPLOAD_TOO_LARGE,
                           f"{request.size} bytes (plus {pending} pending on this connection) exceed "
                           f"server.max_upload_bytes = {self.config.max_upload_bytes}")
        self.budget.reserve(self.user, request.size)
        self.uploads[sha256] = _Upload(request.size, self.user, request.public)
        self._reply(request)

    async def _on_upload_chunk(self, request: rpc.UploadChunk) -> None:
        sha256 = _check_hash(request.sha256)
        upload = self._upload(sha256)
        if len(upload.data) + len(request.data) > upload.size:
            self._discard(sha256)
            raise RpcError(ErrorCode.UPLOAD_TOO_LARGE,
                           f"more bytes than the {upload.size} declared in upload_begin; upload discarded")
        upload.data += request.data
        self._reply(request, len(upload.data))

    async def _on_upload_end(self, request: rpc.UploadEnd) -> None:
        sha256 = _check_hash(request.sha256)
        upload = self._upload(sha256)
        self._discard(sha256)  # its bytes no longer count as an upload in progress
        if len(upload.data) != upload.size:
            raise RpcError(ErrorCode.UPLOAD_INCOMPLETE,
                           f"received {len(upload.data)} of {upload.size} bytes; upload discarded")
        data, public = bytes(upload.data), upload.public
        del upload
        actual = await asyncio.to_thread(lambda: hashlib.sha256(data).hexdigest())
        if actual != sha256:
            raise RpcError(ErrorCode.HASH_MISMATCH, f"the bytes hash to {actual}, not {sha256}")
        try:
            stored = await asyncio.to_thread(self.runtime.programs.add, data, self.user, public)
        except InvalidProgram as e:
            raise RpcError(ErrorCode.INVALID_PROGRAM, str(e)) from None
        self._reply(request, stored)

    async def _on_program_exists(self, request: rpc.ProgramExists) -> None:
        self._reply(request, self.runtime.programs.exists(_check_hash(request.sha256), self.user))

    async def _on_launch(self, request: rpc.Launch) -> None:
        attachment = self.attachments.create(self.user, request.detached)

        def on_event(instance_id: str, kind: str, data: str,
                     usage: dict | None = None) -> threading.Event | None:
            if kind == "message":
                return attachment.post(rpc.InstanceMessage(instance_id, data))
            return attachment.post(rpc.InstanceTerminated(instance_id, data, usage or {}))

        def on_log(instance_id: str, level: str, text: str) -> threading.Event | None:
            return attachment.post(rpc.InstanceLog(instance_id, level, text))

        try:
            info = self.runtime.launch(request.program, request.arguments, on_event, self.user,
                                       on_log if request.logs else None)
        except UnknownProgram as e:
            raise RpcError(ErrorCode.UNKNOWN_PROGRAM, str(e)) from None
        except LaunchRefused as e:
            raise RpcError(ErrorCode.LAUNCH_REFUSED, str(e)) from None
        self.attachments.register(attachment, info)
        self._reply(request, info.id)
        self._attach(attachment)

    async def _on_attach(self, request: rpc.Attach) -> None:
        try:
            attachment = self.attachments.find(request.instance_id, self.user)
        except UnknownAttachment as e:
            raise RpcError(ErrorCode.UNKNOWN_INSTANCE, str(e)) from None
        if request.instance_id in self.instances:
            raise RpcError(ErrorCode.NOT_ATTACHABLE, "the instance is already attached to this connection")
        if not attachment.detached:
            raise RpcError(ErrorCode.NOT_ATTACHABLE,
                           "the instance was not launched detached; it belongs to its connection")
        if attachment.deliver is not None:
            raise RpcError(ErrorCode.NOT_ATTACHABLE, "the instance is attached to another connection")
        self._reply(request)
        self._attach(attachment)

    async def _on_send(self, request: rpc.Send) -> None:
        self._owned(request.instance_id)
        size = len(request.message.encode())
        if size > self.config.max_message_bytes:
            raise RpcError(ErrorCode.MESSAGE_TOO_LARGE,
                           f"{size} bytes exceed server.max_message_bytes = {self.config.max_message_bytes}")
        try:
            self.runtime.send(request.instance_id, request.message)
        except UnknownInstance as e:  # it has just ended
            raise RpcError(ErrorCode.UNKNOWN_INSTANCE, str(e)) from None
        except InboxFull as e:  # it does not read its messages
            raise RpcError(ErrorCode.INBOX_FULL, str(e)) from None
        self._reply(request)

    async def _on_terminate(self, request: rpc.Terminate) -> None:
        self._owned(request.instance_id)
        try:
            await asyncio.to_thread(self.runtime.terminate, request.instance_id)
        except UnknownInstance as e:
            raise RpcError(ErrorCode.UNKNOWN_INSTANCE, str(e)) from None
        self._reply(request)

    async def _on_list_instances(self, request: rpc.ListInstances) -> None:
        instances = []
        for attachment in self.attachments.of_user(self.user):
            i = attachment.info
            assert i is not None
            state = "terminated" if attachment.ended else i.state
            instances.append(dataclasses.asdict(rpc.InstanceSummary(
                i.id, i.program, i.name, list(i.arguments), i.started_at, state,
                attachment.detached, attachment.deliver is not None, attachment.undelivered)))
        self._reply(request, instances)

    # --- helpers -------------------------------------------------------------------------

    def _upload(self, sha256: str) -> _Upload:
        upload = self.uploads.get(sha256)
        if upload is None:
            raise RpcError(ErrorCode.NO_UPLOAD, f"no upload_begin for {sha256} on this connection")
        return upload

    def _discard(self, sha256: str) -> None:
        upload = self.uploads.pop(sha256)
        self.budget.release(upload.user, upload.size)

    def _owned(self, instance_id: str) -> None:
        if instance_id not in self.instances:
            raise RpcError(ErrorCode.UNKNOWN_INSTANCE,
                           f"no live instance {instance_id!r} attached to this connection")

    def _attach(self, attachment: Attachment) -> None:
        self.instances[attachment.instance_id] = attachment
        attachment.attach(self._deliver, self.outbox)

    def _deliver(self, event: rpc.Event) -> None:
        if isinstance(event, rpc.InstanceTerminated):
            self.instances.pop(event.instance_id, None)
            self.attachments.forget(event.instance_id)
        self._send(event)

    def _reply(self, request: rpc.Request, value: object = None) -> None:
        self._send(rpc.Ok(request.corr_id, value))

    def _send(self, message: rpc.Message) -> None:
        self.outbox.put(rpc.encode(message))


def _check_hash(value: str) -> str:
    if not SHA256_HEX.fullmatch(value.lower()):
        raise RpcError(ErrorCode.INVALID_REQUEST, f"expected a sha256 hex digest (64 hex digits), got {value!r}")
    return value.lower()
