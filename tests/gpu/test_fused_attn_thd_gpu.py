"""THD (packed sequence) fused attention on the CUDA backend against the CPU backend and float64."""
import math

import pytest
import torch

from transformer_engine import _nvte as nvte

from attn_gpu_util import BT, DTYPES, L, M, ST, Case, aligned_bottom_right, check_logit_aux, handle, nv_dtype, scalars
from gpu_util import T

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
                 max_sq=None, max_skv=None, dropout=0.0, seed=0, wl=-1, wr=-1, br=False):
        self.layout, self.dtype, self.hq, self.hkv, self.d, self.dv = layout, dtype, hq, hkv, d, dv or d
        self.wl, self.wr = wl, wr  # window (keys i + diag - wl .. i + diag + wr of query i), -1: unbounded
        self.br = br  # bottom_right_diagonal (non-causal masks)
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
    sc = scalars(Case(dtype=c.dtype, sq=c.sq, skv=c.skv, d=c.d, mask=c.mask, dropout=c.dropout, wl=c.wl, wr=c.wr,
                      br=c.br))
    sc["qkv_layout"] = getattr(L, c.layout)
    return sc


def run_thd(c, dev, q, k, v, do, rng_state, backward=True, training=True, max_logit=False):
    """Forward (+ backward) on one backend: O, statistics, dQ, dK, dV as float64 [t, h, d] (CPU).
    max_logit: return_max_logit, with the aux pack also in inference ("described", "aux")."""
    nd = nv_dtype(c)
    (tq, tk, tv), keep = thd_layout(c, (q, k, v), dev)
    side, cu_keep = thd_cu(c, dev)
    H = [handle(x, nd) for x in (tq, tk, tv)]
    sc = thd_scalars(c)
    ws_f = nvte.fused_attn_fwd_workspace_size(*H, None, c.sq, c.skv, training, max_logit, c.dropout, sc["qkv_layout"],
                                               sc["bias_type"], sc["attn_mask_type"], sc["softmax_type"],
                                               sc["window_size_left"], sc["window_size_right"],
                                               sc["bottom_right_diagonal"])  # (the window shapes the graph)
    wsf = torch.empty(max(ws_f, 1), dtype=torch.uint8, device=dev)
    o = torch.full((c.tq, c.hq, c.dv), float("nan"), dtype=DTYPES[c.dtype], device=dev)
    ot = handle(o, nd)
    rng = T(rng_state.to(dev)).t
    kw = dict(**side, Bias=None, SoftmaxOffset=None, S=None, page_table_k=None, page_table_v=None, rng_state=rng,
              is_training=training, return_max_logit=max_logit, cuda_graph=False, workspace=T(wsf).t, **sc)
    res = {}
    aux = None
    if training or max_logit:
        described = nvte.fused_attn_fwd(*H, O=ot, aux=[], **kw)
        f32 = nvte.DType.kFloat32
        aux_bufs = [torch.full(shape, float("nan"), dtype=torch.float32, device=dev) if dt == f32 else
                    torch.zeros(shape, dtype=torch.int64, device=dev) for shape, dt in described]
        aux = [handle(a, dt) for a, (_, dt) in zip(aux_bufs, described)]
        nvte.fused_attn_fwd(*H, O=ot, aux=aux, **kw)
    else:
        nvte.fused_attn_fwd(*H, O=ot, aux=None, **kw)
    res["o"] = o.double().cpu()
    if aux is not None:
        res["stats"] = aux_bufs[0].cpu()
        res["described"] = [(list(shape), dt) for shape, dt in described]
        res["aux"] = [a.clone().cpu() for a in aux_bufs]
    if backward:
        dO = do.to(DTYPES[c.dtype]).to(dev).contiguous()
        nan = lambda x: torch.full_like(x, float("nan"))
        (gq, gk, gv), gkeep = thd_layout(c, (nan(q), nan(k), nan(v)), dev)
        G = [handle(x, nd) for x in (gq, gk, gv)]
        ws_b = nvte.fused_attn_bwd_workspace_size(*H, None, c.sq, c.skv, c.dropout, sc["qkv_layout"], sc["bias_type"],
                                                   sc["attn_mask_type"], sc["softmax_type"], sc["window_size_left"],
                                                   sc["window_size_right"], sc["bottom_right_diagonal"])
        wsb = torch.empty(max(ws_b, 1), dtype=torch.uint8, device=dev)
        nvte.fused_attn_bwd(*H, ot, handle(dO, nd), None, None, aux, *G, None, None, side["cu_seqlens_q"],
                            side["cu_seqlens_kv"], side["cu_seqlens_q_padded"], side["cu_seqlens_kv_padded"],
                            deterministic=False, cuda_graph=False, workspace=T(wsb).t, **sc)
        res.update(dq=gq.double().cpu(), dk=gk.double().cpu(), dv=gv.double().cpu())
    if dev == "cuda":
        torch.cuda.synchronize()
    return res


def thd_visible(c, lq, lkv, dev):
    """[lq, lkv] bool of one sequence (THD always has the lengths; the mask type adds causality)."""
    i = torch.arange(lq, device=dev)[:, None]
    j = torch.arange(lkv, device=dev)[None, :]
    a = torch.ones(lq, lkv, dtype=torch.bool, device=dev)
    diag = (lkv - lq) if aligned_bottom_right(c) else 0
    if "causal" in c.mask:
        a &= j <= i + diag
    if c.wl >= 0:
        a &= j >= i + diag - c.wl
    if c.wr >= 0:
        a &= j <= i + diag + c.wr
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


def check_thd(c, backward=True, training=True, max_logit=False):
    q, k, v, do = thd_inputs(c)
    rng_state = torch.tensor([123, 0], dtype=torch.int64)
    got = run_thd(c, "cuda", q, k, v, do, rng_state, backward, training, max_logit)
    cpu = run_thd(c, "cpu", q, k, v, do, rng_state, backward, training, max_logit)
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
    if max_logit:
        plain = run_thd(c, "cuda", q, k, v, do, rng_state, False, training) if training else None
        check_logit_aux(got, cpu, plain)


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


@pytest.mark.parametrize("wl", [1, 5, 40])
def test_thd_bottom_right_causal_window(wl):
    """THD with a left window on the bottom-right causal diagonal and padded query / key offsets
    (the calls of context parallelism over THD with 'all_gather': a chunk's queries over the keys
    its window reaches, fewer queries than keys)."""
    check_thd(ThdCase(mask="padding_causal_bottom_right", lens_q=[16, 1, 12, 9], lens_kv=[40, 3, 12, 30],
                      gaps_q=[2, 0, 1, 3], gaps_kv=[0, 4, 0, 1], tail_q=2, wl=wl))


@pytest.mark.parametrize("wl,wr,br", [(4, 2, False), (6, 1, True), (-1, 0, True)])
def test_thd_window_band(wl, wr, br):
    """THD with a padding mask and a window of both bounds (cuDNN's diagonal band), top-left or
    bottom-right aligned per sequence (bottom_right_diagonal), with padded offsets."""
    check_thd(ThdCase(mask="padding", lens_q=[16, 1, 12, 9], lens_kv=[40, 3, 12, 30], gaps_q=[2, 0, 1, 3],
                      gaps_kv=[0, 4, 0, 1], tail_q=2, wl=wl, wr=wr, br=br))


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


def test_thd_mixed_layouts_training_and_bias_are_not_supported():
    """What stays NOT_SUPPORTED on the GPU, with its reason: training (the backward) with THD
    queries over BSHD/SBHD K/V (their forward: test_fused_attn_kv_cache_gpu.py), and THD with a
    bias. (FP8 THD: test_fp8_thd_is_not_supported below.)"""
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
        assert "for inference only" in nvte.get_last_error()
        assert nvte.get_fused_attn_backend(qkv_layout=getattr(L, layout), **dict(args, is_training=False)) == \
            BK.NVTE_F16_arbitrary_seqlen, (layout, nvte.get_last_error())
    # the compute path says the same: Q THD [t, h, d], K/V BSHD [b, s, h, d]
    c = ThdCase()
    q = torch.zeros(c.tq, 4, 64, dtype=torch.bfloat16, device="cuda")
    kv = torch.zeros(c.b, 64, 4, 64, dtype=torch.bfloat16, device="cuda")
    H = [handle(x, nvte.DType.kBFloat16) for x in (q, kv, kv)]
    with pytest.raises(nvte.Error, match="for inference only") as e:
        nvte.fused_attn_fwd_workspace_size(*H, None, 64, 64, True, False, 0.0, L.NVTE_THD_BSHD_BSHD,
                                           BT.NVTE_NO_BIAS, M.NVTE_PADDING_MASK, ST.NVTE_VANILLA_SOFTMAX)
    assert e.value.args[1] == int(nvte.Status.NOT_SUPPORTED)
    args["bias_type"] = BT.NVTE_POST_SCALE_BIAS
    assert nvte.get_fused_attn_backend(qkv_layout=L.NVTE_THD_THD_THD, **args) == BK.NVTE_No_Backend
    assert "THD" in nvte.get_last_error() and "bias" in nvte.get_last_error()


# ------------------------------------------------------------------ return_max_logit (THD)
#
# cuDNN's Max and Sum_exp go through the graph-sized scratch like the statistics; the caller's
# max logit and statistics must match the CPU's (-inf past each sequence's length and for rows
# that see no key), and the backward from that pack must pass the bound (check_logit_aux).


@pytest.mark.parametrize("mask", ["padding", "padding_causal"])
@pytest.mark.parametrize("layout", ["NVTE_THD_THD_THD", "NVTE_T3HD", "NVTE_THD_TH2D"])
def test_thd_max_logit(layout, mask):
    packed = layout == "NVTE_T3HD"
    check_thd(ThdCase(layout=layout, mask=mask, lens_q=[37, 1, 64, 20], lens_kv=None if packed else [50, 1, 64, 9],
                      gaps_q=[0, 3, 0, 5], gaps_kv=None if packed else [2, 0, 4, 1], tail_q=4,
                      tail_kv=4 if packed else 6), max_logit=True)


@pytest.mark.parametrize("mask", ["padding_causal_bottom_right", "padding"])
def test_thd_max_logit_rows_without_keys(mask):
    """An empty K/V sequence, and (bottom-right) queries before the first visible key: -inf."""
    check_thd(ThdCase(mask=mask, hq=8, hkv=2, lens_q=[12, 5, 0, 9, 30], lens_kv=[16, 0, 7, 9, 11],
                      gaps_q=[0, 1, 1, 0, 2], tail_q=2), max_logit=True)


def test_thd_max_logit_many_runs():
    """Several graph runs per call: each run's scratch lands at its sequences in the caller's pack."""
    lens = [3, 1, 7, 2, 5, 1, 4, 6, 2, 8, 1]
    check_thd(ThdCase(mask="padding_causal", lens_q=lens, gaps_q=[i % 3 for i in range(len(lens))], tail_q=5,
                      max_sq=64, max_skv=64), max_logit=True)


def test_thd_max_logit_inference():
    check_thd(ThdCase(mask="padding_causal", gaps_q=[0, 3, 0, 5], tail_q=4), backward=False, training=False,
              max_logit=True)
