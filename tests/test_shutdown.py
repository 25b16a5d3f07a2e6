"""`pie serve` drains on SIGTERM (issue 7): launches are refused and /health says draining
while running instances finish; what is still running at server.drain_timeout_s is
terminated and its client told why; the server exits 0."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from pie.client import PieClient
from pie.server.rpc import RpcError

from pie_server import TOKEN, Server

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def completion(prompt: str, tokens: int) -> list[str]:
    return ["--prompt", prompt, "--max-tokens", str(tokens)]


async def test_sigterm_lets_running_instances_finish(tmp_path, hf_chat):
    """What was running finishes whole: each completion is HF's greedy one, not cut short."""
    prompts = ("Tell a long story about a dragon.", "Describe the sea at length.")
    expected = [[hf_chat(p, 48)] for p in prompts]
    server = Server(tmp_path, {"server": {"drain_timeout_s": 120.0}})
    try:
        async with PieClient(server.ws, TOKEN) as client:
            running = [await client.launch("text_completion", completion(p, 48)) for p in prompts]
            server.process.send_signal(signal.SIGTERM)
            await _until(lambda: server.get("/health") == (503, {"status": "draining"}))
            with pytest.raises(RpcError, match="launch_refused.*shutting down"):
                await client.launch("text_completion", completion("Late.", 4))
            for answer, instance in zip(expected, running):
                assert [m async for m in instance] == answer
                assert await instance.wait() == "finished"
        assert server.process.wait(60) == 0
    finally:
        server.stop()


async def test_drain_timeout_terminates_what_is_still_running(tmp_path):
    server = Server(tmp_path, {"server": {"drain_timeout_s": 0.5}})
    try:
        async with PieClient(server.ws, TOKEN) as client:
            endless = await client.launch("hello", ["x"])  # echoes messages until "quit"
            assert (await endless.recv()).text == "x"
            server.process.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(endless.wait(), 60) == "server shutting down"
        assert server.process.wait(60) == 0
    finally:
        server.stop()


async def _until(predicate, timeout_s: float = 120.0) -> None:  # bounds a hang only
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not await asyncio.to_thread(predicate):
        assert loop.time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


def test_sigterm_to_pie_run_stops_its_private_server(tmp_path):
    """`pie run` without --server owns a `pie serve` child: SIGTERM (like Ctrl-C) closes the
    connection and stops that server instead of orphaning it."""
    run = subprocess.Popen(
        [sys.executable, "-m", "pie.cli", "run", "text_completion", "--dtype", "float32", "--",
         "--prompt", "Tell a long story.", "--max-tokens", "2000"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        for line in run.stderr:  # the instance line: the server is up and generating
            if "instance" in line:
                break
        servers = subprocess.run(["pgrep", "-P", str(run.pid)], capture_output=True, text=True).stdout.split()
        assert servers, "no private server child"
        run.send_signal(signal.SIGTERM)
        assert run.wait(60) == 128 + signal.SIGTERM
        for pid in servers:
            assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()
    finally:
        run.kill()
        run.wait()
