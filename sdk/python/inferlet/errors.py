"""Host errors as a Python exception, and how an escaping exception is reported."""

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
        """The exception for a host `error` record."""
        return cls(error.kind.name.lower().replace("_", "-"), error.message)


def host(call: Callable[..., T], *args) -> T:
    """Call a generated binding, turning its `Err(error)` into `Error`."""
    try:
        return call(*args)
    except Err as e:
        raise Error.from_host(e.value) from None


def describe(e: BaseException, home: str = "") -> str:
    """One line for the end reason: `Type: message (at FILE:LINE in FUNCTION)`, the place
    being the innermost frame of a file under `home` (the inferlet's own code, not the
    SDK's or the standard library's), else the innermost frame."""
    text = " ".join(str(e).split())  # one line; an Error's text is already `kind: message`
    head = text if isinstance(e, Error) else f"{type(e).__name__}: {text}" if text else type(e).__name__
    frames = _frames(e)
    own = [f for f in frames if home and f[0].startswith(home)] or frames
    if not own:
        return head
    file, line, function = own[-1]
    return f"{head} (at {file.rsplit('/', 1)[-1]}:{line} in {function})"


def traceback_lines(e: BaseException) -> list[str]:
    """Python's traceback layout without source lines (reading them would need a file system
    the component does not have)."""
    lines = ["Traceback (most recent call last):"]
    lines += [f'  File "{file}", line {line}, in {function}' for file, line, function in _frames(e)]
    return lines + [f"{type(e).__name__}: {e}" if str(e) else type(e).__name__]


def _frames(e: BaseException) -> list[tuple[str, int, str]]:
    """(file, line, function) of each frame the exception passed through, outermost first,
    without the SDK's entry (`run_main`)."""
    frames, tb = [], e.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        frames.append((code.co_filename, tb.tb_lineno, code.co_name))
        tb = tb.tb_next
    return [f for f in frames if f[2] != "run_main"]
