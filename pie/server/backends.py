"""The backend replicas `pie serve` serves on, and their watchdogs.

Three kinds, one list of endpoints (replica i = endpoint i): child processes on private
ipc:// sockets (`backend.replicas`, pinned by `backend.replica_cores`), Ray actors
(`backend.ray`, pie/server/ray_replicas.py) and backends someone else runs, attached by
address (`backend.endpoints`); the last two over tcp, authenticated by the shared secret
(pie/transport.py). All must answer the handshake alike (`common_handshake`). A dead child
is restarted here; a remote one (Ray's restart their own) is asked every REMOTE_PING_S
whether it answers, failed when it does not, and served on again when it does
(docs/scale-out.md).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from pathlib import Path

from rich.console import Console

from pie import protocol as P
from pie.config import PieConfig
from pie.control.backend_link import BACKEND_RESTARTS, BackendError, BackendLink, BackendProcess, BackendTimeout
from pie.control.replica import Replica
from pie.runtime.runtime import Runtime
from pie.server.ray_replicas import RayReplicas
from pie.transport import check_endpoint, load_secret

REMOTE_PING_S = 2.0  # how often a remote replica is asked whether it answers
RAY_LOAD_S = 300.0  # a Ray replica's first handshake: it loads the model (and may compile kernels)


class Backends:
    def __init__(self, config: PieConfig, model_dir: Path, config_path: str | None, backend_args: list[str]):
        self.config = config.backend
        self.model_dir, self.config_path, self.backend_args = model_dir, config_path, backend_args
        self.secret = load_secret(self.config.secret_file)
        self.spawned: list[BackendProcess] = []
        self.ray: RayReplicas | None = None
        self.remote = list(self.config.endpoints)
        self.first_answer_s = self.config.remote_timeout_s  # a remote replica's first handshake

    @property
    def endpoints(self) -> list[str]:
        return [b.endpoint for b in self.spawned] + self.remote

    def describe(self) -> str:
        n = len(self.spawned) + len(self.remote)
        return f"{n} backend replicas" if n > 1 else "the backend"

    async def start(self, console: Console) -> None:
        """Spawn the child processes (or Ray actors); nothing waits for them to load here."""
        n, cores = self.config.replicas, self.config.replica_cores
        if self.config.ray:  # the replicas are Ray actors, attached as remote ones
            with console.status(f"starting {n} replicas on Ray ({self.config.ray})"):
                self.ray = await asyncio.to_thread(RayReplicas, self.config.ray, n, self.model_dir, self.config_path,
                                                   self.backend_args, self.secret, cores)
            self.remote, self.secret, n = self.ray.endpoints + self.remote, self.ray.secret, 0
            self.first_answer_s = max(self.first_answer_s, RAY_LOAD_S)  # they load the model meanwhile
        for endpoint in self.remote:
            check_endpoint(endpoint, self.secret)
        shares = cpu_shares(n, cores) if cores else [None] * n
        self.spawned = [BackendProcess(self.model_dir, self.config_path, self.backend_args, cpus=cpus)
                        for cpus in shares]

    async def handshake(self) -> tuple[P.HandshakeReply, list[str | None]]:
        """The replicas' common handshake, and per replica why it cannot serve yet (None:
        it can). Every child must answer; remote ones that do not (or answer wrongly) are
        waited for while the others serve, but with no child one of them must answer now."""
        replies = await asyncio.gather(
            *(asyncio.to_thread(b.connect) for b in self.spawned),
            *(asyncio.to_thread(reach, e, self.secret, self.first_answer_s) for e in self.remote))
        n = len(self.spawned)
        local = []
        for link, reply in replies[:n]:
            link.close()  # each replica's scheduler opens its own link to its endpoint
            local.append(reply)
        answered = local or [r for r in replies[n:] if isinstance(r, P.HandshakeReply)][:1]
        if not answered:
            raise BackendError("no backend replica answered: " + "; ".join(replies[n:]))
        hello = common_handshake(answered)
        return hello, [None] * n + [mismatch(r, hello, e) for r, e in zip(replies[n:], self.remote)]

    def watch(self, runtime: Runtime, hello: P.HandshakeReply, console: Console) -> list[asyncio.Task]:
        replicas = runtime.controller.replicas
        n = len(self.spawned)
        return ([asyncio.create_task(_watch_spawned(b, r, runtime, console)) for b, r in zip(self.spawned, replicas)]
                + [asyncio.create_task(_watch_remote(r, runtime, console, self.secret, hello)) for r in replicas[n:]])

    async def stop(self) -> None:
        for backend in self.spawned:
            backend.stop()
        if self.ray is not None:
            await asyncio.to_thread(self.ray.stop)


def cpu_shares(n: int, k: int) -> list[list[int]]:
    """backend.replica_cores: n runs of k cores among those this process may use."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < n * k:
        raise BackendError(f"backend.replica_cores = {k} for {n} replicas needs {n * k} cores, "
                           f"{len(cpus)} are available")
    return [cpus[i * k:(i + 1) * k] for i in range(n)]


def common_handshake(replies: list[P.HandshakeReply]) -> P.HandshakeReply:
    """The replicas' common handshake: they must serve the same model with the same pools,
    or an instance's limits would depend on where it was placed."""
    first = replies[0]
    for i, reply in enumerate(replies[1:], 1):
        differ = [f for f in dataclasses.fields(first) if getattr(reply, f.name) != getattr(first, f.name)]
        if differ:
            names = ", ".join(f.name for f in differ)
            raise BackendError(f"backend replica {i} differs from replica 0 in {names}: replicas must "
                               f"load the same model with the same configuration")
    return first


async def _watch_spawned(backend: BackendProcess, replica: Replica, runtime: Runtime,
                         console: Console) -> None:
    """If a replica's backend process dies: fail every call pending on it with the reason,
    end the inferlets running on it (their KV cache died with it) and drop its exports, then
    restart the backend on the same endpoint and serve again. Instances on other replicas
    keep running; new launches go elsewhere meanwhile, and /health is 503 only while no
    replica serves."""
    name = f"backend replica {replica.index}" if len(runtime.controller.replicas) > 1 else "the backend"
    while True:
        while backend.process.poll() is None:
            await asyncio.sleep(0.5)
        reason = f"{name} process exited with code {backend.process.returncode}"
        console.print(f"[red]error:[/] {reason}; restarting it (inferlets running on it end: their KV "
                      "cache is lost)")
        lost = f"{reason} (KV cache lost; the backend was restarted)"
        await _lose(replica, runtime, lost)
        for attempt in range(1, BACKEND_RESTARTS + 1):
            backend.restart()
            try:
                link, _ = await asyncio.to_thread(backend.connect)
                link.close()
                break
            except BackendError as e:
                console.print(f"[red]error:[/] {name} restart {attempt}/{BACKEND_RESTARTS} failed: {e}")
        else:
            replica.failure = f"{reason}; {BACKEND_RESTARTS} restarts failed: restart `pie serve`"
            return
        replica.recover()
        console.print(f"{name} restarted; serving again")


async def _lose(replica: Replica, runtime: Runtime, reason: str) -> None:
    """A replica's backend and KV cache are gone: its calls fail, its instances end (one
    message whichever ends an inferlet first), and placement forgets what it cached."""
    await asyncio.to_thread(runtime.terminate_all, f"error: {reason}", replica=replica,
                            then=lambda: replica.fail(reason))
    runtime.controller.placement.forget(replica.index)


def reach(endpoint: str, secret: bytes | None, timeout_s: float) -> P.HandshakeReply | str:
    """A remote backend's handshake reply, or why there is none."""
    link = BackendLink(endpoint, secret=secret)
    try:
        return link.wait(link.send(P.HandshakeRequest()), timeout_s=timeout_s)  # type: ignore[return-value]
    except BackendTimeout:
        return (f"no answer from {endpoint} in {timeout_s:g} s (not running, unreachable, or a tcp "
                f"endpoint that needs the backend secret on both ends)")
    except BackendError as e:
        return str(e)
    finally:
        link.close()


def mismatch(reply: P.HandshakeReply | str, hello: P.HandshakeReply, endpoint: str) -> str | None:
    """Why a remote replica cannot serve beside the others (None: it can)."""
    if isinstance(reply, str):
        return reply
    try:
        common_handshake([hello, reply])
    except BackendError as e:
        return f"{endpoint}: {e}"
    return None


async def _watch_remote(replica: Replica, runtime: Runtime, console: Console, secret: bytes | None,
                        hello: P.HandshakeReply) -> None:
    """A remote replica cannot be restarted from here: every REMOTE_PING_S a handshake asks
    whether it answers. One that stops answering is failed like a dead local one (its
    instances end); one that answers (again, or for the first time) serves."""
    name = f"backend replica {replica.index} ({replica.endpoint})"
    while True:
        # A link that dropped while serving: the backend ended, or was replaced by a fresh one
        # (an empty KV cache) that answers the ping below; either way its instances are lost.
        why = replica.scheduler.disconnected if replica.serving else None
        if why is None:
            reply = await asyncio.to_thread(reach, replica.endpoint, secret, runtime.config.backend.remote_timeout_s)
            why = mismatch(reply, hello, replica.endpoint)
        if why is None and not replica.serving:
            replica.recover()
            console.print(f"{name} answers; serving on it")
        elif why is not None and replica.serving:
            console.print(f"[red]error:[/] {name}: {why}; inferlets running on it end")
            lost = f"{name} is lost: {why} (KV cache lost)"
            await _lose(replica, runtime, lost)
        elif why is not None:
            replica.failure = why
        await asyncio.sleep(REMOTE_PING_S)
