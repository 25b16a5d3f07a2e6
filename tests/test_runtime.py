"""The runtime (wasmtime, instance threads, limits, teardown) with a real control layer
whose backend is never needed: `hello` and the probe's limit modes make no model calls."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from pie import protocol as P
from pie.config import PieConfig
from pie.runtime.runtime import LaunchRefused, UnknownInstance, UnknownProgram, start_runtime
from pie.toolchain import build_inferlet

ROOT = Path(__file__).resolve().parents[1]


class Events:
    """Collects one instance's events; `ended` is set by its terminated event."""

    def __init__(self) -> None:
        self.messages: list[str] = []
        self.reason: str | None = None
        self.ended = threading.Event()

    def __call__(self, _id: str, kind: str, data: str, usage: dict | None = None) -> None:
        if kind == "message":
            self.messages.append(data)
        else:
            self.reason = data
            self.ended.set()

    def wait(self, timeout: float = 60) -> str:
        """The end reason, once the instance has ended."""
        assert self.ended.wait(timeout), f"the instance did not end within {timeout} s"
        return self.reason


@pytest.fixture
def runtime(tmp_path, model_dir):
    config = PieConfig()
    config.paths.cache_dir = str(tmp_path)
    config.runtime.max_instances = 2
    config.runtime.cpu_slice_ms = 300
    handshake = P.HandshakeReply(
        protocol_version=P.PROTOCOL_VERSION, model_name="test-model", traits=["forward"],
        page_size=16, num_kv_pages=8, num_embeds=8, vocab_size=49152, hidden_size=576,
        max_batch_tokens=64, tokenizer_json=(model_dir / "tokenizer.json").read_text(),
        eos_token_ids=[2], bos_token_id=1, chat_template="", dtype="float32", device="cpu")
    builtins = {name: build_inferlet(ROOT / "inferlets" / name) for name in ("hello", "probe")}
    rt = start_runtime(config, [f"ipc://{tmp_path}/no-backend.sock"], handshake, builtins)
    yield rt
    rt.shutdown()


def test_launch_echo_terminate_and_limits(runtime):
    first, second = Events(), Events()
    a = runtime.launch("hello", ["one"], first)
    runtime.launch("hello", ["two"], second)
    with pytest.raises(LaunchRefused, match="max_instances = 2"):
        runtime.launch("hello", [], Events())
    runtime.send(a.id, "ping")
    runtime.send(a.id, "quit")
    assert first.ended.wait(60) and first.reason == "finished"
    assert first.messages == ["one", "ping"]
    info = runtime.list_instances()
    assert [i.name for i in info] == ["hello"] and info[0].arguments == ["two"]
    runtime.terminate(info[0].id)
    assert second.ended.wait(60) and second.reason == "terminated by client"
    assert runtime.list_instances() == []
    with pytest.raises(UnknownInstance):
        runtime.send(a.id, "too late")
    with pytest.raises(UnknownProgram):
        runtime.launch("f" * 64, [], Events())


def test_the_epoch_ticks_only_while_an_instance_is_live(runtime):
    """The epoch thread (guest deadlines) waits while no instance is live: an idle server
    woke 100 times a second for nothing (control process 24.5 -> 7.0 ms of CPU a second
    idle, Xeon, 2026-12-03, one-off). It ticks again from the next launch."""
    import time

    ticks = [0]
    increment = runtime.engine.increment_epoch
    runtime.engine.increment_epoch = lambda: (ticks.__setitem__(0, ticks[0] + 1), increment())[1]
    time.sleep(0.05)  # a tick already under way when the fixture's runtime started
    idle = ticks[0]
    time.sleep(0.3)  # 30 ticks if it ticked
    assert ticks[0] <= idle + 1 and not runtime.live.is_set()
    events = Events()
    instance = runtime.launch("hello", ["one"], events)
    while ticks[0] < idle + 3:  # it ticks while the instance lives (a hang ends in the wait below)
        assert not events.ended.is_set(), "hello ended before the epoch ticked"
        time.sleep(0.01)
    runtime.send(instance.id, "quit")
    assert events.wait() == "finished"
    time.sleep(0.05)
    after = ticks[0]
    time.sleep(0.3)
    assert ticks[0] <= after + 1 and not runtime.live.is_set()


def test_terminate_all_sets_every_reason_before_its_then_runs(runtime):
    """A lost replica fails its calls in `then`: by then every instance's reason is set and
    none is woken yet, so an inferlet that sees its call fail still ends with the replica's
    reason (CI once saw "error: inference-failed: backend replica 1 … is lost" instead)."""
    events = [Events(), Events()]
    for e in events:
        runtime.launch("hello", [], e)
    seen = []
    runtime.terminate_all("error: replica lost", then=lambda: seen.extend(
        (i.end_reason, i.host.cancelled.is_set()) for i in runtime.instances.values()))
    assert seen == [("error: replica lost", False)] * 2
    assert [e.wait() for e in events] == ["error: replica lost"] * 2


def test_cpu_limit_stops_a_spinning_instance(runtime):
    events = Events()
    runtime.launch("probe", ["loop"], events)
    assert events.ended.wait(60)
    assert events.reason.startswith("trap: CPU limit") and "300 ms" in events.reason


def test_compiled_programs_survive_a_restart(runtime):
    digest = runtime.programs.builtins["hello"]
    artifact = runtime.programs.dir / f"{digest}.cwasm"
    assert artifact.is_file()
    runtime.programs.loaded.clear()  # as after a restart: only the disk cache is left
    assert runtime.programs.exists(digest, "anonymous")  # built-ins are public
    events = Events()
    runtime.launch(digest, ["again"], events)
    runtime.send(runtime.list_instances()[0].id, "quit")
    assert events.ended.wait(60) and events.messages == ["again"]


def test_an_artifact_of_another_engine_is_compiled_again(runtime, tmp_path):
    """A cached artifact compiled under another engine configuration (here: copy-on-write
    memory images off) does not load with this engine: adding its program compiles it again
    instead of leaving a launch to fail."""
    from wasmtime import Config, Engine
    from pie.runtime.programs import ProgramStore

    data = build_inferlet(ROOT / "inferlets" / "hello").read_bytes()
    other = Config()
    other.epoch_interruption = True
    other.memory_init_cow = False
    digest = ProgramStore(Engine(other), tmp_path / "shared").add(data)
    store = ProgramStore(runtime.engine, tmp_path / "shared")
    assert store.add(data) == digest
    store.loaded.clear()  # load from disk: the artifact now is this engine's
    assert store.load(digest) is not None
