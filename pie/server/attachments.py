"""Where each RPC-launched instance's events go: the connection attached to it, or a buffer;
and each connection's outbox, the frames queued for it and not yet written.

An instance launched normally belongs to its connection and ends with it. One launched
*detached* outlives its connection: while no client is attached its events are held, and
any connection of the same user can `attach` to receive them and then the live ones. Held
messages are bounded in count and bytes (server.max_pending_messages, max_pending_bytes):
beyond that the instance's next `send` waits until a client attaches, so nothing is lost.
A connection's outbox is bounded in bytes (server.max_outbox_bytes): beyond it the
instances attached to the connection wait in `send` the same way until the client reads.
Events pass from instance threads to the event loop; everything else here runs on the
event loop.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pie.server import rpc

if TYPE_CHECKING:
    from pie.runtime.runtime import InstanceInfo

# Finished detached instances whose results nobody has collected, kept per user; beyond
# this the oldest is forgotten (an attach then says it is unknown).
FINISHED_KEPT = 64

# Bytes counted for each queued frame besides its own (the bytes object and queue slot).
FRAME_OVERHEAD = 64

Deliver = Callable[[rpc.Event], None]


def text_bytes(text: str) -> int:
    """UTF-8 bytes of `text` (without encoding it when it is ASCII)."""
    return len(text) if text.isascii() else len(text.encode())


@dataclass(frozen=True)
class Close:
    """Queued after the last frame: the writer closes the connection with this code."""

    code: int
    reason: str


class Outbox:
    """Frames queued for one connection and not yet written, bounded in bytes (`cap`,
    server.max_outbox_bytes). Over the bound `room` is clear: the connection's instances
    wait before their next message and the connection reads no further request until the
    writer has caught up. Replies and ends are always queued, never refused. Messages that
    instance threads have posted and the event loop has not queued yet count too
    (`reserve`), so a burst cannot outrun the bound: at most one message per instance
    beyond it. Frames are queued and written on the event loop; any thread may reserve."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.lock = threading.Lock()
        self.frames: deque[bytes | Close] = deque()
        self.bytes = 0  # queued and being written, plus reservations
        self.room = threading.Event()
        self.room.set()
        self.full_since: float | None = None
        self.written_at = time.monotonic()  # when the client last took a frame
        self.closed = False
        self._ready = asyncio.Event()  # frames are queued
        self._not_full = asyncio.Event()
        self._not_full.set()

    def _update(self) -> None:
        """Under the lock, after `bytes` changed."""
        if self.bytes >= self.cap and not self.closed:
            if self.room.is_set():
                self.room.clear()
                self.full_since = time.monotonic()
        elif not self.room.is_set():
            self.room.set()
            self.full_since = None

    def _freed(self) -> None:
        """On the event loop, after `bytes` went down."""
        if self.room.is_set():
            self._not_full.set()

    # --- any thread ---------------------------------------------------------------------

    def reserve(self, size: int) -> None:
        with self.lock:
            if not self.closed:
                self.bytes += size
                self._update()

    # --- event loop ---------------------------------------------------------------------

    def release(self, size: int) -> None:
        with self.lock:
            if not self.closed:
                self.bytes -= size
                self._update()
        self._freed()

    def put(self, frame: bytes | Close) -> None:
        with self.lock:
            if self.closed:
                return
            self.frames.append(frame)
            if isinstance(frame, bytes):
                self.bytes += len(frame) + FRAME_OVERHEAD
                self._update()
        self._ready.set()

    async def get(self) -> bytes | Close:
        """The next frame to write; call `sent` once it is written."""
        while not self.frames:
            self._ready.clear()
            await self._ready.wait()
        return self.frames.popleft()

    def sent(self, frame: bytes) -> None:
        with self.lock:
            if not self.closed:
                self.bytes -= len(frame) + FRAME_OVERHEAD
                self.written_at = time.monotonic()
                self._update()
        self._freed()

    async def wait_room(self) -> None:
        """Until the outbox is below its bound (at once if it is)."""
        while not self.room.is_set():
            self._not_full.clear()
            await self._not_full.wait()

    def stalled_s(self) -> float:
        """How long the outbox has been over its bound without the client taking a frame."""
        with self.lock:
            if self.full_since is None:
                return 0.0
            return time.monotonic() - max(self.full_since, self.written_at)

    def close(self) -> None:
        """Drop what was not written and release everything that waits for room."""
        with self.lock:
            self.closed = True
            self.frames.clear()
            self.bytes = 0
            self.room.set()
            self.full_since = None
        self._not_full.set()
        self._ready.set()


@dataclass(eq=False)
class Attachment:
    user: str
    detached: bool
    limit: int  # held messages before the instance's sends wait
    limit_bytes: int  # held bytes (UTF-8 of the messages) before the instance's sends wait
    loop: asyncio.AbstractEventLoop
    deliver: Deliver | None = None  # the attached connection's; None = hold events
    sink: Outbox | None = None  # the attached connection's outbox
    held: deque[rpc.Event] = field(default_factory=deque)
    ended: bool = False
    # Messages posted and not yet delivered to a connection, and their bytes (counted on
    # both threads).
    undelivered: int = 0
    undelivered_bytes: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    room: threading.Event = field(default_factory=threading.Event)
    info: InstanceInfo | None = None  # set once launched

    def __post_init__(self) -> None:
        self.room.set()

    @property
    def instance_id(self) -> str:
        assert self.info is not None
        return self.info.id

    # --- instance threads -------------------------------------------------------------------

    def post(self, event: rpc.Event) -> threading.Event | None:
        """Hand an event to the event loop. Returns an Event the instance must wait for
        before its next message (else None): when `limit` messages or `limit_bytes` bytes
        are undelivered, or the attached connection's outbox is over its bound."""
        size, sink = 0, None
        if isinstance(event, rpc.InstanceMessage | rpc.InstanceLog):
            size = text_bytes(event.text)
            with self.lock:
                self.undelivered += 1
                self.undelivered_bytes += size
                if self.undelivered >= self.limit or self.undelivered_bytes >= self.limit_bytes:
                    self.room.clear()
                sink = self.sink
                if sink is not None:
                    sink.reserve(size)
        try:
            self.loop.call_soon_threadsafe(self._push, event, sink, size)
        except RuntimeError:
            return None  # the event loop is closed: the server has stopped, nobody to tell
        if not self.room.is_set():
            return self.room
        if sink is not None and not sink.room.is_set():
            return sink.room
        return None

    # --- event loop -------------------------------------------------------------------------

    def _push(self, event: rpc.Event, sink: Outbox | None = None, size: int = 0) -> None:
        if sink is not None:
            sink.release(size)  # now queued for real (or held, if the connection has gone)
        if isinstance(event, rpc.InstanceTerminated):
            self.ended = True
        if self.deliver is None:
            self.held.append(event)
        else:
            self._hand(event)

    def _hand(self, event: rpc.Event) -> None:
        assert self.deliver is not None
        self.deliver(event)
        if isinstance(event, rpc.InstanceMessage | rpc.InstanceLog):
            with self.lock:
                self.undelivered -= 1
                self.undelivered_bytes -= text_bytes(event.text)
                if self.undelivered < self.limit and self.undelivered_bytes < self.limit_bytes:
                    self.room.set()

    def attach(self, deliver: Deliver, sink: Outbox | None = None) -> None:
        """From now on events go to `deliver` (queued on `sink`), the held ones first."""
        with self.lock:
            self.deliver, self.sink = deliver, sink
        while self.held and self.deliver is deliver:
            self._hand(self.held.popleft())

    def detach(self) -> None:
        with self.lock:
            self.deliver, self.sink = None, None


class UnknownAttachment(LookupError):
    """No live instance (or one holding results) of this id belongs to the user."""


class Attachments:
    """Every RPC-launched instance's attachment, until its end has been delivered."""

    def __init__(self, message_limit: int, byte_limit: int = 16 * 2**20):
        self.message_limit = message_limit
        self.byte_limit = byte_limit
        self.by_id: dict[str, Attachment] = {}

    def create(self, user: str, detached: bool) -> Attachment:
        """An attachment holding events until the launch reply has gone out (its instance
        is set then, see `register`)."""
        return Attachment(user, detached, self.message_limit, self.byte_limit,
                          asyncio.get_running_loop())

    def register(self, attachment: Attachment, info: InstanceInfo) -> None:
        attachment.info = info
        self.by_id[info.id] = attachment
        self._forget_old(attachment.user)

    def find(self, instance_id: str, user: str) -> Attachment:
        attachment = self.by_id.get(instance_id)
        if attachment is None or attachment.user != user:  # other users' ids are not revealed
            raise UnknownAttachment(f"no instance {instance_id!r} of yours is live or holds results")
        return attachment

    def of_user(self, user: str) -> list[Attachment]:
        return [a for a in self.by_id.values() if a.user == user]

    def forget(self, instance_id: str) -> None:
        self.by_id.pop(instance_id, None)

    def _forget_old(self, user: str) -> None:
        finished = [a for a in self.of_user(user) if a.ended and a.deliver is None]
        for attachment in finished[:max(0, len(finished) - FINISHED_KEPT)]:
            self.forget(attachment.instance_id)
