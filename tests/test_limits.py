"""Per-instance limits (issue findings 2 and 9): wasmtime store limits — memory_limit_mb on each
linear memory and max_memories of them (1 by default), so an instance holds at most
max_memories × memory_limit_mb — and total CPU and wall-clock budgets.

The hostile programs are hand-written components (WAT, turned into binaries by `wasm-tools
parse`) that import nothing, or only `runtime.now`, and export `run` as the world says
(`func() -> result<_, string>`; the core function returns a pointer to the result, whose
discriminant is 0 = ok in zeroed memory). Most tests use an in-process runtime (no backend:
none of these programs calls the model); one goes through a real `pie serve` and reads its
resident memory.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
from pie_server import Server, run_inferlet
from test_runtime import Events

from pie import protocol as P
from pie.config import InstanceQuota, PieConfig, QuotaConfig
from pie.runtime.runtime import start_runtime
from pie.toolchain import build_inferlet, wasm_tools

ROOT = Path(__file__).resolve().parents[1]

# --- the components ------------------------------------------------------------------------

# Lifting `run`: its core function returns the address of the result (0: zeroed = ok).
RUN_EXPORT = """
  (func (export "run") (result (result (error string)))
    (canon lift (core func $i "run") (memory (core memory $i "memory"))))
"""


def core_only(module_body: str) -> str:
    """A component of one core module (which must export `memory` and `run`)."""
    return f"(component (core module $m {module_body}) (core instance $i (instantiate $m)) {RUN_EXPORT})"


# Finding 2: grows a funcref table by 50 M entries (381 MB of host memory before the fix);
# traps if the growth is refused, as any program that cannot get its allocation would.
TABLE_BOMB = core_only("""
    (table $t 1 funcref)
    (memory (export "memory") 1)
    (func (export "run") (result i32)
      (if (i32.eq (table.grow $t (ref.null func) (i32.const 50000000)) (i32.const -1))
        (then unreachable))
      (i32.const 0))""")


def touch_growth(memory: str, mib: int, on_refusal: str = "") -> str:
    """Grow `memory` 1 MiB at a time up to `mib` MiB, writing to every page (so it is
    resident); when a growth is refused, run `on_refusal` (nothing: stop quietly)."""
    return f"""
      (block $done
        (block $refused
          (loop $grow
            (br_if $refused (i32.eq (memory.grow {memory} (i32.const 16)) (i32.const -1)))
            (local.set $end (i32.mul (memory.size {memory}) (i32.const 65536)))
            (local.set $p (i32.sub (local.get $end) (i32.const 1048576)))
            (loop $touch
              (i32.store8 {memory} (local.get $p) (i32.const 1))
              (local.set $p (i32.add (local.get $p) (i32.const 4096)))
              (br_if $touch (i32.lt_u (local.get $p) (local.get $end))))
            (br_if $grow (i32.lt_u (memory.size {memory}) (i32.const {mib * 16 + 1}))))
          (br $done))
        {on_refusal})"""


# Finding 2: four memories, each grown to 200 MiB and written to (~800 MB before the fix).
# Refused growths are ignored: the program finishes "normally" unless the runtime ends it.
MEMORY_BOMB = core_only(f"""
    (memory $a (export "memory") 1)
    (memory $b 1)
    (memory $c 1)
    (memory $d 1)
    (func (export "run") (result i32)
      (local $p i32) (local $end i32)
      {touch_growth("$a", 200)}
      {touch_growth("$b", 200)}
      {touch_growth("$c", 200)}
      {touch_growth("$d", 200)}
      (i32.const 0))""")

# One memory grown to 200 MiB and written to; a refused growth traps, as a program that
# cannot get its allocation would.
ONE_MEMORY_BOMB = core_only(f"""
    (memory $a (export "memory") 1)
    (func (export "run") (result i32)
      (local $p i32) (local $end i32)
      {touch_growth("$a", 200, "unreachable")}
      (i32.const 0))""")

# Four memories of 200 MiB each at instantiation (nothing written: only the cap is tested).
FOUR_BIG_MEMORIES = core_only("""
    (memory (export "memory") 3200)
    (memory 3200)
    (memory 3200)
    (memory 3200)
    (func (export "run") (result i32) (i32.const 0))""")


def grow_to_exactly(memory: str, pages: int) -> str:
    """Trap unless `memory` (of one page) grows to `pages` pages and not one page more."""
    return f"""
      (if (i32.eq (memory.grow {memory} (i32.const {pages - 1})) (i32.const -1)) (then unreachable))
      (if (i32.ne (memory.grow {memory} (i32.const 1)) (i32.const -1)) (then unreachable))"""


# Four memories, each grown to 64 MiB (1024 pages) and refused one page more: finishes
# only if each is capped at exactly 64 MiB (nothing written: only the cap is tested).
FOUR_MEMORIES_AT_64_MIB = core_only(f"""
    (memory $a (export "memory") 1)
    (memory $b 1)
    (memory $c 1)
    (memory $d 1)
    (func (export "run") (result i32)
      {grow_to_exactly("$a", 1024)}
      {grow_to_exactly("$b", 1024)}
      {grow_to_exactly("$c", 1024)}
      {grow_to_exactly("$d", 1024)}
      (i32.const 0))""")

# One memory of 200 MiB at instantiation.
ONE_BIG_MEMORY = core_only("""
    (memory (export "memory") 3200)
    (func (export "run") (result i32) (i32.const 0))""")

# One memory grown past the cap: the growth is refused (-1) and the program traps.
ONE_MEMORY_PAST_THE_CAP = core_only("""
    (memory (export "memory") 1)
    (func (export "run") (result i32)
      (if (i32.eq (memory.grow (i32.const 8192)) (i32.const -1)) (then unreachable))
      (i32.const 0))""")


def many(item: str, n: int) -> str:
    return " ".join([item] * n)


TOO_MANY_TABLES = core_only(f"""
    {many("(table 0 funcref)", 20)}
    (memory (export "memory") 1)
    (func (export "run") (result i32) (i32.const 0))""")

TOO_MANY_MEMORIES = core_only("""
    (memory (export "memory") 1)
    (memory 0)
    (func (export "run") (result i32) (i32.const 0))""")

TABLE_TOO_LARGE = core_only("""
    (table 200000 funcref)
    (memory (export "memory") 1)
    (func (export "run") (result i32) (i32.const 0))""")

TOO_MANY_INSTANCES = f"""(component
  (core module $empty)
  {many("(core instance (instantiate $empty))", 70)}
  (core module $m
    (memory (export "memory") 1)
    (func (export "run") (result i32) (i32.const 0)))
  (core instance $i (instantiate $m))
  {RUN_EXPORT})"""


def with_now(loop_body: str) -> str:
    """A component importing `runtime.now` whose `run` repeats `loop_body` forever."""
    return f"""(component
  (import "pie:inferlet/runtime@0.1.0" (instance $rt (export "now" (func (result u64)))))
  (alias export $rt "now" (func $now))
  (core func $now_lowered (canon lower (func $now)))
  (core instance $host (export "now" (func $now_lowered)))
  (core module $m
    (import "host" "now" (func $now (result i64)))
    (memory (export "memory") 1)
    (func (export "run") (result i32)
      (local $i i32)
      (loop $forever {loop_body} (br $forever))
      (i32.const 0)))
  (core instance $i (instantiate $m (with "host" (instance $host))))
  {RUN_EXPORT})"""


# Finding 9: a host call about every millisecond, pure computation in between — the CPU
# slice (re-armed at every host call) never fires.
BUSY = with_now("""
        (drop (call $now))
        (local.set $i (i32.const 0))
        (loop $spin
          (local.set $i (i32.add (local.get $i) (i32.const 1)))
          (br_if $spin (i32.lt_u (local.get $i) (i32.const 1000000))))""")

# Pure computation, never a host call.
SPIN = with_now("(local.set $i (i32.add (local.get $i) (i32.const 1)))")


def component(wat: str, tmp_path: Path) -> bytes:
    source = tmp_path / "component.wat"
    source.write_text(wat)
    return subprocess.run([wasm_tools(), "parse", str(source)], check=True,
                          capture_output=True).stdout


# --- an in-process runtime ------------------------------------------------------------------


@pytest.fixture(scope="module")
def builtins() -> dict[str, Path]:
    return {name: build_inferlet(ROOT / "inferlets" / name) for name in ("hello", "probe")}


@pytest.fixture
def make_runtime(tmp_path, model_dir, builtins):
    """start(config tweaks...) -> a runtime without a backend, shut down after the test."""
    started = []

    def start(**runtime_keys) -> object:
        config = PieConfig()
        config.paths.cache_dir = str(tmp_path / "cache")
        if quota := runtime_keys.pop("quota", None):
            config.quota = quota
        for key, value in runtime_keys.items():
            setattr(config.runtime, key, value)
        handshake = P.HandshakeReply(
            protocol_version=P.PROTOCOL_VERSION, model_name="test-model", traits=["forward"],
            page_size=16, num_kv_pages=8, num_embeds=8, vocab_size=49152, hidden_size=576,
            max_batch_tokens=64, tokenizer_json=(model_dir / "tokenizer.json").read_text(),
            eos_token_ids=[2], bos_token_id=1, chat_template="", dtype="float32", device="cpu")
        rt = start_runtime(config, [f"ipc://{tmp_path}/no-backend-{len(started)}.sock"], handshake,
                           builtins)
        started.append(rt)
        return rt

    yield start
    for rt in started:
        rt.shutdown()


def run_wat(rt, wat: str, tmp_path: Path, user: str = "anonymous") -> Events:
    events = Events()
    digest = rt.programs.add(component(wat, tmp_path), owner=user)
    rt.launch(digest, [], events, user)
    return events


def echo_works(rt) -> bool:
    """A bystander `hello` launched now still echoes and finishes."""
    events = Events()
    info = rt.launch("hello", ["still here"], events)
    rt.send(info.id, "quit")
    return events.wait(30) == "finished" and events.messages == ["still here"]


# --- finding 2: memory and tables ------------------------------------------------------------


def test_table_bomb_is_refused_and_named(make_runtime, tmp_path):
    rt = make_runtime()
    reason = run_wat(rt, TABLE_BOMB, tmp_path).wait()
    assert reason.startswith("trap:") and "runtime.max_table_elements = 100000" in reason
    assert echo_works(rt)


@pytest.mark.parametrize("wat, key", [
    (TOO_MANY_TABLES, "runtime.max_tables = 16"),
    (TOO_MANY_MEMORIES, "runtime.max_memories = 1"),
    (TABLE_TOO_LARGE, "runtime.max_table_elements = 100000"),
    (TOO_MANY_INSTANCES, "runtime.max_wasm_instances = 64"),
], ids=["tables", "memories", "table-elements", "core-instances"])
def test_store_limits_refuse_instantiation(make_runtime, tmp_path, wat, key):
    rt = make_runtime()
    reason = run_wat(rt, wat, tmp_path).wait()
    assert reason.startswith("error: the component needs more") and key in reason, reason


def test_memory_is_bounded_by_max_memories_times_the_cap(make_runtime, tmp_path):
    """An instance holds at most max_memories × memory_limit_mb: by default (one memory) a
    component with four 200 MiB memories does not instantiate; with max_memories = 4 and
    memory_limit_mb = 64 each memory grows to 64 MiB and not one page more."""
    rt = make_runtime()
    reason = run_wat(rt, FOUR_BIG_MEMORIES, tmp_path).wait()
    assert reason == "error: the component needs more linear memories than runtime.max_memories = 1"
    rt = make_runtime(memory_limit_mb=64, max_memories=4)
    reason = run_wat(rt, FOUR_BIG_MEMORIES, tmp_path).wait()
    assert reason == "error: the component needs more MiB of linear memory than runtime.memory_limit_mb = 64"
    assert run_wat(rt, FOUR_MEMORIES_AT_64_MIB, tmp_path).wait() == "finished"
    assert echo_works(rt)


def test_one_memory_is_capped_by_wasmtime(make_runtime, tmp_path):
    """With one memory (the default), wasmtime's cap on it is the cap on the instance: too
    large at instantiation, it fails naming memory_limit_mb; grown past it, the growth is
    refused inside the guest (which traps here, and the reason names the key)."""
    rt = make_runtime(memory_limit_mb=64)
    reason = run_wat(rt, ONE_BIG_MEMORY, tmp_path).wait()
    assert reason == "error: the component needs more MiB of linear memory than runtime.memory_limit_mb = 64"
    reason = run_wat(rt, ONE_MEMORY_PAST_THE_CAP, tmp_path).wait()
    assert reason.startswith("trap:") and "runtime.memory_limit_mb = 64" in reason
    assert echo_works(rt)


def test_a_rust_allocation_failure_names_the_cap(make_runtime):
    """The probe allocates without bound: Rust aborts (a trap) when its memory is refused, and
    the SDK's allocator has said so first, so the reason names the failed allocation and the cap."""
    rt = make_runtime(memory_limit_mb=64)
    events = Events()
    rt.launch("probe", ["membomb"], events)
    reason = events.wait()
    assert reason == "trap: out of memory: an allocation of 1048576 bytes failed (runtime.memory_limit_mb = 64)"


def test_handles_an_instance_never_drops_are_bounded(make_runtime):
    """Each future the guest holds is host memory: an instance that makes them without end
    is ended at runtime.max_handles (before, 10 M `receive` calls held 10 M futures)."""
    rt = make_runtime(max_handles=1000)
    events = Events()
    rt.launch("probe", ["leak", "999"], events)  # + its queue: 1000
    assert events.wait() == "finished" and events.messages == ["leaked 999"]
    events = Events()
    rt.launch("probe", ["leak", "5000"], events)
    reason = events.wait()
    assert reason.startswith("error: the instance holds 1000 handles") and "runtime.max_handles = 1000" in reason


def test_dropping_a_subscription_gives_its_place_back(make_runtime):
    """quota.instance.subscriptions bounds the subscriptions held at once (each keeps a
    backlog); a dropped one is unsubscribed, as the WIT says."""
    rt = make_runtime(quota=QuotaConfig(instance=InstanceQuota(subscriptions=4)))
    events = Events()
    rt.launch("probe", ["resubscribe", "100"], events)
    assert events.wait() == "finished" and events.messages == ["resubscribed 100"]
    assert rt.controller.bus.topics == {}


# --- finding 9: CPU and wall-clock budgets ---------------------------------------------------


def test_cpu_budget_ends_a_busy_instance(make_runtime, tmp_path):
    rt = make_runtime(quota=QuotaConfig(instance=InstanceQuota(cpu_s=1.0)))
    busy = run_wat(rt, BUSY, tmp_path)
    assert echo_works(rt)  # meanwhile, others run
    reason = busy.wait()
    assert reason == "error: CPU budget exhausted: 1 s of CPU time (quota.instance.cpu_s)"


def test_cpu_budget_bounds_pure_computation(make_runtime, tmp_path):
    """No host call at all: the epoch deadline never lies beyond the remaining budget, so
    the budget (1 s) ends it long before the CPU slice (60 s) would."""
    rt = make_runtime(cpu_slice_ms=60_000, quota=QuotaConfig(instance=InstanceQuota(cpu_s=1.0)))
    reason = run_wat(rt, SPIN, tmp_path).wait(30)
    assert reason == "error: CPU budget exhausted: 1 s of CPU time (quota.instance.cpu_s)"


def test_wall_budget_ends_a_waiting_instance(make_runtime):
    """A user's wall budget (a per-user override) ends its instance blocked in a wait;
    another user's instance, with no budget, goes on."""
    quota = QuotaConfig(instance=InstanceQuota(wall_s=0),
                        users={"token-slow": {"instance": {"wall_s": 1.0}}})
    rt = make_runtime(quota=quota)
    waiting, other = Events(), Events()
    started = time.monotonic()  # before the launch: the budget counts from it
    rt.launch("hello", ["waiting"], waiting, "token-slow")
    other_id = rt.launch("hello", ["other"], other, "token-fast").id
    reason = waiting.wait()
    assert reason == "error: wall-clock budget exhausted: 1 s since launch (quota.instance.wall_s)"
    # A lower bound only (the budget's own deadline); a loaded machine can only add to it.
    assert time.monotonic() - started >= 1.0
    rt.send(other_id, "ping")
    rt.send(other_id, "quit")
    assert other.wait() == "finished" and other.messages == ["other", "ping"]


# --- through a real server --------------------------------------------------------------------

RSS_SLACK_MIB = 64  # allocator and Python noise beyond the instances' own memory


def test_bombs_leave_the_server_within_bounds(tmp_path):
    """The table bomb and the memory bombs through `pie serve` (memory_limit_mb = 64, one
    memory per instance): the control process's peak resident memory (VmHWM) grows by at
    most memory_limit_mb plus RSS_SLACK_MIB — before the fix it grew by ~381 MB for the
    table and ~800 MB for the four-memory bomb, now refused at instantiation — and a
    bystander still runs."""
    server = Server(tmp_path)
    try:
        def peak_mib() -> float:
            with open(f"/proc/{server.process.pid}/status") as status:
                return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:")) / 1024

        assert run_inferlet(server, "hello", ["warm"], ["quit"]).reason == "finished"
        before = peak_mib()
        table = run_inferlet(server, component(TABLE_BOMB, tmp_path), [])
        assert "runtime.max_table_elements" in table.reason
        memories = run_inferlet(server, component(MEMORY_BOMB, tmp_path), [])
        assert "runtime.max_memories = 1" in memories.reason, memories.reason
        memory = run_inferlet(server, component(ONE_MEMORY_BOMB, tmp_path), [])
        assert memory.reason.startswith("trap:") and "runtime.memory_limit_mb = 64" in memory.reason
        grown = peak_mib() - before
        assert grown <= 64 + RSS_SLACK_MIB, f"peak RSS grew by {grown:.0f} MiB"
        bystander = run_inferlet(server, "hello", ["still here"], ["quit"])
        assert bystander.messages == ["still here"] and bystander.reason == "finished"
    finally:
        server.stop()
