"""Fused scale + mask + softmax (softmax.h), forward and backward, against float64 numpy
references: plain, explicit uint8 mask, upper-triangular and bottom-right aligned causal."""
import numpy as np
import pytest

from util import BF16, DT, assert_close, poisoned, to_np
from transformer_engine import _nvte as nvte

DTYPES = ["float32", "float16", "bfloat16"]
SCALES = [1.0, 0.125]


def T(a):
    """nvte.Tensor of an array; bfloat16 arrays travel as their uint16 bits (no buffer protocol)."""
    if a.dtype == BF16:
        return nvte.Tensor(a.view(np.uint16), dtype=DT.kBFloat16)
    return nvte.Tensor(a)


# ------------------------------------------------------------ float64 references


def softmax_ref(x, scale, masked=None, rule="zero"):
    """softmax(scale * x) over the last dim. masked (bool, broadcastable): rule "fill" replaces
    masked logits by -10000 (scaled_masked), except in a wholly masked row, which is all zeros
    (TE's kernel); rule "zero" excludes them and gives y = 0 there (causal families; a fully
    masked row is all zeros). A row of -inf logits is all zeros."""
    z = np.asarray(x, np.float64) * scale
    if masked is None:
        masked = np.zeros(z.shape, bool)
    masked = np.broadcast_to(masked, z.shape)
    if rule == "fill":
        whole = np.broadcast_to(masked.all(axis=-1, keepdims=True), z.shape)
        z = np.where(masked, -10000.0, z)
        masked = whole
    z = np.where(masked, -np.inf, z)
    m = np.max(z, axis=-1, keepdims=True, initial=-np.inf)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.where(masked, 0.0, np.exp(z - m))
    s = e.sum(axis=-1, keepdims=True)
    return np.divide(e, s, out=np.zeros_like(e), where=s > 0)


def softmax_backward_ref(dy, y, scale):
    dy = np.asarray(dy, np.float64)
    y = np.asarray(y, np.float64)
    return scale * y * (dy - np.sum(dy * y, axis=-1, keepdims=True))


def upper_triang_mask(s):
    return np.triu(np.ones((s, s), bool), k=1)  # (i, j) masked when j > i


def aligned_causal_mask(sq, sk):
    i = np.arange(sq)[:, None]
    j = np.arange(sk)[None, :]
    return j > i + (sk - sq)


def check_rows(y, masked):
    """Rows with a visible entry sum to 1, fully masked rows are all 0, masked entries are 0."""
    y = np.asarray(y, np.float64)
    masked = np.broadcast_to(masked, y.shape)
    assert np.all(y[masked] == 0.0), "masked entries must be exactly 0"
    sums = y.sum(axis=-1)
    visible = ~masked.all(axis=-1)
    assert np.allclose(sums[visible], 1.0, atol=1e-5), f"row sums {sums[visible]}"
    assert np.all(sums[~visible] == 0.0)


def logits(rng, shape, dtype, spread=3.0):
    x = to_np(rng.normal(0.0, spread, shape), dtype)
    return x, x.astype(np.float64)


# ------------------------------------------------------------ scaled_softmax


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("out_dtype", DTYPES)
@pytest.mark.parametrize("in_dtype", DTYPES)
def test_scaled_softmax_forward(in_dtype, out_dtype, scale, rng):
    for shape in [(1, 1), (3, 5), (7, 33), (31, 129), (2, 3, 4, 17), (2, 2, 2, 3, 9), (0, 8), (5, 0)]:
        x, x64 = logits(rng, shape, in_dtype)
        y = poisoned(shape, out_dtype)
        nvte.scaled_softmax_forward(T(x), T(y), scale)
        ref = softmax_ref(x64, scale)
        assert_close(y, ref, out_dtype)
        if out_dtype == "float32" and y.size:
            check_rows(y, np.zeros(shape, bool))


def test_scaled_softmax_structured_and_stable():
    # Equal logits -> uniform; arange -> geometric; huge logits must not overflow.
    x = np.stack([np.ones(10), np.arange(10), 1000.0 * np.arange(10) - 3000.0]).astype(np.float32)
    y = poisoned(x.shape, "float32")
    nvte.scaled_softmax_forward(T(x), T(y), 1.0)
    assert_close(y, softmax_ref(x, 1.0))
    assert_close(y[0], np.full(10, 0.1))
    assert y[2, -1] == 1.0 and np.all(y[2, :-1] == 0.0)


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_scaled_softmax_backward(dtype, scale, rng):
    for shape in [(1, 1), (3, 5), (7, 33), (2, 3, 4, 17), (0, 8)]:
        _, x64 = logits(rng, shape, "float32")
        y = to_np(softmax_ref(x64, 1.0), dtype)
        dy = to_np(rng.normal(0, 1, shape), dtype)
        dx = poisoned(shape, dtype)
        nvte.scaled_softmax_backward(T(dy), T(y), T(dx), scale)
        assert_close(dx, softmax_backward_ref(dy, y, scale), dtype)


# ------------------------------------------------------------ scaled_masked_softmax


@pytest.mark.parametrize("mask_batch", ["B", "1"])
@pytest.mark.parametrize("density", [0.0, 0.3, 0.8, 1.0])
@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_scaled_masked_softmax_forward(dtype, scale, density, mask_batch, rng):
    for b, h, sq, sk in [(2, 3, 5, 7), (1, 2, 4, 33), (3, 1, 1, 1), (2, 2, 3, 0)]:
        x, x64 = logits(rng, (b, h, sq, sk), dtype)
        mb = b if mask_batch == "B" else 1
        mask = (rng.random((mb, 1, sq, sk)) < density).astype(np.uint8)
        if sq > 1 and sk > 0:
            mask[0, 0, 0, :] = 1  # a fully masked row (zeros) and a fully visible one
            mask[0, 0, 1, :] = 0
        y = poisoned(x.shape, dtype)
        nvte.scaled_masked_softmax_forward(T(x), nvte.Tensor(mask), T(y), scale)
        ref = softmax_ref(x64, scale, mask.astype(bool), rule="fill")
        assert_close(y, ref, dtype)
        full = np.broadcast_to(mask.astype(bool).all(axis=-1, keepdims=True), x.shape)
        partly = np.broadcast_to(mask.astype(bool), x.shape) & ~full
        assert np.all(y[partly] == 0), "masked entries of partly visible rows must be 0"
        assert np.all(y[full] == 0), "a wholly masked row must be all zeros (TE's kernel rule)"


@pytest.mark.parametrize("scale", SCALES)
def test_scaled_masked_softmax_backward(scale, rng):
    x64 = rng.normal(0, 3, (2, 3, 5, 9))
    mask = rng.random((2, 1, 5, 9)) < 0.5
    y = softmax_ref(x64, scale, mask, rule="fill").astype(np.float32)
    dy = rng.normal(0, 1, y.shape).astype(np.float32)
    dx = poisoned(y.shape, "float32")
    nvte.scaled_masked_softmax_backward(T(dy), T(y), T(dx), scale)
    assert_close(dx, softmax_backward_ref(dy, y, scale))


# ------------------------------------------------------------ upper-triangular causal


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("out_dtype", DTYPES)
@pytest.mark.parametrize("in_dtype", DTYPES)
def test_upper_triang_forward(in_dtype, out_dtype, scale, rng):
    for batches, s in [(1, 1), (3, 5), (2, 17), (4, 33), (0, 4), (2, 0)]:
        x, x64 = logits(rng, (batches, s, s), in_dtype)
        y = poisoned(x.shape, out_dtype)
        nvte.scaled_upper_triang_masked_softmax_forward(T(x), T(y), scale)
        masked = upper_triang_mask(s)
        assert_close(y, softmax_ref(x64, scale, masked), out_dtype)
        if out_dtype == "float32" and y.size:
            check_rows(y, masked)
        else:
            assert np.all(np.asarray(y, np.float64)[np.broadcast_to(masked, x.shape)] == 0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_upper_triang_backward(dtype, rng):
    s = 13
    y = to_np(softmax_ref(rng.normal(0, 3, (3, s, s)), 1.0, upper_triang_mask(s)), dtype)
    dy = to_np(rng.normal(0, 1, y.shape), dtype)
    dx = poisoned(y.shape, dtype)
    nvte.scaled_upper_triang_masked_softmax_backward(T(dy), T(y), T(dx), 0.125)
    ref = softmax_backward_ref(dy, y, 0.125)
    assert_close(dx, ref, dtype)
    assert np.all(np.asarray(dx, np.float64)[np.broadcast_to(upper_triang_mask(s), y.shape)] == 0)


# ------------------------------------------------------------ bottom-right aligned causal


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_aligned_causal_forward(dtype, scale, rng):
    # Sq == Sk, Sq < Sk (every row sees something), Sq > Sk (the first Sq - Sk rows see nothing: 0).
    for b, h, sq, sk in [(2, 3, 6, 6), (1, 2, 4, 11), (2, 1, 9, 5), (1, 1, 1, 1), (1, 1, 3, 1),
                         (2, 2, 0, 5), (1, 2, 3, 0)]:
        x, x64 = logits(rng, (b, h, sq, sk), dtype)
        y = poisoned(x.shape, dtype)
        nvte.scaled_aligned_causal_masked_softmax_forward(T(x), T(y), scale)
        masked = aligned_causal_mask(sq, sk)
        assert_close(y, softmax_ref(x64, scale, masked), dtype)
        if dtype == "float32" and y.size:
            check_rows(y, masked)


def test_aligned_causal_equals_upper_triang_when_square(rng):
    x = rng.normal(0, 3, (2, 3, 8, 8)).astype(np.float32)
    y1 = poisoned(x.shape, "float32")
    y2 = poisoned(x.shape, "float32")
    nvte.scaled_aligned_causal_masked_softmax_forward(T(x), T(y1), 0.125)
    nvte.scaled_upper_triang_masked_softmax_forward(T(x.reshape(6, 8, 8)), T(y2.reshape(6, 8, 8)), 0.125)
    assert np.array_equal(y1, y2)


@pytest.mark.parametrize("sq, sk", [(5, 5), (3, 7), (7, 3)])
def test_aligned_causal_backward_in_place(sq, sk, rng):
    masked = aligned_causal_mask(sq, sk)
    y = softmax_ref(rng.normal(0, 3, (2, 2, sq, sk)), 1.0, masked).astype(np.float32)
    dy = rng.normal(0, 1, y.shape).astype(np.float32)
    ref = softmax_backward_ref(dy, y, 0.125)
    t = T(dy)
    nvte.scaled_aligned_causal_masked_softmax_backward(t, T(y), t, 0.125)  # output_grads aliases dy
    assert_close(dy, ref)
    assert np.all(dy[np.broadcast_to(masked, y.shape)] == 0)


@pytest.mark.parametrize("fn", ["scaled_softmax", "scaled_masked_softmax", "scaled_upper_triang_masked_softmax"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_backward_in_place(fn, dtype, rng):
    shape = (2, 6, 6) if "triang" in fn else (2, 2, 6, 6)
    y = to_np(softmax_ref(rng.normal(0, 2, shape), 1.0), dtype)
    dy = to_np(rng.normal(0, 1, shape), dtype)
    ref = softmax_backward_ref(dy, y, 0.125)
    t = T(dy)
    getattr(nvte, fn + "_backward")(t, T(y), t, 0.125)
    assert_close(dy, ref, dtype)


# ------------------------------------------------------------ misuse


def f32(*shape):
    return nvte.Tensor(np.zeros(shape, np.float32))


def u8(*shape):
    return nvte.Tensor(np.zeros(shape, np.uint8))


def bad_alias():
    a = np.zeros((2, 4), np.float32)
    out = nvte.Tensor()
    out.set_param(nvte.Param.kRowwiseData, a.ctypes.data, [2, 4], DT.kBFloat16)
    return nvte.scaled_softmax_backward(nvte.Tensor(a), f32(2, 4), out, 1.0), a  # keep a alive


def bad_forward_alias():
    a = np.zeros((2, 4), np.float32)
    out = nvte.Tensor()
    out.set_param(nvte.Param.kRowwiseData, a.ctypes.data, [2, 4], DT.kFloat16)
    return nvte.scaled_softmax_forward(nvte.Tensor(a), out, 1.0), a  # keep a alive


@pytest.mark.parametrize("call, match", [
    (bad_forward_alias, r"softmax_results shares its buffer with input but has dtype float16 instead of float32"),
    (lambda: nvte.scaled_softmax_forward(f32(5), f32(5), 1.0),
     r"nvte_scaled_softmax_forward: input has shape \[5\]; expected rank >= 2"),
    (lambda: nvte.scaled_softmax_forward(f32(2, 5), f32(2, 6), 1.0),
     r"nvte_scaled_softmax_forward: softmax_results has shape \[2, 6\] but input has shape \[2, 5\]"),
    (lambda: nvte.scaled_softmax_forward(nvte.Tensor(np.zeros((2, 2), np.int32)), f32(2, 2), 1.0),
     r"input must be float32, float16 or bfloat16, got int32"),
    (lambda: nvte.scaled_softmax_forward(f32(2, 2), nvte.Tensor(np.zeros((2, 2), np.uint8),
                                                                dtype=DT.kFloat8E4M3), 1.0),
     r"softmax_results must be float32, float16 or bfloat16, got float8_e4m3"),
    (lambda: nvte.scaled_masked_softmax_forward(f32(2, 3, 4), u8(2, 1, 3, 4), f32(2, 3, 4), 1.0),
     r"nvte_scaled_masked_softmax_forward: input has shape \[2, 3, 4\]; expected 4D"),
    (lambda: nvte.scaled_masked_softmax_forward(f32(2, 3, 4, 5), f32(2, 1, 4, 5), f32(2, 3, 4, 5), 1.0),
     r"mask must be uint8 .* got float32"),
    (lambda: nvte.scaled_masked_softmax_forward(f32(2, 3, 4, 5), u8(2, 3, 4, 5), f32(2, 3, 4, 5), 1.0),
     r"mask has shape \[2, 3, 4, 5\]; for input \[2, 3, 4, 5\] expected \[2 or 1, 1, 4, 5\]"),
    (lambda: nvte.scaled_masked_softmax_forward(f32(2, 3, 4, 5), u8(3, 1, 4, 5), f32(2, 3, 4, 5), 1.0),
     r"mask has shape \[3, 1, 4, 5\]"),
    (lambda: nvte.scaled_masked_softmax_forward(f32(2, 3, 4, 5), u8(1, 1, 5, 4), f32(2, 3, 4, 5), 1.0),
     r"mask has shape \[1, 1, 5, 4\]"),
    (lambda: nvte.scaled_masked_softmax_forward(f32(2, 3, 4, 5), None, f32(2, 3, 4, 5), 1.0),
     r"mask is a NULL tensor handle"),
    (lambda: nvte.scaled_upper_triang_masked_softmax_forward(f32(2, 3, 4), f32(2, 3, 4), 1.0),
     r"nvte_scaled_upper_triang_masked_softmax_forward: input has shape \[2, 3, 4\]; expected 3D .*square"),
    (lambda: nvte.scaled_upper_triang_masked_softmax_forward(f32(1, 2, 4, 4), f32(1, 2, 4, 4), 1.0),
     r"input has shape \[1, 2, 4, 4\]; expected 3D"),
    (lambda: nvte.scaled_upper_triang_masked_softmax_backward(f32(2, 3, 4), f32(2, 3, 4), f32(2, 3, 4), 1.0),
     r"softmax_results has shape \[2, 3, 4\]; expected 3D"),
    (lambda: nvte.scaled_aligned_causal_masked_softmax_forward(f32(2, 4, 4), f32(2, 4, 4), 1.0),
     r"nvte_scaled_aligned_causal_masked_softmax_forward: input has shape \[2, 4, 4\]; expected 4D"),
    (lambda: nvte.scaled_softmax_backward(f32(2, 4), f32(2, 5), f32(2, 5), 1.0),
     r"nvte_scaled_softmax_backward: incoming_grads has shape \[2, 4\] but softmax_results has shape \[2, 5\]"),
    (lambda: nvte.scaled_softmax_backward(f32(2, 5), f32(2, 5), f32(5, 2), 1.0),
     r"output_grads has shape \[5, 2\] but softmax_results has shape \[2, 5\]"),
    (lambda: nvte.scaled_masked_softmax_backward(f32(2, 5), f32(2, 5), f32(2, 5), 1.0),
     r"softmax_results has shape \[2, 5\]; expected 4D"),
    (lambda: nvte.scaled_softmax_backward(nvte.Tensor(np.zeros((2, 2), np.int64)), f32(2, 2), f32(2, 2), 1.0),
     r"incoming_grads must be float32, float16 or bfloat16, got int64"),
    (lambda: nvte.scaled_softmax_backward(f32(2, 2), nvte.Tensor(), f32(2, 2), 1.0),
     r"softmax_results has no data"),
    (bad_alias, r"output_grads shares its buffer with incoming_grads but has dtype bfloat16 instead of float32"),
])
def test_errors(call, match):
    with pytest.raises(nvte.Error, match=match):
        call()
    # The process survives and a valid call still works.
    y = np.zeros((1, 2), np.float32)
    nvte.scaled_softmax_forward(f32(1, 2), nvte.Tensor(y), 1.0)
    assert y.tolist() == [[0.5, 0.5]]


def test_rows_of_minus_inf_are_zeros():
    """A row whose logits are all -inf has no probability to give: zeros (never NaN), every family."""
    x = np.full((1, 2, 3, 3), -np.inf, np.float32)
    x[0, 1] = 0.0  # head 1 finite: uniform
    for call in (lambda y: nvte.scaled_softmax_forward(T(x), T(y), 1.0),
                 lambda y: nvte.scaled_masked_softmax_forward(T(x), nvte.Tensor(np.zeros((1, 1, 3, 3), np.uint8)),
                                                              T(y), 1.0),
                 lambda y: nvte.scaled_aligned_causal_masked_softmax_forward(T(x), T(y), 1.0)):
        y = poisoned(x.shape, "float32")
        call(y)
        assert np.all(y[0, 0] == 0.0)
        assert not np.isnan(y).any()


def test_long_rows_keep_float32_accuracy(rng):
    """2^18 keys: the row sums accumulate in double (a float32 running sum drifts by ~1e-4 here)."""
    x = rng.normal(0, 1, (1, 1 << 18)).astype(np.float32)
    y = np.zeros_like(x)
    nvte.scaled_softmax_forward(T(x), T(y), 1.0)
    ref = softmax_ref(x, 1.0)
    assert np.max(np.abs(y - ref) / ref) < 2e-6  # (expf and the division: a few ulps)
    dy = rng.normal(0, 1, x.shape).astype(np.float32)
    dx = np.zeros_like(x)
    nvte.scaled_softmax_backward(T(dy), T(y), T(dx), 1.0)
    ref_dx = softmax_backward_ref(dy, y, 1.0)
    assert np.max(np.abs(dx - ref_dx)) < 2e-6 * np.max(np.abs(ref_dx))
