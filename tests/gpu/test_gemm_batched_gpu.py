"""nvte_batched_gemm on CUDA tensors (one strided-batched cuBLASLt call) against the CPU backend
(one GEMM per matrix) on CPU copies of the same inputs: every layout, odd sizes, a batch of one,
attention-sized stacks (64 matrices of 512 x 512 x 128 in bf16), accumulate, k = 0, and a
structured stack whose matrix i must come out as i (stride and pairing). Tolerances:
gemm_gpu_util.py (twice the float32 accumulation bound, plus one output rounding)."""
import pytest
import torch

from transformer_engine import _nvte as nvte

from gpu_util import T, sync
from gemm_gpu_util import HP, LAYOUTS, Operand, Pair, ab_shapes, acc_tol, check_close, gen, nan_pair, workspace


def stack_ref(a, b, transa, transb):
    """S = |op(B[i])| @ |op(A[i])| per matrix (for the error bound)."""
    oa = a.val.transpose(1, 2) if transa else a.val
    ob = b.val.transpose(1, 2) if transb else b.val
    return ob.abs() @ oa.abs()


def both(a, b, d, transa, transb, accumulate=False):
    nvte.batched_gemm(a.tg.t, b.tg.t, d.tg.t, transa=transa, transb=transb, accumulate=accumulate,
                      workspace=workspace().t)
    nvte.batched_gemm(a.tc.t, b.tc.t, d.tc.t, transa=transa, transb=transb, accumulate=accumulate)
    sync()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("batch,n,m,k", [(1, 3, 5, 7), (3, 37, 129, 65), (5, 1, 1, 1), (4, 64, 48, 96)])
def test_batched_layouts(dtype, layout, batch, n, m, k):
    transa, transb = layout[0] == "T", layout[1] == "T"
    g = gen("batched", dtype, layout, batch, n, m, k)
    sa, sb = ab_shapes(n, m, k, transa, transb)
    a, b = Operand((batch, *sa), dtype, g), Operand((batch, *sb), dtype, g)
    d = nan_pair((batch, n, m), HP[dtype])
    both(a, b, d, transa, transb)
    check_close(d.g, d.c, acc_tol(stack_ref(a, b, transa, transb), k), HP[dtype])


@pytest.mark.parametrize("layout", ["NT", "NN"])
def test_batched_attention_sized(layout):
    """Scores (q @ k^T: NT in TE terms with A = k) and context (p @ v: NN) of 4 x 16 heads."""
    transa = layout == "NT"
    batch, n, m, k = 64, 512, 512, 128
    g = gen("attn", layout)
    sa, sb = ab_shapes(n, m, k, transa, False)
    a, b = Operand((batch, *sa), "bfloat16", g), Operand((batch, *sb), "bfloat16", g)
    d = nan_pair((batch, n, m), torch.bfloat16)
    both(a, b, d, transa, False)
    check_close(d.g, d.c, acc_tol(stack_ref(a, b, transa, False), k), torch.bfloat16)


def test_batched_accumulate():
    batch, n, m, k = 3, 33, 65, 17
    g = gen("acc")
    a, b = Operand((batch, k, m), "float32", g), Operand((batch, n, k), "float32", g)
    d = Pair(torch.rand(batch, n, m, generator=g) * 2 - 1)
    both(a, b, d, False, False, accumulate=True)
    check_close(d.g, d.c, acc_tol(stack_ref(a, b, False, False), k), torch.float32)


def test_batched_matrix_i_is_i():
    batch, n = 7, 40
    a = torch.stack([i * torch.eye(n) for i in range(batch)]).cuda()
    b = torch.ones(batch, n, n, device="cuda")
    d = torch.full((batch, n, n), float("nan"), device="cuda")
    nvte.batched_gemm(T(a).t, T(b).t, T(d).t, workspace=workspace().t)
    sync()
    want = torch.arange(batch, dtype=torch.float32).view(batch, 1, 1).expand(batch, n, n)
    assert torch.equal(d.cpu(), want)


def test_batched_k_zero_and_empty():
    d = torch.full((3, 4, 5), float("nan"), device="cuda")
    nvte.batched_gemm(T(torch.zeros(3, 0, 5, device="cuda")).t, T(torch.zeros(3, 4, 0, device="cuda")).t, T(d).t,
                      workspace=workspace().t)
    e = torch.zeros(0, 4, 5, device="cuda")
    nvte.batched_gemm(T(torch.zeros(0, 6, 5, device="cuda")).t, T(torch.zeros(0, 4, 6, device="cuda")).t, T(e).t,
                      workspace=workspace().t)
    sync()
    assert torch.equal(d.cpu(), torch.zeros(3, 4, 5))
