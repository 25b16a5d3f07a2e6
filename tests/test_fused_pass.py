"""The backend's fused pass (`protocol.Passes`, pie/backend/passes.py) against the three
handlers it replaces (embed_text + forward + sample), on an in-process engine in fp32."""

from __future__ import annotations

from array import array

import numpy as np
import pytest
import torch

from pie import protocol as P
from pie.backend.engine import Engine
from pie.config import BackendConfig
from pie.control.passes import Output, Pass, encode

PS = 16
TOKENS = [504, 3575, 282, 4649, 314, 7042, 30, 198, 504, 2988, 314, 42, 216, 34, 32, 33,
          40, 29, 32, 33, 29, 34]


@pytest.fixture(scope="module")
def engine(model_dir) -> Engine:
    return Engine(model_dir, BackendConfig(dtype="float32", num_kv_pages=64, num_embeds=512,
                                           page_size=PS))


def item(tokens, pages=(), last_len=0, out=(), offset=0, outputs=(), start=0, embeds=(), mask=None) -> Pass:
    return Pass(None, 0, PS, list(tokens), list(range(start, start + len(tokens))), list(embeds),  # type: ignore[arg-type]
                list(pages), last_len, list(out), offset, mask, list(outputs))


def run(engine: Engine, *items: Pass) -> P.PassesReply:
    return engine.handle(encode(list(items)))  # type: ignore[return-value]


def ints(data: bytes, code: str = "i") -> list:
    values = array(code)
    values.frombytes(data)
    return values.tolist()


def legacy_step(engine: Engine, tokens, pages, last_len, out, offset, start, sampler=(0.0, 0, 1.0, -1)):
    n = len(tokens)
    assert engine.embed_text(P.EmbedText(list(tokens), list(range(start, start + n)),
                                         list(range(200, 200 + n)))).errors == {}
    assert engine.forward(P.Forward(
        list(pages), [0, len(pages)], [last_len], list(range(200, 200 + n)), [0, n], list(out),
        [0, len(out)], [offset], [300], [n - 1], [0, 1], [None])).errors == {}
    t, k, p, seed = sampler
    return engine.sample(P.Sample([300], [t], [k], [p], [seed])).token_ids[0], engine.embeds.vectors[300].clone()


def test_a_fused_step_equals_embed_forward_sample(engine):
    n = len(TOKENS)
    want, want_hidden = legacy_step(engine, TOKENS, [], 0, [0, 1], 0, 0)
    reply = run(engine, item(TOKENS, out=[2, 3], outputs=[Output(n - 1, sample=True, keep=301)]))
    assert reply.errors == {} and ints(reply.tokens) == [want]
    torch.testing.assert_close(engine.embeds.vectors[301], want_hidden, rtol=1e-5, atol=1e-5)
    # a decode step on top of each: same token again
    want2, _ = legacy_step(engine, [want], [0, 1], n - PS, [1], n - PS, n)
    reply = run(engine, item([want], pages=[2, 3], last_len=n - PS, out=[3], offset=n - PS, start=n,
                             outputs=[Output(0, sample=True)]))
    assert ints(reply.tokens) == [want2]


def test_seeded_and_filtered_draws_match_sample(engine):
    for sampler in [(0.8, 0, 1.0, 7), (1.0, 5, 1.0, 123), (0.7, 0, 0.9, 99), (1.3, 40, 0.95, 2**40)]:
        want, _ = legacy_step(engine, TOKENS[:5], [], 0, [10], 0, 0, sampler)
        t, k, p, seed = sampler
        reply = run(engine, item(TOKENS[:5], out=[11], outputs=[
            Output(4, sample=True, temperature=t, top_k=k, top_p=p, seed=seed)]))
        assert ints(reply.tokens) == [want], sampler


def test_scores_and_min_p_follow_the_logits(engine):
    _, hidden = legacy_step(engine, TOKENS[:7], [], 0, [12], 0, 0)
    logits = engine.model.logits(hidden[None])[0]
    logp = torch.log_softmax(logits, -1)
    ids = [5, 504, 30]
    reply = run(engine, item(TOKENS[:7], out=[13], outputs=[
        Output(6, dist_k=4, logprob_ids=ids, entropy=True)]))
    top = torch.topk(logp.exp(), 4)
    assert ints(reply.dist_ids) == top.indices.tolist() and ints(reply.dist_indptr) == [0, 4]
    np.testing.assert_allclose(ints(reply.dist_probs, "f"), top.values.numpy(), rtol=1e-4)
    np.testing.assert_allclose(ints(reply.logprobs, "f"), logp[ids].numpy(), rtol=1e-4)
    np.testing.assert_allclose(ints(reply.entropy, "f"), [float(-(logp.exp() * logp).sum())], rtol=1e-4)
    assert ints(reply.tokens) == [-1]  # nothing asked to draw
    # min-p 0.5 at temperature 1: every draw is a token at least half as likely as the top
    probs = logp.exp()
    allowed = set(torch.nonzero(probs >= 0.5 * probs.max()).flatten().tolist())
    for seed in range(20):
        reply = run(engine, item(TOKENS[:7], out=[13], outputs=[
            Output(6, sample=True, temperature=1.0, min_p=0.5, seed=seed)]))
        assert ints(reply.tokens)[0] in allowed


def test_bad_items_fail_alone(engine):
    good = item(TOKENS[:3], out=[20], outputs=[Output(2, sample=True)])
    alone = ints(run(engine, good).tokens)
    bad = [
        (item([60000], out=[21], outputs=[Output(0, sample=True)]), "token id"),
        (item([5], pages=[999], last_len=1, out=[21], outputs=[Output(0, sample=True)]), "page id"),
        (item([5], out=[21], outputs=[Output(3, sample=True)]), "output index"),
        (item([5], out=[21], embeds=[10**6], outputs=[Output(0, sample=True)]), "embed id"),
        (item([5], out=[21], mask=b"\0\0\0", outputs=[Output(0, sample=True)]), "attention mask"),
        (item([5], out=[21], outputs=[Output(0, sample=True, temperature=-1.0)]), "temperature"),
        (item([5], out=[21], outputs=[Output(0, logprob_ids=[10**6])]), "logprob id"),
    ]
    for b, text in bad:
        reply = run(engine, b, good)
        assert list(reply.errors) == [0] and text in reply.errors[0], (text, reply.errors)
        assert ints(reply.tokens) == [-1] + alone


def test_malformed_columns_fail_the_request(engine):
    msg = encode([item(TOKENS[:3], out=[20], outputs=[Output(2, sample=True)])])
    msg.token_indptr = array("i", [0, 5]).tobytes()
    with pytest.raises(P.ProtocolError, match="token_indptr"):
        engine.handle(msg)
    msg = encode([item(TOKENS[:3], out=[20], outputs=[Output(2, sample=True)])])
    msg.top_p = b"\0\0"
    with pytest.raises(P.ProtocolError, match="top_p"):
        engine.handle(msg)


def floats(data: bytes) -> list:
    return ints(data, "f")


def test_a_batch_equals_its_items_alone(engine):
    """Items of one pass (a prompt, embeds then tokens, a scratch item with two outputs)
    draw and score as they do alone; input embeds stand in for the tokens they embed."""
    assert engine.embed_text(P.EmbedText(TOKENS[:4], [0, 1, 2, 3], [320, 321, 322, 323])).errors == {}
    n = len(TOKENS)
    items = [
        item(TOKENS, out=[30, 31], outputs=[Output(n - 1, sample=True, keep=310)]),
        item(TOKENS[4:9], embeds=[320, 321, 322, 323], start=4, out=[32],
             outputs=[Output(8, sample=True, dist_k=3, entropy=True)]),
        item(TOKENS[5:12], outputs=[Output(2, sample=True), Output(6, sample=True, logprob_ids=[7, 9])]),
    ]
    alone = [run(engine, it) for it in items]
    hidden = engine.embeds.vectors[310].clone()
    together = run(engine, *items)
    assert together.errors == {}
    assert ints(together.tokens) == [t for r in alone for t in ints(r.tokens)]
    torch.testing.assert_close(engine.embeds.vectors[310], hidden, rtol=1e-5, atol=1e-5)
    assert ints(together.dist_ids) == ints(alone[1].dist_ids)
    assert ints(together.dist_indptr) == [0, 0, 3, 3, 3]
    np.testing.assert_allclose(floats(together.dist_probs), floats(alone[1].dist_probs), rtol=1e-4)
    np.testing.assert_allclose(floats(together.entropy)[1], floats(alone[1].entropy)[0], rtol=1e-4)
    np.testing.assert_allclose(floats(together.logprobs), floats(alone[2].logprobs), rtol=1e-4, atol=1e-5)
    # the same positions given as tokens rather than embeds: the same draw
    as_tokens = run(engine, item(TOKENS[:9], out=[32], outputs=[Output(8, sample=True)]))
    assert ints(as_tokens.tokens) == ints(alone[1].tokens)[:1]


def _logits(engine, tokens) -> torch.Tensor:
    run(engine, item(tokens, out=[40], outputs=[Output(len(tokens) - 1, keep=330)]))
    return engine.model.logits(engine.embeds.vectors[330][None])[0]


def test_top_k_top_p_and_allowed_masks_restrict_the_draws(engine):
    logits = _logits(engine, TOKENS[:6])
    t = 2.0
    probs = torch.softmax(logits / t, -1)
    top3 = set(torch.topk(probs, 3).indices.tolist())
    sorted_p, order = torch.sort(probs, descending=True)
    nucleus = set(order[: int(((torch.cumsum(sorted_p, 0) - sorted_p) < 0.5).sum())].tolist())
    assert 1 < len(nucleus) < 1000  # half the mass, in a small part of the vocabulary
    rows = 40
    outputs = ([Output(5, sample=True, temperature=t, top_k=3, seed=s) for s in range(rows)]
               + [Output(5, sample=True, temperature=t, top_k=3) for _ in range(rows)]
               + [Output(5, sample=True, temperature=t, top_p=0.5, seed=s) for s in range(rows)]
               + [Output(5, sample=True, temperature=t, top_p=0.5) for _ in range(rows)]
               + [Output(5, sample=True, temperature=t) for _ in range(rows)])
    drawn = ints(run(engine, item(TOKENS[:6], out=[40], outputs=outputs)).tokens)
    assert set(drawn[: 2 * rows]) <= top3 and len(set(drawn[: 2 * rows])) > 1
    assert set(drawn[2 * rows: 4 * rows]) <= nucleus and len(set(drawn[2 * rows: 4 * rows])) > 1
    assert not set(drawn[4 * rows:]) <= nucleus  # unfiltered: half the mass is outside
    # allowed masks: the draw and the scores see only the allowed tokens
    vocab = engine.model.config.vocab_size
    allowed = [17, 4242, 9000]
    bits = np.zeros(vocab, dtype=bool)
    bits[allowed] = True
    mask = np.packbits(bits, bitorder="little").tobytes()
    empty = bytes(len(mask))
    masked = logits.masked_fill(~torch.from_numpy(bits), float("-inf"))
    good = item(TOKENS[:6], out=[40], outputs=[
        Output(5, sample=True, allowed=mask, logprob_ids=allowed, entropy=True),
        Output(5, sample=True, temperature=1.0, allowed=mask)])
    reply = run(engine, good, item(TOKENS[:6], out=[41], outputs=[Output(5, sample=True, allowed=empty)]))
    assert reply.errors == {1: "the allowed-token mask allows no token"}
    tokens = ints(reply.tokens)
    assert tokens[0] == allowed[int(torch.argmax(logits[allowed]))] and tokens[1] in allowed
    assert tokens[2] == -1
    logp = torch.log_softmax(masked, -1)
    np.testing.assert_allclose(floats(reply.logprobs), logp[allowed].numpy(), rtol=1e-4)
    p = logp.exp()[allowed]
    np.testing.assert_allclose(floats(reply.entropy)[0], float(-(p * p.log()).sum()), rtol=1e-4)


def test_every_bad_value_names_its_item(engine):
    good = item(TOKENS[:3], out=[20], outputs=[Output(2, sample=True)])
    alone = ints(run(engine, good).tokens)
    vocab = engine.model.config.vocab_size
    one = lambda **kw: [Output(0, sample=True, **kw)]  # noqa: E731
    bad = [
        (item([5], pages=[1], last_len=0, out=[21], outputs=one()), "kv_last_page_len"),
        (item([5, 6], out=[21], offset=PS - 1, outputs=one()), "output pages hold"),
        (item([5], pages=[1], last_len=1, out=[21], mask=b"\0", outputs=one()), "nothing to attend"),
        (item([5], out=[21], start=-1, outputs=one()), "position"),
        (item([5], out=[21], outputs=one(top_p=0.0)), "top_p"),
        (item([5], out=[21], outputs=one(min_p=2.0)), "min_p"),
        (item([5], out=[21], outputs=one(temperature=float("nan"))), "temperature"),
        (item([5], out=[21], outputs=[Output(0, dist_k=vocab + 1)]), "dist_k"),
        (item([5], out=[21], outputs=one(keep=10**6)), "keep embed id"),
        (item([5], out=[21], outputs=one(allowed=b"\xff")), "allowed mask"),
        (item([], out=[21], outputs=[]), "no new tokens"),
    ]
    for b, text in bad:
        reply = run(engine, b, good)
        assert list(reply.errors) == [0] and text in reply.errors[0], (text, reply.errors)
        assert ints(reply.tokens)[-1:] == alone and set(ints(reply.tokens)[:-1]) <= {-1}
    assert engine.counters["pass.errors"] >= len(bad)


def test_errors_of_one_batch_go_to_their_items(engine):
    good = item(TOKENS[:3], out=[20], outputs=[Output(2, sample=True)])
    alone = ints(run(engine, good).tokens)[0]
    vocab = engine.model.config.vocab_size
    batch = [
        good,
        item([5, 6, vocab + 3], out=[21], outputs=[Output(2, sample=True)]),
        good,
        item([5], out=[22], outputs=[Output(0, logprob_ids=[1]), Output(0, logprob_ids=[2, -4, vocab])]),
        item([5, 6], out=[23], embeds=[10**6], outputs=[Output(0, sample=True), Output(9, sample=True)]),
        good,
    ]
    reply = run(engine, *batch)
    assert reply.errors == {
        1: f"new token 2: token id {vocab + 3} out of range [0, {vocab})",
        3: f"output 1: logprob id -4 out of range [0, {vocab})",
        4: f"new token 0: input embed id {10**6} out of range [0, {engine.embeds.size})",
    }
    assert ints(reply.tokens) == [alone, -1, alone, -1, -1, -1, -1, alone]


def _one_row_reference(logits, temperature, top_k, top_p, min_p):
    """The filters of one row with a full sort of the vocabulary (the per-row code
    `filtered_probs` replaced): its probabilities must come out bit for bit."""
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_k or top_p < 1:
        sorted_probs, order = torch.sort(probs, descending=True)
        keep = torch.ones_like(sorted_probs, dtype=torch.bool)
        if top_k:
            keep[top_k:] = False
        if top_p < 1:
            keep &= (torch.cumsum(sorted_probs, 0) - sorted_probs) < top_p
        probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_probs[keep])
    if min_p > 0:
        probs = torch.where(probs >= min_p * probs.max(), probs, torch.zeros_like(probs))
    return probs


def test_batched_filters_equal_one_row_with_a_full_sort():
    from pie.backend import sampling

    gen = torch.Generator().manual_seed(0)
    vocab = 20000
    logits = torch.randn(12, vocab, generator=gen) * torch.tensor([0.5, 3.0, 10.0] * 4)[:, None]
    logits[0, 100:900] = 1.0  # ties
    logits[1, ::3] = float("-inf")  # an allowed mask
    temperature = np.array([1.0, 0.7, 1.5, 0.3] * 3, dtype=np.float32)
    top_k = np.array([0, 0, 0, 5, 40, 0, vocab + 5, 0, 1, 0, 300, 0])
    top_p = np.array([0.9, 0.99999, 0.5, 1.0, 0.95, 1.0, 1.0, 0.1, 1.0, 0.999, 0.7, 0.8], dtype=np.float32)
    min_p = np.array([0.0, 0.0, 0.0, 0.0, 0.0, 0.05, 0.0, 0.0, 0.0, 0.5, 0.0, 0.01], dtype=np.float32)
    got = sampling.filtered_probs(logits, temperature, top_k, top_p, min_p)
    for r in range(len(logits)):
        want = _one_row_reference(logits[r], float(temperature[r]), int(top_k[r]), float(top_p[r]),
                                  float(min_p[r]))
        assert torch.equal(got[r], want), r
    # unseeded rows: only tokens with weight are ever drawn
    seeds = np.full(len(logits), -1)
    for _ in range(5):
        drawn = sampling.draw_rows(logits, temperature, top_k, top_p, min_p, seeds, gen)
        assert all(got[r, t] > 0 for r, t in enumerate(drawn))


@pytest.mark.parametrize("context,cuts", [(0, [5, 16]), (5, [3, 11, 2]), (16, [4])])
def test_a_pass_split_into_chunks_computes_what_it_computes_whole(engine, context, cuts):
    """Chunked prefill (`Pass.split`, as the scheduler cuts a long prompt): the chunks run
    one after another, each in its own batch, and the last gives the same distribution
    and hidden state as the whole pass, from a partial page, no context or a full page."""
    if context:
        prefix = run(engine, item(TOKENS[:context], out=[20], outputs=[]))
        assert prefix.errors == {}
    tokens = TOKENS[context:]

    def whole_or_split(out_pages, keep, split):
        last = len(tokens) - 1
        kv, last_len = ([20], context) if context else ([], 0)
        offset = context % PS
        out = ([20] if 0 < context < PS else []) + list(out_pages)
        p = item(tokens, pages=kv, last_len=last_len, out=out, offset=offset, start=context,
                 outputs=[Output(last, dist_k=5, keep=keep)])
        for k in split:
            assert 0 < k <= p.chunkable()
            chunk = p.split(k)
            assert chunk.parent is p and chunk.outputs == []
            assert run(engine, chunk).errors == {}
        reply = run(engine, p)
        assert reply.errors == {}
        return ints(reply.dist_ids), floats(reply.dist_probs)

    # the context page (20) is shared: both variants write the same slots of it
    want = whole_or_split([21, 22], 310, [])
    got = whole_or_split([23, 24], 311, cuts)
    assert got[0] == want[0]
    torch.testing.assert_close(torch.tensor(got[1]), torch.tensor(want[1]), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(engine.embeds.vectors[311], engine.embeds.vectors[310], rtol=1e-4, atol=1e-5)
