"""The fused-pass handler (`protocol.Passes`): embedding, one forward and every sampler of a
batch in one request, where the 42 paper calls need three (embed_text, forward, sample).

Columns arrive packed and are read with `numpy.frombuffer`; every value a peer could get
wrong becomes an error of its item (the rest of the batch runs), and only a malformed
message (columns of the wrong length, offsets that do not rise) fails the whole request.
The checked columns run in `pass_compute.compute`; items granted steps ahead
(`Passes.ahead`) go on in pie/backend/ahead.py once the reply has left.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from pie import protocol as P
from pie.backend import sampling
from pie.backend.ahead import Ahead
from pie.backend.pass_compute import compute

if TYPE_CHECKING:
    from pie.backend.engine import Engine

_TYPES = {
    "token_ids": "<i4", "embed_ids": "<i4", "positions": "<i4", "token_indptr": "<i4",
    "kv_page_ids": "<i4", "kv_page_indptr": "<i4", "kv_last_page_lens": "<i4",
    "out_kv_page_ids": "<i4", "out_kv_page_indptr": "<i4", "out_kv_offsets": "<i4",
    "out_indptr": "<i4", "out_index": "<i4", "flags": "u1", "temperature": "<f4", "top_k": "<i4",
    "top_p": "<f4", "min_p": "<f4", "seed": "<i8", "dist_k": "<i4", "keep_embed": "<i4",
    "logprob_ids": "<i4", "logprob_indptr": "<i4", "copy_before": "<i4", "copy_after": "<i4",
    "bias_ids": "<i4", "bias_values": "<f4", "bias_indptr": "<i4",
    "ahead": "<i4", "stop_ids": "<i4", "stop_indptr": "<i4",
}


def _columns(msg: P.Passes) -> dict[str, np.ndarray]:
    cols = {}
    for name, dtype in _TYPES.items():
        data = getattr(msg, name)
        if len(data) % np.dtype(dtype).itemsize:
            raise P.ProtocolError(f"pass.{name} is not a whole number of {dtype} values")
        values = np.frombuffer(data, dtype=dtype)
        cols[name] = values.astype(np.int64) if dtype[1] == "i" else values
    n = len(cols["kv_last_page_lens"])
    rows = len(cols["out_index"])
    for name in ("copy_before", "copy_after"):
        if len(cols[name]) % 2:
            raise P.ProtocolError(f"pass.{name} must hold (src, dst) page pairs, has {len(cols[name])} ids")
    for name in ("out_kv_offsets",):
        if len(cols[name]) != n:
            raise P.ProtocolError(f"pass.{name} must have {n} entries, has {len(cols[name])}")
    if len(cols["ahead"]) not in (0, n):
        raise P.ProtocolError(f"pass.ahead must have {n} entries or none, has {len(cols['ahead'])}")
    for name in ("embed_ids", "positions"):
        if len(cols[name]) != len(cols["token_ids"]):
            raise P.ProtocolError(f"pass.{name} must be as long as token_ids")
    for name in ("flags", "temperature", "top_k", "top_p", "min_p", "seed", "dist_k", "keep_embed"):
        if len(cols[name]) != rows:
            raise P.ProtocolError(f"pass.{name} must have {rows} entries (one per output row)")
    if len(cols["bias_values"]) != len(cols["bias_ids"]):
        raise P.ProtocolError("pass.bias_values must be as long as bias_ids")
    optional = [("bias_indptr", "bias_ids", rows)] if len(cols["bias_indptr"]) or len(cols["bias_ids"]) else []
    if len(cols["stop_indptr"]) or len(cols["stop_ids"]):
        optional.append(("stop_indptr", "stop_ids", n))
    for ptr, data, items in (("token_indptr", "token_ids", n), ("kv_page_indptr", "kv_page_ids", n),
                             ("out_kv_page_indptr", "out_kv_page_ids", n), ("out_indptr", "out_index", n),
                             ("logprob_indptr", "logprob_ids", rows), *optional):
        indptr = cols[ptr]
        if len(indptr) != items + 1 or indptr[0] != 0 or indptr[-1] != len(cols[data]) \
                or np.any(np.diff(indptr) < 0):
            raise P.ProtocolError(f"pass.{ptr} must have {items + 1} entries rising from 0 to "
                                  f"{len(cols[data])}")
    if msg.attention_masks and len(msg.attention_masks) != n:
        raise P.ProtocolError(f"pass.attention_masks must have {n} entries or none")
    if msg.allowed and len(msg.allowed) != rows:
        raise P.ProtocolError(f"pass.allowed must have {rows} entries or none")
    return cols


def _copy_pages(engine: Engine, pairs: np.ndarray, name: str) -> None:
    """Whole pages (K, V and mask bits), src -> dst pairs: the prefix cache's copies. Only
    the control layer sends them, and a bad id is its bug: the whole request fails."""
    if not len(pairs):
        return
    if np.any((pairs < 0) | (pairs >= engine.num_pages)):
        raise P.ProtocolError(f"pass.{name}: a page id is out of range [0, {engine.num_pages})")
    engine.kv.copy_pages(engine._tensor(pairs[0::2]), engine._tensor(pairs[1::2]))


def _check_values(engine: Engine, c: dict[str, np.ndarray], msg: P.Passes) -> dict[int, str]:
    """Every value a peer could get wrong, one vectorised test per column: {item: the first
    problem of that item}. Checks that need the item's pages (page ids, last-page length,
    output capacity, attention mask) are `forward_item`'s."""
    vocab, n_embeds = engine.model.config.vocab_size, engine.embeds.size
    n = len(c["kv_last_page_lens"])
    tptr, optr, lptr = c["token_indptr"], c["out_indptr"], c["logprob_indptr"]
    errors: dict[int, str] = {}

    def report(bad: np.ndarray, indptr: np.ndarray, what) -> None:
        """Entries `bad` (indices into a column split by `indptr`): their items' error,
        `what(entry, first entry of its item)`, unless the item already has one."""
        if len(bad):
            owners = np.searchsorted(indptr, bad, side="right") - 1
            for item, first in zip(*np.unique(owners, return_index=True)):
                errors.setdefault(int(item), what(int(bad[first]), int(indptr[item])))

    tok, emb, pos = c["token_ids"], c["embed_ids"], c["positions"]
    is_tok = emb == -1
    report(np.flatnonzero(is_tok & ((tok < 0) | (tok >= vocab))), tptr, lambda r, r0:
           f"new token {r - r0}: token id {tok[r]} out of range [0, {vocab})")
    report(np.flatnonzero(is_tok & (pos < 0)), tptr, lambda r, r0:
           f"new token {r - r0}: position {pos[r]} is negative")
    report(np.flatnonzero(~is_tok & ((emb < 0) | (emb >= n_embeds))), tptr, lambda r, r0:
           f"new token {r - r0}: input embed id {emb[r]} out of range [0, {n_embeds})")
    report(np.flatnonzero(np.diff(tptr) == 0), np.arange(n + 1), lambda b, _: "no new tokens")

    n_new = np.repeat(np.diff(tptr), np.diff(optr))  # per output row: its item's new tokens
    index, draw = c["out_index"], (c["flags"] & P.FLAG_SAMPLE) != 0
    temp, top_p, min_p, top_k = c["temperature"], c["top_p"], c["min_p"], c["top_k"]
    dist_k, keep, seed = c["dist_k"], c["keep_embed"], c["seed"]
    row_checks = [
        ((index < 0) | (index >= n_new), lambda j: f"output index {index[j]} out of range [0, {n_new[j]})"),
        (draw & ~(np.isfinite(temp) & (temp >= 0)), lambda j: f"temperature {temp[j]} must be a finite number >= 0"),
        (draw & ~((top_p > 0) & (top_p <= 1)), lambda j: f"top_p {top_p[j]} must be in (0, 1]"),
        (draw & ~((min_p >= 0) & (min_p <= 1)), lambda j: f"min_p {min_p[j]} must be in [0, 1]"),
        (draw & (top_k < 0), lambda j: f"top_k {top_k[j]} must be >= 0 (0 = no limit)"),
        (seed < -1, lambda j: f"seed {seed[j]} must be >= 0, or -1 for unseeded"),
        ((dist_k < 0) | (dist_k > vocab), lambda j: f"dist_k {dist_k[j]} out of range [0, {vocab}]"),
        ((keep < -1) | (keep >= n_embeds), lambda j: f"keep embed id {keep[j]} out of range [0, {n_embeds})"),
    ]
    for bad, text in row_checks:
        report(np.flatnonzero(bad), optr, lambda j, j0, text=text: f"output {j - j0}: {text(j)}")
    lp = c["logprob_ids"]
    bad_lp = np.flatnonzero((lp < 0) | (lp >= vocab))
    lp_rows = np.searchsorted(lptr, bad_lp, side="right") - 1
    first = dict(zip(lp_rows[::-1].tolist(), lp[bad_lp][::-1].tolist()))  # row: its first bad id
    report(lp_rows, optr, lambda j, j0: f"output {j - j0}: logprob id {first[j]} out of range [0, {vocab})")
    if len(c["bias_indptr"]):
        ids, values, bptr = c["bias_ids"], c["bias_values"], c["bias_indptr"]
        bad_bias = np.flatnonzero((ids < 0) | (ids >= vocab) | np.isnan(values) | (values == np.inf))
        bias_rows = np.searchsorted(bptr, bad_bias, side="right") - 1
        report(bias_rows, optr, lambda j, j0: f"output {j - j0}: a bias id out of range [0, {vocab}) "
               "or a bias that is NaN or +inf")
    size = sampling.mask_bytes(vocab)
    bad_mask = [j for j, m in enumerate(msg.allowed) if m is not None and (not isinstance(m, bytes) or len(m) != size)]
    report(np.asarray(bad_mask, dtype=np.int64), optr, lambda j, j0: (
        f"output {j - j0}: allowed mask must be {size} bytes (a bitmask over {vocab} tokens)"))
    return errors


def run_passes(engine: Engine, msg: P.Passes) -> P.PassesReply:
    c = _columns(msg)
    _copy_pages(engine, c["copy_before"], "copy_before")
    errors = _check_values(engine, c, msg)
    tokens, reply = compute(engine, c, msg.attention_masks, msg.allowed, errors)
    _copy_pages(engine, c["copy_after"], "copy_after")
    if len(c["ahead"]):
        engine.ahead = Ahead.start(engine, c, tokens, errors)
        reply.more = engine.ahead is not None
    return reply
