"""Host errors as a Python exception."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from componentize_py_types import Err

T = TypeVar("T")


class Error(Exception):
    """A host call failed: `kind` is the WIT `error-kind` (e.g. "invalid-handle")."""

    def __init__(self, kind: str, message: str):
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.message = message

    @classmethod
    def from_host(cls, error) -> Error:
        return cls(error.kind.name.lower().replace("_", "-"), error.message)


def host(call: Callable[..., T], *args) -> T:
    """Call a generated binding, turning its `Err(error)` into `Error`."""
    try:
        return call(*args)
    except Err as e:
        raise Error.from_host(e.value) from None
