"""Linear layers without bias, y = x @ W.T, in the model dtype or with int8 weights.

On CPU in bf16 the weight is prepacked once into oneDNN's blocked layout (AMX/AVX-512
kernels): measured 1.3-1.5x faster than F.linear across batch sizes here (DESIGN §6).
Steps of up to 255 tokens (decode, short prompts) go instead to our AVX-512 BF16 kernel
(csrc/bf16_gemv.cpp; on AVX2-only CPUs its AVX2 + FMA twin, bf16 widened to fp32). For the
fewest tokens a loop that streams each weight once: the 120 layer linears of a SmolLM2-135M
step took 8.7 / 11.1 ms at 1 / 4 tokens against oneDNN's 14.0 / 15.6 (Xeon, avx512_bf16, 2
vCPUs; weights not in cache), before it read the weight from 4-row panels in huge pages
(weight_arena.py), which took the layer linears and LM head at 1 token from 13.6 to 8.6 ms
on an AMD EPYC Zen 4 (docs/backend.md). From `wide_from()` tokens (6; AVX2: 8) GEMM tiles
that read a second copy of the weight (`gemv_wide`): on the Zen 4 the 120 layer linears at
16 / 32 / 128 tokens 11.8 / 19.4 / 72.4 ms against oneDNN's bf16 17.3 / 23.6 / 75.4 (more
in csrc/bf16_gemv.cpp); the AVX2 build's tiles: 109 against 121 ms at 32 tokens, and ahead
of oneDNN's fp32 kernels on the fp32 copy up to ~256 tokens (docs/backend.md). With AVX-512
and no BF16 (Intel Skylake-SP to Ice Lake) the same tiles run in 512-bit vectors, with the
same bits: on an Ice Lake Xeon (2 vCPUs) 15.1 / 46.9 / 89.7 ms at 8 / 32 / 64 tokens against
the AVX2 build's 25.9 / 76.0 / 146.0 and oneDNN's fp32 kernels' 38.4 / 61.3 / 98.6 on an fp32
copy; there `backend.prefill_dtype = auto` hands steps of PREFILL_MIN_TOKENS or more to an
fp32 copy (the tiles are level with it at 128 tokens, 10 % behind at 255). On a CPU with
AMX the kernel runs steps of 1-32 rows on AMX tiles of its own (the 120 layer linears at 8 /
32 rows 11.3 / 15.0 ms against oneDNN's AMX kernels' 23.0 / 32.3; Xeon, family 6 model 207,
2 vCPUs), so every decode step of up to 32 sequences stays in the fused decode step;
oneDNN takes the steps past them (AMX_KERNEL_TO), or from AMX_ONEDNN_FROM (8) rows where the
OS refused the process the tile state.
fp32 keeps F.linear so the fp32 path stays HF's arithmetic for the correctness oracle. On a
CPU without oneDNN's bf16 kernels (AVX2 only), steps past the bf16 kernel's multiply an fp32
copy of the weight packed for oneDNN's fp32 kernels, not F.linear: MKL takes a generic path on
AMD CPUs (AMD EPYC, 2 vCPUs: 120 layer linears at 64 tokens 289 -> 216 ms, lm_head 93 -> 51).

`backend.weight_dtype = "int8"` (off by default) stores weights as int8 with one scale per
output channel and quantizes activations per token at each call (csrc/int8_linear.cpp):
in a microbenchmark of the 91 linears of a SmolLM2-135M step (Xeon with avx512_vnni, 2
vCPUs) 3.9 / 10.0 / 18.8 ms at 1 / 8 / 32 tokens against bf16's 10.1 / 21.7 / 67.6. Whole
steps, perplexity and greedy agreement: docs/backend.md, benchmarks/quantization.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pie.backend.weight_arena import WeightArena

WEIGHT_DTYPES = ("model", "int8")


PREFILL_MIN_TOKENS = 64  # from here on fp32 matmuls won on the Xeon that motivated them
# With AMX and no AMX tiles in the kernel (the OS refused the tile state: kernel_amx()),
# oneDNN's bf16 primitive takes steps from this many rows on: its tile kernels beat the
# AVX-512 BF16 GEMM tiles (tuned on AMD EPYCs, which have no AMX) several times over.
# Measured on a Xeon with AMX (family 6 model 167, 2 vCPUs, 2026-12-03), the 120 layer
# linears of a SmolLM2-135M step at 12 / 32 / 128 rows: oneDNN 18.6 / 20.0 / 30.0 ms against
# the tiles' 42.5 / 53.2 / 160.8; the LM head at 8 / 32 rows 1.7 / 3.3 against 6.3 / 13.6.
# Whole in-process decode steps (context 64) put the crossover between 6 and 8 rows: at 6 the
# fused step on the tiles took 25.5-26.4 ms against the op loop on oneDNN's 30.2-33.0, at 8
# 31.5-31.7 against 28.6-29.7, at 12 52.2-55.5 against 27.3-31.7, at 32 85 against 50.
AMX_ONEDNN_FROM = 8
# The most rows the kernel's own AMX tiles take (csrc/bf16_gemv.cpp, amx_from(): 6 up to its
# max_tokens(), 32); past them oneDNN's AMX kernels, whose blocking pays from ~64 rows on.
AMX_KERNEL_TO = 32
AMX_FLAGS = frozenset({"amx_bf16", "amx_tile"})  # /proc/cpuinfo flags of AMX bf16 tiles


def onednn_from(flags: frozenset[str], kernel_amx: bool = False) -> int | None:
    """From how many rows a bf16 linear leaves the kernel for oneDNN on a CPU with these
    flags: with AMX, AMX_ONEDNN_FROM, or past the kernel's own AMX tiles (`kernel_amx`:
    csrc/bf16_gemv.cpp runs 6-32 rows on them, so steps of up to 32 rows keep the fused
    decode step); else None (the kernel's own limits, `Linear`)."""
    if not AMX_FLAGS <= flags:
        return None
    return AMX_KERNEL_TO + 1 if kernel_amx else AMX_ONEDNN_FROM


def kernel_amx() -> bool:
    """Whether the bf16 kernel runs its own AMX tiles on this machine (built with AMX, and
    the OS granted the process the tile state: csrc/bf16_gemv.cpp, amx_from())."""
    from pie.backend.kernels import bf16_gemv_module

    module = bf16_gemv_module()
    return bool(module.supported()) and module.amx_from() > 0


class Linear:
    """`prefill_fp32`: also keep an fp32 copy of the weight and multiply steps of at least
    PREFILL_MIN_TOKENS tokens in fp32 (`backend.prefill_dtype`, pie/backend/dtype.py).

    A bf16 weight on a CPU without oneDNN's bf16 kernels (no AVX-512: e.g. an AMD EPYC with
    AVX2 only) always keeps the fp32 copy for steps the few-token kernel does not take:
    there F.linear in bf16 ran 3-7x slower than in fp32 at 16-64 rows (0.87 vs 2.8 ms at 16,
    1.3 vs 9.5 ms at 32, one 576 x 1536 weight, 2 vCPUs), while the kernel streams the
    half-size bf16 weight for decode steps."""

    def __init__(self, weight: torch.Tensor, prefill_fp32: bool = False, arena: WeightArena | None = None,
                 onednn_rows: int | None = None):
        dense = weight.contiguous()
        self.out_features = weight.shape[0]
        self.packed = None
        bf16_cpu = weight.device.type == "cpu" and weight.dtype == torch.bfloat16
        # oneDNN's bf16 path needs AVX-512 (bw/vl/dq) or avx_ne_convert; on a plain AVX2 CPU
        # the reorder raises, so bf16 goes to the kernel below and to the fp32 copy.
        if bf16_cpu and torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(dense, None)
        self.gemv, self.gemv_max_tokens, self.gemv_weight, self.gemv_wide = None, 0, None, None
        self.gemv_limit = 0  # the most rows the kernel takes: gemv_max_tokens, or AVX2's GEMM tiles' limit
        if bf16_cpu and weight.shape[1] % 32 == 0:
            from pie.backend.kernels import bf16_gemv_module

            module = bf16_gemv_module()
            if module.supported() and weight.shape[0] % module.panel_rows() == 0:
                self.gemv = module
                self.gemv_max_tokens = module.max_tokens()
                # The weight as the kernel reads it: a copy in 4-row panels (csrc/bf16_gemv.cpp:
                # a step's 120 layer linears at 1 token 13.9 vs 16.8 ms on AVX2, 6.9 vs 10.9 ms
                # with AVX-512 BF16, AMD EPYCs), never the tensor in place: the LM head may be
                # the embedding table. In the model's arena of huge pages where it has one.
                self.gemv_weight = module.pack(dense) if arena is None else \
                    module.pack_into(dense, arena.reserve(tuple(module.packed_shape(*dense.shape)), dense.dtype))
                # For 8-255 tokens, a second copy in the GEMM tiles' layout (another bf16 copy
                # of the weight: ~270 MB for SmolLM2-135M); empty where n is no multiple of 16.
                # In the arena too: the tiles stream it as the panels do. A step's 120 layer
                # linears at 12 rows took 5.7 ms from 4 KB pages, 4.7 from huge pages (AMD
                # EPYC Zen 5, with the tiles' prefetch; csrc/bf16_gemv.cpp).
                wide = module.pack_wide(dense)
                self.gemv_wide = wide if arena is None or not wide.numel() else arena.place(wide)
                self.gemv_limit = module.wide_to() if self.gemv_wide.numel() else self.gemv_max_tokens
        if onednn_rows is not None and self.packed is not None:  # `onednn_from`: AMX
            self.gemv_limit = min(self.gemv_limit, onednn_rows - 1)
        no_onednn = bf16_cpu and self.packed is None
        # The fp32 copy (one of the two), for steps of at least fp32_from tokens.
        self.weight32 = self.packed32 = None
        self.fp32_from = self.gemv_limit + 1 if no_onednn else PREFILL_MIN_TOKENS
        if prefill_fp32 and not no_onednn:  # backend.prefill_dtype = fp32 keeps its prefills
            self.gemv_limit = min(self.gemv_limit, PREFILL_MIN_TOKENS - 1)
        if (prefill_fp32 or no_onednn) and weight.dtype != torch.float32:
            if no_onednn and torch.backends.mkldnn.is_available():
                # oneDNN's fp32 kernels (blocked layout) beat F.linear's MKL on an AMD EPYC
                # (AVX2, 2 vCPUs; 120 layer linears at 64 tokens 216 vs 289 ms, lm_head 51 vs
                # 93 ms: MKL takes a generic path on non-Intel CPUs).
                self.packed32 = torch.ops.mkldnn._reorder_linear_weight(dense.float(), None)
            else:
                self.weight32 = dense.float()
        # oneDNN's bf16 copy only where a step can reach it: where the kernel takes every step
        # below the fp32 copy's (AVX-512 without BF16, backend.prefill_dtype = auto: 212 MB of
        # this model's layers) it is never read, and the fp32 copy takes what the kernel does
        # not (an empty step, fp32 inputs).
        unread = self.packed is not None and self.weight32 is not None \
            and self.gemv is not None and self.gemv_limit >= self.fp32_from - 1
        if unread:
            self.packed, self.fp32_from = None, 0
        # The plain weight only where F.linear reads it: with oneDNN's copy every step goes to
        # it, the kernel or an fp32 copy (AVX-512 BF16: 212 MB of this model's layers freed).
        self.weight = dense if self.packed is None and not unread else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if 0 < x.shape[0] <= self.gemv_limit and x.dtype == torch.bfloat16:
            return self.gemv.gemv(x.contiguous(), self.gemv_weight, self.gemv_wide)  # type: ignore[union-attr]
        if self.packed32 is not None and x.shape[0] >= self.fp32_from:
            return torch.ops.mkldnn._linear_pointwise(x.float(), self.packed32, None, "none", [], "").to(x.dtype)
        if self.weight32 is not None and x.shape[0] >= self.fp32_from:
            return F.linear(x.float(), self.weight32).to(x.dtype)
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")
        return F.linear(x, self.weight)  # type: ignore[arg-type]  (kept when there is no oneDNN copy)


class Int8Linear:
    """Symmetric per-channel int8 weights; x of any leading shape in fp32 or bf16."""

    def __init__(self, weight: torch.Tensor):
        from pie.backend.kernels import int8_linear_module

        self.kernel = int8_linear_module()
        w = weight.to(torch.float32, copy=True)  # scaled in place below (lm_head may be the embeddings)
        self.scale = (w.abs().amax(dim=1) / 127).clamp_(min=1e-12)
        self.weight = w.mul_((1 / self.scale)[:, None]).round_().to(torch.int8)
        self.out_features = weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).contiguous()
        y = self.kernel.int8_linear(flat, self.weight, self.scale)
        return y.view(*x.shape[:-1], self.out_features)


def make_linear(weight: torch.Tensor, weight_dtype: str, prefill_fp32: bool = False,
                arena: WeightArena | None = None, onednn_rows: int | None = None) -> Linear | Int8Linear:
    """The layer for `backend.weight_dtype` (checked in BackendConfig); int8 layers prefill
    in int8 (faster than either float dtype)."""
    return Int8Linear(weight) if weight_dtype == "int8" else Linear(weight, prefill_fp32, arena, onednn_rows)
