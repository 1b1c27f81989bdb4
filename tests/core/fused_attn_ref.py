"""Float64 numpy references for fused attention (fused_attn.h): the visible-key rule, ALiBi,
the Philox dropout mask, forward (O, softmax statistics, max logit) and backward by explicit
formulas. Everything works on canonical padded arrays: q [b, sq, hq, d], k/v [b, skv, hkv, d],
with per-sequence lengths; test_fused_attn.py maps the layouts onto them."""
from dataclasses import dataclass
from typing import Optional

import numpy as np

U32 = 0xFFFFFFFF


@dataclass
class AttnCfg:
    scale: float = 1.0
    causal: bool = False
    bottom_right: bool = False
    wl: int = -1
    wr: int = -1
    bias_type: str = "no_bias"  # no_bias, pre, post, alibi
    softmax: str = "vanilla"    # vanilla, off_by_one, learnable
    dropout: float = 0.0


@dataclass
class AttnExtras:
    lens_q: np.ndarray
    lens_kv: np.ndarray
    bias: Optional[np.ndarray] = None    # [1 or b, 1 or hq, sq, skv]
    slopes: Optional[np.ndarray] = None  # [1 or b, hq] (ALiBi)
    alpha: Optional[np.ndarray] = None   # [hq] sink logits (off_by_one: zeros)
    keep: Optional[np.ndarray] = None    # bool [b, hq, sq, skv] dropout keep mask


# ------------------------------------------------------------------ masks, ALiBi, dropout


def visible(lens_q, lens_kv, sq, skv, cfg):
    """bool [b, sq, skv]: key j visible to query i (fused_attn.h, NVTE_Mask_Type)."""
    i = np.arange(sq)[None, :, None]
    j = np.arange(skv)[None, None, :]
    lq = np.asarray(lens_q)[:, None, None]
    lk = np.asarray(lens_kv)[:, None, None]
    d = i + ((lk - lq) if cfg.bottom_right else 0)
    vis = (i < lq) & (j < lk)
    if cfg.causal:
        vis &= j <= d
    # (as distances: d - wl would overflow int64 for windows near 2^63)
    if cfg.wl >= 0:
        vis &= d - j <= cfg.wl
    if cfg.wr >= 0:
        vis &= j - d <= cfg.wr
    return vis


def default_alibi_slopes(h):
    """TE's default slopes: 2^(-8k/n) for k = 1..n (n: largest power of 2 <= h), then the odd
    powers of 2^(-4/n) for the remaining heads."""
    n = 2 ** int(np.floor(np.log2(h)))
    m = 2.0 ** (-8.0 / n * np.arange(1, n + 1))
    if n < h:
        m = np.concatenate([m, 2.0 ** (-4.0 / n * np.arange(1, 2 * (h - n), 2))])
    return m


def alibi_bias(slopes, lens_q, lens_kv, sq, skv, cfg):
    """[b, hq, sq, skv]: -slope * |i + diag - j|."""
    i = np.arange(sq)[None, :, None]
    j = np.arange(skv)[None, None, :]
    diag = (np.asarray(lens_kv) - np.asarray(lens_q))[:, None, None] if cfg.bottom_right else 0
    dist = np.abs(i + diag - j).astype(np.float64)  # [b, sq, skv]
    return -np.asarray(slopes, np.float64)[:, :, None, None] * dist[:, None]


def philox4x32_10(ctr, key):
    """Philox-4x32-10 on uint64 arrays holding 32-bit words; returns the 4 output words."""
    c = [np.asarray(x, np.uint64) & np.uint64(U32) for x in ctr]
    k0, k1 = np.uint64(key[0] & U32), np.uint64(key[1] & U32)
    m0, m1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
    s32, mask = np.uint64(32), np.uint64(U32)
    for _ in range(10):
        p0, p1 = m0 * c[0], m1 * c[2]
        c = [(p1 >> s32) ^ c[1] ^ k0, p1 & mask, (p0 >> s32) ^ c[3] ^ k1, p0 & mask]
        k0 = (k0 + np.uint64(0x9E3779B9)) & mask
        k1 = (k1 + np.uint64(0xBB67AE85)) & mask
    return c


def dropout_keep(seed, offset, p, b, hq, sq, skv):
    """bool [b, hq, sq, skv]: element kept when draw >= p * 2^32, draw = word (j mod 4) of
    Philox(counter (j / 4, i, b * hq + h, offset low), key (seed low, seed high ^ offset high))."""
    bb, hh, ii, jj = np.meshgrid(np.arange(b), np.arange(hq), np.arange(sq), np.arange(skv),
                                 indexing="ij")
    ctr = (jj >> 2, ii, bb * hq + hh, np.full(jj.shape, offset & U32))
    words = np.stack(philox4x32_10(ctr, (seed & U32, (seed >> 32) ^ (offset >> 32))))
    draw = np.take_along_axis(words, (jj & 3)[None].astype(np.int64), axis=0)[0]
    threshold = min(int(float(np.float32(p)) * 2.0**32), U32)
    return draw >= np.uint64(threshold)


# ------------------------------------------------------------------ forward and backward


def _expand_kv(x, hq):
    return np.repeat(x, hq // x.shape[2], axis=2)


def logits(q, k, cfg, ex):
    """z [b, hq, sq, skv] (-inf where not visible) and the visible mask [b, 1, sq, skv]."""
    b, sq, hq, _ = q.shape
    skv = k.shape[1]
    z = np.einsum("bihd,bjhd->bhij", q, _expand_kv(k, hq))
    if cfg.bias_type == "pre":
        z = cfg.scale * (z + ex.bias)
    elif cfg.bias_type == "post":
        z = cfg.scale * z + ex.bias
    elif cfg.bias_type == "alibi":
        slopes = ex.slopes if ex.slopes is not None else default_alibi_slopes(hq)[None]
        z = cfg.scale * z + alibi_bias(slopes, ex.lens_q, ex.lens_kv, sq, skv, cfg)
    else:
        z = cfg.scale * z
    vis = visible(ex.lens_q, ex.lens_kv, sq, skv, cfg)[:, None]
    return np.where(vis, z, -np.inf), vis


def _sink(cfg, ex, hq):
    if cfg.softmax == "vanilla":
        return None
    return np.zeros(hq) if cfg.softmax == "off_by_one" else np.asarray(ex.alpha, np.float64)


def _drop(cfg, ex):
    return 1.0 if ex.keep is None else ex.keep / (1.0 - float(np.float32(cfg.dropout)))


def _probs(z, lse):
    finite = np.isfinite(lse)
    return np.where(finite[..., None], np.exp(z - np.where(finite, lse, 0.0)[..., None]), 0.0)


def fused_attn_ref(q, k, v, cfg, ex):
    """O [b, sq, hq, dv], lse [b, hq, sq] (-inf past the sequence length and for rows with
    neither a key nor a sink), max logit [b, hq, sq] (-inf for rows without keys)."""
    hq = q.shape[2]
    z, _ = logits(q, k, cfg, ex)
    mx = z.max(axis=-1, initial=-np.inf)
    sink = _sink(cfg, ex, hq)
    m = mx if sink is None else np.maximum(mx, sink[None, :, None])
    finite = np.isfinite(m)
    ms = np.where(finite, m, 0.0)
    total = np.exp(z - ms[..., None]).sum(-1)
    if sink is not None:
        total = total + np.exp(sink[None, :, None] - ms)
    with np.errstate(divide="ignore"):
        lse = np.where(finite, ms + np.log(total), -np.inf)
    # Positions past a sequence's length are not rows at all: no statistics (sink or not).
    past = np.arange(q.shape[1])[None, None, :] >= np.asarray(ex.lens_q)[:, None, None]
    lse = np.where(past, -np.inf, lse)
    p = _probs(z, lse) * _drop(cfg, ex)
    o = np.einsum("bhij,bjhd->bihd", p, _expand_kv(v, hq))
    return o, lse, mx


def fused_attn_bwd_ref(q, k, v, o, do, lse, cfg, ex, bias_shape=None):
    """dQ, dK, dV, dBias (summed to bias_shape) and dAlpha [hq] from the forward's O and lse."""
    hq, hkv = q.shape[2], k.shape[2]
    z, _ = logits(q, k, cfg, ex)
    p = _probs(z, lse)
    drop = _drop(cfg, ex)
    dp = np.einsum("bihd,bjhd->bhij", do, _expand_kv(v, hq)) * drop
    big_d = np.einsum("bihd,bihd->bhi", do, o)
    ds = p * (dp - big_d[..., None])
    dq = cfg.scale * np.einsum("bhij,bjhd->bihd", ds, _expand_kv(k, hq))

    def group_sum(x):  # [b, skv, hq, d] -> [b, skv, hkv, d]
        return x.reshape(x.shape[0], x.shape[1], hkv, hq // hkv, x.shape[3]).sum(3)

    dk = group_sum(cfg.scale * np.einsum("bhij,bihd->bjhd", ds, q))
    dv = group_sum(np.einsum("bhij,bihd->bjhd", p * drop, do))
    dbias = None
    if bias_shape is not None:
        dbias = ds * (cfg.scale if cfg.bias_type == "pre" else 1.0)
        if bias_shape[0] == 1:
            dbias = dbias.sum(0, keepdims=True)
        if bias_shape[1] == 1:
            dbias = dbias.sum(1, keepdims=True)
    dalpha = None
    sink = _sink(cfg, ex, hq)
    if sink is not None:
        psink = np.where(np.isfinite(lse), np.exp(sink[None, :, None] - np.where(np.isfinite(lse), lse, 0)), 0)
        dalpha = -(psink * big_d).sum((0, 2))
    return dq, dk, dv, dbias, dalpha
