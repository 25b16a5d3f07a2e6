"""The automatic prefix cache (pie/control/prefix_cache.py).

Unit tests drive `PrefixCache` with real `Pass` objects and a real pool; the engine test
checks the backend's page copies; the end-to-end tests run a real `pie serve` (fp32) and
hold the cached answers to HF transformers' greedy tokens.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import hf_greedy

from pie import protocol as P
from pie.backend.engine import Engine
from pie.config import BackendConfig, QuotaConfig
from pie.control.errors import ErrorKind, HostError
from pie.control.passes import Limits, Output, Pass, PassResults, encode, fail
from pie.control.quotas import QuotaBook
from pie.control.resources import InstanceResources, ResourceManager

PS = 16
LIMITS = Limits(PS, 50_000, 4096, 64)


def fresh(tokens: list[int], pages: list[int], scope: str = "alice", run: int | None = None) -> Pass:
    """A pass from the start over `tokens`, on `pages`, sampling after its last token."""
    p = Pass(SimpleNamespace(results=PassResults()), 0, PS, list(tokens), list(range(len(tokens))), [], [], 0, list(pages), 0, None,  # type: ignore[arg-type]
             [Output(len(tokens) - 1, sample=True)], scope=scope)
    if run:
        p.validate(LIMITS, run)
    return p


def after(context: int, tokens: list[int], kv_pages: list[int], out_pages: list[int],
          scope: str = "alice") -> Pass:
    """A pass that continues a context of `context` slots on `kv_pages` (a fill of a live
    context), its slots from the context's end, sampling after its last token."""
    last = context - (len(kv_pages) - 1) * PS
    return Pass(SimpleNamespace(results=PassResults()), 0, PS, list(tokens),  # type: ignore[arg-type]
                list(range(context, context + len(tokens))), [], list(kv_pages), last, list(out_pages),
                context % PS, None, [Output(len(tokens) - 1, sample=True)], scope=scope)


@pytest.fixture
def manager() -> ResourceManager:
    return ResourceManager(num_pages=32, num_embeds=4, prefix_cache_page_size=PS)


def run_once(manager: ResourceManager, p: Pass, ok: bool = True) -> tuple[list[int], list[int]]:
    """prepare + settle, as one batch sent and answered; the batch's copy pairs (before, after)."""
    cache = manager.prefix_cache
    cache.prepare([p])
    wire = encode([p])
    before, after = np.frombuffer(wire.copy_before, "<i4").tolist(), np.frombuffer(wire.copy_after, "<i4").tolist()
    cache.settled(p, ok)
    return before, after


def test_full_pages_are_kept_and_copied_into_a_pass_with_the_same_start(manager):
    cache = manager.prefix_cache
    tokens = list(range(100, 140))  # 40 tokens: 2 full pages
    first = fresh(tokens, manager.pages.alloc(3))
    before, first_after = run_once(manager, first)
    assert before == [] and len(first_after) == 4  # 2 pages copied out after the forward
    assert first_after[0::2] == first.out_pages[:2]
    assert cache.stats()["cached_pages"] == 2
    # Same first 35 tokens: both pages hit; the pass keeps its last 8 tokens.
    pages = manager.pages.alloc(3)
    second = fresh(tokens[:35] + [7] * 5, pages)
    before, after = run_once(manager, second)
    assert before == [first_after[1], pages[0], first_after[3], pages[1]]  # cache page -> own page
    assert after == []  # nothing new to keep: its third page is not full
    assert second.token_ids == tokens[32:35] + [7] * 5 and second.positions == list(range(32, 40))
    assert second.kv_pages == pages[:2] and second.last_len == PS and second.out_pages == pages[2:]
    assert second.outputs[0].index == 7 and second.index_base == 32  # results name the guest's index
    assert cache.stats()["hit_tokens"] == 32


def test_at_least_the_tokens_from_the_first_output_are_computed(manager):
    tokens = list(range(200, 232))  # exactly 2 pages
    run_once(manager, fresh(tokens, manager.pages.alloc(2)))
    again = fresh(tokens, manager.pages.alloc(2))
    run_once(manager, again)
    assert again.tokens == PS  # one page hit: the last token must run to be sampled from
    assert again.index_base == PS and again.outputs[0].index == PS - 1


def test_two_passes_that_start_alike_in_one_batch_compute_their_pages_once(manager):
    cache = manager.prefix_cache
    tokens = list(range(600, 640))
    a, b = fresh(tokens, manager.pages.alloc(3)), fresh(tokens, manager.pages.alloc(3))
    assert cache.prepare([a, b]) == [b]  # b waits for the pages a computes
    assert len(a.saves) == 2 and b.copy_in == [] and b.saves == []
    cache.settled(a, True)
    assert cache.prepare([b]) == []  # held back once, never twice
    assert len(b.copy_in) == 2 and b.tokens == 8
    c = fresh(tokens, manager.pages.alloc(3))
    d = fresh(tokens + [1], manager.pages.alloc(3))
    d.deferred = True  # already held back once: it computes what it must
    assert cache.prepare([c, d]) == []


def test_users_never_share_pages(manager):
    tokens = list(range(300, 340))
    run_once(manager, fresh(tokens, manager.pages.alloc(3), scope="alice"))
    bob = fresh(tokens, manager.pages.alloc(3), scope="bob")
    before, _ = run_once(manager, bob)
    assert before == [] and bob.tokens == 40


def test_a_failed_pass_keeps_nothing_and_frees_its_copies(manager):
    free = manager.pages.available
    p = fresh(list(range(40)), manager.pages.alloc(3))
    manager.prefix_cache.prepare([p])
    assert manager.pages.available == free - 3 - 2  # the pass's 3 pages, 2 cache pages planned
    fail([p], HostError(ErrorKind.INFERENCE_FAILED, "the backend died"))
    assert manager.pages.available == free - 3
    assert manager.prefix_cache.stats()["cached_pages"] == 0
    manager.prefix_cache.prepare([p])  # dropped: nothing planned for it again
    assert p.saves == [] and manager.pages.available == free - 3


def test_a_short_pool_takes_cached_pages_least_recent_first_deepest_first(manager):
    cache = manager.prefix_cache
    old = fresh(list(range(48)), manager.pages.alloc(3))  # 3 pages: a chain
    run_once(manager, old)
    new = fresh(list(range(1000, 1016)) + [1], manager.pages.alloc(2))
    run_once(manager, new)
    for p in (old, new):  # their instances end
        manager.pages.release(p.slot_pages())
    assert manager.pages.available == 32 - 4
    assert cache.reclaim(1) == 1  # the old chain's last page goes first
    probe = fresh(list(range(48)) + [5], manager.pages.alloc(4))
    run_once(manager, probe)
    assert probe.index_base == 2 * PS  # its first two pages were still there
    manager.pages.release(probe.slot_pages())
    # An allocation that needs every page takes them all from the cache.
    inst = InstanceResources(QuotaBook(QuotaConfig()).open("alice"), "i1", "alice")
    assert len(manager.alloc_pages(inst, 32)) == 32
    assert cache.stats()["cached_pages"] == 0


def test_a_page_being_copied_in_outlives_its_eviction(manager):
    cache = manager.prefix_cache
    tokens = list(range(40))
    first = fresh(tokens, manager.pages.alloc(3))
    run_once(manager, first)
    manager.pages.release(first.slot_pages())
    second = fresh(tokens, manager.pages.alloc(3))
    cache.prepare([second])
    hits = [src for src, _ in second.copy_in]
    assert len(hits) == 2
    assert cache.reclaim(5) == 0  # both in use by the copy: out of the index, not yet free
    assert all(manager.pages.refs[h] == 1 for h in hits)
    cache.settled(second, True)
    assert all(manager.pages.refs[h] == 0 for h in hits)


def test_a_run_keeps_the_pages_its_steps_fill(manager):
    cache = manager.prefix_cache
    prompt = list(range(500, 514))  # 14 tokens, then 4 steps: the page fills at step 3
    p = fresh(prompt, manager.pages.alloc(2), run=5)
    drawn = [9, 8, 7, 6]
    for token in drawn:
        cache.prepare([p])
        cache.settled(p, True)
        p.advance(token)
    assert cache.stats()["cached_pages"] == 1  # positions 0-15: the prompt and 2 drawn tokens
    later = fresh(prompt + drawn[:2] + [1], manager.pages.alloc(2))
    cache.prepare([later])
    assert later.index_base == PS


@pytest.fixture(scope="module")
def engine(model_dir) -> Engine:
    return Engine(model_dir, BackendConfig(dtype="float32", num_kv_pages=16, num_embeds=16, page_size=PS))


def scoring(tokens: list[int], scope: str = "alice") -> Pass:
    """A scoring pass from the start: no context, no pages, log-probabilities at its last token."""
    return Pass(SimpleNamespace(results=PassResults()), 0, PS, list(tokens), list(range(len(tokens))), [], [], 0,  # type: ignore[arg-type]
                [], 0, None, [Output(len(tokens) - 1, logprob_ids=[5, 6])], scope=scope)


def test_a_scoring_pass_fills_cache_pages_and_the_next_reads_them_in_place(manager):
    cache, pool = manager.prefix_cache, manager.pages
    free = pool.available
    profile = list(range(400, 440))  # 40 tokens: 2 full pages, then a post
    first = scoring(profile + [1, 2, 3])
    assert cache.cached_tokens(first) == 0
    assert cache.prepare([first]) == []
    # It computes everything, writing its 2 full pages into cache pages and the rest into a
    # page of its own until it settles: 3 pages, none copied.
    assert first.kv_pages == [] and len(first.out_pages) == 3 and first.tokens == 43
    assert [page for _, page in first.fills] == first.out_pages[:2] and first.temp == first.out_pages[2:]
    assert encode([first]).copy_before == b"" and encode([first]).copy_after == b""
    assert pool.available == free - 3
    cached = first.out_pages[:2]
    cache.settled(first, True)
    assert pool.available == free - 2 and cache.stats()["cached_pages"] == 2
    second = scoring(profile + [7, 8])
    assert cache.cached_tokens(second) == 32  # what srjf's estimate subtracts
    assert cache.prepare([second]) == []
    # Reads the 2 cache pages as its context where they lie; computes 10 tokens, writing no KV.
    assert second.kv_pages == cached and second.last_len == PS and second.tokens == 10
    assert second.positions == list(range(32, 42)) and second.outputs[0].index == 9 and second.index_base == 32
    assert second.out_pages == [] and second.temp == [] and encode([second]).copy_before == b""  # no page to keep: no KV
    assert all(pool.refs[page] == 2 for page in cached)  # held while it runs
    assert cache.stats()["hit_tokens"] == 32
    cache.settled(second, True)
    assert pool.available == free - 2 and all(pool.refs[page] == 1 for page in cached)


def test_scoring_passes_alike_in_one_batch_compute_the_pages_once_and_users_stay_apart(manager):
    cache = manager.prefix_cache
    profile = list(range(500, 540))
    a, b, bob = scoring(profile + [1]), scoring(profile + [2]), scoring(profile + [3], scope="bob")
    assert cache.prepare([a, b, bob]) == [b]  # b waits for a's pages; bob's are his own
    assert len(a.fills) == 2 and len(bob.fills) == 2 and bob.kv_pages == []
    cache.settled(a, True)
    cache.settled(bob, True)
    assert cache.prepare([b]) == [] and b.tokens == 9 and len(b.kv_pages) == 2


def test_a_failed_scoring_pass_frees_what_it_took_and_a_short_pool_leaves_it_writing_no_kv(manager):
    cache, pool = manager.prefix_cache, manager.pages
    free = pool.available
    p = scoring(list(range(40)))
    cache.prepare([p])
    fail([p], HostError(ErrorKind.INFERENCE_FAILED, "the backend died"))
    assert pool.available == free and cache.stats()["cached_pages"] == 0
    held = pool.alloc(pool.available - 1)  # one page left, none evictable: a 3-page pass runs as it came
    q = scoring(list(range(100, 140)))
    assert cache.prepare([q]) == [] and q.out_pages == [] and q.kv_pages == [] and q.tokens == 40
    cache.settled(q, True)
    assert pool.available == 1 and cache.stats()["cached_pages"] == 0
    pool.release(held)


def test_a_scoring_pass_with_nothing_to_keep_takes_no_pages(manager):
    cache, pool = manager.prefix_cache, manager.pages
    free = pool.available
    p = scoring(list(range(40)))
    p.outputs[0].index = 0  # an output at its first token (prompt log-probabilities): no page can be kept
    assert cache.prepare([p]) == [] and p.out_pages == [] and p.kv_pages == [] and p.tokens == 40
    assert pool.available == free


def test_the_backend_copies_whole_pages(engine):
    """copy_before / copy_after of a Passes request: K, V and mask bits of whole pages."""
    kv = engine.kv
    g = torch.Generator().manual_seed(0)
    for pool in kv.keys + kv.values:
        pool[3] = torch.randn(pool[3].shape, generator=g)
    kv.masked[3 * PS + 2] = True
    wire = encode([])
    wire.copy_before = np.array([3, 5], dtype="<i4").tobytes()
    wire.copy_after = np.array([3, 6], dtype="<i4").tobytes()
    assert engine.handle(wire).errors == {}
    for pool in kv.keys + kv.values:
        assert torch.equal(pool[5], pool[3]) and torch.equal(pool[6], pool[3])
    assert kv.masked[5 * PS + 2] and kv.masked[6 * PS + 2] and not kv.masked[5 * PS + 1]
    wire.copy_before = np.array([3, 10_000], dtype="<i4").tobytes()
    with pytest.raises(P.ProtocolError, match="copy_before: a page id is out of range"):
        engine.handle(wire)
    wire.copy_before = np.array([3], dtype="<i4").tobytes()
    with pytest.raises(P.ProtocolError, match=r"copy_before must hold \(src, dst\) page pairs"):
        engine.handle(wire)


# --- end to end: a real `pie serve` ----------------------------------------------------------

PROMPT = ("Once upon a time, in a small village at the edge of a great forest, there lived an old "
          "clockmaker who repaired every clock in the valley. One winter morning")


def test_v1_requests_with_a_shared_start_hit_the_cache_and_answer_as_hf(pie_server, hf_model, tokenizer):
    import openai
    from pie_server import TOKEN

    client = openai.OpenAI(base_url=f"http://{pie_server.address}/v1", api_key=TOKEN, max_retries=0)
    def stats() -> dict:
        return pie_server.resources()["prefix_cache"]

    before = stats()
    for suffix in ("", " he", ""):
        text = PROMPT + suffix
        r = client.completions.create(model="smollm2-135m-instruct", prompt=text, max_tokens=8, temperature=0)
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        assert r.choices[0].text == tokenizer.decode(hf_greedy(hf_model, ids, 8), skip_special_tokens=False)
    after = stats()
    n = len(tokenizer.encode(PROMPT, add_special_tokens=False).ids)
    assert after["hit_tokens"] - before["hit_tokens"] >= 2 * (n - 1) // PS * PS
    assert after["lookups"] - before["lookups"] == 3
    r = pie_server.resources()
    assert r["kv_pages_free"] == r["kv_pages_total"]  # cached pages nobody holds count as free


def test_concurrent_requests_with_a_new_shared_start_prefill_it_once(pie_server, hf_model, tokenizer):
    import asyncio

    import openai
    from pie_server import TOKEN

    text = "A new prompt that no request has sent before: " + PROMPT
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    before = pie_server.resources()["prefix_cache"]

    async def both():
        # Opened and closed inside the loop: a client left to the garbage collector closes
        # its connections on a loop that has ended, and the error surfaced in a later test.
        async with openai.AsyncOpenAI(base_url=f"http://{pie_server.address}/v1", api_key=TOKEN,
                                      max_retries=0) as client:
            return await asyncio.gather(*(client.completions.create(
                model="smollm2-135m-instruct", prompt=text, max_tokens=4, temperature=0) for _ in range(2)))

    answers = asyncio.run(both())
    expected = tokenizer.decode(hf_greedy(hf_model, ids, 4), skip_special_tokens=False)
    assert [a.choices[0].text for a in answers] == [expected, expected]
    after = pie_server.resources()["prefix_cache"]
    assert after["hit_tokens"] - before["hit_tokens"] == (len(ids) - 1) // PS * PS  # the second copied them


def test_turns_filled_into_a_live_context_hit_the_cache_and_answer_as_hf(pie_server, hf_model, tokenizer):
    """`probe turns`: each turn is a fill that continues the context (after 8 decoded tokens);
    a second run of the same conversation copies the pages the first one's turns completed,
    not only those of its first pass, and both decode HF's greedy tokens."""
    import json

    from pie_server import build, run_inferlet

    turns = [PROMPT, " Then the clockmaker opened the door and looked at the snow that had fallen",
             " overnight on the roofs of the houses, the church tower and the old bridge over the river"]
    program = build("probe")
    before = pie_server.resources()["prefix_cache"]
    runs = []
    for _ in range(2):
        run = run_inferlet(pie_server, program, ["turns", *turns])
        assert run.reason == "finished", run.messages
        runs.append(json.loads(run.messages[0]))
    hits = pie_server.resources()["prefix_cache"]["hit_tokens"] - before["hit_tokens"]
    assert runs[0] == runs[1]
    tokens, generated = runs[0]["tokens"], runs[0]["generated"]
    seq: list[int] = []
    for text, n in zip(turns, generated):
        seq += tokenizer.encode(text, add_special_tokens=False).ids
        assert tokens[len(seq):len(seq) + n] == hf_greedy(hf_model, seq, n)
        seq = tokens[:len(seq) + n]
    first_pass = len(tokenizer.encode(PROMPT, add_special_tokens=False).ids) - 1
    assert hits > (first_pass // PS) * PS  # the second run reused pages of later turns too
    assert hits >= (len(tokens) - 2 * 8) // PS * PS - PS


def test_results_name_the_index_the_guest_gave_after_cached_pages_were_skipped(manager):
    from array import array

    from pie.control.passes import settle

    tokens = list(range(700, 740))
    run_once(manager, fresh(tokens, manager.pages.alloc(3)))
    p = Pass(SimpleNamespace(results=PassResults()), 0, PS, tokens, list(range(40)), [], [], 0,  # type: ignore[arg-type]
             manager.pages.alloc(3), 0, None, [Output(39, dist_k=2)], scope="alice")
    p.queue.results.opened()
    manager.prefix_cache.prepare([p])
    assert p.index_base == 32 and p.outputs[0].index == 7
    reply = P.PassesReply(tokens=array("i", [-1]).tobytes(), entropy=array("f", [float("nan")]).tobytes(),
                          logprobs=b"", dist_ids=array("i", [5, 6]).tobytes(),
                          dist_probs=array("f", [0.75, 0.25]).tobytes(), dist_indptr=array("i", [0, 2]).tobytes())
    assert settle([p], reply)[0] == []
    [(_, status, _, details, _)] = p.queue.results.take()
    assert status == "done" and [d["index"] for d in details] == [39]


def test_a_pass_continuing_known_pages_reuses_and_keeps_pages_as_one_from_the_start(manager):
    cache = manager.prefix_cache
    system, turn = list(range(800, 820)), list(range(900, 940))  # 20 + 40 tokens: 3 full pages
    # One instance fills its context in two passes: the second continues the partial page.
    a, b, c, d = manager.pages.alloc(4)
    run_once(manager, fresh(system, [a, b]))
    second = after(20, turn, [a, b], [b, c, d])
    _, saved = run_once(manager, second)
    assert second.prefix is not None and saved[0::2] == [b, c]  # pages 1 and 2 completed here
    assert cache.stats()["cached_pages"] == 3
    # Another instance from the start with the whole text copies all three.
    whole = fresh(system + turn + [1], manager.pages.alloc(4))
    run_once(manager, whole)
    assert whole.index_base == 3 * PS
    # Another in two passes: the continuation copies pages 1-2 over its partial page and
    # the next, and computes only what is left.
    e, f, g, h = manager.pages.alloc(4)
    run_once(manager, fresh(system, [e, f]))
    again = after(20, turn + [1], [e, f], [f, g, h])
    before, _ = run_once(manager, again)
    assert before[1::2] == [f, g]  # its own partial page, then the next
    assert again.index_base == 3 * PS - 20 and again.token_ids == turn[28:] + [1]
    assert again.positions == list(range(48, 61))
    assert again.kv_pages == [e, f, g] and again.last_len == PS and again.out_pages == [h]


def test_a_page_written_by_another_command_is_no_longer_known(manager):
    cache = manager.prefix_cache
    a, b, c, d = manager.pages.alloc(4)
    run_once(manager, fresh(list(range(20)), [a, b]))
    cache.overwritten([SimpleNamespace(writes=frozenset({("p", b)}))])  # e.g. a mask on it
    second = after(20, list(range(20, 60)), [a, b], [b, c, d])
    _, saved = run_once(manager, second)
    assert second.prefix is None and saved == []


def test_a_record_is_not_made_after_a_later_writer_was_sent(manager):
    cache = manager.prefix_cache
    a, b, c, d = manager.pages.alloc(4)
    first = fresh(list(range(20)), [a, b])
    cache.prepare([first])
    cache.overwritten([SimpleNamespace(writes=frozenset({("p", b)}))])  # sent before first's reply
    cache.settled(first, True)
    second = after(20, list(range(20, 60)), [a, b], [b, c, d])
    cache.prepare([second])
    assert second.prefix is None


def test_continuing_another_users_or_a_contested_page_is_unknown(manager):
    cache = manager.prefix_cache
    a, b, c, d, e = manager.pages.alloc(5)
    run_once(manager, fresh(list(range(20)), [a, b]))
    bob = after(20, list(range(20, 60)), [a, b], [b, c, d], scope="bob")
    cache.prepare([bob])
    assert bob.prefix is None
    cache.settled(bob, False)
    run_once(manager, fresh(list(range(20)), [a, b]))
    mine = after(20, list(range(20, 60)), [a, b], [b, c, d])
    other = fresh(list(range(5)), [a])  # another pass of the batch writes page a
    cache.prepare([mine, other])
    assert mine.prefix is None and other.prefix is not None
