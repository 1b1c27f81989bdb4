"""Shared helpers of the fused-attention GPU tests (test_fused_attn_*gpu.py): a case
description (Case), layouts, nvte handles and calls on either backend, the float64 and naive
same-precision references, and check(), which applies the flash-attention rule stated in
test_fused_attn_gpu.py."""
import math

import torch

from transformer_engine import _nvte as nvte

from gpu_util import T

L, M, BT, ST = nvte.NVTE_QKV_Layout, nvte.NVTE_Mask_Type, nvte.NVTE_Bias_Type, nvte.NVTE_Softmax_Type
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
# Softmax statistics and max logits (float32 of the same logits) against the CPU backend's.
STATS_TOL = 1e-3


def mask_enum(name):
    return M.NVTE_NO_MASK if name == "no_mask" else getattr(M, "NVTE_" + name.upper() + "_MASK")


class Case:
    def __init__(self, layout="NVTE_BSHD_BSHD_BSHD", dtype="bfloat16", b=2, sq=64, skv=64, hq=4, hkv=4, d=64,
                 dv=None, mask="no_mask", bias=False, dropout=0.0, lens_q=None, lens_kv=None, seed=0, alibi=False,
                 wl=-1, softmax="vanilla", wr=-1, br=False, deterministic=False):
        self.deterministic = deterministic  # the backward's flag (its workspace query gets the same)
        self.softmax = softmax  # "vanilla", "off-by-one" or "learnable" (offsets from inputs())
        self.layout, self.dtype, self.b, self.sq, self.skv, self.alibi = layout, dtype, b, sq, skv, alibi
        self.wl = wl  # left window (keys i + diag - wl .. of query i; diag: the mask's alignment), -1: unbounded
        self.wr = wr  # right window (keys .. i + diag + wr), -1: unbounded
        self.br = br  # bottom_right_diagonal: a non-causal mask's window aligned to the bottom-right diagonal
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


SOFTMAX = {"vanilla": ST.NVTE_VANILLA_SOFTMAX, "off-by-one": ST.NVTE_OFF_BY_ONE_SOFTMAX,
           "learnable": ST.NVTE_LEARNABLE_SOFTMAX}


def scalars(c):
    return dict(max_seqlen_q=c.sq, max_seqlen_kv=c.skv, attn_scale=1.0 / math.sqrt(c.d), dropout=c.dropout,
                qkv_layout=getattr(L, c.layout),
                bias_type=BT.NVTE_POST_SCALE_BIAS if c.bias else (BT.NVTE_ALIBI if c.alibi else BT.NVTE_NO_BIAS),
                attn_mask_type=mask_enum(c.mask), softmax_type=SOFTMAX[c.softmax], window_size_left=c.wl,
                window_size_right=c.wr, bottom_right_diagonal=c.br)


def run(c, dev, q, k, v, do, bias, rng_state, backward=True, max_logit=False, training=True, offset=None,
        bias_dtype=None):
    """Forward (+ backward) on one backend. Returns canonical float64 O, dQ, dK, dV (CPU), the
    described aux pack ("described": [(shape, dtype)]) and its buffers after the forward ("aux",
    CPU copies). max_logit: return_max_logit, with the pack's float32 buffers poisoned with NaN
    (every element must be written)."""
    nd = nv_dtype(c)
    (tq, tk, tv), keep = to_layout(c, (q, k, v), dev)
    padded, lq, lkv, cuq, cukv = lengths(c)
    o_shape = (c.b, c.sq, c.hq, c.dv) if c.fmt == "bshd" else (c.sq, c.b, c.hq, c.dv)
    o = torch.full(o_shape, float("nan"), dtype=DTYPES[c.dtype], device=dev)
    bias_t = bias.to(bias_dtype or DTYPES[c.dtype]).to(dev).contiguous() if bias is not None else None
    side = dict(Bias=T(bias_t).t if bias_t is not None else None,
                cu_seqlens_q=T(cuq.to(dev)).t if padded else None, cu_seqlens_kv=T(cukv.to(dev)).t if padded else None)
    rng = T(rng_state.to(dev)).t
    H = [handle(x, nd) for x in (tq, tk, tv)]
    sc = scalars(c)
    ws_f = nvte.fused_attn_fwd_workspace_size(*H, side["Bias"], c.sq, c.skv, training, max_logit, c.dropout,
                                               sc["qkv_layout"], sc["bias_type"], sc["attn_mask_type"],
                                               sc["softmax_type"], sc["window_size_left"], sc["window_size_right"],
                                               sc["bottom_right_diagonal"])  # (the window shapes the graph)
    wsf = torch.empty(max(ws_f, 1), dtype=torch.uint8, device=dev)
    off_t = offset.float().view(1, c.hq, 1, 1).to(dev).contiguous() if c.softmax == "learnable" else None
    kw = dict(**side, SoftmaxOffset=T(off_t).t if off_t is not None else None, S=None, cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None,
              page_table_k=None, page_table_v=None, rng_state=rng, is_training=training, return_max_logit=max_logit,
              cuda_graph=False, workspace=T(wsf).t, **sc)
    ot = handle(o, nd)
    described = nvte.fused_attn_fwd(*H, O=ot, aux=[], **kw)
    f32, i64 = nvte.DType.kFloat32, nvte.DType.kInt64
    fill = float("nan") if max_logit else 0.0
    aux_bufs = [torch.full(shape, fill, dtype=torch.float32, device=dev) if dt == f32 else
                torch.zeros(shape, dtype=torch.int64 if dt == i64 else DTYPES[c.dtype], device=dev)
                for shape, dt in described]
    aux = [handle(a, dt) for a, (_, dt) in zip(aux_bufs, described)]
    nvte.fused_attn_fwd(*H, O=ot, aux=aux, **kw)
    canon = lambda x: (x if c.fmt == "bshd" else x.transpose(0, 1)).double().cpu()
    res = {"o": canon(o), "described": [(list(shape), dt) for shape, dt in described],
           "aux": [a.clone().cpu() for a in aux_bufs]}
    if backward:
        dO = (do if c.fmt == "bshd" else do.transpose(0, 1)).to(DTYPES[c.dtype]).to(dev).contiguous()
        nanq = torch.full_like(q, float("nan"))
        (gq, gk, gv), gkeep = to_layout(c, (nanq, torch.full_like(k, float("nan")), torch.full_like(v, float("nan"))),
                                        dev)
        G = [handle(x, nd) for x in (gq, gk, gv)]
        db = torch.full_like(bias_t, float("nan")) if bias_t is not None else None
        ws_b = nvte.fused_attn_bwd_workspace_size(*H, T(db).t if db is not None else None, c.sq, c.skv, c.dropout,
                                                   sc["qkv_layout"], sc["bias_type"], sc["attn_mask_type"],
                                                   sc["softmax_type"], sc["window_size_left"],
                                                   sc["window_size_right"], sc["bottom_right_diagonal"],
                                                   c.deterministic)
        wsb = torch.empty(max(ws_b, 1), dtype=torch.uint8, device=dev)
        doff = torch.full((1, c.hq, 1, 1), float("nan"), device=dev) if c.softmax == "learnable" else None
        nvte.fused_attn_bwd(*H, ot, handle(dO, nd), None, None, aux, *G, T(db).t if db is not None else None,
                            T(doff).t if doff is not None else None, side["cu_seqlens_q"], side["cu_seqlens_kv"], None,
                            None, deterministic=c.deterministic, cuda_graph=False, workspace=T(wsb).t, **sc)
        res.update(dq=canon(gq), dk=canon(gk), dv=canon(gv), dbias=db.double().cpu() if db is not None else None,
                   doffset=doff.view(-1).double().cpu() if doff is not None else None)
    if dev == "cuda":
        torch.cuda.synchronize()
    return res


def aligned_bottom_right(c):
    """The diagonal of the case's mask and window: bottom-right for the bottom-right causal masks,
    and for the other non-causal ones when bottom_right_diagonal is set."""
    return "bottom_right" in c.mask or ("causal" not in c.mask and c.br)


def visible(c, dev="cpu"):
    """[b, 1, sq, skv] bool: which keys each query sees (padding, causal and left-window rules)."""
    padded, lq, lkv, _, _ = lengths(c)
    allowed = torch.ones(c.b, 1, c.sq, c.skv, dtype=torch.bool, device=dev)
    i = torch.arange(c.sq, device=dev)[:, None]
    j = torch.arange(c.skv, device=dev)[None, :]
    for bi in range(c.b):
        a = torch.ones(c.sq, c.skv, dtype=torch.bool, device=dev)
        if padded:
            a &= (i < lq[bi]) & (j < lkv[bi])
        diag = (lkv[bi] - lq[bi]) if aligned_bottom_right(c) else 0  # the window's diagonal too
        if "causal" in c.mask:
            a &= j <= i + diag
        if c.wl >= 0:
            a &= j >= i + diag - c.wl
        if c.wr >= 0:
            a &= j <= i + diag + c.wr
        allowed[bi, 0] = a
    return allowed


def reference(c, q, k, v, do, bias, dtype=torch.float64, dev="cpu", offset=None):
    """Attention in `dtype` with torch autograd: float64 reference or the naive low-precision one.
    Off-by-one / learnable softmax: one more term exp(offset[h]) (zeros: off-by-one) per row."""
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
    sf = s.float() if dtype != torch.float64 else s
    aa = None
    if c.softmax != "vanilla":
        aa = (offset if c.softmax == "learnable" else torch.zeros(c.hq, dtype=torch.float64)).detach()
        aa = aa.to(sf.dtype).to(dev).clone().requires_grad_(True)
        sink = aa.view(1, c.hq, 1, 1).expand(s.shape[0], c.hq, s.shape[2], 1)
        p = torch.softmax(torch.cat([sf, sink], -1), -1)[..., :-1].to(dtype)
    else:
        p = torch.softmax(sf, -1).to(dtype)
    p = torch.nan_to_num(p, 0.0)  # fully masked rows
    o = torch.einsum("bhqk,bkhd->bqhd", p, vx)
    o.backward(dd)
    out = {"o": o.detach().double().cpu(), "dq": qq.grad.double().cpu(), "dk": kk.grad.double().cpu(),
           "dv": vv.grad.double().cpu()}
    out["dbias"] = bb.grad.double().cpu() if bb is not None else None
    out["doffset"] = aa.grad.double().cpu() if c.softmax == "learnable" else None
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
    if c.softmax == "learnable":  # float32 offsets around the logits' size
        c.offset = torch.randn(c.hq, generator=g, dtype=torch.float64).float().double()
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


def check(c, backward=True, max_logit=False, training=True):
    """The rule above for O (and the gradients); max_logit: with return_max_logit, the gradients
    computed from that forward's aux pack, and check_logit_aux on the pack."""
    q, k, v, do, bias = inputs(c)
    rng_state = torch.tensor([123, 0], dtype=torch.int64)
    off = getattr(c, "offset", None)
    got = run(c, "cuda", q, k, v, do, bias, rng_state, backward, max_logit, training, off)
    cpu = run(c, "cpu", q, k, v, do, bias, rng_state, backward, max_logit, training, off)
    ref = zero_padding(c, reference(c, q, k, v, do, bias, offset=off))
    naive = zero_padding(c, reference(c, q, k, v, do, bias, DTYPES[c.dtype], "cuda", offset=off))
    padded, lq, lkv, _, _ = lengths(c)
    keys = ["o"] + (["dq", "dk", "dv"] + (["dbias"] if bias is not None else []) +
                    (["doffset"] if c.softmax == "learnable" else []) if backward else [])
    for key in keys:
        g = got[key]
        assert not torch.isnan(g).any(), f"{key}: NaN in the CUDA result (unwritten or poisoned element)"
        if padded and key not in ("dbias", "doffset"):
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
    if c.softmax != "vanilla" and training:  # statistics with the sink term; the copied offset slot
        assert got["described"] == cpu["described"], (got["described"], cpu["described"])
        compare_rows("statistics", got["aux"][0], cpu["aux"][0])
        assert torch.equal(got["aux"][-1], cpu["aux"][-1]), "softmax offset slot"
    if max_logit:
        plain = run(c, "cuda", q, k, v, do, bias, rng_state, False, False, training)
        check_logit_aux(got, cpu, plain if training else None)


def compare_rows(name, g, c):
    """float32 per-row values (statistics, max logits) of CUDA (g) and CPU (c): no NaN, -inf
    exactly where the CPU has -inf (padded rows, rows that see no key), STATS_TOL elsewhere."""
    assert not torch.isnan(g).any(), f"{name}: {int(torch.isnan(g).sum())} NaN (unwritten or computed as NaN)"
    fin = torch.isfinite(c)
    assert torch.equal(torch.isfinite(g), fin) and (g[~fin] == c[~fin]).all(), \
        f"{name}: -inf rows differ from the CPU's ({int((torch.isfinite(g) != fin).sum())} rows)"
    if fin.any():
        err = (g[fin] - c[fin]).abs().max().item()
        assert err <= STATS_TOL, f"{name}: {err:.3g} from the CPU's"


def check_logit_aux(got, cpu, plain=None):
    """return_max_logit on both backends: the same pack layout ([stats, max logit, rng_state,
    (bias)]; the plain pack with the max logit inserted second), statistics and max logits as
    compare_rows says, the copied slots equal; plain: the CUDA run without the flag, whose
    statistics must agree with the flagged run's wherever the CPU's are finite."""
    assert got["described"] == cpu["described"], (got["described"], cpu["described"])
    if plain is not None:
        want = plain["described"][:1] + [plain["described"][0]] + plain["described"][1:]
        assert got["described"] == want, (got["described"], plain["described"])
    compare_rows("statistics", got["aux"][0], cpu["aux"][0])
    compare_rows("max logit", got["aux"][1], cpu["aux"][1])
    for i in range(2, len(got["aux"])):
        assert torch.equal(got["aux"][i], cpu["aux"][i]), f"aux slot {i} (a copy) differs from the CPU's"
    if plain is not None:
        fin = torch.isfinite(cpu["aux"][0])
        err = (got["aux"][0][fin] - plain["aux"][0][fin]).abs().max().item() if fin.any() else 0.0
        assert err <= STATS_TOL, f"statistics with the flag differ from those without it by {err:.3g}"
