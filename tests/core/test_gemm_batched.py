"""nvte_batched_gemm on the CPU backend against float64 references: each matrix of the stack
D[i] = op(B[i]) @ op(A[i]) (+ D[i] with accumulate) in every layout, odd sizes, a batch of one,
float32 / bfloat16 / float16 operands and outputs, empty stacks and k = 0; a structured check that
matrix i really pairs A[i] with B[i]; errors for operands that are not dense 3-D high-precision
stacks or whose batch or inner sizes differ. Error bounds as in test_gemm.py."""
import numpy as np
import pytest
from test_gemm import LAYOUTS, U32, ab_shapes, check_f, gemm_bound, gemm_ref
from util import DT, NP_TYPE, nvte

T16 = {"bfloat16": DT.kBFloat16, "float16": DT.kFloat16}


def stack(x, name):
    """(numpy array in name's storage type, its nvte.Tensor, its float64 values)."""
    a = np.ascontiguousarray(np.asarray(x, np.float32).astype(NP_TYPE[name]))
    t = nvte.Tensor(a) if name == "float32" else nvte.Tensor(a.view(np.uint16), dtype=T16[name])
    return a, t, a.astype(np.float64)


def rand_case(rng, batch, n, m, k, transa, transb, name="float32"):
    sa, sb = ab_shapes(n, m, k, transa, transb)
    a = stack(rng.uniform(-2, 2, (batch, *sa)), name)
    b = stack(rng.uniform(-2, 2, (batch, *sb)), name)
    return a, b


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("batch,n,m,k", [(1, 1, 1, 1), (3, 7, 33, 65), (5, 16, 1, 17), (2, 33, 65, 129), (4, 3, 50, 1)])
def test_batched_layouts_random(rng, layout, batch, n, m, k):
    transa, transb = layout[0] == "T", layout[1] == "T"
    (_, ta, ra), (_, tb, rb) = rand_case(rng, batch, n, m, k, transa, transb)
    d = np.full((batch, n, m), np.nan, np.float32)
    nvte.batched_gemm(ta, tb, nvte.Tensor(d), transa=transa, transb=transb)
    for i in range(batch):
        check_f(d[i], gemm_ref(ra[i], rb[i], transa, transb), gemm_bound(ra[i], rb[i], transa, transb))


def test_batched_pairs_matrices_by_index():
    """A[i] = i * identity, B[i] = ones: D[i] = i everywhere (a wrong stride or pairing shows)."""
    batch, n = 5, 4
    a = stack(np.stack([i * np.eye(n) for i in range(batch)]), "float32")
    b = stack(np.ones((batch, n, n)), "float32")
    d = np.zeros((batch, n, n), np.float32)
    nvte.batched_gemm(a[1], b[1], nvte.Tensor(d))
    assert np.array_equal(d, np.arange(batch, dtype=np.float32)[:, None, None] * np.ones((batch, n, n), np.float32))


@pytest.mark.parametrize("name", ["bfloat16", "float16"])
def test_batched_half_precision(rng, name):
    batch, n, m, k = 3, 9, 17, 40
    (_, ta, ra), (_, tb, rb) = rand_case(rng, batch, n, m, k, False, True, name)
    d = np.zeros((batch, n, m), NP_TYPE[name])
    nvte.batched_gemm(ta, tb, nvte.Tensor(d.view(np.uint16), dtype=T16[name]), transa=False, transb=True)
    for i in range(batch):
        check_f(d[i], gemm_ref(ra[i], rb[i], False, True), gemm_bound(ra[i], rb[i], False, True), name)


def test_batched_accumulate(rng):
    batch, n, m, k = 3, 6, 11, 13
    (_, ta, ra), (_, tb, rb) = rand_case(rng, batch, n, m, k, True, False)
    d0 = rng.uniform(-1, 1, (batch, n, m)).astype(np.float32)
    d = d0.copy()
    nvte.batched_gemm(ta, tb, nvte.Tensor(d), transa=True, transb=False, accumulate=True)
    for i in range(batch):
        ref = gemm_ref(ra[i], rb[i], True, False) + d0[i]
        check_f(d[i], ref, gemm_bound(ra[i], rb[i], True, False) + 2 * U32 * np.abs(ref))


def test_batched_empty_and_k_zero(rng):
    d = np.zeros((0, 3, 4), np.float32)
    nvte.batched_gemm(nvte.Tensor(np.zeros((0, 5, 4), np.float32)), nvte.Tensor(np.zeros((0, 3, 5), np.float32)),
                      nvte.Tensor(d))
    d = np.full((2, 3, 4), np.nan, np.float32)  # k = 0: D = 0
    nvte.batched_gemm(nvte.Tensor(np.zeros((2, 0, 4), np.float32)), nvte.Tensor(np.zeros((2, 3, 0), np.float32)),
                      nvte.Tensor(d))
    assert np.array_equal(d, np.zeros_like(d))


def _f(*s):
    return nvte.Tensor(np.zeros(s, np.float32))


@pytest.mark.parametrize("args,msg", [
    (lambda: (_f(2, 5, 4), _f(3, 3, 5), _f(2, 3, 4)), "holds 3 matrices but A holds 2"),
    (lambda: (_f(10, 4), _f(2, 3, 5), _f(2, 3, 4)), r"A must be 3-D \[batch, rows, cols\]"),
    (lambda: (_f(2, 5, 4), _f(2, 3, 6), _f(2, 3, 4)), "inner dimensions differ"),
    (lambda: (_f(2, 5, 4), _f(2, 3, 5), _f(2, 3, 5)), "expected \\[n=3, m=4\\]"),
    (lambda: (nvte.Tensor(np.zeros((2, 5, 4), np.uint8), dtype=DT.kFloat8E4M3), _f(2, 3, 5), _f(2, 3, 4)),
     "batched GEMMs take float32, float16 or bfloat16"),
    (lambda: (nvte.Tensor(None, columnwise_data=np.zeros((4, 2, 5), np.float32)), _f(2, 3, 5), _f(2, 3, 4)),
     "A needs rowwise data"),
])
def test_batched_rejects_bad_arguments(args, msg):
    with pytest.raises(nvte.Error, match=msg):
        nvte.batched_gemm(*args())
