"""Fused scale + mask + softmax on the CUDA backend vs the CPU backend (the oracle) on the same
inputs: the four families forward and backward, row lengths 1 .. 20000 (warp-per-row,
block-per-row and the multi-pass kernel), explicit masks broadcast over heads (and batch),
causal rows that see nothing, mixed dtypes, misaligned buffers, in-place calls, poisoned
outputs. (An nvte tensor does not own its buffers: every torch tensor passed in is kept in a
local until the call returns.)

Tolerances: both backends compute in float32 in the same order per element, but the device
computes exp as 2^(d log2 e) on its special-function unit (a few ulp from glibc's expf, ~5e-6
relative at worst, results below 2^-126 flush to 0) and accumulates the row sums (sum of exp,
sum of dy * y) in a different order (tree vs sequential), a relative difference of order
sqrt(Sk) float32 ulps: rtol 5e-5 on float32 results, plus one ulp of a 16-bit output dtype.
The backward's cancellation (dy - dot) turns the dot's error into an absolute error of
~|scale * y| * sum|dy * y| * 2e-5. Masked (causal) positions must be exactly 0."""
import math

import pytest
import torch

from transformer_engine import _nvte as nvte

from gpu_util import T, _explain, cpu_copy, poisoned, sync

HP = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
ULP = {torch.float32: 0.0, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}
FLOOR = {torch.float32: 1e-30, torch.float16: 2.0**-24, torch.bfloat16: 1e-30}  # fp16 subnormals
RTOL32 = 5e-5
SKS = [1, 7, 128, 1000, 4097]

FWD = {
    "scaled": lambda x, m, y, s: nvte.scaled_softmax_forward(x, y, s),
    "masked": lambda x, m, y, s: nvte.scaled_masked_softmax_forward(x, m, y, s),
    "upper_triang": lambda x, m, y, s: nvte.scaled_upper_triang_masked_softmax_forward(x, y, s),
    "aligned_causal": lambda x, m, y, s: nvte.scaled_aligned_causal_masked_softmax_forward(x, y, s),
}
BWD = {
    "scaled": nvte.scaled_softmax_backward,
    "masked": nvte.scaled_masked_softmax_backward,
    "upper_triang": nvte.scaled_upper_triang_masked_softmax_backward,
    "aligned_causal": nvte.scaled_aligned_causal_masked_softmax_backward,
}


def gen(seed):
    return torch.Generator().manual_seed(seed)


def logits(shape, dtype, g, spread=3.0):
    return (torch.randn(shape, generator=g) * spread).to(dtype)


def probs(shape, dtype, g):
    return torch.softmax(torch.randn(shape, generator=g, dtype=torch.float64) * 3.0, -1).to(dtype)


def assert_fwd_close(got, ref):
    g, r = got.detach().cpu().double(), ref.detach().cpu().double()
    assert g.shape == r.shape
    tol = (RTOL32 + ULP[ref.dtype]) * r.abs() + FLOOR[ref.dtype]
    bad = ~((g - r).abs() <= tol)
    assert not bool(bad.any()), _explain(g, r, bad)


def assert_bwd_close(got, ref, dy, y, scale):
    g, r = got.detach().cpu().double(), ref.detach().cpu().double()
    dy, y = dy.double(), y.double()
    mult = (scale * y).abs() * (dy.abs() + (dy * y).abs().sum(-1, keepdim=True))
    tol = (1e-5 + ULP[ref.dtype]) * r.abs() + 2e-5 * mult + FLOOR[ref.dtype]
    bad = ~((g - r).abs() <= tol)
    assert not bool(bad.any()), _explain(g, r, bad)


def causal_mask(sq, sk):
    i = torch.arange(sq)[:, None]
    j = torch.arange(sk)[None, :]
    return j > i + (sk - sq)


def forward_both(family, x, out_dtype, scale, mask=None, xin=None):
    """Runs on CUDA (x copied, or the device view xin) and on CPU; returns (gpu, cpu) outputs."""
    # Every buffer stays referenced by a local until the call returns (T does not own it).
    xd = xin if xin is not None else x.cuda()
    yd = poisoned(tuple(x.shape), out_dtype, "cuda")
    mask_d = mask.cuda() if mask is not None else None
    FWD[family](T(xd).t, T(mask_d).t if mask is not None else None, T(yd).t, scale)
    xc = cpu_copy(x)
    yc = poisoned(tuple(x.shape), out_dtype, "cpu")
    FWD[family](T(xc).t, T(mask).t if mask is not None else None, T(yc).t, scale)
    sync()
    return yd, yc


def backward_both(family, dy, y, out_dtype, scale):
    dxd = poisoned(tuple(y.shape), out_dtype, "cuda")
    dyd, yd = dy.cuda(), y.cuda()
    BWD[family](T(dyd).t, T(yd).t, T(dxd).t, scale)
    dxc = poisoned(tuple(y.shape), out_dtype, "cpu")
    BWD[family](T(dy).t, T(y).t, T(dxc).t, scale)
    sync()
    return dxd, dxc


# ------------------------------------------------------------ forward


@pytest.mark.parametrize("scale", [1.0, 0.125])
@pytest.mark.parametrize("out_dtype", list(HP))
@pytest.mark.parametrize("in_dtype", list(HP))
def test_scaled_forward(in_dtype, out_dtype, scale):
    """Every kernel size class: warp per row (<= 1024), block per row (<= 16384), multi-pass."""
    g = gen(1)
    shapes = [(2, 3, 5, sk) for sk in SKS] + [(1, 1), (3, 33), (5, 300), (3, 2048), (2, 8000), (2, 16384),
                                               (2, 20000)]
    for shape in shapes:
        x = logits(shape, HP[in_dtype], g)
        yd, yc = forward_both("scaled", x, HP[out_dtype], scale)
        assert_fwd_close(yd, yc)


def test_scaled_forward_extreme_logits():
    """Equal logits give uniform rows; huge logits must not overflow (max subtracted first)."""
    x = torch.stack([torch.ones(1000), torch.arange(1000.0), 1000.0 * torch.arange(1000.0) - 3000.0])
    yd, yc = forward_both("scaled", x, torch.float32, 1.0)
    assert_fwd_close(yd, yc)
    assert yd[2, -1].item() == 1.0 and bool((yd[2, :-1] == 0).all())
    # rows of -inf logits: zeros, not NaN (warp, block and multi-pass kernels)
    for sk in (7, 1000, 8000, 20000):
        x = torch.full((2, sk), float("-inf"))
        x[1] = 0.0
        yd, yc = forward_both("scaled", x, torch.float32, 1.0)
        assert bool((yd[0] == 0).all()) and not bool(yd.isnan().any())
        assert_fwd_close(yd, yc)


@pytest.mark.parametrize("mask_batch", ["B", "1"])
@pytest.mark.parametrize("scale", [1.0, 0.125])
@pytest.mark.parametrize("dtype", list(HP))
def test_masked_forward(dtype, scale, mask_batch):
    g = gen(2)
    for b, h, sq, sk in [(2, 3, 4, sk) for sk in SKS] + [(3, 1, 1, 1), (2, 2, 3, 20000)]:
        x = logits((b, h, sq, sk), HP[dtype], g)
        mb = b if mask_batch == "B" else 1
        mask = (torch.rand((mb, 1, sq, sk), generator=g) < 0.3).to(torch.uint8)
        if sq > 1:
            mask[0, 0, 0, :] = 1  # a fully masked row (zeros) and a fully visible one
            mask[0, 0, 1, :] = 0
        yd, yc = forward_both("masked", x, HP[dtype], scale, mask)
        assert_fwd_close(yd, yc)


@pytest.mark.parametrize("scale", [1.0, 0.125])
@pytest.mark.parametrize("dtype", list(HP))
def test_upper_triang_forward(dtype, scale):
    g = gen(3)
    for batches, s in [(1, 1), (3, 7), (2, 128), (2, 1000), (1, 1500)]:
        x = logits((batches, s, s), HP[dtype], g)
        yd, yc = forward_both("upper_triang", x, HP[dtype], scale)
        assert_fwd_close(yd, yc)
        assert bool((yd.cpu()[causal_mask(s, s).expand(batches, s, s)] == 0).all())


@pytest.mark.parametrize("scale", [1.0, 0.125])
@pytest.mark.parametrize("dtype", list(HP))
def test_aligned_causal_forward(dtype, scale):
    """Sq == Sk, Sq < Sk, and Sq > Sk (the first Sq - Sk rows see nothing: all zeros)."""
    g = gen(4)
    for b, h, sq, sk in [(2, 3, 6, 6), (1, 2, 4, 11), (2, 1, 9, 5), (1, 1, 3, 1), (2, 2, 5, 128),
                         (1, 2, 7, 1000), (1, 1, 3, 4097), (1, 2, 100, 7), (1, 1, 2, 20000), (1, 1, 20, 3000)]:
        x = logits((b, h, sq, sk), HP[dtype], g)
        yd, yc = forward_both("aligned_causal", x, HP[dtype], scale)
        assert_fwd_close(yd, yc)
        assert bool((yd.cpu()[causal_mask(sq, sk).expand(b, h, sq, sk)] == 0).all())


def test_mixed_dtypes_and_in_place_forward():
    g = gen(5)
    for sk in [7, 1000, 4097, 20000]:
        x = logits((3, 4, sk), torch.bfloat16, g)
        yd, yc = forward_both("scaled", x, torch.float32, 0.5)
        assert_fwd_close(yd, yc)
        x = logits((2, 2, 3, sk), torch.float16, g)
        xd = x.cuda()
        FWD["aligned_causal"](T(xd).t, None, T(xd).t, 0.5)  # in place
        yc = poisoned(tuple(x.shape), torch.float16, "cpu")
        FWD["aligned_causal"](T(x).t, None, T(yc).t, 0.5)
        sync()
        assert_fwd_close(xd, yc)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_misaligned_buffers(dtype):
    """Input and output one element past a 16-byte boundary: element-wise loads in every kernel."""
    g = gen(6)
    for sk in [7, 128, 1000, 4096, 16384]:
        x = logits((3, sk), dtype, g)
        xb = torch.empty(x.numel() + 1, dtype=dtype, device="cuda")
        xin = xb[1:].view(x.shape)
        xin.copy_(x)
        ob = torch.full((x.numel() + 1,), float("nan"), dtype=dtype, device="cuda")
        yd = ob[1:].view(x.shape)
        FWD["scaled"](T(xin).t, None, T(yd).t, 0.7)
        yc = poisoned(tuple(x.shape), dtype, "cpu")
        FWD["scaled"](T(x).t, None, T(yc).t, 0.7)
        sync()
        assert_fwd_close(yd, yc)
        assert torch.isnan(ob[0]).item(), "wrote before the output"


# ------------------------------------------------------------ backward


@pytest.mark.parametrize("scale", [1.0, 0.125])
@pytest.mark.parametrize("dtype", list(HP))
@pytest.mark.parametrize("family", list(BWD))
def test_backward(family, dtype, scale):
    g = gen(7)
    shapes = [(2, 3, 5, sk) for sk in SKS] + [(1, 1, 2, 2048), (1, 1, 2, 16384), (1, 1, 2, 20000)]
    if family == "upper_triang":
        shapes = [(3, s, s) for s in [1, 7, 128, 1000]] + [(1, 2048, 2048)]
    for shape in shapes:
        y = probs(shape, HP[dtype], g)
        dy = torch.randn(shape, generator=g).to(HP[dtype])
        dxd, dxc = backward_both(family, dy, y, HP[dtype], scale)
        assert_bwd_close(dxd, dxc, dy, y, scale)


@pytest.mark.parametrize("dtype", list(HP))
def test_backward_in_place(dtype):
    """output_grads aliasing incoming_grads (and, once, softmax_results)."""
    g = gen(8)
    for sk in [1, 7, 1000, 4097, 20000]:
        shape = (2, 2, 3, sk)
        y = probs(shape, HP[dtype], g)
        dy = torch.randn(shape, generator=g).to(HP[dtype])
        dxc = poisoned(shape, HP[dtype], "cpu")
        BWD["scaled"](T(dy).t, T(y).t, T(dxc).t, 0.5)
        dyd, yd2 = dy.cuda(), y.cuda()
        BWD["scaled"](T(dyd).t, T(yd2).t, T(dyd).t, 0.5)
        yd, dyd2 = y.cuda(), dy.cuda()
        BWD["masked"](T(dyd2).t, T(yd).t, T(yd).t, 0.5)
        sync()
        assert_bwd_close(dyd, dxc, dy, y, 0.5)
        assert_bwd_close(yd, dxc, dy, y, 0.5)


def test_backward_mixed_dtypes():
    g = gen(9)
    for sk in [7, 1000, 4097, 20000]:
        shape = (3, 2, sk)
        y = probs(shape, torch.float32, g)
        dy = torch.randn(shape, generator=g).to(torch.bfloat16)
        dxd, dxc = backward_both("scaled", dy, y, torch.float16, 0.25)
        assert_bwd_close(dxd, dxc, dy, y, 0.25)


def test_output_amax_matches_cpu():
    g = gen(10)
    for sk in [7, 1000, 5000, 20000]:
        x = logits((4, sk), torch.float32, g)
        ad, ac = torch.zeros(1, device="cuda"), torch.zeros(1)
        yd, yc = torch.empty(4, sk, device="cuda"), torch.empty(4, sk)
        xd = x.cuda()
        nvte.scaled_softmax_forward(T(xd).t, T(yd, amax=ad).t, 1.0)
        nvte.scaled_softmax_forward(T(x).t, T(yc, amax=ac).t, 1.0)
        sync()
        torch.testing.assert_close(ad.cpu(), ac, rtol=1e-4, atol=0.0)


def test_empty_launches_nothing():
    for shape in [(0, 8), (4, 0)]:
        x = torch.zeros(shape, device="cuda")
        y = torch.empty(shape, device="cuda")
        nvte.scaled_softmax_forward(T(x).t, T(y).t, 1.0)
        nvte.scaled_softmax_backward(T(x).t, T(x).t, T(y).t, 1.0)
    sync()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_columnwise_output_is_the_transposed_rows(dtype):
    """An output with a columnwise buffer too gets the [cols, rows] transpose of its 2D view (the
    CPU's layout), bit-equal to the rowwise result; forward (masked) and backward. Columnwise
    only is NOT_SUPPORTED on the GPU (the rows are written first), with that reason."""
    g = gen(11)
    shape = (2, 3, 5, 37)
    rows, cols = 30, 37
    x = logits(shape, dtype, g)
    mask = torch.rand((2, 1, 5, 37), generator=g) < 0.3
    mask = mask.to(torch.uint8)
    xd, md = x.cuda(), mask.cuda()
    y, yt = poisoned(shape, dtype, "cuda"), poisoned((cols, rows), dtype, "cuda")
    nvte.scaled_masked_softmax_forward(T(xd).t, T(md).t, T(y, columnwise=yt).t, 0.5)
    yc = poisoned(shape, dtype, "cpu")
    nvte.scaled_masked_softmax_forward(T(x).t, T(mask).t, T(yc).t, 0.5)
    sync()
    assert_fwd_close(y, yc)
    assert torch.equal(yt.cpu(), y.cpu().reshape(rows, cols).t())
    dy = torch.randn(shape, generator=g).to(dtype).cuda()
    dx, dxt = poisoned(shape, dtype, "cuda"), poisoned((cols, rows), dtype, "cuda")
    nvte.scaled_softmax_backward(T(dy).t, T(y).t, T(dx, columnwise=dxt).t, 0.5)
    sync()
    assert torch.equal(dxt.cpu(), dx.cpu().reshape(rows, cols).t())
    x2, only = xd.reshape(rows, cols).contiguous(), poisoned((cols, rows), dtype, "cuda")
    with pytest.raises(nvte.Error, match="only columnwise data; the CUDA softmax needs the rowwise buffer"):
        nvte.scaled_softmax_forward(T(x2).t, T(columnwise=only).t, 1.0)
