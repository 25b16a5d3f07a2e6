"""Messages between clients and inferlets, and between inferlets (broadcast/subscribe)."""

from __future__ import annotations

import threading
from collections import deque

from pie.control.future import HostFuture


class Inbox:
    """Messages waiting for a reader, or readers waiting for a message (never both)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.messages: deque[str] = deque()
        self.readers: deque[HostFuture] = deque()
        self.closed = False

    def put(self, message: str) -> None:
        with self.lock:
            while self.readers:
                reader = self.readers.popleft()
                if not reader.done():
                    reader.set_result(message)
                    return
            self.messages.append(message)

    def next(self) -> HostFuture:
        with self.lock:
            if self.messages:
                return HostFuture.resolved(self.messages.popleft())
            future = HostFuture()
            self.readers.append(future)
            return future


class MessageBus:
    """Topics for broadcast/subscribe across instances."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.topics: dict[str, list[tuple[str, Inbox]]] = {}

    def subscribe(self, instance_id: str, topic: str) -> Inbox:
        inbox = Inbox()
        with self.lock:
            self.topics.setdefault(topic, []).append((instance_id, inbox))
        return inbox

    def broadcast(self, topic: str, message: str) -> int:
        with self.lock:
            subscribers = [inbox for _, inbox in self.topics.get(topic, [])]
        for inbox in subscribers:
            inbox.put(message)
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
    """A process-wide string store shared by all inferlets (persists across launches)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.data: dict[str, str] = {}

    def get(self, key: str) -> str | None:
        with self.lock:
            return self.data.get(key)

    def set(self, key: str, value: str) -> None:
        with self.lock:
            self.data[key] = value

    def delete(self, key: str) -> None:
        with self.lock:
            self.data.pop(key, None)

