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


def wait_any(futures: Iterable[HostFuture], cancelled: threading.Event | None = None) -> list[int]:
    """Indices of the done futures, blocking until at least one is done or `cancelled` is set."""
    futures = list(futures)
    ready = [i for i, f in enumerate(futures) if f.done()]
    if ready or not futures:
        return ready
    wake = threading.Event()
    if not all([f._add_waiter(wake) for f in futures]):
        wake.set()
    # Completion sets `wake` at once; a cancellation is noticed within 50 ms.
    while not wake.wait(0.05):
        if cancelled is not None and cancelled.is_set():
            break
    for f in futures:
        f._remove_waiter(wake)
    return [i for i, f in enumerate(futures) if f.done()]
