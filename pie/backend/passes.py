"""The fused-pass handler (`protocol.Passes`): embedding, one forward and every sampler of a
batch in one request, where the 42 paper calls need three (embed_text, forward, sample).

Columns arrive packed and are read with `numpy.frombuffer`; every value a peer could get
wrong becomes an error of its item (the rest of the batch runs), and only a malformed
message (columns of the wrong length, offsets that do not rise) fails the whole request.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from pie import protocol as P
from pie.backend import sampling
from pie.backend.checks import ItemError

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
    for name in ("embed_ids", "positions"):
        if len(cols[name]) != len(cols["token_ids"]):
            raise P.ProtocolError(f"pass.{name} must be as long as token_ids")
    for name in ("flags", "temperature", "top_k", "top_p", "min_p", "seed", "dist_k", "keep_embed"):
        if len(cols[name]) != rows:
            raise P.ProtocolError(f"pass.{name} must have {rows} entries (one per output row)")
    if len(cols["bias_values"]) != len(cols["bias_ids"]):
        raise P.ProtocolError("pass.bias_values must be as long as bias_ids")
    biases = [("bias_indptr", "bias_ids", rows)] if len(cols["bias_indptr"]) or len(cols["bias_ids"]) else []
    for ptr, data, items in (("token_indptr", "token_ids", n), ("kv_page_indptr", "kv_page_ids", n),
                             ("out_kv_page_indptr", "out_kv_page_ids", n), ("out_indptr", "out_index", n),
                             ("logprob_indptr", "logprob_ids", rows), *biases):
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
    n = len(c["kv_last_page_lens"])
    _copy_pages(engine, c["copy_before"], "copy_before")
    errors = _check_values(engine, c, msg)
    items, token_rows, out_rows, row_items = [], [], [], []
    layout = engine.layout()
    for b in range(n):
        if b in errors:
            continue
        t0, t1 = int(c["token_indptr"][b]), int(c["token_indptr"][b + 1])
        r0, r1 = int(c["out_indptr"][b]), int(c["out_indptr"][b + 1])
        k0, k1 = c["kv_page_indptr"][b], c["kv_page_indptr"][b + 1]
        o0, o1 = c["out_kv_page_indptr"][b], c["out_kv_page_indptr"][b + 1]
        q0 = layout.tokens
        try:
            item = layout.add(c["kv_page_ids"][k0:k1], int(c["kv_last_page_lens"][b]), t1 - t0,
                              c["out_kv_page_ids"][o0:o1], int(c["out_kv_offsets"][b]),
                              msg.attention_masks[b] if msg.attention_masks else None)
        except ItemError as e:
            errors[b] = str(e)
            continue
        items.append(item)
        token_rows.append(np.arange(t0, t1))
        out_rows.append(c["out_index"][r0:r1] + q0)
        row_items.append((b, np.arange(r0, r1)))
    rows_total = len(c["out_index"])
    tokens = np.full(rows_total, -1, dtype=np.int32)
    entropy = np.full(rows_total, np.nan, dtype=np.float32)
    logprobs = np.full(len(c["logprob_ids"]), np.nan, dtype=np.float32)
    dist_counts = np.zeros(rows_total, dtype=np.int64)
    dist_ids: list[np.ndarray] = []
    dist_probs: list[np.ndarray] = []
    if items:
        t = np.concatenate(token_rows)
        rows = np.concatenate([r for _, r in row_items])
        if _greedy_only(c, msg, rows) and engine.takes_greedy(items, len(t)):
            # Every output row draws greedily and asks nothing else: the model's greedy tail
            # (csrc/decode_step.cpp) returns the tokens; no logits leave the kernel.
            tokens[rows] = _forward(engine, items, c, t, np.concatenate(out_rows), greedy=True)[0].numpy()
            engine.counters["pass.greedy_tail"] += 1
        else:
            hidden = _forward(engine, items, c, t, np.concatenate(out_rows))
            keep = c["keep_embed"][rows]
            kept = np.flatnonzero(keep != -1)
            if len(kept):
                ids = engine._tensor(keep[kept])
                engine.embeds.vectors[ids] = hidden[0][engine._tensor(kept)]
                engine.embeds.positions[ids] = hidden[1][engine._tensor(kept)]
            # Logits only for rows that draw or score (a keep-only row needs none).
            need = np.flatnonzero((c["flags"][rows] & (P.FLAG_SAMPLE | P.FLAG_ENTROPY) != 0)
                                  | (c["dist_k"][rows] > 0) | (np.diff(c["logprob_indptr"])[rows] > 0))
            if len(need):
                logits = engine.model.logits(hidden[0][engine._tensor(need)])
                _outputs(engine, msg, c, rows[need], logits, errors, row_items, tokens, entropy,
                         logprobs, dist_counts, dist_ids, dist_probs)
    _copy_pages(engine, c["copy_after"], "copy_after")
    engine._count("pass", n, len(errors), layout.tokens)
    indptr = np.concatenate([[0], np.cumsum(dist_counts)]).astype(np.int32)
    cat = (lambda parts, dt: np.concatenate(parts).astype(dt) if parts else np.zeros(0, dt))
    return P.PassesReply(tokens=tokens.tobytes(), entropy=entropy.tobytes(), logprobs=logprobs.tobytes(),
                         dist_ids=cat(dist_ids, np.int32).tobytes(),
                         dist_probs=cat(dist_probs, np.float32).tobytes(),
                         dist_indptr=indptr.tobytes(), errors=errors)


def _greedy_only(c: dict[str, np.ndarray], msg: P.Passes, rows: np.ndarray) -> bool:
    """Every output row draws a greedy token and nothing else: no entropy, distribution,
    log-probabilities, logit bias, allowed-token mask or kept hidden state."""
    return bool(np.all(c["flags"][rows] == P.FLAG_SAMPLE) and np.all(c["temperature"][rows] == 0)
                and not np.any(c["dist_k"][rows]) and not np.any(np.diff(c["logprob_indptr"])[rows])
                and np.all(c["keep_embed"][rows] == -1)
                and not (len(c["bias_indptr"]) and np.any(np.diff(c["bias_indptr"])[rows]))
                and not (msg.allowed and any(msg.allowed[r] is not None for r in rows.tolist())))


def _forward(engine: Engine, items: list, c: dict[str, np.ndarray], t: np.ndarray,
             out_rows: np.ndarray, greedy: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Embed the admitted token rows inside the pass, run them; (hidden of the output rows,
    their positions), or with `greedy` (Engine.takes_greedy) their argmax tokens first."""
    emb = c["embed_ids"][t]
    is_tok = emb == -1
    hidden_size = engine.model.config.hidden_size
    if is_tok.all():
        x = engine.model.embed(engine._tensor(c["token_ids"][t]))
        positions = engine._tensor(c["positions"][t])
    else:
        x = torch.empty(len(t), hidden_size, dtype=engine.dtype, device=engine.device)
        positions = torch.empty(len(t), dtype=torch.long, device=engine.device)
        tok_rows, emb_rows = engine._tensor(np.flatnonzero(is_tok)), engine._tensor(np.flatnonzero(~is_tok))
        x[tok_rows] = engine.model.embed(engine._tensor(c["token_ids"][t][is_tok]))
        positions[tok_rows] = engine._tensor(c["positions"][t][is_tok])
        ids = engine._tensor(emb[~is_tok])
        x[emb_rows] = engine.embeds.vectors[ids]
        positions[emb_rows] = engine.embeds.positions[ids].to(torch.long)
    rows = engine._tensor(out_rows)
    hidden = engine.run_items(items, x, positions, rows, greedy)
    return hidden, positions[rows]


def _bias(engine: Engine, c: dict[str, np.ndarray], rows: np.ndarray, logits: torch.Tensor,
          errors: dict[int, str], row_items: list[tuple[int, np.ndarray]]) -> None:
    """logits[i, bias_ids] += bias_values for each row's slice (repeated ids add up); a row
    whose every token is then banned (-inf) fails its item."""
    bptr = c["bias_indptr"]
    counts = np.diff(bptr)[rows]
    biased = np.flatnonzero(counts)
    if not len(biased):
        return
    entries = np.concatenate([np.arange(bptr[r], bptr[r + 1]) for r in rows[biased]])
    at = np.repeat(biased, counts[biased])
    logits.index_put_((engine._tensor(at), engine._tensor(c["bias_ids"][entries])),
                      torch.from_numpy(c["bias_values"][entries].copy()).to(logits.device, logits.dtype),
                      accumulate=True)
    dead = np.flatnonzero(torch.isneginf(logits[engine._tensor(biased)]).all(dim=1).cpu().numpy())
    for j in dead.tolist():
        r = int(rows[biased[j]])
        item = next(b for b, its in row_items if r in its)
        errors.setdefault(item, "the logit rules ban every token")
        logits[int(biased[j])] = 0.0  # drawn from, then discarded with the item


def _outputs(engine: Engine, msg: P.Passes, c: dict[str, np.ndarray], rows: np.ndarray,
             logits: torch.Tensor, errors: dict[int, str], row_items: list[tuple[int, np.ndarray]],
             tokens: np.ndarray, entropy: np.ndarray, logprobs: np.ndarray,
             dist_counts: np.ndarray, dist_ids: list, dist_probs: list) -> None:
    """Biases, masks, draws and scores of the admitted rows (`rows[i]` is logits row i)."""
    vocab = engine.model.config.vocab_size
    if len(c["bias_indptr"]):
        _bias(engine, c, rows, logits, errors, row_items)
    masked = [i for i, r in enumerate(rows.tolist()) if msg.allowed and msg.allowed[r] is not None]
    if masked:
        allowed = sampling.allowed_masks([msg.allowed[rows[i]] for i in masked], vocab).to(logits.device)
        for j in np.flatnonzero(~allowed.any(dim=1).cpu().numpy()).tolist():
            r = int(rows[masked[j]])
            item = next(b for b, its in row_items if r in its)
            errors.setdefault(item, "the allowed-token mask allows no token")
            allowed[j] = True
        index = engine._tensor(np.asarray(masked))
        logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
    flags = c["flags"][rows]
    draw = np.flatnonzero(flags & P.FLAG_SAMPLE)
    if len(draw):
        drawn = logits if len(draw) == len(rows) else logits[engine._tensor(draw)]  # no 25 MB copy at batch 128
        picked = sampling.draw_rows(drawn, *(c[k][rows][draw] for k in (
            "temperature", "top_k", "top_p", "min_p", "seed")), rng=engine.rng)
        tokens[rows[draw]] = picked
    dist_k = c["dist_k"][rows]
    lp_counts = np.diff(c["logprob_indptr"])[rows]
    want = np.flatnonzero((dist_k > 0) | (lp_counts > 0) | (flags & P.FLAG_ENTROPY))
    if len(want):
        logp = torch.log_softmax(logits[engine._tensor(want)], dim=-1)
        probs = logp.exp()
        if np.any(flags[want] & P.FLAG_ENTROPY):
            ent = -(probs * torch.nan_to_num(logp, neginf=0.0)).sum(-1)
            on = (flags[want] & P.FLAG_ENTROPY) != 0
            entropy[rows[want][on]] = ent.float().cpu().numpy()[on]
        k_max = int(dist_k[want].max())
        top = torch.topk(probs, k_max, dim=-1) if k_max else None
        for j, i in enumerate(want.tolist()):
            r = int(rows[i])
            lo, hi = c["logprob_indptr"][r], c["logprob_indptr"][r + 1]
            if hi > lo:
                logprobs[lo:hi] = logp[j, engine._tensor(c["logprob_ids"][lo:hi])].float().cpu().numpy()
            if top is not None and dist_k[i]:
                k = int(dist_k[i])
                dist_counts[r] = k
                dist_ids.append(top.indices[j, :k].cpu().numpy())
                dist_probs.append(top.values[j, :k].float().cpu().numpy())
    failed = [its for b, its in row_items if b in errors]  # (an allowed mask emptied)
    for its in failed:
        tokens[its] = -1

