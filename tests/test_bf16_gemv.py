"""The bf16 decode linear (csrc/bf16_gemv.cpp: AVX-512 BF16, or its AVX2 + FMA twin) against
float64 arithmetic on the same bf16 inputs, and `Linear`'s choice between it and oneDNN."""

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
        pytest.skip("this CPU has neither AVX-512 BF16 nor AVX2 + FMA: bf16 Linear uses oneDNN or F.linear at every size")
    return module


def check_close(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """Within one bf16 rounding of the exact product, plus fp32 accumulation error."""
    exact = x.double() @ w.double().T
    bound = exact.abs() * 2 ** -8 + (x.double().abs() @ w.double().abs().T) * 1e-6
    assert y.dtype == BF16 and y.shape == exact.shape
    assert bool(((y.double() - exact).abs() <= bound).all())


NONE = torch.empty(0, dtype=BF16)  # gemv()'s `wide` when there is none: its own loop at every size


@pytest.mark.parametrize("wide", [False, True], ids=["panels", "wide"])
@pytest.mark.parametrize("rows", [*range(1, 33), 37, 64, 100, 255])
@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (12, 64), (132, 32), (20, 64), (48, 64)])
def test_gemv_matches_exact_products(gemv, rows, n, k, wide):
    """Every token count the loop over 4-row panels takes (32: two passes of at most 16); row
    counts that leave partial blocks of 4 / 3 / 2 rows, blocks of 3 or 2 rows that straddle
    two of AVX2's 4-row panels, and partial 16-row blocks. With `wide`, the GEMM tiles from
    wide_from() rows up to wide_to() (AVX-512 BF16: tiles of 1-12 tokens over one or two
    16-row blocks; AVX2: 1-6 tokens; n a multiple of 16, else pack_wide() is empty and the
    loop of 4-row panels runs). On a CPU with AMX the wide weight's calls of 1-32 rows run on
    AMX tiles (one or two 16-row x tiles against two 16-row blocks); with AVX-512 and no BF16
    the GEMM tiles take 1-8 tokens over one to three 16-row blocks."""
    tiles = wide and n % 16 == 0 and gemv.wide_from() > 0
    if rows > (gemv.wide_to() if tiles else gemv.max_tokens()):
        pytest.skip(f"past {gemv.max_tokens()} rows only the GEMM tiles take a call (a weight from pack_wide())")
    torch.manual_seed(rows * n + k)
    x, w = torch.randn(rows, k).to(BF16), (torch.randn(n, k) / k ** 0.5).to(BF16)
    check_close(gemv.gemv(x, gemv.pack(w), gemv.pack_wide(w) if wide else NONE), x, w)


def test_a_tiles_row_does_not_depend_on_the_rows_beside_it(gemv):
    """The GEMM tiles sum each (token, row) over k in one order whatever the call's row count
    and tiling: a token's output is the same bits alone, in a tile of 12 and in a call of
    255 (so a step's rows do not change with who shares the step). With AMX (amx_from() > 0)
    calls of up to max_tokens() rows run on AMX tiles instead, whose TDPBF16PS rounds its
    sums otherwise than VDPBF16PS (the last bits differed between the two in 94 of 300 random
    calls of 1-32 rows, 2026-12-05): each is row-independent over its own range of row counts."""
    if not gemv.wide_from():
        pytest.skip("this build has no GEMM tiles")
    torch.manual_seed(3)
    w = (torch.randn(96, 576) / 24).to(BF16)
    packed, wide = gemv.pack(w), gemv.pack_wide(w)
    x = torch.randn(gemv.wide_to(), 576).to(BF16)
    first = gemv.amx_from() or gemv.wide_from()
    ranges = [(first, gemv.max_tokens()), (gemv.max_tokens() + 1, gemv.wide_to())] if gemv.amx_from() \
        else [(first, gemv.wide_to())]
    for lo, hi in ranges:
        full = gemv.gemv(x[:hi].contiguous(), packed, wide)
        for rows in sorted({lo, lo + 1, 12, 13, 16, 17, 31, 32, 33, 100} & set(range(lo, hi))):
            assert torch.equal(gemv.gemv(x[:rows].contiguous(), packed, wide), full[:rows]), rows


def test_the_kernel_runs_amx_tiles_where_the_cpu_has_them(gemv):
    """On a CPU with AMX bf16 tiles the kernel takes 1-32 rows on them (the OS grants the
    tile state on request, Linux 5.16 on), and `kernel_amx` says so; elsewhere amx_from()
    is 0 and the AVX-512 BF16 / AVX2 loops run."""
    from pie.backend.dtype import cpu_flags
    from pie.backend.linear import AMX_FLAGS, kernel_amx

    if not AMX_FLAGS <= cpu_flags():
        assert gemv.amx_from() == 0 and not kernel_amx()
        return
    import ctypes

    # The request the kernel makes (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA; 158 is
    # x86-64's SYS_arch_prctl); asking again is harmless.
    if ctypes.CDLL(None, use_errno=True).syscall(158, 0x1023, 18) != 0:
        assert gemv.amx_from() == 0 and not kernel_amx()
        pytest.skip("the OS refuses this process AMX's tile state (Linux before 5.16?): the kernel keeps its AVX-512 loops")
    assert gemv.amx_from() == 1 and kernel_amx()


def test_gemv_rejects_what_it_cannot_do(gemv):
    plain = torch.randn(64, 576).to(BF16)
    w = gemv.pack(plain)
    cases = [
        (torch.randn(gemv.max_tokens() + 1, 576).to(BF16), w, f"{gemv.max_tokens() + 1} rows"),
        (torch.randn(1, 576), w, "x must be a contiguous bfloat16"),
        (torch.randn(1, 576).to(BF16), w.float(), "weight must be a contiguous bfloat16"),
        (torch.randn(1, 512).to(BF16), w, "x has 512 columns"),
        (torch.randn(576, 2).to(BF16).T, w, "contiguous"),
    ]
    c = gemv.panel_cols()  # the kernel reads 4-row panels: a plain matrix is refused, not misread
    cases.append((torch.randn(1, 576).to(BF16), plain, rf"\[n/4, k/{c}, 4, {c}\] tensor from pack\(\)"))
    for x, weight, message in cases:
        with pytest.raises(RuntimeError, match=message):
            gemv.gemv(x, weight, NONE)
    if gemv.wide_from():  # a wide weight that is not the panels' weight is refused, not misread
        with pytest.raises(RuntimeError, match="wide must be pack_wide"):
            gemv.gemv(torch.randn(gemv.wide_from(), 576).to(BF16), w, gemv.pack_wide(plain[:48]))
    with pytest.raises(RuntimeError, match="not a multiple of 32"):
        gemv.pack(torch.randn(4, 48).to(BF16))
    with pytest.raises(RuntimeError, match="weight must be a contiguous bfloat16"):
        gemv.pack(plain.float())
    with pytest.raises(RuntimeError, match="n = 6 is not a multiple of 4"):
        gemv.pack(torch.randn(6, 64).to(BF16))


def test_panels_hold_the_weight_unchanged(gemv):
    """pack() copies into panels (row r's columns j..j+C-1 at panel r/4, step j/C, lane r%4;
    C = 32 with AVX-512 BF16, 8 with AVX2) and never writes the weight it was given (the LM
    head may be the embedding table)."""
    w = torch.arange(8 * 64, dtype=torch.float32).view(8, 64).to(BF16)
    before = w.clone()
    packed = gemv.pack(w)
    assert torch.equal(w, before)
    c = gemv.panel_cols()
    assert c in (8, 32) and packed.shape == (2, 64 // c, 4, c) and packed.data_ptr() != w.data_ptr()
    assert packed.is_contiguous()
    assert torch.equal(packed[1, 1, 2], w[6, c:2 * c])


def test_wide_layout_holds_the_weight_unchanged(gemv):
    """pack_wide(): [n/16, k, 16]; with AVX-512 BF16 each 16-row block's column pairs
    ([k/2, 16, 2]: rows side by side, their columns 2j and 2j + 1 adjacent), with AVX2
    column j of rows 16b..16b+15 as pairs (row r, row r + 8); empty where n is no multiple
    of 16."""
    w = torch.arange(32 * 64, dtype=torch.float32).view(32, 64).to(BF16)
    before = w.clone()
    wide = gemv.pack_wide(w)
    assert torch.equal(w, before)
    assert wide.shape == (2, 64, 16)
    if gemv.native_bf16():
        pairs = wide.view(2, 32, 16, 2)
        for b, j, r, h in ((0, 0, 0, 0), (0, 5, 3, 1), (1, 31, 15, 1), (1, 10, 2, 0)):
            assert torch.equal(pairs[b, j, r, h], w[16 * b + r, 2 * j + h])
    else:
        for b, j, r, h in ((0, 0, 0, 0), (0, 5, 3, 1), (1, 63, 7, 1), (1, 10, 2, 0)):
            assert torch.equal(wide[b, j, 2 * r + h], w[16 * b + 8 * h + r, j])
    assert gemv.pack_wide(torch.randn(40, 64).to(BF16)).numel() == 0


def test_linear_chooses_between_the_kernel_and_onednn(gemv):
    """Up to wide_to() rows the kernel (in its GEMM tiles from wide_from() on), above it
    oneDNN (on AVX2 an fp32 copy of the weight): all close to the exact product. A weight
    whose width is no multiple of 32 never takes the kernel; one whose height is no multiple
    of 16 has no tiles and stops at max_tokens."""
    torch.manual_seed(0)
    weight = (torch.randn(96, 576) / 24).to(BF16)
    layer = Linear(weight)
    top = gemv.max_tokens()
    assert layer.gemv is gemv and layer.gemv_max_tokens == top == 32
    assert layer.gemv_wide.numel() > 0 and gemv.wide_from() > 0  # GEMM tiles from wide_from() rows
    for rows in (1, 16, top, top + 1, 70):
        x = torch.randn(rows, 576).to(BF16)
        check_close(layer(x), x, weight)
    assert layer(torch.empty(0, 576, dtype=BF16)).shape == (0, 96)  # no rows: oneDNN's empty result
    # Without oneDNN's bf16 kernels (no AVX-512) the steps past the kernel's take an fp32 copy,
    # packed for oneDNN's fp32 kernels.
    assert (layer.packed32 is not None) == (layer.packed is None) and layer.weight32 is None
    limit = gemv.wide_to() or top
    assert layer.gemv_limit == limit
    if layer.packed is None:
        assert layer.fp32_from == limit + 1
    if gemv.wide_to():  # the tiles up to wide_to() rows, then oneDNN (AVX2: the fp32 copy)
        x = torch.randn(limit + 1, 576).to(BF16)
        assert torch.equal(layer(x[:limit]), gemv.gemv(x[:limit].contiguous(), layer.gemv_weight, layer.gemv_wide))
        check_close(layer(x), x, weight)
        with pytest.raises(RuntimeError, match=f"{limit + 1} rows"):
            gemv.gemv(x, layer.gemv_weight, layer.gemv_wide)
    # A weight the tiles cannot take (n no multiple of 16) stops at max_tokens.
    narrow = Linear((torch.randn(20, 576) / 24).to(BF16))
    assert narrow.gemv_limit == top and narrow.gemv_wide.numel() == 0
    odd_weight = torch.randn(8, 40).to(BF16)
    odd = Linear(odd_weight)
    assert odd.gemv is None
    x = torch.randn(1, 40).to(BF16)
    check_close(odd(x), x, odd_weight)
    # The panels hold 4 rows: a weight of 6 rows keeps the path past the kernel.
    six_weight = torch.randn(6, 64).to(BF16)
    six = Linear(six_weight)
    assert six.gemv is None
    x = torch.randn(1, 64).to(BF16)
    check_close(six(x), x, six_weight)
    # The plain weight stays only where F.linear reads it (no oneDNN copy).
    assert (layer.weight is None) == (layer.packed is not None)


def test_pack_into_writes_the_panels_where_it_is_told(gemv):
    """pack_into() (how a Linear fills its slot of the model's weight arena) gives pack()'s
    tensor, in the tensor it was given; a tensor of another shape or dtype is refused."""
    w = torch.randn(12, 64).to(BF16)
    shape = tuple(gemv.packed_shape(12, 64))
    out = torch.empty(shape, dtype=BF16)
    assert gemv.pack_into(w, out).data_ptr() == out.data_ptr()
    assert torch.equal(out, gemv.pack(w))
    with pytest.raises(RuntimeError, match="out must be contiguous bfloat16 of shape"):
        gemv.pack_into(w, torch.empty(shape[::-1], dtype=BF16))
    with pytest.raises(RuntimeError, match="out must be contiguous bfloat16"):
        gemv.pack_into(w, torch.empty(shape))


def test_a_linear_in_an_arena_keeps_both_its_copies_there_with_the_same_results(gemv):
    """With the model's arena (huge pages) a Linear places its panels and its GEMM tiles' wide
    copy there, one after the other; every path gives the bits of the same Linear without one."""
    from pie.backend.weight_arena import WeightArena

    torch.manual_seed(0)
    weight = (torch.randn(96, 576) / 24).to(BF16)
    arena = WeightArena(block_bytes=1 << 20)
    placed, plain = Linear(weight, arena=arena), Linear(weight)
    block = arena.blocks[0]
    inside = lambda t: block.data_ptr() <= t.data_ptr() < block.data_ptr() + block.numel()  # noqa: E731
    assert inside(placed.gemv_weight)
    assert inside(placed.gemv_wide) == (placed.gemv_wide.numel() > 0)
    for rows in (1, 2, 5, gemv.wide_from(), 12, 32, placed.gemv_limit):
        x = torch.randn(rows, 576).to(BF16)
        assert torch.equal(placed(x), plain(x)), rows


def test_with_amx_onednn_takes_steps_past_the_kernels_tiles(gemv):
    """`onednn_from`: AMX flags hand oneDNN every step past the kernel's own AMX tiles
    (AMX_KERNEL_TO, 32 rows), or from AMX_ONEDNN_FROM rows where the kernel has none (its
    AVX-512 tiles lose to oneDNN's AMX kernels there, pie/backend/linear.py); without AMX the
    kernel keeps its own limits."""
    from pie.backend.linear import AMX_KERNEL_TO, AMX_ONEDNN_FROM, onednn_from

    amx_flags = frozenset({"avx512_bf16", "amx_bf16", "amx_tile"})
    assert onednn_from(amx_flags) == AMX_ONEDNN_FROM == 8
    assert onednn_from(amx_flags, kernel_amx=True) == AMX_KERNEL_TO + 1 == 33
    assert onednn_from(frozenset({"avx512_bf16", "avx512f"})) is None
    assert onednn_from(frozenset({"avx512_bf16", "avx512f"}), kernel_amx=True) is None
    assert onednn_from(frozenset({"amx_bf16"})) is None  # no tile state: not AMX
    torch.manual_seed(0)
    weight = (torch.randn(96, 576) / 24).to(BF16)
    layer = Linear(weight)
    for handover in (AMX_ONEDNN_FROM, AMX_KERNEL_TO + 1):
        amx = Linear(weight, onednn_rows=handover)
        if amx.packed is None:  # no oneDNN bf16 (AVX2): nothing to hand over
            assert amx.gemv_limit == layer.gemv_limit
            return
        assert amx.gemv_limit == handover - 1 < layer.gemv_limit
        for rows in (1, handover - 1, handover, 40):
            x = torch.randn(rows, 576).to(BF16)
            check_close(amx(x), x, weight)
        x = torch.randn(handover, 576).to(BF16)
        assert torch.equal(amx(x), torch.ops.mkldnn._linear_pointwise(x, amx.packed, None, "none", [], ""))
