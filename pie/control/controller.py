"""The control layer's front door: one `Controller` per served model, one `InstanceSession` per
inferlet instance. Every host call of the API lands on an InstanceSession method, which validates
the instance's handles, translates virtual ids to physical ones, and either answers at once
(control-layer calls) or enqueues a command for the batch scheduler (inference-layer calls).
"""

from __future__ import annotations

import itertools
import math
import os
import threading
import time

from pie import __version__
from pie import protocol as P
from pie.config import PieConfig
from pie.control.command import MARKER, Command, CommandQueue
from pie.control.errors import ErrorKind, HostError
from pie.control.future import Cancellation, HostFuture, wait_any
from pie.control.grammar import GrammarCompiler, Matcher
from pie.control.http_client import HttpClient
from pie.control.messaging import Inbox, KeyValueStore, MessageBus
from pie.control.passes import Limits, Output, Pass, PassResults
from pie.control.placement import Placement
from pie.control.policies import Objective
from pie.control.quotas import ANONYMOUS, Charges, QuotaBook
from pie.control.replica import Replica
from pie.control.resources import InstanceResources
from pie.control.text_echo import TextEcho
from pie.control.tokenizer import TextTokenizer

MAX_ALLOC = 1 << 16  # most pages or embeds one call may ask for
MAX_GROUP_BYTES = 256  # a task group's name (scheduling.set-queue-objective)
JOB_SIZE_CONTEXTS = 64  # a job-size hint is at most this many context lengths


class Controller:
    """The control layer of one model over `backend.replicas` backend processes (one
    `Replica` each, pie/control/replica.py), with what all replicas share."""

    def __init__(self, config: PieConfig, endpoints: list[str], handshake: P.HandshakeReply,
                 secret: bytes | None = None):
        self.config, self.hs = config, handshake
        control = config.control
        # `secret`: the tcp links' shared secret (pie/transport.py): the configured one, or
        # the one made for a run's Ray replicas.
        self.replicas = [Replica(i, config, endpoint, handshake, secret) for i, endpoint in enumerate(endpoints)]
        self.placement = Placement(control.placement, control.placement_imbalance, len(endpoints))
        self.placing = threading.Lock()  # placement reads and moves every replica's `live`
        self.exporting = threading.Lock()  # an export name is checked on all replicas, then made
        self.quotas = QuotaBook(config.quota)
        self.launches = itertools.count(1)  # an instance's launch order (allocation waiters)
        self.tokenizer = TextTokenizer(handshake)
        self.grammars = GrammarCompiler(handshake)
        self.bus = MessageBus(config.server.max_pending_messages, config.server.max_pending_bytes)
        self.kvs = KeyValueStore(config.control.kvs_max_bytes, config.quota)
        self.http = HttpClient(config.control)

    def session(self, instance_id: str, arguments: list[str], user: str = ANONYMOUS,
                program: str = "") -> "InstanceSession":
        """A new instance's session, charged to `user` (fails over quota.user.instances) and
        placed on a serving replica (fails when none serves)."""
        charges = self.quotas.open(user)
        charges.charge("instances")
        with self.placing:
            replica = self.placement.choose(self.replicas, program, arguments)
            if replica is None:
                charges.refund("instances")
                raise HostError(ErrorKind.OUT_OF_RESOURCES, "no backend replica is serving: " + "; ".join(
                    f"replica {r.index}: {r.failure}" for r in self.replicas))
            replica.live += 1
            replica.launched += 1
        session = InstanceSession(self, replica, instance_id, arguments, charges, user)
        replica.scheduler.arriving(instance_id)
        return session

    def closed(self, replica: Replica) -> None:
        with self.placing:
            replica.live -= 1

    def find_export(self, user: str, name: str) -> Replica | None:
        """The replica holding `user`'s export `name` (for a precise error elsewhere)."""
        return next((r for r in self.replicas if r.resources.has_export(user, name)), None)

    def stats(self, user: str | None = None) -> dict:
        """Scheduler and pool statistics, all replicas together and per replica, and what
        users hold: every user's (user None, for admins) or only `user`'s. Pool totals are
        shared by all and shown to all."""
        replicas = [r.stats(user) for r in self.replicas]
        users = self.quotas.usage(user)
        with self.kvs.lock:
            for name, account in users.items():
                account["kvs_bytes"] = self.kvs.used_by[name]
        return {"scheduler": merged([r["scheduler"] for r in replicas]),
                "resources": merged([r["resources"] for r in replicas]),
                "replicas": replicas, "users": users, "broadcasts_dropped": self.bus.dropped}

    def shutdown(self) -> None:
        for replica in self.replicas:
            replica.scheduler.stop()
        self.http.close()


def merged(parts: list[dict]) -> dict:
    """Statistics of several replicas as one: counts summed, maxima kept, means and rates
    recomputed from their sums (one replica: its own, unchanged)."""
    if len(parts) == 1:
        return parts[0]
    out: dict = {}
    for key, first in parts[0].items():
        values = [p.get(key) for p in parts]
        if isinstance(first, dict):
            out[key] = merged([v or {} for v in values])
        elif isinstance(first, bool) or not isinstance(first, (int, float)):
            out[key] = first
        elif key.startswith("max_"):
            out[key] = max(v or 0 for v in values)
        else:
            out[key] = sum(v or 0 for v in values)
    for key, v in ((k, v) for p in parts[1:] for k, v in p.items()):
        out.setdefault(key, v)  # a key only a later replica has (a kind of call)
    if "mean_batch_size" in out:  # a scheduler's
        calls, batches = sum(out["calls"].values()), sum(out["batches"].values())
        out["mean_batch_size"] = calls / max(1, batches)
        waited = sum(p["mean_wait_ms"] * sum(p["calls"].values()) for p in parts)
        out["mean_wait_ms"] = waited / max(1, calls)
    if "hit_rate" in out:  # a prefix cache's
        out["hit_rate"] = out["hit_tokens"] / out["lookup_tokens"] if out["lookup_tokens"] else 0.0
    return out


def _invalid(message: str) -> HostError:
    return HostError(ErrorKind.INVALID_ARGUMENT, message)


class InstanceSession:
    """One instance's view of the system; all methods run on that instance's thread."""

    def __init__(self, controller: Controller, replica: Replica, instance_id: str,
                 arguments: list[str], charges: Charges, user: str = ANONYMOUS):
        self.c = controller
        self.replica = replica  # where its pages, embeds and queues live, for life
        self.instance_id = instance_id
        self.user = user  # owns the instance's exports, keys and topics (their namespace)
        self.arguments = arguments
        self.charges = charges
        self.resources = InstanceResources(charges, instance_id, user, next(controller.launches))
        self.inbox = Inbox(controller.config.server.max_pending_messages,
                           max_bytes=controller.config.server.max_pending_bytes)
        self.page_size = controller.hs.page_size
        self.forward_calls = 0
        self.forward_tokens = 0
        self.sampled_tokens = 0  # tokens drawn on the host (sample calls, passes, runs)
        self.cached_tokens = 0  # tokens of settled passes whose KV the prefix cache supplied
        self.queues: list[CommandQueue] = []
        self.subscriptions: set[Inbox] = set()
        self.matchers: dict[int, tuple[CommandQueue, Matcher]] = {}  # matcher.id -> (its queue, it)
        self.next_matcher_id = 1
        self.passes: dict[int, Pass] = {}  # pass id -> pass, until its final result is taken
        self.next_pass_id = 1
        hs = controller.hs
        self.limits = Limits(hs.page_size, hs.vocab_size, hs.max_batch_tokens,
                             controller.config.control.max_dist_k, hs.context_length)

    def usage(self) -> dict[str, int]:
        """What the instance consumed, reported to its client when it ends."""
        return {"forward_calls": self.forward_calls, "forward_tokens": self.forward_tokens,
                "sampled_tokens": self.sampled_tokens, "cached_tokens": self.cached_tokens,
                "kv_pages_peak": self.resources.pages.peak, "embeds_peak": self.resources.embeds.peak}

    # --- runtime --------------------------------------------------------------------------

    def version(self) -> str:
        return __version__

    def now_ns(self) -> int:
        return time.monotonic_ns()

    def random_bytes(self, n: int) -> bytes:
        if n > 1 << 20:
            raise _invalid(f"at most 1 MiB of random bytes per call, asked {n}")
        return os.urandom(n)

    def available_models(self) -> list[str]:
        return [self.c.hs.model_name]

    def available_traits(self, model: str) -> list[str]:
        self._check_model(model)
        return list(self.c.hs.traits)

    def _check_model(self, model: str) -> None:
        if model != self.c.hs.model_name:
            raise HostError(ErrorKind.NOT_FOUND, f"no model named {model!r} "
                            f"(available: {self.c.hs.model_name})")

    def create_queue(self, model: str) -> CommandQueue:
        self._check_model(model)
        self.charges.charge("queues")
        queue = self.replica.scheduler.create_queue(self.instance_id)
        # Dropped queues stay listed while calls of theirs wait: they count toward
        # runtime.max_pending_calls until they have run.
        self.queues = [q for q in self.queues if not (q.released and not q.pending)] + [queue]
        return queue

    def drop_queue(self, q: CommandQueue) -> None:
        """The guest dropped the queue: its quota comes back, and the scheduler stops
        counting it as a decoder about to send its next step."""
        if q.released:
            return
        self.charges.refund("queues")
        if q.objective is Objective.LATENCY:
            self.charges.refund("latency_queues")
        self.replica.scheduler.release_queue(q)

    def synchronize(self, q: CommandQueue) -> HostFuture:
        return self._submit(Command(MARKER, q, HostFuture()))

    def set_queue_priority(self, q: CommandQueue, priority: int) -> None:
        q.priority = priority

    def set_queue_objective(self, q: CommandQueue, objective: str, group: str) -> None:
        if len(group.encode()) > MAX_GROUP_BYTES:
            raise _invalid(f"a task group name is at most {MAX_GROUP_BYTES} bytes, got {len(group.encode())}")
        new = Objective[objective.upper()]
        if new is Objective.LATENCY and q.objective is not Objective.LATENCY:
            self.charges.charge("latency_queues")
        elif q.objective is Objective.LATENCY and new is not Objective.LATENCY:
            self.charges.refund("latency_queues")
        q.objective, q.group = new, (self.user, group) if group else None

    def set_job_size(self, q: CommandQueue, tokens: int) -> None:
        limit = JOB_SIZE_CONTEXTS * self.c.hs.context_length
        if tokens > limit:
            raise _invalid(f"a job-size hint of {tokens} tokens is over {JOB_SIZE_CONTEXTS} times the "
                           f"model's context length ({limit})")
        q.job_left = tokens

    # --- messaging, kvs, http --------------------------------------------------------------

    def wait_s(self, rate: str) -> float:
        """How long the caller must wait before its next message or HTTP request
        (quota.*.messages_per_s, http_requests_per_s); the runtime does the waiting."""
        return self.charges.wait_s(rate)

    def receive(self) -> HostFuture:
        return self.inbox.next()

    def broadcast(self, topic: str, message: str) -> None:
        self.c.bus.broadcast(self.instance_id, self.user, topic, message)

    def subscribe(self, topic: str) -> Inbox:
        if not topic:
            raise _invalid("topic must not be empty")
        self.charges.charge("subscriptions")
        inbox = self.c.bus.subscribe(self.instance_id, self.user, topic)
        self.subscriptions.add(inbox)
        return inbox

    def unsubscribe(self, inbox: Inbox) -> None:
        """The guest dropped the subscription: its backlog goes, its quota comes back."""
        if inbox in self.subscriptions:
            self.subscriptions.discard(inbox)
            self.c.bus.unsubscribe(inbox)
            self.charges.refund("subscriptions")

    def store_get(self, key: str) -> str | None:
        return self.c.kvs.get(self.user, key)

    def store_set(self, key: str, value: str) -> None:
        self.c.kvs.set(self.user, key, value)

    def store_delete(self, key: str) -> None:
        self.c.kvs.delete(self.user, key)

    def http(self, method: str, url: str, headers: list[tuple[str, str]],
             body: str | None = None) -> HostFuture:
        return self.c.http.request(method, url, headers, body)

    # --- allocate --------------------------------------------------------------------------

    def _count(self, count: int) -> int:
        if count > MAX_ALLOC:
            raise _invalid(f"at most {MAX_ALLOC} per allocation, asked {count}")
        return count

    def alloc_kvpage(self, q: CommandQueue, count: int) -> list[int]:
        return self.replica.resources.alloc_pages(self.resources, self._count(count))

    def alloc_emb(self, q: CommandQueue, count: int) -> list[int]:
        return self.replica.resources.alloc_embeds(self.resources, self._count(count))

    def set_kv_class(self, pages: list[int], kv_class: str) -> None:
        """What the reclaimer may do with the pages while the instance waits on I/O."""
        self.resources.pages.resolve(pages)  # every id must be live: nothing changes otherwise
        classes = self.resources.classes
        for page in pages:
            if kv_class == "swappable":
                classes.pop(page, None)
            else:
                classes[page] = kv_class

    def pause(self, paused: bool) -> None:
        """The instance's thread blocks on I/O (True) or runs again (False)."""
        self.replica.resources.pause(self.resources, paused)

    def _bring_back(self) -> None:
        """Pages the reclaimer swapped out come back to the device before a call names them."""
        if self.resources.away:
            self.replica.reclaimer.restore(self.resources)

    def _pages(self, ids: list[int], writable: bool = False) -> list[int]:
        """Physical ids of the instance's pages (on the device: `_bring_back`); `writable`:
        none may be shared."""
        self._bring_back()
        if writable:
            return self.replica.resources.writable_pages(self.resources, ids)
        return self.replica.resources.device_pages(self.resources, ids)

    def dealloc_kvpage(self, q: CommandQueue, pages: list[int]) -> None:
        physical = self.replica.resources.take_pages(self.resources, pages)
        self._release_after(q, physical, [])

    def dealloc_emb(self, q: CommandQueue, embeds: list[int]) -> None:
        physical = self.replica.resources.take_embeds(self.resources, embeds)
        self._release_after(q, [], physical)

    def _release_after(self, q: CommandQueue, pages: list[int], embeds: list[int]) -> None:
        """Physical release waits for the queue's earlier commands, which may still use them."""
        self._submit(Command(MARKER, q, HostFuture(), silent=True,
                             on_head=lambda: self.replica.resources.release(pages, embeds)))

    def copy_kvpage(self, q: CommandQueue, src: int, dst: int, src_offset: int,
                    dst_offset: int, length: int) -> None:
        (src_page,) = self._pages([src])
        (dst_page,) = self._pages([dst], writable=True)
        ps = self.page_size
        if src_offset + length > ps or dst_offset + length > ps:
            raise _invalid(f"range does not fit in a page of {ps}: src offset {src_offset}, "
                           f"dst offset {dst_offset}, length {length}")
        self._submit(Command(
            P.Kind.COPY_KVPAGE, q, HostFuture(), silent=True,
            item={"src": src_page, "dst": dst_page, "src_offset": src_offset,
                  "dst_offset": dst_offset, "length": length},
            reads=frozenset({("p", src_page)}), writes=frozenset({("p", dst_page)})))

    def export_kvpage(self, pages: list[int], name: str, persistent: bool) -> None:
        if not name:
            raise _invalid("export name must not be empty")
        self._bring_back()
        with self.c.exporting:  # one namespace of export names over every replica
            holder = self.c.find_export(self.user, name)
            if holder is not None and holder is not self.replica:
                raise HostError(ErrorKind.ALREADY_EXISTS, f"an export named {name!r} exists (on backend "
                                f"replica {holder.index}; this instance runs on replica {self.replica.index})")
            self.replica.resources.export(self.resources, pages, name, persistent)

    def import_kvpage(self, name: str) -> list[int]:
        try:
            return self.replica.resources.import_(self.resources, name)
        except HostError as e:
            holder = self.c.find_export(self.user, name) if e.kind is ErrorKind.NOT_FOUND else None
            if holder is None:
                raise
            raise HostError(ErrorKind.NOT_FOUND, f"export {name!r} is on backend replica {holder.index} "
                            f"and this instance runs on replica {self.replica.index}: KV pages do not "
                            f"move between replicas (backend.replicas = {len(self.c.replicas)}); run the "
                            f"instances that share pages as one program, or with backend.replicas = 1") from None

    def unexport_kvpage(self, name: str) -> None:
        self.replica.resources.unexport(self.resources, name)

    # --- forward ---------------------------------------------------------------------------

    def forward(self, q: CommandQueue, kv_pages: list[int], last_len: int, embeds: list[int],
                out_pages: list[int], out_offset: int, out_embeds: list[int],
                out_indices: list[int], mask: bytes | None) -> None:
        ps = self.page_size
        n_new = len(embeds)
        if n_new == 0:
            raise _invalid("forward needs at least one input embed")
        self._check_batch_tokens(n_new)
        if kv_pages and not 1 <= last_len <= ps:
            raise _invalid(f"input-kv-last-page-len {last_len} must be in [1, {ps}]")
        if len(out_embeds) != len(out_indices):
            raise _invalid(f"{len(out_embeds)} output embeds but {len(out_indices)} token indices")
        if any(i >= n_new for i in out_indices):
            raise _invalid(f"output token index out of range [0, {n_new})")
        if out_pages and (out_offset >= ps or len(out_pages) * ps - out_offset < n_new):
            raise _invalid(f"output pages from offset {out_offset} hold "
                           f"{max(0, len(out_pages) * ps - out_offset)} slots, {n_new} needed")
        n_keys = (len(kv_pages) - 1) * ps + last_len + n_new if kv_pages else n_new
        if mask is not None and len(mask) != math.ceil(n_new * n_keys / 8):
            raise _invalid(f"attention mask must be {math.ceil(n_new * n_keys / 8)} bytes "
                           f"(packed bits of {n_new} x {n_keys}), got {len(mask)}")
        pages = self._pages(kv_pages)
        embeds_in = self.resources.embeds.resolve(embeds)
        written = self._pages(out_pages, writable=True)
        embeds_out = self.resources.embeds.resolve(out_embeds)
        self.forward_calls += 1
        self.forward_tokens += n_new
        self._submit(Command(
            P.Kind.FORWARD, q, HostFuture(), silent=True, tokens=n_new,
            item={"kv_pages": pages, "last_len": last_len if pages else 0, "embeds": embeds_in,
                  "out_pages": written, "out_offset": out_offset, "out_embeds": embeds_out,
                  "out_indices": out_indices, "mask": mask},
            reads=frozenset([("p", p) for p in pages] + [("e", e) for e in embeds_in]),
            writes=frozenset([("p", p) for p in written] + [("e", e) for e in embeds_out])))

    def _check_batch_tokens(self, n: int) -> None:
        limit = self.c.hs.max_batch_tokens
        if n > limit:
            raise _invalid(f"{n} tokens in one call exceed the backend's max_batch_tokens = {limit}; "
                           f"split the call into chunks")

    def mask_kvpage(self, q: CommandQueue, page: int, mask: list[bool]) -> None:
        if len(mask) != self.page_size:
            raise _invalid(f"mask must have {self.page_size} entries (the page size), got {len(mask)}")
        (physical,) = self._pages([page], writable=True)
        self._submit(Command(P.Kind.MASK_KVPAGE, q, HostFuture(), silent=True,
                             item={"page": physical, "mask": list(mask)},
                             writes=frozenset({("p", physical)})))

    def embed_text(self, q: CommandQueue, token_ids: list[int], positions: list[int],
                   embeds: list[int]) -> None:
        if not len(token_ids) == len(positions) == len(embeds):
            raise _invalid(f"{len(token_ids)} tokens, {len(positions)} positions and "
                           f"{len(embeds)} embeds must be equally many")
        self._check_batch_tokens(len(token_ids))
        vocab = self.c.hs.vocab_size
        if any(t >= vocab for t in token_ids):
            raise _invalid(f"token id out of range [0, {vocab})")
        physical = self.resources.embeds.resolve(embeds)
        self._submit(Command(
            P.Kind.EMBED_TEXT, q, HostFuture(), silent=True, tokens=len(token_ids),
            item={"token_ids": list(token_ids), "positions": list(positions), "embed_ids": physical},
            writes=frozenset(("e", e) for e in physical)))

    # --- output-text -----------------------------------------------------------------------

    def get_next_dist(self, q: CommandQueue, embed: int, k: int) -> HostFuture:
        if not 1 <= k <= self.c.config.control.max_dist_k:
            raise _invalid(f"k {k} must be in [1, {self.c.config.control.max_dist_k}] "
                           f"(control.max_dist_k)")
        (physical,) = self.resources.embeds.resolve([embed])
        return self._submit(Command(P.Kind.NEXT_DIST, q, HostFuture(),
                                    item={"embed": physical, "k": k},
                                    reads=frozenset({("e", physical)})))

    def sample(self, q: CommandQueue, embed: int, temperature: float, top_k: int, top_p: float,
               seed: int | None, matcher: Matcher | None = None) -> HostFuture:
        """A token drawn from `embed`'s distribution; with `matcher`, only among the tokens
        its grammar allows next (the matcher is not advanced: the caller accepts the token)."""
        if not (math.isfinite(temperature) and temperature >= 0):
            raise _invalid(f"temperature {temperature} must be a finite number >= 0")
        if not 0 < top_p <= 1:
            raise _invalid(f"top-p {top_p} must be in (0, 1]")
        (physical,) = self.resources.embeds.resolve([embed])
        self.sampled_tokens += 1
        return self._submit(Command(
            P.Kind.SAMPLE, q, HostFuture(),
            item={"embed": physical, "temperature": float(temperature), "top_k": top_k,
                  "top_p": float(top_p), "seed": -1 if seed is None else seed % (1 << 63),
                  "allowed": None if matcher is None else matcher.allowed_mask()},
            reads=frozenset({("e", physical)})))

    # --- inference (the fused pass) ---------------------------------------------------------

    def submit_pass(self, q: CommandQueue, run_steps: int | None, *, stream: bool = True, token_ids: list[int],
                    positions: list[int], embeds: list[int], kv_pages: list[int], last_len: int,
                    out_pages: list[int], out_offset: int, mask: bytes | None,
                    outputs: list[Output], stop_tokens: list[int], echo: TextEcho | None = None) -> int:
        """`inference.execute` (run_steps None), `inference.run` and `run-text` (`echo`):
        resolve the instance's ids, check the pass once (`Pass.validate`), enqueue it; its id."""
        if q.instance_id != self.instance_id:
            raise HostError(ErrorKind.INVALID_HANDLE, "the queue belongs to another instance")
        if len(self.passes) >= self.c.config.runtime.max_pending_calls:
            raise HostError(ErrorKind.OUT_OF_RESOURCES,
                            f"{len(self.passes)} passes of this instance are not taken "
                            f"(runtime.max_pending_calls); take some results first")
        for o in outputs:
            if o.keep >= 0:
                (o.keep,) = self.resources.embeds.resolve([o.keep])
            if o.matcher_id:
                held = self.matchers.get(o.matcher_id)
                if held is None or held[0] is not q:
                    raise HostError(ErrorKind.INVALID_HANDLE, f"matcher {o.matcher_id} is not a live "
                                    f"matcher of this instance compiled on this queue")
                o.matcher = held[1]
        p = Pass(q, self.next_pass_id, self.page_size, list(token_ids), list(positions),
                 self.resources.embeds.resolve(embeds), self._pages(kv_pages),
                 last_len, self._pages(out_pages, writable=True), out_offset,
                 mask, outputs, frozenset(stop_tokens), stream=stream,
                 stream_every=self.c.config.control.stream_interval, echo=echo, scope=self.resources.user)
        p.validate(self.limits, run_steps)
        self.next_pass_id += 1
        self.passes[p.pass_id] = p
        self.forward_calls += 1
        self.forward_tokens += p.tokens
        q.results.opened()
        self._submit(p)  # type: ignore[arg-type]
        return p.pass_id

    def take(self, q: CommandQueue, block: bool, cancelled: Cancellation | None = None) -> list:
        """`inference.take`: results of q's passes; with `block`, waits for one while any
        is in flight. A final result forgets its pass. Runs' tokens count when taken."""
        results = q.results
        while block and not results.done() and not results.idle():
            wait_any([results], cancelled)
            if cancelled is not None and cancelled.is_set():
                break
        taken = results.take()
        for pass_id, status, tokens, _, _ in taken:
            p = self.passes.get(pass_id)
            if p is None:
                continue
            self.sampled_tokens += len(tokens)
            if p.run_pages:  # a run forwards every token it draws but the last, a step each
                steps = len(tokens) - (1 if tokens and not p.taken else 0)
                self.forward_tokens += steps
                self.forward_calls += steps
            p.taken += len(tokens)
            if status != "running":
                self.cached_tokens += p.cached_tokens
                del self.passes[pass_id]
        return taken

    def cancel_pass(self, q: CommandQueue, pass_id: int) -> None:
        p = self.passes.get(pass_id)
        if p is None or p.queue is not q:
            raise HostError(ErrorKind.INVALID_HANDLE, f"pass {pass_id} is not a pass of this "
                            f"queue whose result is still to be taken")
        self.replica.scheduler.cancel(p)

    def results_ready(self, q: CommandQueue) -> PassResults:
        if q.instance_id != self.instance_id:
            raise HostError(ErrorKind.INVALID_HANDLE, "the queue belongs to another instance")
        return q.results

    def compile_grammar(self, q: CommandQueue, kind: str, source: str) -> Matcher:
        """A matcher for `q`'s model, numbered for fused passes (`grammar.matcher.id`)."""
        matcher = self.c.grammars.compile(kind, source)
        matcher.id = self.next_matcher_id
        self.next_matcher_id += 1
        self.matchers[matcher.id] = (q, matcher)
        return matcher

    def forget_matcher(self, matcher: Matcher) -> None:
        """The guest dropped the matcher: passes can no longer name it."""
        self.matchers.pop(matcher.id, None)

    def _submit(self, command: Command) -> HostFuture:
        if command.queue.instance_id != self.instance_id:
            raise HostError(ErrorKind.INVALID_HANDLE, "the queue belongs to another instance")
        limit = self.c.config.runtime.max_pending_calls
        if command.kind != MARKER and sum(len(q.pending) for q in self.queues) >= limit:
            raise HostError(ErrorKind.OUT_OF_RESOURCES,
                            f"{limit} calls of this instance wait for the backend "
                            f"(runtime.max_pending_calls); await some results before enqueuing more")
        return self.replica.scheduler.submit(command)

    # --- teardown --------------------------------------------------------------------------

    def close(self) -> None:
        """Release everything the instance held: queues, pages, embeds, exports, topics."""
        self.replica.scheduler.close_instance(self.instance_id)
        # Pages and embeds go back only once no batch in flight can still write them.
        self.replica.scheduler.when_settled(self.instance_id,
                                            lambda: self.replica.resources.release_instance(self.resources))
        self.c.bus.drop_instance(self.instance_id)
        self.c.closed(self.replica)
