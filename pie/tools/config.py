"""The tool server's settings.

Local to pie.tools for now; it moves into pie/config.py (as a `[tools]` table) when the CLI
wires the tool server in.
"""

from __future__ import annotations

from dataclasses import dataclass

from pie.config import is_loopback


class ToolConfigError(ValueError):
    """A tool-server setting that cannot be used (for example a non-loopback host)."""


@dataclass(frozen=True)
class ToolConfig:
    # Loopback only: the execute tool runs arbitrary code, so the server must never be
    # reachable from another machine.
    host: str = "127.0.0.1"
    port: int = 0  # 0 = any free port; serve_tools reports the one it bound
    corpus_path: str = ""  # JSON corpus for `search`; empty = the bundled one
    slow_default_latency_ms: float = 200.0
    slow_max_latency_ms: float = 10_000.0
    execute_timeout_s: float = 10.0  # wall clock, covers sleeping and blocking too
    execute_cpu_s: int = 5
    execute_memory_mb: int = 512  # address space (RLIMIT_AS)
    execute_file_mb: int = 16  # largest file the snippet may write (RLIMIT_FSIZE)
    execute_max_output_bytes: int = 64 * 1024  # per stream; the rest is dropped
    max_code_bytes: int = 64 * 1024

    def __post_init__(self) -> None:
        if not is_loopback(self.host):
            raise ToolConfigError(
                f"the tool server binds loopback only (127.0.0.0/8, ::1 or localhost); "
                f"refusing host {self.host!r}"
            )
        if not 0 <= self.port < 65536:
            raise ToolConfigError(f"tools port must be in [0, 65535], got {self.port}")
        if not 0 <= self.slow_default_latency_ms <= self.slow_max_latency_ms:
            raise ToolConfigError("need 0 <= slow_default_latency_ms <= slow_max_latency_ms")
        limits = (self.execute_timeout_s, self.execute_cpu_s, self.execute_memory_mb,
                  self.execute_file_mb, self.execute_max_output_bytes, self.max_code_bytes)
        if min(limits) <= 0:
            raise ToolConfigError("execute limits must be positive")
