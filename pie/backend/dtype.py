"""`backend.dtype = auto` (the default): the dtype this machine runs the model fastest in.

On CPU, bf16 halves the bytes every decode step streams, but only hardware with bf16
arithmetic (AMX, or AVX-512 BF16) computes in it; elsewhere oneDNN emulates bf16 matmuls,
and a prefill, which is compute-bound, slows down far more than decode speeds up. Measured on
a CPU without bf16 hardware (issue 16; vLLM's serving client, 8 concurrent, 128-token
prompts): fp32 prefilled 2.8x faster than bf16 (mean time to first token 1.46 s vs 4.03 s)
and decoded 9% slower (137 vs 125 ms per token).

So: bf16 where the CPU has bf16 arithmetic; bf16 *weights* with fp32 arithmetic on any other
CPU with AVX2 + FMA: our kernel (csrc/bf16_gemv.cpp) widens the bf16 weight to fp32 for steps of
up to 255 tokens (from 8 on in GEMM tiles, 512-bit ones where the CPU has AVX-512), and larger
steps multiply an fp32 copy of it (pie/backend/linear.py; on AVX-512 `backend.prefill_dtype =
auto` takes that copy from 64 tokens, its probe finding oneDNN's emulated bf16 slower).
Measured with benchmarks/dtypes.py (backend decode step at context 128, the two dtypes
alternating):
- an AMD EPYC with AVX2 only (2 vCPUs): 25 / 77 / 131 / 245 ms at batch 1 / 8 / 16 / 32
  against fp32's 77 / 228 / 299 / 386 (before the panels and tiles of docs/backend.md), a
  512-token prefill at the same speed (226 vs 221 tok/s), 1.9 GB resident against 2.5 GB;
- an Intel Xeon with AVX-512 and no bf16 (Ice Lake, family 6 model 106, 2 vCPUs; 2026-12-06,
  benchmarks/results/xeon-icelake/dtypes.json): 16.4 / 27.5 / 39.6 / 82.4 ms against fp32's
  43.4 / 116.2 / 171.7 / 221.3 (2.6-4.3x), a 512-token prefill at
  680 against 780 tok/s (0.87x; an earlier run the same hour, not kept, had 617 against 616).
  `auto` picked fp32 there before (unmeasured then), the CPU of the outside measurements of
  2026-11-23.
fp32 where the CPU has no AVX2 + FMA; bf16 on CUDA. The dtype chosen is in the handshake (`pie
status`, `GET /health`) and in every benchmark result's meta, next to the CPU flags.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

log = logging.getLogger("pie.backend")

BF16_FLAGS = frozenset({"amx_bf16", "avx512_bf16"})  # /proc/cpuinfo flags of bf16 arithmetic
WIDENING_FLAGS = frozenset({"avx2", "fma"})  # csrc/bf16_gemv.cpp's bf16 -> fp32 loop


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The first CPU's flags (empty where /proc/cpuinfo is absent: not Linux)."""
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.split(":", 1)[0].strip() == "flags":
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def resolve_dtype(name: str, device: str, flags: frozenset[str] | None = None) -> str:
    """`name` unless it is "auto"; then bfloat16 on CUDA, on a CPU with bf16 arithmetic and on
    one with AVX2 + FMA (bf16 weights, fp32 arithmetic); float32 otherwise."""
    if name != "auto":
        return name
    if device == "cuda":
        return "bfloat16"
    flags = cpu_flags() if flags is None else flags
    if flags & BF16_FLAGS or WIDENING_FLAGS <= flags:
        return "bfloat16"
    return "float32"


def fp32_prefill_is_faster(rows: int = 256, repeats: int = 8) -> bool:
    """Whether fp32 matmuls beat bf16 ones at prefill sizes on this CPU, timed at startup
    (~50 ms) rather than guessed from flags: a Xeon with avx512_bf16 and no AMX ran a
    256 x 576 x 1536 matmul in 1.7 ms in fp32 and 2.6 ms in prepacked bf16, and prefilled 512
    tokens at 843 tok/s in fp32 against 600 in bf16, while bf16 decoded 1.3x faster."""
    import torch
    import torch.nn.functional as F

    from pie.backend.linear import Linear

    weight = torch.randn(1536, 576)
    x = torch.randn(rows, 576)
    bf16, xb = Linear(weight.bfloat16()), x.bfloat16()

    def best(run) -> float:
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            run()
            times.append(time.perf_counter() - started)
        return min(times)

    fp32_s, bf16_s = best(lambda: F.linear(x, weight)), best(lambda: bf16(xb))
    log.info("prefill matmul probe: fp32 %.2f ms, bf16 %.2f ms", 1e3 * fp32_s, 1e3 * bf16_s)
    return fp32_s < 0.85 * bf16_s


def resolve_prefill_dtype(name: str, device: str, dtype: str) -> str:
    """`backend.prefill_dtype`: "model", or "float32" (fp32 matmuls for steps of many tokens
    over an fp32 copy of the weights); "auto" = float32 where a bf16 model on CPU prefills
    faster in fp32 (`fp32_prefill_is_faster`)."""
    if name != "auto":
        return name
    if device != "cpu" or dtype != "bfloat16":
        return "model"
    import torch

    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        # No oneDNN bf16 (AVX2 only): steps past the bf16 kernel always multiply the fp32
        # copy (pie/backend/linear.py), so the probe would only time noise.
        return "float32"
    return "float32" if fp32_prefill_is_faster() else "model"
