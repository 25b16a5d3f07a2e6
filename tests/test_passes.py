"""The fused pass in the control layer (`pie/control/passes.py` + the scheduler), on the fake
backend of test_control.py: checks at the call, results through `take`, host-side runs that
advance without the instance, cancellation, and teardown with passes in flight."""

from __future__ import annotations

import threading
import time
from array import array

import pytest
from test_control import controller_on_fake_backend

from pie.config import PieConfig
from pie.control.errors import ErrorKind, HostError
from pie.control.passes import Output
from pie.control.text_echo import TextEcho

PS = 16  # the fake model's page size


@pytest.fixture
def fake(tmp_path, model_dir):
    controller, backend = controller_on_fake_backend(PieConfig(), tmp_path, model_dir)
    yield controller, backend
    controller.shutdown()
    backend.close()


def sampled(index: int, **kw) -> Output:
    return Output(index=index, sample=True, **kw)


def submit(session, q, tokens, *, run=None, kv=(), last_len=0, out=(), offset=0,
           outputs=None, stop=(), mask=None, stream=True):
    n = len(tokens)
    outputs = [sampled(n - 1)] if outputs is None else outputs
    return session.submit_pass(q, run, stream=stream, token_ids=list(tokens), positions=list(range(n)), embeds=[],
                               kv_pages=list(kv), last_len=last_len, out_pages=list(out),
                               out_offset=offset, mask=mask, outputs=outputs, stop_tokens=list(stop))


def take_all(session, q) -> list:
    """Take until every pass of q has a final result."""
    results = []
    while True:
        got = session.take(q, True)
        if not got:
            return results
        results += got


def wait_for(condition, limit_s: float = 30.0) -> None:
    """Poll a condition on counters (never a timing assertion: the limit only ends a hang)."""
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, "condition never held"
        time.sleep(0.005)


def columns(msg, name: str, code: str = "i") -> list:
    values = array(code)
    values.frombytes(getattr(msg, name))
    return values.tolist()


def test_execute_returns_one_result_through_take(fake):
    controller, backend = fake
    a = controller.session("a", [])
    q = a.create_queue("m")
    pages = a.alloc_kvpage(q, 1)
    pid = submit(a, q, [5, 6, 7], out=pages, outputs=[sampled(2), Output(index=0, entropy=True)])
    ((got_id, status, tokens, details, error),) = take_all(a, q)
    assert (got_id, status, tokens, error) == (pid, "done", [7], None)
    assert details == [{"index": 0, "top_ids": [], "top_probs": [], "logprobs": [], "entropy": 0.5}]
    assert backend.batches == [("pass", 1)]
    msg = backend.passes[0]
    assert columns(msg, "token_ids") == [5, 6, 7] and columns(msg, "out_index") == [2, 0]
    assert a.usage()["sampled_tokens"] == 1 and a.usage()["forward_tokens"] == 3
    assert a.take(q, True) == []  # nothing in flight: returns at once
    a.close()


def test_run_advances_on_the_host_until_steps_or_a_stop_token(fake):
    controller, backend = fake
    a = controller.session("a", [])
    q = a.create_queue("m")
    pages = a.alloc_kvpage(q, 2)  # prompt 14 + 5 steps - 1 = 18 slots
    pid = submit(a, q, list(range(1, 15)), run=5, out=pages)
    results = take_all(a, q)
    assert [t for r in results for t in r[2]] == [7] * 5 and results[-1][1] == "done"
    assert all(r[0] == pid for r in results)
    assert backend.batches == [("pass", 1)] * 5
    steps = backend.passes
    physical = a.resources.pages.resolve(pages)
    # step k (k >= 1) feeds the drawn token at position 13 + k, written at slot 13 + k
    for k, msg in enumerate(steps[1:], 1):
        slot = 13 + k
        assert columns(msg, "token_ids") == [7] and columns(msg, "positions") == [slot]
        assert columns(msg, "out_kv_page_ids") == [physical[slot // PS]]
        assert columns(msg, "out_kv_offsets") == [slot % PS]
        assert columns(msg, "kv_page_ids") == physical[: (slot - 1) // PS + 1]
        assert columns(msg, "kv_last_page_lens") == [slot - (slot - 1) // PS * PS]
    assert a.usage()["sampled_tokens"] == 5 and a.usage()["forward_tokens"] == 14 + 4

    backend.batches.clear()
    pages3 = a.alloc_kvpage(q, 1)
    submit(a, q, [1, 2], run=6, out=pages3, stream=False)  # one result, at the end
    ((_, status, tokens, _, _),) = take_all(a, q)
    assert (status, tokens) == ("done", [7] * 6) and backend.batches == [("pass", 1)] * 6

    backend.batches.clear()
    pages2 = a.alloc_kvpage(q, 1)
    submit(a, q, [1, 2], run=8, out=pages2, stop=[7])
    assert [t for r in take_all(a, q) for t in r[2]] == [7]  # the stop token ends it
    assert backend.batches == [("pass", 1)]
    a.close()


def test_runs_of_many_instances_share_every_step(fake):
    """Each reply queues every run's next step at once: one batch per step, all instances."""
    controller, backend = fake
    backend.hold.clear()  # the first batch stays in flight until the others are queued
    sessions = [controller.session(f"i{k}", []) for k in range(4)]
    queues = [s.create_queue("m") for s in sessions]
    for k, (s, q) in enumerate(zip(sessions, queues)):
        submit(s, q, [1, 2, 3], run=6, out=s.alloc_kvpage(q, 1))
        wait_for(lambda: backend.batches)  # the first one left alone
    backend.hold.set()
    for s, q in zip(sessions, queues):
        assert sum(len(r[2]) for r in take_all(s, q)) == 6
    # the others catch up with the first's second step, then every step is one batch
    assert [n for kind, n in backend.batches] == [1, 4, 4, 4, 4, 4, 3]
    for s in sessions:
        s.close()


def test_bad_passes_fail_at_the_call_with_the_field_named(fake):
    controller, backend = fake
    a, b = controller.session("a", []), controller.session("b", [])
    q, qb = a.create_queue("m"), b.create_queue("m")
    page = a.alloc_kvpage(q, 1)
    (matcher,) = [a.compile_grammar(q, "regex", "[ab]+")]
    cases = [
        (lambda: submit(a, q, []), ErrorKind.INVALID_ARGUMENT, "at least one new token"),
        (lambda: submit(a, q, [60000]), ErrorKind.INVALID_ARGUMENT, "not below the vocabulary size"),
        (lambda: submit(a, q, [1], outputs=[sampled(1)]), ErrorKind.INVALID_ARGUMENT, "output index 1"),
        (lambda: submit(a, q, [1, 2], outputs=[sampled(0), sampled(0)]), ErrorKind.INVALID_ARGUMENT,
         "repeated"),
        (lambda: submit(a, q, [1], outputs=[sampled(0, top_p=0)]), ErrorKind.INVALID_ARGUMENT, "top-p"),
        (lambda: submit(a, q, [1], outputs=[sampled(0, temperature=-1)]), ErrorKind.INVALID_ARGUMENT,
         "temperature"),
        (lambda: submit(a, q, [1], outputs=[Output(0, dist_k=10_000)]), ErrorKind.INVALID_ARGUMENT,
         "max_dist_k"),
        (lambda: submit(a, q, [1], outputs=[Output(0, allowed=b"\0" * 8)]), ErrorKind.INVALID_ARGUMENT,
         "1536 words"),
        (lambda: submit(a, q, [1], mask=b"\0\0"), ErrorKind.INVALID_ARGUMENT, "attention mask must be 1 bytes"),
        (lambda: submit(a, q, [1] * 65), ErrorKind.INVALID_ARGUMENT, "max_batch_tokens = 64"),
        (lambda: submit(a, q, [1], kv=[99], last_len=1), ErrorKind.INVALID_HANDLE, "kv page 99"),
        (lambda: submit(b, qb, [1], kv=page, last_len=1), ErrorKind.INVALID_HANDLE, "not a live kv page"),
        (lambda: submit(a, qb, [1]), ErrorKind.INVALID_HANDLE, "another instance"),
        (lambda: submit(a, q, [1], outputs=[sampled(0, matcher_id=matcher.id + 1)]),
         ErrorKind.INVALID_HANDLE, "matcher"),
        (lambda: submit(a, q, [1], run=0, out=page), ErrorKind.INVALID_ARGUMENT, "at least 1"),
        (lambda: submit(a, q, [1] * 10, run=8, out=page), ErrorKind.INVALID_ARGUMENT, "needs 17"),
        (lambda: submit(a, q, [1], run=2, out=page, outputs=[Output(0)]), ErrorKind.INVALID_ARGUMENT,
         "exactly one output"),
        (lambda: submit(a, q, [1], run=2, kv=page, last_len=3, out=a.alloc_kvpage(q, 1)),
         ErrorKind.INVALID_ARGUMENT, "continue the context"),
        (lambda: a.cancel_pass(q, 12345), ErrorKind.INVALID_HANDLE, "pass 12345"),
    ]
    for call, kind, text in cases:
        with pytest.raises(HostError) as e:
            call()
        assert e.value.kind == kind and text in e.value.message, (text, e.value.message)
    assert backend.batches == [] and not q.pending
    a.close()
    b.close()


def test_a_runs_next_step_leaves_before_its_instance_is_woken(fake):
    """On a reply the scheduler sends the run's next step first and only then wakes the
    instance waiting for its results: woken first, 32 streaming instances' threads held it
    off the GIL for ~22 ms a step (passes.settle). The waiter's event notes what is in
    flight at the moment it is set (in the scheduler's thread)."""
    import threading

    controller, backend = fake

    class Gate:  # the fake answers one batch per release
        def __init__(self) -> None:
            self.permits = threading.Semaphore(0)

        def wait(self, timeout: float) -> bool:
            return self.permits.acquire(timeout=timeout)

    backend.hold = gate = Gate()
    a = controller.session("a", [])
    q = a.create_queue("m")
    submit(a, q, [1, 2, 3], run=3, out=a.alloc_kvpage(q, 1))
    scheduler = a.replica.scheduler
    in_flight_at_wake: list[list] = []

    class Probe(threading.Event):
        def set(self) -> None:
            in_flight_at_wake.append([c.queue for batch in scheduler.in_flight.values() for c in batch])
            super().set()

    for step in (1, 2):
        wait_for(lambda: len(backend.batches) == step)  # step `step` waits for its answer
        probe = Probe()
        assert q.results._add_waiter(probe)
        gate.permits.release()
        assert probe.wait(30)
        assert in_flight_at_wake[-1] == [q]  # the run's next step had already left
        ((_, status, tokens, _, _),) = a.take(q, True)
        assert (status, tokens) == ("running", [7])
    gate.permits.release()
    assert [r[1] for r in take_all(a, q)] == ["done"]
    a.close()


def test_cancel_stops_a_run_after_its_step_in_flight(fake):
    controller, backend = fake
    a = controller.session("a", [])
    q = a.create_queue("m")
    backend.hold.clear()
    first = submit(a, q, [1, 2], run=10, out=a.alloc_kvpage(q, 1))
    wait_for(lambda: backend.batches)
    second = submit(a, q, [3], out=[])
    a.cancel_pass(q, second)  # still waiting behind the run: never runs
    a.cancel_pass(q, first)  # in flight: its step ends the run
    backend.hold.set()
    results = {r[0]: r for r in take_all(a, q)}
    assert results[second][1:3] == ("cancelled", [])
    assert results[first][1:3] == ("cancelled", [7])
    assert backend.batches == [("pass", 1)]
    a.close()


def test_a_failed_item_fails_only_its_pass(fake):
    controller, backend = fake
    backend.hold.clear()
    a, b = controller.session("a", []), controller.session("b", [])
    qa, qb = a.create_queue("m"), b.create_queue("m")
    submit(a, qa, [1], out=[])
    wait_for(lambda: backend.batches)
    submit(a, qa, [2], out=[])
    submit(b, qb, [3], run=3, out=b.alloc_kvpage(qb, 1))
    backend.pass_errors = {1: {0: "embed id 999 out of range"}}  # batch 1, item 0: a's
    backend.hold.set()
    first, second = take_all(a, qa)
    assert first[1] == "done" and second[1] == "failed"
    assert second[4].kind == ErrorKind.INFERENCE_FAILED and "embed id 999" in second[4].message
    assert [t for r in take_all(b, qb) for t in r[2]] == [7, 7, 7]


def test_teardown_waits_for_the_batch_in_flight_before_freeing_pages(fake):
    """An ending instance's pages go back to the pool only after the batch writing them
    replies: a page handed to another instance is never overwritten by a late write."""
    controller, backend = fake
    a = controller.session("a", [])
    q = a.create_queue("m")
    backend.hold.clear()
    submit(a, q, [1, 2, 3], run=4, out=a.alloc_kvpage(q, 1))
    submit(a, q, [4], out=[])  # queued behind it
    total = controller.replicas[0].resources.pages.size
    wait_for(lambda: backend.batches)
    a.close()
    assert controller.replicas[0].resources.pages.available == total - 1  # still held by the batch
    backend.hold.set()
    wait_for(lambda: controller.replicas[0].resources.pages.available == total)
    assert controller.replicas[0].resources.embeds.available == controller.replicas[0].resources.embeds.size
    assert not q.pending and not a.passes or all(p.queue.closed for p in a.passes.values())


def fake_with_control(tmp_path, model_dir, **control):
    """The fake backend under a control section with `control`'s settings."""
    from pie.config import ControlConfig

    controller, backend = controller_on_fake_backend(
        PieConfig(control=ControlConfig(**control)), tmp_path, model_dir)
    yield controller, backend
    controller.shutdown()
    backend.close()


@pytest.fixture
def chunking(tmp_path, model_dir):
    """The fake backend with control.max_step_tokens = 16: a prefill next to a decoder
    goes 16 tokens per batch."""
    yield from fake_with_control(tmp_path, model_dir, max_step_tokens=16)


def waiting_prompts(controller, count: int, length: int, pages: int) -> list:
    """`count` sessions, each with a queue and one distinct `length`-token prompt submitted
    (nothing to share), sampling at its last token: [(session, queue)]."""
    sessions = [controller.session(f"p{i}", []) for i in range(count)]
    pairs = [(s, s.create_queue("m")) for s in sessions]
    for i, (s, q) in enumerate(pairs):
        submit(s, q, list(range(100 * i, 100 * i + length)), out=s.alloc_kvpage(q, pages),
               outputs=[sampled(length - 1)])
    return pairs


def all_done(pairs: list) -> None:
    """Each (session, queue)'s one pass finished without error."""
    for s, q in pairs:
        ((_, status, _, _, error),) = take_all(s, q)
        assert status == "done" and error is None


def test_a_long_prefill_goes_in_chunks_while_a_run_decodes(chunking):
    """Chunked prefill: each batch holds the decoder's step and at most 16 prefill tokens;
    the chunks write the prompt's slots in order, each attending to the ones before; the
    instance sees one result for its pass."""
    controller, backend = chunking
    d, p = controller.session("d", []), controller.session("p", [])
    qd, qp = d.create_queue("m"), p.create_queue("m")
    backend.hold.clear()
    submit(d, qd, [1, 2, 3], run=8, out=d.alloc_kvpage(qd, 1))
    wait_for(lambda: backend.batches)  # the decoder's first step is in flight
    pages = p.alloc_kvpage(qp, 4)
    prompt = list(range(100, 160))  # 60 tokens, one output at the last
    pid = submit(p, qp, prompt, out=pages, outputs=[sampled(59, dist_k=2)])
    backend.hold.set()
    ((got, status, tokens, details, error),) = take_all(p, qp)
    assert (got, status, tokens, error) == (pid, "done", [7], None) and len(details) == 1
    assert sum(len(r[2]) for r in take_all(d, qd)) == 8
    # batch sizes: the decoder's prefill, then its steps each beside a 16-token chunk
    # (max_step_tokens of prompt; the decoder's row is not counted against it), then the
    # last 28 tokens whole (no tail shorter than a chunk), then the decoder alone
    assert [n for _, n in backend.batches][:5] == [1, 2, 2, 2, 1]
    assert [len(columns(m, "token_ids")) for m in backend.passes[1:4]] == [16 + 1, 16 + 1, 28 + 1]
    # beside a chunk the decoder is granted no steps ahead: they would run without the
    # prompt's next chunk, which waits for the reply; beside the prompt's last part neither:
    # one grant for the batch, and the prompt's pass (no run) takes none, its queue held
    # until the batch's final step
    assert [bool(m.ahead) for m in backend.passes[1:4]] == [False] * 3 and backend.passes[4].ahead
    physical = p.resources.pages.resolve(pages)
    seen = 0
    for msg in backend.passes[1:4]:
        optr = columns(msg, "out_kv_page_ids"), columns(msg, "out_kv_page_indptr")
        item = next(i for i in range(2) if optr[0][optr[1][i]] in physical)  # the prefill's
        tptr = columns(msg, "token_indptr")
        ids = columns(msg, "token_ids")[tptr[item]:tptr[item + 1]]
        assert ids == prompt[seen:seen + len(ids)]
        kvptr = columns(msg, "kv_page_indptr")
        kv = columns(msg, "kv_page_ids")[kvptr[item]:kvptr[item + 1]]
        lens = columns(msg, "kv_last_page_lens")[item]
        context = (len(kv) - 1) * PS + lens if kv else 0
        assert context == seen and kv == physical[:len(kv)]  # everything before it
        out = optr[0][optr[1][item]:optr[1][item + 1]]
        assert out[0] == physical[seen // PS] and columns(msg, "out_kv_offsets")[item] == seen % PS
        outputs = columns(msg, "out_indptr")
        last = seen + len(ids) == len(prompt)
        assert outputs[item + 1] - outputs[item] == (1 if last else 0)  # chunks compute nothing
        if last:
            assert columns(msg, "out_index")[outputs[item]] == len(ids) - 1
        seen += len(ids)
    assert seen == 60
    d.close()
    p.close()


def test_prefills_that_outnumber_the_decoders_go_whole(chunking):
    """Chunking protects decoders only while they are at least as many as the prefills
    waiting: at the start of a wave (one early decoder, the rest of the wave prefilling)
    chunking spread 32 prompts over ~18 small batches and cost 25% against the direct
    driver (benchmarks/overhead.py); the prefills now ride one batch beside the decoder."""
    controller, backend = chunking
    d = controller.session("d", [])
    qd = d.create_queue("m")
    backend.hold.clear()
    submit(d, qd, [1, 2, 3], run=4, out=d.alloc_kvpage(qd, 1))
    wait_for(lambda: backend.batches)  # the decoder's prefill is in flight
    prompts = waiting_prompts(controller, 2, 24, 2)
    backend.hold.set()
    all_done(prompts)
    # the decoder's prefill, then one batch: its step and both 24-token prompts whole
    # (chunking would have sent 16 prefill tokens beside the step)
    assert [n for _, n in backend.batches][:2] == [1, 3]
    assert columns(backend.passes[1], "token_indptr")[-1] == 1 + 24 + 24
    for s in [d, *(s for s, _ in prompts)]:
        s.close()


@pytest.fixture
def backlog(tmp_path, model_dir):
    """The fake backend with control.max_step_tokens = 16 and prefill_batch_tokens = 48."""
    yield from fake_with_control(tmp_path, model_dir, max_step_tokens=16, prefill_batch_tokens=48)


def test_a_wave_of_prompts_goes_in_batches_of_prefill_batch_tokens(backlog):
    """Prompts that outnumber the decoders go whole, oldest first, at most
    control.prefill_batch_tokens of them a batch, the decoder riding every batch: the first
    ones start decoding while the rest prefill (a 32-client wave waited 15 s for one batch
    of all its prompts; in batches of 512 tokens its mean time to first token was 7 s)."""
    controller, backend = backlog
    d = controller.session("d", [])
    qd = d.create_queue("m")
    backend.hold.clear()
    submit(d, qd, [1, 2, 3], run=4, out=d.alloc_kvpage(qd, 1))
    wait_for(lambda: backend.batches)  # the decoder's prefill is in flight
    prompts = waiting_prompts(controller, 3, 24, 2)
    backend.hold.set()
    all_done(prompts)
    # the decoder's prefill, then its step beside the two oldest 24-token prompts (48 tokens;
    # the third would pass the cap), then the third prompt beside the next step
    assert [n for _, n in backend.batches][:2] == [1, 3]
    assert columns(backend.passes[1], "token_indptr")[-1] == 1 + 48
    for s in [d, *(s for s, _ in prompts)]:
        s.close()


def prompts_beside_two_decoders(backlog, prompt_tokens: int):
    """Two decoders (3-token prompts, 6-token runs), then two prompts of `prompt_tokens`
    waiting while the decoders' prefill is held; every pass done and closed. The backend."""
    controller, backend = backlog
    decoders = [controller.session(f"d{i}", []) for i in range(2)]
    dq = [s.create_queue("m") for s in decoders]
    backend.hold.clear()
    for s, q in zip(decoders, dq):
        submit(s, q, [1, 2, 3], run=6, out=s.alloc_kvpage(q, 1))
    wait_for(lambda: backend.batches)
    prompts = waiting_prompts(controller, 2, prompt_tokens, 3)
    backend.hold.set()
    all_done(prompts)
    for s in decoders + [s for s, _ in prompts]:
        s.close()
    return backend


def test_prompts_beside_decoders_start_and_finish_a_batch_apart(backlog):
    """While decoders are at least as many as the prompts waiting, a batch carries the
    decoders and max_step_tokens of prompt (16 here; the decoders' rows not counted), a
    prompt that would leave at most that much goes whole, and a prompt that finished does
    not keep the next from starting: two 40-token prompts beside two decoders go 16, then
    24 (whole) beside the other's first 16, then its last 24. They finish one batch apart,
    so they do not come back together (the old budget, 16 per waiting prompt, sent them
    side by side in every batch)."""
    backend = prompts_beside_two_decoders(backlog, 40)
    sizes = [columns(m, "token_indptr")[-1] for m in backend.passes[:4]]
    assert sizes == [2 * 3, 2 + 16, 2 + 24 + 16, 2 + 24]
    outputs = [columns(m, "out_indptr")[-1] for m in backend.passes[1:4]]
    assert outputs == [2, 3, 3]  # the decoders' two draws, plus one prompt's first token


@pytest.mark.parametrize("prompt_tokens, sizes", [(20, [2 * 3, 2 + 20 + 20]),
                                                  (30, [2 * 3, 2 + 30 + 16, 2 + 14])])
def test_short_prompts_beside_decoders_go_whole_up_to_prefill_batch_tokens(backlog, prompt_tokens, sizes):
    """Prompts that fit one step's budget and a chunk (16 + 16 here) go whole beside the
    decoders while the batch's prompts stay within control.prefill_batch_tokens (48 here),
    the bound a backlog batch keeps; past it they keep to the budget: two 20-token prompts
    go in one batch, two 30-token ones as the first whole beside the second's first chunk.
    Without the cap every such prompt went whole in one batch, up to max_batch_tokens; on
    the budget alone (two a step) the 32 chat prompts of benchmarks/overhead.py's wave took
    37 batches instead of 34 and ~8 % longer."""
    backend = prompts_beside_two_decoders(backlog, prompt_tokens)
    assert [columns(m, "token_indptr")[-1] for m in backend.passes[:len(sizes)]] == sizes


def test_chunking_spares_passes_it_cannot_cut_and_fails_a_pass_whose_chunk_failed(chunking):
    """A pass with a custom mask or an output at its first token goes whole; a chunk that
    fails fails its pass, whose rest never runs, and the decoder beside it goes on."""
    controller, backend = chunking
    d, p = controller.session("d", []), controller.session("p", [])
    qd, qp = d.create_queue("m"), p.create_queue("m")
    backend.hold.clear()
    submit(d, qd, [1, 2, 3], run=6, out=d.alloc_kvpage(qd, 1))
    wait_for(lambda: backend.batches)
    whole = submit(p, qp, list(range(40)), out=p.alloc_kvpage(qp, 3),
                   outputs=[Output(index=0, entropy=True), sampled(39)])
    cut = submit(p, qp, list(range(40)), out=p.alloc_kvpage(qp, 3))
    backend.pass_errors = {2: {1: "kv page 5 out of range"}}  # the first chunk of `cut`
    backend.hold.set()
    results = {r[0]: r for r in take_all(p, qp)}
    assert results[whole][1] == "done" and results[cut][1] == "failed"
    assert "kv page 5 out of range" in results[cut][4].message
    assert sum(len(r[2]) for r in take_all(d, qd)) == 6
    # `whole` rode one batch with 40 tokens; `cut`'s first 16 tokens failed: no more chunks
    sizes = [len(columns(m, "token_ids")) for m in backend.passes]
    assert sizes[:3] == [3, 41, 17] and all(s == 1 for s in sizes[3:])
    d.close()
    p.close()


def test_a_streaming_run_wakes_its_taker_once_per_stream_interval_and_at_its_end():
    """control.stream_interval = 3: results are listed (and `take`'s waiter woken) when 3
    tokens wait, and whatever is left when the run ends."""
    from pie.control.command import CommandQueue
    from pie.control.passes import Pass, PassResults, Status

    results = PassResults()
    p = Pass(CommandQueue("i"), 1, 16, [1], [0], [], [], 0, [], 0, None, [], stream_every=3)
    results.opened()
    for token in (10, 11):
        results.publish(p, Status.RUNNING, [token])
        assert not results.done()
    results.publish(p, Status.RUNNING, [12])
    assert results.done() and results.take() == [(1, Status.RUNNING, [10, 11, 12], [], None)]
    results.publish(p, Status.RUNNING, [13])
    assert not results.done()
    results.publish(p, Status.DONE, [14])
    assert results.take() == [(1, Status.DONE, [13, 14], [], None)] and results.idle()


def test_settle_records_results_and_leaves_the_wake_to_its_caller():
    """`settle` lists a pass's tokens at once but returns the waiting threads' events
    instead of setting them: the scheduler sets them after its next send."""
    import threading

    from pie import protocol as P
    from pie.control.command import CommandQueue
    from pie.control.passes import Pass, settle

    queue = CommandQueue("i")
    p = Pass(queue, 1, 16, [1], [0], [], [], 0, [], 0, None, [sampled(0)])
    queue.results.opened()
    event = threading.Event()
    assert queue.results._add_waiter(event)
    reply = P.PassesReply(tokens=array("i", [9]).tobytes(), entropy=array("f", [0.0]).tobytes(), logprobs=b"",
                          dist_ids=b"", dist_probs=b"", dist_indptr=bytes(8))
    runs, wakes = settle([p], reply)
    assert runs == [] and wakes == [event] and not event.is_set()
    assert queue.results.take() == [(1, "done", [9], [], None)]



# --- steps the backend takes on its own (Passes.ahead; the fake steps as the backend does) ---


def test_steps_taken_ahead_are_published_and_the_run_goes_on_from_them(fake):
    """A run's first step (slots 0-2) is granted the rest of its page but the page's last
    slot (12 steps); the scheduler sends the page-completing step itself (no grant), then
    grants the next page's steps up to the run's end. The tokens arrive in order, and each
    step the scheduler sends starts where the backend's left off."""
    controller, backend = fake
    backend.step_ahead = True
    a = controller.session("a", [])
    q = a.create_queue("m")
    pages = a.alloc_kvpage(q, 2)
    pid = submit(a, q, [1, 2, 3], run=20, out=pages)
    results = take_all(a, q)
    window = [100 + k for k in range(1, 13)]
    assert [t for r in results for t in r[2]] == [7, *window, 7, 7, 101, 102, 103, 104, 105]
    assert results[-1][:2] == (pid, "done")
    assert [columns(m, "ahead") for m in backend.passes] == [[12], [], [5]]  # no grant: no column
    physical = a.resources.pages.resolve(pages)
    after = backend.passes[1]  # the step after the first window: slot 15, the page's last
    assert columns(after, "token_ids") == [window[-1]] and columns(after, "positions") == [15]
    assert columns(after, "out_kv_page_ids") == [physical[0]] and columns(after, "out_kv_offsets") == [15]
    assert columns(backend.passes[2], "positions") == [16]
    stats = controller.stats()["scheduler"]
    assert stats["ahead_steps"] == 17 and stats["interrupts"] == 0
    a.close()


def test_runs_in_one_batch_get_one_grant_the_least_of_theirs(fake):
    """Two runs at different offsets in their pages share a batch: both are granted the
    lesser number of steps ahead (6: the second's 9th slot leaves 6 before its page's last;
    the first's would be 9),
    so neither sits out steps the other takes, its queue busy until the final one."""
    controller, backend = fake
    backend.step_ahead = True
    backend.hold.clear()
    c = controller.session("c", [])
    qc = c.create_queue("m")
    submit(c, qc, [9, 9], out=c.alloc_kvpage(qc, 1), stream=False)  # in flight, unanswered
    wait_for(lambda: backend.batches)
    a, b = controller.session("a", []), controller.session("b", [])
    qa, qb = a.create_queue("m"), b.create_queue("m")
    submit(a, qa, [1, 2, 3], run=10, out=a.alloc_kvpage(qa, 1))
    submit(b, qb, list(range(1, 10)), run=8, out=b.alloc_kvpage(qb, 1))
    backend.hold.set()
    window = [101, 102, 103, 104, 105, 106]
    assert [t for r in take_all(a, qa) for t in r[2]] == [7, *window, 7, 7, 101]
    assert [t for r in take_all(b, qb) for t in r[2]] == [7, *window, 7]
    assert columns(backend.passes[1], "ahead") == [6, 6] and backend.batches[1] == ("pass", 2)
    assert backend.steps[:6] == [[t, t] for t in window]
    for s in (a, b, c):
        s.close()


def test_a_call_waiting_while_steps_run_ahead_interrupts_them_and_rides_the_next_batch(fake):
    controller, backend = fake
    backend.step_ahead = True
    backend.step_gate.clear()  # the backend holds before its first step ahead
    a = controller.session("a", [])
    qa = a.create_queue("m")
    submit(a, qa, [1, 2, 3], run=8, out=a.alloc_kvpage(qa, 1))
    wait_for(backend.stepping.is_set)
    b = controller.session("b", [])
    qb = b.create_queue("m")
    submit(b, qb, [4, 5], out=b.alloc_kvpage(qb, 1), stream=False)
    wait_for(lambda: controller.stats()["scheduler"]["interrupts"] == 1)
    backend.step_gate.set()
    tokens_a = [t for r in take_all(a, qa) for t in r[2]]
    assert [t for r in take_all(b, qb) for t in r[2]] == [7]
    # the Interrupt waited when the backend would have stepped: it took no step ahead, and
    # a's second step went in one batch with b's pass, with no grant (b's queue would have
    # been held through a's steps); a's third step, alone, was granted the rest of its run
    assert backend.batches[:3] == [("pass", 1), ("pass", 2), ("pass", 1)] and backend.interrupts == 1
    assert backend.steps == [[101], [102], [103], [104], [105]]
    assert tokens_a == [7, 7, 7, 101, 102, 103, 104, 105]
    a.close()
    b.close()


def test_a_run_cancelled_while_stepping_ahead_ends_with_its_next_step(fake):
    controller, backend = fake
    backend.step_ahead = True
    backend.step_gate.clear()
    a = controller.session("a", [])
    q = a.create_queue("m")
    pid = submit(a, q, [1, 2, 3], run=10, out=a.alloc_kvpage(q, 1))
    wait_for(backend.stepping.is_set)
    a.cancel_pass(q, pid)
    wait_for(lambda: controller.stats()["scheduler"]["interrupts"] == 1)  # sent, though nothing else waits
    backend.step_gate.set()
    results = take_all(a, q)
    assert results[-1][1] == "cancelled" and [t for r in results for t in r[2]] == [7]
    assert backend.batches == [("pass", 1)]  # nothing more was sent for it
    a.close()


def test_a_stop_string_completed_while_stepping_ahead_ends_the_run_and_interrupts(fake):
    """A `run-text` run (a TextEcho on the pass, the real tokenizer) whose text completes a
    stop string during steps the backend takes on its own: the run ends done with the token
    that completed it, the text sent stops before the stop string, and one Interrupt ends
    the steps ahead (none is drawn after it). Tokens 7, 101, 102, 103 are
    "<gh_stars>", "u", "v", "w"; the stop string "vw" holds "v" back until "w" cuts it."""
    import threading

    from pie.control.text_echo import TextEcho

    controller, backend = fake
    backend.step_ahead = True
    backend.step_permits = threading.Semaphore(0)
    a = controller.session("a", [])
    q = a.create_queue("m")
    sent: list[str] = []
    echo = TextEcho(controller.tokenizer.tokenizer, sent.append, "", "", False, ["vw"], [])
    pid = a.submit_pass(q, 10, stream=False, echo=echo, token_ids=[1, 2, 3], positions=[0, 1, 2], embeds=[],
                        kv_pages=[], last_len=0, out_pages=a.alloc_kvpage(q, 1), out_offset=0, mask=None,
                        outputs=[sampled(2)], stop_tokens=[])
    scheduler = lambda: controller.stats()["scheduler"]  # noqa: E731
    for k in (1, 2, 3):
        backend.step_permits.release()
        wait_for(lambda: scheduler()["ahead_steps"] == k)
    wait_for(lambda: scheduler()["interrupts"] == 1)  # the run ended: its steps ahead are not needed
    backend.step_permits.release()  # the backend finds the Interrupt waiting: an empty final step
    ((got, status, tokens, _, error),) = take_all(a, q)  # one result, at the end
    assert (got, status, tokens, error) == (pid, "done", [7, 101, 102, 103], None)
    assert sent == ["<gh_stars>", "u"] and backend.steps == [[101], [102], [103]]
    wait_for(lambda: backend.interrupts == 1)
    assert backend.batches == [("pass", 1)]  # nothing more was sent for it
    a.close()


def test_teardown_while_stepping_ahead_frees_pages_after_the_final_step(fake):
    """An instance that ends while the backend steps its run on its own: its pages stay
    held until the backend's final step (it still writes them), then all come back; the
    run is not put back on the closed queue, and an Interrupt ends the steps it no longer needs."""
    controller, backend = fake
    backend.step_ahead = True
    backend.step_gate.clear()
    a = controller.session("a", [])
    q = a.create_queue("m")
    submit(a, q, [1, 2, 3], run=10, out=a.alloc_kvpage(q, 1))
    wait_for(backend.stepping.is_set)
    pages = controller.replicas[0].resources.pages
    a.close()
    assert pages.available == pages.size - 1  # the steps ahead still write it
    wait_for(lambda: controller.stats()["scheduler"]["interrupts"] == 1)
    backend.step_gate.set()
    wait_for(lambda: pages.available == pages.size)
    assert backend.batches == [("pass", 1)]  # nothing was sent for the closed queue
    assert backend.interrupts == 1 and backend.steps == []
