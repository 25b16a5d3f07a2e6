"""`backend.dtype = auto` (the default): the dtype this machine runs the model fastest in.

On CPU, bf16 halves the bytes every decode step streams, but only hardware with bf16
arithmetic (AMX, or AVX-512 BF16) computes in it; elsewhere oneDNN emulates bf16 matmuls,
and a prefill, which is compute-bound, slows down far more than decode speeds up. Measured on
a CPU without bf16 hardware (issue 16; vLLM's serving client, 8 concurrent, 128-token
prompts): fp32 prefilled 2.8x faster than bf16 (mean time to first token 1.46 s vs 4.03 s)
and decoded 9% slower (137 vs 125 ms per token). So: bf16 where the CPU has bf16 arithmetic,
fp32 where it has not; bf16 on CUDA. The dtype chosen is in the handshake (`pie status`,
`GET /health`) and in every benchmark result's meta, next to the CPU flags.
"""

from __future__ import annotations

from pathlib import Path

BF16_FLAGS = frozenset({"amx_bf16", "avx512_bf16"})  # /proc/cpuinfo flags of bf16 arithmetic


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
    """`name` unless it is "auto"; then bfloat16 on CUDA or on a CPU with bf16 arithmetic,
    float32 otherwise."""
    if name != "auto":
        return name
    if device == "cuda":
        return "bfloat16"
    return "bfloat16" if (cpu_flags() if flags is None else flags) & BF16_FLAGS else "float32"
