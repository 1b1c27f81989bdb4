"""nvte_cublas_gemm / _v2 / nvte_multi_tensor_gemm on the CPU backend against float64 references.

Row-major view of TE's convention: D [n, m] = op(B) [n, k] @ op(A) [k, m].

Accuracy bound for the float32 product (used wherever results are not exact): summing k
products in float32 in any order (blocking and FMA change the order, not the bound) gives
|fl(x.y) - x.y| <= gamma_k * |x|.|y| with gamma_k ~= k * u, u = 2^-24 (Higham, Thm 3.1).
We allow 2 * (k + 2) * u * (|op(B)| @ |op(A)|): the factor 2 and the +2 cover the epilogue's
own roundings (alpha, beta * C, bias add). The reference operands are the float32 values the
library decodes (FP8 bytes * scale_inv rounded to float32), so decoding adds no error.
"""
import os
import subprocess
import sys

import numpy as np
import pytest
from util import (BF16, DT, FP8_NP, NP_TYPE, NVTE_DTYPE, TOLERANCE, assert_bits_equal, fp8_decode,
                  fp8_encode_ref, nvte, scalar)

U32 = 2.0**-24
LAYOUTS = ["TN", "NN", "NT", "TT"]


# ----------------------------------------------------------------------------- references
def op(x, trans):
    return x.T if trans else x


def gemm_ref(a, b, transa, transb):
    return op(b, transb) @ op(a, transa)


def gemm_bound(a, b, transa, transb):
    k = op(a, transa).shape[0]
    return 2.0 * (k + 2) * U32 * (np.abs(op(b, transb)) @ np.abs(op(a, transa)))


def gelu_ref(x):
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)))


def dgelu_ref(x):
    k = np.sqrt(2.0 / np.pi)
    t = np.tanh(k * (x + 0.044715 * x**3))
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * k * (1.0 + 3 * 0.044715 * x * x)


# ------------------------------------------------------------------------------ operands
class Operand:
    """A GEMM input of dtype `name`; .ref holds the exact float64 values the library sees."""

    def __init__(self, values, name, scale_inv=1.0, columnwise=False):
        self.name = name
        if name in FP8_NP:
            si = np.float32(scale_inv)
            self.data = np.ascontiguousarray(fp8_encode_ref(np.asarray(values, np.float32) / si, name))
            self.si = scalar(si)
            dec = (fp8_decode(self.data, name).astype(np.float32) * si).astype(np.float64)
            if columnwise:  # only the transpose is stored, with its columnwise scale_inv
                self.col = np.ascontiguousarray(self.data.T)
                self.tensor = nvte.Tensor(columnwise_data=self.col, dtype=NVTE_DTYPE[name],
                                          columnwise_scale_inv=self.si)
            else:
                self.tensor = nvte.Tensor(self.data, dtype=NVTE_DTYPE[name], scale_inv=self.si)
            self.ref = dec
        else:
            self.data = np.ascontiguousarray(np.asarray(values, np.float32).astype(NP_TYPE[name]))
            self.tensor = nvte.Tensor(self.data)
            self.ref = self.data.astype(np.float64)


def rand_operand(rng, shape, name, scale_inv=1.0, columnwise=False):
    # FP8 operands get scale_inv != 1 so decoding must apply it; values stay in range.
    if name in FP8_NP and scale_inv == 1.0:
        scale_inv = 0.375 if name == "e4m3" else 3.0
    return Operand(rng.uniform(-2.0, 2.0, shape), name, scale_inv, columnwise)


def ab_shapes(n, m, k, transa, transb):
    return ((m, k) if transa else (k, m)), ((k, n) if transb else (n, k))


def out_f(shape, name="float32"):
    d = np.full(shape, np.nan, dtype=NP_TYPE[name])
    return d, nvte.Tensor(d)


def check_f(got, ref, bound, name="float32"):
    """|got - ref| <= bound (+ the output dtype's rounding from util.TOLERANCE when not float32)."""
    g = np.asarray(got, np.float64)
    assert g.shape == ref.shape
    tol = np.array(bound, np.float64)
    if name != "float32":
        atol, rtol = TOLERANCE[name]
        tol = tol + atol + rtol * np.abs(ref)
    bad = ~(np.abs(g - ref) <= tol)
    assert not bad.any(), (f"{bad.sum()} of {bad.size} differ; first at {np.argwhere(bad)[0]}: "
                           f"got {g[bad][0]!r} ref {ref[bad][0]!r} tol {np.broadcast_to(tol, ref.shape)[bad][0]!r}")


def act_err(x):
    """Absolute error of gelu_f / dgelu_f evaluated in float32 at x: a few ulps of their O(1 + |x|)
    terms, plus tanhf's error (~2 ulp) amplified by |d/dt| <= ~5 for |x| <= 4; 2^-19 (1 + |x|) covers both."""
    return 2.0**-19 * (1.0 + np.abs(x))


# ------------------------------------------------------------------------------- layouts
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("n,m,k", [(1, 1, 1), (7, 33, 65), (33, 65, 129), (129, 7, 33), (16, 1, 17), (3, 50, 1)])
def test_layouts_random(rng, layout, n, m, k):
    transa, transb = layout[0] == "T", layout[1] == "T"
    sa, sb = ab_shapes(n, m, k, transa, transb)
    a, b = rand_operand(rng, sa, "float32"), rand_operand(rng, sb, "float32")
    d, td = out_f((n, m))
    nvte.gemm(a.tensor, b.tensor, td, transa=transa, transb=transb)
    check_f(d, gemm_ref(a.ref, b.ref, transa, transb), gemm_bound(a.ref, b.ref, transa, transb))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_structured_exact(layout):
    # Small integers: every partial sum is exact in float32, so any indexing slip shows.
    n, m, k = 37, 45, 29
    transa, transb = layout[0] == "T", layout[1] == "T"
    sa, sb = ab_shapes(n, m, k, transa, transb)
    a_vals = (np.arange(np.prod(sa)) % 13 - 6).reshape(sa)
    b_vals = (np.arange(np.prod(sb)) % 7 - 3).reshape(sb)
    for av, bv in [(a_vals, b_vals), (np.ones(sa), b_vals), (a_vals, np.ones(sb))]:
        a, b = Operand(av, "float32"), Operand(bv, "float32")
        d, td = out_f((n, m))
        nvte.gemm(a.tensor, b.tensor, td, transa=transa, transb=transb)
        np.testing.assert_array_equal(d, gemm_ref(a.ref, b.ref, transa, transb))


def test_large_blocked_threaded(rng):
    # Several k slices, row blocks and column panels, edge tiles on every side.
    n, m, k = 300, 257, 511
    for transa, transb, name in [(True, False, "float32"), (False, True, "bfloat16")]:
        sa, sb = ab_shapes(n, m, k, transa, transb)
        a, b = rand_operand(rng, sa, name), rand_operand(rng, sb, name)
        d, td = out_f((n, m))
        nvte.gemm(a.tensor, b.tensor, td, transa=transa, transb=transb)
        check_f(d, gemm_ref(a.ref, b.ref, transa, transb), gemm_bound(a.ref, b.ref, transa, transb))


def test_packed_column_chunks(rng):
    # Large k: the packed copy of op(A) is built in several column chunks (bounded memory).
    n, m, k = 150, 2100, 4096
    a, b = rand_operand(rng, (k, m), "float32"), rand_operand(rng, (n, k), "float32")
    d, td = out_f((n, m))
    nvte.gemm(a.tensor, b.tensor, td)
    check_f(d, gemm_ref(a.ref, b.ref, False, False), gemm_bound(a.ref, b.ref, False, False))


def test_3d_operands(rng):
    # Leading dims flatten: B [2, 5, k] (tokens) x W [m, k]^T -> D [2, 5, m].
    b = rand_operand(rng, (2, 5, 24), "float32")
    a = rand_operand(rng, (11, 24), "float32")
    d, td = out_f((2, 5, 11))
    nvte.gemm(a.tensor, b.tensor, td, transa=True)
    b2 = b.ref.reshape(10, 24)
    check_f(d.reshape(10, 11), gemm_ref(a.ref, b2, True, False), gemm_bound(a.ref, b2, True, False))


# -------------------------------------------------------------------------------- dtypes
IN_COMBOS = [("float32", "float32"), ("bfloat16", "bfloat16"), ("float16", "float16"), ("bfloat16", "float32"),
             ("e4m3", "e4m3"), ("e4m3", "e5m2"), ("e5m2", "e4m3"), ("e5m2", "e5m2")]


@pytest.mark.parametrize("a_t,b_t", IN_COMBOS)
@pytest.mark.parametrize("out", ["float32", "bfloat16", "float16"])
def test_input_output_dtypes(rng, a_t, b_t, out):
    n, m, k = 19, 70, 45
    a, b = rand_operand(rng, (m, k), a_t), rand_operand(rng, (n, k), b_t)
    d, td = out_f((n, m), out)
    nvte.gemm(a.tensor, b.tensor, td, transa=True)
    check_f(d, gemm_ref(a.ref, b.ref, True, False), gemm_bound(a.ref, b.ref, True, False), out)


def check_fp8_out(o, ref, bound, fmt, scale):
    # The float32 result is within `bound` of ref, then rounded to FP8: allow one FP8 step
    # (2^-3 relative for E4M3, 2^-2 for E5M2) plus the smallest subnormal below the normals.
    step = 2.0**-3 if fmt == "e4m3" else 2.0**-2
    tiny = (2.0**-9 if fmt == "e4m3" else 2.0**-16) / scale
    got = fp8_decode(o.data, fmt) / scale
    check_f(got, ref, bound + tiny + step * (np.abs(ref) + bound))


@pytest.mark.parametrize("a_t,b_t", [("e4m3", "e4m3"), ("e4m3", "e5m2"), ("bfloat16", "bfloat16")])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fp8_output(rng, a_t, b_t, fmt):
    from util import FP8Out
    n, m, k = 23, 40, 37
    a, b = rand_operand(rng, (k, m), a_t), rand_operand(rng, (n, k), b_t)
    scale = 8.0 if fmt == "e4m3" else 0.5
    o = FP8Out((n, m), fmt, scale=scale, amax=0.0)
    nvte.gemm(a.tensor, b.tensor, o.tensor)
    ref, bound = gemm_ref(a.ref, b.ref, False, False), gemm_bound(a.ref, b.ref, False, False)
    check_fp8_out(o, ref, bound, fmt, scale)
    assert o.scale_inv[0] == np.float32(1.0 / scale)
    assert abs(o.amax[0] - np.abs(ref).max()) <= bound.max()
    # amax is max-accumulated: a larger running value survives.
    o2 = FP8Out((n, m), fmt, scale=scale, amax=1e6)
    nvte.gemm(a.tensor, b.tensor, o2.tensor)
    assert o2.amax[0] == 1e6
    assert_bits_equal(o2.data, o.data)


@pytest.mark.parametrize("which", ["A", "B", "both"])
def test_fp8_columnwise_only_operand(rng, which):
    # An operand holding only its transpose must give bit-identical results to the rowwise one.
    n, m, k = 21, 34, 50
    av, bv = rng.uniform(-2, 2, (m, k)), rng.uniform(-2, 2, (n, k))
    a_row, b_row = Operand(av, "e4m3", 0.5), Operand(bv, "e5m2", 1.5)
    a = Operand(av, "e4m3", 0.5, columnwise=which in ("A", "both"))
    b = Operand(bv, "e5m2", 1.5, columnwise=which in ("B", "both"))
    d_row, td_row = out_f((n, m))
    d, td = out_f((n, m))
    nvte.gemm(a_row.tensor, b_row.tensor, td_row, transa=True)
    nvte.gemm(a.tensor, b.tensor, td, transa=True)
    check_f(d, gemm_ref(a_row.ref, b_row.ref, True, False), gemm_bound(a_row.ref, b_row.ref, True, False))
    np.testing.assert_array_equal(d, d_row)


# ----------------------------------------------------------------------------- epilogues
@pytest.mark.parametrize("out,bias_t", [("float32", "float32"), ("bfloat16", "bfloat16"), ("float16", "float32")])
def test_bias(rng, out, bias_t):
    n, m, k = 9, 31, 20
    a, b = rand_operand(rng, (m, k), "float32"), rand_operand(rng, (n, k), "float32")
    bias = rng.uniform(-1, 1, m).astype(np.float32).astype(NP_TYPE[bias_t])
    d, td = out_f((n, m), out)
    nvte.gemm(a.tensor, b.tensor, td, bias=nvte.Tensor(bias), transa=True)
    ref = gemm_ref(a.ref, b.ref, True, False) + bias.astype(np.float64)
    check_f(d, ref, gemm_bound(a.ref, b.ref, True, False) + U32 * np.abs(ref), out)


@pytest.mark.parametrize("aux_t", ["float32", "bfloat16"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gelu_epilogue(rng, aux_t, with_bias):
    n, m, k = 17, 29, 33
    a, b = rand_operand(rng, (m, k), "bfloat16"), rand_operand(rng, (n, k), "bfloat16")
    bias = rng.uniform(-1, 1, m).astype(np.float32)
    aux, taux = out_f((n, m), aux_t)
    d, td = out_f((n, m))
    nvte.gemm(a.tensor, b.tensor, td, bias=nvte.Tensor(bias) if with_bias else None, pre_gelu_out=taux,
              transa=True)
    pre = gemm_ref(a.ref, b.ref, True, False) + (bias if with_bias else 0.0)
    bound = gemm_bound(a.ref, b.ref, True, False) + U32 * np.abs(pre)
    check_f(aux, pre, bound, aux_t)
    # D is gelu of the float32 pre-activation (not of the rounded aux); |gelu'| < 1.13.
    check_f(d, gelu_ref(pre), 1.13 * bound + act_err(pre))


@pytest.mark.parametrize("aux_t", ["float32", "bfloat16"])
@pytest.mark.parametrize("with_dbias", [False, True])
def test_dgelu_dbias_epilogue(rng, aux_t, with_dbias):
    n, m, k = 45, 26, 38
    # dgrad: A = W [out, in] with NN layout, B = dY [tok, out].
    a, b = rand_operand(rng, (k, m), "float32"), rand_operand(rng, (n, k), "float32")
    pre = rng.uniform(-3, 3, (n, m)).astype(np.float32).astype(NP_TYPE[aux_t])
    dbias = np.full(m, np.nan, np.float32)
    d, td = out_f((n, m))
    nvte.gemm(a.tensor, b.tensor, td, bias=nvte.Tensor(dbias) if with_dbias else None,
              pre_gelu_out=nvte.Tensor(pre), grad=True)
    x = pre.astype(np.float64)
    g, r = dgelu_ref(x), gemm_ref(a.ref, b.ref, False, False)
    ref = r * g
    # Product error scaled by |dgelu| (+ the product's rounding), plus dgelu_f's own error times |r|.
    bound = (gemm_bound(a.ref, b.ref, False, False) + U32 * np.abs(r)) * np.abs(g) + np.abs(r) * act_err(x)
    check_f(d, ref, bound)
    if with_dbias:
        # Column sums in float32 over n rows: (n + 2) * u relative to the sum of magnitudes.
        mag = (np.abs(ref) + bound).sum(axis=0)
        check_f(dbias, ref.sum(axis=0), bound.sum(axis=0) + 2 * (n + 2) * U32 * mag)


@pytest.mark.parametrize("transb", [False, True])
@pytest.mark.parametrize("b_t", ["float32", "bfloat16", "e4m3"])
def test_bgradb_epilogue(rng, transb, b_t):
    # grad without pre_gelu_out: bias receives sum_k op(B)[i, k] (length n); D is the plain product.
    n, m, k = 27, 19, 53
    a = rand_operand(rng, (k, m), "e5m2" if b_t == "e4m3" else "float32")
    b = rand_operand(rng, (k, n) if transb else (n, k), b_t)
    db = np.full(n, np.nan, np.float32)
    d, td = out_f((n, m))
    nvte.gemm(a.tensor, b.tensor, td, bias=nvte.Tensor(db), transb=transb, grad=True)
    check_f(d, gemm_ref(a.ref, b.ref, False, transb), gemm_bound(a.ref, b.ref, False, transb))
    opb = op(b.ref, transb)
    check_f(db, opb.sum(axis=1), 2 * (k + 1) * U32 * np.abs(opb).sum(axis=1))
    # Structured check of the index mapping: row i of op(B) all equal i -> bias[i] = i * k.
    bv = np.repeat(np.arange(n, dtype=np.float64)[:, None], k, axis=1)
    b2 = Operand(bv.T if transb else bv, "float32")
    nvte.gemm(a.tensor if b_t != "e4m3" else rand_operand(rng, (k, m), "float32").tensor, b2.tensor, td,
              bias=nvte.Tensor(db), transb=transb, grad=True)
    np.testing.assert_array_equal(db, np.arange(n) * k)


@pytest.mark.parametrize("out", ["float32", "bfloat16"])
def test_accumulate(rng, out):
    n, m, k = 14, 37, 22
    a, b = rand_operand(rng, (m, k), "float32"), rand_operand(rng, (k, n), "float32")
    d0 = rng.uniform(-1, 1, (n, m)).astype(np.float32).astype(NP_TYPE[out])
    d = d0.copy()
    bias = rng.uniform(-1, 1, m).astype(np.float32)
    nvte.gemm(a.tensor, b.tensor, nvte.Tensor(d), bias=nvte.Tensor(bias), transa=True, transb=True, accumulate=True)
    ref = gemm_ref(a.ref, b.ref, True, True) + d0.astype(np.float64) + bias
    check_f(d, ref, gemm_bound(a.ref, b.ref, True, True) + 2 * U32 * np.abs(ref), out)


# ------------------------------------------------------------------------------------ v2
@pytest.mark.parametrize("c_mode", ["separate", "none", "same"])
def test_v2_alpha_beta(rng, c_mode):
    n, m, k = 12, 41, 30
    a, b = rand_operand(rng, (m, k), "bfloat16"), rand_operand(rng, (n, k), "bfloat16")
    c = rng.uniform(-1, 1, (n, m)).astype(np.float32)
    alpha, beta = 0.75, -1.5
    if c_mode == "separate":
        d, td = out_f((n, m), "bfloat16")
        nvte.gemm_v2(True, False, alpha, a.tensor, b.tensor, beta, nvte.Tensor(c), td)
    else:
        d = c.copy()
        td = nvte.Tensor(d)
        nvte.gemm_v2(True, False, alpha, a.tensor, b.tensor, beta, None if c_mode == "none" else td, td)
    ref = alpha * gemm_ref(a.ref, b.ref, True, False) + beta * c
    bound = alpha * gemm_bound(a.ref, b.ref, True, False) + 2 * U32 * (np.abs(ref) + np.abs(beta * c))
    check_f(d, ref, bound, "bfloat16" if c_mode == "separate" else "float32")


def test_v2_epilogues(rng):
    n, m, k = 10, 23, 19
    a, b = rand_operand(rng, (m, k), "float32"), rand_operand(rng, (n, k), "float32")
    bias = rng.uniform(-1, 1, m).astype(np.float32)
    aux, taux = out_f((n, m))
    d, td = out_f((n, m))
    nvte.gemm_v2(True, False, 2.0, a.tensor, b.tensor, 0.0, None, td, bias=nvte.Tensor(bias), gelu=True, aux=taux)
    pre = 2.0 * gemm_ref(a.ref, b.ref, True, False) + bias
    bound = 2.0 * gemm_bound(a.ref, b.ref, True, False) + U32 * np.abs(pre)
    check_f(aux, pre, bound)
    check_f(d, gelu_ref(pre), 1.13 * bound + act_err(pre))
    # dgelu + dbias (column sums), then dbias alone (bias gradient of op(B)).
    db = np.full(m, np.nan, np.float32)
    nvte.gemm_v2(True, False, 1.0, a.tensor, b.tensor, 0.0, None, td, dbias=nvte.Tensor(db), dgelu=True, aux=taux)
    x = aux.astype(np.float64)
    g, r = dgelu_ref(x), gemm_ref(a.ref, b.ref, True, False)
    ref = r * g
    bound = (gemm_bound(a.ref, b.ref, True, False) + U32 * np.abs(r)) * np.abs(g) + np.abs(r) * act_err(x)
    check_f(d, ref, bound)
    mag = (np.abs(ref) + bound).sum(axis=0)
    check_f(db, ref.sum(axis=0), bound.sum(axis=0) + 2 * (n + 2) * U32 * mag)
    dbn = np.full(n, np.nan, np.float32)
    nvte.gemm_v2(True, False, 1.0, a.tensor, b.tensor, 0.0, None, td, dbias=nvte.Tensor(dbn))
    check_f(dbn, b.ref.sum(axis=1), 2 * (k + 1) * U32 * np.abs(b.ref).sum(axis=1))


# -------------------------------------------------------------------------- multi-tensor
def test_multi_tensor_gemm(rng):
    shapes = [(5, 17, 9), (33, 8, 40), (1, 1, 1)]
    As, Bs, Ds, bias, refs, bounds = [], [], [], [], [], []
    for i, (n, m, k) in enumerate(shapes):
        a, b = rand_operand(rng, (m, k), "float32"), rand_operand(rng, (n, k), "bfloat16")
        d, td = out_f((n, m))
        bv = rng.uniform(-1, 1, m).astype(np.float32) if i != 1 else None
        As.append(a), Bs.append(b), Ds.append((d, td)), bias.append(bv)
        r = gemm_ref(a.ref, b.ref, True, False) + (bv if bv is not None else 0.0)
        refs.append(r), bounds.append(gemm_bound(a.ref, b.ref, True, False) + U32 * np.abs(r))
    nvte.multi_tensor_gemm([a.tensor for a in As], [b.tensor for b in Bs], [t for _, t in Ds],
                           [nvte.Tensor(v) if v is not None else None for v in bias], [None] * 3, transa=True)
    for (d, _), r, bd in zip(Ds, refs, bounds):
        check_f(d, r, bd)
    nvte.multi_tensor_gemm([], [], [], [], [])  # zero GEMMs is a no-op


def test_multi_tensor_gemm_error_names_index(rng):
    a, b = rand_operand(rng, (4, 3), "float32"), rand_operand(rng, (2, 3), "float32")
    bad = rand_operand(rng, (2, 5), "float32")
    _, td = out_f((2, 4))
    _, td2 = out_f((2, 4))
    with pytest.raises(nvte.Error, match=r"nvte_multi_tensor_gemm: GEMM 1 of 2: inner dimensions differ"):
        nvte.multi_tensor_gemm([a.tensor, a.tensor], [b.tensor, bad.tensor], [td, td2], [None, None],
                               [None, None], transa=True)


# ---------------------------------------------------------------------- degenerate sizes
def test_k_zero(rng):
    n, m = 4, 6
    a = Operand(np.zeros((m, 0)), "float32")
    b = Operand(np.zeros((n, 0)), "float32")
    bias = rng.uniform(-1, 1, m).astype(np.float32)
    d, td = out_f((n, m))
    nvte.gemm(a.tensor, b.tensor, td, transa=True)
    np.testing.assert_array_equal(d, np.zeros((n, m)))
    aux, taux = out_f((n, m))
    nvte.gemm(a.tensor, b.tensor, td, bias=nvte.Tensor(bias), pre_gelu_out=taux, transa=True)
    np.testing.assert_array_equal(aux, np.broadcast_to(bias, (n, m)))
    x = np.broadcast_to(bias, (n, m)).astype(np.float64)
    check_f(d, gelu_ref(x), act_err(x))
    d0 = rng.uniform(-1, 1, (n, m)).astype(np.float32)
    d = d0.copy()
    nvte.gemm(a.tensor, b.tensor, nvte.Tensor(d), transa=True, accumulate=True)
    np.testing.assert_array_equal(d, d0)
    db = np.full(n, np.nan, np.float32)
    nvte.gemm(a.tensor, b.tensor, td, bias=nvte.Tensor(db), transa=True, grad=True)
    np.testing.assert_array_equal(db, np.zeros(n))


@pytest.mark.parametrize("n,m,k", [(0, 5, 3), (4, 0, 3), (0, 0, 0)])
def test_empty(rng, n, m, k):
    from util import FP8Out
    a, b = rand_operand(rng, (m, k), "e4m3"), rand_operand(rng, (n, k), "e4m3")
    o = FP8Out((n, m), "e4m3", scale=2.0, amax=3.5)
    nvte.gemm(a.tensor, b.tensor, o.tensor, transa=True)
    assert o.amax[0] == np.float32(3.5)
    a32, b32 = rand_operand(rng, (k, m), "float32"), rand_operand(rng, (n, k), "float32")
    d, td = out_f((n, m))
    db = np.full(m, np.nan, np.float32)
    aux = np.zeros((n, m), np.float32)
    nvte.gemm(a32.tensor, b32.tensor, td, bias=nvte.Tensor(db), pre_gelu_out=nvte.Tensor(aux), grad=True)
    np.testing.assert_array_equal(db, np.zeros(m))  # column sums over no rows


def test_workspace_size():
    assert nvte.gemm_workspace_size(nvte.Backend.CPU) == 0
    assert nvte.gemm_workspace_size() == 0


def test_workspace_tensor_accepted(rng):
    a, b = rand_operand(rng, (5, 3), "float32"), rand_operand(rng, (2, 3), "float32")
    d, td = out_f((2, 5))
    ws = nvte.Tensor(np.zeros(0, np.uint8))
    nvte.gemm(a.tensor, b.tensor, td, transa=True, workspace=ws, use_split_accumulator=True, math_sm_count=4)
    check_f(d, gemm_ref(a.ref, b.ref, True, False), gemm_bound(a.ref, b.ref, True, False))


# -------------------------------------------------------------------------------- errors
def test_errors(rng):
    a, b = rand_operand(rng, (4, 5), "float32"), rand_operand(rng, (3, 6), "float32")
    _, td = out_f((3, 4))
    with pytest.raises(nvte.Error, match=r"nvte_cublas_gemm: inner dimensions differ: op\(A\) is \[k=5, m=4\] "
                                         r"from A \[4, 5\] \(transa=true\) but op\(B\) is \[n=3, k=6\]"):
        nvte.gemm(a.tensor, b.tensor, td, transa=True)
    b = rand_operand(rng, (3, 5), "float32")
    with pytest.raises(nvte.Error, match=r"D has shape \[3, 5\]; expected \[n=3, m=4\]"):
        nvte.gemm(a.tensor, b.tensor, out_f((3, 5))[1], transa=True)
    with pytest.raises(nvte.Error, match=r"bias has shape \[5\]; expected \[4\]"):
        nvte.gemm(a.tensor, b.tensor, td, bias=nvte.Tensor(np.zeros(5, np.float32)), transa=True)
    with pytest.raises(nvte.Error, match=r"bias has shape \[4\]; expected \[3\] \(the bias gradient of op\(B\)"):
        nvte.gemm(a.tensor, b.tensor, td, bias=nvte.Tensor(np.zeros(4, np.float32)), transa=True, grad=True)
    with pytest.raises(nvte.Error, match=r"pre_gelu_out has shape \[3, 5\]; expected \[n=3, m=4\]"):
        nvte.gemm(a.tensor, b.tensor, td, pre_gelu_out=out_f((3, 5))[1], transa=True)
    f8 = rand_operand(rng, (4, 5), "e4m3")
    b16 = rand_operand(rng, (3, 5), "bfloat16")
    with pytest.raises(nvte.Error, match=r"A is float8_e4m3 and B is bfloat16: an FP8 GEMM needs both"):
        nvte.gemm(f8.tensor, b16.tensor, td, transa=True)
    from util import FP8Out
    o = FP8Out((3, 4), "e4m3")
    with pytest.raises(nvte.Error, match=r"accumulating into D .*needs a float32, float16 or bfloat16 D, got "
                                         r"float8_e4m3"):
        nvte.gemm(a.tensor, b.tensor, o.tensor, transa=True, accumulate=True)
    no_si = nvte.Tensor(f8.data, dtype=DT.kFloat8E4M3)
    with pytest.raises(nvte.Error, match=r"A is FP8 \(float8_e4m3\) but has no scale_inv"):
        nvte.gemm(no_si, rand_operand(rng, (3, 5), "e4m3").tensor, td, transa=True)
    null = nvte.Tensor()
    null.set_param(nvte.Param.kRowwiseData, 0, [4, 5], DT.kFloat32)
    with pytest.raises(nvte.Error, match=r"A rowwise data pointer is NULL but shape \[4, 5\]"):
        nvte.gemm(null, b.tensor, td, transa=True)
    with pytest.raises(nvte.Error, match=r"bias rowwise data pointer is NULL"):
        nvte.gemm(a.tensor, b.tensor, td, bias=null, transa=True)
    with pytest.raises(nvte.Error, match=r"D has no data"):
        nvte.gemm(a.tensor, b.tensor, nvte.Tensor(), transa=True)
    ints = nvte.Tensor(np.zeros((4, 5), np.int32))
    with pytest.raises(nvte.Error, match=r"A has dtype int32; expected float32"):
        nvte.gemm(ints, b.tensor, td, transa=True)
    # v2 configuration misuse
    with pytest.raises(nvte.Error, match=r"nvte_cublas_gemm_v2: the GELU epilogue needs the pre_gelu_out"):
        nvte.gemm_v2(True, False, 1.0, a.tensor, b.tensor, 0.0, None, td, gelu=True)
    aux = out_f((3, 4))[1]
    with pytest.raises(nvte.Error, match=r"GELU and dGELU epilogues cannot be combined"):
        nvte.gemm_v2(True, False, 1.0, a.tensor, b.tensor, 0.0, None, td, gelu=True, dgelu=True, aux=aux)
    with pytest.raises(nvte.Error, match=r"C has shape \[3, 5\]; expected \[n=3, m=4\]"):
        nvte.gemm_v2(True, False, 1.0, a.tensor, b.tensor, 1.0, out_f((3, 5))[1], td)
    # The process survives and a valid call still works.
    d, td = out_f((3, 4))
    nvte.gemm(a.tensor, b.tensor, td, transa=True)
    check_f(d, gemm_ref(a.ref, b.ref, True, False), gemm_bound(a.ref, b.ref, True, False))


# ------------------------------------------------------------------------ kernel fallbacks
@pytest.mark.parametrize("kernel", ["avx2", "generic"])
def test_fallback_kernels(kernel):
    # The micro-kernel is chosen once per process, so the fallbacks run in a child process.
    code = (
        "import numpy as np\n"
        "from transformer_engine import _nvte as nvte\n"
        "rng = np.random.default_rng(1)\n"
        "for n, m, k, ta, tb in [(37, 45, 300, True, False), (5, 70, 3, False, True), (130, 20, 33, True, True),\n"
        "                        (300, 40, 70, False, False)]:\n"
        "    a = rng.uniform(-1, 1, (m, k) if ta else (k, m)).astype(np.float32)\n"
        "    b = rng.uniform(-1, 1, (k, n) if tb else (n, k)).astype(np.float32)\n"
        "    d = np.full((n, m), np.nan, np.float32)\n"
        "    nvte.gemm(nvte.Tensor(a), nvte.Tensor(b), nvte.Tensor(d), transa=ta, transb=tb)\n"
        "    A = (a.T if ta else a).astype(np.float64); B = (b.T if tb else b).astype(np.float64)\n"
        "    bound = 2 * (k + 2) * 2.0**-24 * (np.abs(B) @ np.abs(A))\n"
        "    assert (np.abs(d - B @ A) <= bound).all(), (n, m, k)\n"
        "print('ok')\n")
    env = dict(os.environ, NVTE_CPU_GEMM_KERNEL=kernel)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr


def test_thread_count_does_not_change_results():
    # Each output element sums its k products in the same order whatever the split over
    # threads, and dGELU column sums use fixed row blocks: results are bit-identical.
    code = (
        "import hashlib, numpy as np\n"
        "from transformer_engine import _nvte as nvte\n"
        "rng = np.random.default_rng(7)\n"
        "a = rng.uniform(-1, 1, (150, 260)).astype(np.float32)\n"
        "b = rng.uniform(-1, 1, (90, 260)).astype(np.float32)\n"
        "pre = rng.uniform(-2, 2, (90, 150)).astype(np.float32)\n"
        "d = np.empty((90, 150), np.float32); db = np.empty(150, np.float32)\n"
        "nvte.gemm(nvte.Tensor(a), nvte.Tensor(b), nvte.Tensor(d), bias=nvte.Tensor(db),\n"
        "          pre_gelu_out=nvte.Tensor(pre), transa=True, grad=True)\n"
        "print(hashlib.sha256(d.tobytes() + db.tobytes()).hexdigest())\n")
    outs = []
    for threads in ["1", "2", "3"]:
        env = dict(os.environ, NVTE_CPU_THREADS=threads)
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        outs.append(r.stdout.strip())
    assert outs[0] == outs[1] == outs[2], outs
