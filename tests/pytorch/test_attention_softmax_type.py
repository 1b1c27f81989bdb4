"""DotProductAttention(softmax_type=...) (TE's attention sink): "off-by-one" adds exp(0) and
"learnable" exp(softmax_offset[h]) to every row's softmax denominator (softmax_offset: a
Parameter [heads], zeros at first). Against a float64 torch reference with that extra term:
output, dQ/dK/dV and the offset's gradient, on the fused path (the library: CPU reference or
cuDNN's sink token) and on the unfused one (torch); THD (fused only); MultiheadAttention and
TransformerLayer pass softmax_type down; a K/V-cache decode (non-paged and paged) equals the rows
of one full forward;
FP8 attention and bad names are clear errors. CPU: float32, rel_err < 2e-5 (gradients 1e-4).
CUDA: bfloat16 under test_fused_attention.py's rule (2x a naive bfloat16 implementation)."""
import math
from collections import OrderedDict

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling
from transformer_engine.pytorch import DotProductAttention

from _util import DEVICE, dev
from test_attention import make_qkv, padding_masks, ref_mask
from test_fused_attention import DT, TOL, Spy, assert_close_fused, check_out_and_backward
from transformer_engine.pytorch import fused_attention as fa

ON_GPU = DEVICE.type == "cuda"


def ref_sink(q, k, v, fmt, scale, mask, offset, dtype=torch.float64, q_valid=None):
    """Attention whose softmax has one more term, exp(offset[h]), per row (offset [h]); in `dtype`."""
    perm = (1, 2, 0, 3) if fmt == "sbhd" else (0, 2, 1, 3)
    q, k, v = (t.to(dtype).permute(*perm) for t in (q, k, v))
    b, h, sq, _ = q.shape
    g = k.shape[1]
    k, v = k.repeat_interleave(h // g, 1), v.repeat_interleave(h // g, 1)
    s = scale * (q @ k.transpose(-1, -2))
    if mask is not None:
        s = s.masked_fill(mask, float("-inf"))
    sf = s.float() if dtype != torch.float64 else s
    sink = offset.to(sf.dtype).view(1, h, 1, 1).expand(b, h, sq, 1)
    p = torch.softmax(torch.cat([sf, sink], -1), -1)[..., :-1].to(dtype)
    o = p @ v
    if q_valid is not None:
        o = o * q_valid[:, None, :, None]
    o = o.permute(2, 0, 1, 3) if fmt == "sbhd" else o.permute(0, 2, 1, 3)
    return o.reshape(o.shape[0], o.shape[1], -1)


def naive_doffset(q, k, v, fmt, scale, mask, offset, o, dy):
    """The same-precision naive form of the offset's gradient that a flash-style backward (the fused
    path; the unfused one is autograd through ref_sink's dataflow) computes:
    -sum over rows of exp(offset - logsumexp) * (dO . O) with O the stored low-precision output.
    (Autograd through a naive implementation keeps P in float32 instead; the sum over rows of the
    bfloat16 rounding of O then makes the flash form's error a few times larger: a float64
    emulation of it on the CPU with these inputs is off by 1.8e-3 / 4.2e-3 / 7.7e-3 where autograd
    in bfloat16 is off by 1.8e-3 / 5.4e-3 / 8.1e-3.)"""
    perm = (1, 2, 0, 3) if fmt == "sbhd" else (0, 2, 1, 3)
    qh, kh = (t.float().permute(*perm) for t in (q, k))
    b, h, sq, _ = qh.shape
    kh = kh.repeat_interleave(h // kh.shape[1], 1)
    z = scale * (qh @ kh.transpose(-1, -2))
    if mask is not None:
        z = z.masked_fill(mask, float("-inf"))
    lse = torch.logsumexp(torch.cat([z, offset.view(1, h, 1, 1).expand(b, h, sq, 1)], -1), -1)  # [b, h, sq]
    rows = lambda t: t.float().reshape(*t.shape[:2], h, -1).permute(*perm)  # [b, h, sq, d_v]
    dsum = (rows(o) * rows(dy)).sum(-1)
    return -(torch.exp(offset.view(1, h, 1) - lse) * dsum).sum((0, 2))


def check(monkeypatch, softmax_type, fmt, mask_type, b, sq, sk, h, g, d, fused, attention_mask=None, q_valid=None):
    monkeypatch.setenv("NVTE_FUSED_ATTN", "1" if fused else "0")
    spy = Spy(fa._nvte)
    monkeypatch.setattr(fa, "_nvte", spy)
    dpa = DotProductAttention(h, d, num_gqa_groups=g, qkv_format=fmt, attn_mask_type=mask_type,
                              softmax_type=softmax_type).to(DEVICE)
    if softmax_type == "learnable":
        with torch.no_grad():
            dpa.softmax_offset.copy_(torch.linspace(-1.5, 2.0, h))
    q, k, v = make_qkv(fmt, b, sq, sk, h, g, d, seed=3, dtype=DT)
    out = dpa(dev(q), dev(k), dev(v), attention_mask=None if attention_mask is None else
              tuple(dev(t) for t in attention_mask))
    assert spy.fwd == (1 if fused else 0), "the expected attention path was not taken"
    off = dpa.sink_offset(torch.device("cpu")).detach().cpu().double().requires_grad_(True)
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    m = ref_mask(mask_type, b, sq, sk, attention_mask)
    ref = ref_sink(q64, k64, v64, fmt, 1.0 / math.sqrt(d), m, off, q_valid=q_valid)
    naive = None
    if ON_GPU:
        qn, kn, vn = (dev(t.detach()).requires_grad_(True) for t in (q, k, v))
        on = dev(off.detach()).float().requires_grad_(True)
        naive = ref_sink(qn, kn, vn, fmt, 1.0 / math.sqrt(d), dev(m), on, dtype=DT,
                         q_valid=None if q_valid is None else dev(q_valid))
    dy = check_out_and_backward(out, ref, naive)
    grads = [("dq", q.grad, q64.grad, None if naive is None else qn.grad),
             ("dk", k.grad, k64.grad, None if naive is None else kn.grad),
             ("dv", v.grad, v64.grad, None if naive is None else vn.grad)]
    if softmax_type == "learnable":  # each path against the naive form of its own dataflow
        nd = None
        if naive is not None:
            nd = on.grad if not fused else naive_doffset(dev(q.detach()), dev(k.detach()), dev(v.detach()), fmt,
                                                         1.0 / math.sqrt(d), dev(m), dev(off.detach()).float(),
                                                         naive.detach(), dev(dy))
        grads.append(("doffset", dpa.softmax_offset.grad, off.grad, nd))
    for name, got, want, nv in grads:
        assert got is not None, f"{name}: no gradient"
        assert_close_fused(got, want, nv, 1e-4, name)
    assert spy.bwd == (1 if fused else 0)


@pytest.mark.parametrize("softmax_type", ["off-by-one", "learnable"])
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("fmt", ["bshd", "sbhd"])
@pytest.mark.parametrize("mask_type,sq,sk,h,g", [("no_mask", 7, 9, 4, 4), ("causal", 8, 8, 4, 2),
                                                 ("causal_bottom_right", 5, 9, 4, 1)])
def test_matches_float64(monkeypatch, softmax_type, fused, fmt, mask_type, sq, sk, h, g):
    if ON_GPU and fused:  # cuDNN's sink token: head dims multiple of 8, at least 2 query rows
        sq, sk = sq + 1 if sq % 2 else sq, sk
    check(monkeypatch, softmax_type, fmt, mask_type, 2, sq, sk, h, g, 16, fused)


@pytest.mark.parametrize("softmax_type", ["off-by-one", "learnable"])
@pytest.mark.parametrize("fused", [True, False])
def test_padding(monkeypatch, softmax_type, fused):
    b, sq, sk = 3, 8, 10
    qm, km = padding_masks(b, sq, sk, seed=4)
    check(monkeypatch, softmax_type, "bshd", "padding_causal", b, sq, sk, 4, 4, 16, fused, (qm, km),
          q_valid=~qm.view(b, sq))


@pytest.mark.parametrize("softmax_type", ["off-by-one", "learnable"])
def test_thd(softmax_type):
    """THD (fused only; on the GPU it runs as padded BSHD, which takes the sink) against per-sequence
    float64 attention with the sink."""
    lens, h, d = [5, 1, 7], 2, 16
    cu = torch.tensor([0, 5, 6, 13], dtype=torch.int32)
    dpa = DotProductAttention(h, d, qkv_format="thd", attn_mask_type="padding_causal",
                              softmax_type=softmax_type).to(DEVICE)
    if softmax_type == "learnable":
        with torch.no_grad():
            dpa.softmax_offset.copy_(torch.tensor([0.7, -0.4]))
    gen = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(13, h, d, generator=gen).to(DT).requires_grad_(True) for _ in range(3))
    out = dpa(dev(q), dev(k), dev(v), cu_seqlens_q=dev(cu), cu_seqlens_kv=dev(cu), max_seqlen_q=7, max_seqlen_kv=7)
    off = dpa.sink_offset(torch.device("cpu")).detach().cpu().double()
    refs = []
    for i, n in enumerate(lens):
        s = slice(int(cu[i]), int(cu[i + 1]))
        qi, ki, vi = (t.detach()[s].double().unsqueeze(0) for t in (q, k, v))
        causal = torch.ones(n, n, dtype=torch.bool).triu(1).view(1, 1, n, n)
        refs.append(ref_sink(qi, ki, vi, "bshd", 1.0 / math.sqrt(d), causal, off)[0])
    ref = torch.cat(refs)
    err = ((out.detach().double().cpu() - ref).abs().max() / ref.abs().max()).item()
    assert err < (2 * 2.0 ** -8 if ON_GPU else TOL), err
    out.float().sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    if softmax_type == "learnable":
        assert dpa.softmax_offset.grad is not None and torch.isfinite(dpa.softmax_offset.grad).all()


@pytest.mark.parametrize("module", ["mha", "layer"])
def test_modules_pass_softmax_type_down(module):
    torch.manual_seed(0)
    hid, h = 32, 4
    make = (lambda st: te.MultiheadAttention(hid, h, attention_dropout=0.0, softmax_type=st, params_dtype=DT)) \
        if module == "mha" else \
        (lambda st: te.TransformerLayer(hid, 64, h, hidden_dropout=0.0, attention_dropout=0.0, softmax_type=st,
                                        params_dtype=DT))
    plain, sink = make("vanilla").to(DEVICE), make("learnable").to(DEVICE)
    sink.load_state_dict(plain.state_dict(), strict=False)
    names = [n for n, _ in sink.named_parameters() if n.endswith("softmax_offset")]
    assert len(names) == 1 and not any(n.endswith("softmax_offset") for n, _ in plain.named_parameters())
    x = dev(torch.randn(6, 2, hid).to(DT))
    a, b = plain(x), sink(x)
    assert not torch.allclose(a.float(), b.float()), "the sink changed nothing"
    b.float().sum().backward()
    off = dict(sink.named_parameters())[names[0]]
    assert off.grad is not None and off.grad.shape == (h,) and torch.isfinite(off.grad).all()


@pytest.mark.parametrize("softmax_type", ["off-by-one", "learnable"])
@pytest.mark.parametrize("paged", [False, True])
def test_kv_cache_decode_matches_full_forward(softmax_type, paged):
    """Generation with InferenceParams (non-paged or paged cache; on the GPU the decode steps rescale
    a vanilla cuDNN forward by the sink share): each step's row equals the same row of one causal
    forward over the whole sequence."""
    b, h, d, steps = 2, 2, 16, 4
    dpa = DotProductAttention(h, d, qkv_format="bshd", attn_mask_type="causal", softmax_type=softmax_type,
                              layer_number=1).to(DEVICE)
    if softmax_type == "learnable":
        with torch.no_grad():
            dpa.softmax_offset.copy_(torch.tensor([1.0, -0.5]))
    gen = torch.Generator().manual_seed(2)
    q, k, v = (dev(torch.randn(b, 3 + steps, h, d, generator=gen).to(DT)) for _ in range(3))
    with torch.no_grad():
        full = dpa(q, k, v)
        kw = dict(is_paged=True, page_size=4, total_num_pages=b * 16 // 4) if paged else {}
        params = te.InferenceParams(b, 16, h, d, DT, **kw)
        params.pre_step(OrderedDict((i, 3) for i in range(b)))
        rows = [dpa(q[:, :3], k[:, :3], v[:, :3], inference_params=params, attn_mask_type="padding_causal")]
        for t in range(3, 3 + steps):
            params.pre_step(OrderedDict((i, 1) for i in range(b)))
            rows.append(dpa(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], inference_params=params,
                            attn_mask_type="padding_causal"))
    got = torch.cat(rows, 1).float()
    tol = 2e-2 if ON_GPU else 1e-5
    assert (got - full.float()).abs().max().item() <= tol * full.float().abs().max().item()


def test_errors():
    with pytest.raises(ValueError, match="softmax_type must be one of"):
        DotProductAttention(2, 16, softmax_type="sink")
    dpa = DotProductAttention(2, 16, qkv_format="bshd", attn_mask_type="causal", softmax_type="off-by-one").to(DEVICE)
    q = dev(torch.randn(1, 128, 2, 16).to(DT))
    with te.fp8_autocast(enabled=True, fp8_recipe=DelayedScaling(fp8_dpa=True)):
        with pytest.raises(NotImplementedError, match="vanilla softmax only"):
            dpa(q, q, q)
