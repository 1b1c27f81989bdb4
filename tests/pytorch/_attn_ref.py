"""float64 reference of attention over packed (THD) sequences, forward and backward written out by
hand so that FP8 attention's quantization points (fused_attn.h, "FP8 attention"; the numpy
reference tests/core/fused_attn_fp8_ref.py) can be emulated where they happen.

Inputs are CPU tensors in THD form: q [t_q, h, d], k [t_kv, g, d], v [t_kv, g, d_v], dO [t_q, h, d_v];
seqs lists (q_offset, q_len, kv_offset, kv_len) per sequence. Rows outside every sequence (THD
gaps) get O = 0 and zero gradients. bshd/sbhd inputs are converted with to_thd().

fp8 (None: plain float64 math) is a dict of float32 scales s_qkv, s_s, s_o (forward) and s_do,
s_dp, s_dqkv (backward) and the backward format fmt_bwd ("e4m3" / "e5m2"); each quantization
point is qdq(): fp8(float32(x) * scale) (RNE, saturating) decoded with float32(1 / scale), as the
library does. As in the library, the backward recomputes P from the float32 softmax statistics.
"""
import math

import torch

_FP8 = {"e4m3": (torch.float8_e4m3fn, 448.0), "e5m2": (torch.float8_e5m2, 57344.0)}


def qdq(x, scale, fmt):
    """The float64 value x takes after FP8 quantization with `scale` and decoding."""
    dt, mx = _FP8[fmt]
    s = torch.tensor(float(scale), dtype=torch.float32)
    codes = (x.float() * s).clamp(-mx, mx).to(dt)
    return codes.double() * float(torch.tensor(1.0, dtype=torch.float32) / s)


def amax32(x):
    return float(x.float().abs().max()) if x.numel() else 0.0


def seqs_from_cu(cu_q, cu_kv, pad_q=None, pad_kv=None):
    pq = cu_q if pad_q is None else pad_q
    pkv = cu_kv if pad_kv is None else pad_kv
    return [(int(pq[i]), int(cu_q[i + 1] - cu_q[i]), int(pkv[i]), int(cu_kv[i + 1] - cu_kv[i]))
            for i in range(len(cu_q) - 1)]


def to_thd(x, fmt):
    """bshd / sbhd [.., h, d] -> thd [b*s, h, d] (sequence after sequence)."""
    if fmt == "sbhd":
        x = x.transpose(0, 1)
    return x.reshape(-1, *x.shape[2:])


def from_thd(x, fmt, b):
    x = x.reshape(b, -1, *x.shape[1:])
    return x.transpose(0, 1) if fmt == "sbhd" else x


def _mask(lq, lkv, mask_type):
    i = torch.arange(lq).view(lq, 1)
    j = torch.arange(lkv).view(1, lkv)
    if "causal" not in mask_type:
        return torch.zeros(lq, lkv, dtype=torch.bool)
    diag = lkv - lq if mask_type.endswith("bottom_right") else 0
    return j > i + diag


def dpa_thd_ref(q, k, v, seqs, mask_type, scale, do=None, fp8=None):
    """(O [t_q, h, d_v], (dQ, dK, dV) or None, amaxes dict) in float64."""
    q, k, v = (t.detach().double().cpu() for t in (q, k, v))
    h, g, dv_ = q.shape[1], k.shape[1], v.shape[2]
    rep = h // g
    qq = (lambda x, key, fmt="e4m3": qdq(x, fp8[key], fmt)) if fp8 else (lambda x, key, fmt=None: x)
    fb = fp8["fmt_bwd"] if fp8 else None
    qt, kt, vt = qq(q, "s_qkv"), qq(k, "s_qkv"), qq(v, "s_qkv")
    out = torch.zeros(q.shape[0], h, dv_, dtype=torch.float64)
    grads = [torch.zeros_like(t) for t in (q, k, v)] if do is not None else None
    am = {"qkv": max(amax32(q), amax32(k), amax32(v)), "s": 0.0, "o": 0.0, "do": 0.0, "dp": 0.0, "dqkv": 0.0}
    dot = None
    if do is not None:
        do = do.detach().double().cpu()
        am["do"] = amax32(do)
        dot = qq(do, "s_do", fb)
    parts = []
    for oq, lq, okv, lkv in seqs:
        Q = qt[oq:oq + lq].transpose(0, 1)                                    # [h, lq, d]
        K = kt[okv:okv + lkv].repeat_interleave(rep, 1).transpose(0, 1)       # [h, lkv, d]
        V = vt[okv:okv + lkv].repeat_interleave(rep, 1).transpose(0, 1)
        z = (scale * (Q @ K.transpose(1, 2))).masked_fill(_mask(lq, lkv, mask_type), -math.inf)
        lse = torch.logsumexp(z, -1, keepdim=True) if lkv else torch.full((h, lq, 1), -math.inf, dtype=torch.float64)
        fin = torch.isfinite(lse)
        p = torch.where(fin, torch.exp(z - torch.where(fin, lse, 0.0)), 0.0)
        if fp8:  # cuDNN's flash kernel quantizes exp(z - row max) and divides by the row sum after P V
            m = torch.where(fin, z.amax(-1, keepdim=True), 0.0)
            u = torch.where(fin, torch.exp(z - m), 0.0)
            am["s"] = max(am["s"], amax32(u))
            o = (qq(u, "s_s") @ V) / torch.where(fin, torch.exp(lse - m), 1.0)
        else:
            o = p @ V
        am["o"] = max(am["o"], amax32(o))
        ot = qq(o, "s_o")
        out[oq:oq + lq] = ot.transpose(0, 1)
        parts.append((oq, lq, okv, lkv, Q, K, V, z, lse, ot))
    if do is None:
        return out, None, am
    dg = []
    for oq, lq, okv, lkv, Q, K, V, z, lse, ot in parts:
        if fp8:  # the backward's P comes from the float32 statistics
            lse = lse.float().double()
        fin = torch.isfinite(lse)
        p = torch.where(fin, torch.exp(z - torch.where(fin, lse, 0.0)), 0.0)
        dO = dot[oq:oq + lq].transpose(0, 1)                                  # [h, lq, dv]
        big_d = (dO * ot).sum(-1, keepdim=True)
        ds = scale * p * (dO @ V.transpose(1, 2) - big_d)
        am["dp"] = max(am["dp"], amax32(ds))
        dst = qq(ds, "s_dp", fb)
        dq = (dst @ K).transpose(0, 1)
        dk = (dst.transpose(1, 2) @ Q).transpose(0, 1).reshape(lkv, g, rep, Q.shape[-1]).sum(2)
        dv = (qq(p, "s_s").transpose(1, 2) @ dO).transpose(0, 1).reshape(lkv, g, rep, dv_).sum(2)
        dg.append((oq, lq, okv, lkv, dq, dk, dv))
    for oq, lq, okv, lkv, dq, dk, dv in dg:  # K/V rows of one sequence are disjoint from the others
        grads[0][oq:oq + lq] += dq
        grads[1][okv:okv + lkv] += dk
        grads[2][okv:okv + lkv] += dv
    am["dqkv"] = max(amax32(x) for x in grads)
    if fp8:
        grads = [qq(x, "s_dqkv", fb) for x in grads]
    return out, grads, am
