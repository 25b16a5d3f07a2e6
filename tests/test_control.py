"""Control-layer unit tests: resources and the batch scheduler, against a fake backend
(a ZeroMQ ROUTER thread that records batches and answers them)."""

from __future__ import annotations

import threading
import time
from array import array
from collections import deque

import pytest
import zmq

from pie import protocol as P
from pie.config import ConfigError, ControlConfig, InstanceQuota, QuotaConfig, UserQuota
from pie.control.command import MARKER, Command
from pie.control.errors import ErrorKind, HostError
from pie.control.future import HostFuture
from pie.control.messaging import MessageBus
from pie.control.quotas import QuotaBook, RateLimit
from pie.control.resources import InstanceResources, ResourceManager
from pie.control.scheduler import Scheduler


class FakeBackend:
    """Answers every batch (sample → token 7 per item; a pass → `pass_token` per output
    row) and records (kind, item count) and the pass requests. While `hold` is clear, it
    takes requests but answers none (a batch in flight, for as long as a test needs).

    With `step_ahead`, a pass request granting steps ahead (`Passes.ahead`) is answered
    `more`, then stepped as the real backend does: step k draws 100 + k for every item
    granted at least k steps, a frame waiting ends the steps (an empty final step), and
    while `step_gate` is clear it waits before each step; with `step_permits` (a
    semaphore) each step takes one permit first, so a test lets them go one by one."""

    def __init__(self, endpoint: str):
        self.batches: list[tuple[str, int]] = []
        self.passes: list[P.Passes] = []
        self.pass_token = 7
        self.pass_errors: dict[int, dict[int, str]] = {}  # pass batch number -> item -> error
        self.hold = threading.Event()
        self.hold.set()
        self.step_ahead = False
        self.step_gate = threading.Event()
        self.step_gate.set()
        self.stepping = threading.Event()  # set once a reply said `more`
        self.step_permits: threading.Semaphore | None = None
        self.steps: list[list[int]] = []  # tokens of each step taken ahead
        self.interrupts = 0
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.bind(endpoint)
        self.running = True
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self) -> None:
        while self.running:
            if not self.socket.poll(50):
                continue
            peer, frame = self.socket.recv_multipart()
            request_id, message = P.decode_request(frame)
            if isinstance(message, P.Interrupt):
                self.interrupts += 1
                self.socket.send_multipart([peer, P.encode(request_id, message)])
                continue
            if isinstance(message, P.Passes):
                n = len(message.kv_last_page_lens) // 4
                self.passes.append(message)
            else:
                items = message.kv_last_page_lens if isinstance(message, P.Forward) else message.embed_ids
                n = len(items)
            self.batches.append((str(message.kind), n))
            while not self.hold.wait(0.05):
                if not self.running:
                    return
            if isinstance(message, P.Sample):
                reply: P.Message = P.SampleReply([7] * len(message.embed_ids))
            elif isinstance(message, P.Passes):
                rows = len(message.out_index) // 4
                reply = P.PassesReply(tokens=array("i", [self.pass_token] * rows).tobytes(),
                                      entropy=array("f", [0.5] * rows).tobytes(), logprobs=b"",
                                      dist_ids=b"", dist_probs=b"", dist_indptr=bytes(4 * (rows + 1)),
                                      errors=self.pass_errors.get(len(self.passes) - 1, {}))
            else:
                reply = P.BatchReply()
            ahead = array("i", message.ahead).tolist() if isinstance(message, P.Passes) else []
            if self.step_ahead and any(ahead):
                reply.more = True  # type: ignore[attr-defined]
            self.socket.send_multipart([peer, P.encode(request_id, reply, message.kind)])
            if self.step_ahead and any(ahead):
                self._step(peer, request_id, ahead)
            self.socket.send_multipart([peer, P.encode(0, P.Idle())])

    def _step(self, peer: bytes, request_id: int, ahead: list[int]) -> None:
        self.stepping.set()
        for k in range(1, max(ahead) + 1):
            while not self.step_gate.wait(0.05) or (self.step_permits is not None
                                                      and not self.step_permits.acquire(timeout=0.05)):
                if not self.running:
                    return
            if self.socket.poll(0):
                tokens, final = [-1] * len(ahead), True
            else:
                tokens, final = [100 + k if a >= k else -1 for a in ahead], k == max(ahead)
                self.steps.append(tokens)
            self.socket.send_multipart([peer, P.encode(request_id, P.PassesStep(
                tokens=array("i", tokens).tobytes(), final=final))])
            if final:
                return

    def close(self) -> None:
        self.running = False
        self.thread.join()
        self.socket.close()
        self.context.term()


@pytest.fixture
def setup(tmp_path):
    """The adaptive scheduler on a fake backend that looks busy until the test has queued
    every call (`busy_until_queued`): the first decision sees all of them, however slowly
    the test thread runs — no timing window to miss on a loaded machine."""
    endpoint = f"ipc://{tmp_path}/fake.sock"
    backend = FakeBackend(endpoint)
    scheduler = Scheduler(endpoint, ControlConfig(scheduler="adaptive"), max_batch_tokens=64)
    scheduler.backend_idle = False
    yield scheduler, backend
    scheduler.stop()
    backend.close()


def busy_until_queued(scheduler: Scheduler) -> None:
    """The backend says it is idle (as its Idle message would): the scheduler decides now."""
    with scheduler.lock:
        scheduler.backend_idle = True
    scheduler.channel.wake()


def forward(queue, reads=(), writes=(), tokens=1) -> Command:
    item = {"kv_pages": [], "last_len": 0, "embeds": [0] * tokens, "out_pages": [], "out_offset": 0,
            "out_embeds": [], "out_indices": [], "mask": None}
    return Command(P.Kind.FORWARD, queue, HostFuture(), item=item, tokens=tokens,
                   reads=frozenset(reads), writes=frozenset(writes))


def sample(queue) -> Command:
    item = {"embed": 0, "temperature": 0.0, "top_k": 0, "top_p": 1.0, "seed": -1}
    return Command(P.Kind.SAMPLE, queue, HostFuture(), item=item)


def test_horizontal_and_vertical_batching(setup):
    scheduler, backend = setup
    queues = [scheduler.create_queue(f"i{n}") for n in range(3)]
    futures = [scheduler.submit(forward(q)) for q in queues]  # horizontal: 3 queues
    futures.append(scheduler.submit(forward(queues[0])))  # vertical: 2nd in queue 0
    futures += [scheduler.submit(sample(q)) for q in queues]
    busy_until_queued(scheduler)
    for f in futures:
        assert _wait(f)
    assert backend.batches == [("forward", 4), ("sample", 3)]
    assert [f.result() for f in futures[4:]] == [7, 7, 7]
    stats = scheduler.snapshot_stats()
    assert stats["mean_batch_size"] == 3.5 and stats["calls"]["forward"] == 4


def test_eager_policy_sends_every_call_alone(tmp_path):
    endpoint = f"ipc://{tmp_path}/fake.sock"
    backend = FakeBackend(endpoint)
    scheduler = Scheduler(endpoint, ControlConfig(scheduler="eager"), max_batch_tokens=64)
    try:
        queues = [scheduler.create_queue(f"i{n}") for n in range(3)]
        futures = [scheduler.submit(forward(q)) for q in queues] + [scheduler.submit(forward(queues[0]))]
        for f in futures:
            assert _wait(f)
        assert backend.batches == [("forward", 1)] * 4
    finally:
        scheduler.stop()
        backend.close()


def test_conflicting_commands_are_not_batched_vertically(setup):
    scheduler, backend = setup
    q = scheduler.create_queue("i")
    first = scheduler.submit(forward(q, writes={("e", 5)}))
    second = scheduler.submit(forward(q, reads={("e", 5)}))  # reads what the first writes
    busy_until_queued(scheduler)
    assert _wait(first) and _wait(second)
    assert backend.batches == [("forward", 1), ("forward", 1)]


def test_token_budget_cuts_the_batch(setup):
    scheduler, backend = setup
    queues = [scheduler.create_queue(f"i{n}") for n in range(3)]
    futures = [scheduler.submit(forward(q, tokens=30)) for q in queues]  # budget 64
    busy_until_queued(scheduler)
    for f in futures:
        assert _wait(f)
    assert backend.batches == [("forward", 2), ("forward", 1)]


def test_markers_complete_in_queue_order_and_release(setup):
    scheduler, backend = setup
    q = scheduler.create_queue("i")
    released = []
    f1 = scheduler.submit(forward(q))
    marker = scheduler.submit(Command(MARKER, q, HostFuture(), on_head=lambda: released.append(1)))
    busy_until_queued(scheduler)
    assert _wait(marker) and f1.done() and released == [1]


def test_close_instance_fails_pending_calls_but_still_releases(setup):
    scheduler, _ = setup
    q = scheduler.create_queue("gone")
    released = []
    f = scheduler.submit(forward(q))
    scheduler.submit(Command(MARKER, q, HostFuture(), on_head=lambda: released.append(1)))
    scheduler.close_instance("gone")
    assert released == [1]
    assert f.done()
    with pytest.raises(HostError):
        f.result()


def test_stragglers_are_open_queues_that_read_their_last_forward(setup):
    """The adaptive policy waits briefly for queues that ran the model lately (a decoder
    computing its next step). A forward that only wrote KV (a prefix filled on a queue of
    its own) and a dropped queue are not waited for: both made the semantic-variables
    chain's next decode step wait half a prefill (~0.25 s a call)."""
    scheduler, _ = setup
    reader, writer, dropped, waiting = (scheduler.create_queue(f"i{n}") for n in range(4))
    reads, also_reads = forward(reader), forward(dropped)
    reads.item["out_embeds"], also_reads.item["out_embeds"] = [3], [4]
    futures = [scheduler.submit(reads), scheduler.submit(forward(writer)), scheduler.submit(also_reads)]
    busy_until_queued(scheduler)
    assert all(_wait(f) for f in futures)
    scheduler.release_queue(dropped)
    with scheduler.lock:
        scheduler.last_forward_s = 60.0  # every forward above is "lately"
        waiting.pending.append(forward(waiting))
        heads = scheduler._eligible_heads()
        assert scheduler._view(heads).stragglers == {"forward"}  # the reader only
        assert dropped not in scheduler.queues  # nothing left to run: it has left
        scheduler.recent_forwards.pop(id(reader))
        assert scheduler._view(heads).stragglers == frozenset()
        waiting.pending.clear()


def test_a_dropped_queue_runs_its_calls_and_gives_its_quota_back(tmp_path, model_dir):
    """WIT: dropping a queue lets its pending commands finish; quota.instance.queues counts
    the queues held at once, so a program that makes a queue per call (a pipeline of
    semantic variables) is not stopped at 64 calls."""
    from pie.config import PieConfig

    config = PieConfig(quota=QuotaConfig(instance=InstanceQuota(queues=2)))
    controller, backend = controller_on_fake_backend(config, tmp_path, model_dir)
    try:
        a = controller.session("a", [])
        q1, q2 = a.create_queue("m"), a.create_queue("m")
        with pytest.raises(HostError, match="quota.instance.queues = 2"):
            a.create_queue("m")
        backend.hold.clear()  # the backend takes the call but does not answer yet
        (embed,) = a.alloc_emb(q1, 1)
        a.embed_text(q1, [1], [0], [embed])
        pending = a.synchronize(q1)  # completes once the embed has run
        a.drop_queue(q1)
        a.drop_queue(q1)  # twice: refunded once
        q3 = a.create_queue("m")
        with pytest.raises(HostError, match="quota.instance.queues = 2"):
            a.create_queue("m")
        backend.hold.set()
        assert _wait(pending) and q1.error is None  # it ran
        assert _wait(a.synchronize(q3))
        assert q1 not in controller.replicas[0].scheduler.queues and q2 in controller.replicas[0].scheduler.queues
        a.close()
    finally:
        controller.shutdown()
        backend.close()


def test_a_failed_backend_still_releases_deferred_frees(setup):
    """After fail_all (backend gone) a pending or later dealloc marker still releases its
    pages: an inferlet ending on the error must not leak them."""
    scheduler, _ = setup
    q = scheduler.create_queue("i")
    released = []
    with scheduler.lock:  # hold dispatch so the marker is still pending when the backend fails
        q.pending.append(Command(MARKER, q, HostFuture(), on_head=lambda: released.append("pending")))
    scheduler.fail_all("backend gone")
    later = scheduler.submit(Command(MARKER, q, HostFuture(), on_head=lambda: released.append("later")))
    assert released == ["pending", "later"] and later.done()
    scheduler.recover()
    assert _wait(scheduler.submit(forward(q)))  # serving again


HANG_S = 60.0  # bounds a wait that only a hang would reach


def _wait(future: HostFuture, timeout: float = HANG_S) -> bool:
    from pie.control.future import Cancellation, wait_any

    done = Cancellation()
    timer = threading.Timer(timeout, done.set)
    timer.start()
    wait_any([future], done)
    timer.cancel()
    return future.done()


def test_a_blocked_wait_wakes_on_cancellation_without_polling():
    """wait_any sleeps until a future completes or the instance is cancelled; the
    Cancellation wakes it directly (it used to poll every 50 ms: ~2.6 ms of CPU per
    64-token text_completion), and one set before the wait ends it at once."""
    from pie.control.future import Cancellation, HostFuture, wait_any

    never = HostFuture()
    cancel = Cancellation()
    waiter = threading.Thread(target=wait_any, args=([never], cancel))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive()  # blocked: nothing is done
    cancel.set()
    waiter.join(HANG_S)
    assert not waiter.is_alive() and not never.done()
    assert wait_any([never], cancel) == []  # already cancelled: returns at once
    assert not cancel._wakes  # every wait unregistered itself


def test_resources_virtualize_and_refcount():
    manager = ResourceManager(num_pages=4, num_embeds=4)
    a, b = holder(instance="a"), holder(instance="b")
    pages = manager.alloc_pages(a, 2)
    with pytest.raises(HostError) as e:  # b holds no pages: a's ids are foreign to it
        b.pages.resolve(pages)
    assert e.value.kind == ErrorKind.INVALID_HANDLE
    manager.export(a, pages, "prefix", persistent=False)
    imported = manager.import_(b, "prefix")  # the same user: its own namespace
    assert manager.pages.available == 2
    with pytest.raises(HostError, match="shared"):
        manager.writable_pages(b, imported)
    with pytest.raises(HostError, match="another instance that is still running") as e:
        manager.unexport(b, "prefix")
    assert e.value.kind == ErrorKind.PERMISSION_DENIED
    manager.release_instance(a)  # a's pages live on in b; the owned export is gone
    assert manager.pages.available == 2 and manager.exports_of(None) == 0
    manager.release_instance(b)
    assert manager.pages.available == 4
    with pytest.raises(HostError) as e:
        manager.alloc_pages(a, 5)
    assert e.value.kind == ErrorKind.OUT_OF_RESOURCES


def holder(book: QuotaBook | None = None, user: str = "u", instance: str = "") -> InstanceResources:
    """One instance's resources, charged to `user` in `book` (no quotas by default)."""
    return InstanceResources((book or QuotaBook(QuotaConfig())).open(user), instance or user, user)


def test_export_names_belong_to_their_user_unless_public():
    """Another user can neither import, remove nor squat a private export name; a `public:`
    export can be imported by anyone and removed only by its owner."""
    manager = ResourceManager(num_pages=8, num_embeds=4)
    alice, bob = holder(user="alice"), holder(user="bob")
    pages = manager.alloc_pages(alice, 2)
    manager.export(alice, pages, "secret", persistent=True)
    for attempt in (lambda: manager.import_(bob, "secret"), lambda: manager.unexport(bob, "secret")):
        with pytest.raises(HostError, match="no export named 'secret'") as e:
            attempt()
        assert e.value.kind == ErrorKind.NOT_FOUND
    manager.export(bob, manager.alloc_pages(bob, 1), "secret", persistent=False)  # no squatting
    assert manager.exports_of("alice") == 1 and manager.exports_of("bob") == 1
    manager.export(alice, pages, "public:prefix", persistent=True)
    assert len(manager.import_(bob, "public:prefix")) == 2
    with pytest.raises(HostError, match="belongs to another user") as e:
        manager.unexport(bob, "public:prefix")
    assert e.value.kind == ErrorKind.PERMISSION_DENIED
    with pytest.raises(HostError, match="a public name another user owns") as e:
        manager.export(bob, manager.alloc_pages(bob, 1), "public:prefix", persistent=False)
    assert e.value.kind == ErrorKind.ALREADY_EXISTS
    manager.unexport(alice, "public:prefix")
    manager.unexport(alice, "secret")
    manager.release_instance(alice)
    manager.release_instance(bob)
    assert manager.pages.available == 8 and manager.exports_of(None) == 0


def test_user_quota_spans_the_users_instances_and_is_refunded_at_teardown():
    """quota.user.* sums over one user's instances; other users are not affected; an
    instance's end gives its user back everything but its persistent exports, whose pages
    stay charged to the user until they are removed."""
    book = QuotaBook(QuotaConfig(user=UserQuota(kv_pages=5, exports=1, queues=2)))
    manager = ResourceManager(num_pages=16, num_embeds=4)
    a1, a2, b = holder(book, "alice", "a1"), holder(book, "alice", "a2"), holder(book, "bob")
    manager.alloc_pages(a1, 3)
    with pytest.raises(HostError, match="user alice holds 3 kv pages and asks for 3 more: over "
                                        "its quota quota.user.kv_pages = 5") as e:
        manager.alloc_pages(a2, 3)
    assert e.value.kind == ErrorKind.OUT_OF_RESOURCES and manager.pages.available == 13
    assert len(manager.alloc_pages(b, 4)) == 4  # bob has a quota of his own
    pages = manager.alloc_pages(a2, 1)
    manager.export(a2, pages, "kept", persistent=True)  # a2 holds the page: nothing more to pay
    assert book.usage()["alice"]["kv_pages"] == 4
    with pytest.raises(HostError, match="quota.user.exports = 1"):
        manager.export(a1, pages[:0], "other", persistent=False)
    assert len(manager.import_(a1, "kept")) == 1  # a page alice keeps alive already
    assert book.usage()["alice"]["kv_pages"] == 4 and a1.charges.instance.held["kv_pages"] == 4
    extra = manager.alloc_pages(a2, 1)  # alice holds 5
    bobs = bobs_export(manager, b)
    with pytest.raises(HostError, match="holds 5 kv pages and asks for 1 more"):  # a new page
        manager.import_(a1, bobs)
    manager.release(manager.take_pages(a2, extra), [])
    a1.charges.charge("queues", 2)
    with pytest.raises(HostError, match="quota.user.queues = 2"):
        a2.charges.charge("queues")
    manager.release_instance(a1)
    manager.release_instance(a2)
    assert book.usage()["alice"] == {"kv_pages": 1, "embeds": 0, "queues": 0, "exports": 1,
                                     "subscriptions": 0, "instances": 0, "latency_queues": 0}  # the persistent export's page
    survivor = holder(book, "alice", "a3")
    with pytest.raises(HostError, match="holds 1 kv pages and asks for 5 more"):  # still pinned
        manager.alloc_pages(survivor, 5)
    manager.unexport(survivor, "kept")
    assert book.usage()["alice"]["exports"] == 0 and book.usage()["alice"]["kv_pages"] == 0
    assert manager.pages.available == 11  # bob's 4, and the page of his public export
    assert manager.exports_of("bob") == 1 and book.usage()["bob"]["kv_pages"] == 5


def bobs_export(manager: ResourceManager, bob: InstanceResources) -> str:
    manager.export(bob, manager.alloc_pages(bob, 1), "public:bobs", persistent=True)
    return "public:bobs"


def test_per_user_quota_overrides():
    config = QuotaConfig(user=UserQuota(kv_pages=2),
                         users={"token-big": {"user": {"kv_pages": 6}, "instance": {"cpu_s": 5}}})
    assert config.for_user("token-big")[1].kv_pages == 6 and config.for_user("token-big")[0].cpu_s == 5
    assert config.for_user("token-big")[0].queues == config.instance.queues  # the rest inherited
    book = QuotaBook(config)
    manager = ResourceManager(num_pages=16, num_embeds=4)
    assert len(manager.alloc_pages(holder(book, "token-big"), 6)) == 6
    with pytest.raises(HostError, match="over its quota quota.user.kv_pages = 2"):
        manager.alloc_pages(holder(book, "token-small"), 3)
    with pytest.raises(HostError, match="quota.users.token-big.user.kv_pages = 6"):
        manager.alloc_pages(holder(book, "token-big"), 1)
    with pytest.raises(ConfigError, match="quota.users.x.user.kv_pagez"):
        QuotaConfig(users={"x": {"user": {"kv_pagez": 1}}})


def test_rate_limit_allows_one_seconds_burst_then_paces():
    """GCRA: `per_s` calls at once, then one per 1/per_s; 0 means no limit."""
    limit = RateLimit(4.0)
    assert [limit.reserve(100.0) for _ in range(4)] == [0.0] * 4
    assert [round(limit.reserve(100.0), 3) for _ in range(3)] == [0.25, 0.5, 0.75]
    assert limit.reserve(102.0) == 0.0  # the bucket refilled meanwhile
    assert RateLimit(0.0).reserve(0.0) == 0.0


def test_quotas_and_bounded_waiting_for_a_short_pool():
    """A quota fails at once; a short pool makes an allocation wait (bounded) for releases by
    others, then fail — nothing is taken from another instance."""
    # The pool-full hook runs, under the pool's lock, just before an allocation starts to
    # wait: a's release (which takes the lock) can only come once b waits.
    short_of_pages = threading.Event()
    manager = ResourceManager(num_pages=4, num_embeds=4, wait_s=HANG_S,
                              evict=lambda requester, shortfall, what: short_of_pages.set())
    book = QuotaBook(QuotaConfig(instance=InstanceQuota(kv_pages=3)))
    a, b = holder(book), holder(book)
    held = manager.alloc_pages(a, 3)
    with pytest.raises(HostError, match="quota quota.instance.kv_pages = 3") as e:
        manager.alloc_pages(a, 1)
    assert e.value.kind == ErrorKind.OUT_OF_RESOURCES
    got: list[list[int]] = []
    waiter = threading.Thread(target=lambda: got.append(manager.alloc_pages(b, 3)))
    waiter.start()
    assert short_of_pages.wait(HANG_S)
    manager.release(manager.take_pages(a, held[:2]), [])
    waiter.join(HANG_S)
    assert [len(pages) for pages in got] == [3]  # waited for a's release
    short = ResourceManager(num_pages=2, num_embeds=2, wait_s=0.2)
    c, d = holder(), holder()
    short.alloc_pages(c, 2)
    start = time.monotonic()
    with pytest.raises(HostError, match="1 kv pages requested, 0 free of 2 after waiting 200 ms"):
        short.alloc_pages(d, 1)
    # A lower bound only (the wait's deadline), never an upper one: a loaded machine is slower.
    assert time.monotonic() - start >= 0.2 and len(c.pages.mapping) == 2  # c keeps its pages
    with pytest.raises(HostError):  # more than the pool holds fails at once, no wait
        ResourceManager(num_pages=2, num_embeds=2, wait_s=30).alloc_pages(d, 3)


def test_freed_handle_is_invalid():
    manager = ResourceManager(num_pages=2, num_embeds=2)
    inst = holder()
    (page,) = manager.alloc_pages(inst, 1)
    manager.release(manager.take_pages(inst, [page]), [])
    with pytest.raises(HostError, match="not a live kv page"):
        inst.pages.resolve([page])
    with pytest.raises(HostError, match="appears twice"):
        manager.take_embeds(inst, [1, 1])


def controller_on_fake_backend(config, tmp_path, model_dir):
    """A Controller for a model "m" (8 KV pages, 100 embeds, 64 tokens per batch) whose
    backend is a FakeBackend; both must be shut down by the caller."""
    from pie.control.controller import Controller

    endpoint = f"ipc://{tmp_path}/fake.sock"
    backend = FakeBackend(endpoint)
    handshake = P.HandshakeReply(
        protocol_version=P.PROTOCOL_VERSION, model_name="m", traits=[], page_size=16,
        num_kv_pages=8, num_embeds=100, vocab_size=49152, hidden_size=576, max_batch_tokens=64,
        tokenizer_json=(model_dir / "tokenizer.json").read_text(), eos_token_ids=[2],
        bos_token_id=1, chat_template="", dtype="float32", device="cpu")
    return Controller(config, [endpoint], handshake), backend


def test_instance_session_validates_before_enqueueing(tmp_path, model_dir):
    """Bad handles and arguments fail at the call, with the WIT error kind, not later."""
    from pie.config import PieConfig

    controller, backend = controller_on_fake_backend(PieConfig(), tmp_path, model_dir)
    try:
        a, b = controller.session("a", []), controller.session("b", [])
        qa = a.create_queue("m")
        embeds = a.alloc_emb(qa, 70)
        (page,) = a.alloc_kvpage(qa, 1)
        cases = [
            (lambda: a.forward(qa, [], 0, embeds, [], 0, [], [], None), ErrorKind.INVALID_ARGUMENT,
             "max_batch_tokens = 64"),
            (lambda: a.forward(qa, [99], 1, embeds[:1], [], 0, [], [], None),
             ErrorKind.INVALID_HANDLE, "kv page 99"),
            (lambda: b.forward(b.create_queue("m"), [page], 1, [1], [], 0, [], [], None),
             ErrorKind.INVALID_HANDLE, "not a live kv page"),
            (lambda: a.forward(b.create_queue("m"), [], 0, embeds[:1], [], 0, [], [], None),
             ErrorKind.INVALID_HANDLE, "another instance"),
            (lambda: a.get_next_dist(qa, embeds[0], 10_000), ErrorKind.INVALID_ARGUMENT, "max_dist_k"),
            (lambda: a.create_queue("other-model"), ErrorKind.NOT_FOUND, "no model named"),
            (lambda: a.alloc_kvpage(qa, 100), ErrorKind.OUT_OF_RESOURCES, "free of 8"),
            (lambda: a.set_kv_class([page, 77], "discardable"), ErrorKind.INVALID_HANDLE, "kv page 77"),
            (lambda: b.set_kv_class([page], "pinned"), ErrorKind.INVALID_HANDLE, "not a live kv page"),
        ]
        for call, kind, text in cases:
            with pytest.raises(HostError) as e:
                call()
            assert e.value.kind == kind and text in e.value.message
        assert a.resources.classes == {}  # a refused set-kv-class changed nothing
        a.close()
        assert controller.replicas[0].resources.pages.available == 8
        assert controller.replicas[0].resources.embeds.available == 100
    finally:
        controller.shutdown()
        backend.close()


def test_pending_calls_and_subscriptions_per_instance_are_bounded(tmp_path, model_dir):
    """runtime.max_pending_calls: an instance cannot queue inference calls without bound
    (each holds its arguments in the control process); quota.instance.subscriptions: nor
    hold subscriptions (each keeps a backlog), and dropping one gives its place back."""
    from pie.config import PieConfig, RuntimeConfig

    config = PieConfig(runtime=RuntimeConfig(max_pending_calls=3),
                       quota=QuotaConfig(instance=InstanceQuota(subscriptions=2)))
    controller, backend = controller_on_fake_backend(config, tmp_path, model_dir)
    try:
        a = controller.session("a", [])
        q = a.create_queue("m")
        (embed,) = a.alloc_emb(q, 1)
        accepted = 0
        backend.hold.clear()  # the backend takes the first batch and answers none: calls pile up
        with pytest.raises(HostError, match="runtime.max_pending_calls") as e:
            for _ in range(10):
                a.embed_text(q, [1], [0], [embed])
                accepted += 1
        # 3 waiting when the 4th (or, if the scheduler sent the first to the backend before
        # the queue filled, the 5th) was refused; the scheduler may send one more after.
        assert e.value.kind == ErrorKind.OUT_OF_RESOURCES and accepted in (3, 4) and len(q.pending) <= 3
        backend.hold.set()
        a.synchronize(q)  # markers (and the frees behind dealloc) are never refused
        first = a.subscribe("t1")
        a.subscribe("t2")
        with pytest.raises(HostError, match="quota.instance.subscriptions = 2"):
            a.subscribe("t3")
        a.unsubscribe(first)
        assert a.subscribe("t3") and set(controller.bus.topics) == {("anonymous", "t2"), ("anonymous", "t3")}
        a.close()
        assert controller.bus.topics == {}
    finally:
        controller.shutdown()
        backend.close()


def test_key_value_store_is_capped():
    from pie.control.messaging import KeyValueStore

    store = KeyValueStore(max_bytes=20, quotas=QuotaConfig())
    store.set("u", "a", "x" * 10)
    store.set("u", "a", "y" * 19)  # replacing frees the old value first
    with pytest.raises(HostError, match="kvs_max_bytes = 20") as e:
        store.set("u", "b", "z")
    assert e.value.kind == ErrorKind.OUT_OF_RESOURCES and store.get("u", "b") is None
    store.delete("u", "a")
    store.set("u", "b", "z" * 19)
    assert store.used == 20


def test_key_value_store_keys_belong_to_their_user_unless_public():
    from pie.control.messaging import KeyValueStore

    store = KeyValueStore(max_bytes=1000, quotas=QuotaConfig(user=UserQuota(kvs_bytes=30)))
    store.set("alice", "k", "alice's secret")
    assert store.get("bob", "k") is None  # bob's own namespace
    store.set("bob", "k", "bob's")
    assert store.get("alice", "k") == "alice's secret" and not store.delete("bob", "nothing")
    store.set("alice", "public:motd", "hi")
    assert store.get("bob", "public:motd") == "hi"
    with pytest.raises(HostError, match="belongs to another user") as e:
        store.set("bob", "public:motd", "defaced")
    assert e.value.kind == ErrorKind.PERMISSION_DENIED
    assert not store.delete("bob", "public:motd") and store.get("alice", "public:motd") == "hi"
    with pytest.raises(HostError, match="quota.user.kvs_bytes = 30"):
        store.set("alice", "more", "x" * 20)
    assert store.used_by["alice"] == len("k") + len("alice's secret") + len("public:motd") + 2


def test_a_subscription_keeps_its_newest_messages_up_to_its_backlog():
    """As the WIT says: undelivered messages are buffered per subscription up to the limit,
    the oldest dropped beyond it (and counted); other subscribers and the broadcaster are
    not affected."""
    bus = MessageBus(backlog=2)
    idle, reader = bus.subscribe("idle", "u", "news"), bus.subscribe("reader", "u", "news")
    got = []
    for i in range(4):
        assert bus.broadcast("w", "u", "news", f"n{i}") == 2
        got.append(reader.next().result())
    assert got == ["n0", "n1", "n2", "n3"] and bus.dropped == 2
    assert [idle.next().result() for _ in range(2)] == ["n2", "n3"]
    bus.drop_instance("idle")
    assert bus.broadcast("w", "u", "news", "n4") == 1


def test_topics_belong_to_their_user_and_public_ones_have_one_publisher():
    bus = MessageBus(backlog=8)
    alices = bus.subscribe("a1", "alice", "news")
    assert bus.broadcast("b1", "bob", "news", "from bob") == 0  # bob's own "news"
    assert bus.broadcast("a2", "alice", "news", "from alice") == 1
    assert alices.next().result() == "from alice"
    bobs = bus.subscribe("b1", "bob", "public:feed")
    assert bus.broadcast("a2", "alice", "public:feed", "hello all") == 1
    assert bobs.next().result() == "hello all"
    with pytest.raises(HostError, match="published by another user") as e:
        bus.broadcast("b1", "bob", "public:feed", "spoofed")
    assert e.value.kind == ErrorKind.PERMISSION_DENIED
    bus.drop_instance("a2")  # alice's publisher ended: the topic is free again
    assert bus.broadcast("b1", "bob", "public:feed", "mine now") == 1
    bus.drop_instance("b1")
    bus.drop_instance("a1")
    assert bus.topics == {} and bus.publishers == {}


def test_an_inbox_is_bounded_in_bytes_as_well_as_in_messages():
    """server.max_pending_bytes: a client message that would take an instance's unread
    messages over it is refused (the session turns that into inbox_full); a subscription
    drops its oldest messages until the new one fits."""
    from pie.control.messaging import Inbox

    inbox = Inbox(limit=100, max_bytes=10)
    inbox.put("abcd")
    inbox.put("é" * 3)  # 6 bytes of UTF-8
    with pytest.raises(OverflowError, match="10 bytes of unread messages; 1 more would exceed "
                                             "server.max_pending_bytes = 10"):
        inbox.put("x")
    assert inbox.next().result() == "abcd" and inbox.bytes == 6
    inbox.put("wxyz")
    assert inbox.bytes == 10
    subscription = Inbox(limit=100, drop_oldest=True, max_bytes=10)
    assert [subscription.put(m) for m in ("aaaa", "bbbb", "cc", "dddddddd")] == [0, 0, 0, 2]
    assert [subscription.next().result() for _ in range(2)] == ["cc", "dddddddd"]
    assert subscription.bytes == 0
    assert subscription.put("y" * 11) == 1  # larger than the bound on its own: dropped itself
    assert subscription.messages == deque()


def _http_client(handler, **config):
    import httpx

    from pie.control.http_client import HttpClient

    client = HttpClient(ControlConfig(**config))
    client.client = httpx.Client(transport=httpx.MockTransport(handler))
    return client


def _get(client, url: str):
    """GET `url` through `client` and wait for the answer (raises its HostError)."""
    from pie.control.future import wait_any

    future = client.request("GET", url, [])
    wait_any([future])
    return future.result()


def test_http_responses_are_read_in_pieces_up_to_the_cap():
    """control.http_max_response_bytes: a larger body fails with an `io` error naming the
    key once that much was read (or at once, if it declares a larger Content-Length)."""
    import httpx

    pulled = []

    def body(n: int):
        for _ in range(n):
            pulled.append(1)
            yield b"x" * 1000

    def handler(request: httpx.Request) -> httpx.Response:
        n = int(request.url.params["n"])
        if request.url.path == "/declared":
            return httpx.Response(200, headers={"content-length": str(n * 1000)}, content=b"")
        return httpx.Response(200, content=body(n))

    client = _http_client(handler, http_max_response_bytes=5000)
    assert _get(client, "http://localhost/x?n=5") == (200, "x" * 5000)
    pulled.clear()
    with pytest.raises(HostError) as e:
        _get(client, "http://localhost/x?n=100000")
    assert e.value.kind == ErrorKind.IO
    assert "the response body exceeds control.http_max_response_bytes = 5000 (stopped reading after 6000" \
        in e.value.message
    assert len(pulled) == 6  # not the 100 MB
    with pytest.raises(HostError, match="it declares 6000 bytes"):
        _get(client, "http://localhost/declared?n=6")
    client.close()


def test_http_to_the_servers_own_port_is_refused_on_every_local_address():
    import httpx

    client = _http_client(lambda request: httpx.Response(200, text="ok"),
                          http_allowlist=["127.0.0.1", "localhost", "0.0.0.0", "::1", "example.invalid"])
    client.protect("127.0.0.1", 8080)
    for url in ("http://127.0.0.1:8080/stats", "http://localhost:8080/", "http://0.0.0.0:8080/",
                "http://[::1]:8080/ws"):
        with pytest.raises(HostError, match="is this Pie server's own address") as e:
            client.request("GET", url, [])
        assert e.value.kind == ErrorKind.PERMISSION_DENIED
    assert _get(client, "http://127.0.0.1:8081/") == (200, "ok")
    assert _get(client, "http://localhost/") == (200, "ok")  # port 80
    # A name is refused for the server's port only if it resolves to this machine.
    assert _get(client, "http://example.invalid:8080/") == (200, "ok")
    client.close()


def test_allocation_waiters_are_served_in_launch_order():
    """A short pool serves the oldest instance's waiting allocation first, even one that
    asked later, and a newer request waits behind it though the pool could serve it."""
    manager = ResourceManager(num_pages=4, num_embeds=4, wait_s=HANG_S)
    book = QuotaBook(QuotaConfig())
    holder_, old, new = (InstanceResources(book.open("u"), name, "u", order)
                         for name, order in (("h", 0), ("old", 1), ("new", 2)))
    held = manager.alloc_pages(holder_, 4)
    served: list[str] = []

    def alloc(inst: InstanceResources, count: int) -> None:
        manager.alloc_pages(inst, count)
        served.append(inst.instance_id)

    def waiting(n: int) -> bool:
        with manager.lock:
            return len(manager.waiters.get("kv pages", [])) == n

    newer = threading.Thread(target=alloc, args=(new, 1))
    newer.start()
    until_true(lambda: waiting(1))
    older = threading.Thread(target=alloc, args=(old, 2))
    older.start()
    until_true(lambda: waiting(2))
    manager.release(manager.take_pages(holder_, held[:1]), [])  # enough for `new`, not `old`
    time.sleep(0.2)
    assert served == []  # `new` waits behind the older request
    manager.release(manager.take_pages(holder_, held[1:3]), [])
    older.join(HANG_S)
    newer.join(HANG_S)
    assert served == ["old", "new"]


def until_true(predicate, timeout_s: float = HANG_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)
