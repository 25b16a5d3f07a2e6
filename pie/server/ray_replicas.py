"""`pie serve --ray [ADDRESS]`: backend replicas started as Ray actors (PyPI `ray`).

Why Ray: a user whose model outgrows one machine already runs a Ray cluster (vLLM and
SGLang scale out on it); Pie places its replicas there instead of orchestrating machines
itself. Only the backends go into Ray. The control process stays outside: it holds every
instance's state, and its link to each backend is the same authenticated tcp link as for
any remote backend (pie/transport.py, docs/scale-out.md).

Each `ReplicaActor` asks Ray for a GPU where the cluster has GPUs (else
`backend.replica_cores` CPUs, at least one), runs `pie backend --endpoint
tcp://0.0.0.0:PORT` as a child process on its node with the shared secret in its
environment (restarting it on the same port if it exits), and returns the address the
control process connects back to, which then treats it as any remote replica. Without a
configured secret (`backend.secret_file`, `PIE_BACKEND_SECRET`) the server makes a random
one for the run: Ray replicas always listen off loopback. The model must be at the same
path on every node (`pie model pull` there, or a shared filesystem).
"""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from pie.control.backend_link import BACKEND_RESTARTS, BackendError
from pie.transport import SECRET_ENV

REACH_S = 5.0  # a Ray cluster's address must accept a connection this fast


class RayReplicas:
    """`n` replica actors on the cluster at `address` ("" or "local": a local cluster)."""

    def __init__(self, address: str, n: int, model_dir: Path, config_path: str | None, backend_args: list[str],
                 secret: bytes | None, cores: int):
        try:
            import ray
        except ImportError:
            raise BackendError("--ray needs Ray: pip install 'ray>=2.9'") from None
        self.ray = ray
        self.secret = secret or secrets.token_hex(24).encode()
        _check_reachable(address)
        try:
            ray.init(address=None if address in ("", "local") else address, include_dashboard=False,
                     log_to_driver=False, ignore_reinit_error=True)
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise BackendError(f"cannot reach the Ray cluster at {address or 'local'}: {e}") from None
        gpus = ray.cluster_resources().get("GPU", 0)
        options: dict[str, Any] = {"num_gpus": 1} if gpus >= n else {"num_cpus": max(1, cores)}
        actor = ray.remote(**options)(ReplicaActor)
        self.actors = [actor.remote() for _ in range(n)]
        command = ["-m", "pie.cli", "backend", "--model", str(model_dir), *backend_args]
        if config_path:
            command += ["--config", str(Path(config_path).resolve())]
        self.endpoints: list[str] = ray.get([a.start.remote(command, self.secret) for a in self.actors])

    def stop(self) -> None:
        for actor in self.actors:
            try:
                self.ray.get(actor.stop.remote(), timeout=15)
            except Exception:  # an actor whose node is gone: nothing left to stop
                pass
        self.ray.shutdown()


class ReplicaActor:
    """Runs one `pie backend` on its Ray node, restarted on the same port when it exits
    (BACKEND_RESTARTS times): the control process's watchdog finds it answering again. Made
    a Ray actor class by `RayReplicas`."""

    def __init__(self) -> None:
        self.process: subprocess.Popen | None = None
        self.stopping = False

    def start(self, command: list[str], secret: bytes) -> str:
        host = _node_address()
        with socket.socket() as s:  # a free port on this node
            s.bind(("", 0))
            port = s.getsockname()[1]
        argv = [sys.executable, *command, "--endpoint", f"tcp://0.0.0.0:{port}"]
        env = {**os.environ, SECRET_ENV: secret.decode()}
        self.process = subprocess.Popen(argv, env=env)
        threading.Thread(target=self._keep, args=(argv, env), daemon=True).start()
        return f"tcp://{host}:{port}"

    def _keep(self, argv: list[str], env: dict[str, str]) -> None:
        for _ in range(BACKEND_RESTARTS):
            assert self.process is not None
            self.process.wait()
            if self.stopping:
                return
            self.process = subprocess.Popen(argv, env=env)

    def pid(self) -> int:
        """The backend process's id (tests kill it)."""
        assert self.process is not None
        return self.process.pid

    def stop(self) -> None:
        self.stopping = True
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()


def _check_reachable(address: str) -> None:
    """Fail fast on a cluster address nothing answers at: `ray.init` would retry for
    minutes. ("local" starts a cluster; "auto" finds this node's.)"""
    if address in ("", "local", "auto"):
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port or 6379)), timeout=REACH_S):
            pass
    except (OSError, ValueError) as e:
        raise BackendError(f"cannot reach the Ray cluster at {address}: {e} (start one with `ray start "
                           f"--head`, or give --ray without an address for a local one)") from None


def _node_address() -> str:
    import ray

    return ray.util.get_node_ip_address()
