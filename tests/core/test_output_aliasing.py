"""Outputs that share memory with inputs (api/alias_checks.h), op by op.

Each refusal is checked to be INVALID_ARGUMENT, to name both operands and to leave every buffer
of the call untouched; each in-place form that stays allowed (an elementwise or row-by-row output
exactly over an input of the same dtype and size, GEMM accumulation into C's own buffer) is
checked against a float64 numpy reference. The overlaps are built from one numpy buffer and
views of it, as a framework's slices would be."""
import numpy as np
import pytest

from util import BF16, DT
from transformer_engine import _nvte as nvte

T = nvte.Tensor
R, C = 64, 16
K_GELU = np.sqrt(2.0 / np.pi)


def bf16_tensor(a):
    return T(a.view(np.uint16), dtype=DT.kBFloat16)


def refused(call, buffers, *names):
    """call() must fail with INVALID_ARGUMENT naming every one of `names`, writing nothing."""
    before = [b.tobytes() for b in buffers]
    with pytest.raises(nvte.Error) as e:
        call()
    msg, status = e.value.args
    assert status == int(nvte.Status.INVALID_ARGUMENT), msg
    for n in names:
        assert n in msg, f"{n!r} not in {msg!r}"
    for b, old in zip(buffers, before):
        assert b.tobytes() == old, "a refused call wrote to a buffer"
    return msg


def close(got, ref, tol=1e-5):
    got = np.asarray(got, np.float64)
    assert got.shape == ref.shape
    err = np.max(np.abs(got - ref) / (1.0 + np.abs(ref)), initial=0.0)
    assert err <= tol, f"max relative error {err:.3g} > {tol}"


def gelu(x):
    return 0.5 * x * (1.0 + np.tanh(K_GELU * (x + 0.044715 * x**3)))


def dgelu(x):
    t = np.tanh(K_GELU * (x + 0.044715 * x**3))
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * K_GELU * (1.0 + 3 * 0.044715 * x * x)


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def shifted(rng, rows=R, cols=C, shift=1):
    """A [rows + shift, cols] float32 buffer with input rows [0, rows) and output rows [shift, rows + shift)."""
    big = rng.standard_normal((rows + shift, cols)).astype(np.float32)
    return big, big[:rows], big[shift:]


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


# ----------------------------------------------------------------------------------- transpose
@pytest.mark.parametrize("shape", [(3, 5), (8, 8)])
def test_transpose_in_place_refused(shape):
    buf = np.arange(np.prod(shape), dtype=np.float32)
    refused(lambda: nvte.transpose(T(buf.reshape(shape)), T(buf.reshape(shape[::-1]))), [buf],
            "transposed_output", "input", "in place")


def test_transpose_partial_overlap_refused():
    buf = np.arange(40, dtype=np.float32)
    refused(lambda: nvte.transpose(T(buf[:15].reshape(3, 5)), T(buf[10:25].reshape(5, 3))), [buf],
            "transposed_output", "input")


def test_transpose_disjoint_views_of_one_buffer_work():
    buf = np.arange(30, dtype=np.float32)
    nvte.transpose(T(buf[:15].reshape(3, 5)), T(buf[15:].reshape(5, 3)))
    assert np.array_equal(buf[15:].reshape(5, 3), np.arange(15, dtype=np.float32).reshape(3, 5).T)


# ---------------------------------------------------------------------------------------- cast
def test_quantize_exactly_in_place_works(rng):
    x = rng.standard_normal((R, C)).astype(np.float32)
    ref = x.astype(np.float64)
    nvte.quantize(T(x), T(x))
    close(x, ref, 0)


def test_quantize_partial_overlap_refused(rng):
    big, inp, out = shifted(rng)
    refused(lambda: nvte.quantize(T(inp), T(out)), [big], "output", "input", "without being the same buffer")


def test_quantize_narrower_dtype_at_same_address_refused(rng):
    x = rng.standard_normal((R, C)).astype(np.float32)
    out = x.view(np.uint16).reshape(-1)[: R * C].reshape(R, C).view(BF16)
    refused(lambda: nvte.quantize(T(x), bf16_tensor(out)), [x], "output", "input", "bfloat16")


def test_cast_transpose_columnwise_output_over_input_refused(rng):
    x = rng.standard_normal((4, 8)).astype(np.float32)
    row = np.zeros((4, 8), np.uint8)
    col = x.view(np.uint8).reshape(-1)[:32].reshape(8, 4)  # the transpose's bytes inside x
    out = T(row, dtype=DT.kFloat8E4M3, scale=np.ones(1, np.float32), amax=np.zeros(1, np.float32),
            scale_inv=np.zeros(1, np.float32), columnwise_data=col)
    msg = refused(lambda: nvte.cast_transpose(T(x), out), [x, row], "output", "input")
    assert "columnwise" in msg


def test_dequantize_over_its_input_refused():
    buf = np.zeros(4 * 8 * 4, np.uint8)
    buf[:32] = 0x38  # e4m3 1.0
    q = T(buf[:32].reshape(4, 8), dtype=DT.kFloat8E4M3, scale_inv=np.ones(1, np.float32))
    out = buf.view(np.float32).reshape(4, 8)  # starts at the input's first byte
    refused(lambda: nvte.dequantize(q, T(out)), [buf], "output", "input", "float32")


def test_quantize_dbias_in_place_works_and_dbias_over_input_refused(rng):
    x = rng.standard_normal((R, C)).astype(np.float32)
    ref = x.astype(np.float64)
    db = np.zeros(C, np.float32)
    nvte.quantize_dbias(T(x), T(x), T(db))
    close(x, ref, 0)
    close(db, ref.sum(0), 1e-5)
    refused(lambda: nvte.quantize_dbias(T(x), T(np.zeros((R, C), np.float32)), T(x[0])), [x], "dbias", "input")


def test_quantize_dbias_dgelu_over_act_input_works(rng):
    g = rng.standard_normal((R, C)).astype(np.float32)
    a = rng.standard_normal((R, C)).astype(np.float32)
    ref = g.astype(np.float64) * dgelu(a.astype(np.float64))
    db = np.zeros(C, np.float32)
    nvte.quantize_dbias_dgelu(T(g), T(a), T(a), T(db))
    close(a, ref)
    close(db, ref.sum(0), 1e-4)
    big, inp, out = shifted(rng)
    refused(lambda: nvte.quantize_dbias_dgelu(T(g), T(inp), T(out), T(np.zeros(C, np.float32))), [big, g],
            "output", "act_input")


def test_multi_cast_transpose_cross_pair_overlap_refused(rng):
    x0 = rng.standard_normal((8, C)).astype(np.float32)
    x1 = rng.standard_normal((8, C)).astype(np.float32)
    o1 = np.zeros((8, C), np.float32)
    # output 0 over input 1: pair 0 would overwrite what pair 1 reads
    refused(lambda: nvte.multi_cast_transpose([T(x0), T(x1)], [T(x1), T(o1)]), [x0, x1, o1],
            "output_list[0]", "input_list[1]")
    # two outputs on one buffer
    o0 = np.zeros((8, C), np.float32)
    refused(lambda: nvte.multi_cast_transpose([T(x0), T(x1)], [T(o0), T(o0)]), [x0, x1, o0],
            "output_list[0]", "output_list[1]")
    # each output exactly over its own input is fine
    r0, r1 = x0.astype(np.float64), x1.astype(np.float64)
    nvte.multi_cast_transpose([T(x0), T(x1)], [T(x0), T(x1)])
    close(x0, r0, 0)
    close(x1, r1, 0)


# --------------------------------------------------------------------------------- activations
def test_gelu_in_place_works_and_partial_refused(rng):
    x = rng.standard_normal((R, C)).astype(np.float32)
    ref = gelu(x.astype(np.float64))
    nvte.gelu(T(x), T(x))
    close(x, ref)
    big, inp, out = shifted(rng)
    refused(lambda: nvte.gelu(T(inp), T(out)), [big], "output", "input", "without being the same buffer")


def test_relu_partial_overlap_refused(rng):
    big, inp, out = shifted(rng)
    refused(lambda: nvte.relu(T(inp), T(out)), [big], "output", "input")


def test_gelu_narrower_output_at_same_address_refused(rng):
    x = rng.standard_normal((R, C)).astype(np.float32)
    out = x.view(np.uint16).reshape(-1)[: R * C].reshape(R, C).view(BF16)
    refused(lambda: nvte.gelu(T(x), bf16_tensor(out)), [x], "output", "input", "dtype")


def test_dgelu_over_grad_and_over_input_work(rng):
    g = rng.standard_normal((R, C)).astype(np.float32)
    x = rng.standard_normal((R, C)).astype(np.float32)
    ref = g.astype(np.float64) * dgelu(x.astype(np.float64))
    g2, x2 = g.copy(), x.copy()
    nvte.dgelu(T(g), T(x), T(g))
    close(g, ref)
    nvte.dgelu(T(g2), T(x2), T(x2))
    close(x2, ref)
    big, inp, out = shifted(rng)
    refused(lambda: nvte.dgelu(T(inp), T(x), T(out)), [big, x], "output", "grad")


def test_swiglu_output_over_its_input_refused(rng):
    x = rng.standard_normal((R, 2 * C)).astype(np.float32)
    out = x.reshape(-1)[: R * C].reshape(R, C)
    msg = refused(lambda: nvte.swiglu(T(x), T(out)), [x], "output", "input")
    assert "[N, H]" in msg


def test_dswiglu_over_input_works_and_over_grad_refused(rng):
    g = rng.standard_normal((R, C)).astype(np.float32)
    x = rng.standard_normal((R, 2 * C)).astype(np.float32)
    a, gate, g64 = x[:, :C].astype(np.float64), x[:, C:].astype(np.float64), g.astype(np.float64)
    s = sigmoid(a)
    ref = np.concatenate([g64 * gate * s * (1 + a * (1 - s)), g64 * a * s], axis=1)
    nvte.dswiglu(T(g), T(x), T(x))
    close(x, ref)
    buf = np.zeros(R * 2 * C, np.float32)
    gv = buf[: R * C].reshape(R, C)
    gv[...] = g
    refused(lambda: nvte.dswiglu(T(gv), T(rng.standard_normal((R, 2 * C)).astype(np.float32)),
                                 T(buf.reshape(R, 2 * C))), [buf], "output", "grad")


# ------------------------------------------------------------------------------- normalization
def ln_ref(x, g, b, eps):
    x = x.astype(np.float64)
    mu = x.mean(1, keepdims=True)
    rs = 1.0 / np.sqrt(((x - mu) ** 2).mean(1, keepdims=True) + eps)
    return (x - mu) * rs * g + b, mu[:, 0], rs[:, 0]


def test_layernorm_fwd_z_over_x_works(rng):
    x = rng.standard_normal((R, C)).astype(np.float32)
    g = rng.uniform(0.5, 1.5, C).astype(np.float32)
    b = rng.standard_normal(C).astype(np.float32)
    ref, mref, rref = ln_ref(x, g, b, 1e-5)
    mu, rs = np.zeros(R, np.float32), np.zeros(R, np.float32)
    nvte.layernorm_fwd(T(x), T(g), T(b), 1e-5, T(x), T(mu), T(rs))
    close(x, ref)
    close(mu, mref)
    close(rs, rref)


def test_layernorm_fwd_overlaps_refused(rng):
    x = rng.standard_normal((R, C)).astype(np.float32)
    g, b = np.ones(C, np.float32), np.zeros(C, np.float32)
    z, mu, rs = np.zeros((R, C), np.float32), np.zeros(R, np.float32), np.zeros(R, np.float32)
    flat = x.reshape(-1)
    refused(lambda: nvte.layernorm_fwd(T(x), T(g), T(b), 1e-5, T(z), T(mu), T(flat[R:2 * R])), [x, z, mu],
            "rsigma", "x")
    refused(lambda: nvte.layernorm_fwd(T(x), T(g), T(b), 1e-5, T(z), T(flat[:R]), T(rs)), [x, z, rs], "mu", "x")
    zg = np.zeros(R * C + C, np.float32)
    gv = zg[R * C - 1: R * C - 1 + C]
    gv[...] = 1.0
    refused(lambda: nvte.layernorm_fwd(T(x), T(gv), T(b), 1e-5, T(zg[: R * C].reshape(R, C)), T(mu), T(rs)),
            [x, zg, mu, rs], "z", "gamma")
    refused(lambda: nvte.layernorm_fwd(T(x), T(g), T(b), 1e-5, T(z), T(mu), T(mu)), [x, z, mu], "mu", "rsigma")


def test_rmsnorm_fwd_partial_and_narrower_z_refused(rng):
    big, inp, out = shifted(rng)
    g, rs = np.ones(C, np.float32), np.zeros(R, np.float32)
    refused(lambda: nvte.rmsnorm_fwd(T(inp), T(g), 0.0, T(out), T(rs)), [big, rs], "z", "x")
    x = rng.standard_normal((R, C)).astype(np.float32)
    zv = x.view(np.uint16).reshape(-1)[: R * C].reshape(R, C).view(BF16)
    refused(lambda: nvte.rmsnorm_fwd(T(x), T(g), 1e-5, bf16_tensor(zv), T(rs)), [x, rs], "z", "x", "dtype")


def ln_bwd_ref(dz, x, mu, rs, g):
    dz, x = dz.astype(np.float64), x.astype(np.float64)
    xhat = (x - mu[:, None]) * rs[:, None]
    dy = dz * g
    dx = rs[:, None] * (dy - dy.mean(1, keepdims=True) - xhat * (dy * xhat).mean(1, keepdims=True))
    return dx, (dz * xhat).sum(0), dz.sum(0)


@pytest.mark.parametrize("over", ["dz", "x"])
def test_layernorm_bwd_dx_in_place_works(rng, over):
    x = rng.standard_normal((R, C)).astype(np.float32)
    dz = rng.standard_normal((R, C)).astype(np.float32)
    g = rng.uniform(0.5, 1.5, C).astype(np.float32)
    mu = x.mean(1).astype(np.float32)
    rs = (1.0 / np.sqrt(x.var(1) + 1e-5)).astype(np.float32)
    dx_ref, dg_ref, db_ref = ln_bwd_ref(dz, x, mu.astype(np.float64), rs.astype(np.float64), g)
    dg, db = np.zeros(C, np.float32), np.zeros(C, np.float32)
    dx = dz if over == "dz" else x
    nvte.layernorm_bwd(T(dz), T(x), T(mu), T(rs), T(g), T(dx), T(dg), T(db))
    close(dx, dx_ref, 1e-4)
    close(dg, dg_ref, 1e-4)
    close(db, db_ref, 1e-4)


def test_norm_bwd_overlaps_refused(rng):
    x = rng.standard_normal((R, C)).astype(np.float32)
    dz = rng.standard_normal((R, C)).astype(np.float32)
    g, mu, rs = np.ones(C, np.float32), np.zeros(R, np.float32), np.ones(R, np.float32)
    dx, db = np.zeros((R, C), np.float32), np.zeros(C, np.float32)
    keep = [x, dz, g, mu, rs, dx, db]
    # dgamma inside dx: dx rows would be overwritten by the reduction
    refused(lambda: nvte.layernorm_bwd(T(dz), T(x), T(mu), T(rs), T(g), T(dx), T(dx[3]), T(db)), keep,
            "dgamma", "dx")
    refused(lambda: nvte.layernorm_bwd(T(dz), T(x), T(mu), T(rs), T(g), T(dx), T(db), T(db)), keep,
            "dgamma", "dbeta")
    # dx starting one row into dz
    big, dzv, dxv = shifted(rng)
    refused(lambda: nvte.rmsnorm_bwd(T(dzv), T(x), T(rs), T(g), T(dxv), T(np.zeros(C, np.float32))),
            keep + [big], "dx", "dz")
    # dx over rsigma / gamma (read by every row)
    flat = np.zeros(R * C, np.float32)
    flat[:R] = 1.0
    refused(lambda: nvte.rmsnorm_bwd(T(dz), T(x), T(flat[:R]), T(g), T(flat.reshape(R, C)),
                                     T(np.zeros(C, np.float32))), keep + [flat], "dx", "rsigma")


def test_rmsnorm_bwd_add_dx_over_add_works(rng):
    x = rng.standard_normal((R, C)).astype(np.float32)
    dz = rng.standard_normal((R, C)).astype(np.float32)
    add = rng.standard_normal((R, C)).astype(np.float32)
    g = rng.uniform(0.5, 1.5, C).astype(np.float32)
    x64, dz64 = x.astype(np.float64), dz.astype(np.float64)
    rs = (1.0 / np.sqrt((x64**2).mean(1) + 1e-5)).astype(np.float32)
    xhat = x64 * rs[:, None]
    dy = dz64 * g
    ref = rs[:, None] * (dy - xhat * (dy * xhat).mean(1, keepdims=True)) + add
    dg = np.zeros(C, np.float32)
    nvte.rmsnorm_bwd_add(T(dz), T(x), T(add), T(rs), T(g), T(add), T(dg))
    close(add, ref, 1e-4)
    close(dg, (dz64 * xhat).sum(0), 1e-4)


# ---------------------------------------------------------------------------------------- GEMM
# D = B @ A (row-major, transa = transb = False): A [k, m], B [n, k], D [n, m].
def test_gemm_d_over_b_and_a_refused(rng):
    a = rng.standard_normal((C, C)).astype(np.float32)
    b = rng.standard_normal((C, C)).astype(np.float32)
    refused(lambda: nvte.gemm(T(a), T(b), T(b)), [a, b], "D", "B")
    refused(lambda: nvte.gemm(T(a), T(b), T(a)), [a, b], "D", "A")
    big = rng.standard_normal((C + 1, C)).astype(np.float32)
    refused(lambda: nvte.gemm(T(big[:C]), T(b), T(big[1:])), [big, b], "D", "A")


def test_gemm_d_over_columnwise_operand_refused(rng):
    a = rng.standard_normal((C, C)).astype(np.float32)
    b_col = rng.standard_normal((C, C)).astype(np.float32)  # B stored only transposed
    refused(lambda: nvte.gemm(T(a), T(columnwise_data=b_col), T(b_col)), [a, b_col], "D", "B", "columnwise")


def test_gemm_epilogue_overlaps_refused(rng):
    a = rng.standard_normal((C, C)).astype(np.float32)
    b = rng.standard_normal((C, C)).astype(np.float32)
    aux = rng.standard_normal((C, C)).astype(np.float32)
    d = np.zeros((C, C), np.float32)
    keep = [a, b, aux, d]
    # dGELU: D over its pre_gelu_out input
    refused(lambda: nvte.gemm(T(a), T(b), T(aux), pre_gelu_out=T(aux), grad=True), keep, "D", "pre_gelu_out")
    # GELU: the pre_gelu_out output over A, over D
    refused(lambda: nvte.gemm(T(a), T(b), T(d), pre_gelu_out=T(a)), keep, "pre_gelu_out", "A")
    refused(lambda: nvte.gemm(T(a), T(b), T(d), pre_gelu_out=T(d)), keep, "pre_gelu_out", "D")
    # D over bias
    bias = d[0]
    refused(lambda: nvte.gemm(T(a), T(b), T(d), bias=T(bias)), keep, "D", "bias")
    # bias gradient (of op(B)) inside B
    refused(lambda: nvte.gemm_v2(False, False, 1.0, T(a), T(b), 0.0, None, T(d), dbias=T(b[2])), keep,
            "bias gradient", "B")


def test_gemm_accumulate_into_c_buffer_works(rng):
    a = rng.standard_normal((C, 8)).astype(np.float32)
    b = rng.standard_normal((5, C)).astype(np.float32)
    d = rng.standard_normal((5, 8)).astype(np.float32)
    ref = b.astype(np.float64) @ a + d
    nvte.gemm(T(a), T(b), T(d), accumulate=True)
    close(d, ref, 1e-5)
    # v2: C a separate handle on D's buffer
    ref = 0.5 * (b.astype(np.float64) @ a) - 2.0 * d
    nvte.gemm_v2(False, False, 0.5, T(a), T(b), -2.0, T(d), T(d))
    close(d, ref, 1e-5)


def test_gemm_c_partially_over_d_refused(rng):
    a = rng.standard_normal((C, 8)).astype(np.float32)
    b = rng.standard_normal((5, C)).astype(np.float32)
    big = rng.standard_normal((6, 8)).astype(np.float32)
    refused(lambda: nvte.gemm_v2(False, False, 1.0, T(a), T(b), 1.0, T(big[:5]), T(big[1:])), [a, b, big],
            "D", "C")


def test_batched_gemm_d_over_a_later_matrix_refused(rng):
    a = rng.standard_normal((3, C, C)).astype(np.float32)
    b = rng.standard_normal((3, C, C)).astype(np.float32)
    d = a[1:].reshape(-1)[: 3 * C * C]
    buf = np.zeros(4 * C * C, np.float32)
    buf[: 3 * C * C] = a.reshape(-1)
    av = buf[: 3 * C * C].reshape(3, C, C)
    dv = buf[C * C:].reshape(3, C, C)  # D's matrix 0 is A's matrix 1
    refused(lambda: nvte.batched_gemm(T(av), T(b), T(dv)), [buf, b], "D", "A")
    del d


def test_multi_tensor_gemm_cross_gemm_overlap_refused_before_any_write(rng):
    a0, a1 = (rng.standard_normal((C, C)).astype(np.float32) for _ in range(2))
    b0, b1 = (rng.standard_normal((C, C)).astype(np.float32) for _ in range(2))
    d1 = np.zeros((C, C), np.float32)
    # GEMM 0 writes D over GEMM 1's A
    refused(lambda: nvte.multi_tensor_gemm([T(a0), T(a1)], [T(b0), T(b1)], [T(a1), T(d1)], [None, None],
                                           [None, None]), [a0, a1, b0, b1, d1], "GEMM 0", "D", "A of GEMM 1")
    # GEMM 1 is in place over its own B: GEMM 0's D is left untouched too
    d0 = np.full((C, C), -7.0, np.float32)
    refused(lambda: nvte.multi_tensor_gemm([T(a0), T(a1)], [T(b0), T(b1)], [T(d0), T(b1)], [None, None],
                                           [None, None]), [a0, a1, b0, b1, d0], "GEMM 1", "D", "B")
    nvte.multi_tensor_gemm([T(a0), T(a1)], [T(b0), T(b1)], [T(d0), T(d1)], [None, None], [None, None])
    close(d0, b0.astype(np.float64) @ a0, 1e-5)
    close(d1, b1.astype(np.float64) @ a1, 1e-5)
