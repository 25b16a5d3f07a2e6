"""The host side of the WIT world `pie:inferlet/inferlet` (sdk/wit), for one instance.

Each WIT function becomes a Python function on one linker shared by all instances; a call
finds its instance's `HostState` (and through it the `InstanceSession` of pie/control) from
the store it runs in. Wasm resources (queues, futures, pollables,
subscriptions) live in a per-instance table keyed by the rep we hand to wasmtime.
Conventions of wasmtime-py 50 that this file relies on:
- a `borrow<T>` argument arrives as a ResourceAny; `.to_host(store)` must be called on it
  exactly once (it also ends the borrow);
- `result<T, error>` is lowered untagged when T is not a record: return the value or an
  error `Record`; with a record T (and inside `option`) a `Variant("ok"/"err", ...)`.
Every call checks whether the instance is being terminated or is past a budget, and
restarts its CPU slice.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

from wasmtime import Engine, Store
from wasmtime.component import Linker, Record, ResourceAny, ResourceHost, ResourceType, Variant

from pie.control.controller import Controller, InstanceSession
from pie.control.errors import ErrorKind, HostError
from pie.control.future import HostFuture, wait_any

log = logging.getLogger("pie.inferlet")
PACKAGE = "pie:inferlet/{}@0.1.0"


class Kind(IntEnum):
    QUEUE = 1
    POLLABLE = 2
    FUTURE_UNIT = 3
    FUTURE_STRING = 4
    SUBSCRIPTION = 5
    FUTURE_RESPONSE = 6
    FUTURE_DIST = 7
    FUTURE_TOKEN = 8
    MATCHER = 9


class LimitExceeded(Exception):
    """Raised inside a host call to end an instance that broke a limit its API call cannot
    report as an error (a message too large to deliver); the message is the reason."""


class Terminated(Exception):
    """Raised inside a host call to unwind an instance that is being terminated."""


def error_record(error: HostError) -> Record:
    record = Record()
    record.kind = str(error.kind)
    record.message = error.message
    return record


def record(**fields: Any) -> Record:
    out = Record()
    for name, value in fields.items():
        setattr(out, name.replace("_", "-"), value)
    return out


@dataclass(frozen=True)
class Budgets:
    """What one instance may spend: times in seconds (0 = no budget), and host objects.

    `cpu_s` (quota.instance.cpu_s) is CPU time of the instance's own thread — guest code and
    the host work its calls do there — in total; `wall_s` (quota.instance.wall_s) is time
    since launch; `slice_s` (runtime.cpu_slice_ms) the longest stretch of guest code between
    two host calls. Wasm code is interrupted only at epoch deadlines, so `tick_s` (the
    engine's epoch period) and `check_s` (how often a computing guest is checked) bound how
    far past a budget it can get."""

    cpu_s: float = 0.0
    wall_s: float = 0.0
    slice_s: float = 5.0
    tick_s: float = 0.01
    check_s: float = 0.1
    handles: int = 65536  # runtime.max_handles: host objects held at once


class HostState:
    """One instance's wasm resources, its link to the control layer, and its budgets.

    Budgets are enforced at two points, both on the instance's thread: at every host call
    (`check`, from the `call` wrapper), and, for guest code that makes none, at epoch
    deadlines (`on_deadline`, wasmtime's deadline callback; `deadline_ticks` arms the next
    one). A wait blocked in the host is ended from outside through `cancelled` (the runtime
    terminates an instance whose wall budget runs out)."""

    def __init__(self, session: InstanceSession, send: Callable[[str], threading.Event | None],
                 budgets: Budgets):
        self.session = session
        self.send_message = send
        self.budgets = budgets
        self.objects: dict[int, tuple[Kind, Any]] = {}
        self.next_rep = 1
        self.cancelled = threading.Event()
        self.store: Store | None = None
        self.calls: Counter[str] = Counter()  # host function name -> calls (benchmarks)
        self.watched: dict[int, tuple[int, HostFuture]] = {}  # pollable rep -> (key, future)
        self.launched = time.monotonic()  # the wall budget counts from here
        self.cpu_start: float | None = None  # thread_time() when the thread began (start())
        self.resumed = self.launched  # when guest code last got control back (CPU slice)
        self.end_reason: str | None = None  # why a limit ended the instance, once one did
        self.deadline: Any = None  # the store's DeadlineCallback, kept alive with it

    # --- budgets ------------------------------------------------------------------------------

    def start(self) -> None:
        """Called first thing on the instance's own thread: its CPU time counts from here."""
        self.cpu_start = time.thread_time()
        self.resumed = time.monotonic()

    def cpu_used(self) -> float:
        """CPU seconds of this instance's thread; only meaningful on that thread."""
        return 0.0 if self.cpu_start is None else time.thread_time() - self.cpu_start

    def wall_expired(self, now: float) -> bool:
        return bool(self.budgets.wall_s) and now - self.launched >= self.budgets.wall_s

    def wall_reason(self) -> str:
        return (f"error: wall-clock budget exhausted: {self.budgets.wall_s:g} s since launch "
                f"(quota.instance.wall_s)")

    def over_budget(self) -> str | None:
        """The reason to end the instance now, if a limit says so (on its own thread)."""
        if self.budgets.cpu_s and self.cpu_used() >= self.budgets.cpu_s:
            return (f"error: CPU budget exhausted: {self.budgets.cpu_s:g} s of CPU time "
                    f"(quota.instance.cpu_s)")
        if self.wall_expired(time.monotonic()):
            return self.wall_reason()
        return None

    def check(self) -> None:
        """At every host call: unwind a terminated instance, end one past a limit."""
        if self.cancelled.is_set():
            raise Terminated("instance terminated")
        if (reason := self.over_budget()) is not None:
            self.end_reason = reason
            raise LimitExceeded(reason.removeprefix("error: "))

    def on_deadline(self) -> str | None:
        """wasmtime's epoch-deadline callback, in the middle of guest code: None lets it go
        on (for `deadline_ticks()` more ticks), a string traps it with that reason."""
        reason = self.over_budget()
        if reason is None and self.cancelled.is_set():
            reason = "terminated"
        if reason is None and time.monotonic() - self.resumed >= self.budgets.slice_s:
            reason = (f"trap: CPU limit — ran longer than runtime.cpu_slice_ms = "
                      f"{round(self.budgets.slice_s * 1e3)} ms without a host call")
        if reason is not None:
            self.end_reason = self.end_reason or reason
        return reason

    def deadline_ticks(self) -> int:
        """Epoch ticks until guest code is next checked: the check period, or sooner when the
        CPU slice or CPU budget would run out first (CPU time on this thread cannot advance
        faster than the clock, so a deadline at the remaining CPU budget is never late)."""
        b = self.budgets
        now = time.monotonic()
        left = min(b.check_s, b.slice_s - (now - self.resumed))
        if b.cpu_s:
            left = min(left, b.cpu_s - self.cpu_used())
        return max(1, math.ceil(left / b.tick_s))

    def own(self, kind: Kind, obj: Any) -> ResourceHost:
        """A new guest handle for `obj`. Each one is host memory until the guest drops it, so
        an instance that holds runtime.max_handles is ended rather than let grow."""
        if len(self.objects) >= self.budgets.handles:
            raise LimitExceeded(f"the instance holds {len(self.objects)} handles (futures, pollables, "
                                f"...) it never dropped: runtime.max_handles = {self.budgets.handles}")
        rep, self.next_rep = self.next_rep, self.next_rep + 1
        self.objects[rep] = (kind, obj)
        return ResourceHost.own(rep, kind)

    def get(self, store: Any, handle: Any, kind: Kind) -> Any:
        rep = handle.to_host(store).rep if isinstance(handle, ResourceAny) else handle
        held = self.objects.get(rep)
        if held is None or held[0] != kind:
            raise Terminated(f"unknown {kind.name.lower()} handle {rep}")  # wasmtime prevents this
        return held[1]

    def drop(self, store: Any, rep: int) -> None:
        kind, obj = self.objects.pop(rep, (None, None))
        self.watched.pop(rep, None)
        if kind == Kind.SUBSCRIPTION:  # dropping a subscription unsubscribes (the WIT)
            self.session.unsubscribe(obj)

    def wait_for(self, event: threading.Event) -> None:
        """Block until `event` is set, or unwind if the instance is terminated meanwhile."""
        while not event.wait(0.05):
            if self.cancelled.is_set():
                raise Terminated("instance terminated")

    def pace(self, rate: str) -> None:
        """Wait out the instance's (and its user's) rate quota before a message or HTTP call."""
        delay = self.session.wait_s(rate)
        if delay > 0 and self.cancelled.wait(delay):
            raise Terminated("instance terminated")

    def watch(self, store: Any, pollable: Any, key: int) -> None:
        rep = pollable.to_host(store).rep
        self.watched[rep] = (key, self.get(store, rep, Kind.POLLABLE))

    def wait(self) -> list[int]:
        """Block until a watched pollable is ready; unwatch the ready ones, return their keys."""
        if not self.watched:
            return []
        reps = list(self.watched)
        ready = wait_any([self.watched[r][1] for r in reps], self.cancelled)
        if self.cancelled.is_set():
            raise Terminated("instance terminated")
        return sorted(self.watched.pop(reps[i])[0] for i in ready)


def build_linker(engine: Engine, controller: Controller, lookup: Callable[[Any], HostState]) -> Linker:
    """One linker for every instance: each host function finds its instance through the store."""
    linker = Linker(engine)
    tok = controller.tokenizer

    def call(func: Callable[..., Any], fallible: bool = True) -> Callable[..., Any]:
        """Wrap a host function: termination and budget checks (`HostState.check`), HostError
        → error record, and the restart of the CPU slice when guest code resumes."""

        def wrapper(st: HostState, store: Any, *args: Any) -> Any:
            st.check()
            try:
                return func(st, store, *args)
            except HostError as e:
                if not fallible:
                    raise
                return error_record(e)
            finally:
                st.resumed = time.monotonic()

        return wrapper

    def counted(interface: Any) -> Any:
        """Make `interface.add_func` count each function's calls in `st.calls`."""
        add_func = interface.add_func

        def add_counted(name: str, func: Callable[..., Any]) -> None:
            def run(store: Any, *args: Any) -> Any:
                st = lookup(store)
                st.calls[name] += 1
                return func(st, store, *args)
            add_func(name, run)

        interface.add_func = add_counted
        return interface

    def drop(store: Any, rep: int) -> None:
        try:
            lookup(store).drop(store, rep)
        except KeyError:
            pass  # the instance is gone and its whole table with it

    def queue(st: HostState, store: Any, q: Any) -> Any:
        return st.get(store, q, Kind.QUEUE)

    def future_getter(kind: Kind, convert: Callable[[HostFuture], Any], pending: Any = None):
        def get(st: HostState, store: Any, f: Any) -> Any:
            future = st.get(store, f, kind)
            return convert(future) if future.done() else pending
        return get

    def subscribe_to(kind: Kind):
        return lambda st, store, f: st.own(Kind.POLLABLE, st.get(store, f, kind))

    def tagged(future: HostFuture, ok: Callable[[Any], Any]) -> Variant:
        try:
            return Variant("ok", ok(future.result()))
        except HostError as e:
            return Variant("err", error_record(e))

    def untagged(future: HostFuture) -> Any:
        try:
            return future.result()
        except HostError as e:
            return error_record(e)

    with linker.root() as root:
        with root.add_instance(PACKAGE.format("types")) as types:
            counted(types)
            types.add_resource("queue", ResourceType.host(Kind.QUEUE), drop)

        with root.add_instance(PACKAGE.format("futures")) as futures:
            counted(futures)
            for name, kind in (("pollable", Kind.POLLABLE), ("future-unit", Kind.FUTURE_UNIT),
                               ("future-string", Kind.FUTURE_STRING)):
                futures.add_resource(name, ResourceType.host(kind), drop)
            futures.add_func("[method]pollable.ready",
                             call(lambda st, store, p: st.get(store, p, Kind.POLLABLE).done(), False))

            futures.add_func("[method]pollable.watch", call(lambda st, store, p, key: st.watch(store, p, key), False))
            futures.add_func("wait", call(lambda st, store: st.wait(), False))
            futures.add_func("[method]future-unit.subscribe", call(subscribe_to(Kind.FUTURE_UNIT), False))

            def unit_result(future: HostFuture) -> Variant:
                try:
                    future.result()
                    return Variant("some", None)
                except HostError as e:
                    return Variant("some", error_record(e))

            futures.add_func("[method]future-unit.get",
                             call(future_getter(Kind.FUTURE_UNIT, unit_result, Variant("none")), False))
            futures.add_func("[method]future-string.subscribe", call(subscribe_to(Kind.FUTURE_STRING), False))
            futures.add_func("[method]future-string.get",
                             call(future_getter(Kind.FUTURE_STRING, lambda f: f.result()), False))

        with root.add_instance(PACKAGE.format("runtime")) as runtime:
            counted(runtime)
            runtime.add_func("get-arguments", call(lambda st, store: list(st.session.arguments), False))
            runtime.add_func("instance-id", call(lambda st, store: st.session.instance_id, False))
            runtime.add_func("version", call(lambda st, store: st.session.version(), False))

            def log_message(st: HostState, store: Any, level: str, message: str) -> None:
                log.log({"debug": 10, "info": 20, "warn": 30, "error": 40}.get(level, 20),
                        "[%s] %s", st.session.instance_id[:8], message)

            runtime.add_func("log", call(log_message, False))
            runtime.add_func("now", call(lambda st, store: st.session.now_ns(), False))
            runtime.add_func("random-bytes", call(lambda st, store, n: list(st.session.random_bytes(n))))
            runtime.add_func("available-models", call(lambda st, store: st.session.available_models(), False))
            runtime.add_func("available-traits", call(lambda st, store, m: st.session.available_traits(m)))
            runtime.add_func("create-queue",
                             call(lambda st, store, m: st.own(Kind.QUEUE, st.session.create_queue(m))))
            runtime.add_func("synchronize", call(
                lambda st, store, q: st.own(Kind.FUTURE_UNIT, st.session.synchronize(queue(st, store, q))), False))
            runtime.add_func("set-queue-priority", call(
                lambda st, store, q, p: st.session.set_queue_priority(queue(st, store, q), p), False))

        with root.add_instance(PACKAGE.format("messaging")) as messaging:
            counted(messaging)
            messaging.add_resource("subscription", ResourceType.host(Kind.SUBSCRIPTION), drop)
            max_bytes = controller.config.server.max_message_bytes

            def check_size(message: str) -> None:
                if (size := len(message.encode())) > max_bytes:
                    raise LimitExceeded(f"a message of {size} bytes exceeds server.max_message_bytes = {max_bytes}")

            def send(st: HostState, store: Any, message: str) -> None:
                check_size(message)
                st.pace("messages_per_s")
                room = st.send_message(message)
                if room is not None:  # nobody is attached and too many messages are held
                    st.wait_for(room)

            def broadcast(st: HostState, store: Any, topic: str, message: str) -> None:
                check_size(message)
                st.pace("messages_per_s")
                try:
                    st.session.broadcast(topic, message)
                except HostError as e:  # broadcast has no error result: the refusal ends the instance
                    raise LimitExceeded(f"broadcast refused: {e.kind}: {e.message}") from None

            messaging.add_func("send", call(send, False))
            messaging.add_func("receive",
                               call(lambda st, store: st.own(Kind.FUTURE_STRING, st.session.receive()), False))
            messaging.add_func("broadcast", call(broadcast, False))
            messaging.add_func("subscribe",
                               call(lambda st, store, t: st.own(Kind.SUBSCRIPTION, st.session.subscribe(t))))
            messaging.add_func("[method]subscription.next", call(
                lambda st, store, sub: st.own(Kind.FUTURE_STRING,
                                             st.get(store, sub, Kind.SUBSCRIPTION).next()), False))

        with root.add_instance(PACKAGE.format("kvs")) as kvs:
            counted(kvs)
            kvs.add_func("store-get", call(lambda st, store, k: st.session.store_get(k), False))
            kvs.add_func("store-set", call(lambda st, store, k, v: st.session.store_set(k, v)))
            kvs.add_func("store-delete", call(lambda st, store, k: st.session.store_delete(k), False))

        with root.add_instance(PACKAGE.format("http")) as http:
            counted(http)
            http.add_resource("future-response", ResourceType.host(Kind.FUTURE_RESPONSE), drop)

            def request(st: HostState, method: str, url: str, headers: Any, body: str | None = None) -> Any:
                st.pace("http_requests_per_s")
                return st.own(Kind.FUTURE_RESPONSE, st.session.http(method, url, list(headers), body))

            http.add_func("http-get", call(lambda st, store, url, headers: request(st, "GET", url, headers)))
            http.add_func("http-post", call(
                lambda st, store, url, headers, body: request(st, "POST", url, headers, body)))
            http.add_func("[method]future-response.subscribe",
                          call(subscribe_to(Kind.FUTURE_RESPONSE), False))
            http.add_func("[method]future-response.get", call(future_getter(
                Kind.FUTURE_RESPONSE,
                lambda f: tagged(f, lambda r: record(status=r[0], body=r[1]))), False))

        with root.add_instance(PACKAGE.format("allocate")) as allocate:
            counted(allocate)
            allocate.add_func("alloc-kvpage", call(lambda st, store, q, n: st.session.alloc_kvpage(queue(st, store, q), n)))
            allocate.add_func("dealloc-kvpage",
                              call(lambda st, store, q, pages: st.session.dealloc_kvpage(queue(st, store, q), pages)))
            allocate.add_func("alloc-emb", call(lambda st, store, q, n: st.session.alloc_emb(queue(st, store, q), n)))
            allocate.add_func("dealloc-emb",
                              call(lambda st, store, q, embeds: st.session.dealloc_emb(queue(st, store, q), embeds)))
            allocate.add_func("copy-kvpage", call(
                lambda st, store, q, src, dst, so, do, n: st.session.copy_kvpage(queue(st, store, q), src, dst, so, do, n)))
            allocate.add_func("export-kvpage", call(
                lambda st, store, pages, name, persistent: st.session.export_kvpage(pages, name, persistent)))
            allocate.add_func("import-kvpage", call(lambda st, store, name: st.session.import_kvpage(name)))
            allocate.add_func("unexport-kvpage", call(lambda st, store, name: st.session.unexport_kvpage(name)))
            allocate.add_func("kv-page-size", call(lambda st, store, q: (queue(st, store, q), st.session.page_size)[1], False))

        with root.add_instance(PACKAGE.format("forward")) as forward:
            counted(forward)
            def run_forward(st: HostState, store: Any, q: Any, p: Any) -> None:
                mask = getattr(p, "attention-mask")
                st.session.forward(queue(st, store, q), getattr(p, "input-kv-pages"),
                          getattr(p, "input-kv-last-page-len"), getattr(p, "input-embeds"),
                          getattr(p, "output-kv-pages"), getattr(p, "output-kv-offset"),
                          getattr(p, "output-embeds"), getattr(p, "output-token-indices"),
                          None if mask is None else bytes(mask))

            forward.add_func("forward", call(run_forward))

            def forward_with_adapter(st: HostState, store: Any, q: Any, adapter: str, p: Any) -> None:
                queue(st, store, q)
                raise HostError(ErrorKind.UNSUPPORTED,
                                f"adapter {adapter!r}: this model serves no LoRA adapters")

            forward.add_func("forward-with-adapter", call(forward_with_adapter))
            forward.add_func("mask-kvpage",
                             call(lambda st, store, q, page, mask: st.session.mask_kvpage(queue(st, store, q), page, mask)))

        with root.add_instance(PACKAGE.format("input-text")) as input_text:
            counted(input_text)
            input_text.add_func("embed-text", call(
                lambda st, store, q, tokens, positions, embeds: st.session.embed_text(queue(st, store, q), tokens, positions, embeds)))

        with root.add_instance(PACKAGE.format("input-image")) as input_image:
            counted(input_image)
            def no_images(st: HostState, store: Any, q: Any, *args: Any) -> Any:
                queue(st, store, q)
                raise HostError(ErrorKind.UNSUPPORTED, f"{st.session.c.hs.model_name} takes no image input")

            input_image.add_func("num-embs-needed", call(no_images))
            input_image.add_func("embed-image", call(no_images))

        with root.add_instance(PACKAGE.format("tokenize")) as tokenize:
            counted(tokenize)
            tokenize.add_func("tokenize", call(lambda st, store, q, text: (queue(st, store, q), tok.encode(text))[1], False))

            def detokenize(st: HostState, store: Any, q: Any, ids: list[int]) -> str:
                queue(st, store, q)
                if any(i >= st.session.c.hs.vocab_size for i in ids):
                    raise HostError(ErrorKind.INVALID_ARGUMENT, f"token id out of range [0, {st.session.c.hs.vocab_size})")
                return tok.decode(ids)

            tokenize.add_func("detokenize", call(detokenize))
            tokenize.add_func("get-vocabs", call(lambda st, store, q: (queue(st, store, q), [list(b) for b in tok.vocabs])[1], False))
            tokenize.add_func("get-eos-tokens", call(lambda st, store, q: (queue(st, store, q), tok.eos_token_ids)[1], False))

            def chat(st: HostState, store: Any, q: Any, messages: list[Any], add_generation_prompt: bool) -> str:
                queue(st, store, q)
                try:
                    return tok.apply_chat_template(
                        [{"role": m.role, "content": m.content} for m in messages], add_generation_prompt)
                except Exception as e:  # a template error is the caller's input, not a crash
                    raise HostError(ErrorKind.INVALID_ARGUMENT, f"chat template: {e}") from None

            tokenize.add_func("apply-chat-template", call(chat))

        with root.add_instance(PACKAGE.format("output-text")) as output_text:
            counted(output_text)
            output_text.add_resource("future-dist", ResourceType.host(Kind.FUTURE_DIST), drop)
            output_text.add_resource("future-token", ResourceType.host(Kind.FUTURE_TOKEN), drop)
            output_text.add_func("get-next-dist", call(lambda st, store, q, emb, k: st.own(
                Kind.FUTURE_DIST, st.session.get_next_dist(queue(st, store, q), emb, k))))

            def sample(st: HostState, store: Any, q: Any, emb: int, sampler: Any) -> Any:
                return st.own(Kind.FUTURE_TOKEN, st.session.sample(
                    queue(st, store, q), emb, sampler.temperature, getattr(sampler, "top-k"),
                    getattr(sampler, "top-p"), sampler.seed))

            output_text.add_func("sample", call(sample))
            output_text.add_func("[method]future-dist.subscribe", call(subscribe_to(Kind.FUTURE_DIST), False))
            output_text.add_func("[method]future-dist.get", call(future_getter(
                Kind.FUTURE_DIST,
                lambda f: tagged(f, lambda d: record(token_ids=d[0], probs=d[1]))), False))
            output_text.add_func("[method]future-token.subscribe", call(subscribe_to(Kind.FUTURE_TOKEN), False))
            output_text.add_func("[method]future-token.get",
                                 call(future_getter(Kind.FUTURE_TOKEN, untagged), False))

        with root.add_instance(PACKAGE.format("grammar")) as grammar:
            counted(grammar)
            grammar.add_resource("matcher", ResourceType.host(Kind.MATCHER), drop)

            def matcher(st: HostState, store: Any, m: Any) -> Any:
                return st.get(store, m, Kind.MATCHER)

            # A matcher keeps the queue it was compiled on: wasmtime-py 50 cannot take two
            # borrows in one host call ("deferred host scope has no call context").
            def compile_grammar(st: HostState, store: Any, q: Any, kind: str, source: str) -> Any:
                q = queue(st, store, q)
                return st.own(Kind.MATCHER, (q, st.session.compile_grammar(q, kind, source)))

            grammar.add_func("compile", call(compile_grammar))

            def constrained_sample(st: HostState, store: Any, m: Any, emb: int, sampler: Any) -> Any:
                q, grammar_matcher = matcher(st, store, m)
                return st.own(Kind.FUTURE_TOKEN, st.session.sample(
                    q, emb, sampler.temperature, getattr(sampler, "top-k"),
                    getattr(sampler, "top-p"), sampler.seed, grammar_matcher))

            grammar.add_func("[method]matcher.sample", call(constrained_sample))
            grammar.add_func("[method]matcher.accept",
                             call(lambda st, store, m, tokens: matcher(st, store, m)[1].accept(list(tokens))))
            grammar.add_func("[method]matcher.rollback",
                             call(lambda st, store, m, n: matcher(st, store, m)[1].rollback(n)))
            for name, method in (("allowed-tokens", "allowed_tokens"), ("forced-tokens", "forced_tokens"),
                                 ("is-accepting", "is_accepting"), ("is-stopped", "is_stopped")):
                grammar.add_func(f"[method]matcher.{name}", call(
                    lambda st, store, m, method=method: getattr(matcher(st, store, m)[1], method)(), False))
    return linker
