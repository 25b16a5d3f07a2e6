"""A real `pie serve` (and the tool server) for end-to-end tests, and a one-call way to run
an inferlet on it. Shared by tests/test_e2e.py and tests/inferlets/."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import msgpack
import pytest
import websockets

from pie.client import PieClient, ws_url
from pie.toolchain import build_inferlet

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "e2e-secret-token-0001"
ADMIN = "e2e-admin-token-0001"  # server.admin_tokens: sees every user (/stats, /metrics)
READY = re.compile(r"\(ws://(\S+)/ws\)")


def base_config() -> dict[str, dict]:
    """The test server's config tables (fp32, so greedy output can be held to HF's)."""
    return {
        "backend": {"dtype": "float32", "num_kv_pages": 1024},
        "control": {"alloc_wait_ms": 200.0},  # short: the fuzzers exhaust the pool on purpose
        "runtime": {"cpu_slice_ms": 1000, "memory_limit_mb": 64},
        "server": {"max_upload_bytes": 67108864, "auth_tokens": [TOKEN], "admin_tokens": [ADMIN]},
    }


def to_toml(tables: dict[str, dict]) -> str:
    """Tables of scalars and lists as TOML (JSON's literals are TOML's for these)."""
    return "".join(f"[{name}]\n" + "".join(f"{key} = {json.dumps(value)}\n" for key, value in keys.items())
                   for name, keys in tables.items())



MODEL_KINDS = ("forward", "pass")  # scheduler call kinds that run the model

class Server:
    """`pie serve` on a free loopback port with the test config, `overrides` merged in
    per table (e.g. {"quota.user": {"kv_pages": 40}})."""

    def __init__(self, tmp: Path, overrides: dict[str, dict] | None = None):
        tables = base_config()
        for name, keys in (overrides or {}).items():
            tables[name] = {**tables.get(name, {}), **keys}
        config = tmp / "pie.toml"
        config.write_text(to_toml(tables))
        self.process = subprocess.Popen(
            [sys.executable, "-m", "pie.cli", "serve", "--host", "127.0.0.1", "--port", "0",
             "--config", str(config)], stdout=subprocess.PIPE, text=True)
        for line in self.process.stdout:
            if match := READY.search(line):
                self.address = match.group(1)
                break
        else:
            raise RuntimeError(f"pie serve exited with {self.process.wait()} before it was ready")
        self.ws = f"ws://{self.address}/ws"

    def get(self, path: str, token: str = TOKEN) -> tuple[int, dict]:
        request = urllib.request.Request(f"http://{self.address}{path}",
                                         headers={"Authorization": f"Bearer {token}"})
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def resources(self) -> dict:
        return self.get("/stats")[1]["resources"]

    def resources_once_pages_free(self) -> dict:
        """`resources()` once every KV page is free again: an ended instance's pages come back
        once the batch in flight that writes them is answered (steps the backend takes on its
        own included), which may be a moment after its end reaches the client."""
        return until(lambda: (r := self.resources())["kv_pages_free"] == r["kv_pages_total"] and r,
                     what=lambda: f"every KV page free again ({self.resources()})")

    def scheduler(self) -> dict:
        return self.get("/stats")[1]["scheduler"]

    def backend_pids(self) -> list[int]:
        """The backend processes (`pie backend`, one per replica), children of `pie serve`."""
        children = subprocess.run(["pgrep", "-P", str(self.process.pid), "-f", "pie.cli backend"],
                                  capture_output=True, text=True).stdout.split()
        return [int(pid) for pid in children]

    def backend_pid(self) -> int:
        (pid,) = self.backend_pids()
        return pid

    @staticmethod
    def cmdline(pid: int) -> str:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()

    @contextlib.contextmanager
    def backend_paused(self):
        """The backend process stopped (SIGSTOP) for the block, then continued: whatever the
        scheduler sends meanwhile stays in flight, and every later call waits in its queue
        (see `queued`), so a test can line calls up and then let them go at once."""
        pid = self.backend_pid()
        os.kill(pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(pid, signal.SIGCONT)

    def queued(self, kind: str) -> int:
        """Calls of `kind` (e.g. "sample") waiting in the scheduler's queues now."""
        return self.scheduler()["queued"].get(kind, 0)

    def model_calls_since(self, before: dict) -> int:
        """Calls that run the model (legacy `forward`s and fused passes) submitted since the
        `scheduler()` snapshot `before`: waiting now, or sent to the backend (a paused
        backend holds the batch in flight, which may hold several)."""
        now = self.scheduler()
        return sum(now["queued"].get(k, 0) + now["calls"].get(k, 0) - before.get("calls", {}).get(k, 0)
                   for k in MODEL_KINDS)

    def rss_mib(self) -> float:
        """Resident memory of the `pie serve` process (the control process: server, runtime
        and inferlets; the backend is a child process of its own)."""
        with open(f"/proc/{self.process.pid}/status") as status:
            kib = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
        return kib / 1024

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(60)


class ToolServer:
    """`python -m pie.tools` on a free loopback port (see docs/tools.md)."""

    def __init__(self, *extra_args: str):
        self.process = subprocess.Popen([sys.executable, "-m", "pie.tools", "--port", "0", *extra_args],
                                        stdout=subprocess.PIPE, text=True)
        self.url = re.search(r"(http://\S+)", self.process.stdout.readline()).group(1)

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(10)


HANG_S = 300.0  # bounds a wait for a condition: only reached when something hangs


def until(predicate, timeout_s: float = HANG_S, what="condition", interval_s: float = 0.05):
    """Poll `predicate` until it returns something true (returned); fail after `timeout_s`,
    which only bounds a hang: a slow machine just polls longer. `what` names the condition
    (a string, or a function giving one, called on failure)."""
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"{what() if callable(what) else what}: not reached in {timeout_s:g} s"
        time.sleep(interval_s)
    return value


async def until_async(predicate, timeout_s: float = HANG_S, what="condition", interval_s: float = 0.05):
    """`until` for a coroutine: `predicate` (a plain function, may block) runs in a thread."""
    deadline = time.monotonic() + timeout_s
    while not (value := await asyncio.to_thread(predicate)):
        assert time.monotonic() < deadline, f"{what() if callable(what) else what}: not reached in {timeout_s:g} s"
        await asyncio.sleep(interval_s)
    return value


def forward_batches(before: dict, after: dict) -> tuple[int, int]:
    """(calls, batches) that ran the model (forwards and fused passes) between two /stats
    snapshots."""
    def delta(field: str) -> int:
        return sum(after[field].get(k, 0) - before.get(field, {}).get(k, 0) for k in MODEL_KINDS)
    return delta("calls"), delta("batches")


def slow_reader(url: str, **kwargs):
    """A raw connection whose socket holds little (64 KiB) of what the client has not read
    (the kernel otherwise lets tens of MB pile up on loopback: net.ipv4.tcp_rmem), without
    compression (which would let our repetitive messages pile up 50 times as many)."""
    parts = urllib.parse.urlsplit(ws_url(url))
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
    sock.connect((parts.hostname, parts.port))
    sock.setblocking(False)
    return websockets.connect(ws_url(url), sock=sock, max_size=None, compression=None, **kwargs)


async def read_until_closed(ws) -> tuple[list[dict], websockets.frames.Close]:
    """Every frame left on a raw connection, then the server's close frame."""
    frames = []
    with pytest.raises(websockets.ConnectionClosed) as closed:
        while True:
            frames.append(msgpack.unpackb(await ws.recv()))
    return frames, closed.value.rcvd


@dataclass
class Run:
    """What one inferlet run produced."""

    messages: list[str]
    reason: str
    usage: dict[str, int] = field(default_factory=dict)
    logs: list[tuple[str, str]] = field(default_factory=list)  # (level, line), with logs=True


def build(name: str) -> bytes:
    """The component of inferlets/<name> (cargo builds only what changed)."""
    return build_inferlet(ROOT / "inferlets" / name).read_bytes()


def run_inferlet(server: Server, program: bytes | str, args: list[str],
                 replies: list[str] = (), logs: bool = False) -> Run:
    """Launch `program` (component bytes or a built-in name) with `args`, send it `replies`
    one by one, and collect its messages (and with `logs` its log lines) until it ends."""
    async def run() -> Run:
        async with PieClient(server.ws, TOKEN) as client:
            name = await client.upload(program) if isinstance(program, bytes) else program
            instance = await client.launch(name, args, logs=logs)
            for reply in replies:
                await instance.send(reply)
            messages = [m async for m in instance]
            return Run(messages, await instance.wait(), instance.usage, instance.logs)

    return asyncio.run(run())


def run_inferlet_batched(server: Server, program: bytes | str, args: list[str], forwards: int) -> Run:
    """`run_inferlet`, launched while the backend is paused: once `forwards` forward calls
    wait in the scheduler's queues (e.g. the first decode step of n forks, all enqueued
    before any is awaited) the backend goes on, and they leave in one batch — whatever the
    machine's speed. With the adaptive policy alone that is a race between the instance
    enqueueing them and the scheduler sending the first one."""
    async def run() -> Run:
        async with PieClient(server.ws, TOKEN) as client:
            name = await client.upload(program) if isinstance(program, bytes) else program
            with server.backend_paused():
                before = server.scheduler()
                instance = await client.launch(name, args)
                await until_async(lambda: server.model_calls_since(before) >= forwards,
                                  what=f"{forwards} forward calls queued")
            messages = [m async for m in instance]
            return Run(messages, await instance.wait(), instance.usage)

    return asyncio.run(run())
