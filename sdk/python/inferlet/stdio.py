"""Standard streams for an inferlet: `print()` and `sys.stderr` write to the instance's log.

A component has no WASI stdio (`pie build` stubs WASI out, as the `pie:inferlet` world
imports none), so CPython's own streams trap on their first write ("wasm `unreachable`
instruction executed") and `shutil.get_terminal_size` (argparse's help) traps on its
terminal query. `run_main` installs a `LogStream` for each stream before `main` runs: each
line goes to `runtime.log` (stdout at info level, stderr at warn), which the server writes
to its log and forwards to a client that launched with logs (`pie run -v`).
"""

from __future__ import annotations

import io

from wit_world.imports import runtime

__all__ = ["LogStream"]


class LogStream(io.TextIOBase):
    """A text stream that logs one line per newline; `last` is the last non-blank line
    (what `sys.exit` or argparse said before exiting, for the end reason)."""

    def __init__(self, level: runtime.LogLevel):
        super().__init__()
        self.level = level
        self.partial = ""
        self.last = ""

    def writable(self) -> bool:
        """Yes: a write-only stream."""
        return True

    def write(self, text: str) -> int:
        """Log each completed line; keep the rest for the next write."""
        lines = (self.partial + text).split("\n")
        self.partial = lines.pop()
        for line in lines:
            self._emit(line)
        return len(text)

    def flush(self) -> None:
        """Log the unfinished line, if any."""
        if self.partial:
            self._emit(self.partial)
            self.partial = ""

    def _emit(self, line: str) -> None:
        runtime.log(self.level, line)
        if line.strip():
            self.last = line
