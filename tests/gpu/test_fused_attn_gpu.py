"""Fused attention on the CUDA backend (cuDNN SDPA) against the CPU backend and float64.

Tolerance (flash-attention's rule): the CUDA result's largest error against a float64
reference must be at most 2x the error of a naive same-precision implementation (torch on the
GPU: scores, softmax and products in the input dtype) plus a small floor. The CPU backend is
the oracle too: its result (float64 accumulation, rounded once) is within one output ulp of
the float64 reference, so the same bound holds against it. Padded positions must be zero in
O and in the gradients. Dropout (different random streams on the two backends) is checked for
determinism per rng_state and for its keep rate.

FP8 attention (the second half of this file) has its own rule, stated above its tests: FP8
codes of the CUDA result against the CPU backend's FP8 reference within one or two FP8 steps,
amax to a small relative tolerance, scale_inv exact, and an FP8-level check against float64."""
import math

import pytest
import torch

from transformer_engine import _nvte as nvte

from gpu_util import T

L, M, BT, ST = nvte.NVTE_QKV_Layout, nvte.NVTE_Mask_Type, nvte.NVTE_Bias_Type, nvte.NVTE_Softmax_Type
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def mask_enum(name):
    return M.NVTE_NO_MASK if name == "no_mask" else getattr(M, "NVTE_" + name.upper() + "_MASK")


class Case:
    def __init__(self, layout="NVTE_BSHD_BSHD_BSHD", dtype="bfloat16", b=2, sq=64, skv=64, hq=4, hkv=4, d=64,
                 dv=None, mask="no_mask", bias=False, dropout=0.0, lens_q=None, lens_kv=None, seed=0):
        self.layout, self.dtype, self.b, self.sq, self.skv = layout, dtype, b, sq, skv
        self.hq, self.hkv, self.d, self.dv, self.mask, self.bias = hq, hkv, d, dv or d, mask, bias
        self.dropout, self.lens_q, self.lens_kv, self.seed = dropout, lens_q, lens_kv, seed
        self.fmt = "sbhd" if layout.startswith("NVTE_SB") else "bshd"
        tail = layout.split("_")[-1].lower()
        self.group = next((g for g in ("3hd", "h3d", "2hd", "h2d") if tail.endswith(g)), "sep")


def to_layout(c, canon, dev, dt=None):
    """canonical [b, s, h, d] float64 tensors (q, k, v) -> three (possibly strided) tensors in
    the case's layout on dev, plus the buffers that own them (dt: element type, default the
    case's; torch.uint8 for FP8 codes)."""
    dt = dt or DTYPES[c.dtype]
    def rows(x):  # [b, s, h, d] -> bshd or sbhd order
        return (x if c.fmt == "bshd" else x.transpose(0, 1)).to(dt).to(dev)
    q, k, v = (rows(x) for x in canon)
    if c.group in ("3hd", "h3d"):
        buf = torch.stack([q, k, v], 2 if c.group == "3hd" else 3).contiguous()
        views = [buf.select(2 if c.group == "3hd" else 3, r) for r in range(3)]
        return views, [buf]
    if c.group in ("2hd", "h2d"):
        kv = torch.stack([k, v], 2 if c.group == "2hd" else 3).contiguous()
        q = q.contiguous()
        return [q] + [kv.select(2 if c.group == "2hd" else 3, r) for r in range(2)], [q, kv]
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    return [q, k, v], [q, k, v]


def handle(x, dtype):
    """nvte.Tensor over a (possibly strided) torch view: its first element and logical shape."""
    t = nvte.Tensor()
    t.set_param(nvte.Param.kRowwiseData, x.data_ptr(), list(x.shape), dtype)
    t._refs = x
    return t


def nv_dtype(c):
    return nvte.DType.kBFloat16 if c.dtype == "bfloat16" else nvte.DType.kFloat16


def lengths(c):
    padded = c.mask.startswith("padding")
    lq = c.lens_q or ([c.sq] * c.b)
    lkv = c.lens_kv or ([c.skv] * c.b)
    cu = lambda ls: torch.tensor([0] + list(torch.tensor(ls).cumsum(0)), dtype=torch.int32)
    return padded, lq, lkv, cu(lq), cu(lkv)


def scalars(c):
    return dict(max_seqlen_q=c.sq, max_seqlen_kv=c.skv, attn_scale=1.0 / math.sqrt(c.d), dropout=c.dropout,
                qkv_layout=getattr(L, c.layout), bias_type=BT.NVTE_POST_SCALE_BIAS if c.bias else BT.NVTE_NO_BIAS,
                attn_mask_type=mask_enum(c.mask), softmax_type=ST.NVTE_VANILLA_SOFTMAX, window_size_left=-1,
                window_size_right=-1, bottom_right_diagonal=False)


def run(c, dev, q, k, v, do, bias, rng_state, backward=True):
    """Forward (+ backward) on one backend. Returns canonical float64 O, dQ, dK, dV (CPU)."""
    nd = nv_dtype(c)
    (tq, tk, tv), keep = to_layout(c, (q, k, v), dev)
    padded, lq, lkv, cuq, cukv = lengths(c)
    o_shape = (c.b, c.sq, c.hq, c.dv) if c.fmt == "bshd" else (c.sq, c.b, c.hq, c.dv)
    o = torch.full(o_shape, float("nan"), dtype=DTYPES[c.dtype], device=dev)
    bias_t = bias.to(DTYPES[c.dtype]).to(dev).contiguous() if bias is not None else None
    side = dict(Bias=T(bias_t).t if bias_t is not None else None,
                cu_seqlens_q=T(cuq.to(dev)).t if padded else None, cu_seqlens_kv=T(cukv.to(dev)).t if padded else None)
    rng = T(rng_state.to(dev)).t
    H = [handle(x, nd) for x in (tq, tk, tv)]
    sc = scalars(c)
    ws_f = nvte.fused_attn_fwd_workspace_size(*H, side["Bias"], c.sq, c.skv, True, False, c.dropout,
                                               sc["qkv_layout"], sc["bias_type"], sc["attn_mask_type"],
                                               sc["softmax_type"])
    wsf = torch.empty(max(ws_f, 1), dtype=torch.uint8, device=dev)
    kw = dict(**side, SoftmaxOffset=None, S=None, cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None,
              page_table_k=None, page_table_v=None, rng_state=rng, is_training=True, return_max_logit=False,
              cuda_graph=False, workspace=T(wsf).t, **sc)
    ot = handle(o, nd)
    described = nvte.fused_attn_fwd(*H, O=ot, aux=[], **kw)
    aux_bufs = [torch.zeros(shape, dtype={nvte.DType.kFloat32: torch.float32, nvte.DType.kInt64: torch.int64}.get(
        dt, DTYPES[c.dtype]), device=dev) for shape, dt in described]
    aux = [handle(a, dt) for a, (_, dt) in zip(aux_bufs, described)]
    nvte.fused_attn_fwd(*H, O=ot, aux=aux, **kw)
    canon = lambda x: (x if c.fmt == "bshd" else x.transpose(0, 1)).double().cpu()
    res = {"o": canon(o)}
    if backward:
        dO = (do if c.fmt == "bshd" else do.transpose(0, 1)).to(DTYPES[c.dtype]).to(dev).contiguous()
        nanq = torch.full_like(q, float("nan"))
        (gq, gk, gv), gkeep = to_layout(c, (nanq, torch.full_like(k, float("nan")), torch.full_like(v, float("nan"))),
                                        dev)
        G = [handle(x, nd) for x in (gq, gk, gv)]
        db = torch.full_like(bias_t, float("nan")) if bias_t is not None else None
        ws_b = nvte.fused_attn_bwd_workspace_size(*H, T(db).t if db is not None else None, c.sq, c.skv, c.dropout,
                                                   sc["qkv_layout"], sc["bias_type"], sc["attn_mask_type"],
                                                   sc["softmax_type"])
        wsb = torch.empty(max(ws_b, 1), dtype=torch.uint8, device=dev)
        nvte.fused_attn_bwd(*H, ot, handle(dO, nd), None, None, aux, *G, T(db).t if db is not None else None, None,
                            side["cu_seqlens_q"], side["cu_seqlens_kv"], None, None, deterministic=True,
                            cuda_graph=False, workspace=T(wsb).t, **sc)
        res.update(dq=canon(gq), dk=canon(gk), dv=canon(gv), dbias=db.double().cpu() if db is not None else None)
    if dev == "cuda":
        torch.cuda.synchronize()
    return res


def visible(c, dev="cpu"):
    """[b, 1, sq, skv] bool: which keys each query sees (padding and causal rules)."""
    padded, lq, lkv, _, _ = lengths(c)
    allowed = torch.ones(c.b, 1, c.sq, c.skv, dtype=torch.bool, device=dev)
    i = torch.arange(c.sq, device=dev)[:, None]
    j = torch.arange(c.skv, device=dev)[None, :]
    for bi in range(c.b):
        a = torch.ones(c.sq, c.skv, dtype=torch.bool, device=dev)
        if padded:
            a &= (i < lq[bi]) & (j < lkv[bi])
        if "causal" in c.mask:
            diag = (lkv[bi] - lq[bi]) if "bottom_right" in c.mask else 0
            a &= j <= i + diag
        allowed[bi, 0] = a
    return allowed


def reference(c, q, k, v, do, bias, dtype=torch.float64, dev="cpu"):
    """Attention in `dtype` with torch autograd: float64 reference or the naive low-precision one."""
    padded, lq, lkv, _, _ = lengths(c)
    leaf = lambda x: x.detach().to(dtype).to(dev).clone().requires_grad_(True)  # never the caller's tensor
    qq, kk, vv, dd = (leaf(x) for x in (q, k, v, do))
    bb = leaf(bias) if bias is not None else None
    rep = c.hq // c.hkv
    kx, vx = kk.repeat_interleave(rep, 2), vv.repeat_interleave(rep, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", qq, kx) * (1.0 / math.sqrt(c.d))
    if bb is not None:
        s = s + bb
    allowed = visible(c, dev)
    s = s.masked_fill(~allowed, float("-inf"))
    p = torch.softmax(s.float() if dtype != torch.float64 else s, -1).to(dtype)
    p = torch.nan_to_num(p, 0.0)  # fully masked rows
    o = torch.einsum("bhqk,bkhd->bqhd", p, vx)
    o.backward(dd)
    out = {"o": o.detach().double().cpu(), "dq": qq.grad.double().cpu(), "dk": kk.grad.double().cpu(),
           "dv": vv.grad.double().cpu()}
    out["dbias"] = bb.grad.double().cpu() if bb is not None else None
    return out


def inputs(c):
    g = torch.Generator().manual_seed(c.seed)
    q = torch.randn(c.b, c.sq, c.hq, c.d, generator=g, dtype=torch.float64)
    k = torch.randn(c.b, c.skv, c.hkv, c.d, generator=g, dtype=torch.float64)
    v = torch.randn(c.b, c.skv, c.hkv, c.dv, generator=g, dtype=torch.float64)
    do = torch.randn(c.b, c.sq, c.hq, c.dv, generator=g, dtype=torch.float64)
    dt = DTYPES[c.dtype]
    q, k, v, do = (x.to(dt).double() for x in (q, k, v, do))  # exactly representable inputs
    bias = torch.randn(1, c.hq, c.sq, c.skv, generator=g, dtype=torch.float64).to(dt).double() if c.bias else None
    return q, k, v, do, bias


def zero_padding(c, r):
    """Padded positions carry no information: compare them as zeros on every side."""
    padded, lq, lkv, _, _ = lengths(c)
    if not padded:
        return r
    for bi in range(c.b):
        for key in ("o", "dq"):
            if r.get(key) is not None:
                r[key][bi, lq[bi]:] = 0
        for key in ("dk", "dv"):
            if r.get(key) is not None:
                r[key][bi, lkv[bi]:] = 0
    return r


def check(c, backward=True):
    q, k, v, do, bias = inputs(c)
    rng_state = torch.tensor([123, 0], dtype=torch.int64)
    got = run(c, "cuda", q, k, v, do, bias, rng_state, backward)
    cpu = run(c, "cpu", q, k, v, do, bias, rng_state, backward)
    ref = zero_padding(c, reference(c, q, k, v, do, bias))
    naive = zero_padding(c, reference(c, q, k, v, do, bias, DTYPES[c.dtype], "cuda"))
    padded, lq, lkv, _, _ = lengths(c)
    keys = ["o"] + (["dq", "dk", "dv"] + (["dbias"] if bias is not None else []) if backward else [])
    for key in keys:
        g = got[key]
        assert not torch.isnan(g).any(), f"{key}: NaN in the CUDA result (unwritten or poisoned element)"
        if padded and key != "dbias":
            # Padded positions are written as zeros by the CUDA backend.
            for bi in range(c.b):
                tail = g[bi, (lq if key in ("o", "dq") else lkv)[bi]:]
                assert (tail == 0).all(), f"{key}: padded positions of batch {bi} are not zero"
        err = (g - ref[key]).abs().max().item()
        err_naive = (naive[key] - ref[key]).abs().max().item()
        err_cpu = (cpu[key] - ref[key]).abs().max().item()
        scale = ref[key].abs().max().item()
        bound = 2.0 * err_naive + 1e-3 * scale + 1e-6
        assert err <= bound, f"{key}: CUDA error {err:.3g} > 2 x naive {err_naive:.3g} (+floor); CPU {err_cpu:.3g}"
        assert (g - cpu[key]).abs().max().item() <= bound + err_cpu, f"{key}: CUDA vs CPU backend beyond the bound"


LAYOUTS = ["NVTE_BSHD_BSHD_BSHD", "NVTE_SBHD_SBHD_SBHD", "NVTE_BS3HD", "NVTE_SB3HD", "NVTE_BSH3D",
           "NVTE_BSHD_BS2HD", "NVTE_SBHD_SBH2D"]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_layouts(layout, dtype):
    check(Case(layout=layout, dtype=dtype, sq=80, skv=80, mask="causal"))


@pytest.mark.parametrize("mask", ["no_mask", "causal", "padding", "padding_causal", "causal_bottom_right",
                                  "padding_causal_bottom_right"])
def test_masks(mask):
    padded = mask.startswith("padding")
    check(Case(mask=mask, sq=48, skv=72, lens_q=[48, 17] if padded else None, lens_kv=[72, 30] if padded else None))


@pytest.mark.parametrize("hq,hkv", [(8, 2), (8, 1)])
def test_gqa_mqa(hq, hkv):
    check(Case(hq=hq, hkv=hkv, sq=96, skv=96, mask="causal"))


@pytest.mark.parametrize("d", [64, 128])
def test_head_dims_and_odd_lengths(d):
    check(Case(d=d, sq=77, skv=77, b=3))


def test_post_scale_bias():
    check(Case(bias=True, sq=64, skv=64))


def test_inference_forward_only():
    check(Case(mask="causal"), backward=False)


def test_dropout_deterministic_per_rng_state():
    c = Case(dropout=0.25, sq=128, skv=128)
    q, k, v, do, bias = inputs(c)
    a = run(c, "cuda", q, k, v, do, bias, torch.tensor([7, 0], dtype=torch.int64))
    b = run(c, "cuda", q, k, v, do, bias, torch.tensor([7, 0], dtype=torch.int64))
    d = run(c, "cuda", q, k, v, do, bias, torch.tensor([7, 4096], dtype=torch.int64))
    for key in ("o", "dq", "dk", "dv"):
        assert torch.equal(a[key], b[key]), f"{key}: same rng_state gave different results"
        assert not torch.isnan(a[key]).any()
    assert not torch.equal(a["o"], d["o"]), "a different offset must draw a different dropout mask"
    # The expectation over masks is attention without dropout: the mean over many offsets approaches it.
    no = run(Case(sq=128, skv=128), "cuda", q, k, v, do, bias, torch.tensor([0, 0]), backward=False)["o"]
    mean = sum(run(c, "cuda", q, k, v, do, bias, torch.tensor([7, 4096 * i]), backward=False)["o"]
               for i in range(32)) / 32
    assert (mean - no).abs().mean() < 0.25 * no.abs().mean()


def test_unsupported_config_is_a_clear_error():
    c = Case(dtype="bfloat16")
    q, k, v, do, bias = inputs(c)
    (tq, tk, tv), keep = to_layout(c, (q, k, v), "cuda")
    H = [handle(x, nv_dtype(c)) for x in (tq, tk, tv)]
    sc = scalars(c)
    sc["bias_type"] = BT.NVTE_PRE_SCALE_BIAS
    bias_t = torch.zeros(1, c.hq, c.sq, c.skv, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(nvte.Error, match="pre-scale bias"):
        nvte.fused_attn_fwd_workspace_size(*H, T(bias_t).t, c.sq, c.skv, True, False, 0.0, sc["qkv_layout"],
                                           sc["bias_type"], sc["attn_mask_type"], sc["softmax_type"])


# ------------------------------------------------------------------ THD (packed sequences)
#
# THD layouts (fused_attn.h: Q/K/V [t, h, d], lengths from cu_seqlens, token offsets from
# cu_seqlens_*_padded, gaps between sequences and unused tokens at the end) against the CPU
# backend and float64 with check()'s rule per output: error vs float64 <= 2x the naive
# same-precision error (+ floor), CUDA vs CPU within that bound plus the CPU's own error. Every
# output (O, the statistics, dQ, dK, dV) starts as NaN: each element must be written, rows of
# gaps and unused tokens as 0; statistics -inf past a sequence's length and for rows that see no
# key, and within 1e-3 of the CPU's elsewhere (float32 log-sum-exp of the same logits).

THD_GROUP = {"NVTE_T3HD": "3hd", "NVTE_TH3D": "h3d", "NVTE_THD_T2HD": "2hd", "NVTE_THD_TH2D": "h2d"}


class ThdCase:
    def __init__(self, layout="NVTE_THD_THD_THD", dtype="bfloat16", hq=4, hkv=4, d=64, dv=None, mask="padding",
                 lens_q=(37, 1, 64, 20), lens_kv=None, gaps_q=None, gaps_kv=None, tail_q=0, tail_kv=0,
                 max_sq=None, max_skv=None, dropout=0.0, seed=0):
        self.layout, self.dtype, self.hq, self.hkv, self.d, self.dv = layout, dtype, hq, hkv, d, dv or d
        self.mask, self.dropout, self.seed = mask, dropout, seed
        self.group = THD_GROUP.get(layout, "sep")
        self.lens_q = list(lens_q)
        self.lens_kv = list(lens_kv) if lens_kv is not None else list(lens_q)
        self.b = len(self.lens_q)
        self.gaps_q = list(gaps_q) if gaps_q is not None else [0] * self.b
        self.gaps_kv = list(gaps_kv) if gaps_kv is not None else list(self.gaps_q)
        self.off_q, self.tq = self._place(self.lens_q, self.gaps_q, tail_q)
        self.off_kv, self.tkv = self._place(self.lens_kv, self.gaps_kv, tail_kv)
        self.sq = max_sq or max(max(self.lens_q), 1)
        self.skv = max_skv or max(max(self.lens_kv), 1)
        self.padded = any(self.gaps_q) or any(self.gaps_kv) or tail_q or tail_kv

    @staticmethod
    def _place(lens, gaps, tail):
        offs, t = [], 0
        for n, g in zip(lens, gaps):
            t += g
            offs.append(t)
            t += n
        return offs, t + tail


def thd_inputs(c):
    g = torch.Generator().manual_seed(c.seed)
    dt = DTYPES[c.dtype]
    draw = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64).to(dt).double()
    # gap and tail tokens hold finite values too: they must not leak into any result
    return draw(c.tq, c.hq, c.d), draw(c.tkv, c.hkv, c.d), draw(c.tkv, c.hkv, c.dv), draw(c.tq, c.hq, c.dv)


def thd_layout(c, canon, dev):
    """[t, h, d] float64 (q, k, v) -> three (possibly strided) tensors in the case's layout on dev."""
    q, k, v = (x.to(DTYPES[c.dtype]).to(dev) for x in canon)
    if c.group in ("3hd", "h3d"):
        dim = 1 if c.group == "3hd" else 2
        buf = torch.stack([q, k, v], dim).contiguous()
        return [buf.select(dim, r) for r in range(3)], [buf]
    if c.group in ("2hd", "h2d"):
        dim = 1 if c.group == "2hd" else 2
        kv = torch.stack([k, v], dim).contiguous()
        q = q.contiguous()
        return [q] + [kv.select(dim, r) for r in range(2)], [q, kv]
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    return [q, k, v], [q, k, v]


def thd_cu(c, dev):
    cu = lambda ls: torch.tensor([0] + list(torch.tensor(ls, dtype=torch.int64).cumsum(0)), dtype=torch.int32)
    pad = lambda offs, t: torch.tensor(offs + [t], dtype=torch.int32)
    side = dict(cu_seqlens_q=cu(c.lens_q), cu_seqlens_kv=cu(c.lens_kv), cu_seqlens_q_padded=None,
                cu_seqlens_kv_padded=None)
    if c.padded:
        side.update(cu_seqlens_q_padded=pad(c.off_q, c.tq), cu_seqlens_kv_padded=pad(c.off_kv, c.tkv))
    keep = {n: x.to(dev) for n, x in side.items() if x is not None}
    return {n: (T(keep[n]).t if n in keep else None) for n in side}, keep


def thd_scalars(c):
    sc = scalars(Case(dtype=c.dtype, sq=c.sq, skv=c.skv, d=c.d, mask=c.mask, dropout=c.dropout))
    sc["qkv_layout"] = getattr(L, c.layout)
    return sc


def run_thd(c, dev, q, k, v, do, rng_state, backward=True, training=True):
    """Forward (+ backward) on one backend: O, statistics, dQ, dK, dV as float64 [t, h, d] (CPU)."""
    nd = nv_dtype(c)
    (tq, tk, tv), keep = thd_layout(c, (q, k, v), dev)
    side, cu_keep = thd_cu(c, dev)
    H = [handle(x, nd) for x in (tq, tk, tv)]
    sc = thd_scalars(c)
    ws_f = nvte.fused_attn_fwd_workspace_size(*H, None, c.sq, c.skv, training, False, c.dropout, sc["qkv_layout"],
                                               sc["bias_type"], sc["attn_mask_type"], sc["softmax_type"])
    wsf = torch.empty(max(ws_f, 1), dtype=torch.uint8, device=dev)
    o = torch.full((c.tq, c.hq, c.dv), float("nan"), dtype=DTYPES[c.dtype], device=dev)
    ot = handle(o, nd)
    rng = T(rng_state.to(dev)).t
    kw = dict(**side, Bias=None, SoftmaxOffset=None, S=None, page_table_k=None, page_table_v=None, rng_state=rng,
              is_training=training, return_max_logit=False, cuda_graph=False, workspace=T(wsf).t, **sc)
    res = {}
    aux = None
    if training:
        described = nvte.fused_attn_fwd(*H, O=ot, aux=[], **kw)
        f32 = nvte.DType.kFloat32
        aux_bufs = [torch.full(shape, float("nan"), dtype=torch.float32, device=dev) if dt == f32 else
                    torch.zeros(shape, dtype=torch.int64, device=dev) for shape, dt in described]
        aux = [handle(a, dt) for a, (_, dt) in zip(aux_bufs, described)]
        nvte.fused_attn_fwd(*H, O=ot, aux=aux, **kw)
    else:
        nvte.fused_attn_fwd(*H, O=ot, aux=None, **kw)
    res["o"] = o.double().cpu()
    if training:
        res["stats"] = aux_bufs[0].cpu()
    if backward:
        dO = do.to(DTYPES[c.dtype]).to(dev).contiguous()
        nan = lambda x: torch.full_like(x, float("nan"))
        (gq, gk, gv), gkeep = thd_layout(c, (nan(q), nan(k), nan(v)), dev)
        G = [handle(x, nd) for x in (gq, gk, gv)]
        ws_b = nvte.fused_attn_bwd_workspace_size(*H, None, c.sq, c.skv, c.dropout, sc["qkv_layout"], sc["bias_type"],
                                                   sc["attn_mask_type"], sc["softmax_type"])
        wsb = torch.empty(max(ws_b, 1), dtype=torch.uint8, device=dev)
        nvte.fused_attn_bwd(*H, ot, handle(dO, nd), None, None, aux, *G, None, None, side["cu_seqlens_q"],
                            side["cu_seqlens_kv"], side["cu_seqlens_q_padded"], side["cu_seqlens_kv_padded"],
                            deterministic=True, cuda_graph=False, workspace=T(wsb).t, **sc)
        res.update(dq=gq.double().cpu(), dk=gk.double().cpu(), dv=gv.double().cpu())
    if dev == "cuda":
        torch.cuda.synchronize()
    return res


def thd_visible(c, lq, lkv, dev):
    """[lq, lkv] bool of one sequence (THD always has the lengths; the mask type adds causality)."""
    i = torch.arange(lq, device=dev)[:, None]
    j = torch.arange(lkv, device=dev)[None, :]
    a = torch.ones(lq, lkv, dtype=torch.bool, device=dev)
    if "causal" in c.mask:
        a &= j <= i + ((lkv - lq) if "bottom_right" in c.mask else 0)
    return a


def thd_reference(c, q, k, v, do, dtype=torch.float64, dev="cpu"):
    """Per-sequence attention in `dtype` with torch autograd (float64: the reference; the input
    dtype on the GPU: the naive same-precision one). Rows outside every sequence stay 0."""
    leaf = lambda x: x.detach().to(dtype).to(dev).clone().requires_grad_(True)
    qq, kk, vv = leaf(q), leaf(k), leaf(v)
    dd = do.to(dtype).to(dev)
    out = torch.zeros(c.tq, c.hq, c.dv, dtype=dtype, device=dev)
    rep = c.hq // c.hkv
    for oq, lq, okv, lkv in zip(c.off_q, c.lens_q, c.off_kv, c.lens_kv):
        if lq == 0:
            continue
        qs = qq[oq:oq + lq]
        ks, vs = kk[okv:okv + lkv].repeat_interleave(rep, 1), vv[okv:okv + lkv].repeat_interleave(rep, 1)
        s = torch.einsum("qhd,khd->hqk", qs, ks) * (1.0 / math.sqrt(c.d))
        s = s.masked_fill(~thd_visible(c, lq, lkv, dev), float("-inf"))
        p = torch.softmax(s.float() if dtype != torch.float64 else s, -1).to(dtype)
        p = torch.nan_to_num(p, 0.0)  # rows that see no key
        o = torch.einsum("hqk,khd->qhd", p, vs)
        o.backward(dd[oq:oq + lq])
        out[oq:oq + lq] = o.detach()
    grad = lambda x: (x.grad if x.grad is not None else torch.zeros_like(x)).double().cpu()
    return {"o": out.double().cpu(), "dq": grad(qq), "dk": grad(kk), "dv": grad(vv)}


def thd_used(offs, lens, t):
    used = torch.zeros(t, dtype=torch.bool)
    for o, n in zip(offs, lens):
        used[o:o + n] = True
    return used


def check_thd(c, backward=True, training=True):
    q, k, v, do = thd_inputs(c)
    rng_state = torch.tensor([123, 0], dtype=torch.int64)
    got = run_thd(c, "cuda", q, k, v, do, rng_state, backward, training)
    cpu = run_thd(c, "cpu", q, k, v, do, rng_state, backward, training)
    ref = thd_reference(c, q, k, v, do)
    naive = thd_reference(c, q, k, v, do, DTYPES[c.dtype], "cuda")
    used = {"q": thd_used(c.off_q, c.lens_q, c.tq), "kv": thd_used(c.off_kv, c.lens_kv, c.tkv)}
    bad = []
    for key in ["o"] + (["dq", "dk", "dv"] if backward else []):
        g = got[key]
        if torch.isnan(g).any():
            bad.append(f"{key}: {int(torch.isnan(g).sum())} NaN elements (unwritten or computed as NaN)")
            continue
        unused = ~used["q" if key in ("o", "dq") else "kv"]
        if not (g[unused] == 0).all():
            bad.append(f"{key}: rows of gaps / unused tokens are not zero")
        err = (g - ref[key]).abs().max().item()
        err_naive = (naive[key] - ref[key]).abs().max().item()
        err_cpu = (cpu[key] - ref[key]).abs().max().item()
        bound = 2.0 * err_naive + 1e-3 * ref[key].abs().max().item() + 1e-6
        print(f"{key}: CUDA {err:.3g}, naive {err_naive:.3g}, CPU {err_cpu:.3g} (bound {bound:.3g})")
        if err > bound:
            bad.append(f"{key}: CUDA error {err:.3g} > 2 x naive {err_naive:.3g} (+floor); CPU {err_cpu:.3g}")
        if (g - cpu[key]).abs().max().item() > bound + err_cpu:
            bad.append(f"{key}: CUDA vs CPU backend beyond the bound")
    if training:
        gs, cs = got["stats"], cpu["stats"]
        fin = torch.isfinite(cs)
        if torch.isnan(gs).any():
            bad.append(f"statistics: {int(torch.isnan(gs).sum())} NaN elements")
        elif not torch.equal(torch.isfinite(gs), fin) or not (gs[~fin] == cs[~fin]).all():
            bad.append("statistics: -inf entries (padding rows, rows without keys) differ from the CPU's")
        elif fin.any() and (gs[fin] - cs[fin]).abs().max().item() > 1e-3:
            bad.append(f"statistics differ from the CPU's by {(gs[fin] - cs[fin]).abs().max().item():.3g}")
    assert not bad, bad


THD_LAYOUTS = ["NVTE_THD_THD_THD", "NVTE_T3HD", "NVTE_TH3D", "NVTE_THD_T2HD", "NVTE_THD_TH2D"]


@pytest.mark.parametrize("mask", ["padding", "padding_causal"])
@pytest.mark.parametrize("layout", THD_LAYOUTS)
def test_thd_layouts(layout, mask):
    """Lengths 37, 1, 64, 20 with a gap before the second and fourth sequence and unused tokens at
    the end; K/V lengths differ from Q's where the layout keeps them apart."""
    packed = layout in ("NVTE_T3HD", "NVTE_TH3D")
    check_thd(ThdCase(layout=layout, mask=mask, lens_q=[37, 1, 64, 20],
                      lens_kv=None if packed else [50, 1, 64, 9], gaps_q=[0, 3, 0, 5],
                      gaps_kv=None if packed else [2, 0, 4, 1], tail_q=4, tail_kv=4 if packed else 6))


@pytest.mark.parametrize("layout", ["NVTE_THD_THD_THD", "NVTE_THD_T2HD"])
@pytest.mark.parametrize("hq,hkv", [(8, 2), (8, 1)])
def test_thd_gqa(layout, hq, hkv):
    check_thd(ThdCase(layout=layout, hq=hq, hkv=hkv, mask="padding_causal", lens_q=[33, 1, 70],
                      lens_kv=[40, 5, 70], gaps_q=[1, 0, 2], gaps_kv=[0, 3, 0], tail_q=2))


@pytest.mark.parametrize("mask", ["no_mask", "causal", "causal_bottom_right", "padding_causal_bottom_right"])
def test_thd_mask_types(mask):
    """THD always takes its lengths from cu_seqlens: no_mask / causal act as padding /
    padding_causal (the CPU's and TE's rule). Bottom-right with more queries than keys leaves the
    first rows of a sequence without keys: O, dQ zero there and statistics -inf."""
    check_thd(ThdCase(mask=mask, lens_q=[30, 1, 12, 48], lens_kv=[41, 3, 7, 48], gaps_q=[0, 2, 1, 0], tail_q=3))


@pytest.mark.parametrize("mask", ["padding", "padding_causal", "padding_causal_bottom_right"])
def test_thd_empty_sequences(mask):
    """A sequence without keys (its queries see nothing: O = 0, statistics -inf) and one without
    queries (its keys get dK = dV = 0); cuDNN before 9.25 gives NaN rows there."""
    check_thd(ThdCase(mask=mask, lens_q=[12, 5, 0, 9], lens_kv=[16, 0, 7, 9], gaps_q=[0, 1, 1, 0], tail_q=2))


def test_thd_many_runs():
    """max_seqlen far above the token count per sequence: the graph covers fewer sequences than
    the batch has, so one call runs it several times (fused_attn_cudnn.cpp, THD)."""
    lens = [3, 1, 7, 2, 5, 1, 4, 6, 2, 8, 1]
    check_thd(ThdCase(mask="padding_causal", lens_q=lens, gaps_q=[i % 3 for i in range(len(lens))], tail_q=5,
                      max_sq=64, max_skv=64))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("d", [64, 128])
def test_thd_dtypes_head_dims(dtype, d):
    check_thd(ThdCase(layout="NVTE_THD_T2HD", dtype=dtype, d=d, mask="padding_causal", lens_q=[19, 77, 1],
                      gaps_q=[2, 0, 1], tail_q=1, max_sq=96, max_skv=96))


def test_thd_inference_forward_only():
    check_thd(ThdCase(mask="padding_causal", gaps_q=[0, 3, 0, 5], tail_q=4), backward=False, training=False)


def test_thd_inputs_in_gaps_are_never_read():
    """Gap and unused tokens of Q, K, V hold NaN: no result may change (cuDNN reads each sequence's
    rows through its ragged offset only)."""
    c = ThdCase(mask="padding_causal", lens_q=[37, 1, 64, 20], lens_kv=[50, 1, 64, 9], gaps_q=[0, 3, 0, 5],
                gaps_kv=[2, 0, 4, 1], tail_q=4, tail_kv=6)
    q, k, v, do = thd_inputs(c)
    rng_state = torch.tensor([123, 0], dtype=torch.int64)
    clean = run_thd(c, "cuda", q, k, v, do, rng_state)
    unused_q, unused_kv = ~thd_used(c.off_q, c.lens_q, c.tq), ~thd_used(c.off_kv, c.lens_kv, c.tkv)
    q2, k2, v2, do2 = (x.clone() for x in (q, k, v, do))
    for x, unused in ((q2, unused_q), (k2, unused_kv), (v2, unused_kv), (do2, unused_q)):
        x[unused] = float("nan")
    dirty = run_thd(c, "cuda", q2, k2, v2, do2, rng_state)
    for key in ("o", "stats", "dq", "dk", "dv"):
        assert torch.equal(clean[key], dirty[key]), f"{key}: NaN in gap tokens changed the result"


def test_thd_dropout_deterministic_per_rng_state():
    c = ThdCase(mask="padding_causal", dropout=0.25, lens_q=[70, 1, 33, 64], gaps_q=[0, 2, 0, 1], tail_q=3)
    q, k, v, do = thd_inputs(c)
    a = run_thd(c, "cuda", q, k, v, do, torch.tensor([7, 0], dtype=torch.int64))
    b = run_thd(c, "cuda", q, k, v, do, torch.tensor([7, 0], dtype=torch.int64))
    d = run_thd(c, "cuda", q, k, v, do, torch.tensor([7, 4096], dtype=torch.int64))
    unused = ~thd_used(c.off_q, c.lens_q, c.tq)
    for key in ("o", "dq", "dk", "dv"):
        assert torch.equal(a[key], b[key]), f"{key}: same rng_state gave different results"
        assert not torch.isnan(a[key]).any()
    assert (a["o"][unused] == 0).all() and (a["dq"][unused] == 0).all()
    assert not torch.equal(a["o"], d["o"]), "a different offset must draw a different dropout mask"


def test_thd_mixed_layouts_and_bias_are_not_supported():
    """What stays NOT_SUPPORTED on the GPU, with its reason: THD mixed with BSHD/SBHD, and THD with
    a bias. (FP8 THD: test_fp8_thd_is_not_supported below.)"""
    BK = nvte.NVTE_Fused_Attn_Backend
    args = dict(is_training=True, q_dtype=nvte.DType.kBFloat16, kv_dtype=nvte.DType.kBFloat16,
                bias_type=BT.NVTE_NO_BIAS, attn_mask_type=M.NVTE_PADDING_MASK, softmax_type=ST.NVTE_VANILLA_SOFTMAX,
                dropout=0.0, num_attn_heads=4, num_gqa_groups=4, max_seqlen_q=64, max_seqlen_kv=64, head_dim_qk=64,
                head_dim_v=64)
    for layout in THD_LAYOUTS:
        assert nvte.get_fused_attn_backend(qkv_layout=getattr(L, layout), **args) == BK.NVTE_F16_arbitrary_seqlen, \
            (layout, nvte.get_last_error())
    for layout in ("NVTE_THD_BSHD_BSHD", "NVTE_THD_SBHD_SBHD"):
        assert nvte.get_fused_attn_backend(qkv_layout=getattr(L, layout), **args) == BK.NVTE_No_Backend
        assert "mixes THD" in nvte.get_last_error()
    # the compute path says the same: Q THD [t, h, d], K/V BSHD [b, s, h, d]
    c = ThdCase()
    q = torch.zeros(c.tq, 4, 64, dtype=torch.bfloat16, device="cuda")
    kv = torch.zeros(c.b, 64, 4, 64, dtype=torch.bfloat16, device="cuda")
    H = [handle(x, nvte.DType.kBFloat16) for x in (q, kv, kv)]
    with pytest.raises(nvte.Error, match="mixes THD") as e:
        nvte.fused_attn_fwd_workspace_size(*H, None, 64, 64, True, False, 0.0, L.NVTE_THD_BSHD_BSHD,
                                           BT.NVTE_NO_BIAS, M.NVTE_PADDING_MASK, ST.NVTE_VANILLA_SOFTMAX)
    assert e.value.args[1] == int(nvte.Status.NOT_SUPPORTED)
    args["bias_type"] = BT.NVTE_POST_SCALE_BIAS
    assert nvte.get_fused_attn_backend(qkv_layout=L.NVTE_THD_THD_THD, **args) == BK.NVTE_No_Backend
    assert "THD" in nvte.get_last_error() and "bias" in nvte.get_last_error()


# ------------------------------------------------------------------ FP8 attention
#
# FP8 attention (fused_attn.h "FP8 attention"; CUDA: cuDNN's sdpa_fp8 / sdpa_fp8_backward)
# against the CPU backend's FP8 reference on the same FP8 inputs and scales, and against
# float64 softmax attention on the dequantized inputs.
#
# Bound for CUDA vs CPU (FP8 outputs compared as codes, in value order): both backends see the
# same FP8 codes, scales and (backward) the same O and statistics, and quantize at the same
# points (P~ to E4M3 with scale_S, dS~ to dO's format with scale_dP, outputs with their
# scales). They differ only in arithmetic: float32 accumulation of exact FP8 products and
# float32 exp/log on the GPU (relative error ~1e-6) against float64 on the CPU. Such an error
# changes an FP8 rounding only when the value lies within ~1e-6 (relative) of a rounding
# boundary, i.e. for a fraction ~1e-6 / 2^-4 (E4M3 step) of the quantized values. A flipped
# output is one step off; a flipped P~ or dS~ element moves the outputs of its row by a small
# fraction of their own step, flipping those already near a boundary, again by one step. So:
# at least 99% of the FP8 outputs equal within one step, at least 99.9% within two (in
# practice almost all are equal). amax values are float32 maxima of the same quantities:
# amax_S and amax_dP (no output quantization upstream) to 1e-3 relative; amax of O, dQ, dK, dV
# (which a flipped P~ / dS~ can move by a fraction of a step) to 2e-2 relative. scale_inv must
# be exactly 1/scale in float32.

FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}
FP8_TORCH = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
FP8_NV = {"e4m3": nvte.DType.kFloat8E4M3, "e5m2": nvte.DType.kFloat8E5M2}
HYBRID = dict(o="e4m3", do="e5m2", grad="e5m2")  # TE's HYBRID recipe: E4M3 forward, E5M2 gradients


def fp8_scale(amax, fmt):
    """Delayed-scaling-like power-of-two scale: amax lands between a quarter and half of the
    format's largest value (one binade of margin; 1/scale is exact)."""
    if not amax > 0:
        return 1.0
    return 2.0 ** (math.floor(math.log2(FP8_MAX[fmt] / float(amax))) - 1)


def encode(x, scale, fmt):
    """float64 values -> FP8 codes (uint8) of x * scale."""
    return (x * scale).float().to(FP8_TORCH[fmt]).view(torch.uint8)


def decode(codes, fmt, scale_inv=1.0):
    return codes.contiguous().view(FP8_TORCH[fmt]).double() * scale_inv


class Meta:
    """float32 [1] scale / amax / scale_inv buffers on one device, attached to an nvte.Tensor."""

    PARAMS = (("scale", nvte.Param.kScale), ("amax", nvte.Param.kAmax), ("scale_inv", nvte.Param.kRowwiseScaleInv))

    def __init__(self, dev, scale=None, amax=None, scale_inv=None):
        vals = dict(scale=scale, amax=amax, scale_inv=scale_inv)
        self.bufs = {n: torch.tensor([v], dtype=torch.float32, device=dev) for n, v in vals.items() if v is not None}

    def attach(self, t):
        for name, param in self.PARAMS:
            if name in self.bufs:
                t.set_param(param, self.bufs[name].data_ptr(), [1], nvte.DType.kFloat32)
        t._meta = self
        return t

    def get(self, name):
        return float(self.bufs[name].cpu()[0])


def fp8_inputs(c, fmts):
    """FP8 codes of Q, K, V (E4M3) and dO (fmts["do"]) with their scales, and the dequantized
    float64 values (canonical [b, s, h, d])."""
    g = torch.Generator().manual_seed(c.seed)
    raw = dict(q=torch.randn(c.b, c.sq, c.hq, c.d, generator=g, dtype=torch.float64),
               k=torch.randn(c.b, c.skv, c.hkv, c.d, generator=g, dtype=torch.float64),
               v=torch.randn(c.b, c.skv, c.hkv, c.dv, generator=g, dtype=torch.float64),
               do=torch.randn(c.b, c.sq, c.hq, c.dv, generator=g, dtype=torch.float64))
    codes, scale, deq = {}, {}, {}
    for n, x in raw.items():
        fmt = fmts["do"] if n == "do" else "e4m3"
        scale[n] = fp8_scale(x.abs().max().item(), fmt)
        codes[n] = encode(x, scale[n], fmt)
        deq[n] = decode(codes[n], fmt, 1.0 / scale[n])
    return codes, scale, deq


def fp8_math(c, deq):
    """Unquantized float64 attention on the dequantized inputs: O, dQ, dK, dV and the amax of
    P and of dS = attn_scale * P * (dO V^T - rowsum(dO * O))."""
    r = zero_padding(c, reference(c, deq["q"], deq["k"], deq["v"], deq["do"], None))
    rep, sc = c.hq // c.hkv, 1.0 / math.sqrt(c.d)
    kx, vx = deq["k"].repeat_interleave(rep, 2), deq["v"].repeat_interleave(rep, 2)
    s = (torch.einsum("bqhd,bkhd->bhqk", deq["q"], kx) * sc).masked_fill(~visible(c), float("-inf"))
    p = torch.nan_to_num(torch.softmax(s, -1), 0.0)
    dp = torch.einsum("bqhd,bkhd->bhqk", deq["do"], vx)
    d = (deq["do"] * r["o"]).sum(-1).permute(0, 2, 1)[..., None]  # [b, h, sq, 1]
    ds = sc * p * (dp - d)
    r["amax_dp_raw"] = dp.abs().max().item()  # diagnostics: the other tensors an amax_dP could be of
    r["amax_pdp"] = (p * (dp - d)).abs().max().item()
    return r, p.max().item(), ds.abs().max().item()


def fp8_case_scales(c, fmts, math64):
    """Delayed-scaling scales from the float64 run. S's amax is 1: the forward quantizes the
    unnormalized exp(z - row max), whose largest value is exp(0) (core/cpu/fused_attn_fp8.cpp)."""
    r, amax_p, amax_ds = math64
    sc = dict(s=fp8_scale(1.0, "e4m3"), dp=fp8_scale(amax_ds, fmts["do"]), o=fp8_scale(r["o"].abs().max(), fmts["o"]))
    for n in ("dq", "dk", "dv"):
        sc[n] = fp8_scale(r[n].abs().max(), fmts["grad"])
    return sc


def fp8_qkv(c, codes, in_scale, dev):
    (tq, tk, tv), keep = to_layout(c, (codes["q"], codes["k"], codes["v"]), dev, torch.uint8)
    return [Meta(dev, scale_inv=1.0 / in_scale[n]).attach(handle(x, FP8_NV["e4m3"]))
            for n, x in zip("qkv", (tq, tk, tv))], keep


def canon_rows(c, x):
    """A [b, s, ...] or [s, b, ...] device tensor -> canonical [b, s, ...] on the host."""
    return (x if c.fmt == "bshd" else x.transpose(0, 1)).cpu()


def fp8_side(c, dev):
    padded, lq, lkv, cuq, cukv = lengths(c)
    return dict(cu_seqlens_q=T(cuq.to(dev)).t if padded else None, cu_seqlens_kv=T(cukv.to(dev)).t if padded else None)


def fp8_fwd(c, dev, codes, in_scale, sc, fmts, rng_state):
    """The FP8 forward on one backend: O codes (canonical), O/S metadata and the statistics."""
    H, keep = fp8_qkv(c, codes, in_scale, dev)
    o_shape = (c.b, c.sq, c.hq, c.dv) if c.fmt == "bshd" else (c.sq, c.b, c.hq, c.dv)
    o = torch.full(o_shape, 0x7F, dtype=torch.uint8, device=dev)  # NaN code in both formats
    om = Meta(dev, scale=sc["o"], amax=0.0, scale_inv=-1.0)
    ot = om.attach(handle(o, FP8_NV[fmts["o"]]))
    sm = Meta(dev, scale=sc["s"], amax=0.0, scale_inv=-1.0)
    st = sm.attach(nvte.Tensor())
    a = scalars(c)
    ws = nvte.fused_attn_fwd_workspace_size(*H, None, c.sq, c.skv, True, False, 0.0, a["qkv_layout"],
                                            a["bias_type"], a["attn_mask_type"], a["softmax_type"])
    wsb = torch.empty(max(ws, 1), dtype=torch.uint8, device=dev)
    kw = dict(**fp8_side(c, dev), Bias=None, SoftmaxOffset=None, S=st, cu_seqlens_q_padded=None,
              cu_seqlens_kv_padded=None, page_table_k=None, page_table_v=None, rng_state=T(rng_state.to(dev)).t,
              is_training=True, return_max_logit=False, cuda_graph=False, workspace=T(wsb).t, **a)
    described = nvte.fused_attn_fwd(*H, O=ot, aux=[], **kw)
    f32 = nvte.DType.kFloat32
    bufs = [torch.zeros(shape, dtype=torch.float32 if dt == f32 else torch.int64, device=dev) for shape, dt in described]
    nvte.fused_attn_fwd(*H, O=ot, aux=[handle(b, dt) for b, (_, dt) in zip(bufs, described)], **kw)
    if dev == "cuda":
        torch.cuda.synchronize()
    return dict(o=canon_rows(c, o), o_amax=om.get("amax"), o_scale_inv=om.get("scale_inv"), s_amax=sm.get("amax"),
                s_scale_inv=sm.get("scale_inv"), stats=bufs[0].cpu())


def fp8_bwd(c, dev, codes, in_scale, sc, fmts, o_codes, stats, rng_state, shared_amax=False):
    """The FP8 backward on one backend from the given O codes and statistics. shared_amax: dQ,
    dK and dV get one amax buffer (as the PyTorch adapter's one dQKV slot), returned as dqkv_amax."""
    H, keep = fp8_qkv(c, codes, in_scale, dev)
    rows = lambda x: (x if c.fmt == "bshd" else x.transpose(0, 1)).contiguous().to(dev)
    ot = Meta(dev, scale_inv=1.0 / sc["o"]).attach(handle(rows(o_codes), FP8_NV[fmts["o"]]))
    dot = Meta(dev, scale_inv=1.0 / in_scale["do"]).attach(handle(rows(codes["do"]), FP8_NV[fmts["do"]]))
    st = Meta(dev, scale=sc["s"]).attach(nvte.Tensor())
    dpm = Meta(dev, scale=sc["dp"], amax=0.0, scale_inv=-1.0)
    dpt = dpm.attach(nvte.Tensor())
    poison = [torch.full_like(codes[n], 0x7F) for n in "qkv"]
    (gq, gk, gv), gkeep = to_layout(c, poison, dev, torch.uint8)
    gm = [Meta(dev, scale=sc[n], amax=0.0, scale_inv=-1.0) for n in ("dq", "dk", "dv")]
    G = [m.attach(handle(x, FP8_NV[fmts["grad"]])) for m, x in zip(gm, (gq, gk, gv))]
    shared = Meta(dev, amax=0.0)
    if shared_amax:
        for t in G:
            t.set_param(nvte.Param.kAmax, shared.bufs["amax"].data_ptr(), [1], nvte.DType.kFloat32)
    stats_d = stats.to(dev).contiguous()
    rng_d = rng_state.to(dev).contiguous()
    aux = [handle(stats_d, nvte.DType.kFloat32), handle(rng_d, nvte.DType.kInt64)]
    a = scalars(c)
    ws = nvte.fused_attn_bwd_workspace_size(*H, None, c.sq, c.skv, 0.0, a["qkv_layout"], a["bias_type"],
                                            a["attn_mask_type"], a["softmax_type"])
    wsb = torch.empty(max(ws, 1), dtype=torch.uint8, device=dev)
    side = fp8_side(c, dev)
    nvte.fused_attn_bwd(*H, ot, dot, st, dpt, aux, *G, None, None, side["cu_seqlens_q"], side["cu_seqlens_kv"],
                        None, None, deterministic=True, cuda_graph=False, workspace=T(wsb).t, **a)
    if dev == "cuda":
        torch.cuda.synchronize()
    out = dict(dp_amax=dpm.get("amax"), dp_scale_inv=dpm.get("scale_inv"), dqkv_amax=shared.get("amax"))
    for n, x, m in zip(("dq", "dk", "dv"), (gq, gk, gv), gm):
        out[n] = canon_rows(c, x)
        out[n + "_amax"], out[n + "_scale_inv"] = m.get("amax"), m.get("scale_inv")
    return out


def ordinal(codes):
    """FP8 codes -> integers in value order (adjacent FP8 numbers differ by 1; +0 == -0)."""
    x = codes.to(torch.int64)
    return torch.where(x >= 128, -(x - 128), x)


def check_fp8_codes(got, ref, fmt, name, ref64, min_one=0.97, min_two=0.995):
    """Problems (a list of messages) of CUDA FP8 codes against the CPU reference's. cuDNN works in
    float32 in its own order (and its online softmax rounds the exponentials against a running
    maximum), so a few codes land one or two steps away. Codes are compared where the float64
    value is at least 1/8 of the tensor's RMS value: below that, cancellation leaves rounding
    noise of either sign (e.g. the first row of a causal dQ, where dS = P (dP - D) is exactly 0),
    whose codes differ by many steps while adding nothing to the error check_vs_float64 bounds."""
    mag = got & 0x7F
    bad = (mag == 0x7F) if fmt == "e4m3" else (mag > 0x7B)
    if bad.any():
        return [f"{name}: {int(bad.sum())} NaN/inf codes in the CUDA result (unwritten or overflowed)"]
    keep = ref64.abs() >= 0.125 * ref64.double().pow(2).mean().sqrt()
    diff = (ordinal(got) - ordinal(ref)).abs()[keep]
    n = max(diff.numel(), 1)
    same, one, two = [(diff <= t).sum().item() / n for t in (0, 1, 2)]
    print(f"{name}: {diff.numel()} FP8 values compared ({int((~keep).sum())} near-zero left out), equal {same:.4%}, "
          f"within 1 step {one:.4%}, within 2 {two:.4%}, max {diff.max().item() if diff.numel() else 0} steps")
    if one >= min_one and two >= min_two:
        return []
    return [f"{name}: CUDA vs CPU FP8 codes: only {one:.3%} within one step, {two:.3%} within two"]


def check_vs_float64(got, cpu, ref, name):
    """The CUDA result must be as close to float64 attention (on the dequantized inputs) as the
    CPU reference's, which has the same quantization points: at most 1.25x its error + 1e-3."""
    e_g, e_c = rel_l2(got, ref), rel_l2(cpu, ref)
    print(f"{name} vs float64: CUDA {e_g:.4e}, CPU reference {e_c:.4e}")
    return [] if e_g <= 1.25 * e_c + 1e-3 else [f"{name}: CUDA error vs float64 {e_g:.4e} > 1.25 x the reference's {e_c:.4e}"]


def rel_l2(got, ref):
    return ((got - ref).norm() / ref.norm()).item()


def check_amax(got, ref, rtol, name, hint=""):
    print(f"{name}: CUDA {got!r}, CPU {ref!r}{hint}")
    return [] if abs(got - ref) <= rtol * abs(ref) + 1e-30 else [f"{name}: CUDA {got!r} vs CPU {ref!r} (rtol {rtol})"]


def skip_unsupported(e, what):
    if len(e.args) > 1 and e.args[1] == int(nvte.Status.NOT_SUPPORTED):
        pytest.skip(f"cuDNN FP8 {what} not available for this configuration/device/cuDNN: {e.args[0]}")
    raise e


def fp8_check(c, fmts=HYBRID, backward=True, allow_skip=True):
    codes, in_scale, deq = fp8_inputs(c, fmts)
    math64 = fp8_math(c, deq)
    r64 = math64[0]
    sc = fp8_case_scales(c, fmts, math64)
    rng_state = torch.tensor([123, 0], dtype=torch.int64)
    padded, lq, lkv, _, _ = lengths(c)
    try:
        got = fp8_fwd(c, "cuda", codes, in_scale, sc, fmts, rng_state)
    except nvte.Error as e:
        if not allow_skip:
            raise
        skip_unsupported(e, "forward")
    cpu = fp8_fwd(c, "cpu", codes, in_scale, sc, fmts, rng_state)
    # Every check is run and printed before the test fails, so one GPU run shows them all.
    bad = []
    o_g, o_c = decode(got["o"], fmts["o"], 1.0 / sc["o"]), decode(cpu["o"], fmts["o"], 1.0 / sc["o"])
    bad += check_fp8_codes(got["o"], cpu["o"], fmts["o"], "O", r64["o"])
    bad += check_vs_float64(o_g, o_c, r64["o"], "O")
    bad += check_amax(got["s_amax"], cpu["s_amax"], 1e-3, "amax_S", " (that of exp(z - row max): 1)")
    bad += check_amax(got["o_amax"], cpu["o_amax"], 2e-2, "amax_O")
    if not (got["s_scale_inv"] == cpu["s_scale_inv"] == float(torch.tensor(1.0 / sc["s"], dtype=torch.float32))):
        bad.append(f"S scale_inv: CUDA {got['s_scale_inv']!r}, CPU {cpu['s_scale_inv']!r}")
    if not (got["o_scale_inv"] == cpu["o_scale_inv"] == float(torch.tensor(1.0 / sc["o"], dtype=torch.float32))):
        bad.append(f"O scale_inv: CUDA {got['o_scale_inv']!r}, CPU {cpu['o_scale_inv']!r}")
    # Statistics (float32 lse) of the valid rows: the logits come from FP8 tensor-core products
    # accumulated with fewer mantissa bits than float32 (about 2^-13 relative to sum |q k|, i.e.
    # ~1e-3 absolute for these d <= 128 logits; 3e-4 was seen on an H200).
    for bi in range(c.b):
        gs, cs = got["stats"][bi, :, :lq[bi]], cpu["stats"][bi, :, :lq[bi]]
        dmax = (gs - cs).abs().max().item() if gs.numel() else 0.0
        print(f"stats batch {bi}: max |CUDA - CPU| {dmax:.3e}")
        if not torch.allclose(gs, cs, atol=3e-3, rtol=1e-5):
            bad.append(f"softmax statistics differ (batch {bi}): max {dmax:.3e}")
    if not backward:
        assert not bad, bad
        return
    # Both backwards read the CPU forward's O and statistics: the comparison isolates the backward.
    try:
        gb = fp8_bwd(c, "cuda", codes, in_scale, sc, fmts, cpu["o"], cpu["stats"], rng_state)
    except nvte.Error as e:
        assert not bad, bad
        if not allow_skip:
            raise
        skip_unsupported(e, "backward (forward checked)")
    cb = fp8_bwd(c, "cpu", codes, in_scale, sc, fmts, cpu["o"], cpu["stats"], rng_state)
    bad += check_amax(gb["dp_amax"], cb["dp_amax"], 1e-3, "amax_dP",
                      f" (float64: |dS| {math64[2]:.4g}, |dP| {r64['amax_dp_raw']:.4g}, "
                      f"|P (dP - D)| {r64['amax_pdp']:.4g})")
    if not (gb["dp_scale_inv"] == cb["dp_scale_inv"] == float(torch.tensor(1.0 / sc["dp"], dtype=torch.float32))):
        bad.append(f"dP scale_inv: CUDA {gb['dp_scale_inv']!r}, CPU {cb['dp_scale_inv']!r}")
    for n in ("dq", "dk", "dv"):
        bad += check_fp8_codes(gb[n], cb[n], fmts["grad"], n, r64[n])
        g_deq, c_deq = decode(gb[n], fmts["grad"], 1.0 / sc[n]), decode(cb[n], fmts["grad"], 1.0 / sc[n])
        bad += check_vs_float64(g_deq, c_deq, r64[n], n)
        bad += check_amax(gb[n + "_amax"], cb[n + "_amax"], 2e-2, "amax_" + n)
        if not (gb[n + "_scale_inv"] == cb[n + "_scale_inv"] == float(torch.tensor(1.0 / sc[n], dtype=torch.float32))):
            bad.append(f"{n} scale_inv: CUDA {gb[n + '_scale_inv']!r}, CPU {cb[n + '_scale_inv']!r}")
    assert not bad, bad


@pytest.mark.parametrize("mask", ["no_mask", "causal"])
@pytest.mark.parametrize("d", [128, 64])
@pytest.mark.parametrize("s", [128, 256])
def test_fp8_fwd_bwd(s, d, mask):
    """HYBRID FP8 (E4M3 Q/K/V/O, E5M2 dO and gradients); on Hopper cuDNN's FP8 backward takes
    head_dim 128 only (d=64 checks the forward, then skips the backward with cuDNN's reason)."""
    fp8_check(Case(b=2, hq=4, hkv=4, sq=s, skv=s, d=d, mask=mask))


@pytest.mark.parametrize("mask", ["no_mask", "causal"])
def test_fp8_bwd_gradients_sharing_one_amax(mask):
    """dQ, dK and dV handles sharing one amax buffer get the max of the three (the amax folds run
    in order: in parallel, all but one fold was lost and dV's larger amax went missing under a
    causal mask, so the next step's dV scale saturated ~15% of dV)."""
    c = Case(b=2, hq=4, hkv=4, sq=128, skv=128, d=128, mask=mask)
    codes, in_scale, deq = fp8_inputs(c, HYBRID)
    math64 = fp8_math(c, deq)
    sc = fp8_case_scales(c, HYBRID, math64)
    rng_state = torch.tensor([123, 0], dtype=torch.int64)
    cpu = fp8_fwd(c, "cpu", codes, in_scale, sc, HYBRID, rng_state)
    try:
        gb = fp8_bwd(c, "cuda", codes, in_scale, sc, HYBRID, cpu["o"], cpu["stats"], rng_state, shared_amax=True)
    except nvte.Error as e:
        skip_unsupported(e, "backward")
    cb = fp8_bwd(c, "cpu", codes, in_scale, sc, HYBRID, cpu["o"], cpu["stats"], rng_state)
    want = max(cb["dq_amax"], cb["dk_amax"], cb["dv_amax"])
    print(f"{mask}: shared amax CUDA {gb['dqkv_amax']:.5g}, CPU per tensor dQ {cb['dq_amax']:.5g} "
          f"dK {cb['dk_amax']:.5g} dV {cb['dv_amax']:.5g}")
    assert not check_amax(gb["dqkv_amax"], want, 2e-2, "shared dQKV amax")


def test_fp8_training_needs_multiples_of_128():
    """At s = 200 cuDNN's FP8 backward gave a dQ twice as far from float64 as the reference on an
    H200 (cuDNN 9.19), while 128 and 256 matched: FP8 training at other lengths is NOT_SUPPORTED
    with the reason, not silently wrong."""
    c = Case(b=2, hq=4, hkv=4, sq=200, skv=200, d=128, mask="causal")
    codes, in_scale, deq = fp8_inputs(c, HYBRID)
    sc = fp8_case_scales(c, HYBRID, fp8_math(c, deq))
    with pytest.raises(nvte.Error, match="multiples of 128"):
        fp8_fwd(c, "cuda", codes, in_scale, sc, HYBRID, torch.tensor([123, 0], dtype=torch.int64))


@pytest.mark.parametrize("hq,hkv", [(4, 2), (4, 1)])
def test_fp8_gqa(hq, hkv):
    fp8_check(Case(b=2, hq=hq, hkv=hkv, sq=128, skv=128, d=128, mask="causal"))


@pytest.mark.parametrize("layout", ["NVTE_SBHD_SBHD_SBHD", "NVTE_BS3HD", "NVTE_BSHD_BS2HD", "NVTE_SBH3D"])
def test_fp8_layouts(layout):
    fp8_check(Case(layout=layout, b=2, hq=4, hkv=4, sq=128, skv=128, d=128, mask="causal"))


def test_fp8_padding_causal():
    fp8_check(Case(b=2, hq=4, hkv=4, sq=128, skv=128, d=128, mask="padding_causal", lens_q=[128, 77],
                   lens_kv=[128, 77]))


def test_fp8_all_e4m3():
    fp8_check(Case(b=2, hq=4, hkv=4, sq=128, skv=128, d=128, mask="no_mask"), fmts=dict(o="e4m3", do="e4m3", grad="e4m3"))


def test_fp8_inference_forward():
    c = Case(b=2, hq=4, hkv=4, sq=128, skv=128, d=128, mask="causal")
    fp8_check(c, backward=False)


def test_fp8_runs_on_hopper():
    """The canonical configuration must run (not skip) where cuDNN documents FP8 attention:
    sm90+ with cuDNN >= 9.1 (9.10.0 excluded)."""
    ver = torch.backends.cudnn.version() or 0
    if torch.cuda.get_device_capability() < (9, 0) or ver < 90100 or ver == 91000:
        pytest.skip(f"cuDNN FP8 attention needs sm90+ and cuDNN >= 9.1 (device sm"
                    f"{''.join(map(str, torch.cuda.get_device_capability()))}, cuDNN {ver})")
    fp8_check(Case(b=2, hq=4, hkv=4, sq=256, skv=256, d=128, mask="causal"), allow_skip=False)


def test_fp8_unsupported_is_a_clear_error():
    """Dropout (not implemented on the GPU FP8 path) is NOT_SUPPORTED with the reason, not a crash."""
    c = Case(b=2, hq=4, hkv=4, sq=128, skv=128, d=128, mask="causal")
    codes, in_scale, _ = fp8_inputs(c, HYBRID)
    H, keep = fp8_qkv(c, codes, in_scale, "cuda")
    a = scalars(c)
    with pytest.raises(nvte.Error, match="dropout") as e:
        nvte.fused_attn_fwd_workspace_size(*H, None, c.sq, c.skv, True, False, 0.1, a["qkv_layout"], a["bias_type"],
                                           a["attn_mask_type"], a["softmax_type"])
    assert e.value.args[1] == int(nvte.Status.NOT_SUPPORTED)


def test_fp8_thd_is_not_supported():
    """FP8 attention with THD layouts stays NOT_SUPPORTED on the GPU, with the reason."""
    args = dict(is_training=True, q_dtype=nvte.DType.kFloat8E4M3, kv_dtype=nvte.DType.kFloat8E4M3,
                qkv_layout=L.NVTE_THD_THD_THD, bias_type=BT.NVTE_NO_BIAS, attn_mask_type=M.NVTE_PADDING_CAUSAL_MASK,
                softmax_type=ST.NVTE_VANILLA_SOFTMAX, dropout=0.0, num_attn_heads=4, num_gqa_groups=4,
                max_seqlen_q=128, max_seqlen_kv=128, head_dim_qk=128, head_dim_v=128)
    assert nvte.get_fused_attn_backend(**args) == nvte.NVTE_Fused_Attn_Backend.NVTE_No_Backend
    assert "THD" in nvte.get_last_error()
