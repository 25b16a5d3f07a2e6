"""Running the checked columns of fused passes (`compute`): the forward of the admitted items
and every output row's draw and scores. A request's columns come checked from
pie/backend/passes.py; the steps the backend takes on its own (pie/backend/ahead.py) build
theirs from checked ones.
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


def compute(engine: Engine, c: dict[str, np.ndarray], masks: list[bytes | None],
            allowed: list[bytes | None], errors: dict[int, str],
            counter: str = "pass") -> tuple[np.ndarray, P.PassesReply]:
    """Run the items of checked columns `c` not in `errors` (which gains the items that fail
    here): each output row's drawn token (-1: none) and the whole reply. Shared by a request
    and the steps the backend takes on its own (pie/backend/ahead.py, `counter` "pass.ahead")."""
    n = len(c["kv_last_page_lens"])
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
                              masks[b] if masks else None)
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
        if _greedy_only(c, allowed, rows) and engine.takes_greedy(items, len(t)):
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
                _outputs(engine, allowed, c, rows[need], logits, errors, row_items, tokens, entropy,
                         logprobs, dist_counts, dist_ids, dist_probs)
    engine._count(counter, n, len(errors), layout.tokens)
    indptr = np.concatenate([[0], np.cumsum(dist_counts)]).astype(np.int32)
    cat = (lambda parts, dt: np.concatenate(parts).astype(dt) if parts else np.zeros(0, dt))
    return tokens, P.PassesReply(tokens=tokens.tobytes(), entropy=entropy.tobytes(), logprobs=logprobs.tobytes(),
                                 dist_ids=cat(dist_ids, np.int32).tobytes(),
                                 dist_probs=cat(dist_probs, np.float32).tobytes(),
                                 dist_indptr=indptr.tobytes(), errors=errors)


def _greedy_only(c: dict[str, np.ndarray], allowed: list[bytes | None], rows: np.ndarray) -> bool:
    """Every output row draws a greedy token and nothing else: no entropy, distribution,
    log-probabilities, logit bias, allowed-token mask or kept hidden state."""
    return bool(np.all(c["flags"][rows] == P.FLAG_SAMPLE) and np.all(c["temperature"][rows] == 0)
                and not np.any(c["dist_k"][rows]) and not np.any(np.diff(c["logprob_indptr"])[rows])
                and np.all(c["keep_embed"][rows] == -1)
                and not (len(c["bias_indptr"]) and np.any(np.diff(c["bias_indptr"])[rows]))
                and not (allowed and any(allowed[r] is not None for r in rows.tolist())))


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


def _outputs(engine: Engine, allowed_masks: list[bytes | None], c: dict[str, np.ndarray], rows: np.ndarray,
             logits: torch.Tensor, errors: dict[int, str], row_items: list[tuple[int, np.ndarray]],
             tokens: np.ndarray, entropy: np.ndarray, logprobs: np.ndarray,
             dist_counts: np.ndarray, dist_ids: list, dist_probs: list) -> None:
    """Biases, masks, draws and scores of the admitted rows (`rows[i]` is logits row i)."""
    vocab = engine.model.config.vocab_size
    if len(c["bias_indptr"]):
        _bias(engine, c, rows, logits, errors, row_items)
    masked = [i for i, r in enumerate(rows.tolist()) if allowed_masks and allowed_masks[r] is not None]
    if masked:
        allowed = sampling.allowed_masks([allowed_masks[rows[i]] for i in masked], vocab).to(logits.device)
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

