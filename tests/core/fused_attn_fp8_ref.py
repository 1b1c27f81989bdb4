"""Float64 reference of FP8 fused attention (fused_attn.h "FP8 attention",
core/cpu/fused_attn_fp8.cpp): the high-precision reference of fused_attn_ref.py with TE's two
intermediate FP8 quantization points emulated exactly.

Every quantization follows the library's rule (util.fp8_encode_ref): x is rounded to float32,
multiplied by the float32 scale in float32, rounded to nearest even in the FP8 format and
saturated; dequantizing multiplies the FP8 number by float32(1 / scale). Inputs are the decoded
values (FP8 number * scale_inv), exact in float64.

Forward:  m = row max of z (and the sink), l = sum exp(z - m) (+ sink), U = dropout(exp(z - m))
          (unnormalized, as cuDNN's flash kernel quantizes it), amax_S = max U,
          U~ = qdq(U, s_S, E4M3), O = U~ V / l (unscaled; the caller quantizes it with s_O).
Backward: P from the stored lse, P~ as above, D = dO . O, dS = attn_scale * P (drop dP - D),
          amax_dP = max |dS|, dS~ = qdq(dS, s_dP, dO's format), dQ = dS~ K, dK = dS~^T Q,
          dV = P~^T dO (dK, dV summed over each K/V head's Q heads).
A format of None skips that quantization point: the result is then the high-precision math,
which test_fused_attn_fp8.py checks against fused_attn_ref.py."""
import numpy as np

from fused_attn_ref import _drop, _expand_kv, _probs, _sink, fused_attn_ref, logits
from util import FP8_MAX, fp8_decode, fp8_encode_ref


def descale(scale):
    """float32(1 / scale) as float64: how the library decodes what it quantized with scale."""
    return float(np.float32(1.0) / np.float32(scale))


def fp8_codes(x, scale, fmt):
    """FP8 bytes of float32(x) * float32(scale) (RNE, saturating)."""
    return fp8_encode_ref(np.asarray(x, np.float32) * np.float32(scale), fmt)


def qdq(x, scale, fmt):
    """The value x becomes at an FP8 quantization point (identity when fmt is None)."""
    if fmt is None:
        return np.asarray(x, np.float64)
    return fp8_decode(fp8_codes(x, scale, fmt), fmt) * descale(scale)


def amax_f32(x):
    """max |float32(x)|, 0 for empty arrays (the amax the library records)."""
    return float(np.abs(np.asarray(x, np.float32)).max(initial=0.0))


def delayed_scale(amax, fmt, margin=1.25):
    """A float32 scale mapping amax * margin to the format's max (TE's recipe without history);
    1 when amax is 0."""
    return float(np.float32(FP8_MAX[fmt] / (amax * margin))) if amax > 0 else 1.0


def fp8_attn_fwd_ref(q, k, v, cfg, ex, scale_s, fmt_s="e4m3"):
    """O [b, sq, hq, dv] before its own quantization, lse [b, hq, sq], amax_S."""
    _, lse, mx = fused_attn_ref(q, k, v, cfg, ex)
    z, _ = logits(q, k, cfg, ex)
    sink = _sink(cfg, ex, q.shape[2])
    m = mx if sink is None else np.maximum(mx, sink[None, :, None])
    fin = np.isfinite(lse)
    m0 = np.where(fin, m, 0.0)
    u = np.where(fin[..., None], np.exp(z - m0[..., None]), 0.0) * _drop(cfg, ex)
    l_sum = np.where(fin, np.exp(lse - m0), 1.0)  # [b, hq, sq]
    uq = qdq(u, scale_s, fmt_s)
    o = np.einsum("bhij,bjhd->bihd", uq, _expand_kv(v, q.shape[2])) / l_sum.transpose(0, 2, 1)[..., None]
    return o, lse, amax_f32(u)


def fp8_attn_bwd_ref(q, k, v, o, do, lse, cfg, ex, scale_s, scale_dp, fmt_s="e4m3", fmt_dp="e5m2"):
    """dQ, dK, dV (before their own quantization), dAlpha [hq] (or None) and amax_dP, from the
    decoded O and dO and the stored float32 lse (as float64)."""
    hq, hkv = q.shape[2], k.shape[2]
    z, _ = logits(q, k, cfg, ex)
    p = _probs(z, lse)
    drop = _drop(cfg, ex)
    pq = qdq(p * drop, scale_s, fmt_s)
    dp = np.einsum("bihd,bjhd->bhij", do, _expand_kv(v, hq))
    big_d = np.einsum("bihd,bihd->bhi", do, o)
    ds = cfg.scale * (p * (dp * drop - big_d[..., None]))
    dsq = qdq(ds, scale_dp, fmt_dp)

    def group_sum(x):  # [b, skv, hq, d] -> [b, skv, hkv, d]
        return x.reshape(x.shape[0], x.shape[1], hkv, hq // hkv, x.shape[3]).sum(3)

    dq = np.einsum("bhij,bjhd->bihd", dsq, _expand_kv(k, hq))
    dk = group_sum(np.einsum("bhij,bihd->bjhd", dsq, q))
    dv = group_sum(np.einsum("bhij,bihd->bjhd", pq, do))
    dalpha = None
    sink = _sink(cfg, ex, hq)
    if sink is not None:
        fin = np.isfinite(lse)
        psink = np.where(fin, np.exp(sink[None, :, None] - np.where(fin, lse, 0.0)), 0.0)
        dalpha = -(psink * big_d).sum((0, 2))
    return dq, dk, dv, dalpha, amax_f32(ds)
