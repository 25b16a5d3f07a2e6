"""Paging invariants of the inference layer, on an in-process engine in fp32."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pie import protocol as P
from pie.backend.engine import Engine
from pie.config import BackendConfig

PS = 16


@pytest.fixture(scope="module")
def engine(model_dir) -> Engine:
    return Engine(model_dir, BackendConfig(dtype="float32", num_kv_pages=64, num_embeds=512,
                                           page_size=PS))


TOKENS = [504, 3575, 282, 4649, 314, 7042, 30, 198, 504, 2988, 314, 42, 216, 34, 32, 33,
          40, 29, 32, 33, 29, 34]  # 22 tokens: spans two pages


def embed(engine: Engine, tokens: list[int], positions: list[int], slots: list[int]) -> None:
    assert engine.embed_text(P.EmbedText(tokens, positions, slots)).errors == {}


def forward(engine: Engine, pages: list[int], last_len: int, embeds: list[int],
            out_pages: list[int], offset: int, out: list[int], out_idx: list[int],
            mask: bytes | None = None) -> None:
    reply = engine.forward(P.Forward(
        kv_page_ids=pages, kv_page_indptr=[0, len(pages)], kv_last_page_lens=[last_len],
        embed_ids=embeds, embed_indptr=[0, len(embeds)], out_kv_page_ids=out_pages,
        out_kv_page_indptr=[0, len(out_pages)], out_kv_offsets=[offset], out_embed_ids=out,
        out_token_indices=out_idx, out_embed_indptr=[0, len(out)], attention_masks=[mask]))
    assert reply.errors == {}


def hidden(engine: Engine, slot: int) -> torch.Tensor:
    return engine.embeds.vectors[slot].clone()


def test_one_forward_equals_two_chained_forwards(engine):
    n = len(TOKENS)
    embed(engine, TOKENS, list(range(n)), list(range(n)))
    # One forward of all tokens into pages 0, 1.
    forward(engine, [], 0, list(range(n)), [0, 1], 0, [100], [n - 1])
    # The same split in two: 10 tokens into page 2, then 12 more appended (page 2 and 3).
    forward(engine, [], 0, list(range(10)), [2], 0, [], [])
    forward(engine, [2], 10, list(range(10, n)), [2, 3], 10, [101], [n - 1 - 10])
    torch.testing.assert_close(hidden(engine, 100), hidden(engine, 101), rtol=1e-5, atol=1e-5)
    one, _ = engine.kv.gather(5, torch.arange(n))
    two, _ = engine.kv.gather(5, torch.arange(2 * PS, 2 * PS + n))
    torch.testing.assert_close(one, two, rtol=1e-5, atol=1e-5)


def test_copied_page_continues_identically(engine):
    n = len(TOKENS)  # pages 4 (16 tokens) and 5 (6 tokens)
    embed(engine, TOKENS, list(range(n)), list(range(n)))
    forward(engine, [], 0, list(range(n)), [4, 5], 0, [], [])
    # Fork: the full page 4 is shared, the partial page 5 is copied token by token into 6.
    assert engine.copy_kvpage(P.CopyKvPage([5], [6], [0], [0], [n - PS])).errors == {}
    embed(engine, [1000, 1000], [n, n], [200, 201])
    forward(engine, [4, 5], n - PS, [200], [5], n - PS, [110], [0])
    forward(engine, [4, 6], n - PS, [201], [6], n - PS, [111], [0])
    assert torch.equal(hidden(engine, 110), hidden(engine, 111))


def test_masked_token_behaves_as_if_absent(engine):
    n, gone = len(TOKENS), 7
    embed(engine, TOKENS, list(range(n)), list(range(n)))
    forward(engine, [], 0, list(range(n)), [8, 9], 0, [], [])
    # The same cached keys without token 7: copy the other slots, compacted, into pages 10, 11.
    keep = [i for i in range(n) if i != gone]
    copies = [(8 + i // PS, i % PS, 10 + j // PS, j % PS) for j, i in enumerate(keep)]
    src, src_off, dst, dst_off = map(list, zip(*copies))
    assert engine.copy_kvpage(P.CopyKvPage(src, dst, src_off, dst_off, [1] * len(keep))).errors == {}
    mask = [False] * PS
    mask[gone] = True
    assert engine.mask_kvpage(P.MaskKvPage([8], [mask])).errors == {}
    embed(engine, [1000, 1000], [n, n], [300, 301])
    forward(engine, [8, 9], n - PS, [300], [], 0, [120], [0])  # masked; writes no page
    forward(engine, [10, 11], n - 1 - PS, [301], [], 0, [121], [0])  # absent
    torch.testing.assert_close(hidden(engine, 120), hidden(engine, 121), rtol=1e-5, atol=1e-5)
    # Unmasked again, the token is seen and the result differs.
    assert engine.mask_kvpage(P.MaskKvPage([8], [[False] * PS])).errors == {}
    forward(engine, [8, 9], n - PS, [300], [], 0, [122], [0])
    assert not torch.allclose(hidden(engine, 120), hidden(engine, 122), atol=1e-4)


def test_custom_mask_matches_page_mask_and_causal_default(engine):
    n = len(TOKENS)
    embed(engine, TOKENS, list(range(n)), list(range(n)))
    forward(engine, [], 0, list(range(n - 3)), [12, 13], 0, [], [])  # 19 cached tokens
    new = list(range(n - 3, n))  # 3 new tokens
    causal = np.tril(np.ones((3, 3), dtype=bool))
    dense = np.concatenate([np.ones((3, n - 3), dtype=bool), causal], axis=1)
    forward(engine, [12, 13], n - 3 - PS, new, [], 0, [130], [2])
    forward(engine, [12, 13], n - 3 - PS, new, [], 0, [131], [2], np.packbits(dense).tobytes())
    torch.testing.assert_close(hidden(engine, 130), hidden(engine, 131), rtol=1e-6, atol=1e-6)
    # Hiding context token 4 with the custom mask equals hiding it with a page mask bit.
    dense[:, 4] = False
    forward(engine, [12, 13], n - 3 - PS, new, [], 0, [132], [2], np.packbits(dense).tobytes())
    mask = [False] * PS
    mask[4] = True
    engine.mask_kvpage(P.MaskKvPage([12], [mask]))
    forward(engine, [12, 13], n - 3 - PS, new, [], 0, [133], [2])
    engine.mask_kvpage(P.MaskKvPage([12], [[False] * PS]))
    torch.testing.assert_close(hidden(engine, 132), hidden(engine, 133), rtol=1e-6, atol=1e-6)
    assert not torch.allclose(hidden(engine, 130), hidden(engine, 132), atol=1e-4)


def test_batched_items_equal_single_items(engine):
    """Two sequences in one forward batch get exactly what each gets alone."""
    a, b = TOKENS[:9], TOKENS[9:]
    embed(engine, a + b, list(range(len(a))) + list(range(len(b))), list(range(len(a) + len(b))))
    ia, ib = list(range(len(a))), list(range(len(a), len(a) + len(b)))
    forward(engine, [], 0, ia, [20], 0, [140], [len(a) - 1])
    forward(engine, [], 0, ib, [21], 0, [141], [len(b) - 1])
    reply = engine.forward(P.Forward(
        kv_page_ids=[], kv_page_indptr=[0, 0, 0], kv_last_page_lens=[0, 0],
        embed_ids=ia + ib, embed_indptr=[0, len(a), len(a) + len(b)],
        out_kv_page_ids=[22, 23], out_kv_page_indptr=[0, 1, 2], out_kv_offsets=[0, 0],
        out_embed_ids=[142, 143], out_token_indices=[len(a) - 1, len(b) - 1],
        out_embed_indptr=[0, 1, 2], attention_masks=[None, None]))
    assert reply.errors == {}
    torch.testing.assert_close(hidden(engine, 140), hidden(engine, 142), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hidden(engine, 141), hidden(engine, 143), rtol=1e-5, atol=1e-5)


def test_allowed_mask_restricts_sampling(engine):
    """`Sample.allowed` (grammar masks): the draw stays inside the mask, greedy or not; a mask
    allowing nothing fails that item only; a mask of the wrong size fails the request."""
    embed(engine, TOKENS[:5], list(range(5)), list(range(5)))
    forward(engine, [], 0, list(range(5)), [30], 0, [150], [4])
    vocab = engine.model.config.vocab_size
    free = engine.sample(P.Sample([150], [0.0], [0], [1.0], [-1])).token_ids[0]

    def mask(tokens: list[int]) -> bytes:
        bits = np.zeros(vocab, dtype=bool)
        bits[tokens] = True
        return np.packbits(bits, bitorder="little").tobytes()

    allowed = [t for t in (17, 4242, 9000) if t != free]
    reply = engine.sample(P.Sample([150] * 4, [0.0, 2.0, 0.0, 0.0], [0] * 4, [1.0] * 4, [1, 2, -1, -1],
                                   allowed=[mask(allowed), mask(allowed), None, mask([])]))
    assert reply.token_ids[0] in allowed and reply.token_ids[1] in allowed
    assert reply.token_ids[2] == free
    assert reply.errors == {3: "the allowed-token mask allows no token"}
    with pytest.raises(P.ProtocolError, match="bitmask"):
        engine.sample(P.Sample([150], [0.0], [0], [1.0], [-1], allowed=[b"\xff"]))


def test_seeds_differing_above_32_bits_draw_differently():
    """torch's CPU generator keeps 32 bits of a seed; the engine folds all 64 in first."""
    from pie.backend.sampling import seed32 as _seed32

    seeds = [7, 7 + 2**32, 7 + 2**40, 7 + 2**63]
    assert len({_seed32(s) for s in seeds}) == len(seeds)
    assert _seed32(7) == _seed32(7) and all(0 <= _seed32(s) < 2**32 for s in seeds)


def test_the_overlap_check_equals_the_slot_sets(engine):
    """`_writes_context` (page ranges in plain ints) says what intersecting the slot lists
    says, on random layouts: repeated and shared pages, offsets, writes over page ends."""
    rng = np.random.default_rng(0)
    ps = engine.page_size
    seen = {True: 0, False: 0}
    for _ in range(2000):
        pages = rng.integers(0, 6, size=rng.integers(1, 5))
        last_len = int(rng.integers(1, ps + 1))
        out_pages = rng.choice(6, size=rng.integers(1, 4), replace=False)
        out_offset = int(rng.integers(0, ps))
        n_new = int(rng.integers(1, len(out_pages) * ps - out_offset + 1))
        context = engine._page_slots(pages)[: (len(pages) - 1) * ps + last_len]
        write = engine._page_slots(out_pages)[out_offset : out_offset + n_new]
        expected = bool(np.isin(write, context).any())
        assert engine._writes_context(pages, last_len, out_pages, out_offset, n_new) == expected
        seen[expected] += 1
    assert min(seen.values()) > 100  # both answers exercised
