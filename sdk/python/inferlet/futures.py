"""Results that arrive later, and waiting for several at once.

A `Future` wraps a host future resource. Waiting goes through the host's wait set
(`pollable.watch` + `futures.wait`), so `wait_any` blocks once for many futures and other
instances keep running meanwhile.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

from componentize_py_types import Err, Ok
from wit_world.imports import futures as host_futures

from inferlet.errors import Error

T = TypeVar("T")


class Future(Generic[T]):
    """A host result: `ready()` without blocking, `result()` blocking until it is there."""

    def __init__(self, resource: Any, convert: Callable[[Any], T] = lambda value: value):
        self._resource = resource
        self._convert = convert
        self._done = False
        self._value: Any = None

    def ready(self) -> bool:
        """Whether the result is there (`result()` would not block)."""
        if not self._done:
            outcome = self._resource.get()
            if outcome is not None:
                self._done, self._value = True, outcome
        return self._done

    def result(self) -> T:
        """The value (blocking until ready); raises `Error` if the host call failed."""
        if not self.ready():
            wait_all([self])
        value = self._value
        if isinstance(value, Err):
            raise Error.from_host(value.value)
        if isinstance(value, Ok):
            value = value.value
        return self._convert(value)


def wait_any(futures: Sequence[Future]) -> list[int]:
    """Block until at least one of `futures` is ready; the indices of every ready one."""
    ready = [i for i, f in enumerate(futures) if f.ready()]
    if ready or not futures:
        return ready
    pollables = []
    for key, future in enumerate(futures):
        pollable = future._resource.subscribe()
        pollable.watch(key)
        pollables.append(pollable)  # kept alive until the wait returns
    host_futures.wait()
    for pollable in pollables:
        pollable.__exit__(None, None, None)  # unwatch the rest: dropping removes them
    return [i for i, f in enumerate(futures) if f.ready()]


def wait_all(futures: Sequence[Future]) -> list:
    """Block until every future is ready; their results in order (raises the first error)."""
    pending = list(futures)
    while pending:
        wait_any(pending)
        pending = [f for f in pending if not f.ready()]
    return [f.result() for f in futures]
