"""Where each RPC-launched instance's events go: the connection attached to it, or a buffer.

An instance launched normally belongs to its connection and ends with it. One launched
*detached* outlives its connection: while no client is attached its events are held, and
any connection of the same user can `attach` to receive them and then the live ones. Held
messages are bounded (server.max_pending_messages): beyond that the instance's next `send`
waits until a client attaches, so nothing is lost. Events pass from instance threads to
the event loop; everything else here runs on the event loop.
"""

from __future__ import annotations

import asyncio
import threading
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

Deliver = Callable[[rpc.Event], None]


@dataclass(eq=False)
class Attachment:
    user: str
    detached: bool
    limit: int  # held messages before the instance's sends wait
    loop: asyncio.AbstractEventLoop
    deliver: Deliver | None = None  # the attached connection's; None = hold events
    held: deque[rpc.Event] = field(default_factory=deque)
    ended: bool = False
    # Messages posted and not yet delivered to a connection (counted on both threads).
    undelivered: int = 0
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
        before its next message when `limit` messages are undelivered (else None)."""
        if isinstance(event, rpc.InstanceMessage):
            with self.lock:
                self.undelivered += 1
                if self.undelivered >= self.limit:
                    self.room.clear()
        try:
            self.loop.call_soon_threadsafe(self._push, event)
        except RuntimeError:
            return None  # the event loop is closed: the server has stopped, nobody to tell
        return None if self.room.is_set() else self.room

    # --- event loop -------------------------------------------------------------------------

    def _push(self, event: rpc.Event) -> None:
        if isinstance(event, rpc.InstanceTerminated):
            self.ended = True
        if self.deliver is None:
            self.held.append(event)
        else:
            self._hand(event)

    def _hand(self, event: rpc.Event) -> None:
        assert self.deliver is not None
        self.deliver(event)
        if isinstance(event, rpc.InstanceMessage):
            with self.lock:
                self.undelivered -= 1
                if self.undelivered < self.limit:
                    self.room.set()

    def attach(self, deliver: Deliver) -> None:
        """From now on events go to `deliver`, the held ones first."""
        self.deliver = deliver
        while self.held and self.deliver is deliver:
            self._hand(self.held.popleft())

    def detach(self) -> None:
        self.deliver = None


class Attachments:
    """Every RPC-launched instance's attachment, until its end has been delivered."""

    def __init__(self, message_limit: int):
        self.message_limit = message_limit
        self.by_id: dict[str, Attachment] = {}

    def create(self, user: str, detached: bool) -> Attachment:
        """An attachment holding events until the launch reply has gone out (its instance
        is set then, see `register`)."""
        return Attachment(user, detached, self.message_limit, asyncio.get_running_loop())

    def register(self, attachment: Attachment, info: InstanceInfo) -> None:
        attachment.info = info
        self.by_id[info.id] = attachment
        self._forget_old(attachment.user)

    def find(self, instance_id: str, user: str) -> Attachment:
        attachment = self.by_id.get(instance_id)
        if attachment is None or attachment.user != user:  # other users' ids are not revealed
            raise LookupError(f"no instance {instance_id!r} of yours is live or holds results")
        return attachment

    def of_user(self, user: str) -> list[Attachment]:
        return [a for a in self.by_id.values() if a.user == user]

    def forget(self, instance_id: str) -> None:
        self.by_id.pop(instance_id, None)

    def _forget_old(self, user: str) -> None:
        finished = [a for a in self.of_user(user) if a.ended and a.deliver is None]
        for attachment in finished[:max(0, len(finished) - FINISHED_KEPT)]:
            self.forget(attachment.instance_id)
