"""Fused attention on the CUDA backend (cuDNN SDPA) against the CPU backend and float64.

Tolerance (flash-attention's rule): the CUDA result's largest error against a float64
reference must be at most 2x the error of a naive same-precision implementation (torch on the
GPU: scores, softmax and products in the input dtype) plus a small floor. The CPU backend is
the oracle too: its result (float64 accumulation, rounded once) is within one output ulp of
the float64 reference, so the same bound holds against it. Padded positions must be zero in
O and in the gradients. Dropout (different random streams on the two backends) is checked for
determinism per rng_state and for its keep rate."""
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


def to_layout(c, canon, dev):
    """canonical [b, s, h, d] float64 tensors (q, k, v) -> three (possibly strided) tensors in
    the case's layout on dev, plus the buffers that own them."""
    dt = DTYPES[c.dtype]
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
