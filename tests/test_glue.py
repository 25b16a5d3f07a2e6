"""The fused bf16 glue (csrc/fused_ops.cpp) against the torch ops it replaces: the same
bf16 roundings, so results are equal except where the mean of squares, summed in another
order, lands a value on the other side of a bf16 rounding boundary."""

from __future__ import annotations

import pytest
import torch

from pie.backend.glue import FusedGlue, TorchGlue, make_glue

BF16 = torch.bfloat16


def close_in_bf16(ours: torch.Tensor, theirs: torch.Tensor, max_mismatch: float) -> None:
    """Equal values, or one bf16 step apart on at most `max_mismatch` of the elements."""
    assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
    diff = (ours.float() - theirs.float()).abs()
    ulp = theirs.float().abs().clamp(min=1e-30) * 2 ** -7
    assert bool((diff <= ulp * 1.01).all()), float((diff / ulp).max())
    assert float((diff > 0).float().mean()) <= max_mismatch


@pytest.fixture(scope="module")
def glues():
    return FusedGlue(), TorchGlue()


@pytest.mark.parametrize("rows,hidden", [(1, 576), (7, 576), (40, 576), (300, 576), (5, 50)])
def test_add_norm_matches_torch(glues, rows, hidden):
    """Prefill sizes (300 rows) included, and a hidden size that is no multiple of the 16
    lanes the squares are summed in."""
    fused, eager = glues
    torch.manual_seed(rows)
    x, delta = torch.randn(rows, hidden).to(BF16), (3 * torch.randn(rows, hidden)).to(BF16)
    weight = torch.rand(hidden).to(BF16) * 2
    for d in (delta, None):
        (sx, h), (tx, th) = fused.add_norm(x, d, weight, 1e-5), eager.add_norm(x, d, weight, 1e-5)
        assert torch.equal(sx, tx)  # the residual add: one rounding, exact
        close_in_bf16(h, th, max_mismatch=0.01)


@pytest.mark.parametrize("rows", [1, 9])
def test_rope_and_silu_match_torch_exactly(glues, rows):
    fused, eager = glues
    torch.manual_seed(rows)
    qkv = torch.randn(rows, 9 * 64 + 6 * 64).to(BF16)  # q (9 heads) + k (3) + v (3)
    qk = qkv[:, : 12 * 64].view(rows, -1, 64)  # strided rows, as in the model
    angles = torch.rand(rows, 1, 64) * 6
    cos, sin = angles.cos().to(BF16), angles.sin().to(BF16)
    assert torch.equal(fused.rope(qk, cos, sin), eager.rope(qk, cos, sin))
    gate_up = (4 * torch.randn(rows, 2 * 1536)).to(BF16)
    close_in_bf16(fused.silu_mul(gate_up, 1536), eager.silu_mul(gate_up, 1536), max_mismatch=0.001)


def test_silu_tail_columns_match_the_vector_loop(glues):
    """silu_mul's loop is vectorised (pie/backend/kernels.py's flags), the rest of a row run
    apart: every column gets the same value whichever way it went (columns are independent)."""
    fused, _ = glues
    torch.manual_seed(3)
    gate, up = (4 * torch.randn(5, 48)).to(BF16), torch.randn(5, 48).to(BF16)
    gate[0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0])
    whole = fused.ops.silu_mul(torch.cat([gate, up], 1))
    for width in (1, 7, 20, 33):  # tails of every length, after 0-2 full vectors
        part = fused.ops.silu_mul(torch.cat([gate[:, :width], up[:, :width]], 1))
        assert torch.equal(part.view(torch.int16), whole[:, :width].view(torch.int16))


def test_a_rows_values_do_not_depend_on_its_batch_and_choice_by_dtype(glues):
    """Every row count takes the fused ops (prefills too), and a row's values are the same
    whatever batch it rides and however the rows are split between threads: what keeps a
    chunked item equal to its one-shot result (tests/test_scoring.py)."""
    fused, _ = glues
    torch.manual_seed(5)
    rows = 300
    x, delta = torch.randn(rows, 576).to(BF16), torch.randn(rows, 576).to(BF16)
    weight = torch.rand(576).to(BF16) * 2
    gate_up = (4 * torch.randn(rows, 2 * 96)).to(BF16)
    qk = torch.randn(rows, 12, 64).to(BF16)
    angles = torch.rand(rows, 1, 64) * 6
    cos, sin = angles.cos().to(BF16), angles.sin().to(BF16)
    whole = (fused.add_norm(x, delta, weight, 1e-5), fused.silu_mul(gate_up, 96), fused.rope(qk, cos, sin))
    for a, b in ((0, 1), (1, 8), (8, 131), (131, rows)):
        (sx, h), y, r = fused.add_norm(x[a:b], delta[a:b], weight, 1e-5), fused.silu_mul(gate_up[a:b], 96), \
            fused.rope(qk[a:b], cos[a:b], sin[a:b])
        assert torch.equal(sx, whole[0][0][a:b]) and torch.equal(h, whole[0][1][a:b])
        assert torch.equal(y.view(torch.int16), whole[1][a:b].view(torch.int16))
        assert torch.equal(r, whole[2][a:b])
    assert isinstance(make_glue(BF16, torch.device("cpu")), FusedGlue)
    assert type(make_glue(torch.float32, torch.device("cpu"))) is TorchGlue  # the fp32 oracle path


def test_fused_ops_reject_other_dtypes(glues):
    fused, _ = glues
    with pytest.raises(RuntimeError, match="bf16"):
        fused.ops.silu_mul(torch.randn(2, 8))
