"""Steps the backend takes on its own (`Passes.ahead`): a host-side run's decode steps
without a round trip to the control layer between them.

The control layer grants each run's pass a number of further steps (docs/fused-pass.md
§2.5). After answering the request, the server (pie/backend/server.py) steps the items that
go on, feeding each its own draw at the next position and slot, and sends one `PassesStep`
per step, until every item has used its steps or drawn a stop token, or a request waits on
the socket. Why: at batch 1 under `pie serve` a token cost ~12.7 ms against a ~10.6 ms fused
step (benchmarks/analysis.md): the rest was the reply's and the next request's trip through
both processes, their message Python and the control layer's settle and encode, which now
run once per ahead window instead of once per token.

Only items whose next step is determined here go on: one output row, at the last new token,
drawing a token and asking for nothing else (no bias, allowed mask, scores or kept state),
whose output slots continue the context. A step's columns are built from checked ones (its
tokens were drawn here), so they skip the request checks; `pass_compute.compute` runs them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from pie import protocol as P
from pie.backend.pass_compute import compute

if TYPE_CHECKING:
    from pie.backend.engine import Engine


@dataclass(slots=True)
class Row:
    """One item that goes on: the request's item index, its pages in slot order, slots
    filled, its next token and position, steps left, stop tokens, sampler (temperature,
    top_k, top_p, min_p) and seed (a seeded sampler's advances by one a step, as
    `Pass.advance` does)."""

    item: int
    pages: np.ndarray
    filled: int
    token: int
    position: int
    left: int
    stops: set[int]
    sampler: tuple[float, int, float, float]
    seed: int


class Ahead:
    """The items of one request that go on (`Row`s)."""

    def __init__(self, engine: Engine, n_items: int, rows: list[Row]):
        self.engine = engine
        self.n_items = n_items
        self.rows = rows

    @classmethod
    def start(cls, engine: Engine, c: dict[str, np.ndarray], tokens: np.ndarray,
              errors: dict[int, str]) -> Ahead | None:
        """The items of a request (checked columns `c`, drawn `tokens` per output row) that
        go on; None if none does."""
        ps, n = engine.page_size, len(c["kv_last_page_lens"])
        stop_ptr = c["stop_indptr"]
        rows = []
        for b in np.flatnonzero(c["ahead"] > 0).tolist():
            r0, r1 = int(c["out_indptr"][b]), int(c["out_indptr"][b + 1])
            t0, t1 = int(c["token_indptr"][b]), int(c["token_indptr"][b + 1])
            if b in errors or r1 - r0 != 1 or not _draws_only(c, r0) or c["out_index"][r0] != t1 - t0 - 1 \
                    or c["embed_ids"][t1 - 1] != -1 or tokens[r0] < 0:
                continue
            stops = set(c["stop_ids"][stop_ptr[b]:stop_ptr[b + 1]].tolist()) if len(stop_ptr) else set()
            if int(tokens[r0]) in stops:
                continue
            pages = _slot_pages(c, b, ps)
            if pages is None:
                continue
            k0, k1 = c["kv_page_indptr"][b], c["kv_page_indptr"][b + 1]
            context = (k1 - k0 - 1) * ps + int(c["kv_last_page_lens"][b]) if k1 > k0 else 0
            filled = context + t1 - t0
            steps = min(int(c["ahead"][b]), len(pages) * ps - filled)
            if steps <= 0:
                continue
            rows.append(Row(b, pages, filled, int(tokens[r0]), int(c["positions"][t1 - 1]) + 1, steps, stops,
                            (float(c["temperature"][r0]), int(c["top_k"][r0]), float(c["top_p"][r0]),
                             float(c["min_p"][r0])), int(c["seed"][r0])))
        return cls(engine, n, rows) if rows else None

    @property
    def done(self) -> bool:
        return not self.rows

    def unstepped(self) -> np.ndarray:
        """A step's tokens where no item stepped."""
        return np.full(self.n_items, -1, dtype=np.int32)

    def abandon(self, reason: str) -> dict[int, str]:
        """Stop every item that goes on: {request item: `reason`}."""
        errors = {r.item: reason for r in self.rows}
        self.rows = []
        return errors

    def step(self) -> tuple[np.ndarray, dict[int, str]]:
        """One decode step of every item that goes on: the token each drew (-1 for items of
        the request that did not step) and the errors of items whose step failed (those stop)."""
        ps, rows = self.engine.page_size, self.rows
        n = len(rows)
        kv, kv_ptr, last, out, off = [], [0], [], [], []
        for r in rows:
            f = r.filled
            k = -(-f // ps)
            kv.append(r.pages[:k])
            kv_ptr.append(kv_ptr[-1] + k)
            last.append(f - (k - 1) * ps)
            out.append(r.pages[f // ps])
            off.append(f % ps)
        ones, zeros = np.arange(n + 1, dtype=np.int64), np.zeros(n, dtype=np.int64)
        samplers = np.array([r.sampler for r in rows], dtype=np.float64).reshape(n, 4)
        c = {
            "token_ids": np.array([r.token for r in rows], dtype=np.int64),
            "embed_ids": zeros - 1, "positions": np.array([r.position for r in rows], dtype=np.int64),
            "token_indptr": ones, "kv_page_ids": np.concatenate(kv), "kv_page_indptr": np.array(kv_ptr),
            "kv_last_page_lens": np.array(last, dtype=np.int64), "out_kv_page_ids": np.array(out, dtype=np.int64),
            "out_kv_page_indptr": ones, "out_kv_offsets": np.array(off, dtype=np.int64),
            "out_indptr": ones, "out_index": zeros, "flags": np.full(n, P.FLAG_SAMPLE, dtype=np.uint8),
            "temperature": samplers[:, 0].astype(np.float32), "top_k": samplers[:, 1].astype(np.int64),
            "top_p": samplers[:, 2].astype(np.float32), "min_p": samplers[:, 3].astype(np.float32),
            "seed": np.array([r.seed for r in rows], dtype=np.int64), "dist_k": zeros,
            "keep_embed": zeros - 1, "logprob_ids": zeros[:0], "logprob_indptr": np.zeros(n + 1, dtype=np.int64),
            "bias_ids": zeros[:0], "bias_values": np.zeros(0, np.float32), "bias_indptr": zeros[:0],
        }
        errors: dict[int, str] = {}
        drawn, _ = compute(self.engine, c, [], [], errors, counter="pass.ahead")
        tokens = self.unstepped()
        failed, going = {}, []
        for i, r in enumerate(rows):
            if i in errors or drawn[i] < 0:
                failed[r.item] = errors.get(i, "no token drawn")
                continue
            t = int(drawn[i])
            tokens[r.item] = t
            r.filled, r.position, r.token, r.left = r.filled + 1, r.position + 1, t, r.left - 1
            if r.seed >= 0:
                r.seed = (r.seed + 1) % (1 << 63)
            if r.left > 0 and t not in r.stops:
                going.append(r)
        self.rows = going
        return tokens, failed


def _draws_only(c: dict[str, np.ndarray], r: int) -> bool:
    """Output row `r` draws a token and asks for nothing else."""
    bias = len(c["bias_indptr"]) and c["bias_indptr"][r + 1] > c["bias_indptr"][r]
    return bool(c["flags"][r] == P.FLAG_SAMPLE and not c["dist_k"][r] and c["keep_embed"][r] == -1
                and c["logprob_indptr"][r + 1] == c["logprob_indptr"][r] and not bias)


def _slot_pages(c: dict[str, np.ndarray], b: int, ps: int) -> np.ndarray | None:
    """Item `b`'s pages holding slots 0, 1, ... of its sequence, where its output slots
    continue its context (the partial last page first, from its length, or offset 0 after a
    full page or none; every further page new): the layout a run's steps follow. None: not."""
    kv = c["kv_page_ids"][c["kv_page_indptr"][b]:c["kv_page_indptr"][b + 1]]
    out = c["out_kv_page_ids"][c["out_kv_page_indptr"][b]:c["out_kv_page_indptr"][b + 1]]
    last_len, offset = int(c["kv_last_page_lens"][b]), int(c["out_kv_offsets"][b])
    if not len(out):
        return None
    partial = len(kv) and last_len < ps
    if partial and (out[0] != kv[-1] or offset != last_len):
        return None
    if not partial and offset != 0:
        return None
    fresh = out[1:] if partial else out
    if len(set(fresh.tolist())) != len(fresh) or set(fresh.tolist()) & set(kv.tolist()):
        return None
    return np.concatenate([kv, fresh])
