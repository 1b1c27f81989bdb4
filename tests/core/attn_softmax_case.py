"""Shared pieces of the nvte_attn_softmax tests (test_attn_softmax*.py): the score softmax of
unfused attention (softmax.h) on the CPU backend against float64 numpy references written from the header's
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
