"""Messages between clients and inferlets, and between inferlets (broadcast/subscribe)."""

from __future__ import annotations

import threading
from collections import Counter, deque

from pie.config import QuotaConfig
from pie.control.errors import ErrorKind, HostError
from pie.control.future import HostFuture
from pie.control.quotas import namespace

MAX_PUBLIC_TOPICS = 256  # public topics one instance may publish on (bounds the owner table)


class InboxFull(OverflowError):
    """A message for an instance that already holds `server.max_pending_messages` unread
    messages or `server.max_pending_bytes` of them (the message names the limit)."""


class Inbox:
    """Messages waiting for a reader, or readers waiting for a message (never both). With a
    `limit` (unread messages) and `max_bytes` (their UTF-8 bytes together; 0 = no bound), a
    message beyond either is refused (`InboxFull`, naming the config key) — or, with
    `drop_oldest`, queued in place of as many of the oldest unread ones as it takes."""

    def __init__(self, limit: int = 0, drop_oldest: bool = False, max_bytes: int = 0) -> None:
        self.lock = threading.Lock()
        self.messages: deque[str] = deque()
        self.readers: deque[HostFuture] = deque()
        self.limit = limit
        self.drop_oldest = drop_oldest
        self.max_bytes = max_bytes
        self.bytes = 0  # UTF-8 bytes of the unread messages

    @staticmethod
    def size(message: str) -> int:
        """UTF-8 bytes of `message` (without encoding it when it is ASCII)."""
        return len(message) if message.isascii() else len(message.encode())

    def _full(self, size: int) -> bool:
        return ((bool(self.limit) and len(self.messages) >= self.limit)
                or (bool(self.max_bytes) and self.bytes + size > self.max_bytes))

    def put(self, message: str) -> int:
        """Deliver or queue `message`; how many older unread messages were dropped for it
        (with `drop_oldest`; a message larger than `max_bytes` alone is dropped itself)."""
        with self.lock:
            while self.readers:
                reader = self.readers.popleft()
                if not reader.done():
                    reader.set_result(message)
                    return 0
            size = self.size(message)
            if not self._full(size):
                self.messages.append(message)
                self.bytes += size
                return 0
            if not self.drop_oldest:
                if bool(self.limit) and len(self.messages) >= self.limit:
                    raise InboxFull(f"the instance has {len(self.messages)} unread messages, the "
                                        f"limit is server.max_pending_messages = {self.limit}")
                raise InboxFull(f"the instance has {self.bytes} bytes of unread messages; {size} more "
                                    f"would exceed server.max_pending_bytes = {self.max_bytes}")
            dropped = 0
            while self.messages and self._full(size):
                self.bytes -= self.size(self.messages.popleft())
                dropped += 1
            if self._full(size):  # larger than max_bytes on its own
                return dropped + 1
            self.messages.append(message)
            self.bytes += size
            return dropped

    def next(self) -> HostFuture:
        with self.lock:
            if self.messages:
                message = self.messages.popleft()
                self.bytes -= self.size(message)
                return HostFuture.resolved(message)
            future = HostFuture()
            self.readers.append(future)
            return future


class MessageBus:
    """Topics for broadcast/subscribe across instances. A subscription keeps at most
    `backlog` unread messages, dropping the oldest beyond (counted in `dropped`), as the WIT
    promises: a subscriber that does not read neither grows without bound nor holds up the
    broadcasters.

    Topics live in their user's namespace (`resources.namespace`): instances of one user
    talk to each other, never to another user's. A `public:` topic is shared by every user:
    anyone may subscribe, and it is published by one user, the one whose instance first
    broadcast on it, for as long as an instance of that user that broadcast on it runs;
    another user's broadcast is refused (permission-denied)."""

    def __init__(self, backlog: int, max_bytes: int = 0) -> None:
        self.lock = threading.Lock()
        self.max_bytes = max_bytes  # unread bytes per subscription (server.max_pending_bytes)
        self.topics: dict[tuple[str, str], list[tuple[str, Inbox]]] = {}
        # public topic -> (its publishing user, that user's instances that broadcast on it)
        self.publishers: dict[str, tuple[str, set[str]]] = {}
        self.backlog = backlog
        self.dropped = 0  # unread messages dropped from full subscriptions (/stats)

    def subscribe(self, instance_id: str, user: str, topic: str) -> Inbox:
        inbox = Inbox(self.backlog, drop_oldest=True, max_bytes=self.max_bytes)
        with self.lock:
            self.topics.setdefault(namespace(user, topic), []).append((instance_id, inbox))
        return inbox

    def broadcast(self, instance_id: str, user: str, topic: str, message: str) -> int:
        """Deliver to every subscriber; how many there were."""
        key = namespace(user, topic)
        with self.lock:
            if not key[0]:
                self._claim(instance_id, user, topic)
            subscribers = [inbox for _, inbox in self.topics.get(key, [])]
        dropped = sum(inbox.put(message) for inbox in subscribers)
        if dropped:
            with self.lock:
                self.dropped += dropped
        return len(subscribers)

    def _claim(self, instance_id: str, user: str, topic: str) -> None:
        owner, instances = self.publishers.setdefault(topic, (user, set()))
        if owner != user:
            raise HostError(ErrorKind.PERMISSION_DENIED,
                            f"the public topic {topic!r} is published by another user; subscribe "
                            f"to read it, or publish on a topic of your own")
        if instance_id not in instances:
            claimed = sum(instance_id in held for _, held in self.publishers.values())
            if claimed >= MAX_PUBLIC_TOPICS:
                raise HostError(ErrorKind.OUT_OF_RESOURCES,
                                f"an instance may publish on at most {MAX_PUBLIC_TOPICS} public topics")
            instances.add(instance_id)

    def unsubscribe(self, inbox: Inbox) -> None:
        with self.lock:
            for key in [k for k, subs in self.topics.items() if any(box is inbox for _, box in subs)]:
                kept = [(i, box) for i, box in self.topics[key] if box is not inbox]
                if kept:
                    self.topics[key] = kept
                else:
                    del self.topics[key]

    def drop_instance(self, instance_id: str) -> None:
        with self.lock:
            for key in list(self.topics):
                kept = [(i, box) for i, box in self.topics[key] if i != instance_id]
                if kept:
                    self.topics[key] = kept
                else:
                    del self.topics[key]
            for topic, (_, instances) in list(self.publishers.items()):
                instances.discard(instance_id)
                if not instances:
                    del self.publishers[topic]


class KeyValueStore:
    """A process-wide string store (persists across launches until the server stops),
    capped at `max_bytes` of keys and values together (control.kvs_max_bytes) and per user
    at its `quota.user.kvs_bytes`. Keys live in their user's namespace; a `public:` key is
    shared: the user who first sets it owns it (and is charged for it), every user may read
    it, only its owner may change or delete it."""

    def __init__(self, max_bytes: int, quotas: QuotaConfig) -> None:
        self.lock = threading.Lock()
        self.data: dict[tuple[str, str], tuple[str, str]] = {}  # namespace -> (owner, value)
        self.max_bytes = max_bytes
        self.quotas = quotas
        self.used = 0
        self.used_by: Counter[str] = Counter()  # bytes each user owns

    def get(self, user: str, key: str) -> str | None:
        with self.lock:
            entry = self.data.get(namespace(user, key))
            return None if entry is None else entry[1]

    def set(self, user: str, key: str, value: str) -> None:
        where = namespace(user, key)
        size = len(key.encode()) + len(value.encode())
        limit = self.quotas.for_user(user)[1].kvs_bytes
        with self.lock:
            old = self.data.get(where)
            if old is not None and old[0] != user:
                raise HostError(ErrorKind.PERMISSION_DENIED,
                                f"the public key {key!r} belongs to another user; only its owner may change it")
            freed = 0 if old is None else len(key.encode()) + len(old[1].encode())
            if self.used - freed + size > self.max_bytes:
                raise HostError(ErrorKind.OUT_OF_RESOURCES,
                                f"the key-value store holds {self.used} bytes; {size} more would exceed "
                                f"control.kvs_max_bytes = {self.max_bytes}")
            if limit and self.used_by[user] - freed + size > limit:
                raise HostError(ErrorKind.OUT_OF_RESOURCES,
                                f"user {user} holds {self.used_by[user]} bytes in the key-value store; "
                                f"{size} more would exceed its quota quota.user.kvs_bytes = {limit}")
            self.data[where] = (user, value)
            self.used += size - freed
            self.used_by[user] += size - freed

    def delete(self, user: str, key: str) -> bool:
        """Remove `user`'s key; whether it was removed (another user's public key is not)."""
        where = namespace(user, key)
        with self.lock:
            old = self.data.get(where)
            if old is None or old[0] != user:
                return False
            del self.data[where]
            size = len(key.encode()) + len(old[1].encode())
            self.used -= size
            self.used_by[user] -= size
            return True
