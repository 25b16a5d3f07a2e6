"""The client ⇄ server RPC protocol: the only definition of its messages.

Clients talk to `pie serve` over a WebSocket at `/ws`. Every frame is binary and holds one
msgpack map with a `type` key. A client sends *requests*; each carries an integer
`corr_id` that the server echoes in exactly one reply, `ok` (with a `value`) or `error`
(with a `code` from `ErrorCode` and a human-readable `message`). The server also pushes
*events* of the instances launched on the connection.

A connection handles its requests one at a time, in order (upload chunks rely on it);
open several connections for parallel work. The reply to `launch` is always sent before
any event of the new instance. A connection opened while the backend is still starting is
closed at once with code 1013 (poll `GET /health` until it answers 200).

This is separate from `pie/protocol.py`, which is the control ⇄ backend protocol.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, ClassVar

import msgpack

# Size of the upload chunks the client sends (the server's frame limit leaves room for it).
CHUNK_BYTES = 1 << 20
# WebSocket close code of a connection opened before the backend handshake is done.
CLOSE_NOT_READY = 1013  # "try again later"
# Close code of a connection whose client stopped reading (server.slow_client_timeout_s);
# the reason says so.
CLOSE_SLOW_CLIENT = 1008  # "policy violation"


class ErrorCode(StrEnum):
    INVALID_MESSAGE = "invalid_message"  # not binary msgpack, not a map, no usable corr_id
    UNKNOWN_OP = "unknown_op"
    INVALID_REQUEST = "invalid_request"  # missing, unknown or wrongly typed field
    UNAUTHENTICATED = "unauthenticated"  # a request before a successful authenticate
    AUTH_FAILED = "auth_failed"
    # over server.max_upload_bytes / max_user_upload_bytes / max_total_upload_bytes, or the declared size
    UPLOAD_TOO_LARGE = "upload_too_large"
    NO_UPLOAD = "no_upload"  # chunk or end without upload_begin
    UPLOAD_INCOMPLETE = "upload_incomplete"  # end before the declared size arrived
    HASH_MISMATCH = "hash_mismatch"
    INVALID_PROGRAM = "invalid_program"  # the bytes are not a valid component
    UNKNOWN_PROGRAM = "unknown_program"
    LAUNCH_REFUSED = "launch_refused"  # e.g. runtime.max_instances reached
    UNKNOWN_INSTANCE = "unknown_instance"  # not live, or not attached to this connection
    NOT_ATTACHABLE = "not_attachable"  # not launched detached, or attached to another connection
    MESSAGE_TOO_LARGE = "message_too_large"  # over server.max_message_bytes
    INBOX_FULL = "inbox_full"  # the instance has server.max_pending_messages unread messages
    INTERNAL = "internal"


class RpcError(Exception):
    """A request that failed; the server turns it into an `Error` reply, the client raises it."""

    def __init__(self, code: ErrorCode | str, message: str, corr_id: int | None = None):
        super().__init__(f"{code}: {message}")
        self.code = str(code)
        self.message = message
        self.corr_id = corr_id


@dataclass
class Message:
    """Base of every frame; `type` ties a dataclass to its wire tag."""

    type: ClassVar[str]

    def to_wire(self) -> dict[str, Any]:
        return {"type": self.type, **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)}}


# --- requests (client → server) ------------------------------------------------------------


@dataclass
class Request(Message):
    corr_id: int


@dataclass
class Authenticate(Request):
    """Must come first when the server has auth tokens. Value: None."""

    type: ClassVar[str] = "authenticate"
    token: str


@dataclass
class UploadBegin(Request):
    """Start uploading a program of `size` bytes whose sha256 is `sha256`. A `public`
    program may be launched by every user (otherwise only by those who uploaded it).
    Value: None."""

    type: ClassVar[str] = "upload_begin"
    sha256: str
    size: int
    public: bool = False


@dataclass
class UploadChunk(Request):
    """The next bytes of the upload `sha256`. Value: bytes received so far."""

    type: ClassVar[str] = "upload_chunk"
    sha256: str
    data: bytes


@dataclass
class UploadEnd(Request):
    """Verify size and hash, compile and store the program. Value: its hash."""

    type: ClassVar[str] = "upload_end"
    sha256: str


@dataclass
class ProgramExists(Request):
    """Value: whether the server stores the program with this hash."""

    type: ClassVar[str] = "program_exists"
    sha256: str


@dataclass
class Launch(Request):
    """Start an instance of a program (hash or built-in name). Value: the instance id.
    A `detached` instance is not terminated when this connection closes (see `Attach`).
    With `logs`, the instance's log lines (its `log` calls, a Python inferlet's print() and
    stderr, a Rust panic's message) come as `InstanceLog` events too; they always go to the
    server log."""

    type: ClassVar[str] = "launch"
    program: str
    arguments: list[str] = field(default_factory=list)
    detached: bool = False
    logs: bool = False


@dataclass
class Attach(Request):
    """Receive the events of a detached instance of the same user that no other connection
    is attached to: first those held since it was last attached (possibly its end), then
    live ones; `send` and `terminate` then work on it here. Value: None."""

    type: ClassVar[str] = "attach"
    instance_id: str


@dataclass
class Send(Request):
    """Deliver a message to an instance attached to this connection. Value: None."""

    type: ClassVar[str] = "send"
    instance_id: str
    message: str


@dataclass
class Terminate(Request):
    """Stop an instance attached to this connection. Value: None."""

    type: ClassVar[str] = "terminate"
    instance_id: str


@dataclass
class ListInstances(Request):
    """Value: the caller's user's instances — live ones, and detached ones whose end nobody
    has collected — as `InstanceSummary` maps."""

    type: ClassVar[str] = "list_instances"


# --- server → client -----------------------------------------------------------------------


@dataclass
class Ok(Message):
    type: ClassVar[str] = "ok"
    corr_id: int
    value: Any = None


@dataclass
class Error(Message):
    type: ClassVar[str] = "error"
    corr_id: int | None  # None when the frame was unreadable
    code: str
    message: str


@dataclass
class InstanceMessage(Message):
    """The instance sent a message to its client."""

    type: ClassVar[str] = "instance_message"
    instance_id: str
    text: str


@dataclass
class InstanceLog(Message):
    """A line of the instance's log (only for an instance launched with `logs`)."""

    type: ClassVar[str] = "instance_log"
    instance_id: str
    level: str  # "debug" | "info" | "warn" | "error"
    text: str


@dataclass
class InstanceTerminated(Message):
    """The instance ended; `reason` is "finished", "error: …", "trap: …", "terminated by client", …"""

    type: ClassVar[str] = "instance_terminated"
    instance_id: str
    reason: str
    # What the instance consumed: forward_calls, forward_tokens, sampled_tokens, cached_tokens
    # (prompt tokens the prefix cache supplied), kv_pages_peak, embeds_peak,
    # host_calls (empty when the server does not know).
    usage: dict[str, int] = field(default_factory=dict)


@dataclass
class InstanceSummary:
    """One entry of the `list_instances` value (a plain map on the wire)."""

    id: str
    program: str  # content hash
    name: str | None  # built-in name, if launched by one
    arguments: list[str]
    started_at: float  # Unix time
    state: str  # "running" | "terminated"
    detached: bool
    attached: bool  # to some connection
    held: int = 0  # its messages not yet delivered (held while no client is attached)


Event = InstanceMessage | InstanceLog | InstanceTerminated

REQUESTS: Mapping[str, type[Request]] = types.MappingProxyType({
    cls.type: cls
    for cls in (Authenticate, UploadBegin, UploadChunk, UploadEnd, ProgramExists, Launch, Attach,
                Send, Terminate, ListInstances)
})
SERVER_MESSAGES: Mapping[str, type[Message]] = types.MappingProxyType({
    cls.type: cls for cls in (Ok, Error, InstanceMessage, InstanceLog, InstanceTerminated)
})


def encode(message: Message) -> bytes:
    return msgpack.packb(message.to_wire(), use_bin_type=True)


def decode_request(frame: bytes) -> Request:
    """Parse a client frame; raises `RpcError` saying exactly what is wrong (with the
    frame's corr_id when it has a usable one)."""
    table = _unpack(frame)
    corr_id = table.get("corr_id")
    if not isinstance(corr_id, int) or isinstance(corr_id, bool):
        raise RpcError(ErrorCode.INVALID_MESSAGE, "every request needs an integer corr_id")
    kind = table.get("type")
    cls = REQUESTS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise RpcError(ErrorCode.UNKNOWN_OP, f"unknown request type {kind!r} (known: {', '.join(REQUESTS)})",
                       corr_id)
    return _build(cls, table, corr_id)


def decode_server_message(frame: bytes) -> Message:
    """Parse a server frame (used by the client)."""
    table = _unpack(frame)
    kind = table.get("type")
    cls = SERVER_MESSAGES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise RpcError(ErrorCode.UNKNOWN_OP, f"unknown server message type {kind!r}")
    return _build(cls, table, None)


def _unpack(frame: bytes) -> dict[str, Any]:
    """The frame's map, whose keys are all strings."""
    try:
        table = msgpack.unpackb(frame, raw=False)
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        raise RpcError(ErrorCode.INVALID_MESSAGE, f"frame is not valid msgpack ({e or type(e).__name__})") from None
    if not isinstance(table, dict):
        raise RpcError(ErrorCode.INVALID_MESSAGE, f"frame must be a msgpack map, got {type(table).__name__}")
    if bad := [key for key in table if not isinstance(key, str)]:
        corr_id = table.get("corr_id")
        usable = isinstance(corr_id, int) and not isinstance(corr_id, bool)
        raise RpcError(ErrorCode.INVALID_REQUEST if usable else ErrorCode.INVALID_MESSAGE,
                       f"map keys must be strings, got {', '.join(sorted({type(k).__name__ for k in bad}))} "
                       f"key(s) {', '.join(sorted(repr(k)[:40] for k in bad)[:5])}",
                       corr_id if usable else None)
    return table


def _build(cls: type[Message], table: dict[str, Any], corr_id: int | None) -> Any:
    """Instantiate `cls` from a wire map, checking every field against its annotation."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = set(table) - set(fields) - {"type"}
    if unknown:
        raise RpcError(ErrorCode.INVALID_REQUEST, f"{cls.type}: unknown field(s) {', '.join(sorted(unknown))}",
                       corr_id)
    kwargs = {}
    for name, f in fields.items():
        if name not in table:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise RpcError(ErrorCode.INVALID_REQUEST, f"{cls.type}: missing field {name!r}", corr_id)
            continue
        if not _matches(table[name], hints[name]):
            raise RpcError(ErrorCode.INVALID_REQUEST,
                           f"{cls.type}.{name} must be {_describe(hints[name])}, got {_describe_value(table[name])}",
                           corr_id)
        kwargs[name] = table[name]
    return cls(**kwargs)


def _matches(value: Any, hint: Any) -> bool:
    if hint is Any:
        return True
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, arg) for arg in typing.get_args(hint))
    if origin is list:
        (item,) = typing.get_args(hint)
        return isinstance(value, list) and all(_matches(v, item) for v in value)
    if origin is dict:
        key, item = typing.get_args(hint)
        return isinstance(value, dict) and all(
            _matches(k, key) and _matches(v, item) for k, v in value.items())
    if hint is type(None):
        return value is None
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, hint)


def _describe(hint: Any) -> str:
    return str(hint).replace("typing.", "") if typing.get_args(hint) else hint.__name__


def _describe_value(value: Any) -> str:
    if isinstance(value, list):
        kinds = sorted({type(v).__name__ for v in value})
        return f"list of {', '.join(kinds)}" if kinds else "list"
    return type(value).__name__
