"""The application layer: launches inferlet instances, one thread each, inside wasmtime.

The threads are started ahead, with the runtime (pie/runtime/instance_threads.py).

An instance runs its component's `run` export on its own thread; host calls block that
thread only (wasm execution and blocking waits release the GIL), so hundreds of inferlets
interleave while the scheduler batches their calls. Limits of one instance: wasmtime store
limits (runtime.memory_limit_mb on each linear memory, runtime.max_memories of them — 1 by
default, so the cap is on all its memory — and runtime.max_tables, max_table_elements,
max_wasm_instances), a CPU slice (runtime.cpu_slice_ms: guest code between two host calls),
and total CPU and wall-clock budgets (quota.instance.cpu_s / wall_s, checked in guest code
through the epoch-deadline callback of pie/runtime/limits.py); plus a maximum number of
live instances. A limit ends only its instance, with a reason naming the config key.
However an instance ends — normal exit, error, trap or terminate — its session releases
every page, embed, queue, owned export and subscription it held.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from wasmtime import Config, Engine, Store, Trap, WasmtimeError

from pie import protocol as P
from pie.config import PieConfig
from pie.control.controller import Controller, InstanceSession
from pie.control.errors import HostError
from pie.control.messaging import InboxFull
from pie.control.quotas import ANONYMOUS
from pie.control.replica import Replica
from pie.runtime import wasmtime_compat
from pie.runtime.bindings import build_linker
from pie.runtime.instance_threads import InstanceThreads
from pie.runtime.host import Budgets, HostState, LimitExceeded, Terminated
from pie.runtime.limits import DeadlineCallback
from pie.runtime.programs import InvalidProgram, ProgramStore

log = logging.getLogger("pie.runtime")

EPOCH_TICK_S = 0.01
WALL_CHECK_S = 0.25  # how often the epoch thread looks for instances past quota.instance.wall_s
# (instance_id, "message" | "terminated", text or end reason, usage at the end: host calls,
# forward calls/tokens, peak pages; see InstanceSession.usage). For a message the sink may
# return an Event the instance must wait for before it sends again (backpressure).
EventSink = Callable[[str, str, str, "dict[str, int] | None"], "threading.Event | None"]
# (instance_id, level, line) of an instance launched with its log forwarded; may return an
# Event to wait for, like EventSink.
LogSink = Callable[[str, str, str], "threading.Event | None"]

# What a caller (pie/server) catches, each for one answer: no exception base class stands
# for any of them there (a KeyError or a torch RuntimeError from a bug is no refusal).
__all__ = ["Runtime", "InstanceInfo", "UnknownProgram", "UnknownInstance", "LaunchRefused",
           "InvalidProgram", "InboxFull", "start_runtime"]


class UnknownProgram(LookupError):
    """Launch of a hash or built-in name the program store does not hold."""


class UnknownInstance(LookupError):
    """An instance id that is not live."""


class LaunchRefused(RuntimeError):
    """The runtime cannot take another instance now (the message says why)."""


@dataclass
class InstanceInfo:
    id: str
    program: str
    name: str | None
    arguments: list[str]
    started_at: float
    user: str
    state: str = "running"


@dataclass(eq=False)
class Instance:
    info: InstanceInfo
    session: InstanceSession
    host: HostState
    on_event: EventSink
    order: int = 0  # launch order (control.kv_pressure = terminate-newest ends the newest first)
    ended: threading.Event = field(default_factory=threading.Event)  # set once it is torn down
    end_reason: str | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)


class Runtime:
    def __init__(self, config: PieConfig, controller: Controller):
        self.config = config
        self.controller = controller
        wasmtime_compat.install()
        wasmtime_compat.install_fast_calls()
        wasmtime_compat.install_gil_holding_calls()
        wasmtime_compat.install_fast_lists()
        # Work hops between many threads (scheduler → instance → scheduler) every token; a
        # 0.5 ms GIL switch interval instead of 5 ms cuts those hand-offs (measured: -15% time
        # per token with 8 concurrent decoders).
        sys.setswitchinterval(0.0005)
        engine_config = Config()
        engine_config.epoch_interruption = True
        self.engine = Engine(engine_config)
        self.programs = ProgramStore(self.engine, config.paths.cache)
        self.instances: dict[str, Instance] = {}
        self.by_store: dict[int, HostState] = {}  # store context address -> its instance
        self.linker = build_linker(self.engine, controller, self._host_state)
        self.host_calls: dict[str, Counter[str]] = {}  # program name or hash -> calls by function
        self.ended: Counter[str] = Counter()  # instances ended, by outcome (`outcome`)
        self.launches = itertools.count(1)
        if config.control.kv_pressure == "terminate-newest":
            for replica in controller.replicas:
                replica.resources.evict = self._evict_newer
        self.lock = threading.Lock()
        self.running = True
        self.accepting = True  # False once the server drains: launches are refused
        # Set while an instance is live (or to stop the ticker): with none, the epoch has no
        # guest code to interrupt, and an idle server woke 100 times a second for nothing.
        self.live = threading.Event()
        self.ticker = threading.Thread(target=self._tick, name="pie-epoch", daemon=True)
        self.ticker.start()
        self.threads = InstanceThreads(config.runtime.idle_threads)

    def _host_state(self, store: object) -> HostState:
        """The instance a host call belongs to, from the store it runs in."""
        return self.by_store[store_key(store)]

    def _tick(self) -> None:
        """Advance the engine's epoch (guest code's deadlines) and, every WALL_CHECK_S, end
        instances past their wall-clock budget: one blocked in a wait makes no host call
        that could notice, so it is terminated from here (its wait wakes on `cancelled`).
        It waits while no instance is live: a store's deadline counts from the epoch when it
        is set, so a paused epoch delays nobody."""
        ticks_per_check = max(1, round(WALL_CHECK_S / EPOCH_TICK_S))
        for tick in itertools.count(1):
            self.live.wait()
            if not self.running:
                break
            time.sleep(EPOCH_TICK_S)
            self.engine.increment_epoch()
            if tick % ticks_per_check == 0:
                now = time.monotonic()
                with self.lock:
                    expired = [i for i in self.instances.values()
                               if i.end_reason is None and i.host.wall_expired(now)]
                for instance in expired:
                    with instance.lock:
                        instance.end_reason = instance.end_reason or instance.host.wall_reason()
                    instance.host.cancelled.set()

    # --- the server's interface -------------------------------------------------------------

    def launch(self, program: str, arguments: list[str], on_event: EventSink,
               user: str = ANONYMOUS, on_log: LogSink | None = None) -> InstanceInfo:
        """Start an instance charged to `user` (quota.user.*). Its log lines always go to the
        server log (logger `pie.inferlet`), and to `on_log` when given."""
        try:
            digest = self.programs.resolve(program, user)
        except KeyError:
            raise UnknownProgram(f"no program {program!r} (neither a built-in name nor the hash "
                                 f"of a program you uploaded or one uploaded public)") from None
        instance_id = uuid.uuid4().hex
        name = next((n for n, h in self.programs.builtins.items() if h == digest), None)
        info = InstanceInfo(instance_id, digest, name, list(arguments), time.time(), user)
        with self.lock:
            if not self.accepting:
                raise LaunchRefused("the server is shutting down")
            if len(self.instances) >= self.config.runtime.max_instances:
                raise LaunchRefused(f"{len(self.instances)} instances are live, the limit is "
                                    f"runtime.max_instances = {self.config.runtime.max_instances}")
            try:
                session = self.controller.session(instance_id, list(arguments), user, digest)
            except HostError as e:  # over quota.user.instances, or no replica serving
                raise LaunchRefused(e.message) from None
            host = HostState(session, lambda message: on_event(instance_id, "message", message, None),
                             self._budgets(user),
                             None if on_log is None else lambda level, line: on_log(instance_id, level, line))
            instance = self.instances[instance_id] = Instance(info, session, host, on_event,
                                                              next(self.launches))
            self.live.set()
        self.threads.run(lambda: self._run(instance, digest), f"inferlet-{instance_id[:8]}")
        return info

    def send(self, instance_id: str, message: str) -> None:
        """Raises InboxFull when the instance has too many unread messages, UnknownInstance
        when it is not live."""
        self._get(instance_id).session.inbox.put(message)

    def terminate(self, instance_id: str, reason: str = "terminated by client") -> None:
        instance = self._get(instance_id)
        with instance.lock:
            instance.end_reason = instance.end_reason or reason
        instance.host.cancelled.set()

    def terminate_all(self, reason: str, timeout_s: float = 10.0, replica: Replica | None = None,
                      then: Callable[[], None] | None = None) -> int:
        """End every instance (on `replica` only, when given) with `reason` and wait for their
        teardown; returns how many. `then` runs once every reason is set and before any
        instance is woken: a lost replica fails its calls there, so an inferlet that sees its
        call fail still ends with `reason`, not with the failed call's message."""
        with self.lock:
            instances = [i for i in self.instances.values() if replica in (None, i.session.replica)]
        for instance in instances:
            with instance.lock:
                instance.end_reason = instance.end_reason or reason
        if then is not None:
            then()
        for instance in instances:
            instance.host.cancelled.set()
        for instance in instances:
            instance.ended.wait(timeout_s)
        return len(instances)

    def stop_launches(self) -> None:
        """Refuse new launches from now on; running instances go on (the server drains)."""
        with self.lock:
            self.accepting = False

    def live_count(self) -> int:
        with self.lock:
            return len(self.instances)

    def _evict_newer(self, requester: str, shortfall: int, pool: str) -> None:
        """The paper's FCFS policy: end instances launched after `requester`, newest first,
        until they hold `shortfall` of `pool` ("kv pages" or "embeds"); runs on the
        requester's thread, which then waits for their teardown to refill the pool."""
        with self.lock:
            me = self.instances.get(requester)
            # Only instances on the requester's replica hold pages of its pool.
            newer = sorted((i for i in self.instances.values()
                            if me is not None and i.order > me.order and i.end_reason is None
                            and i.session.replica is me.session.replica),
                           key=lambda i: -i.order)
        held_by = {"kv pages": lambda r: r.pages, "embeds": lambda r: r.embeds}[pool]
        for victim in newer:
            if shortfall <= 0:
                break
            if held := len(held_by(victim.session.resources).mapping):
                self.terminate(victim.info.id, f"error: terminated to free {pool} for an older instance "
                                               f"(control.kv_pressure = terminate-newest)")
                shortfall -= held

    def replica_health(self) -> list[dict]:
        """Each backend replica: ok, or failed with why (being restarted, or given up)."""
        return [{"replica": r.index, "status": "ok"} if r.serving else
                {"replica": r.index, "status": "failed", "reason": r.failure}
                for r in self.controller.replicas]

    def list_instances(self) -> list[InstanceInfo]:
        with self.lock:
            return [i.info for i in self.instances.values()]

    def stats(self, user: str | None = None) -> dict:
        """Live instances, host calls per program, and the control layer's statistics: of
        every user (user None: an admin, or a server without tokens), or of `user` only —
        its instances, and programs it may launch, so no other user's program hash shows."""
        with self.lock:
            calls = {program: dict(c) for program, c in self.host_calls.items()
                     if user is None or program in self.programs.builtins
                     or self.programs.visible(program, user)}
            live = sum(1 for i in self.instances.values() if user is None or i.info.user == user)
        ended = {"ended": dict(self.ended)} if user is None else {}
        return {"instances": live, **ended, "host_calls": calls, **self.controller.stats(user)}

    def shutdown(self, timeout_s: float = 5.0) -> None:
        with self.lock:
            self.running = self.accepting = False
            self.live.set()  # the ticker sees `running` and ends
            instances = list(self.instances.values())
        for instance in instances:
            self.terminate(instance.info.id, "server shutting down")
        for instance in instances:
            instance.ended.wait(timeout_s)
        self.threads.close()
        self.controller.shutdown()
        self.linker.close()  # now, not at interpreter exit when wasmtime's FFI is gone

    def _get(self, instance_id: str) -> Instance:
        with self.lock:
            instance = self.instances.get(instance_id)
        if instance is None:
            raise UnknownInstance(f"no live instance {instance_id!r}")
        return instance

    # --- one instance's thread --------------------------------------------------------------

    def _budgets(self, user: str) -> Budgets:
        """The CPU slice and the user's instance budgets (quota.users overrides apply)."""
        quota, _ = self.config.quota.for_user(user)
        return Budgets(cpu_s=quota.cpu_s, wall_s=quota.wall_s,
                       slice_s=self.config.runtime.cpu_slice_ms / 1e3, tick_s=EPOCH_TICK_S,
                       handles=self.config.runtime.max_handles)

    def _store(self, host: HostState) -> Store:
        """A store for one instance, with wasmtime's store limits: memory_limit_mb on each
        linear memory, and counts of memories, tables and core instances. An instance thus
        holds at most max_memories × memory_limit_mb of linear memory — with the default
        max_memories = 1, memory_limit_mb in all (the Rust and componentize-py toolchains
        emit one memory). Counts and sizes at instantiation past a limit fail instantiation
        (the reason names the key); a `memory.grow` past memory_limit_mb or a `table.grow`
        past max_table_elements returns -1 to the guest (wasm has no other answer; a guest
        that cannot go on traps, and its reason names the limits)."""
        limits = self.config.runtime
        store = Store(self.engine)
        store.set_limits(memory_size=limits.memory_limit_mb * 2**20,
                         table_elements=limits.max_table_elements, tables=limits.max_tables,
                         memories=limits.max_memories, instances=limits.max_wasm_instances)
        host.store = store
        host.deadline = DeadlineCallback(store, host.on_deadline, host.deadline_ticks)
        store.set_epoch_deadline(host.deadline_ticks())
        self.by_store[store_key(store)] = host
        return store

    def _run(self, instance: Instance, digest: str) -> None:
        reason = "finished"
        host = instance.host
        host.start()
        try:
            component = self.programs.load(digest)  # here: a first load may take a while
            store = self._store(host)
            wasm = self.linker.instantiate(store, component)
            run = wasm.get_func(store, "run")
            if run is None:
                raise InvalidProgram("the component exports no `run` function")
            result = run(store)
            run.post_return(store)
            if result is not None:
                reason = f"error: {result}"
        except Terminated:
            reason = "terminated"
        except LimitExceeded as e:
            reason = host.end_reason or f"error: {e}"
        except (Trap, WasmtimeError) as e:
            # A limit that stopped guest code (the deadline callback) said why.
            reason = host.end_reason or _failure_summary(str(e), self.config, host.panic)
        except InvalidProgram as e:
            reason = f"error: {e}"
        except Exception as e:  # a host bug must not leak the instance's resources
            log.exception("instance %s failed in the host", instance.info.id)
            reason = f"error: host failure: {type(e).__name__}: {e}"
        finally:
            with instance.lock:
                reason = instance.end_reason or reason
            instance.session.close()
            if host.store is not None:
                self.by_store.pop(store_key(host.store), None)
                # Free its memories now, on this thread, rather than whenever the garbage
                # collector gets to the store.
                host.store.close()
                host.store = None
            with self.lock:
                self.instances.pop(instance.info.id, None)
                if not self.instances and self.running:
                    self.live.clear()
                program = instance.info.name or instance.info.program
                self.host_calls.setdefault(program, Counter()).update(instance.host.calls)
                self.ended[outcome(reason)] += 1
            instance.info.state = "terminated"
            usage = {**instance.session.usage(), "host_calls": sum(instance.host.calls.values())}
            try:
                instance.on_event(instance.info.id, "terminated", reason, usage)  # the client first
            finally:
                instance.ended.set()
            log.info("instance %s (%s, user %s) ended: %s", instance.info.id[:8],
                     instance.info.name or instance.info.program[:12], instance.info.user, reason)


def outcome(reason: str) -> str:
    """How an instance ended, from its end reason: finished, error (a limit, a failure, its
    own error), trap, or terminated (by its client, the server, KV pressure)."""
    for kind in ("finished", "error", "trap", "terminated"):
        if reason.startswith(kind):
            return kind
    return "terminated"  # "server shutting down", a slow client's end, ...


def store_key(store: object) -> int:
    """The address of a store's context: the same for the Store and for the StoreContext
    wasmtime-py hands to host functions called from it."""
    return ctypes.cast(store._context(), ctypes.c_void_p).value  # type: ignore[attr-defined]


# wasmtime's messages for a store limit hit at instantiation -> the config key it names.
_STORE_LIMIT_MESSAGES = (
    ("instance count too high", "max_wasm_instances", "core instances"),
    ("table count too high", "max_tables", "tables"),
    ("memory count too high", "max_memories", "linear memories"),
    ("elements exceeds table limits", "max_table_elements", "entries in a table"),
    ("exceeds memory limits", "memory_limit_mb", "MiB of linear memory"),  # in one memory
)


def _failure_summary(text: str, config: PieConfig, panic: str | None = None) -> str:
    """One line for the client out of wasmtime's multi-line error (backtrace elided); a
    store limit or a likely cause is named by its config key; a trap after the SDK's panic
    hook reported a panic (`panic`) is that panic."""
    cause = text.split("Caused by:")[-1].strip().splitlines()
    line = cause[0].strip() if cause else text.strip()
    limits = config.runtime
    for message, key, what in _STORE_LIMIT_MESSAGES:
        if message in text:
            return f"error: the component needs more {what} than runtime.{key} = {getattr(limits, key)}"
    if "wasm trap: interrupt" in line:
        return (f"trap: CPU limit — ran longer than runtime.cpu_slice_ms = "
                f"{limits.cpu_slice_ms} ms without a host call")
    if "Terminated" in text:
        return "terminated"
    if "call stack exhausted" in line:
        return "trap: stack overflow — wasm's call stack is exhausted (unbounded or too deep recursion)"
    if "out of bounds memory access" in line:  # safe Rust has no other way to get here
        return ("trap: out of bounds memory access — in a Rust inferlet, a stack overflow (its stack, "
                "1 MiB at the start of linear memory, ran past its start: unbounded or too deep "
                "recursion, or large local arrays)")
    if "unreachable" in line and panic is not None and panic.startswith("out of memory: "):
        return f"trap: {panic} (runtime.memory_limit_mb = {limits.memory_limit_mb})"
    if "unreachable" in line and panic is not None:
        return f"trap: {panic}"
    if "unreachable" in line:  # no panic or allocation failure reported first (the SDKs report both)
        return (f"trap: {line.removeprefix('wasm trap: ')} (an abort that reported no panic or "
                f"allocation failure: std::process::abort or `unreachable` in the inferlet; in a "
                f"component not built with Pie's SDKs also a panic, an allocation refused under "
                f"runtime.memory_limit_mb = {limits.memory_limit_mb} or a table growth past "
                f"runtime.max_table_elements = {limits.max_table_elements})")
    if line.startswith("wasm trap:"):
        return f"trap: {line.removeprefix('wasm trap: ')}"
    return f"error: {line}"


def start_runtime(config: PieConfig, endpoints: list[str], handshake: P.HandshakeReply,
                  builtins: dict[str, Path] | None = None, secret: bytes | None = None) -> Runtime:
    """The control layer and the runtime over the backends at `endpoints` (replicas of one
    model, `handshake` their common reply; `secret` for tcp ones), with built-in programs
    loaded."""
    controller = Controller(config, endpoints, handshake, secret)
    runtime = Runtime(config, controller)
    for name, path in (builtins or {}).items():
        runtime.programs.add_builtin(name, path)
    return runtime
