"""A one-shot result that crosses threads: set by the scheduler or an I/O worker, awaited by
an inferlet's thread through the host's blocking `poll`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

from pie.control.errors import HostError

_PENDING = object()


class HostFuture:
    __slots__ = ("_value", "_error", "_waiters", "_lock")

    def __init__(self) -> None:
        self._value: Any = _PENDING
        self._error: HostError | None = None
        self._waiters: list[threading.Event] = []
        self._lock = threading.Lock()

    @classmethod
    def resolved(cls, value: Any = None) -> "HostFuture":
        future = cls()
        future.set_result(value)
        return future

    def done(self) -> bool:
        return self._value is not _PENDING or self._error is not None

    def set_result(self, value: Any = None) -> None:
        self._finish(value, None)

    def set_error(self, error: HostError) -> None:
        self._finish(None, error)

    def _finish(self, value: Any, error: HostError | None) -> None:
        with self._lock:
            if self.done():
                return
            self._value, self._error = value, error
            waiters, self._waiters = self._waiters, []
        for event in waiters:
            event.set()

    def result(self) -> Any:
        """The value, or raise the error; only once done()."""
        if self._error is not None:
            raise self._error
        return self._value

    def _add_waiter(self, event: threading.Event) -> bool:
        """Register `event`; False (not registered) if already done."""
        with self._lock:
            if self.done():
                return False
            self._waiters.append(event)
            return True

    def _remove_waiter(self, event: threading.Event) -> None:
        with self._lock:
            if event in self._waiters:
                self._waiters.remove(event)


class Cancellation(threading.Event):
    """An instance's cancel flag that also wakes the waits blocked on it (`wait_any`), so a
    blocked wait needs no polling: 16 `text_completion`s polling every 50 ms while they
    decoded cost ~2.6 ms of control CPU each per 64-token request (0.04 ms per token)."""

    def __init__(self) -> None:
        super().__init__()
        self._wakes: set[threading.Event] = set()
        self._guard = threading.Lock()

    def set(self) -> None:
        with self._guard:
            super().set()
            for wake in self._wakes:
                wake.set()

    def watch(self, wake: threading.Event) -> None:
        """Set `wake` when this is set (at once if it already is)."""
        with self._guard:
            self._wakes.add(wake)
            if self.is_set():
                wake.set()

    def unwatch(self, wake: threading.Event) -> None:
        with self._guard:
            self._wakes.discard(wake)


def wait_any(futures: Iterable[HostFuture], cancelled: Cancellation | None = None) -> list[int]:
    """Indices of the done futures, blocking until at least one is done or `cancelled` is set."""
    futures = list(futures)
    ready = [i for i, f in enumerate(futures) if f.done()]
    if ready or not futures:
        return ready
    wake = threading.Event()
    if cancelled is not None:
        cancelled.watch(wake)
    if not all([f._add_waiter(wake) for f in futures]):
        wake.set()
    wake.wait()
    for f in futures:
        f._remove_waiter(wake)
    if cancelled is not None:
        cancelled.unwatch(wake)
    return [i for i, f in enumerate(futures) if f.done()]
