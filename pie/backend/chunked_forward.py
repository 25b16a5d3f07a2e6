"""One long item's forward pass, `backend.mlp_chunk_tokens` rows at a time (PrefillOnly's
hybrid prefilling).

Why: a T-token pass holds per layer [T, 2 x intermediate] MLP activations and, when it
keeps no KV (a scoring pass), every layer's keys and values in the scratch pages until the
pass ends. Here every op but attention's key set runs over one chunk of rows at a time, and
a pass that keeps no KV holds only the current layer's keys and values (in fp32, the form
attention reads). What stays per token is the residual stream, the queries and one layer's
K/V; attention takes 64 queries a call, over each KV head's keys with its query heads
stacked (no per-head copies of the keys). Measured with SmolLM2-135M in bf16
(`benchmarks/max_input.py`): the memory a scoring pass needs beyond weights and KV pool,
and the longest input that fits a fixed budget, in benchmarks/RESULTS.md.

Results equal the one-shot forward's bit for bit on CPU when the matmul library sums as it
did there (tests/test_scoring.py; benchmarks/max_input.py compares every length: two of
eight differed in the last bits in a run beside other work, whose load seemingly changed
how the library split its sums; the others were equal). A chunk
is at least MIN_MLP_CHUNK = 256 rows (the last one absorbs the remainder), so every matmul
takes the same summation order as over all T rows (the glue's values never depend on the
row count, pie/backend/glue.py): an fp32 product's rows equal a 4,096-row product's from 193 rows on (Xeon,
2 threads; below that the library splits the sums across threads: the down projection
differs from 1 to 192 rows), oneDNN's bf16 rows at any count. Attention runs each chunk of
queries over the item's whole key set with its rows of the same mask, which is how the CPU
flash kernel blocks queries anyway (equal at 64-512-query chunks, and with a KV head's
query heads stacked as rows). On CUDA it runs
the same PyTorch ops (SDPA instead of FlashInfer), held to the one-shot forward on one H200
(tests/test_cuda.py, fp32 with torch attention and bf16 beside FlashInfer; to rounding).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pie.backend.attention import takes_prompt_kernel
from pie.backend.kv_cache import KvCache
from pie.backend.llama import Llama, project

# Queries per attention call: SDPA turns the boolean mask into an fp32 one of
# (query heads per KV head) x rows x keys, 3 KiB per key at 256 rows of SmolLM2.
ATTENTION_ROWS = 64


class ChunkedForward:
    def __init__(self, model: Llama, chunk: int):
        self.model, self.chunk = model, chunk

    def applies(self, n_new: int) -> bool:
        return n_new > self.chunk

    def bounds(self, tokens: int) -> list[tuple[int, int]]:
        """Chunks of `chunk` rows; the last one takes the remainder (< 2 x chunk rows)."""
        starts = list(range(0, max(tokens - self.chunk, 0) + 1, self.chunk))
        return [(a, b) for a, b in zip(starts, starts[1:] + [tokens])]

    @torch.inference_mode()
    def run(self, x: torch.Tensor, positions: torch.Tensor, context_slots: torch.Tensor,
            context_visible: torch.Tensor, write_slots: torch.Tensor | None, mask: torch.Tensor | None,
            kv: KvCache, out_rows: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden] new tokens after `context_slots` (visible where `context_visible`),
        overwritten (it becomes the residual stream); their K/V written to `write_slots`
        (None: kept only while their layer runs); `mask`: the item's custom [T, n_keys] mask
        or None (causal). Returns the final-normed hidden states of rows `out_rows`
        (indices into T)."""
        model, cfg = self.model, self.model.config
        glue, eps, dtype = model.glue, cfg.rms_norm_eps, model.dtype
        tokens, n_ctx = x.shape[0], len(context_slots)
        chunks = self.bounds(tokens)
        cos, sin = model.rope_tables(positions)
        q = torch.empty(tokens, cfg.num_heads, cfg.head_dim, dtype=dtype, device=x.device)
        shape = (cfg.num_kv_heads, n_ctx + tokens, cfg.head_dim)
        keys = torch.empty(shape, dtype=torch.float32, device=x.device)
        values = torch.empty(shape, dtype=torch.float32, device=x.device)
        last = len(model.layers) - 1
        out_chunks = [(a, b) for a, b in chunks if bool(((out_rows >= a) & (out_rows < b)).any())]
        visible = torch.cat([context_visible, torch.ones(tokens, dtype=torch.bool, device=x.device)])
        flash = self._flash(q, keys, mask, visible)
        for index, layer in enumerate(model.layers):
            if n_ctx:
                k_ctx, v_ctx = kv.gather(index, context_slots)
                keys[:, :n_ctx] = k_ctx.float().transpose(0, 1)
                values[:, :n_ctx] = v_ctx.float().transpose(0, 1)
            for a, b in chunks:
                _, h = glue.add_norm(x[a:b], None, layer.input_norm, eps)
                qkv = project(layer.qkv, layer.qkv_bias, h)
                qk = glue.rope(qkv[:, : layer.q_size + layer.kv_size].view(b - a, -1, cfg.head_dim),
                               cos[a:b], sin[a:b])
                q[a:b] = qk[:, : cfg.num_heads]
                pool = kv.keys[index].dtype  # attention reads K/V as the pool holds them
                k = qk[:, cfg.num_heads :].to(pool)
                v = qkv[:, layer.q_size + layer.kv_size :].view(b - a, cfg.num_kv_heads, cfg.head_dim).to(pool)
                if write_slots is not None:
                    kv.write(index, write_slots[a:b], k, v)
                keys[:, n_ctx + a : n_ctx + b] = k.float().transpose(0, 1)
                values[:, n_ctx + a : n_ctx + b] = v.float().transpose(0, 1)
            for a, b in (out_chunks if index == last else chunks):
                for c in range(a, b, ATTENTION_ROWS):
                    d = min(c + ATTENTION_ROWS, b)
                    if flash is not None:  # as the one-shot forward's prompt attention sums it
                        q[c:d] = flash.prompt_attention_dense(q[c:d], keys, values, n_ctx + c, cfg.head_dim ** -0.5)
                    else:
                        self._attend(q, keys, values, c, d, self._mask(c, d, n_ctx, visible, mask))
                if index < last:
                    xa, h = glue.add_norm(x[a:b], project(layer.o, layer.o_bias, q[a:b].view(b - a, -1)),
                                          layer.post_norm, eps)
                    x[a:b] = xa + model.mlp(layer, h)  # (the one-shot forward adds it in the next norm)
        # Past the last layer's attention only the output rows matter, all in one call as the
        # one-shot forward makes it (a matmul of few rows may round otherwise).
        layer = model.layers[last]
        xo, h = glue.add_norm(x[out_rows], project(layer.o, layer.o_bias, q.view(tokens, -1)[out_rows]),
                              layer.post_norm, eps)
        return glue.final_norm(xo + model.mlp(layer, h), model.norm, eps)

    @staticmethod
    def _flash(q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor | None, visible: torch.Tensor):
        """The kernel module when the item's attention is the one-shot forward's prompt kernel
        (bf16 on CPU, causal over every key: pie/backend/attention.py), else None: a row's
        result there does not depend on the other rows of its call, so chunks of 64 queries
        give the one-shot forward's bits."""
        if q.dtype != torch.bfloat16 or q.device.type != "cpu":
            return None  # (before the import: no kernel build for an fp32 or CUDA model)
        from pie.backend.kernels import paged_attention_module

        module = paged_attention_module()
        return module if takes_prompt_kernel(module, q, keys.shape[0], mask, visible) else None

    @staticmethod
    def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, a: int, b: int,
                mask: torch.Tensor) -> None:
        """Queries a:b over every key, in place of those queries. Per KV head, its query
        heads stacked as rows over that head's keys: SDPA's GQA would copy the keys and
        values once per query head ([heads, n_keys, head_dim] in fp32 each, the largest
        buffer of a long input); the sums are the same ones."""
        kv_heads, heads = keys.shape[0], q.shape[1]
        group = heads // kv_heads
        rows = mask.repeat(group, 1)
        for g in range(kv_heads):
            hs = slice(g * group, (g + 1) * group)
            qg = q[a:b, hs].float().transpose(0, 1).reshape(1, 1, group * (b - a), -1)
            out = F.scaled_dot_product_attention(qg, keys[None, g : g + 1], values[None, g : g + 1], attn_mask=rows)
            q[a:b, hs] = out.view(group, b - a, -1).transpose(0, 1).to(q.dtype)

    @staticmethod
    def _mask(a: int, b: int, n_ctx: int, visible: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Rows a:b of the item's [T, n_keys] visibility (as AttentionPlan.item_mask);
        `visible`: which of its n_keys keys page mask bits leave visible."""
        if mask is None:
            rows = torch.arange(a, b, device=visible.device)[:, None]
            mask = torch.arange(len(visible), device=visible.device)[None, :] <= rows + n_ctx
        else:
            mask = mask[a:b]
        return mask & visible[None, :]
