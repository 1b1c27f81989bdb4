"""nvte_attn_softmax_forward on the CPU backend against float64 (attn_softmax_case.py holds the
references and the tolerance rule): every bias type and broadcast, ALiBi slopes and diagonals, the
causal mask types with Sq < Sk and Sq > Sk, explicit masks with wholly hidden rows (zeros), the
attention sink, -inf biases, float32 output from 16-bit input, odd sizes, in-place calls."""
import numpy as np
import pytest

from attn_softmax_case import (BIAS, DTYPES, MASK, T, attn_softmax_ref, bias_for, check_forward, default_slopes,
                               logit_rtol, mask_for, offset_for, randn, run_forward, terms)
from util import TOLERANCE, assert_close, poisoned, to_np
from transformer_engine import _nvte as nvte

# ------------------------------------------------------------ forward: bias types


@pytest.mark.parametrize("bias_dtype", DTYPES)
@pytest.mark.parametrize("in_dtype", DTYPES)
@pytest.mark.parametrize("bcast", ["11", "B1", "1H", "BH"])
@pytest.mark.parametrize("bias_type", ["pre", "post"])
def test_forward_bias(bias_type, bcast, in_dtype, bias_dtype, rng):
    """Pre-scale (scale * bias) and post-scale bias, broadcast over size-1 batch / head dims, in
    each float dtype, with inputs of each float dtype (scale 0.125 tells pre from post)."""
    for b, h, sq, sk in [(2, 3, 5, 7), (2, 1, 4, 33), (1, 3, 3, 130)]:
        x = randn(rng, (b, h, sq, sk), in_dtype)
        bias = bias_for(rng, b, h, sq, sk, bcast, bias_dtype)
        check_forward(x, 0.125, bias_type, bias=bias)


def test_pre_and_post_scale_bias_differ_by_the_scale(rng):
    """pre-scale bias B equals post-scale bias scale * B (structured check of the two rules)."""
    x = randn(rng, (2, 3, 4, 9))
    bias = randn(rng, (1, 3, 4, 9), spread=2.0)
    y1, _ = run_forward(x, 0.5, "pre", bias=bias)
    y2, _ = run_forward(x, 0.5, "post", bias=(0.5 * bias).astype(np.float32))
    assert_close(y1, y2)
    y3, _ = run_forward(x, 0.5, "post", bias=bias)
    assert not np.allclose(y1, y3), "pre- and post-scale bias must not be the same rule"


# ------------------------------------------------------------ forward: ALiBi


@pytest.mark.parametrize("mask_type", list(MASK))
@pytest.mark.parametrize("diag_kind", ["1", "B"])
@pytest.mark.parametrize("slopes_kind", ["default", "H", "BH"])
def test_forward_alibi(slopes_kind, diag_kind, mask_type, rng):
    """-slope[b, h] * |i + diag[b] - j| with default / [H] / [B, H] slopes, diag [1] or [B] of
    either sign (0: top-left, Sk - Sq: bottom-right), with each mask type."""
    for b, h, sq, sk in [(2, 3, 5, 7), (2, 1, 4, 9), (1, 6, 3, 33), (2, 3, 6, 4)]:
        x = randn(rng, (b, h, sq, sk), spread=1.0)
        slopes = None
        if slopes_kind == "H":
            slopes = rng.uniform(0.01, 1.0, h).astype(np.float32)
        elif slopes_kind == "BH":
            slopes = rng.uniform(0.01, 1.0, (b, h)).astype(np.float32)
        diags = [[0], [-3], [5], [sk - sq]] if diag_kind == "1" else [[0] * b, [-2, 6][:b], [sk - sq, -1][:b]]
        for d in diags:
            check_forward(x, 0.5, "alibi", mask_type, slopes=slopes, diag=np.array(d, np.int64))


@pytest.mark.parametrize("h", [1, 2, 3, 5, 8, 12])
def test_default_alibi_slopes_structured(h):
    """x = 0, diag 0, one query: y_j is proportional to exp(-slope_h * j), so the slope of each
    head is log(y_0 / y_{Sk-1}) / (Sk - 1); it must be TE's default (spot values for H = 3:
    2^-4, 2^-8, 2^-2). Given slopes equal to the defaults give the same result."""
    sk = 41
    x = np.zeros((1, h, 1, sk), np.float32)
    diag = np.zeros(1, np.int64)
    y, _ = check_forward(x, 1.0, "alibi", diag=diag)
    got = np.log(y[0, :, 0, 0].astype(np.float64) / y[0, :, 0, -1]) / (sk - 1)
    np.testing.assert_allclose(got, default_slopes(h), rtol=1e-5)
    if h == 3:
        np.testing.assert_allclose(default_slopes(3), [2.0**-4, 2.0**-8, 2.0**-2])
    y2, _ = run_forward(x, 1.0, "alibi", slopes=default_slopes(h).astype(np.float32), diag=diag)
    assert_close(y2, y)


def test_alibi_diagonal_per_batch_structured():
    """diag [B]: entry b's peak (x = 0) sits at key i + diag[b] (clamped into the row)."""
    sq, sk = 4, 12
    x = np.zeros((3, 2, sq, sk), np.float32)
    diag = np.array([0, 5, -2], np.int64)
    y, _ = check_forward(x, 1.0, "alibi", diag=diag)
    for b in range(3):
        for i in range(sq):
            assert int(np.argmax(y[b, 0, i])) == min(max(i + int(diag[b]), 0), sk - 1)


# ------------------------------------------------------------ forward: masks


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mask_type", ["causal", "bottom_right"])
def test_forward_causal(mask_type, dtype, rng):
    """Sq == Sk, Sq < Sk, Sq > Sk (bottom-right: the first Sq - Sk rows see nothing: zeros), Sk 1."""
    for b, h, sq, sk in [(2, 3, 6, 6), (1, 2, 4, 11), (2, 1, 9, 5), (1, 1, 1, 1), (1, 1, 3, 1),
                         (2, 3, 7, 33), (1, 1, 5, 130)]:
        x = randn(rng, (b, h, sq, sk), dtype)
        y, _ = check_forward(x, 0.125, "no_bias", mask_type)
        if mask_type == "bottom_right" and sq > sk:
            assert np.all(np.asarray(y, np.float64)[:, :, :sq - sk] == 0.0)


@pytest.mark.parametrize("mask_type", list(MASK))
@pytest.mark.parametrize("bcast", ["11", "B1", "1H", "BH"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_forward_explicit_mask(dtype, bcast, mask_type, rng):
    """uint8 masks [1|B, 1|H, Sq, Sk] (-10000 fill); a row whose kept keys it hides all is zeros
    (TE's kernel rule); hidden keys of other rows are exactly 0."""
    for b, h, sq, sk in [(2, 3, 5, 7), (2, 3, 4, 33), (1, 3, 3, 1), (2, 1, 6, 130)]:
        x = randn(rng, (b, h, sq, sk), dtype)
        for density in [0.0, 0.4, 1.0]:
            mask = mask_for(rng, b, h, sq, sk, bcast, density)
            y, _ = check_forward(x, 0.25, "no_bias", mask_type, mask=mask)
            y64 = np.asarray(y, np.float64)
            _, _, hidden, explicit = terms(x, 1.0, mask=mask, mask_type=mask_type)
            # rows whose keys (those the mask type leaves) the explicit mask hides all: zeros
            full = np.broadcast_to((explicit | hidden).all(axis=-1, keepdims=True), x.shape)
            assert np.all(y64[full] == 0.0), "a wholly hidden row must be all zeros"
            assert np.all(y64[explicit & ~full] == 0.0), "hidden keys of partly visible rows must be 0"


# ------------------------------------------------------------ forward: attention sink


@pytest.mark.parametrize("want_sink", [True, False])
@pytest.mark.parametrize("mask_type", list(MASK))
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_sink(dtype, mask_type, want_sink, rng):
    """softmax_offset adds exp(offset[h] - m) to each row's denominator; sink_probs (optional)
    is its share. Rows without keys (causal, Sq > Sk) give y = 0 and sink 1; explicit masks and
    a large offset (the sink takes nearly everything) too."""
    for b, h, sq, sk in [(2, 3, 5, 7), (1, 3, 8, 3), (2, 1, 4, 33), (1, 2, 3, 1), (2, 3, 2, 130)]:
        x = randn(rng, (b, h, sq, sk), dtype)
        offset = offset_for(rng, h)
        check_forward(x, 0.5, "no_bias", mask_type, offset=offset, want_sink=want_sink)
        offset[0] = 30.0
        mask = mask_for(rng, b, h, sq, sk, "B1", 0.3)
        check_forward(x, 0.5, "post", mask_type, bias=bias_for(rng, b, h, sq, sk, "1H"), mask=mask,
                      offset=offset, want_sink=want_sink)


def test_sink_rows_without_keys_structured():
    """Bottom-right, Sq 4 > Sk 2: rows 0, 1 see nothing (y 0, sink 1); rows 2, 3 with x = 0 and
    offset 0 split evenly between their keys and the sink."""
    x = np.zeros((1, 1, 4, 2), np.float32)
    y, sink = check_forward(x, 1.0, "no_bias", "bottom_right", offset=np.zeros(1, np.float32), want_sink=True)
    assert_close(y[0, 0], [[0, 0], [0, 0], [0.5, 0], [1 / 3, 1 / 3]])
    assert_close(sink[0, 0], [1, 1, 0.5, 1 / 3])


# ------------------------------------------------------------ forward: combinations, sizes, dtypes


@pytest.mark.parametrize("extra", ["none", "mask", "offset", "mask+offset"])
@pytest.mark.parametrize("mask_type", list(MASK))
@pytest.mark.parametrize("bias_type", list(BIAS))
def test_forward_combinations(bias_type, mask_type, extra, rng):
    """Every bias type with every mask type, with and without explicit mask and sink."""
    for b, h, sq, sk in [(2, 3, 5, 7), (1, 1, 6, 4), (2, 3, 4, 33)]:
        x = randn(rng, (b, h, sq, sk))
        kw = {}
        if bias_type in ("pre", "post"):
            kw["bias"] = bias_for(rng, b, h, sq, sk, "BH")
        if bias_type == "alibi":
            kw["diag"] = np.array([sk - sq], np.int64)
        if "mask" in extra:
            kw["mask"] = mask_for(rng, b, h, sq, sk, "BH", 0.3)
        if "offset" in extra:
            kw["offset"] = offset_for(rng, h)
            kw["want_sink"] = True
        check_forward(x, 0.3, bias_type, mask_type, **kw)


@pytest.mark.parametrize("scale", [1.0, 0.125])
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_odd_sizes(dtype, scale, rng):
    for shape in [(1, 1, 1, 1), (2, 3, 1, 7), (1, 3, 5, 1), (2, 1, 3, 33), (2, 3, 4, 130), (1, 1, 17, 130)]:
        check_forward(randn(rng, shape, dtype), scale)


def test_forward_structured_and_stable():
    """arange logits: row i of a head is geometric (ratio e^scale); equal logits are uniform; huge
    logits (1e4 apart) must not overflow."""
    x = np.broadcast_to(np.arange(10, dtype=np.float32), (2, 3, 4, 10)).copy()
    x[1, 2, 3] = 7.0
    x[0, 1, 2] = 1000.0 * np.arange(10) - 3000.0
    y, _ = check_forward(x, 1.0)
    ratio = y[0, 0, 0, 1:].astype(np.float64) / y[0, 0, 0, :-1]
    np.testing.assert_allclose(ratio, np.e, rtol=1e-5)
    assert_close(y[1, 2, 3], np.full(10, 0.1))
    assert y[0, 1, 2, -1] == 1.0 and np.all(y[0, 1, 2, :-1] == 0.0)
    xs = (np.arange(2 * 3 * 5 * 9, dtype=np.float32).reshape(2, 3, 5, 9) % 11) - 5.0
    check_forward(xs, 0.7, "alibi", "causal", diag=np.array([1, -1], np.int64),
                  mask=(np.arange(5 * 9).reshape(1, 1, 5, 9) % 4 == 0).astype(np.uint8),
                  offset=np.array([0.0, -1.0, 2.0], np.float32), want_sink=True)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_forward_float32_output(dtype, rng):
    """16-bit scores may give float32 probabilities (kept exact for a sink gradient): the reference
    at float32's tolerance, with bias, sink, causal rule and mask."""
    x = to_np(rng.standard_normal((2, 3, 5, 9)) * 3, dtype)
    bias = to_np(rng.standard_normal((1, 3, 5, 9)), dtype)
    offset = rng.standard_normal(3).astype(np.float32)
    mask = (rng.random((2, 1, 5, 9)) < 0.3).astype(np.uint8)
    kw = dict(bias_type="post", mask_type="causal", bias=bias, mask=mask)
    y, sink = run_forward(x, 0.3, offset=offset, want_sink=True, out=poisoned(x.shape, "float32"), **kw)
    ref, sink_ref = attn_softmax_ref(x, 0.3, offset=offset, **kw)
    rt, rt_sink = logit_rtol(x, 0.3, ref, **kw)
    assert y.dtype == np.float32
    assert_close(y, ref, "float32", rtol=TOLERANCE["float32"][1] + rt)
    assert_close(sink, sink_ref, "float32", rtol=TOLERANCE["float32"][1] + rt_sink)

@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_in_place(dtype, rng):
    """softmax_results may alias input."""
    x = randn(rng, (2, 3, 5, 33), dtype)
    bias = bias_for(rng, 2, 3, 5, 33, "1H")
    ref, _ = attn_softmax_ref(x, 0.5, "post", bias=bias, mask_type="causal")
    rt, _ = logit_rtol(x, 0.5, ref, bias_type="post", bias=bias, mask_type="causal")
    run_forward(x, 0.5, "post", "causal", bias=bias, out=x)
    assert_close(x, ref, dtype, rtol=TOLERANCE[dtype][1] + rt)


def test_matches_the_softmax_family(rng):
    """Without bias and sink the op is nvte_scaled_masked_softmax (explicit [B or 1, 1, Sq, Sk]
    mask) and nvte_scaled_aligned_causal_masked_softmax (bottom-right)."""
    x = randn(rng, (2, 3, 5, 9))
    mask = mask_for(rng, 2, 3, 5, 9, "B1", 0.4)
    y1, _ = run_forward(x, 0.25, mask=mask)
    y2 = poisoned(x.shape, "float32")
    nvte.scaled_masked_softmax_forward(T(x), T(mask), T(y2), 0.25)
    assert_close(y1, y2)
    for sq, sk in [(5, 9), (9, 5), (6, 6)]:
        x = randn(rng, (2, 3, sq, sk))
        y1, _ = run_forward(x, 0.25, mask_type="bottom_right")
        y2 = poisoned(x.shape, "float32")
        nvte.scaled_aligned_causal_masked_softmax_forward(T(x), T(y2), 0.25)
        assert_close(y1, y2)
        if sq == sk:
            y3, _ = run_forward(x, 0.25, mask_type="causal")
            assert_close(y3, y2)


def test_empty(rng):
    """Sq = 0 or Sk = 0 writes nothing (no keys: sink 1); B = 0 too."""
    for shape in [(2, 3, 0, 5), (2, 3, 4, 0), (0, 3, 4, 5)]:
        x = np.zeros(shape, np.float32)
        _, sink = run_forward(x, 1.0, offset=np.zeros(3, np.float32), want_sink=True)
        assert np.all(sink == 1.0)
        dx, dl, doff = (poisoned(shape, "float32"), poisoned(shape, "float32"), poisoned(shape[:3], "float32"))
        nvte.attn_softmax_backward(T(x), T(x), None, T(sink), T(dx), T(dl), T(doff), 1.0)
        assert np.all(doff == 0.0)


@pytest.mark.parametrize("offset", [None, "sink"])
def test_minus_inf_bias_leaves_keys_out(offset, rng):
    """A post-scale bias of -inf leaves its key out, as in fused attention; a row whose keys it
    leaves out all is zeros (not NaN), its sink share 1."""
    b, h, sq, sk = 1, 2, 3, 5
    x = randn(rng, (b, h, sq, sk), "float32")
    bias = np.zeros((1, h, sq, sk), np.float32)
    bias[0, 0, 0, :] = -np.inf  # a whole row
    bias[0, 1, 1, 2:] = -np.inf  # part of one
    off = offset_for(rng, h) if offset else None
    y, sink = run_forward(x, 0.5, "post", bias=bias, offset=off, want_sink=offset is not None)
    y_ref, sink_ref = attn_softmax_ref(x, 0.5, "post", bias=bias, offset=off)
    assert not np.isnan(y).any()
    assert_close(y, y_ref, "float32")  # (the -inf keys: exactly 0 in both)
    assert np.all(y[0, 0, 0] == 0.0) and np.all(y[0, 1, 1, 2:] == 0.0)
    if offset:
        assert_close(sink, sink_ref, "float32")
        assert sink[0, 0, 0] == 1.0
