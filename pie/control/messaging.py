"""Messages between clients and inferlets, and between inferlets (broadcast/subscribe)."""

from __future__ import annotations

import threading
from collections import deque

from pie.control.errors import ErrorKind, HostError
from pie.control.future import HostFuture


class Inbox:
    """Messages waiting for a reader, or readers waiting for a message (never both). With a
    `limit`, a message beyond that many unread ones is refused (OverflowError) — or, with
    `drop_oldest`, queued in place of the oldest unread one."""

    def __init__(self, limit: int = 0, drop_oldest: bool = False) -> None:
        self.lock = threading.Lock()
        self.messages: deque[str] = deque()
        self.readers: deque[HostFuture] = deque()
        self.limit = limit
        self.drop_oldest = drop_oldest

    def put(self, message: str) -> bool:
        """Deliver or queue `message`; whether an older unread message was dropped for it."""
        with self.lock:
            while self.readers:
                reader = self.readers.popleft()
                if not reader.done():
                    reader.set_result(message)
                    return False
            dropped = bool(self.limit) and len(self.messages) >= self.limit
            if dropped and not self.drop_oldest:
                raise OverflowError(f"the instance has {len(self.messages)} unread messages, the "
                                    f"limit is server.max_pending_messages = {self.limit}")
            if dropped:
                self.messages.popleft()
            self.messages.append(message)
            return dropped

    def next(self) -> HostFuture:
        with self.lock:
            if self.messages:
                return HostFuture.resolved(self.messages.popleft())
            future = HostFuture()
            self.readers.append(future)
            return future


class MessageBus:
    """Topics for broadcast/subscribe across instances. A subscription keeps at most
    `backlog` unread messages, dropping the oldest beyond (counted in `dropped`), as the WIT
    promises: a subscriber that does not read neither grows without bound nor holds up the
    broadcasters."""

    def __init__(self, backlog: int) -> None:
        self.lock = threading.Lock()
        self.topics: dict[str, list[tuple[str, Inbox]]] = {}
        self.backlog = backlog
        self.dropped = 0  # unread messages dropped from full subscriptions (/stats)

    def subscribe(self, instance_id: str, topic: str) -> Inbox:
        inbox = Inbox(self.backlog, drop_oldest=True)
        with self.lock:
            self.topics.setdefault(topic, []).append((instance_id, inbox))
        return inbox

    def broadcast(self, topic: str, message: str) -> int:
        """Deliver to every subscriber; how many there were."""
        with self.lock:
            subscribers = [inbox for _, inbox in self.topics.get(topic, [])]
        dropped = sum(inbox.put(message) for inbox in subscribers)
        if dropped:
            with self.lock:
                self.dropped += dropped
        return len(subscribers)

    def drop_instance(self, instance_id: str) -> None:
        with self.lock:
            for topic in list(self.topics):
                kept = [(i, box) for i, box in self.topics[topic] if i != instance_id]
                if kept:
                    self.topics[topic] = kept
                else:
                    del self.topics[topic]


class KeyValueStore:
    """A process-wide string store shared by all inferlets (persists across launches),
    capped at `max_bytes` of keys and values together (control.kvs_max_bytes)."""

    def __init__(self, max_bytes: int) -> None:
        self.lock = threading.Lock()
        self.data: dict[str, str] = {}
        self.max_bytes = max_bytes
        self.used = 0

    def get(self, key: str) -> str | None:
        with self.lock:
            return self.data.get(key)

    def set(self, key: str, value: str) -> None:
        size = len(key.encode()) + len(value.encode())
        with self.lock:
            old = self.data.get(key)
            freed = 0 if old is None else len(key.encode()) + len(old.encode())
            if self.used - freed + size > self.max_bytes:
                raise HostError(ErrorKind.OUT_OF_RESOURCES,
                                f"the key-value store holds {self.used} bytes; {size} more would exceed "
                                f"control.kvs_max_bytes = {self.max_bytes}")
            self.data[key] = value
            self.used += size - freed

    def delete(self, key: str) -> None:
        with self.lock:
            old = self.data.pop(key, None)
            if old is not None:
                self.used -= len(key.encode()) + len(old.encode())

