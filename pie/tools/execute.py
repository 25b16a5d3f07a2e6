"""The `execute` tool: run a short Python snippet in a resource-limited subprocess.

A CONVENIENCE SANDBOX FOR LOCAL BENCHMARKS, NOT A SECURITY BOUNDARY. The snippet runs as
the server's own user, with that user's file-system access, and can open network sockets.
What it does bound is the accidents an agent's code makes: runaway loops (CPU seconds and a
wall-clock timeout), runaway allocation (address space), huge files (file size), fork bombs
(no new processes), floods of output (truncated), and leaked configuration (empty
environment, isolated interpreter `-I -S`, a fresh temporary working directory).

RLIMIT_NPROC counts every process of the user, not the snippet's children, so the only
setting that means the same on every machine is 0: the snippet cannot start a process or
a thread. Linux does not enforce it for root.
"""

from __future__ import annotations

import asyncio
import os
import resource
import signal
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

_READ_CHUNK = 64 * 1024


@dataclass(frozen=True)
class ExecuteLimits:
    timeout_s: float
    cpu_s: int
    memory_mb: int
    file_mb: int
    max_output_bytes: int


@dataclass(frozen=True)
class ExecuteResult:
    stdout: str
    stderr: str
    exit_code: int  # negative: killed by that signal (e.g. -9 on timeout, -24 SIGXCPU)
    timed_out: bool
    stdout_truncated: bool
    stderr_truncated: bool


async def execute_python(code: str, limits: ExecuteLimits) -> ExecuteResult:
    """Run `code` as a script and collect what it printed and how it ended."""
    with tempfile.TemporaryDirectory(prefix="pie-execute-") as workdir:
        script = Path(workdir) / "main.py"
        script.write_text(code, encoding="utf-8")
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-I", "-S", script.name,
            cwd=workdir, env={}, stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            start_new_session=True,  # its own process group, killed as one on timeout
            preexec_fn=lambda: _apply_limits(limits),
        )
        assert process.stdout is not None and process.stderr is not None
        stdout = asyncio.ensure_future(_read_capped(process.stdout, limits.max_output_bytes))
        stderr = asyncio.ensure_future(_read_capped(process.stderr, limits.max_output_bytes))
        timed_out = False
        try:
            await asyncio.wait_for(process.wait(), limits.timeout_s)
        except TimeoutError:
            timed_out = True
            _kill_group(process.pid)
            await process.wait()
        (out, out_cut), (err, err_cut) = await asyncio.gather(stdout, stderr)
    return ExecuteResult(
        stdout=out.decode("utf-8", "replace"), stderr=err.decode("utf-8", "replace"),
        exit_code=process.returncode,
        timed_out=timed_out, stdout_truncated=out_cut, stderr_truncated=err_cut,
    )


def _apply_limits(limits: ExecuteLimits) -> None:
    """Runs in the child between fork and exec. The CPU hard limit is one second above the
    soft one so the snippet dies of SIGXCPU (exit code -24), not SIGKILL: a CPU-limit hit
    stays distinguishable from a timeout."""
    mb = 2**20
    resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 1))
    for limit, value in (
        (resource.RLIMIT_AS, limits.memory_mb * mb),
        (resource.RLIMIT_FSIZE, limits.file_mb * mb),
        (resource.RLIMIT_NPROC, 0),
        (resource.RLIMIT_CORE, 0),
    ):
        resource.setrlimit(limit, (value, value))


async def _read_capped(stream: asyncio.StreamReader, limit: int) -> tuple[bytes, bool]:
    """The first `limit` bytes of `stream` and whether more followed. Reads to the end so
    the child never blocks on a full pipe, but keeps only what it returns."""
    kept = bytearray()
    truncated = False
    while chunk := await stream.read(_READ_CHUNK):
        room = limit - len(kept)
        kept += chunk[:room]
        truncated = truncated or len(chunk) > room
    return bytes(kept), truncated


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:  # it ended between the timeout and the kill
        pass
