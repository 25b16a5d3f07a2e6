"""The batch scheduler: command queues in, batches to the backend out, results back.

Every batchable call is a `Command` (pie/control/command.py) on a `CommandQueue`; commands
of one queue run in order. One thread (`SchedulerChannel`, pie/control/scheduler_channel.py)
owns the backend socket and calls `dispatch` and `on_reply`; this class does no I/O of its
own. `dispatch` forms a batch of one call kind from the heads of all
queues (horizontal batching) plus, per queue, the following commands of the same kind that
do not conflict with the ones before them (vertical batching); higher-priority queues come
first and the batch is cut at the backend's token budget and the prefill budgets of
`BatchFormer` (pie/control/batch_former.py). *When* to dispatch, and which
kind, is the policy's (`pie/control/policies.py`: adaptive, eager, k, t). Fused passes
(`pie/control/passes.py`) ride the same queues; a host-side run's next step is put back at
the head of its queue by the reply that ends its last one. pie/control/batch_codec.py turns
a batch into its protocol message and a reply back into results. Markers (synchronize, deferred release) complete when they reach the head of their queue.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from pie import protocol as P
from pie.config import ControlConfig
from pie.control.batch_codec import (
    abandon,
    build_batch,
    complete,
    resolve_batch,
    settle_command,
)
from pie.control.batch_former import DECODE_TOKENS, BatchFormer
from pie.control.command import MARKER, Command, CommandQueue, reads_result
from pie.control.errors import ErrorKind, HostError
from pie.control.future import HostFuture
from pie.control.passes import Pass, Status, fail, settle, settle_step
from pie.control.policies import HEAVY, Head, Objective, ReadyView, policy_for
from pie.control.prefix_cache import PrefixCache
from pie.control.scheduler_channel import SchedulerChannel
from pie.control.scheduler_stats import Costs, SchedulerStats

log = logging.getLogger("pie.control")


class Scheduler:
    def __init__(self, endpoint: str, config: ControlConfig, max_batch_tokens: int,
                 prefix_cache: PrefixCache | None = None, secret: bytes | None = None,
                 prompt_hold: bool = False):
        self.config = config
        self.policy = policy_for(config)
        self.former = BatchFormer(config, max_batch_tokens, prompt_hold)
        # Copies cached prompt pages into the passes it sends and keeps the ones they fill
        # (control.prefix_cache; owned with the pools by the ResourceManager).
        self.prefix_cache = prefix_cache
        self.lock = threading.Lock()
        self.queues: list[CommandQueue] = []
        self.stats = SchedulerStats()
        self.in_flight: dict[int, list[Command]] = {}
        self.sent_at: dict[int, float] = {}
        # Requests whose runs the backend steps on its own (Passes.ahead): request id -> item
        # index -> the pass, at the step the backend computes next; in flight until the final
        # step. `interrupt`: an Interrupt is due (other work waits, or a run was cancelled);
        # `interrupted`: the requests one was sent for.
        self.ahead: dict[int, dict[int, Pass]] = {}
        self.interrupt = False
        self.interrupted: set[int] = set()
        self.last_forward_s = 0.05  # duration of the latest forward batch (seed: a guess)
        self.costs = Costs()  # what a token and a swapped page cost (the reclaimer's estimates)
        self.recent_forwards: dict[int, float] = {}  # id(queue) -> when its last forward left
        # instance id -> when it was launched, until it submits its first model call: a wave
        # of launches counts as stragglers, so their prefills share one batch (see _view)
        self.arrivals: dict[str, float] = {}
        self.backend_idle = True
        # (request ids still in flight, callback): teardown waiting for batches to settle
        self.settle_callbacks: list[tuple[set[int], Callable[[], Any]]] = []
        self.request_ids = itertools.count(1)
        self.failure: str | None = None
        # Its thread, the socket and the wake pipe; `secret`: the link's CURVE secret
        # (pie/transport.py), for a remote backend.
        self.channel = SchedulerChannel(self, endpoint, secret)

    # --- called from instance threads -----------------------------------------------------

    def arriving(self, instance_id: str) -> None:
        """An instance was launched: expect its first model call soon."""
        with self.lock:
            self.arrivals[instance_id] = time.monotonic()

    def create_queue(self, instance_id: str) -> CommandQueue:
        queue = CommandQueue(instance_id)
        with self.lock:
            self.queues.append(queue)
        return queue

    def submit(self, command: Command) -> HostFuture:
        with self.lock:
            failure = self.failure
            if failure is None and command.queue.closed:
                raise HostError(ErrorKind.INVALID_HANDLE, "the queue is closed")
            if failure is None:
                command.queue.pending.append(command)
                if command.kind in HEAVY and self.arrivals:
                    self.arrivals.pop(command.queue.instance_id, None)
        if failure is not None:  # outside the lock: a swap's on_done takes the pools' lock
            abandon(command, HostError(ErrorKind.INFERENCE_FAILED, failure))
            return command.future
        self.channel.wake()
        return command.future

    def close_instance(self, instance_id: str) -> None:
        """Drop an instance's queues; its pending calls fail (batches in flight finish)."""
        with self.lock:
            mine = [q for q in self.queues if q.instance_id == instance_id]
            self.queues = [q for q in self.queues if q.instance_id != instance_id]
            self.arrivals.pop(instance_id, None)
            for queue in mine:
                self.recent_forwards.pop(id(queue), None)
            # Its runs stepped ahead in the backend are of no use now: end those steps.
            ahead = any(p.queue.instance_id == instance_id for going in self.ahead.values() for p in going.values())
            self.interrupt = self.interrupt or ahead
        if ahead:
            self.channel.wake()
        for queue in mine:
            queue.closed = True
            for command in queue.pending:
                abandon(command, HostError(ErrorKind.INVALID_HANDLE, "instance terminated"))
            queue.pending.clear()

    def release_queue(self, queue: CommandQueue) -> None:
        """The guest dropped `queue`. It is no longer a straggler (one that ran the model
        lately is waited for, `_view`): a finished call's queue kept open made the next call's
        first decode step wait half a forward after its prefill (~0.25 s a call in the
        semantic-variables chain, benchmarks/semantic_variables.py). Its pending commands
        still run (the WIT); then it leaves `self.queues` (`_eligible_heads`)."""
        with self.lock:
            queue.released = True
            self.recent_forwards.pop(id(queue), None)

    def idle(self, instance_id: str) -> bool:
        """No call of the instance waits or is in flight: nothing the backend will run
        names its pages, so the reclaimer may move them."""
        with self.lock:
            if any(q.pending for q in self.queues if q.instance_id == instance_id):
                return False
            return not any(c.queue.instance_id == instance_id
                           for batch in self.in_flight.values() for c in batch)

    def snapshot_stats(self) -> dict[str, Any]:
        with self.lock:
            # "queued": calls waiting now, by kind (not yet sent to the backend).
            queued = Counter(str(c.kind) for q in self.queues for c in q.pending)
            return {**self.stats.as_dict(), "queued": dict(queued)}

    def stop(self) -> None:
        self.channel.stop()

    @property
    def disconnected(self) -> str | None:
        """Why the link to the backend dropped, until `recover` (None: it did not)."""
        return self.channel.disconnected

    def recover(self) -> None:
        """A new backend serves the endpoint: accept calls again, on a fresh socket (so
        nothing queued for the dead backend reaches the new one)."""
        with self.lock:
            self.failure = None
            self.backend_idle = True
        self.channel.renew()

    # --- called from the channel's thread (pie/control/scheduler_channel.py); fail_all also
    # by the replica when its backend is lost -----------------------------------------------

    def fail_all(self, reason: str) -> None:
        """Fail every waiting and in-flight call, and every later one (backend gone)."""
        with self.lock:
            self.failure = reason
            commands = [c for batch in self.in_flight.values() for c in batch]
            commands += [c for q in self.queues for c in q.pending]
            for q in self.queues:
                q.pending.clear()
            self.in_flight.clear()
            self.sent_at.clear()
            self.ahead.clear()
            self.interrupted.clear()
            callbacks = [callback for _, callback in self.settle_callbacks]
            self.settle_callbacks = []
        for command in commands:
            abandon(command, HostError(ErrorKind.INFERENCE_FAILED, reason))
        for callback in callbacks:
            callback()

    def dispatch(self, send: Callable[[bytes], None]) -> int | None:
        """Send every batch the policy allows now; return how long the loop may sleep (ms)."""
        while True:
            with self.lock:
                markers = self._pop_markers()
            # A deferred release takes the pools' lock: never under ours (the reclaimer holds
            # that lock and asks the scheduler whether an instance is idle).
            complete(markers)
            with self.lock:
                heads = self._eligible_heads()
                interrupt = self._interrupt_due(bool(heads))
            if interrupt:
                send(P.encode(next(self.request_ids), P.Interrupt()))
            with self.lock:
                if not heads:
                    return None
                kind, wait_ms = self.policy.choose(self._view(heads))
                if kind is None:
                    return wait_ms
                batch = self._form_batch(kind, single=self.policy.single)
                request_id = next(self.request_ids)
                if kind in HEAVY:
                    sent = time.monotonic()
                    for c in batch:
                        if reads_result(c) and not c.queue.released:
                            self.recent_forwards[id(c.queue)] = sent
                        else:
                            self.recent_forwards.pop(id(c.queue), None)
                self.in_flight[request_id] = batch
                ahead = self._ahead_grant(batch)
                self.backend_idle = False
                now = time.monotonic()
                self.sent_at[request_id] = now
                self.stats.batches[kind] += 1
                self.stats.calls[kind] += len(batch)
                self.stats.batch_sizes[len(batch)] += 1
                for command in batch:
                    waited = now - command.enqueued
                    self.stats.wait_s_total += waited
                    self.stats.wait_s_max = max(self.stats.wait_s_max, waited)
            if self.prefix_cache is not None:  # takes the pools' lock: not under ours
                if kind != P.Kind.PASS:
                    self.prefix_cache.overwritten(batch)
                elif (deferred := self.prefix_cache.prepare(batch)) and not self._hold_back(  # type: ignore[arg-type]
                        request_id, deferred, batch):
                    continue
            send(P.encode(request_id, build_batch(kind, batch, ahead)))

    def _ahead_grant(self, batch: list[Command]) -> int:
        """(Under the lock, the batch in flight.) How many steps its runs may take ahead in
        the backend: none while other work would interrupt them at once — calls that could
        go now, the rest of a prompt whose chunk this batch carries, an instance launched
        whose first call is due. Granted beside a chunk, the runs stepped once more without
        the prompt before its Interrupt landed: +130 / +440 ms mean time to first token at 8
        / 32 streamed clients (Zen 4: benchmarks/results/epyc-zen4/serving.json of commit a895fe9, one run)."""
        if not self.config.ahead_steps or self.arrivals or self._eligible_heads():
            return 0
        if any(getattr(c, "parent", None) is not None for c in batch):
            return 0
        return self.config.ahead_steps

    def _interrupt_due(self, waiting: bool) -> bool:
        """(Under the lock.) Whether to end the steps the backend takes on its own now: other
        calls wait for the next batch (`waiting`) or a run stepped ahead was cancelled, and
        no Interrupt was sent for those requests yet. Any frame ends them at the next step;
        their runs then head their queues and ride the next batch with the waiting calls."""
        due = (waiting or self.interrupt) and not self.interrupted.issuperset(self.ahead)
        self.interrupt = False
        if due:
            self.interrupted |= set(self.ahead)
            self.stats.interrupts += 1
        return due

    def _hold_back(self, request_id: int, deferred: list[Pass], batch: list[Command]) -> bool:
        """Put passes the prefix cache held back at the head of their queues again (a
        closed queue's fail); False where nothing of the batch is left to send."""
        with self.lock:
            for p in deferred:
                batch.remove(p)
            closed = self._requeue(deferred)
            self.stats.calls[P.Kind.PASS] -= len(deferred)
            if not batch:
                self.stats.batches[P.Kind.PASS] -= 1
                self.in_flight.pop(request_id, None)
                self.sent_at.pop(request_id, None)
                self.backend_idle = self._computing_nothing()  # nothing was sent
        fail(closed, HostError(ErrorKind.INVALID_HANDLE, "instance terminated"))
        return bool(batch)

    def _computing_nothing(self) -> bool:
        """(Under the lock.) No batch in flight but swaps: a swap's reply may be held by the
        backend until an emulated link has carried it (backend.swap_gbps) while it computes
        other batches, so a swap in flight does not keep it busy."""
        return all(batch[0].kind == P.Kind.SWAP_KVPAGE for batch in self.in_flight.values())

    def _busy_queues(self) -> set[int]:
        """id() of queues with a command in flight: their next command must wait for it."""
        return {id(c.queue) for batch in self.in_flight.values() for c in batch}

    def _pop_markers(self) -> list[tuple[Command, HostError | None]]:
        """(Under the lock.) Markers at the head of queues with nothing in flight, with the
        queue error each reports; `_complete` runs them once the lock is released."""
        busy = self._busy_queues()
        done = []
        for queue in self.queues:
            while queue.pending and queue.pending[0].kind == MARKER and id(queue) not in busy:
                marker = queue.pending.popleft()
                error = None
                if queue.error is not None and not marker.silent:
                    error, queue.error = queue.error, None
                done.append((marker, error))
        return done

    def _eligible_heads(self) -> list[Command]:
        """Head commands of queues with nothing in flight (a queue's calls run in order).
        Released queues with nothing left to run leave here."""
        busy = self._busy_queues()
        if done := {id(q) for q in self.queues if q.released and not q.pending and id(q) not in busy}:
            self.queues = [q for q in self.queues if id(q) not in done]
        return [q.pending[0] for q in self.queues
                if q.pending and q.pending[0].kind != MARKER and id(q) not in busy]

    def _view(self, heads: list[Command]) -> ReadyView:
        """What the policy decides on (under the lock)."""
        now = time.monotonic()
        oldest: dict[str, float] = {}
        count: Counter = Counter()
        ready: dict[str, set[int]] = {}
        for command in heads:
            count[command.kind] += 1
            oldest[command.kind] = min(oldest.get(command.kind, command.enqueued), command.enqueued)
            ready.setdefault(command.kind, set()).add(id(command.queue))
        window = 3 * self.last_forward_s
        recent = {q for q, t in self.recent_forwards.items() if now - t < window}
        if recent:
            recent &= {id(q) for q in self.queues if not q.closed}
        # Instances launched within the window that have not submitted a model call yet: in
        # a wave of 32 launches the first prefill went alone (186 ms) and the other 31
        # waited for it; gathered, they ride one batch as the direct driver's do.
        if self.arrivals:
            self.arrivals = {i: t for i, t in self.arrivals.items() if now - t < window}
        stragglers = frozenset(k for k in HEAVY if k in ready
                               and (self.arrivals or recent - ready[k]))
        heavy = [c for c in heads if c.kind in HEAVY]
        gathering = bool(self.arrivals) and bool(heavy) and all(c.tokens > DECODE_TOKENS for c in heavy)
        return ReadyView(dict(count), oldest, self.backend_idle, self.last_forward_s, now, stragglers,
                         gathering)

    def _form_batch(self, kind: str, single: bool = False) -> list[Command]:
        """The waiting commands of `kind` to send together (just the oldest one if
        `single`), popped from their queues: the idle queues whose head is of `kind`, in
        the policy's order, within the budgets of pie/control/batch_former.py."""
        busy = self._busy_queues()
        queues = [q for q in self.queues if q.pending and id(q) not in busy
                  and q.pending[0].kind == kind]
        latency_open = any(q.objective is Objective.LATENCY for q in self.queues)
        return self.former.form(queues, kind, single, latency_open, self._order(queues), time.monotonic())

    def _order(self, queues: list[CommandQueue]) -> dict[int, float]:
        """(Under the lock.) The policy's key of each queue (by id): its head, or its task
        group's oldest head, with the job's estimated work where the policy sizes jobs."""
        now = time.monotonic()
        heads: dict[int, Head] = {}
        groups: dict[tuple[str, str], list[float]] = {}  # group -> [oldest enqueued, estimate_s]
        for q in queues:
            head = q.pending[0]
            estimate = 0.0
            if self.policy.sizes_jobs:
                tokens = q.job_left or head.tokens
                if not q.job_left and self.prefix_cache is not None and isinstance(head, Pass):
                    tokens -= self.prefix_cache.cached_tokens(head)
                estimate = tokens * self.costs.token_s
            heads[id(q)] = Head(head.enqueued, estimate)
            if q.group is not None:
                g = groups.setdefault(q.group, [head.enqueued, 0.0])
                g[0], g[1] = min(g[0], head.enqueued), g[1] + estimate
        for q in queues:
            if q.group is not None:
                heads[id(q)] = Head(*groups[q.group])
        return {q: self.policy.key(head, now) for q, head in heads.items()}

    def on_reply(self, frame: bytes) -> list[threading.Event]:
        """Settle the batch the reply answers; return the events that wake the instances
        waiting for its passes' results, for the loop to set after the next dispatch."""
        request_id, kind, reply = P.decode_reply(frame)
        wakes: list[threading.Event] = []
        if kind is P.Kind.IDLE:
            with self.lock:
                self.backend_idle = self._computing_nothing()
            return wakes
        if kind is P.Kind.INTERRUPT:
            return wakes
        if kind is P.Kind.PASS_STEP:
            return self._stepped(request_id, reply)  # type: ignore[arg-type]
        with self.lock:
            batch = self.in_flight.pop(request_id, None)
            sent = self.sent_at.pop(request_id, None)
            # The backend answers a batch once done with it, so it is idle now unless another
            # is in flight: what its Idle frame right behind says, known a frame sooner, so
            # that the dispatch before the instances' wake (`settle`) finds it idle.
            self.backend_idle = self._computing_nothing()
            if batch and sent is not None and batch[0].kind in HEAVY:
                self.last_forward_s = time.monotonic() - sent
                self.costs.forwarded(self.last_forward_s, sum(c.tokens for c in batch))
                self.stats.stepped(self.last_forward_s)
            elif batch and sent is not None and batch[0].kind == P.Kind.SWAP_KVPAGE:
                self.costs.swapped(time.monotonic() - sent, sum(len(c.item["device"]) for c in batch))
        if batch is None:
            log.warning("reply to unknown request %s", request_id)
            return wakes
        if kind is P.Kind.ERROR:
            message = reply.message  # type: ignore[attr-defined]
            if batch[0].kind == P.Kind.PASS:
                fail(batch, HostError(ErrorKind.INFERENCE_FAILED, f"pass: {message}"))  # type: ignore[arg-type]
            else:
                for command in batch:
                    settle_command(command, message, None)
        elif kind is P.Kind.PASS:
            runs, wakes = settle(batch, reply)  # type: ignore[arg-type]
            if reply.more:  # type: ignore[attr-defined]
                # The backend steps these runs on: the batch stays in flight until its final step.
                at = {id(p): item for item, p in enumerate(batch)}
                with self.lock:
                    self.interrupt = self.interrupt or any(p.text_cut for p in batch)
                    self.in_flight[request_id] = batch
                    self.sent_at[request_id] = time.monotonic()
                    self.backend_idle = False
                    self.ahead[request_id] = {at[id(p)]: p for p in runs}
                self._drop_failed_parents(batch)
                return wakes
            self._continue(runs)
        else:
            resolve_batch(batch, reply)
        self._drop_failed_parents(batch)
        self._settled(request_id)
        return wakes

    def _stepped(self, request_id: int, step: P.PassesStep) -> list[threading.Event]:
        """A step the backend took on its own: publish its tokens; after the final one, the
        runs still going head their queues again and the batch is settled."""
        with self.lock:
            going = self.ahead.get(request_id)
            if going is None:
                log.warning("step of unknown request %s", request_id)
                return []
        before = list(going.values())
        wakes, stepped = settle_step(going, step)
        with self.lock:
            # A stop string ended a run the backend still steps: stop it (at most a step more).
            self.interrupt = self.interrupt or any(p.text_cut for p in before)
            now = time.monotonic()
            self.last_forward_s = now - self.sent_at.get(request_id, now)
            self.sent_at[request_id] = now
            if stepped:
                self.stats.batches[P.Kind.PASS] += 1
                self.stats.calls[P.Kind.PASS] += stepped
                self.stats.batch_sizes[stepped] += 1
                self.stats.stepped(self.last_forward_s)
                self.stats.ahead_steps += 1
            if not step.final:
                return wakes
            self.ahead.pop(request_id, None)
            self.interrupted.discard(request_id)
            self.in_flight.pop(request_id, None)
            self.sent_at.pop(request_id, None)
            self.backend_idle = self._computing_nothing()
        runs = [p for p in going.values() if not p.cancelled]
        for p in going.values():
            if p.cancelled:  # cancelled after its last step ahead: nothing more runs
                p.queue.results.publish(p, Status.CANCELLED, wakes=wakes)
        self._continue(runs)
        self._settled(request_id)
        return wakes

    def on_malformed(self, reason: str) -> None:
        """A frame that is no reply (a broken or impostor backend): its request id cannot be
        read, so every batch in flight fails with the reason; the loop goes on."""
        log.error(reason)
        with self.lock:
            lost = dict(self.in_flight)
            self.in_flight.clear()
            self.sent_at.clear()
            self.ahead.clear()
            self.interrupted.clear()
            self.backend_idle = True
        for request_id, batch in lost.items():
            for command in batch:
                abandon(command, HostError(ErrorKind.INFERENCE_FAILED, reason))
            self._settled(request_id)

    def _drop_failed_parents(self, batch: list[Command]) -> None:
        """A failed prefill chunk fails its pass: the rest of it, waiting at the head of
        its queue, never runs."""
        parents = [c.parent for c in batch if getattr(c, "parent", None) is not None]
        if parents:
            with self.lock:
                for p in parents:
                    if p.status is Status.FAILED and p in p.queue.pending:
                        p.queue.pending.remove(p)

    def _continue(self, runs: list[Pass]) -> None:
        """Runs that go on: their next step heads their queue, so it leaves in the next batch."""
        with self.lock:
            closed = self._requeue(runs)
        fail(closed, HostError(ErrorKind.INVALID_HANDLE, "instance terminated"))

    def _requeue(self, passes: list[Pass]) -> list[Pass]:
        """(Under the lock.) Put passes back at the head of their queues, in their order; the
        ones whose queue has closed are returned for the caller to fail once the lock is
        released. A pass failed meanwhile (`dropped`, by fail_all) stays out."""
        closed = []
        for p in reversed(passes):
            if p.queue.closed:
                closed.append(p)
            elif not p.dropped:
                p.queue.pending.appendleft(p)  # type: ignore[arg-type]
        return closed

    def cancel(self, p: Pass) -> None:
        """A waiting pass never runs; one in flight (a run's step) is the run's last, and
        the backend stops stepping it on its own at its next step."""
        with self.lock:
            waiting = p in p.queue.pending
            if waiting:
                p.queue.pending.remove(p)  # type: ignore[arg-type]
            p.cancelled = True
            ahead = any(p in going.values() for going in self.ahead.values())
            self.interrupt = self.interrupt or ahead
        if waiting:
            p.queue.results.publish(p, Status.CANCELLED)
        if ahead:
            self.channel.wake()

    def when_settled(self, instance_id: str, callback: Callable[[], Any]) -> None:
        """Run `callback` once no batch in flight holds a call of `instance_id` (at once if
        none does): an ending instance's pages must not be reused while a batch still
        writes them."""
        with self.lock:
            waiting = {rid for rid, batch in self.in_flight.items()
                       if any(c.queue.instance_id == instance_id for c in batch)}
            if waiting:
                self.settle_callbacks.append((waiting, callback))
                return
        callback()

    def _settled(self, request_id: int) -> None:
        with self.lock:
            ready = []
            for waiting, callback in self.settle_callbacks:
                waiting.discard(request_id)
                if not waiting:
                    ready.append(callback)
            self.settle_callbacks = [e for e in self.settle_callbacks if e[0]]
        for callback in ready:
            callback()


