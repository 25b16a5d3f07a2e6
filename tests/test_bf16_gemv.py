"""The bf16 decode linear (csrc/bf16_gemv.cpp) against float64 arithmetic on the same bf16
inputs, and `Linear`'s choice between it and oneDNN."""

from __future__ import annotations

import pytest
import torch

from pie.backend.kernels import bf16_gemv_module
from pie.backend.linear import Linear

BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def gemv():
    module = bf16_gemv_module()
    if not module.supported():
        pytest.skip("this CPU has no AVX-512 BF16: Linear uses oneDNN (F.linear without AVX-512) for every size here")
    return module


def check_close(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """Within one bf16 rounding of the exact product, plus fp32 accumulation error."""
    exact = x.double() @ w.double().T
    bound = exact.abs() * 2 ** -8 + (x.double().abs() @ w.double().abs().T) * 1e-6
    assert y.dtype == BF16 and y.shape == exact.shape
    assert bool(((y.double() - exact).abs() <= bound).all())


@pytest.mark.parametrize("rows", range(1, 17))
@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (7, 64), (131, 32)])
def test_gemv_matches_exact_products(gemv, rows, n, k):
    """Every token count the kernel takes; row counts that leave partial blocks of 4 / 2
    rows and of 64-row tasks."""
    torch.manual_seed(rows * n + k)
    x, w = torch.randn(rows, k).to(BF16), (torch.randn(n, k) / k ** 0.5).to(BF16)
    check_close(gemv.gemv(x, w), x, w)


def test_gemv_rejects_what_it_cannot_do(gemv):
    w = torch.randn(64, 576).to(BF16)
    cases = [
        (torch.randn(17, 576).to(BF16), w, "17 rows"),
        (torch.randn(1, 576), w, "x must be a contiguous bfloat16"),
        (torch.randn(1, 576).to(BF16), torch.randn(64, 576), "weight must be a contiguous bfloat16"),
        (torch.randn(1, 512).to(BF16), w, "x has 512 columns"),
        (torch.randn(1, 48).to(BF16), torch.randn(4, 48).to(BF16), "not a multiple of 32"),
        (torch.randn(576, 2).to(BF16).T, w, "contiguous"),
    ]
    for x, weight, message in cases:
        with pytest.raises(RuntimeError, match=message):
            gemv.gemv(x, weight)


def test_linear_uses_the_kernel_for_decode_sizes_only(gemv):
    """Up to max_tokens rows the kernel, above it oneDNN: both close to the exact product.
    A weight whose width is no multiple of 32 never takes the kernel."""
    torch.manual_seed(0)
    layer = Linear((torch.randn(96, 576) / 24).to(BF16))
    assert layer.gemv is gemv and layer.gemv_max_tokens == gemv.max_tokens() == 16
    for rows in (1, 16, 17, 70):
        x = torch.randn(rows, 576).to(BF16)
        check_close(layer(x), x, layer.weight)
    assert layer(torch.empty(0, 576, dtype=BF16)).shape == (0, 96)  # no rows: oneDNN's empty result
    odd = Linear(torch.randn(8, 40).to(BF16))
    assert odd.gemv is None
    x = torch.randn(1, 40).to(BF16)
    check_close(odd(x), x, odd.weight)
