"""Everything outside the model: arguments, messages (client and other inferlets), logging,
HTTP to allowlisted hosts, and the server's key-value store."""

from __future__ import annotations

from wit_world.imports import http, kvs, messaging, runtime
from wit_world.imports.http import Response
from wit_world.imports.tokenize import ChatMessage

from inferlet.errors import host
from inferlet.futures import Future

__all__ = ["Response", "Subscription", "args", "broadcast", "chat", "http_get", "http_post", "log",
           "receive", "send", "store_delete", "store_get", "store_set", "subscribe"]


def args() -> list[str]:
    """The arguments the client passed at launch."""
    return runtime.get_arguments()


def send(message: str) -> None:
    """A message to the client that launched this instance."""
    messaging.send(message)


def receive() -> Future[str]:
    """The client's next message."""
    return Future(messaging.receive())


def log(message: str) -> None:
    """A line in the server log (prefixed with the instance id)."""
    runtime.log(runtime.LogLevel.INFO, message)


def chat(role: str, content: str) -> ChatMessage:
    """One turn of a conversation, for `Context.fill_chat`."""
    return ChatMessage(role, content)


def broadcast(topic: str, message: str) -> None:
    """A message to every instance subscribed to `topic`."""
    messaging.broadcast(topic, message)


class Subscription:
    """Messages broadcast on a topic after `subscribe`, in order."""

    def __init__(self, topic: str):
        self._subscription = host(messaging.subscribe, topic)

    def next(self) -> Future[str]:
        """The next message published on the topic."""
        return Future(self._subscription.next())


def subscribe(topic: str) -> Subscription:
    """Messages broadcast on `topic` from now on."""
    return Subscription(topic)


def http_get(url: str, headers: dict[str, str] | None = None) -> Future[Response]:
    """GET `url` (its host must be in the server's `control.http_allowlist`)."""
    return Future(host(http.http_get, url, list((headers or {}).items())))


def http_post(url: str, body: str, headers: dict[str, str] | None = None) -> Future[Response]:
    """POST `body` to `url` (a host allowed by control.http_allowlist)."""
    return Future(host(http.http_post, url, list((headers or {}).items()), body))


def store_get(key: str) -> str | None:
    """The value of `key` in the server's key-value store, or None."""
    return kvs.store_get(key)


def store_set(key: str, value: str) -> None:
    """Set `key` in the server's key-value store."""
    host(kvs.store_set, key, value)


def store_delete(key: str) -> None:
    """Remove `key` from the server's key-value store."""
    kvs.store_delete(key)
