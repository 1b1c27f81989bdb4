"""nvte_attn_softmax_forward / nvte_attn_softmax_backward (softmax.h), the score softmax of
unfused attention, on the CPU backend against float64 numpy references written from the header's
contract (attn_softmax_ref, attn_softmax_backward_ref): every bias type (pre/post-scale bias
broadcast over batch and heads, in each float dtype; ALiBi with TE's default slopes, [H] and
[B, H] slopes, diagonals [1] and [B] of either sign), the causal mask types with Sq < Sk and
Sq > Sk (rows that see no key are all zeros), explicit uint8 masks broadcast in batch and heads
with wholly hidden rows (zeros), the attention sink (softmax_offset, sink_probs; rows without
keys give y = 0, sink 1), float32 / float16 / bfloat16 inputs, odd sizes, in-place calls; the
backward's three outputs, aliasing; misuse raises nvte.Error.

Tolerances: the central table (util.TOLERANCE) of the output dtype, plus the float32 rounding of
the logits: z_j = scale * x_j + t_j is formed in float32, an absolute error up to ~2^-23 (|s_j| +
|t_j|) (s = scale * x, t the additive term), and exp turns an absolute error of a logit into a
relative one of y. Per element the bound is 2^-22 (mag_j + mag at the row max + sum_k y_k mag_k),
mag = |s| + |t| over the keys left in the row (explicitly masked keys are the constant -10000).
The backward's row dot d = sum dy * y is a float32 sum: an absolute error of ~2^-18 |scale * y|
(|dy| + sum |dy * y|) covers its rounding and the cancellation in dy - d."""
import numpy as np
import pytest

from util import BF16, DT, TOLERANCE, assert_close, poisoned, to_np
from transformer_engine import _nvte as nvte

BT = nvte.NVTE_Bias_Type
MT = nvte.NVTE_Mask_Type
BIAS = {"no_bias": BT.NVTE_NO_BIAS, "pre": BT.NVTE_PRE_SCALE_BIAS, "post": BT.NVTE_POST_SCALE_BIAS,
        "alibi": BT.NVTE_ALIBI}
MASK = {"no_mask": MT.NVTE_NO_MASK, "causal": MT.NVTE_CAUSAL_MASK,
        "bottom_right": MT.NVTE_CAUSAL_BOTTOM_RIGHT_MASK}
DTYPES = ["float32", "float16", "bfloat16"]
NAME = {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16", np.dtype(BF16): "bfloat16"}


def T(a):
    """nvte.Tensor of an array (None: a null handle); bfloat16 travels as its uint16 bits."""
    if a is None:
        return None
    if a.dtype == BF16:
        return nvte.Tensor(a.view(np.uint16), dtype=DT.kBFloat16)
    return nvte.Tensor(a)


# ------------------------------------------------------------ float64 references


def default_slopes(h):
    """TE's default ALiBi slopes: n the largest power of two <= h; head k < n gets
    2^(-8 (k + 1) / n), the others 2^(-4 (2 (k - n) + 1) / n)."""
    n = 1
    while 2 * n <= h:
        n *= 2
    return np.array([2.0 ** (-8.0 * (k + 1) / n) if k < n else 2.0 ** (-4.0 * (2 * (k - n) + 1) / n)
                     for k in range(h)])


def causal_hidden(sq, sk, mask_type):
    """bool [Sq, Sk]: keys the mask type leaves out of row i."""
    i = np.arange(sq)[:, None]
    j = np.arange(sk)[None, :]
    if mask_type == "causal":
        return j > i
    if mask_type == "bottom_right":
        return j > i + (sk - sq)
    return np.zeros((sq, sk), bool)


def terms(x, scale, bias_type="no_bias", bias=None, slopes=None, diag=None, mask=None, mask_type="no_mask"):
    """float64 s = scale * x, the additive term t, the mask type's hidden keys and the explicit
    mask's hidden keys, all [B, H, Sq, Sk]."""
    x = np.asarray(x, np.float64)
    b, h, sq, sk = x.shape
    s = scale * x
    if bias_type in ("pre", "post"):
        t = np.broadcast_to(np.asarray(bias, np.float64), x.shape)
        t = scale * t if bias_type == "pre" else t
    elif bias_type == "alibi":
        sl = default_slopes(h)[None] if slopes is None else np.asarray(slopes, np.float64).reshape(-1, h)
        sl = np.broadcast_to(sl, (b, h))
        dg = np.broadcast_to(np.asarray(diag, np.int64).reshape(-1), (b,))
        i = np.arange(sq)[None, :, None]
        j = np.arange(sk)[None, None, :]
        dist = np.abs(i + dg[:, None, None] - j).astype(np.float64)  # [B, Sq, Sk]
        t = -sl[:, :, None, None] * dist[:, None]
    else:
        t = np.zeros(x.shape)
    hidden = np.broadcast_to(causal_hidden(sq, sk, mask_type), x.shape)
    explicit = np.zeros(x.shape, bool) if mask is None else np.broadcast_to(np.asarray(mask).astype(bool), x.shape)
    return s, t, hidden, explicit


def attn_softmax_ref(x, scale, bias_type="no_bias", bias=None, slopes=None, diag=None, mask=None,
                     mask_type="no_mask", offset=None):
    """(y, sink_probs) in float64 from the header's formula: z = s + t; explicitly masked keys get
    z = -10000; keys hidden by the mask type leave the row (y = 0); m = row max including the
    sink logit; y = exp(z - m) / (sum exp(z - m) + exp(offset - m)). sink_probs is None without
    an offset; a row with neither key nor sink is all zeros."""
    s, t, hidden, explicit = terms(x, scale, bias_type, bias, slopes, diag, mask, mask_type)
    z = np.where(explicit, -10000.0, s + t)
    # a row whose kept keys the explicit mask hides all leaves them all out (TE's kernel rule)
    hidden = hidden | np.broadcast_to((explicit | hidden).all(axis=-1, keepdims=True), x.shape)
    z = np.where(hidden, -np.inf, z)
    m = z.max(axis=-1, initial=-np.inf)
    if offset is not None:
        off = np.broadcast_to(np.asarray(offset, np.float64)[None, :, None], m.shape)
        m = np.maximum(m, off)
    ms = np.where(np.isfinite(m), m, 0.0)
    e = np.where(hidden, 0.0, np.exp(z - ms[..., None]))
    den = e.sum(axis=-1)
    sink = None
    if offset is not None:
        es = np.exp(off - ms)
        den = den + es
        sink = es / den
    y = np.divide(e, den[..., None], out=np.zeros_like(e), where=den[..., None] > 0)
    return y, sink


def attn_softmax_backward_ref(dy, y, scale, mask=None, sink=None):
    """(output_grads, logit_grads, offset_grads) in float64: d = sum dy * y; g = y (dy - d), 0 where
    the explicit mask hides the key; scale * g; -sink * d (None without sink)."""
    dy = np.asarray(dy, np.float64)
    y = np.asarray(y, np.float64)
    d = (dy * y).sum(axis=-1)
    g = y * (dy - d[..., None])
    if mask is not None:
        g = np.where(np.broadcast_to(np.asarray(mask).astype(bool), g.shape), 0.0, g)
    doff = None if sink is None else -np.asarray(sink, np.float64) * d
    return scale * g, g, doff


def logit_rtol(x, scale, y_ref, **kw):
    """Per-element relative error of y from float32 logits (module docstring), and per row that of
    the sink share: 2^-22 (mag_j + mag at the max + sum_k y_k mag_k)."""
    kw.pop("offset", None)
    s, t, hidden, explicit = terms(x, scale, **kw)
    mag = np.where(hidden | explicit, 0.0, np.abs(s) + np.abs(t))
    z = np.where(hidden | explicit, -np.inf, s + t)
    if z.shape[-1] == 0:
        return np.zeros(z.shape), np.zeros(z.shape[:-1])
    star = np.take_along_axis(mag, np.argmax(z, axis=-1)[..., None], axis=-1)  # [.., 1]
    avg = (y_ref * mag).sum(axis=-1, keepdims=True)
    return 2.0**-22 * (mag + star + avg), 2.0**-22 * (star + avg)[..., 0]


# ------------------------------------------------------------ calls and checks


def run_forward(x, scale, bias_type="no_bias", mask_type="no_mask", bias=None, slopes=None, diag=None,
                mask=None, offset=None, want_sink=False, out=None):
    """Calls the op with poisoned outputs; returns (y, sink_probs or None)."""
    y = poisoned(x.shape, NAME[x.dtype]) if out is None else out
    sink = poisoned(x.shape[:3], "float32") if want_sink else None
    nvte.attn_softmax_forward(T(x), T(bias), T(slopes), T(diag), T(mask), T(offset), T(y), T(sink),
                              scale, BIAS[bias_type], MASK[mask_type])
    return y, sink


def check_forward(x, scale, bias_type="no_bias", mask_type="no_mask", bias=None, slopes=None, diag=None,
                  mask=None, offset=None, want_sink=False):
    """Runs the op and holds y (and sink_probs) to the reference; the structural rules exactly:
    keys the mask type hides are 0, rows without keys are 0 (sink 1), visible float32 rows sum
    to 1 with the sink."""
    kw = dict(bias_type=bias_type, bias=bias, slopes=slopes, diag=diag, mask=mask, mask_type=mask_type)
    y, sink = run_forward(x, scale, bias_type, mask_type, bias, slopes, diag, mask, offset, want_sink)
    ref, sink_ref = attn_softmax_ref(x, scale, offset=offset, **kw)
    dtype = NAME[x.dtype]
    rt, rt_sink = logit_rtol(x, scale, ref, **kw)
    assert_close(y, ref, dtype, rtol=TOLERANCE[dtype][1] + rt)
    y64 = np.asarray(y, np.float64)
    _, _, hidden, explicit = terms(x, scale, **kw)
    assert np.all(y64[hidden] == 0.0), "keys hidden by mask_type must be exactly 0"
    no_keys = (hidden | explicit).all(axis=-1)  # (an explicit mask hiding every kept key: no keys either)
    assert np.all(y64[no_keys] == 0.0), "rows without keys must be all zeros"
    if want_sink:
        assert_close(sink, sink_ref, "float32", rtol=TOLERANCE["float32"][1] + rt_sink)
        assert np.all(sink[no_keys] == 1.0), "rows without keys: the sink takes everything"
    if dtype == "float32" and y.size:
        total = y64.sum(axis=-1) + (sink_ref if offset is not None else 0.0)
        rows = ~no_keys if offset is None else np.ones(no_keys.shape, bool)
        assert np.allclose(total[rows], 1.0, atol=1e-5), "rows must sum to 1 (with the sink)"
    return y, sink


def randn(rng, shape, dtype="float32", spread=3.0):
    return to_np(rng.normal(0.0, spread, shape), dtype)


def bias_for(rng, b, h, sq, sk, bcast, dtype="float32"):
    shape = (b if "B" in bcast else 1, h if "H" in bcast else 1, sq, sk)
    return randn(rng, shape, dtype, 2.0)


def mask_for(rng, b, h, sq, sk, bcast="BH", density=0.3, full_row=True):
    """uint8 [B or 1, H or 1, Sq, Sk], with (when Sq > 1) row 0 of entry (0, 0) hidden wholly and
    row 1 not at all."""
    shape = (b if "B" in bcast else 1, h if "H" in bcast else 1, sq, sk)
    m = (rng.random(shape) < density).astype(np.uint8)
    if full_row and sq > 1 and sk > 0:
        m[0, 0, 0, :] = 1
        m[0, 0, 1, :] = 0
    return m


def offset_for(rng, h):
    return rng.normal(0.0, 2.0, h).astype(np.float32)


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


# ------------------------------------------------------------ backward


def backward_case(rng, shape, dtype, with_mask, with_sink, mask_type="no_mask", bcast="B1"):
    """(dy, y, mask, sink): y and sink from the float64 forward (y in dtype, sink float32)."""
    b, h, sq, sk = shape
    x = rng.normal(0.0, 2.0, shape)
    mask = mask_for(rng, b, h, sq, sk, bcast, 0.3) if with_mask else None
    offset = offset_for(rng, h) if with_sink else None
    y, sink = attn_softmax_ref(x, 1.0, mask=mask, mask_type=mask_type, offset=offset)
    y = to_np(y, dtype)
    sink = None if sink is None else sink.astype(np.float32)
    dy = randn(rng, shape, dtype, 1.0)
    return dy, y, mask, sink


def bwd_atol(dtype, dy, y, scale):
    dy, y = np.asarray(dy, np.float64), np.asarray(y, np.float64)
    mult = np.abs(scale * y) * (np.abs(dy) + np.abs(dy * y).sum(axis=-1, keepdims=True))
    return TOLERANCE[dtype][0] + 2.0**-18 * mult


@pytest.mark.parametrize("out_dtype", ["same", "float32"])
@pytest.mark.parametrize("variant", ["plain", "mask", "sink", "mask+sink"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_backward(dtype, variant, out_dtype, rng):
    """output_grads = scale * g, logit_grads = g, offset_grads = -sink * d against float64, g = 0
    where the explicit mask hides (wholly hidden rows: zero gradient), causal rows without keys."""
    od = dtype if out_dtype == "same" else out_dtype
    ld = "float32" if out_dtype == "same" else dtype  # logit_grads: float32, or 16-bit
    for shape, mask_type, bcast in [((2, 3, 5, 7), "no_mask", "B1"), ((1, 1, 3, 1), "no_mask", "11"),
                                    ((2, 3, 4, 33), "causal", "1H"), ((1, 3, 6, 130), "bottom_right", "BH"),
                                    ((2, 1, 5, 3), "bottom_right", "BH")]:
        dy, y, mask, sink = backward_case(rng, shape, dtype, "mask" in variant, "sink" in variant, mask_type,
                                          bcast)
        scale = 0.125
        dx = poisoned(shape, od)
        dl = poisoned(shape, ld)
        doff = poisoned(shape[:3], "float32") if sink is not None else None
        nvte.attn_softmax_backward(T(dy), T(y), T(mask), T(sink), T(dx), T(dl), T(doff), scale)
        rdx, rg, rdoff = attn_softmax_backward_ref(dy, y, scale, mask, sink)
        assert_close(dx, rdx, od, atol=bwd_atol(od, dy, y, scale))
        assert_close(dl, rg, ld, atol=bwd_atol(ld, dy, y, 1.0))
        if sink is not None:
            d_mult = np.abs(np.asarray(dy, np.float64) * np.asarray(y, np.float64)).sum(axis=-1)
            assert_close(doff, rdoff, "float32", atol=1e-6 + 2.0**-18 * np.abs(sink) * d_mult)
        if mask is not None:
            hid = np.broadcast_to(mask.astype(bool), shape)
            assert np.all(np.asarray(dx, np.float64)[hid] == 0.0)
            assert np.all(np.asarray(dl, np.float64)[hid] == 0.0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_optional_outputs(dtype, rng):
    """logit_grads and offset_grads are optional (null): output_grads alone is the same."""
    dy, y, mask, sink = backward_case(rng, (2, 3, 4, 9), dtype, True, True)
    full = poisoned(y.shape, dtype)
    dl, doff = poisoned(y.shape, "float32"), poisoned(y.shape[:3], "float32")
    nvte.attn_softmax_backward(T(dy), T(y), T(mask), T(sink), T(full), T(dl), T(doff), 0.5)
    alone = poisoned(y.shape, dtype)
    nvte.attn_softmax_backward(T(dy), T(y), T(mask), None, T(alone), None, None, 0.5)
    rdx, _, _ = attn_softmax_backward_ref(dy, y, 0.5, mask, sink)
    assert_close(full, rdx, dtype, atol=bwd_atol(dtype, dy, y, 0.5))
    assert np.array_equal(full.view(np.uint8), alone.view(np.uint8))


@pytest.mark.parametrize("mask_type", ["causal", "bottom_right"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_mask_type(mask_type, dtype, rng):
    """With the forward's mask type the backward leaves the hidden keys unread: NaN there in y and
    dy still gives zero gradients there and the reference elsewhere (Sq > Sk: rows without keys)."""
    for sq, sk in [(5, 9), (6, 4), (7, 7)]:
        x = rng.standard_normal((2, 3, sq, sk)) * 2
        hidden = np.broadcast_to(causal_hidden(sq, sk, mask_type), x.shape)
        y = to_np(attn_softmax_ref(x, 0.5, mask_type=mask_type)[0], dtype)
        dy = to_np(rng.standard_normal(x.shape), dtype)
        ref = attn_softmax_backward_ref(dy, y, 0.5)
        y[hidden] = np.nan
        dy[hidden] = np.nan
        dx = poisoned(x.shape, dtype)
        dl = poisoned(x.shape, "float32")
        nvte.attn_softmax_backward(T(dy), T(y), None, None, T(dx), T(dl), None, 0.5, MASK[mask_type])
        assert np.all(np.asarray(dx, np.float64)[hidden] == 0) and np.all(np.asarray(dl)[hidden] == 0)
        assert_close(np.where(hidden, 0.0, np.asarray(dx, np.float64)), ref[0], dtype)
        assert_close(dl, ref[1], "float32", rtol=2.0**-18)


@pytest.mark.parametrize("alias", ["incoming_grads", "softmax_results"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_in_place(dtype, alias, rng):
    """output_grads aliasing incoming_grads or softmax_results (same dtype), with the other outputs."""
    for shape in [(2, 3, 5, 7), (1, 2, 3, 130)]:
        dy, y, mask, sink = backward_case(rng, shape, dtype, True, True, "causal")
        rdx, rg, rdoff = attn_softmax_backward_ref(dy, y, 0.25, mask, sink)
        atol, atol_g = bwd_atol(dtype, dy, y, 0.25), bwd_atol("float32", dy, y, 1.0)
        d_mult = np.abs(np.asarray(dy, np.float64) * np.asarray(y, np.float64)).sum(axis=-1)
        atol_off = 1e-6 + 2.0**-18 * np.abs(sink) * d_mult
        dl = poisoned(shape, "float32")
        doff = poisoned(shape[:3], "float32")
        t = T(dy) if alias == "incoming_grads" else T(y)
        tdy = t if alias == "incoming_grads" else T(dy)
        ty = t if alias == "softmax_results" else T(y)
        nvte.attn_softmax_backward(tdy, ty, T(mask), T(sink), t, T(dl), T(doff), 0.25)
        assert_close(dy if alias == "incoming_grads" else y, rdx, dtype, atol=atol)
        assert_close(dl, rg, "float32", atol=atol_g)
        assert_close(doff, rdoff, "float32", atol=atol_off)


def test_backward_matches_forward_differences(rng):
    """The backward is the gradient of the forward: central differences of L = sum(w * y) in float64
    over the reference forward (causal, explicit mask, sink) match the float64 backward formula
    with dy = w, for x (output_grads) and for the offset (offset_grads summed over b and i); this
    checks the reference itself, and the op agrees."""
    shape = (1, 2, 3, 5)
    x = rng.normal(0.0, 1.0, shape)
    mask = np.zeros((1, 1, 3, 5), np.uint8)
    mask[0, 0, 1, 0] = 1
    mask[0, 0, 2, :] = 1  # row 2: every key hidden (its gradient is 0)
    offset = np.array([0.5, -1.0])
    w = rng.normal(0.0, 1.0, shape)
    scale = 0.7

    def loss(xx, off):
        return (w * attn_softmax_ref(xx, scale, mask=mask, mask_type="causal", offset=off)[0]).sum()

    eps = 1e-6
    num = np.zeros(shape)
    for idx in np.ndindex(shape):
        xp, xm = x.copy(), x.copy()
        xp[idx] += eps
        xm[idx] -= eps
        num[idx] = (loss(xp, offset) - loss(xm, offset)) / (2 * eps)
    num_off = np.zeros(2)
    for hh in range(2):
        op, om = offset.copy(), offset.copy()
        op[hh] += eps
        om[hh] -= eps
        num_off[hh] = (loss(x, op) - loss(x, om)) / (2 * eps)
    y, sink = attn_softmax_ref(x, scale, mask=mask, mask_type="causal", offset=offset)
    rdx, _, rdoff = attn_softmax_backward_ref(w, y, scale, mask, sink)
    np.testing.assert_allclose(rdx, num, atol=1e-7)
    np.testing.assert_allclose(rdoff.sum(axis=(0, 2)), num_off, atol=1e-7)
    dx = poisoned(shape, "float32")
    doff = poisoned(shape[:3], "float32")
    w32, y32, s32 = w.astype(np.float32), y.astype(np.float32), sink.astype(np.float32)
    nvte.attn_softmax_backward(T(w32), T(y32), T(mask), T(s32), T(dx), None, T(doff), scale)
    np.testing.assert_allclose(dx, num, atol=2e-6)
    np.testing.assert_allclose(doff.sum(axis=(0, 2)), num_off, atol=2e-6)
    assert np.all(dx[0, :, 2] == 0.0)


# ------------------------------------------------------------ misuse


def f32(*shape):
    return nvte.Tensor(np.zeros(shape, np.float32))


def arr(dtype, *shape):
    return nvte.Tensor(np.zeros(shape, dtype))


def u8(*shape):
    return arr(np.uint8, *shape)


def i64(*shape):
    return arr(np.int64, *shape)


def fwd(inp=None, bias=None, slopes=None, diag=None, mask=None, offset=None, out=None, sink=None,
        bias_type="no_bias", mask_type=MT.NVTE_NO_MASK):
    """A forward on [2, 3, 4, 5] unless overridden (mask_type: an NVTE_Mask_Type)."""
    inp = f32(2, 3, 4, 5) if inp is None else inp
    out = f32(2, 3, 4, 5) if out is None else out
    return nvte.attn_softmax_forward(inp, bias, slopes, diag, mask, offset, out, sink, 1.0,
                                     BIAS[bias_type], mask_type)


def bwd(dy=None, y=None, mask=None, sink=None, dx=None, dl=None, doff=None):
    dy = f32(2, 3, 4, 5) if dy is None else dy
    y = f32(2, 3, 4, 5) if y is None else y
    dx = f32(2, 3, 4, 5) if dx is None else dx
    return nvte.attn_softmax_backward(dy, y, mask, sink, dx, dl, doff, 1.0)


@pytest.mark.parametrize("call, match", [
    # bias
    (lambda: fwd(bias=f32(2, 3, 4, 6), bias_type="post"), r"bias has shape \[2, 3, 4, 6\]"),
    (lambda: fwd(bias=f32(3, 1, 4, 5), bias_type="pre"), r"bias has shape \[3, 1, 4, 5\]"),
    (lambda: fwd(bias=f32(3, 4, 5), bias_type="pre"), r"bias has shape \[3, 4, 5\]"),
    (lambda: fwd(bias=f32(2, 3, 4, 5)), r"bias"),  # bias with NVTE_NO_BIAS
    (lambda: fwd(bias_type="pre"), r"bias"),  # pre-scale bias missing
    (lambda: fwd(bias=arr(np.int32, 1, 1, 4, 5), bias_type="post"), r"bias.*int32"),
    # ALiBi
    (lambda: fwd(bias_type="alibi"), r"alibi_diagonal"),
    (lambda: fwd(diag=arr(np.int32, 1), bias_type="alibi"), r"alibi_diagonal.*int"),
    (lambda: fwd(diag=i64(3), bias_type="alibi"), r"alibi_diagonal has shape \[3\]"),
    (lambda: fwd(slopes=f32(4), diag=i64(1), bias_type="alibi"), r"alibi_slopes has shape \[4\]"),
    (lambda: fwd(slopes=f32(3, 3), diag=i64(1), bias_type="alibi"), r"alibi_slopes has shape \[3, 3\]"),
    (lambda: fwd(slopes=f32(2, 3, 1), diag=i64(1), bias_type="alibi"), r"alibi_slopes has shape \[2, 3, 1\]"),
    (lambda: fwd(slopes=arr(np.float16, 3), diag=i64(1), bias_type="alibi"), r"alibi_slopes.*float"),
    (lambda: fwd(bias=f32(2, 3, 4, 5), slopes=f32(3), bias_type="post"), r"alibi"),  # ALiBi only
    # explicit mask
    (lambda: fwd(mask=u8(2, 3, 4, 6)), r"mask has shape \[2, 3, 4, 6\]"),
    (lambda: fwd(mask=u8(3, 1, 4, 5)), r"mask has shape \[3, 1, 4, 5\]"),
    (lambda: fwd(mask=u8(2, 2, 4, 5)), r"mask has shape \[2, 2, 4, 5\]"),
    (lambda: fwd(mask=u8(4, 5)), r"mask has shape \[4, 5\]"),
    (lambda: fwd(mask=f32(2, 1, 4, 5)), r"mask.*uint8"),
    # sink
    (lambda: fwd(offset=f32(4)), r"softmax_offset has shape \[4\]"),
    (lambda: fwd(offset=arr(np.float16, 3)), r"softmax_offset.*float"),
    (lambda: fwd(sink=f32(2, 3, 4)), r"sink_probs"),  # sink_probs without softmax_offset
    (lambda: fwd(offset=f32(3), sink=f32(2, 3, 5)), r"sink_probs has shape \[2, 3, 5\]"),
    (lambda: fwd(offset=f32(3), sink=arr(np.float16, 2, 3, 4)), r"sink_probs.*float"),
    # mask types
    (lambda: fwd(mask_type=MT.NVTE_PADDING_MASK), r"(?i)mask.?type|PADDING"),
    (lambda: fwd(mask_type=MT.NVTE_PADDING_CAUSAL_MASK), r"(?i)mask.?type|PADDING"),
    (lambda: fwd(mask_type=MT.NVTE_ARBITRARY_MASK), r"(?i)mask.?type|ARBITRARY"),
    # input / output
    (lambda: fwd(inp=f32(3, 4, 5), out=f32(3, 4, 5)), r"input has shape \[3, 4, 5\]"),
    (lambda: fwd(inp=arr(np.int32, 2, 3, 4, 5)), r"input must be float32, float16 or bfloat16, got int32"),
    (lambda: fwd(out=f32(2, 3, 4, 6)), r"softmax_results has shape \[2, 3, 4, 6\]"),
    (lambda: fwd(out=arr(np.float16, 2, 3, 4, 5)), r"softmax_results"),  # dtype must be input's
    (lambda: fwd(out=nvte.Tensor()), r"softmax_results"),  # no data
    (lambda: bwd(dx=nvte.Tensor()), r"output_grads"),
    # backward
    (lambda: bwd(doff=f32(2, 3, 4)), r"offset_grads|sink_probs"),  # offset_grads without sink_probs
    (lambda: bwd(sink=f32(2, 3, 4), doff=f32(2, 3, 5)), r"offset_grads has shape \[2, 3, 5\]"),
    (lambda: bwd(sink=f32(2, 4, 3), doff=f32(2, 3, 4)), r"sink_probs has shape \[2, 4, 3\]"),
    (lambda: bwd(dy=f32(2, 3, 4, 6)), r"incoming_grads has shape \[2, 3, 4, 6\]"),
    (lambda: bwd(dx=f32(2, 3, 5, 4)), r"output_grads has shape \[2, 3, 5, 4\]"),
    (lambda: bwd(dl=f32(2, 3, 4, 6)), r"logit_grads has shape \[2, 3, 4, 6\]"),
    (lambda: bwd(mask=u8(2, 3, 4, 6)), r"mask has shape \[2, 3, 4, 6\]"),
    (lambda: bwd(dy=f32(3, 4, 5), y=f32(3, 4, 5), dx=f32(3, 4, 5)), r"has shape \[3, 4, 5\]"),
    (lambda: bwd(dx=arr(np.int32, 2, 3, 4, 5)), r"output_grads must be float32, float16 or bfloat16"),
])
def test_errors(call, match):
    with pytest.raises(nvte.Error, match=match):
        call()
    # The process survives and a valid call still works.
    y = np.zeros((1, 1, 1, 2), np.float32)
    nvte.attn_softmax_forward(f32(1, 1, 1, 2), None, None, None, None, None, nvte.Tensor(y), None, 1.0,
                              BT.NVTE_NO_BIAS, MT.NVTE_NO_MASK)
    assert y.tolist() == [[[[0.5, 0.5]]]]


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
