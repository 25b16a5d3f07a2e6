"""The reclaimer through a real `pie serve` (issue 17): a short KV pool takes the pages of an
instance paused on a message — swapped to host memory and back, or discarded and computed
again by the SDK's context — and the paused instance's greedy output is the same as if the
pool had never been pressed. Nothing is killed; both pools are full again afterwards."""

from __future__ import annotations

import json
import os
import signal

import pytest

from pie.client import PieClient
from pie.python_build import build_python_inferlet

from pie_server import TOKEN, Server, ToolServer, build, until, until_async

pytestmark = pytest.mark.anyio
PAGES = 48  # the device pool: a hold of all but a few pages needs the paused one's
PROMPT = "The history of the printing press begins in the fifteenth century, when"


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def probe() -> bytes:
    return build("probe")


def server_with(tmp_path_factory, policy: str) -> Server:
    """A pool of PAGES; swaps over an emulated link of 50 MB/s (~7 ms a page), so their
    replies are held while other batches run (backend.swap_gbps)."""
    return Server(tmp_path_factory.mktemp(policy),
                  {"backend": {"num_kv_pages": PAGES, "num_host_kv_pages": PAGES, "swap_gbps": 0.05},
                   "control": {"kv_pressure": policy, "alloc_wait_ms": 5000.0}})


@pytest.fixture(scope="module")
def swap_server(tmp_path_factory):
    server = server_with(tmp_path_factory, "swap")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def discard_server(tmp_path_factory):
    server = server_with(tmp_path_factory, "discard")
    yield server
    server.stop()


def reclaim(server: Server) -> dict:
    return server.resources()["reclaim"]


def free_pages(server: Server) -> int:
    return server.resources()["kv_pages_free"]


async def pause_run(client: PieClient, program: str, kv_class: str, server: Server,
                    press: bool, holder: str | None = None) -> tuple[str, str]:
    """`probe pause` (or its Python twin): its first 8 tokens, then (with `press`, a probe
    holding 2 more pages than are free meanwhile) 8 more."""
    paused = await client.launch(program, ["pause", kv_class, PROMPT])
    first = (await paused.recv()).text
    if press:
        hold = await client.launch(holder or program, ["hold", str(free_pages(server) + 2)])
        assert (await hold.recv()).text.startswith("held ")
        await hold.send("done")
        assert await hold.wait() == "finished"
    await paused.send("go")
    second = (await paused.recv()).text
    assert await paused.wait() == "finished"
    return first, second


async def calm_and_pressed(server: Server, probe: bytes, kv_class: str) -> tuple[bool, dict, dict]:
    """`probe pause` unpressed, then pressed: whether their outputs agree, and the reclaim
    counts before and after the pressed run."""
    async with PieClient(server.ws, TOKEN) as client:
        program = await client.upload(probe)
        calm = await pause_run(client, program, kv_class, server, press=False)
        before = reclaim(server)
        pressed = await pause_run(client, program, kv_class, server, press=True)
    assert calm[0].startswith("first: ") and calm[1].startswith("second: ")
    return pressed == calm, before, reclaim(server)


async def test_swap_moves_a_paused_instance_and_brings_it_back(swap_server, probe):
    """kv_pressure = swap: the pages of an instance waiting on a message go to host memory
    when another instance needs them, and come back before its next pass: same output."""
    same, before, after = await calm_and_pressed(swap_server, probe, "swappable")
    assert same
    assert after["swapped_out"] > before["swapped_out"]
    assert after["swapped_in"] - before["swapped_in"] == after["swapped_out"] - before["swapped_out"]
    assert after["host_pages_free"] == PAGES and swap_server.resources()["kv_pages_free"] == PAGES


async def test_pinned_pages_stay_and_the_allocation_fails(swap_server, probe):
    """A page its instance pinned is never moved: the allocation that needed it waits out
    control.alloc_wait_ms and fails; the paused instance goes on unharmed."""
    async with PieClient(swap_server.ws, TOKEN) as client:
        program = await client.upload(probe)
        before = reclaim(swap_server)
        paused = await client.launch(program, ["pause", "pinned", PROMPT])
        assert (await paused.recv()).text.startswith("first: ")
        hold = await client.launch(program, ["hold", str(free_pages(swap_server) + 2)])
        refused = (await hold.recv()).text
        assert refused.startswith("out-of-resources:") and "alloc_wait_ms" in refused
        await hold.send("done")
        await paused.send("go")
        assert (await paused.recv()).text.startswith("second: ")
        for instance in (hold, paused):
            assert await instance.wait() == "finished"
    assert reclaim(swap_server)["swapped_out"] == before["swapped_out"]
    assert swap_server.resources()["kv_pages_free"] == PAGES


async def swapped_out(client: PieClient, server: Server, probe: bytes):
    """A paused `probe pause` whose pages a `probe hold` took: (the paused, the holder)."""
    program = await client.upload(probe)
    paused = await client.launch(program, ["pause", "swappable", PROMPT])
    assert (await paused.recv()).text.startswith("first: ")
    hold = await client.launch(program, ["hold", str(free_pages(server) + 2)])
    assert (await hold.recv()).text.startswith("held ")
    return paused, hold


async def test_terminated_while_swapped_out_gives_both_pools_back(swap_server, probe):
    async with PieClient(swap_server.ws, TOKEN) as client:
        paused, hold = await swapped_out(client, swap_server, probe)
        assert reclaim(swap_server)["host_pages_free"] < PAGES  # its pages sit in host memory
        await paused.terminate()
        assert await paused.wait() == "terminated by client"
        await hold.send("done")
        assert await hold.wait() == "finished"
    assert reclaim(swap_server)["host_pages_free"] == PAGES
    assert swap_server.resources()["kv_pages_free"] == PAGES


async def test_a_backend_restart_with_pages_in_host_memory_refills_both_pools(swap_server, probe):
    """The backend dies while a paused instance's pages sit in host memory: every instance
    ends with the reason, both pools come back full, and the restarted backend swaps again."""
    async with PieClient(swap_server.ws, TOKEN) as client:
        paused, hold = await swapped_out(client, swap_server, probe)
        assert reclaim(swap_server)["host_pages_free"] < PAGES
        os.kill(swap_server.backend_pid(), signal.SIGKILL)
        for instance in (paused, hold):
            assert "backend process exited" in await instance.wait()
    until(lambda: swap_server.get("/health")[0] == 200, what="the backend restarted", interval_s=0.5)
    assert reclaim(swap_server)["host_pages_free"] == PAGES
    assert swap_server.resources()["kv_pages_free"] == PAGES
    async with PieClient(swap_server.ws, TOKEN) as client:
        before = reclaim(swap_server)["swapped_out"]
        first, second = await pause_run(client, await client.upload(probe), "swappable", swap_server, press=True)
        assert first.startswith("first: ") and second.startswith("second: ")
        assert reclaim(swap_server)["swapped_out"] > before


async def test_discard_recomputes_a_discardable_context(discard_server, probe):
    """kv_pressure = discard: a discardable context's pages are dropped; its next pass
    fails with `discarded` inside the SDK, which computes the tokens again: same output."""
    same, before, after = await calm_and_pressed(discard_server, probe, "discardable")
    assert same
    assert after["discarded"] > before["discarded"] and after["swapped_out"] == 0
    assert discard_server.resources()["kv_pages_free"] == PAGES


PY_PAUSE = '''
import inferlet

def main(args):
    _, kv_class, prompt = args
    ctx = inferlet.Context(inferlet.Model.default().create_queue())
    ctx.fill(prompt)
    ctx.flush()
    if kv_class == "discardable":
        ctx.set_discardable(True)
    stop, greedy = inferlet.Stop(8), inferlet.Sampler.greedy()
    inferlet.send("first: " + ctx.generate(greedy, stop))
    inferlet.receive().result()
    inferlet.send("second: " + ctx.generate(greedy, stop))
'''


async def test_python_sdk_context_recomputes_too(discard_server, probe, tmp_path):
    """The Python SDK's Context.set_discardable: dropped pages are computed again, and the
    output equals the Rust probe's unpressed one."""
    source = tmp_path / "py_pause.py"
    source.write_text(PY_PAUSE)
    python = build_python_inferlet(source).read_bytes()
    async with PieClient(discard_server.ws, TOKEN) as client:
        rust = await client.upload(probe)
        calm = await pause_run(client, rust, "discardable", discard_server, press=False)
        before = reclaim(discard_server)
        pressed = await pause_run(client, await client.upload(python), "discardable", discard_server,
                                  press=True, holder=rust)
    assert pressed == calm
    assert reclaim(discard_server)["discarded"] > before["discarded"]
    assert discard_server.resources()["kv_pages_free"] == PAGES


async def test_api_agent_waits_on_calls_and_recomputes_what_was_dropped(discard_server):
    """The api_serve benchmark's inferlet: its context waits on tool calls (the tool server's
    `slow`), its pages are dropped meanwhile by a probe that needs them, and its context
    computes them again: it forwards more tokens than its context holds, and finishes."""
    tools = ToolServer()
    try:
        async with PieClient(discard_server.ws, TOKEN) as client:
            agent_program, probe_program = await client.upload(build("api_agent")), await client.upload(build("probe"))
            calm = await client.launch(agent_program, ["--tools-url", tools.url, "--context", "200",
                                                       "--calls", "0.1,1500", "--gen", "4", "--seed", "3"])
            [report] = [json.loads(m) async for m in calm]
            assert await calm.wait() == "finished"
            assert report == {"context": 200, "calls": 2, "generated": 12, "tokens": report["tokens"]}
            assert calm.usage["forward_tokens"] == report["tokens"] - 1  # each token forwarded once
            agent = await client.launch(agent_program, ["--tools-url", tools.url, "--context", "200",
                                                        "--calls", "1500", "--gen", "4", "--seed", "4"])
            await until_async(lambda: reclaim(discard_server)["paused_instances"] == 1,
                              what="the agent waiting on its call")
            hold = await client.launch(probe_program, ["hold", str(free_pages(discard_server) + 2)])
            assert (await hold.recv()).text.startswith("held ")
            await hold.send("done")
            [pressed] = [json.loads(m) async for m in agent]
            assert await agent.wait() == "finished" and await hold.wait() == "finished"
            assert agent.usage["forward_tokens"] > pressed["tokens"] - 1  # it recomputed its context
    finally:
        tools.stop()
    assert discard_server.resources()["kv_pages_free"] == PAGES
