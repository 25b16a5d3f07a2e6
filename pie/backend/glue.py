"""The elementwise glue between a Llama layer's matmuls: residual add + RMSNorm, RoPE,
SiLU(gate) * up — in torch ops (HF's arithmetic, the fp32 correctness oracle) or, for bf16
on CPU, one C++ call each (csrc/fused_ops.cpp) at every row count.

Why: eager, the glue is ~20 Python-dispatched ops per layer, 600 per step. Fused, the bf16
decode step (benchmarks/quantization.py's "base", Xeon 2 vCPU, context 128) went from 22.0
/ 38.3 / 94.2 ms to 19.5 / 35.2 / 92.9 ms at batch 1 / 8 / 32, int8 weights from 12.8 /
24.5 / 52.9 to 11.1 / 22.5 / 49.6. The fused calls round to bf16 where the torch ops do.

Prefills too (2026-12-03): they kept the torch ops above 128 rows while add+norm summed
its squares in one running float, a scalar chain that was level with torch at 256 rows.
Summed in 16 lanes it vectorises: per call at 512 rows (AMD EPYC Zen 5, 2 vCPUs) add+norm
58 vs torch's 166 us, RoPE 79 vs 194, SiLU*up 207 vs 258, and a 512-token prefill's forward
went from 244 to 218 ms in-process (136 tokens: 67 -> 64 ms; alternating rounds, pairs
0.97-1.20x). One arithmetic at every row count also keeps a chunked item equal to its
one-shot result (tests/test_scoring.py): a row's values never depend on its batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's LlamaRMSNorm: normalise in fp32, cast back, then scale in the model dtype.

    Not F.rms_norm: its single rounding differs from HF's two in bf16 and, compounded over
    30 layers, flipped SmolLM2's greedy answers (tests/test_bf16.py guards this).
    """
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D]; cos/sin: [T, 1, D] in x's dtype (HF's rotate_half convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class TorchGlue:
    def add_norm(self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, rms_norm(x + delta)); delta None: (x, rms_norm(x))."""
        x = x if delta is None else x + delta
        return x, rms_norm(x, weight, eps)

    def final_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """The model's last RMSNorm, over the output rows of a step."""
        return rms_norm(x, weight, eps)

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return apply_rope(x, cos, sin)

    def silu_mul(self, gate_up: torch.Tensor, intermediate: int) -> torch.Tensor:
        return F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]


class FusedGlue(TorchGlue):
    """bf16 on CPU: the C++ calls."""

    def __init__(self) -> None:
        from pie.backend.kernels import fused_ops_module

        self.ops = fused_ops_module()

    def add_norm(self, x, delta, weight, eps):
        return self.ops.add_rms_norm(x, delta, weight, eps)

    def final_norm(self, x, weight, eps):
        """norm_row's arithmetic at every row count, as the greedy tail of a fused decode step
        computes it (csrc/decode_step.cpp, Head): a row's draw is then the same
        whichever path its step took, one-shot or chunked."""
        return self.ops.add_rms_norm(x.contiguous(), None, weight, eps)[1]

    def rope(self, x, cos, sin):
        return self.ops.rope(x, cos, sin)

    def silu_mul(self, gate_up, intermediate):
        return self.ops.silu_mul(gate_up)


def make_glue(dtype: torch.dtype, device: torch.device) -> TorchGlue:
    return FusedGlue() if dtype == torch.bfloat16 and device.type == "cpu" else TorchGlue()
