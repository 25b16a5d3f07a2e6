"""`backend.weight_dtype = "int8"`: the int8 linear kernel against the arithmetic it stands
for, its batch invariance, and the config's guard. Speed and quality on real weights are
benchmarks/quantization.py's (its quick run is in tests/test_bench_scripts.py)."""

from __future__ import annotations

import pytest
import torch

from pie.backend.linear import Int8Linear, make_linear, Linear
from pie.config import BackendConfig, ConfigError


def reference(x: torch.Tensor, layer: Int8Linear) -> torch.Tensor:
    """What the kernel computes, spelled out in torch ops: per-token symmetric int8
    activations, an exact integer product, both scales applied in fp32."""
    xf = x.float()
    amax = xf.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    q = torch.round(xf * (1 / scale)[:, None]).to(torch.int64)
    acc = (q @ layer.weight.to(torch.int64).t()).float()
    return (acc * scale[:, None] * layer.scale[None, :]).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 33])
def test_kernel_matches_its_arithmetic(dtype, rows):
    torch.manual_seed(rows)
    layer = Int8Linear(torch.randn(96, 64).to(dtype))
    x = torch.randn(rows, 64).to(dtype)
    y = layer(x)
    assert y.dtype == dtype and y.shape == (rows, 96)
    torch.testing.assert_close(y.float(), reference(x, layer).float(), rtol=1e-5 if dtype == torch.float32 else 1e-2,
                               atol=1e-5)
    # and close to the unquantized product (int8 keeps ~1% relative error on random data)
    exact = x.float() @ (layer.weight.float() * layer.scale[:, None]).t()
    assert float((y.float() - exact).norm() / exact.norm()) < 0.02


def test_weights_are_per_channel_symmetric_int8():
    w = torch.randn(40, 32) * torch.linspace(0.01, 10, 40)[:, None]  # rows of very different size
    layer = Int8Linear(w)
    assert layer.weight.dtype == torch.int8 and layer.weight.abs().amax(dim=1).eq(127).all()
    torch.testing.assert_close(layer.weight.float() * layer.scale[:, None], w, rtol=0, atol=float(layer.scale.max()) / 2)


def test_a_row_does_not_depend_on_its_batch():
    """Per-token activation scales and an exact int32 product: a sequence's numbers are the
    same alone and among others (a per-batch scale would couple users' outputs)."""
    torch.manual_seed(0)
    layer = Int8Linear(torch.randn(128, 64).bfloat16())
    batch = torch.randn(17, 64).bfloat16()
    batch[3] *= 100  # an outlier row must not change the others
    together = layer(batch)
    for i in (0, 3, 16):
        assert torch.equal(layer(batch[i:i + 1])[0], together[i])


def test_zero_rows_and_leading_dimensions():
    layer = Int8Linear(torch.randn(24, 16))
    x = torch.zeros(2, 3, 16)
    x[1, 2] = torch.randn(16)
    y = layer(x)
    assert y.shape == (2, 3, 24) and torch.isfinite(y).all() and y[0].eq(0).all()


def test_kernel_rejects_mismatched_shapes():
    layer = Int8Linear(torch.randn(8, 16))
    with pytest.raises(RuntimeError, match="columns"):
        layer.kernel.int8_linear(torch.randn(2, 12), layer.weight, layer.scale)


def test_quantizing_leaves_the_source_weight_alone():
    """lm_head may be the embedding table (tied): quantizing it must not scale it in place."""
    w = torch.randn(8, 16)
    before = w.clone()
    Int8Linear(w)
    assert torch.equal(w, before)


def test_make_linear_and_config():
    assert isinstance(make_linear(torch.randn(4, 4), "model"), Linear)
    assert isinstance(make_linear(torch.randn(4, 4), "int8"), Int8Linear)
    assert BackendConfig().weight_dtype == "model"  # off by default: it changes outputs
    with pytest.raises(ConfigError, match="weight_dtype"):
        BackendConfig(weight_dtype="int4")
    with pytest.raises(ConfigError, match="CPU only"):
        BackendConfig(device="cuda", weight_dtype="int8")
