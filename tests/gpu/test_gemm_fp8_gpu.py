"""FP8 GEMMs on CUDA (cuBLASLt) against the CPU backend: operand formats, fast accumulation, FP8
output with scale / amax / scale_inv, columnwise operands, the shape rules, and scale factors
that are not 16-byte aligned. Tolerances: gemm_gpu_util.py."""
import pytest
import torch

from transformer_engine import _nvte as nvte

from gpu_util import DT, T, assert_bits_equal, sync
from gemm_gpu_util import (AMAX_RTOL, DEV, HP, Operand, ab_shapes, acc_tol, both_gemm, check_close,
                           check_fp8_within_one_step, expect_error, fp8_out_pair, gen, nan_pair,
                           non_tn_fp8_supported, product_ref, scalar_at, workspace)


# ------------------------------------------------------------------------------ FP8
FP8_PAIRS = [("e4m3", "e4m3"), ("e4m3", "e5m2"), ("e5m2", "e4m3")]


@pytest.mark.parametrize("fa,fb", FP8_PAIRS)
@pytest.mark.parametrize("out", ["bfloat16", "float32"])
@pytest.mark.parametrize("n,m,k", [(64, 48, 96), (37, 256, 512), (200, 16, 32)])
def test_fp8_tn(fa, fb, out, n, m, k):
    g = gen(fa, fb, out, n, m, k)
    a, b = Operand((m, k), fa, g), Operand((n, k), fb, g)
    d = nan_pair((n, m), HP[out])
    both_gemm(a, b, d, True, False)
    _, S = product_ref(a, b, True, False)
    check_close(d.g, d.c, acc_tol(S, k, fp8=True), HP[out])


def test_fp8_fast_accumulation():
    g = gen(21)
    n, m, k = 128, 96, 1024
    a, b = Operand((m, k), "e4m3", g), Operand((n, k), "e4m3", g)
    d = nan_pair((n, m), torch.bfloat16)
    both_gemm(a, b, d, True, False, split=False)
    _, S = product_ref(a, b, True, False)
    check_close(d.g, d.c, acc_tol(S, k, fp8=True, split=False), torch.bfloat16)



@pytest.mark.parametrize("fa,fb,fd", [("e4m3", "e4m3", "e4m3"), ("e4m3", "e5m2", "e4m3"),
                                      ("e5m2", "e4m3", "e4m3"), ("e4m3", "e5m2", "e5m2")])
@pytest.mark.parametrize("amax_init", [0.25, 1e6])
def test_fp8_output(fa, fb, fd, amax_init):
    g = gen(22)
    n, m, k = 80, 64, 64
    a, b = Operand((m, k), fa, g), Operand((n, k), fb, g)
    scale = 2.0 if fd == "e4m3" else 64.0
    d, x = fp8_out_pair((n, m), fd, scale, amax_init)
    both_gemm(a, b, d, True, False)
    _, S = product_ref(a, b, True, False)
    check_fp8_within_one_step(d.g, d.c, fd, scale * acc_tol(S, k, fp8=True))
    assert_bits_equal(x["scale_inv"].g, x["scale_inv"].c)  # 1 / scale
    check_close(x["amax"].g, x["amax"].c, AMAX_RTOL * x["amax"].c.abs(), torch.float32)
    if amax_init > 1e5:
        assert x["amax"].g.item() == amax_init  # max-accumulated, not overwritten


def test_fp8_output_needs_workspace_for_amax():
    g = gen(23)
    a, b = Operand((32, 32), "e4m3", g), Operand((16, 32), "e4m3", g)
    d, _ = fp8_out_pair((16, 32), "e4m3", 1.0, 0.0)
    expect_error(nvte.Status.INVALID_ARGUMENT, r"amax needs the GEMM workspace",
                 lambda: nvte.gemm(a.tg.t, b.tg.t, d.tg.t, transa=True, transb=False, workspace=None))


@pytest.mark.parametrize("layout", ["NN", "NT", "TT"])
def test_fp8_columnwise_operands(layout):
    """Non-TN FP8 layouts use the columnwise data (the transpose) with the flag flipped on
    Hopper; the CPU uses the rowwise data. Same values, same result."""
    transa, transb = layout[0] == "T", layout[1] == "T"
    n, m, k = 48, 64, 96
    g = gen(24)
    sa, sb = ab_shapes(n, m, k, transa, transb)
    a = Operand(sa, "e4m3", g, columnwise=True)
    b = Operand(sb, "e5m2", g, columnwise=True)
    d = nan_pair((n, m), torch.bfloat16)
    both_gemm(a, b, d, transa, transb)
    _, S = product_ref(a, b, transa, transb)
    check_close(d.g, d.c, acc_tol(S, k, fp8=True), torch.bfloat16)


def test_fp8_columnwise_only():
    """Operands holding only columnwise data (as FP8 tensors quantized for the backward pass)."""
    n, m, k = 48, 64, 96
    g = gen(25)
    a = Operand((k, m), "e4m3", g, rowwise=False, columnwise=True)  # NN: A needs its transpose
    b = Operand((n, k), "e4m3", g)
    d = nan_pair((n, m), torch.bfloat16)
    both_gemm(a, b, d, False, False)
    _, S = product_ref(a, b, False, False)
    check_close(d.g, d.c, acc_tol(S, k, fp8=True), torch.bfloat16)


def test_fp8_non_tn_without_columnwise_is_not_supported_on_hopper():
    if non_tn_fp8_supported():
        pytest.skip("this GPU runs FP8 GEMMs in every layout")
    g = gen(26)
    a, b = Operand((32, 32), "e4m3", g), Operand((16, 32), "e4m3", g)
    d = nan_pair((16, 32), torch.bfloat16)
    expect_error(nvte.Status.NOT_SUPPORTED, r"only in TN layout.*A is FP8 with transa = false.*no columnwise data",
                 lambda: nvte.gemm(a.tg.t, b.tg.t, d.tg.t, transa=False, transb=False, workspace=workspace().t))


def test_fp8_shape_rules():
    g = gen(27)
    # k = 40: A's and B's leading dimension is 40 bytes, not a multiple of 16.
    a, b = Operand((32, 40), "e4m3", g), Operand((16, 40), "e4m3", g)
    d = nan_pair((16, 32), torch.bfloat16)
    expect_error(nvte.Status.NOT_SUPPORTED, r"leading dimensions of A and B to be multiples of 16 bytes",
                 lambda: nvte.gemm(a.tg.t, b.tg.t, d.tg.t, transa=True, workspace=workspace().t))
    # m = 12 with a bf16 D: 24 bytes.
    a, b = Operand((12, 32), "e4m3", g), Operand((16, 32), "e4m3", g)
    d = nan_pair((16, 12), torch.bfloat16)
    expect_error(nvte.Status.NOT_SUPPORTED, r"D's leading dimension \(m = 12",
                 lambda: nvte.gemm(a.tg.t, b.tg.t, d.tg.t, transa=True, workspace=workspace().t))
    # e5m2 x e5m2 has no cuBLASLt kernel.
    a, b = Operand((32, 32), "e5m2", g), Operand((16, 32), "e5m2", g)
    d = nan_pair((16, 32), torch.bfloat16)
    expect_error(nvte.Status.NOT_SUPPORTED, r"both operands in float8_e5m2",
                 lambda: nvte.gemm(a.tg.t, b.tg.t, d.tg.t, transa=True, workspace=workspace().t))




@pytest.mark.parametrize("offset", [1, 2, 3])
def test_fp8_scale_inv_not_16_byte_aligned(offset):
    """cuBLASLt 13.1's FP8 matmul refuses A/B scale pointers that are 4- or 8-byte aligned (seen
    on the H100); the library hands it aligned copies, so the result is that of aligned ones."""
    g = gen(40, offset)
    n, m, k = 64, 96, 128
    a, b = Operand((m, k), "e4m3", g), Operand((n, k), "e5m2", g)
    d_ref = nan_pair((n, m), torch.bfloat16)
    both_gemm(a, b, d_ref, True, False)
    sa = scalar_at(a.tg.refs[int(nvte.Param.kRowwiseScaleInv)].item(), offset)
    sb = scalar_at(b.tg.refs[int(nvte.Param.kRowwiseScaleInv)].item(), offset + 4)
    assert sa.data_ptr() % 16 != 0 and sb.data_ptr() % 16 != 0
    ta = T(a.tg.refs[int(nvte.Param.kRowwiseData)], dtype=DT.kFloat8E4M3, scale_inv=sa)
    tb = T(b.tg.refs[int(nvte.Param.kRowwiseData)], dtype=DT.kFloat8E5M2, scale_inv=sb)
    d = torch.full((n, m), float("nan"), dtype=torch.bfloat16, device=DEV)
    nvte.gemm(ta.t, tb.t, T(d).t, transa=True, transb=False, workspace=workspace().t)
    sync()
    assert_bits_equal(d, d_ref.g)
    _, S = product_ref(a, b, True, False)
    check_close(d, d_ref.c, acc_tol(S, k, fp8=True), torch.bfloat16)
    expect_error(nvte.Status.INVALID_ARGUMENT, r"not 16-byte aligned.*needs the GEMM workspace",
                 lambda: nvte.gemm(ta.t, tb.t, T(d).t, transa=True, transb=False, workspace=None))


def test_fp8_output_scale_not_16_byte_aligned():
    """The same for D's scale (FP8 output): the stored bytes, amax and scale_inv are those of an
    aligned scale."""
    g = gen(41)
    n, m, k = 80, 64, 64
    a, b = Operand((m, k), "e4m3", g), Operand((n, k), "e4m3", g)
    d_ref, x_ref = fp8_out_pair((n, m), "e4m3", 2.0, 0.25)
    both_gemm(a, b, d_ref, True, False)
    data = torch.full((n, m), 0xAB, dtype=torch.uint8, device=DEV)
    scale, amax, scale_inv = scalar_at(2.0, 1), scalar_at(0.25, 6), scalar_at(-1.0, 11)
    d = T(data, dtype=DT.kFloat8E4M3, scale=scale, amax=amax, scale_inv=scale_inv)
    nvte.gemm(a.tg.t, b.tg.t, d.t, transa=True, transb=False, workspace=workspace().t)
    sync()
    assert_bits_equal(data, d_ref.g.view(torch.uint8))
    assert_bits_equal(amax, x_ref["amax"].g)
    assert_bits_equal(scale_inv, x_ref["scale_inv"].g)
