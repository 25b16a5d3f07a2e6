"""`backend.dtype = auto`: bf16 only where the hardware computes in it."""

from __future__ import annotations

import pytest

from pie.backend.dtype import cpu_flags, resolve_dtype
from pie.config import BackendConfig, ConfigError


@pytest.mark.parametrize("flags, want", [
    ({"avx2", "avx512f", "avx512_bf16"}, "bfloat16"),  # AMD Zen 4, Intel Cooper Lake
    ({"avx2", "avx512f", "amx_tile", "amx_bf16"}, "bfloat16"),  # Intel Sapphire Rapids
    ({"avx2", "avx512f"}, "float32"),  # Skylake-SP, Zen 3: bf16 would be emulated
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
