"""The batched handlers of the inference layer.

Each handler takes one protocol message (a batch of items), validates every item, carries
out the valid ones in as few tensor operations as it can, and reports the invalid ones in
`errors`. A batch whose parallel arrays disagree in length cannot be split into items; it
raises ProtocolError and gets a whole-request error reply instead.
"""

from __future__ import annotations

import importlib.util
import json
import math
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from pie import protocol as P
from pie.backend import sampling
from pie.backend.ahead import Ahead
from pie.backend.attention import (
    AttentionPlan,
    CpuKernelAttention,
    PagedAttention,
    TorchPagedAttention,
)
from pie.backend.batch_layout import BatchLayout
from pie.backend.checks import ItemError, check_indptr, float_array, int_array, same_length, valid_items
from pie.backend.chunked_forward import ChunkedForward
from pie.backend.dtype import resolve_dtype, resolve_prefill_dtype
from pie.backend.host_pages import HostPages
from pie.backend.kv_cache import EmbedPool, KvCache
from pie.backend.llama import Llama
from pie.backend.passes import run_passes
from pie.config import BackendConfig

TRAITS = ["allocate", "forward", "input-text", "tokenize", "output-text"]
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass
class ForwardItem:
    """One item's attention layout, shared by `forward` and fused passes: the KV slots it
    reads (its context), how many new tokens it runs, where their K/V go, its mask."""

    context_slots: np.ndarray
    n_new: int
    write_slots: np.ndarray
    mask: torch.Tensor | None
    keeps_kv: bool = True  # False: its K/V live only during the pass (scratch or chunked_forward)
    alone: bool = False  # runs in a forward of its own, a chunk at a time (chunked_forward.py)


class Engine:
    """Model weights, physical pools, and one method per batched handler."""

    def __init__(self, model_dir: Path, config: BackendConfig):
        # "auto" resolved once: the handshake reports the dtype in use
        dtype = resolve_dtype(config.dtype, config.device)
        self.config = config = replace(config, dtype=dtype, prefill_dtype=resolve_prefill_dtype(
            config.prefill_dtype, config.device, dtype) if config.weight_dtype == "model" else "model")
        self.device = torch.device(config.device)
        self.dtype = DTYPES[config.dtype]
        self.model_dir = model_dir
        self.model = Llama(model_dir, self.dtype, self.device, config.weight_dtype,
                           prefill_fp32=config.prefill_dtype == "float32")
        cfg = self.model.config
        self.page_size = config.page_size
        self.num_pages = config.num_kv_pages
        self.chunked = ChunkedForward(self.model, config.mlp_chunk_tokens) if config.mlp_chunk_tokens else None
        # Scratch slots for the new tokens of items that keep no KV. Chunking on, two chunks'
        # worth: a longer such item, or one that finds the scratch full, runs alone and keeps
        # one layer's K/V at a time (a long input's memory does not grow with every layer).
        self.scratch_tokens = config.max_batch_tokens if self.chunked is None else \
            min(config.max_batch_tokens, 2 * config.mlp_chunk_tokens)
        self.kv = KvCache(
            cfg.num_layers, config.num_kv_pages, config.page_size, self.scratch_tokens,
            cfg.num_kv_heads, cfg.head_dim, self.dtype, self.device,
        )
        self.embeds = EmbedPool(config.num_embeds, cfg.hidden_size, self.dtype, self.device)
        self.host = HostPages(self.kv, config.num_host_kv_pages, config.swap_gbps) if config.num_host_kv_pages else None
        self.hold_reply_until: float | None = None  # see take_hold
        # The steps a request's items take on after its reply (pie/backend/ahead.py), which
        # the server runs before it reads the next request.
        self.ahead: Ahead | None = None
        self.attention: PagedAttention = self._attention_backend()
        self.graphs = None  # decode steps replayed from CUDA graphs (backend.cuda_graphs)
        if config.cuda_graphs:
            from pie.backend.cuda_graphs import DecodeGraphs

            self.graphs = DecodeGraphs(self.model, self.kv, config.max_batch_tokens)
        self.rng = torch.Generator(device="cpu")
        self.rng.seed()
        self.counters: Counter[str] = Counter()

    @staticmethod
    def attention_choice(choice: str, device: torch.device, dtype: torch.dtype) -> str:
        """backend.attention with "auto" resolved: our C++ kernel on CPU; on CUDA, FlashInfer
        where it is installed and takes the dtype (bf16/fp16), else the torch reference. On one
        H200 (benchmarks/results/backend-cuda-*.json) FlashInfer's eager decode step took 20-32
        ms at batch 1-32 against the torch reference's 40-430 ms."""
        if choice != "auto":
            return choice
        if device.type == "cpu":
            return "cpu-kernel"
        usable = dtype in (torch.float16, torch.bfloat16) and importlib.util.find_spec("flashinfer")
        return "flashinfer" if usable else "torch"

    def _attention_backend(self) -> PagedAttention:
        cfg = self.model.config
        choice = self.attention_choice(self.config.attention, self.device, self.dtype)
        if choice == "flashinfer":
            from pie.backend.flashinfer_attention import FlashInferAttention

            return FlashInferAttention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, self.dtype,
                                       self.device, self.config.shared_prefix_keys)
        if choice == "cpu-kernel":
            return CpuKernelAttention(self.config.shared_prefix_keys)
        return TorchPagedAttention()

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        """A numpy index array as a tensor on the engine's device."""
        return torch.from_numpy(array).to(self.device)

    # --- handshake / stats -------------------------------------------------------------

    def handshake(self, request: P.HandshakeRequest) -> P.HandshakeReply:
        if request.protocol_version != P.PROTOCOL_VERSION:
            raise P.ProtocolError(
                f"protocol version {request.protocol_version} is not supported "
                f"(backend speaks {P.PROTOCOL_VERSION})"
            )
        cfg = self.model.config
        tokenizer_config = json.loads((self.model_dir / "tokenizer_config.json").read_text())
        return P.HandshakeReply(
            protocol_version=P.PROTOCOL_VERSION,
            model_name=self.model_dir.name,
            traits=TRAITS,
            page_size=self.page_size,
            num_kv_pages=self.num_pages,
            num_host_kv_pages=self.host.num_pages if self.host else 0,
            num_embeds=self.embeds.size,
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            max_batch_tokens=self.config.max_batch_tokens,
            tokenizer_json=(self.model_dir / "tokenizer.json").read_text(),
            eos_token_ids=list(cfg.eos_token_ids),
            bos_token_id=cfg.bos_token_id,
            chat_template=tokenizer_config.get("chat_template") or "",
            dtype=self.config.dtype,
            device=self.config.device,
            context_length=cfg.max_position_embeddings,
        )

    def stats(self, request: P.StatsRequest) -> P.StatsReply:
        return P.StatsReply(counters=dict(self.counters))

    def _count(self, kind: str, items: int, errors: int, tokens: int = 0) -> None:
        self.counters[f"{kind}.batches"] += 1
        self.counters[f"{kind}.items"] += items
        self.counters[f"{kind}.errors"] += errors
        if tokens:
            self.counters[f"{kind}.tokens"] += tokens

    # --- embed_text --------------------------------------------------------------------

    def embed_text(self, msg: P.EmbedText) -> P.BatchReply:
        tokens = int_array(msg.token_ids, "token_ids")
        positions = int_array(msg.positions, "positions")
        embed_ids = int_array(msg.embed_ids, "embed_ids")
        n = same_length("embed_text", token_ids=tokens, positions=positions, embed_ids=embed_ids)
        errors: dict[int, str] = {}
        for i in np.flatnonzero((tokens < 0) | (tokens >= self.model.config.vocab_size)):
            errors[int(i)] = f"token id {tokens[i]} out of range [0, {self.model.config.vocab_size})"
        for i in np.flatnonzero(positions < 0):
            errors[int(i)] = f"position {positions[i]} is negative"
        for i in np.flatnonzero((embed_ids < 0) | (embed_ids >= self.embeds.size)):
            errors[int(i)] = f"embed id {embed_ids[i]} out of range [0, {self.embeds.size})"
        ok = valid_items(n, errors)
        if ok.any():
            ids = self._tensor(embed_ids[ok])
            self.embeds.vectors[ids] = self.model.embed(self._tensor(tokens[ok]))
            self.embeds.positions[ids] = self._tensor(positions[ok])
        self._count("embed_text", n, len(errors), int(ok.sum()))
        return P.BatchReply(errors=errors)

    # --- forward -----------------------------------------------------------------------

    def forward(self, msg: P.Forward) -> P.BatchReply:
        kind = "forward"
        last_lens = int_array(msg.kv_last_page_lens, "kv_last_page_lens")
        n_items = same_length(
            kind, kv_last_page_lens=last_lens, out_kv_offsets=msg.out_kv_offsets,
            attention_masks=msg.attention_masks,
        )
        flat = {
            name: int_array(getattr(msg, name), name)
            for name in ("kv_page_ids", "kv_page_indptr", "embed_ids", "embed_indptr",
                         "out_kv_page_ids", "out_kv_page_indptr", "out_embed_ids",
                         "out_token_indices", "out_embed_indptr", "out_kv_offsets")
        }
        same_length(kind, out_embed_ids=flat["out_embed_ids"],
                    out_token_indices=flat["out_token_indices"])
        for indptr, data in (("kv_page_indptr", "kv_page_ids"), ("embed_indptr", "embed_ids"),
                             ("out_kv_page_indptr", "out_kv_page_ids"),
                             ("out_embed_indptr", "out_embed_ids")):
            check_indptr(kind, flat[indptr], len(flat[data]), n_items, indptr)

        errors: dict[int, str] = {}
        items: list[ForwardItem] = []
        embed_ids, out_ids, out_rows = [], [], []
        layout = self.layout()
        for b in range(n_items):
            try:
                span = lambda name: slice(flat[name][b], flat[name][b + 1])  # noqa: E731
                embeds = flat["embed_ids"][span("embed_indptr")]
                outs = flat["out_embed_ids"][span("out_embed_indptr")]
                rows = flat["out_token_indices"][span("out_embed_indptr")]
                self._check_embeds(embeds, "input")
                self._check_embeds(outs, "output")
                bad = rows[(rows < 0) | (rows >= len(embeds))]
                if len(bad):
                    raise ItemError(f"out_token_index {bad[0]} out of range [0, {len(embeds)})")
                q0 = layout.tokens
                item = layout.add(
                    pages=flat["kv_page_ids"][span("kv_page_indptr")], last_len=int(last_lens[b]),
                    n_new=len(embeds), out_pages=flat["out_kv_page_ids"][span("out_kv_page_indptr")],
                    out_offset=int(flat["out_kv_offsets"][b]), mask=msg.attention_masks[b])
            except ItemError as e:
                errors[b] = str(e)
                continue
            items.append(item)
            embed_ids.append(embeds)
            out_ids.append(outs)
            out_rows.append(rows + q0)
        if items:
            ids = self._tensor(np.concatenate(embed_ids))
            rows = self._tensor(np.concatenate(out_rows))
            positions = self.embeds.positions[ids]
            hidden = self.run_items(items, self.embeds.vectors[ids], positions, rows)
            out = self._tensor(np.concatenate(out_ids))
            if len(out):
                self.embeds.vectors[out] = hidden
                self.embeds.positions[out] = positions[rows]
        self._count(kind, n_items, len(errors), layout.tokens)
        return P.BatchReply(errors=errors)

    def layout(self) -> BatchLayout:
        """A fresh per-batch token budget and scratch cursor for `ForwardItem`s."""
        return BatchLayout(self)

    def _page_slots(self, pages: np.ndarray) -> np.ndarray:
        return (pages[:, None] * self.page_size + np.arange(self.page_size)).ravel()

    def _check_pages(self, pages: np.ndarray, what: str) -> None:
        bad = pages[(pages < 0) | (pages >= self.num_pages)]
        if len(bad):
            raise ItemError(f"{what} page id {bad[0]} out of range [0, {self.num_pages})")

    def _check_embeds(self, ids: np.ndarray, what: str) -> None:
        bad = ids[(ids < 0) | (ids >= self.embeds.size)]
        if len(bad):
            raise ItemError(f"{what} embed id {bad[0]} out of range [0, {self.embeds.size})")

    def _writes_context(self, pages: np.ndarray, last_len: int, out_pages: np.ndarray,
                        out_offset: int, n_new: int) -> bool:
        """Whether slots `out_offset .. + n_new` of `out_pages` hit the context (every slot
        of `pages` but the last page's first `last_len`). Page by page in plain ints: a
        context covers a prefix of each of its pages, and a write a range of each of its
        own; `np.isin` on the slot lists cost ~35 us an item, a third of a decode item's
        checks."""
        ps = self.page_size
        covered = dict.fromkeys(pages[:-1].tolist(), ps)  # page -> context slots [0, n) on it
        last = int(pages[-1])
        covered[last] = max(covered.get(last, 0), last_len)
        end = out_offset + n_new
        for k, page in enumerate(out_pages.tolist()):
            lo, hi = max(out_offset - k * ps, 0), min(end - k * ps, ps)
            if lo < hi and lo < covered.get(page, 0):
                return True
        return False

    def forward_item(
        self, pages: np.ndarray, last_len: int, n_new: int, out_pages: np.ndarray,
        out_offset: int, mask: bytes | None, scratch_cursor: int | None,
    ) -> ForwardItem:
        """Check one item's pages, offsets and mask (ItemError says what is wrong); no
        `scratch_cursor`: it runs alone (chunked_forward.py)."""
        ps = self.page_size
        self._check_pages(pages, "input")
        if len(pages) and not 1 <= last_len <= ps:
            raise ItemError(f"kv_last_page_len {last_len} must be in [1, {ps}]")
        context = self._page_slots(pages)[: max(0, (len(pages) - 1) * ps + last_len)] if len(pages) else np.zeros(0, np.int64)
        if n_new == 0:
            raise ItemError("no new tokens")
        if len(out_pages):
            self._check_pages(out_pages, "output")
            if len(set(out_pages.tolist())) != len(out_pages):
                raise ItemError("output pages repeat a page")
            if not 0 <= out_offset < ps:
                raise ItemError(f"out_kv_offset {out_offset} must be in [0, {ps})")
            capacity = len(out_pages) * ps - out_offset
            if capacity < n_new:
                raise ItemError(f"output pages hold {capacity} slots from the offset, {n_new} needed")
            write = self._page_slots(out_pages)[out_offset : out_offset + n_new]
            if len(pages) and self._writes_context(pages, last_len, out_pages, out_offset, n_new):
                raise ItemError("output slots overlap the input context")
        elif scratch_cursor is not None:
            write = np.arange(scratch_cursor, scratch_cursor + n_new, dtype=np.int64)
        else:
            write = np.zeros(0, dtype=np.int64)
        dense = None
        if mask is not None:
            n_keys = len(context) + n_new
            if not isinstance(mask, bytes) or len(mask) != math.ceil(n_new * n_keys / 8):
                raise ItemError(
                    f"attention mask must be {math.ceil(n_new * n_keys / 8)} packed bytes "
                    f"for {n_new} new tokens x {n_keys} keys"
                )
            bits = np.unpackbits(np.frombuffer(mask, dtype=np.uint8))[: n_new * n_keys]
            dense = torch.from_numpy(bits.reshape(n_new, n_keys).astype(bool))
            dense = dense.to(self.device)
            visible = torch.cat([~self.kv.masked[self._tensor(context)],
                                 torch.ones(n_new, dtype=torch.bool, device=self.device)])
            if not (dense & visible).any(dim=1).all():
                raise ItemError("attention mask leaves a new token with nothing to attend to")
        return ForwardItem(context, n_new, write, dense, keeps_kv=bool(len(out_pages)),
                           alone=scratch_cursor is None)

    def run_items(self, items: list[ForwardItem], x: torch.Tensor, positions: torch.Tensor,
                  out_rows: torch.Tensor, greedy: bool = False) -> torch.Tensor:
        """The items' new tokens (inputs `x` at `positions`, item after item) through the
        model; the final hidden states of rows `out_rows` (`greedy`, where `takes_greedy`:
        their argmax tokens). Items longer than `backend.mlp_chunk_tokens` run alone, a chunk
        at a time (chunked_forward.py), the others in one forward per run of consecutive
        items, in item order (an item may read an earlier one's new tokens)."""
        if greedy or self.chunked is None or not any(i.alone for i in items):
            return self._forward_batch(items, x, positions, out_rows, greedy)
        hidden = torch.empty(len(out_rows), self.model.config.hidden_size, dtype=self.dtype,
                             device=self.device)
        segments: list[list[ForwardItem]] = []
        for item in items:
            if item.alone or not segments or segments[-1][0].alone:
                segments.append([])
            segments[-1].append(item)
        q0 = 0
        for segment in segments:
            q1 = q0 + sum(i.n_new for i in segment)
            at = torch.nonzero((out_rows >= q0) & (out_rows < q1)).flatten()
            rows = out_rows[at] - q0
            if segment[0].alone:
                item = segment[0]
                write = self._tensor(item.write_slots) if item.keeps_kv else None
                if write is not None:
                    self.kv.masked[write] = False
                context = self._tensor(item.context_slots)
                hidden[at] = self.chunked.run(  # type: ignore[union-attr]
                    x[q0:q1], positions[q0:q1], context, ~self.kv.masked[context], write, item.mask,
                    self.kv, rows)
            else:
                hidden[at] = self._forward_batch(segment, x[q0:q1], positions[q0:q1], rows)
            q0 = q1
        return hidden

    def takes_greedy(self, items: list[ForwardItem], tokens: int) -> bool:
        """Whether `run_items(greedy=True)` runs these items: one forward (no item chunked
        alone, no CUDA graph) that the model's greedy tail takes (Llama.takes_greedy)."""
        return self.graphs is None and not (self.chunked is not None and any(i.alone for i in items)) \
            and self.model.takes_greedy(tokens, max(i.n_new for i in items), self.attention, self.kv)

    def _forward_batch(self, items: list[ForwardItem], x: torch.Tensor, positions: torch.Tensor,
                       out_rows: torch.Tensor, greedy: bool = False) -> torch.Tensor:
        """One model forward over the items' new tokens (`greedy`: Llama.forward's)."""
        q_indptr, kv_indptr = [0], [0]
        for item in items:
            q_indptr.append(q_indptr[-1] + item.n_new)
            kv_indptr.append(kv_indptr[-1] + len(item.context_slots) + item.n_new)
        # Built on the host and moved once: per-item device tensors cost two small copies or
        # kernels an item, on a GPU the larger part of a batch-32 step's host time.
        write_slots = self._tensor(np.concatenate([i.write_slots for i in items]))
        kv_slots = self._tensor(np.concatenate(
            [slots for i in items for slots in (i.context_slots, i.write_slots)]))
        # Slots written by this batch are fresh: clear their mask bits first, so an item that
        # reads another item's new tokens (vertically batched chained forwards) sees them, and
        # its own new tokens read as visible.
        self.kv.masked[write_slots] = False
        plan = AttentionPlan(
            q_indptr=q_indptr,
            kv_indptr=kv_indptr,
            kv_slots=kv_slots,
            kv_visible=~self.kv.masked[kv_slots],
            custom_masks=[item.mask for item in items],
        )
        if self.graphs is not None and not greedy:
            hidden = self.graphs.forward(x, positions, write_slots, plan, out_rows)
            if hidden is not None:
                return hidden
        return self.model.forward(x, positions, write_slots, plan, self.attention, self.kv, out_rows, greedy)

    # --- next_dist / sample ------------------------------------------------------------

    def _valid_embeds(self, ids: np.ndarray, errors: dict[int, str]) -> None:
        for i in np.flatnonzero((ids < 0) | (ids >= self.embeds.size)):
            errors[int(i)] = f"embed id {ids[i]} out of range [0, {self.embeds.size})"

    def _probs(self, ids: np.ndarray, ok: np.ndarray) -> torch.Tensor:
        hidden = self.embeds.vectors[self._tensor(ids[ok])]
        return torch.softmax(self.model.logits(hidden), dim=-1)

    def next_dist(self, msg: P.NextDist) -> P.NextDistReply:
        ids = int_array(msg.embed_ids, "embed_ids")
        ks = int_array(msg.ks, "ks")
        n = same_length("next_dist", embed_ids=ids, ks=ks)
        vocab = self.model.config.vocab_size
        errors: dict[int, str] = {}
        self._valid_embeds(ids, errors)
        for i in np.flatnonzero((ks < 1) | (ks > vocab)):
            errors[int(i)] = f"k {ks[i]} out of range [1, {vocab}]"
        ok = valid_items(n, errors)
        token_ids: list[list[int]] = [[] for _ in range(n)]
        probs: list[list[float]] = [[] for _ in range(n)]
        if ok.any():
            top = torch.topk(self._probs(ids, ok), int(ks[ok].max()), dim=-1)
            for row, i in enumerate(np.flatnonzero(ok)):
                k = int(ks[i])
                token_ids[i] = top.indices[row, :k].tolist()
                probs[i] = top.values[row, :k].tolist()
        self._count("next_dist", n, len(errors))
        return P.NextDistReply(token_ids=token_ids, probs=probs, errors=errors)

    def sample(self, msg: P.Sample) -> P.SampleReply:
        ids = int_array(msg.embed_ids, "embed_ids")
        temps = float_array(msg.temperatures, "temperatures")
        top_ks = int_array(msg.top_ks, "top_ks")
        top_ps = float_array(msg.top_ps, "top_ps")
        seeds = int_array(msg.seeds, "seeds")
        n = same_length("sample", embed_ids=ids, temperatures=temps, top_ks=top_ks,
                        top_ps=top_ps, seeds=seeds)
        allowed = self._allowed_masks(msg.allowed, n)
        errors: dict[int, str] = {}
        self._valid_embeds(ids, errors)
        for i in np.flatnonzero(~np.isfinite(temps) | (temps < 0)):
            errors[int(i)] = f"temperature {temps[i]} must be a finite number >= 0"
        for i in np.flatnonzero(top_ks < 0):
            errors[int(i)] = f"top_k {top_ks[i]} must be >= 0 (0 = no limit)"
        for i in np.flatnonzero(~((top_ps > 0) & (top_ps <= 1))):
            errors[int(i)] = f"top_p {top_ps[i]} must be in (0, 1]"
        for i in np.flatnonzero(seeds < -1):
            errors[int(i)] = f"seed {seeds[i]} must be >= 0, or -1 for unseeded"
        ok = valid_items(n, errors)
        out = [-1] * n
        if ok.any():
            hidden = self.embeds.vectors[self._tensor(ids[ok])]
            logits = self.model.logits(hidden)
            for row, i in enumerate(np.flatnonzero(ok)):
                if allowed[i] is not None:
                    if not allowed[i].any():
                        errors[int(i)] = "the allowed-token mask allows no token"
                        continue
                    logits[row] = logits[row].masked_fill(~allowed[i].to(logits.device), float("-inf"))
            rows = np.flatnonzero(ok)
            drawn = valid_items(n, errors)[rows]
            rows = rows[drawn]
            picks = sampling.draw_rows(logits[self._tensor(np.flatnonzero(drawn))], temps[rows],
                                       top_ks[rows], top_ps[rows], np.zeros(len(rows)), seeds[rows],
                                       self.rng)
            for i, token in zip(rows.tolist(), picks):
                out[i] = token
        self._count("sample", n, len(errors))
        return P.SampleReply(token_ids=out, errors=errors)

    def _allowed_masks(self, allowed: list[bytes | None], n: int) -> list[torch.Tensor | None]:
        """Per item: a bool tensor over the vocabulary (True = may be sampled), or None."""
        if not allowed:
            return [None] * n
        if len(allowed) != n:
            raise P.ProtocolError(f"sample: {len(allowed)} allowed masks for {n} items")
        vocab = self.model.config.vocab_size
        size = sampling.mask_bytes(vocab)
        masks: list[torch.Tensor | None] = []
        for i, mask in enumerate(allowed):
            if mask is None:
                masks.append(None)
                continue
            if not isinstance(mask, bytes) or len(mask) != size:
                raise P.ProtocolError(f"sample: allowed[{i}] must be {size} bytes (a bitmask over "
                                      f"{vocab} tokens)")
            masks.append(sampling.allowed_mask(mask, vocab))
        return masks

    # --- KV page operations ------------------------------------------------------------

    def copy_kvpage(self, msg: P.CopyKvPage) -> P.BatchReply:
        src = int_array(msg.src_page_ids, "src_page_ids")
        dst = int_array(msg.dst_page_ids, "dst_page_ids")
        src_off = int_array(msg.src_offsets, "src_offsets")
        dst_off = int_array(msg.dst_offsets, "dst_offsets")
        lengths = int_array(msg.lengths, "lengths")
        n = same_length("copy_kvpage", src_page_ids=src, dst_page_ids=dst, src_offsets=src_off,
                        dst_offsets=dst_off, lengths=lengths)
        ps, errors = self.page_size, {}
        src_slots, dst_slots = [], []
        for i in range(n):
            if not (0 <= src[i] < self.num_pages and 0 <= dst[i] < self.num_pages):
                errors[i] = f"page id out of range [0, {self.num_pages}): {src[i]} -> {dst[i]}"
            elif lengths[i] < 0 or src_off[i] < 0 or dst_off[i] < 0 \
                    or src_off[i] + lengths[i] > ps or dst_off[i] + lengths[i] > ps:
                errors[i] = (f"range does not fit in a page of {ps}: src offset {src_off[i]}, "
                             f"dst offset {dst_off[i]}, length {lengths[i]}")
            else:
                src_slots.append(src[i] * ps + src_off[i] + np.arange(lengths[i]))
                dst_slots.append(dst[i] * ps + dst_off[i] + np.arange(lengths[i]))
        if src_slots:
            self.kv.copy_slots(self._tensor(np.concatenate(src_slots)),
                               self._tensor(np.concatenate(dst_slots)))
        self._count("copy_kvpage", n, len(errors))
        return P.BatchReply(errors=errors)

    def swap_kvpage(self, msg: P.SwapKvPage) -> P.BatchReply:
        """Whole pages to the host tier and back, in item order; runs of items going the
        same way (no page written twice) are one copy per layer."""
        device = int_array(msg.device_page_ids, "device_page_ids")
        host = int_array(msg.host_page_ids, "host_page_ids")
        n = same_length("swap_kvpage", device_page_ids=device, host_page_ids=host, to_host=msg.to_host)
        errors: dict[int, str] = {}
        runs: list[tuple[bool, list[int], list[int]]] = []  # (to_host, device pages, host pages)
        for i in range(n):
            if self.host is None:
                errors[i] = "this backend has no host tier (backend.num_host_kv_pages = 0)"
            elif not isinstance(msg.to_host[i], bool):
                errors[i] = "to_host must be a boolean"
            elif not (0 <= device[i] < self.num_pages and 0 <= host[i] < self.host.num_pages):
                errors[i] = (f"page ids out of range: device {device[i]} of [0, {self.num_pages}), "
                             f"host {host[i]} of [0, {self.host.num_pages})")
            else:
                to_host, dst = msg.to_host[i], int(host[i] if msg.to_host[i] else device[i])
                if not runs or runs[-1][0] != to_host or dst in runs[-1][2 if to_host else 1]:
                    runs.append((to_host, [], []))  # a new direction, or a page written twice
                runs[-1][1].append(int(device[i]))
                runs[-1][2].append(int(host[i]))
        for to_host, device_pages, host_pages in runs:
            if to_host:
                self.host.store(device_pages, host_pages)  # type: ignore[union-attr]
            else:
                self.host.load(host_pages, device_pages)  # type: ignore[union-attr]
        if self.host is not None and self.host.gbps and n > len(errors):
            self.hold_reply_until = self.host.through_link_at(n - len(errors))
        self._count("swap_kvpage", n, len(errors))
        return P.BatchReply(errors=errors)

    def take_hold(self) -> float | None:
        """When the reply just made may go out (a swap over an emulated link,
        `backend.swap_gbps`), or None: at once."""
        hold, self.hold_reply_until = self.hold_reply_until, None
        return hold

    def mask_kvpage(self, msg: P.MaskKvPage) -> P.BatchReply:
        pages = int_array(msg.page_ids, "page_ids")
        n = same_length("mask_kvpage", page_ids=pages, masks=msg.masks)
        errors: dict[int, str] = {}
        for i in range(n):
            mask = msg.masks[i]
            if not 0 <= pages[i] < self.num_pages:
                errors[i] = f"page id {pages[i]} out of range [0, {self.num_pages})"
            elif not (isinstance(mask, list) and len(mask) == self.page_size
                      and all(isinstance(bit, bool) for bit in mask)):
                errors[i] = f"mask must be a list of {self.page_size} booleans"
            else:
                start = int(pages[i]) * self.page_size
                self.kv.masked[start : start + self.page_size] = torch.tensor(mask, device=self.device)
        self._count("mask_kvpage", n, len(errors))
        return P.BatchReply(errors=errors)

    def handle(self, message: P.Message) -> P.Message:
        """Dispatch one decoded request to its handler."""
        handler = {
            P.Kind.HANDSHAKE: self.handshake,
            P.Kind.EMBED_TEXT: self.embed_text,
            P.Kind.FORWARD: self.forward,
            P.Kind.NEXT_DIST: self.next_dist,
            P.Kind.SAMPLE: self.sample,
            P.Kind.COPY_KVPAGE: self.copy_kvpage,
            P.Kind.MASK_KVPAGE: self.mask_kvpage,
            P.Kind.SWAP_KVPAGE: self.swap_kvpage,
            P.Kind.PASS: lambda msg: run_passes(self, msg),
            P.Kind.INTERRUPT: lambda msg: msg,  # the server ended any steps ahead on seeing it
            P.Kind.STATS: self.stats,
        }[message.kind]
        return handler(message)  # type: ignore[arg-type]
