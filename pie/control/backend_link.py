"""A synchronous link to one backend process: send a request, wait for its reply.

The control layer's scheduler keeps one batch in flight and waits for the backend's idle
signal; this link does the same in its simplest form (used by `pie generate`, the tests
and the benchmarks that drive the backend directly).
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import zmq

from pie import protocol as P
from pie.transport import for_endpoint, handshake_failure, secure_client, watch_handshakes


BACKEND_RESTARTS = 3  # restarts of a dead backend (spawned or a Ray actor's) before giving up


class BackendError(RuntimeError):
    """The backend rejected a whole request, or could not be reached."""


class BackendTimeout(BackendError):
    """No reply within the deadline."""


class BackendLink:
    """`secret`: the CURVE secret of a remote backend's link (pie/transport.py)."""

    def __init__(self, endpoint: str, timeout_s: float = 120.0, secret: bytes | None = None):
        self.endpoint = endpoint
        self.timeout_ms = int(timeout_s * 1000)
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        secure_client(self.socket, for_endpoint(endpoint, secret))
        self.monitor = watch_handshakes(self.socket)
        self.socket.connect(endpoint)
        self.ids = itertools.count(1)
        self.idle_signals = 0

    def call(self, message: P.Message) -> P.Message:
        return self.wait(self.send(message))

    def send(self, message: P.Message) -> int:
        request_id = next(self.ids)
        self.socket.send(P.encode(request_id, message))
        return request_id

    def send_raw(self, frame: bytes) -> None:
        self.socket.send(frame)

    def wait(self, request_id: int, timeout_s: float | None = None) -> P.Message:
        """The reply to `request_id`; idle signals on the way are counted, not returned."""
        deadline = time.monotonic() + (self.timeout_ms / 1000 if timeout_s is None else timeout_s)
        while True:
            remaining = int((deadline - time.monotonic()) * 1000)
            if remaining <= 0 or not self.socket.poll(min(remaining, 250)):
                if failure := handshake_failure(self.monitor, self.endpoint):
                    raise BackendError(failure)
                if remaining <= 0:
                    raise BackendTimeout(f"no reply from the backend at {self.endpoint} in time")
                continue
            try:
                reply_id, kind, reply = P.decode_reply(self.socket.recv())
            except P.ProtocolError as e:
                raise BackendError(f"the backend at {self.endpoint} sent a malformed reply: {e}") from None
            if kind is P.Kind.IDLE:
                self.idle_signals += 1
                continue
            if kind is P.Kind.ERROR:
                raise BackendError(reply.message)  # type: ignore[attr-defined]
            if reply_id == request_id:
                return reply

    def close(self) -> None:
        self.socket.disable_monitor()
        self.monitor.close()
        self.socket.close()
        self.context.term()


class BackendProcess:
    """A `pie backend` child process on a private ipc:// endpoint."""

    def __init__(self, model_dir: Path, config_path: str | None = None, extra_args: list[str] = (),
                 log_file: Path | None = None, cpus: list[int] | None = None):
        self.tmpdir = tempfile.TemporaryDirectory(prefix="pie-")
        self.endpoint = f"ipc://{self.tmpdir.name}/backend.sock"
        self.command = [sys.executable, "-m", "pie.cli", "backend", "--model", str(model_dir),
                        "--endpoint", self.endpoint, "--exit-with", str(os.getpid()), *extra_args]
        if config_path:
            self.command += ["--config", config_path]
        self.log_file = log_file
        self.cpus = cpus  # the cores it may run on (backend.replica_cores); None: all
        self.process = self._spawn()

    def _spawn(self) -> subprocess.Popen:
        out = open(self.log_file, "ab") if self.log_file else None
        env = os.environ.copy()
        pin = None
        if self.cpus is not None:
            cpus = self.cpus
            env["OMP_NUM_THREADS"] = str(len(cpus))  # torch's threads: one per core it has

            def pin() -> None:
                os.sched_setaffinity(0, cpus)
        return subprocess.Popen(self.command, stdout=out, stderr=out or None, env=env, preexec_fn=pin)

    def restart(self) -> None:
        """A fresh backend on the same endpoint, after the previous one died."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.process = self._spawn()

    def connect(self, timeout_s: float = 300.0) -> tuple[BackendLink, P.HandshakeReply]:
        """Handshake once the backend has loaded its model (ZeroMQ queues the request)."""
        deadline = time.monotonic() + timeout_s
        link = BackendLink(self.endpoint)
        request_id = link.send(P.HandshakeRequest())
        while True:
            if self.process.poll() is not None:
                link.close()
                raise BackendError(f"backend exited with code {self.process.returncode} while starting")
            try:
                return link, link.wait(request_id, timeout_s=0.5)  # type: ignore[return-value]
            except BackendTimeout:
                if time.monotonic() > deadline:
                    link.close()
                    raise

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.tmpdir.cleanup()
