"""A bf16 CPU decode step's decoder layers in one C++ call (csrc/decode_step.cpp).

The Python loop of `Llama.forward` dispatches ~9 calls per layer (norms, four linears, RoPE,
KV write, attention, SiLU * up) plus the slicing between them: ~270 calls and ~2.5 ms of a
14 ms batch-1 step on the Xeon of 2026-11-26 (2 vCPUs; the linears, ~9.6 ms, are at the
memory bandwidth). The C++ loop runs the same kernels in the same order, so its result is
bit-identical to the Python loop's (tests/test_decode_step.py), and runs them inside one
OpenMP parallel region with barriers between them instead of a region per op (0.88x the op
loop's step at batch 1, 0.96x at 16; AMD EPYC Zen 4, csrc/decode_step.cpp). A step takes it
where every item has at most ITEM_TOKENS (32) new tokens, the paged attention kernel's items
(decode steps, drafts, short prompts), and the step at most `max_tokens` rows: as many as the
bf16 linear takes (its GEMM tiles: 255 without AMX, 63 where an fp32 copy takes prefills of
64+ rows; 32 with the kernel's own AMX tiles, 7 where oneDNN's take steps from 8). Everything else (longer prefills, fp32, int8, biases,
other attention backends) keeps the Python loop. The step stopped at 32 rows before: in-process
decode steps of 128 sequences at context ~14-30 took 0.90 / 0.84 / 0.88 / 0.93 / 0.86 / 0.95x
the op loop's time (median 64.9 against 74.1 ms), 64 sequences at ~400 keys 0.87-0.96x, 48 at
~130 0.87-1.04x (AMD EPYC Zen 5, 2 vCPUs, 2026-12-07, the two limits alternating in one
process, the same tokens): the op loop's ~270 calls, its fp32 logits and the sampler's
argmax per row were ~10 % of a 128-sequence step. A 12-token prompt's forward: 34.7
-> 27.4 ms with the 16-token linear and this loop. `greedy` also runs the final norm, the LM
head and the argmax in the region, for steps whose rows only draw greedily: 0.95x the step at
batch 1, 0.91x at 8 (Zen 4, docs/backend.md "The greedy tail"). With AVX-512 BF16 the step
took 16 tokens until the bf16 linear's GEMM tiles (csrc/bf16_gemv.cpp) beat oneDNN at 17-32:
the in-process step at 32 users on a shared 2,048-token prefix 94.9 -> 49.9 ms (Zen 4,
2026-12-02: the Python loop with oneDNN's linears before), at 32 users of 128 tokens each
~49 -> ~42, at 16 users 29.1 -> 22.6 (the linears' tiles alone). On a Xeon with AMX the step
took 7 tokens while oneDNN's AMX kernels took the linears from 8 rows; since the bf16 linear
runs 1-32 rows on AMX tiles of its own it takes 32 there too: in-process steps at context 128
18.0 / 23.4 / 33.1 ms at batch 8 / 16 / 32 against the op loop's 40.3 / 45.7 / 65.0 (family 6
model 207, 2 vCPUs, 2026-12-05).
"""

from __future__ import annotations

import torch

from pie.backend.attention import AttentionPlan, CpuKernelAttention, PagedAttention
from pie.backend.kv_cache import KvCache
from pie.backend.linear import Linear


# The most new tokens of an item the region takes: those the paged attention kernel takes at
# any context (an item past it goes to the prompt loop or SDPA: CpuKernelAttention._prepare).
ITEM_TOKENS = CpuKernelAttention.PREFILL_TOKENS


class FusedDecode:
    def __init__(self, layers: list, heads: int, kv_heads: int, head_dim: int, eps: float):
        from pie.backend.kernels import decode_step_module

        self.kernel = decode_step_module()
        # The bf16 linear's limit (`usable`: what Linear takes to the kernel, so both loops run
        # the same kernels), lower where oneDNN takes more rows (AMX: linear.py)
        self.max_tokens = min(getattr(layer, name).gemv_limit for layer in layers
                              for name in ("qkv", "o", "gate_up", "down"))
        self.weights = [t for layer in layers for t in (
            layer.input_norm, layer.qkv.gemv_weight, layer.o.gemv_weight, layer.post_norm,
            layer.gate_up.gemv_weight, layer.down.gemv_weight, layer.qkv.gemv_wide,
            layer.o.gemv_wide, layer.gate_up.gemv_wide, layer.down.gemv_wide)]
        self.shape = (heads, kv_heads, head_dim, eps)

    @staticmethod
    def usable(layers: list, dtype: torch.dtype, device: torch.device) -> bool:
        """bf16 on CPU with the bf16 linear (AVX-512 BF16, or its AVX2 twin) for every
        projection and no biases."""
        if dtype != torch.bfloat16 or device.type != "cpu":
            return False
        linears = [getattr(layer, name) for layer in layers for name in ("qkv", "o", "gate_up", "down")]
        biases = [getattr(layer, name) for layer in layers
                  for name in ("qkv_bias", "o_bias", "gate_up_bias", "down_bias")]
        return all(isinstance(lin, Linear) and lin.gemv is not None for lin in linears) \
            and all(b is None for b in biases)

    def applies(self, tokens: int, longest: int, attention: PagedAttention, kv: KvCache) -> bool:
        """Whether a step of `tokens` rows whose longest item has `longest` new tokens runs here:
        the region's attention is the paged kernel alone (no prompt loop, no SDPA)."""
        return 0 < tokens <= self.max_tokens and longest <= ITEM_TOKENS \
            and isinstance(attention, CpuKernelAttention) and kv.kernel is not None

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, write_slots: torch.Tensor,
            plan: AttentionPlan, attention: CpuKernelAttention, kv: KvCache,
            out_rows: torch.Tensor) -> torch.Tensor:
        """The residual stream of rows `out_rows` after the last layer (before the final norm)."""
        none = torch.empty(0, dtype=torch.bfloat16)
        keep = self.kept_rows(out_rows, x.shape[0])
        x = self._call(x, cos, sin, write_slots, plan, attention, kv, keep,
                       torch.empty(0, dtype=torch.long), none, none, none)
        return x if len(keep) else x[out_rows]

    def greedy(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, write_slots: torch.Tensor,
               plan: AttentionPlan, attention: CpuKernelAttention, kv: KvCache, out_rows: torch.Tensor,
               norm: torch.Tensor, lm_head: Linear) -> torch.Tensor:
        """`run`, then the greedy tail in the same region: rows `out_rows` through the final
        norm and the LM head, each row's argmax token (int64 [R]; csrc/decode_step.cpp, Head)."""
        keep = self.kept_rows(out_rows, x.shape[0])
        rows = torch.arange(len(keep)) if len(keep) else out_rows.contiguous()
        return self._call(x, cos, sin, write_slots, plan, attention, kv, keep, rows, norm,
                          lm_head.gemv_weight, lm_head.gemv_wide)

    @staticmethod
    def kept_rows(out_rows: torch.Tensor, tokens: int) -> torch.Tensor:
        """The rows the last layer's o projection and MLP run on: `out_rows` where they are
        fewer than the step's rows (none: all), as llama.py's loop runs them. Not only less
        work: a row's bits through the bf16 linear depend on how many rows are beside it
        (bf16_gemv.cpp's GEMM tiles from kWideFrom rows sum in another order than its loop),
        so the fused step keeps the loop's row counts to give its bits."""
        return out_rows.to(torch.long).contiguous() if len(out_rows) < tokens else torch.empty(0, dtype=torch.long)

    def _call(self, x, cos, sin, write_slots, plan, attention, kv, *tail) -> torch.Tensor:
        heads, kv_heads, head_dim, eps = self.shape
        return self.kernel.decode_layers(
            x.contiguous(), self.weights, kv.keys, kv.values, cos.contiguous(), sin.contiguous(),
            write_slots, *attention.kernel_args(plan, kv), heads, kv_heads, head_dim, eps, *tail)
