"""A fix for a thread-safety bug in wasmtime-py (50.x), which Pie calls from many threads.

To lower an `option`/`result`/`variant` value, wasmtime-py collects the Python classes of
each case into one module-level set (`component._types.case_test_cache`), shared by every
thread. Two instances returning such values at once race on it and one fails with
"value not valid for this variant" (seen with 16 concurrent inferlets). Giving each thread
its own set removes the race; the lowering logic is unchanged.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

from wasmtime.component import _types


class PerThreadSet(threading.local):
    """The subset of `set` that wasmtime-py's lowering uses, one set per thread."""

    def __init__(self) -> None:
        self.items: set[type] = set()

    def clear(self) -> None:
        self.items.clear()

    def add(self, item: type) -> None:
        self.items.add(item)

    def __iter__(self) -> Iterator[type]:
        return iter(self.items)


def install() -> None:
    if not isinstance(_types.case_test_cache, PerThreadSet):
        _types.case_test_cache = PerThreadSet()
