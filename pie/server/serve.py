"""`pie serve`: the control process — the RPC server, the runtime, and the backend it spawns.

Order matters for `/health`: the server binds first (answering 503), then the backend (or
`backend.replicas` of them) is spawned and handshaken (the built-in inferlets are built meanwhile), then the runtime is
built and `/health` turns 200. The first SIGINT/SIGTERM drains: launches are refused and
`/health` says "draining" while running instances finish (up to server.drain_timeout_s,
or until a second signal); the rest are terminated and their clients told. Then uvicorn
closes every connection, and the runtime and the backend are shut down, however serving
ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from pathlib import Path

import uvicorn
from rich.console import Console

from pie.config import PieConfig
from pie.control.backend_link import BackendError
from pie.runtime.runtime import Runtime, start_runtime
from pie.server.app import ServerState, create_app, ws_max_size
from pie.server.backends import Backends
from pie.toolchain import REPO, ToolchainError, build_inferlet
from pie.transport import TransportError

BUILTIN_INFERLETS = ("hello", "text_completion", "openai_completion")  # crates in inferlets/
# `pie run` finds the address of the server it started in this line (see local.py).
READY_LINE = "Pie serving {model} on http://{host}:{port} (ws://{host}:{port}/ws)"


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: after shutdown it re-raises the signal it
    caught, and the default SIGTERM action would kill us before the backend is stopped."""

    def capture_signals(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


def serve(config: PieConfig, model_dir: Path, config_path: str | None, backend_args: list[str],
          console: Console, verbose: bool = False) -> int:
    """Serve until SIGINT/SIGTERM; the exit code of `pie serve`."""
    return asyncio.run(_serve(config, model_dir, config_path, backend_args, console, verbose))


async def _serve(config: PieConfig, model_dir: Path, config_path: str | None,
                 backend_args: list[str], console: Console, verbose: bool) -> int:
    state = ServerState(config.server)
    server = _Server(uvicorn.Config(
        create_app(state), host=config.server.host, port=config.server.port, lifespan="off",
        log_config=None, log_level=logging.INFO if verbose else logging.WARNING,
        ws_max_size=ws_max_size(config.server), timeout_graceful_shutdown=10,
    ))
    loop = asyncio.get_running_loop()
    stop = _StopRequests(server)
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.request)
    serving = asyncio.create_task(server.serve())
    stopping = asyncio.ensure_future(stop.first.wait())
    backends = Backends(config, model_dir, config_path, backend_args)
    runtime = None
    try:
        while not server.started:  # bound and listening (uvicorn logs why if it cannot bind)
            if serving.done():
                return 1
            await asyncio.sleep(0.02)
        host, port = server.servers[0].sockets[0].getsockname()[:2]
        await backends.start(console)
        with console.status(f"starting {backends.describe()} ({model_dir.name}, {config.backend.dtype})") as status:
            handshakes = asyncio.ensure_future(backends.handshake())
            builtins = asyncio.ensure_future(asyncio.to_thread(_build_builtins, config, console))
            await asyncio.wait({handshakes, serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if not handshakes.done():  # asked to stop while the backends were loading
                await backends.stop()
                await asyncio.gather(handshakes, builtins, return_exceptions=True)
                return 0
            hello, failures = handshakes.result()
            status.update("starting the runtime")
            runtime = await asyncio.to_thread(start_runtime, config, backends.endpoints, hello, await builtins,
                                              backends.secret)
            for replica, failure in zip(runtime.controller.replicas, failures):
                replica.failure = failure  # a remote replica not (yet) serving: watched below
        for sock in server.servers[0].sockets:  # inferlets may not call this server itself
            runtime.controller.http.protect(*sock.getsockname()[:2])
        state.model, state.runtime = hello.model_name, runtime
        print(READY_LINE.format(model=hello.model_name, host=host, port=port), flush=True)
        watchdogs = backends.watch(runtime, hello, console)
        await asyncio.wait({serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
        for watchdog in watchdogs:
            watchdog.cancel()
        if stopping.done():
            await _drain(runtime, state, config.server.drain_timeout_s, stop, console)
        return 0
    except (BackendError, TransportError) as e:
        console.print(f"[red]error:[/] {e}")
        return 1
    finally:
        stopping.cancel()
        server.should_exit = True
        await asyncio.gather(serving, return_exceptions=True)
        if runtime is not None:
            runtime.shutdown()
        await backends.stop()


def _build_builtins(config: PieConfig, console: Console) -> dict[str, Path]:
    """Components of the built-in inferlets, launchable by name. Built on every start: cargo
    rebuilds only what changed (< 1 s when nothing did). One that cannot be built (no Rust
    toolchain, no source tree in an installed package) is left out with a warning."""
    components = {}
    for name in BUILTIN_INFERLETS:
        crate = REPO / "inferlets" / name
        if not crate.is_dir():
            continue
        try:
            components[name] = build_inferlet(crate, release=True, console=console,
                                               cache=config.paths.cache)
        except ToolchainError as e:
            console.print(f"[yellow]warning:[/] built-in inferlet {name!r} unavailable: {e}",
                          highlight=False)
    return components


class _StopRequests:
    """SIGINT/SIGTERM: the first asks for a drain, the second to stop waiting (for running
    instances, and for uvicorn's connections)."""

    def __init__(self, server: uvicorn.Server) -> None:
        self.server = server
        self.first = asyncio.Event()
        self.second = asyncio.Event()

    def request(self) -> None:
        if self.first.is_set():
            self.second.set()
            self.server.force_exit = True
        self.first.set()


async def _drain(runtime: Runtime, state: ServerState, timeout_s: float, stop: _StopRequests,
                 console: Console) -> None:
    """Refuse new work, let running instances finish (bounded), then terminate the rest and
    give their connections a moment to send the news before they are closed."""
    state.draining = True
    runtime.stop_launches()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    if live := runtime.live_count():
        console.print(f"draining: {live} instance(s) running; waiting up to {timeout_s:g} s "
                      "(server.drain_timeout_s) for them to finish — signal again to stop now")
    while runtime.live_count() and loop.time() < deadline and not stop.second.is_set():
        await asyncio.sleep(0.05)
    if ended := await asyncio.to_thread(runtime.terminate_all, "server shutting down"):
        console.print(f"terminated {ended} instance(s) still running")
        await asyncio.sleep(0.2)  # their end events reach the connections' writers
