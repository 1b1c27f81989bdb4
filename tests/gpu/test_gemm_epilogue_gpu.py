"""The CUDA GEMM's fused epilogues (bias, GELU with aux, dGELU, bias gradients), high precision and
FP8, against the CPU backend. Tolerances: gemm_gpu_util.py."""
import pytest
import torch

from transformer_engine import _nvte as nvte

from gemm_gpu_util import (AMAX_RTOL, HP, LAYOUTS, OUT_RTOL, Operand, U, ab_shapes, acc_tol, act_tol, both_gemm,
                           check_close, check_fp8_within_one_step, expect_error, fp8_out_pair, gen, nan_pair, op,
                           product_ref, rand_pair, workspace)


# ------------------------------------------------------------------------- epilogues
def operands(layout, dtype, n, m, k, seed):
    """(transa, transb, A, B, generator) of an n x m x k GEMM in `layout` ("TN", ...)."""
    transa, transb = layout[0] == "T", layout[1] == "T"
    g = gen(seed)
    sa, sb = ab_shapes(n, m, k, transa, transb)
    return transa, transb, Operand(sa, dtype, g), Operand(sb, dtype, g), g


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_bias(dtype, layout):
    n, m, k = 40, 72, 56
    transa, transb, a, b, g = operands(layout, dtype, n, m, k, 31)
    bias = rand_pair((m,), HP[dtype], g)
    d = nan_pair((n, m), HP[dtype])
    both_gemm(a, b, d, transa, transb, bias=bias)
    _, S = product_ref(a, b, transa, transb)
    check_close(d.g, d.c, acc_tol(S + 2.0, k), HP[dtype])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("layout", ["TN", "NN"])
def test_gelu_aux(dtype, with_bias, layout):
    n, m, k = 48, 64, 40
    transa, transb, a, b, g = operands(layout, dtype, n, m, k, 32)
    bias = rand_pair((m,), HP[dtype], g) if with_bias else None
    pre = nan_pair((n, m), HP[dtype])
    d = nan_pair((n, m), HP[dtype])
    both_gemm(a, b, d, transa, transb, bias=bias, pre=pre)
    _, S = product_ref(a, b, transa, transb)
    tol = acc_tol(S + 2.0, k)
    check_close(pre.g, pre.c, tol, HP[dtype])
    x = pre.c.double()
    check_close(d.g, d.c, 1.2 * tol + act_tol(x), HP[dtype])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("with_dbias", [False, True])
@pytest.mark.parametrize("layout", ["NN", "TN"])
def test_dgelu(dtype, with_dbias, layout):
    n, m, k = 48, 64, 40
    transa, transb, a, b, g = operands(layout, dtype, n, m, k, 33)
    pre = rand_pair((n, m), HP[dtype], g, -3.0, 3.0)  # the GELU input, read
    dbias = nan_pair((m,), HP[dtype]) if with_dbias else None
    d = nan_pair((n, m), HP[dtype])
    both_gemm(a, b, d, transa, transb, bias=dbias, pre=pre, grad=True)
    _, S = product_ref(a, b, transa, transb)
    # |dgelu| <= 1.13: the product's error scales by it; dgelu's own error times |product|.
    tol = 1.2 * acc_tol(S, k) + act_tol(pre.c.double()) * S
    check_close(d.g, d.c, tol, HP[dtype])
    if with_dbias:
        # Column sums of D (before its output rounding on both sides): each element's error plus
        # the rounding of D itself (the GPU may sum the unrounded values), plus float32 summation.
        dc = d.c.double()
        col_tol = (tol + OUT_RTOL[HP[dtype]] * dc.abs()).sum(0) + 2 * (n + 2) * U * dc.abs().sum(0)
        check_close(dbias.g, dbias.c, col_tol, HP[dtype])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_bgradb(dtype, layout):
    """grad with bias and no pre_gelu_out: bias receives the row sums of op(B) ([n]). cuBLASLt's
    BGRADB epilogue exists only for a transposed B (the wgrad layout NT); other layouts fail
    clearly instead of computing something else."""
    n, m, k = 48, 64, 40
    transa, transb, a, b, g = operands(layout, dtype, n, m, k, 34)
    dbias = nan_pair((n,), HP[dtype])
    d = nan_pair((n, m), HP[dtype])
    if not transb:
        expect_error(nvte.Status.NOT_SUPPORTED, r"epilogue BGRADB.*only for a transposed B",
                     lambda: nvte.gemm(a.tg.t, b.tg.t, d.tg.t, bias=dbias.tg.t, transa=transa, transb=transb,
                                       grad=True, workspace=workspace().t))
        return
    both_gemm(a, b, d, transa, transb, bias=dbias, grad=True)
    _, S = product_ref(a, b, transa, transb)
    check_close(d.g, d.c, acc_tol(S, k), HP[dtype])
    ob = op(b.val, transb)
    check_close(dbias.g, dbias.c, 4 * (k + 2) * U * ob.abs().sum(1), HP[dtype])


def test_gelu_needs_m_multiple_of_8():
    g = gen(35)
    a, b = Operand((12, 16), "bfloat16", g), Operand((8, 16), "bfloat16", g)
    pre = nan_pair((8, 12), torch.bfloat16)
    d = nan_pair((8, 12), torch.bfloat16)
    expect_error(nvte.Status.NOT_SUPPORTED, r"GELU epilogues need m .* multiple of 8, got m = 12",
                 lambda: nvte.gemm(a.tg.t, b.tg.t, d.tg.t, pre_gelu_out=pre.tg.t, transa=True,
                                   workspace=workspace().t))


@pytest.mark.parametrize("epi", ["bias", "gelu_bias", "fp8_out_bias"])
def test_fp8_epilogues(epi):
    """The FP8 forward epilogues Transformer Engine uses: bf16 bias, GELU with a bf16 aux."""
    g = gen(36)
    n, m, k = 64, 96, 128
    a, b = Operand((m, k), "e4m3", g), Operand((n, k), "e4m3", g)
    bias = rand_pair((m,), torch.bfloat16, g)
    _, S = product_ref(a, b, True, False)
    tol = acc_tol(S + 2.0, k, fp8=True)
    if epi == "fp8_out_bias":
        d, x = fp8_out_pair((n, m), "e4m3", 1.0, 0.0)
        both_gemm(a, b, d, True, False, bias=bias)
        check_fp8_within_one_step(d.g, d.c, "e4m3", tol)
        check_close(x["amax"].g, x["amax"].c, AMAX_RTOL * x["amax"].c.abs(), torch.float32)
        return
    d = nan_pair((n, m), torch.bfloat16)
    pre = nan_pair((n, m), torch.bfloat16) if epi == "gelu_bias" else None
    both_gemm(a, b, d, True, False, bias=bias, pre=pre)
    if pre is not None:
        check_close(pre.g, pre.c, tol, torch.bfloat16)
        tol = 1.2 * tol + act_tol(pre.c.double())
    check_close(d.g, d.c, tol, torch.bfloat16)


@pytest.mark.parametrize("epi", ["bias", "gelu", "gelu_bias"])
@pytest.mark.parametrize("accumulate", [False, True])
def test_fp8_epilogues_float32_model(epi, accumulate):
    """FP8 operands with a float32 D, bias and GELU aux (a float32 model under fp8_autocast): cuBLASLt
    has no such FP8 epilogue, so the library runs a plain GEMM and applies bias / GELU itself."""
    g = gen(37)
    n, m, k = 48, 80, 96
    a, b = Operand((m, k), "e4m3", g), Operand((n, k), "e4m3", g)
    bias = rand_pair((m,), torch.float32, g) if epi != "gelu" else None
    _, S = product_ref(a, b, True, False)
    tol = acc_tol(S + 2.0 + (2.0 if accumulate else 0.0), k, fp8=True)
    d = rand_pair((n, m), torch.float32, g) if accumulate else nan_pair((n, m), torch.float32)
    pre = nan_pair((n, m), torch.float32) if epi.startswith("gelu") else None
    both_gemm(a, b, d, True, False, bias=bias, pre=pre, accumulate=accumulate)
    if pre is not None:
        check_close(pre.g, pre.c, tol, torch.float32)
        tol = 1.2 * tol + act_tol(pre.c.double())
    check_close(d.g, d.c, tol, torch.float32)
