"""`backend.dtype = auto`: bf16 where the hardware computes in it, or where our kernel widens
bf16 weights to fp32 (AVX2 + FMA, with or without AVX-512)."""

from __future__ import annotations

import pytest

from pie.backend.dtype import cpu_flags, resolve_dtype
from pie.config import BackendConfig, ConfigError


@pytest.mark.parametrize("flags, want", [
    ({"avx2", "avx512f", "avx512_bf16"}, "bfloat16"),  # AMD Zen 4, Intel Cooper Lake
    ({"avx2", "avx512f", "amx_tile", "amx_bf16"}, "bfloat16"),  # Intel Sapphire Rapids
    ({"avx2", "fma", "avx512f"}, "bfloat16"),  # Skylake-SP to Ice Lake: bf16 weights, fp32 arithmetic
    ({"avx2", "fma", "f16c"}, "bfloat16"),  # AMD Zen 2/3: bf16 weights, fp32 arithmetic (our kernel)
    ({"avx", "sse4_2"}, "float32"),  # no AVX2: no kernel for bf16
    (set(), "float32"),  # no /proc/cpuinfo (not Linux)
])
def test_auto_follows_the_cpu_flags(flags, want):
    assert resolve_dtype("auto", "cpu", frozenset(flags)) == want


def test_an_explicit_dtype_and_cuda():
    assert resolve_dtype("float32", "cpu", frozenset({"avx512_bf16"})) == "float32"
    assert resolve_dtype("bfloat16", "cpu", frozenset()) == "bfloat16"
    assert resolve_dtype("auto", "cuda", frozenset()) == "bfloat16"


def test_cpu_flags_reads_the_flags_line(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: X\nflags\t\t: fpu avx2 avx512_bf16\n\nprocessor\t: 1\n")
    assert cpu_flags(info) == {"fpu", "avx2", "avx512_bf16"}
    assert cpu_flags(tmp_path / "absent") == frozenset()


def test_config_default_is_auto_and_bad_values_are_refused():
    assert BackendConfig().dtype == "auto"
    with pytest.raises(ConfigError, match="backend.dtype"):
        BackendConfig(dtype="float16")


def test_the_engine_reports_the_resolved_dtype(model_dir):
    from pie import protocol as P
    from pie.backend.engine import Engine

    engine = Engine(model_dir, BackendConfig(num_kv_pages=4, num_embeds=8))
    reply = engine.handshake(P.HandshakeRequest(P.PROTOCOL_VERSION))
    assert reply.dtype == resolve_dtype("auto", "cpu") and reply.dtype != "auto"


def test_prefill_dtype_resolution():
    """`backend.prefill_dtype`: explicit values stand; auto is fp32 only for a bf16 model
    on CPU, decided by a timed probe (whose answer depends on the CPU, so only its type is
    checked here; without oneDNN's bf16 kernels it is fp32 unprobed)."""
    import torch

    from pie.backend.dtype import fp32_prefill_is_faster, resolve_prefill_dtype

    assert resolve_prefill_dtype("model", "cpu", "bfloat16") == "model"
    assert resolve_prefill_dtype("float32", "cpu", "bfloat16") == "float32"
    assert resolve_prefill_dtype("auto", "cuda", "bfloat16") == "model"
    assert resolve_prefill_dtype("auto", "cpu", "float32") == "model"
    assert resolve_prefill_dtype("auto", "cpu", "bfloat16") in ("model", "float32")
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():  # AVX2 only: always the fp32 copy, no probe
        assert resolve_prefill_dtype("auto", "cpu", "bfloat16") == "float32"
    assert isinstance(fp32_prefill_is_faster(rows=16, repeats=2), bool)


def test_linear_prefills_in_fp32_from_64_tokens():
    import torch
    import torch.nn.functional as F

    from pie.backend.linear import PREFILL_MIN_TOKENS, Linear

    torch.manual_seed(0)
    weight = torch.randn(48, 32).bfloat16()
    mixed, plain = Linear(weight, prefill_fp32=True), Linear(weight)
    # (On AVX2 the kernel's GEMM tiles take steps up to gemv_limit rows, fp32_from after them.)
    long = torch.randn(max(PREFILL_MIN_TOKENS, mixed.fp32_from), 32).bfloat16()
    assert torch.equal(mixed(long), F.linear(long.float(), weight.float()).bfloat16())
    short = long[: PREFILL_MIN_TOKENS - 1]
    assert torch.equal(mixed(short), plain(short))  # decode steps keep the bf16 kernel
    # Where oneDNN has bf16 kernels and the kernel takes every step below the fp32 copy's,
    # oneDNN's copy is dropped (never read) and the fp32 copy takes the rest.
    if torch.ops.mkldnn._is_mkldnn_bf16_supported() and mixed.gemv is not None \
            and mixed.gemv_limit >= PREFILL_MIN_TOKENS - 1:
        assert mixed.packed is None and mixed.weight is None
        assert mixed(torch.empty(0, 32).bfloat16()).shape == (0, 48)
        x32 = torch.randn(3, 32)
        assert torch.equal(mixed(x32), F.linear(x32, weight.float()))
    assert Linear(weight.float(), prefill_fp32=True).weight32 is None  # an fp32 model needs no copy
