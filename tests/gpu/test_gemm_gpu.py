"""nvte_cublas_gemm / _v2 / nvte_multi_tensor_gemm on CUDA tensors in high precision against the
CPU backend on CPU copies of the same inputs: layouts, sizes, alignment, accumulate, amax, the
_v2 options, grouped GEMMs, empty products. Tolerances: gemm_gpu_util.py."""
import pytest
import torch

from transformer_engine import _nvte as nvte

from gpu_util import T, assert_bits_equal, sync
from gemm_gpu_util import (HP, LAYOUTS, OUT_RTOL, Operand, Pair, WS_BYTES, ab_shapes, acc_tol, act_tol, both_gemm,
                           check_close, gen, nan_pair, product_ref, rand_pair, workspace)


# ------------------------------------------------------------------------- plain GEMMs
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("n,m,k", [(1, 1, 1), (3, 5, 7), (37, 129, 65), (200, 256, 1000), (64, 48, 96)])
def test_layouts(dtype, layout, n, m, k):
    transa, transb = layout[0] == "T", layout[1] == "T"
    g = gen(dtype, layout, n, m, k)
    sa, sb = ab_shapes(n, m, k, transa, transb)
    a, b = Operand(sa, dtype, g), Operand(sb, dtype, g)
    d = nan_pair((n, m), HP[dtype])
    both_gemm(a, b, d, transa, transb)
    _, S = product_ref(a, b, transa, transb)
    check_close(d.g, d.c, acc_tol(S, k), HP[dtype])


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_large(dtype):
    n, m, k = 1024, 768, 2048
    g = gen(7)
    a, b = Operand((m, k), dtype, g), Operand((n, k), dtype, g)
    d = nan_pair((n, m), HP[dtype])
    both_gemm(a, b, d, True, False)
    _, S = product_ref(a, b, True, False)
    check_close(d.g, d.c, acc_tol(S, k), HP[dtype])


@pytest.mark.parametrize("layout", ["TN", "NT"])
def test_misaligned_operands(layout):
    """Operands starting 1 element into their allocation (2-byte aligned): cuBLASLt must be told."""
    transa, transb = layout[0] == "T", layout[1] == "T"
    n, m, k = 33, 47, 81
    g = gen(11)
    sa, sb = ab_shapes(n, m, k, transa, transb)
    a, b = Operand(sa, "bfloat16", g, offset=1), Operand(sb, "bfloat16", g, offset=3)
    d = nan_pair((n, m), torch.bfloat16)
    both_gemm(a, b, d, transa, transb)
    _, S = product_ref(a, b, transa, transb)
    check_close(d.g, d.c, acc_tol(S, k), torch.bfloat16)


def test_repeated_call_same_result():
    """The second call of a shape reuses the cached plan; results are bit-identical."""
    g = gen(12)
    n, m, k = 96, 80, 144
    a, b = Operand((m, k), "bfloat16", g), Operand((n, k), "bfloat16", g)
    d1, d2 = nan_pair((n, m), torch.bfloat16), nan_pair((n, m), torch.bfloat16)
    both_gemm(a, b, d1, True, False)
    both_gemm(a, b, d2, True, False)
    assert_bits_equal(d1.g, d2.g)
    _, S = product_ref(a, b, True, False)
    check_close(d1.g, d1.c, acc_tol(S, k), torch.bfloat16)


def test_sm_count_and_no_workspace():
    g = gen(13)
    n, m, k = 128, 256, 512
    a, b = Operand((m, k), "bfloat16", g), Operand((n, k), "bfloat16", g)
    _, S = product_ref(a, b, True, False)
    d = nan_pair((n, m), torch.bfloat16)
    both_gemm(a, b, d, True, False, sm=16)
    check_close(d.g, d.c, acc_tol(S, k), torch.bfloat16)
    d = nan_pair((n, m), torch.bfloat16)
    both_gemm(a, b, d, True, False, ws=False)
    check_close(d.g, d.c, acc_tol(S, k), torch.bfloat16)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_accumulate(dtype):
    g = gen(14)
    n, m, k = 64, 72, 40
    a, b = Operand((k, m), dtype, g), Operand((n, k), dtype, g)
    d = rand_pair((n, m), HP[dtype], g)
    both_gemm(a, b, d, False, False, accumulate=True)
    P, S = product_ref(a, b, False, False)
    # cuBLASLt rounds the product to D's dtype before adding C = D when D is 16-bit (seen on
    # H200, cuBLASLt 13.1): one more rounding of |product| than the CPU.
    check_close(d.g, d.c, acc_tol(S + 2.0, k) + OUT_RTOL[HP[dtype]] * P.abs(), HP[dtype])


def test_amax_of_high_precision_output():
    g = gen(15)
    n, m, k = 50, 64, 32
    a, b = Operand((m, k), "bfloat16", g), Operand((n, k), "bfloat16", g)
    for init in (0.25, 1e6):  # max-accumulated: a small amax grows, a large one stays
        d = Pair(torch.full((n, m), float("nan"), dtype=torch.bfloat16))
        amax = Pair(torch.tensor([init], dtype=torch.float32))
        d.tg = T(d.g, amax=amax.g)
        d.tc = T(d.c, amax=amax.c)
        both_gemm(a, b, d, True, False)
        _, S = product_ref(a, b, True, False)
        check_close(d.g, d.c, acc_tol(S, k), torch.bfloat16)
        # The GPU reduces the stored bf16 D, the CPU the float32 values before rounding: one bf16 ulp.
        check_close(amax.g, amax.c, 1e-5 * amax.c.abs(), torch.bfloat16)
        if init > 1e5:
            assert amax.g.item() == init




# ------------------------------------------------------------------------------ v2
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("separate_c", [False, True])
def test_v2_alpha_beta(dtype, separate_c):
    g = gen(41)
    n, m, k = 56, 40, 72
    a, b = Operand((m, k), dtype, g), Operand((k, n), dtype, g)  # TT
    alpha, beta = 0.5, -1.5
    d = rand_pair((n, m), HP[dtype], g)
    c = rand_pair((n, m), HP[dtype], g) if separate_c else None
    ws = workspace()
    nvte.gemm_v2(True, True, alpha, a.tg.t, b.tg.t, beta, c.tg.t if c else None, d.tg.t, workspace=ws.t)
    nvte.gemm_v2(True, True, alpha, a.tc.t, b.tc.t, beta, c.tc.t if c else None, d.tc.t)
    sync()
    _, S = product_ref(a, b, True, True)
    check_close(d.g, d.c, acc_tol(alpha * S + abs(beta) * 2.0, k), HP[dtype])


def test_v2_config_epilogue():
    g = gen(42)
    n, m, k = 40, 64, 48
    a, b = Operand((m, k), "bfloat16", g), Operand((n, k), "bfloat16", g)
    bias = rand_pair((m,), torch.bfloat16, g)
    pre = nan_pair((n, m), torch.bfloat16)
    d = nan_pair((n, m), torch.bfloat16)
    for dev_t in ("tg", "tc"):
        kw = dict(workspace=workspace().t) if dev_t == "tg" else {}
        nvte.gemm_v2(True, False, 2.0, getattr(a, dev_t).t, getattr(b, dev_t).t, 0.0, None, getattr(d, dev_t).t,
                     bias=getattr(bias, dev_t).t, gelu=True, aux=getattr(pre, dev_t).t, sm_count=8, **kw)
    sync()
    _, S = product_ref(a, b, True, False)
    tol = acc_tol(2 * S + 2.0, k)
    check_close(pre.g, pre.c, tol, torch.bfloat16)
    check_close(d.g, d.c, 1.2 * tol + act_tol(pre.c.double()), torch.bfloat16)


# ---------------------------------------------------------------------- multi-tensor
def test_multi_tensor():
    g = gen(51)
    shapes = [(16, 32, 48), (33, 40, 24), (64, 8, 16)]
    As, Bs, Ds, biases = [], [], [], []
    for i, (n, m, k) in enumerate(shapes):
        As.append(Operand((m, k), "bfloat16", g))
        Bs.append(Operand((n, k), "bfloat16", g))
        Ds.append(nan_pair((n, m), torch.bfloat16))
        biases.append(rand_pair((m,), torch.bfloat16, g) if i != 1 else None)
    ws = workspace()
    nvte.multi_tensor_gemm([x.tg.t for x in As], [x.tg.t for x in Bs], [x.tg.t for x in Ds],
                           [x.tg.t if x else None for x in biases], [None] * 3, transa=True, transb=False,
                           workspace=[ws.t])
    nvte.multi_tensor_gemm([x.tc.t for x in As], [x.tc.t for x in Bs], [x.tc.t for x in Ds],
                           [x.tc.t if x else None for x in biases], [None] * 3, transa=True, transb=False)
    sync()
    for (n, m, k), a, b, d in zip(shapes, As, Bs, Ds):
        _, S = product_ref(a, b, True, False)
        check_close(d.g, d.c, acc_tol(S + 2.0, k), torch.bfloat16)


def test_empty_and_k0():
    g = gen(52)
    # n = 0: nothing to write.
    a, b = Operand((16, 8), "bfloat16", g), Operand((0, 8), "bfloat16", g)
    d = nan_pair((0, 16), torch.bfloat16)
    both_gemm(a, b, d, True, False)
    # k = 0: D = 0, and the bias gradient of op(B) is 0.
    a, b = Operand((16, 0), "bfloat16", g), Operand((8, 0), "bfloat16", g)
    d = nan_pair((8, 16), torch.bfloat16)
    dbias = nan_pair((8,), torch.bfloat16)
    both_gemm(a, b, d, True, False, bias=dbias, grad=True)
    assert_bits_equal(d.g, d.c)
    assert_bits_equal(dbias.g, dbias.c)


def test_workspace_size():
    assert WS_BYTES >= 32 << 20
    assert nvte.gemm_workspace_size(nvte.Backend.CPU) == 0
