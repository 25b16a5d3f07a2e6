"""A private `pie serve` child process for one `pie run` call without `--server`.

The child binds 127.0.0.1 port 0, so the OS picks a free port, and prints its address in
the ready line (`serve.READY_LINE`) on stdout: no race between choosing a port and binding
it. Its logs and startup spinner go to our stderr. A subprocess rather than an in-process
server keeps `pie run`'s stdout for the inferlet's messages alone and its shutdown exactly
that of `pie serve`.
"""

from __future__ import annotations

import asyncio
import re
import signal
import sys
from typing import IO

# Matches the end of serve.READY_LINE: "... (ws://HOST:PORT/ws)".
READY = re.compile(r"^Pie serving .* \((ws://\S+)\)$")


class LocalServer:
    """`async with LocalServer(args) as url:` a ready server at `url` for the block's duration."""

    def __init__(self, serve_args: list[str], stderr: int | IO[bytes] | None = None):
        self.serve_args = serve_args
        self.stderr = stderr  # None: ours; a file: the server's logs go there (benchmarks)
        self.process: asyncio.subprocess.Process | None = None

    async def __aenter__(self) -> str:
        self.process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "pie.cli", "serve", "--host", "127.0.0.1", "--port", "0",
            *self.serve_args, stdout=asyncio.subprocess.PIPE, stderr=self.stderr,
        )
        assert self.process.stdout is not None
        try:
            while line := await self.process.stdout.readline():
                if match := READY.match(line.decode().strip()):
                    return match.group(1)
        except BaseException:  # e.g. Ctrl-C while the backend loads
            await self.__aexit__()
            raise
        code = await self.process.wait()
        raise RuntimeError(f"pie serve exited with code {code} before it was ready")

    async def __aexit__(self, *exc: object) -> None:
        process = self.process
        if process is None or process.returncode is not None:
            return
        # The first signal drains (nothing should be running: our client is done); if that
        # takes long, a second one skips the wait; a server that hangs even then is killed.
        for signal_, wait_s in ((signal.SIGTERM, 5), (signal.SIGTERM, 30), (signal.SIGKILL, None)):
            process.send_signal(signal_)
            try:
                await asyncio.wait_for(process.wait(), wait_s)
                return
            except TimeoutError:
                continue
