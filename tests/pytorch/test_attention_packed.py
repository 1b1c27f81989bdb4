"""Q, K, V that are views of one packed buffer (the split of a fused QKV projection's output), or
K, V that are (a key/value projection's, for cross attention), go to fused attention in the
packed layout as they are (sbh3d / sb3hd / bsh3d / bs3hd; sbhd_sbh2d / sbhd_sb2hd / bshd_bsh2d /
bshd_bs2hd), without contiguous copies, and their gradients come back as views of one packed
buffer, which MultiheadAttention's split (attn_packing.SplitPacked) hands on as the projection
output's gradient without a copy.

Checked: the detection (packed placements found, anything else not), outputs and gradients
bit-identical to the same call on contiguous copies (separate layout: the same math, other
addresses), in float32 / BF16 and under fp8_dpa (one cast of the whole buffer gives the same
scale and bytes as separate casts with a shared amax), SplitPacked's zero-copy and copying
backward, and MultiheadAttention (self and cross attention) against its unfused path."""
import copy

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common import recipe
from transformer_engine.pytorch import attn_packing as pk
from transformer_engine.pytorch import fused_attention as fa
from transformer_engine.pytorch import fused_attention_fp8 as fa8

from _util import DEVICE, ON_CUDA

L = fa.L


def split_qkv_op(mixed, h, g, d, inter):
    """MultiheadAttention's split of its QKV projection output (attn_packing.SplitPacked)."""
    return pk.SplitPacked.apply(mixed, lambda t: fa8.split_qkv(t, h, g, d, inter),
                                lambda t: fa8.split_qkv(t, h, g, d, inter, grouped_q=True))


def spy_layouts(monkeypatch, func):
    """The layouts (cfg[5]) of every func.apply call (FusedAttnFunc / FusedAttnFP8Func), in a list."""
    seen, real = [], func.apply
    monkeypatch.setattr(func, "apply", lambda *a: seen.append(a[-1][5]) or real(*a))
    return seen


def spy_in_place(monkeypatch):
    """SplitPacked's zero-copy decisions (attn_packing._in_place results), in a list."""
    taken, real = [], pk._in_place
    monkeypatch.setattr(pk, "_in_place", lambda *a: taken.append(real(*a)) or taken[-1])
    return taken


def packed_qkv(fmt, placement, s, b, h, d, dtype, gen):
    """(mixed [tokens..., 3 h d] leaf, q, k, v views) in the given placement."""
    lead = (s, b) if fmt == "sbhd" else (b, s)
    mixed = torch.randn(*lead, 3 * h * d, generator=gen).to(dtype).to(DEVICE).requires_grad_(True)
    if placement == "h3d":
        x = mixed.view(*lead, h, 3, d)
        q, k, v = x[..., 0, :], x[..., 1, :], x[..., 2, :]
    else:
        x = mixed.view(*lead, 3, h, d)
        q, k, v = x[..., 0, :, :], x[..., 1, :, :], x[..., 2, :, :]
    return mixed, q, k, v


@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
@pytest.mark.parametrize("placement", ["h3d", "3hd"])
def test_packed_placements_are_found(fmt, placement):
    _, q, k, v = packed_qkv(fmt, placement, 5, 3, 4, 8, torch.float32, torch.Generator().manual_seed(0))
    assert pk.packed_layout(q, k, v, fmt) == pk.QKV[(fmt, placement)]
    assert pk.packed_layout(q, k, v, "thd") is None
    # the same values in separate buffers, a swapped order, or a gap: not packed
    assert pk.packed_layout(q.contiguous(), k.contiguous(), v.contiguous(), fmt) is None
    assert pk.packed_layout(k, q, v, fmt) is None
    wide = torch.zeros(5, 3, 4, 4, 8, device=DEVICE)  # 4 slots per head: token rows of 4 h d
    assert pk.packed_layout(wide[..., 0, :], wide[..., 1, :], wide[..., 2, :], "sbhd") is None


def test_gqa_interleaved_split_is_not_packed():
    mixed = torch.zeros(5, 3, 2 * (2 + 2) * 8, device=DEVICE)
    q, k, v = fa8.split_qkv(mixed, 4, 2, 8, True)
    assert pk.packed_layout(q, k, v, "sbhd") is None


def _run(q, k, v, fmt, mask, r=None):
    dpa = te.DotProductAttention(q.shape[-2], q.shape[-1], qkv_format=fmt, attn_mask_type=mask,
                                 attention_dropout=0.0)
    with te.fp8_autocast(enabled=r is not None, fp8_recipe=r):
        return dpa(q, k, v)


@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
@pytest.mark.parametrize("placement", ["h3d", "3hd"])
@pytest.mark.parametrize("mask", ["no_mask", "causal"])
def test_packed_call_matches_contiguous_copies(fmt, placement, mask, monkeypatch):
    monkeypatch.setenv("NVTE_FUSED_ATTN", "1")
    dtype = torch.bfloat16 if ON_CUDA else torch.float32
    g = torch.Generator().manual_seed(3)
    mixed, q, k, v = packed_qkv(fmt, placement, 24, 2, 3, 64, dtype, g)
    seen = spy_layouts(monkeypatch, fa.FusedAttnFunc)
    y = _run(q, k, v, fmt, mask)
    dy = torch.randn(y.shape, generator=g).to(dtype).to(DEVICE)
    y.backward(dy)
    assert seen == [pk.QKV[(fmt, placement)]]
    ref_in = [t.detach().clone().contiguous().requires_grad_(True) for t in (q, k, v)]
    y_ref = _run(*ref_in, fmt, mask)
    y_ref.backward(dy)
    assert seen[-1] == fa.LAYOUTS[fmt]
    assert torch.equal(y, y_ref)
    want = torch.stack([t.grad for t in ref_in], dim=-2 if placement == "h3d" else -3)  # mixed's placement
    assert torch.equal(mixed.grad.reshape(want.shape), want)


@pytest.mark.parametrize("interleaved", [True, False])
def test_split_qkv_backward_takes_packed_gradients_without_a_copy(interleaved):
    mixed = torch.randn(4, 2, 3 * 2 * 8, device=DEVICE, requires_grad=True)
    q, k, v = split_qkv_op(mixed, 2, 2, 8, interleaved)
    buf = torch.randn(4, 2, 3 * 2 * 8, device=DEVICE)
    dq, dk, dv = fa8.split_qkv(buf, 2, 2, 8, interleaved)
    torch.autograd.backward((q, k, v), (dq, dk, dv))
    assert torch.equal(mixed.grad, buf)
    (got,) = torch.autograd.grad((q, k, v), mixed, (dq, dk, dv))
    assert got.data_ptr() == buf.data_ptr()


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("h, g", [(2, 2), (4, 2)])
def test_split_qkv_backward_copies_other_gradients(interleaved, h, g):
    mixed = torch.randn(3, 2, (h + 2 * g) * 8, device=DEVICE, requires_grad=True)
    q, k, v = split_qkv_op(mixed, h, g, 8, interleaved)
    dq, dk = torch.randn(q.shape, device=DEVICE), torch.randn(k.shape, device=DEVICE)
    (got,) = torch.autograd.grad((q, k), mixed, (dq, dk))  # v unused: its part is zero
    ref_in = mixed.detach().clone().requires_grad_(True)
    rq, rk, rv = fa8.split_qkv(ref_in, h, g, 8, interleaved)
    (want,) = torch.autograd.grad((rq, rk), ref_in, (dq, dk))
    assert torch.equal(got, want)


@pytest.mark.parametrize("interleaved", [True, False])
def test_multihead_attention_fused_packed_matches_unfused(interleaved, monkeypatch):
    """MultiheadAttention (fused QKV projection, self attention): the fused path with q, k, v
    packed against the unfused path, outputs and every gradient."""
    torch.manual_seed(0)
    dtype = torch.bfloat16 if ON_CUDA else torch.float32
    mha = te.MultiheadAttention(128, 2, attention_dropout=0.0, attn_mask_type="causal", params_dtype=dtype,
                                qkv_weight_interleaved=interleaved, fuse_qkv_params=True, device=DEVICE)
    x = torch.randn(16, 2, 128, dtype=dtype, device=DEVICE)
    dy = torch.randn(16, 2, 128, dtype=dtype, device=DEVICE)
    assert_fused_packed_matches_unfused(monkeypatch, mha, (x,), dy, lambda m, xi: m(xi))


def assert_fused_packed_matches_unfused(monkeypatch, mha, inputs, dy, call):
    """call(mha, *inputs) on the fused path (Q/K/V or K/V packed) against a copy of mha on the
    unfused path: the fused run's packed gradient became the projection output's gradient as it
    was (no copy), and the outputs, the inputs' gradients and every parameter gradient agree."""
    other = copy.deepcopy(mha)
    taken = spy_in_place(monkeypatch)
    outs = []
    for m, fused in ((mha, "1"), (other, "0")):
        monkeypatch.setenv("NVTE_FUSED_ATTN", fused)
        xs = [t.clone().requires_grad_(True) for t in inputs]
        y = call(m, *xs)
        y.backward(dy)
        outs.append([y.detach().float()] + [t.grad.float() for t in xs] + [p.grad.float() for p in m.parameters()])
    assert taken[0] is True
    tol = dict(rtol=2e-2, atol=2e-2) if ON_CUDA else dict(rtol=1e-5, atol=1e-5)
    assert len(outs[0]) == len(outs[1])
    for a, b in zip(outs[0], outs[1]):
        torch.testing.assert_close(a, b, **tol)


def test_split_qkv_of_a_non_contiguous_output_copies():
    """A non-contiguous `mixed` never takes the zero-copy gradient (it would need mixed's strides)."""
    base = torch.randn(2, 4, 3 * 2 * 8, device=DEVICE)
    mixed = base.transpose(0, 1).requires_grad_(True)  # [4, 2, 48], not contiguous
    q, k, v = split_qkv_op(mixed, 2, 2, 8, True)
    buf = torch.randn(4, 2, 3 * 2 * 8, device=DEVICE)
    grads = fa8.split_qkv(buf, 2, 2, 8, True)
    (got,) = torch.autograd.grad((q, k, v), mixed, grads)
    assert torch.equal(got, buf) and got.data_ptr() != buf.data_ptr()


def packed_kv(fmt, placement, s, b, g, d, dtype, gen):
    """(mixed [tokens..., 2 g d] leaf, k, v views) in the given placement."""
    lead = (s, b) if fmt == "sbhd" else (b, s)
    mixed = torch.randn(*lead, 2 * g * d, generator=gen).to(dtype).to(DEVICE).requires_grad_(True)
    x = mixed.view(*lead, g, 2, d) if placement == "h2d" else mixed.view(*lead, 2, g, d)
    k, v = (x[..., i, :] for i in range(2)) if placement == "h2d" else (x[..., i, :, :] for i in range(2))
    return mixed, k, v


@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
@pytest.mark.parametrize("placement", ["h2d", "2hd"])
def test_packed_kv_placements_are_found(fmt, placement):
    g = torch.Generator().manual_seed(1)
    _, k, v = packed_kv(fmt, placement, 7, 3, 2, 8, torch.float32, g)
    q = torch.randn((5, 3, 4, 8) if fmt == "sbhd" else (3, 5, 4, 8), device=DEVICE)
    assert pk.packed_layout(q, k, v, fmt) == pk.KV[(fmt, placement)]
    assert pk.packed_layout(q.transpose(0, 1).contiguous().transpose(0, 1), k, v, fmt) is None  # strided q
    assert pk.packed_layout(q, v, k, fmt) is None


@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
@pytest.mark.parametrize("placement", ["h2d", "2hd"])
def test_packed_kv_cross_attention_matches_contiguous_copies(fmt, placement, monkeypatch):
    monkeypatch.setenv("NVTE_FUSED_ATTN", "1")
    dtype = torch.bfloat16 if ON_CUDA else torch.float32
    gen = torch.Generator().manual_seed(4)
    mixed, k, v = packed_kv(fmt, placement, 40, 2, 2, 64, dtype, gen)
    q = torch.randn((24, 2, 4, 64) if fmt == "sbhd" else (2, 24, 4, 64), generator=gen).to(dtype).to(DEVICE)
    q.requires_grad_(True)
    seen = spy_layouts(monkeypatch, fa.FusedAttnFunc)
    dpa = te.DotProductAttention(4, 64, num_gqa_groups=2, qkv_format=fmt, attn_mask_type="no_mask",
                                 attention_dropout=0.0)
    y = dpa(q, k, v)
    dy = torch.randn(y.shape, generator=gen).to(dtype).to(DEVICE)
    y.backward(dy)
    ref_in = [t.detach().clone().contiguous().requires_grad_(True) for t in (q, k, v)]
    y_ref = dpa(*ref_in)
    y_ref.backward(dy)
    assert seen == [pk.KV[(fmt, placement)], fa.LAYOUTS[fmt]]
    assert torch.equal(y, y_ref) and torch.equal(q.grad, ref_in[0].grad)
    want = torch.stack([t.grad for t in ref_in[1:]], dim=-2 if placement == "h2d" else -3)
    assert torch.equal(mixed.grad.reshape(want.shape), want)


@pytest.mark.parametrize("packed", ["qkv", "kv"])
def test_packed_fp8_dpa_matches_contiguous_copies(packed, monkeypatch):
    """Two steps each (the first seeds the backward scales): the same outputs, gradients and recipe
    state as the call on contiguous copies. Sizes: cuDNN's FP8 attention wants head dim 128 and
    lengths that are multiples of 128 on CUDA; the CPU backend takes small odd ones."""
    monkeypatch.setenv("NVTE_FUSED_ATTN", "1")
    sq, skv, d = (128, 256, 128) if ON_CUDA else (20, 28, 16)
    gen = torch.Generator().manual_seed(5)
    if packed == "qkv":  # self attention: one length
        mixed, q, k, v = packed_qkv("sbhd", "h3d", sq, 2, 2, d, torch.bfloat16, gen)
        layout, first = pk.QKV[("sbhd", "h3d")], 0
    else:
        mixed, k, v = packed_kv("sbhd", "h2d", skv, 2, 2, d, torch.bfloat16, gen)
        q = torch.randn(sq, 2, 2, d, generator=gen).to(torch.bfloat16).to(DEVICE).requires_grad_(True)
        layout, first = pk.KV[("sbhd", "h2d")], 1
    r = recipe.DelayedScaling(fp8_dpa=True, amax_history_len=4)
    dpa = te.DotProductAttention(2, d, qkv_format="sbhd", attn_mask_type="causal" if packed == "qkv" else "no_mask",
                                 attention_dropout=0.0)
    twin = copy.deepcopy(dpa)
    seen = spy_layouts(monkeypatch, fa8.FusedAttnFP8Func)
    for step in range(2):
        dy = torch.randn(sq, 2, 2 * d, generator=gen).to(torch.bfloat16).to(DEVICE)
        mixed.grad = q.grad = None
        with te.fp8_autocast(fp8_recipe=r):
            y = dpa(q, k, v)
        y.backward(dy, retain_graph=True)
        ref_in = [t.detach().clone().contiguous().requires_grad_(True) for t in (q, k, v)]
        with te.fp8_autocast(fp8_recipe=r):
            y_ref = twin(*ref_in)
        y_ref.backward(dy)
        assert seen[-2:] == [layout, fa.LAYOUTS["sbhd"]]
        assert torch.equal(y, y_ref), step
        if packed == "kv":
            assert torch.equal(q.grad, ref_in[0].grad), step
        want = torch.stack([t.grad for t in ref_in[first:]], dim=-2)
        assert torch.equal(mixed.grad.view(want.shape), want), step
        for key in ("fwd", "bwd"):
            assert torch.equal(dpa.fp8_meta.scale[key], twin.fp8_meta.scale[key])
            assert torch.equal(dpa.fp8_meta.amax_history[key], twin.fp8_meta.amax_history[key])


@pytest.mark.parametrize("interleaved", [True, False])
def test_multihead_cross_attention_fused_packed_kv_matches_unfused(interleaved, monkeypatch):
    """MultiheadAttention(attention_type="cross"): K, V from the key/value projection go packed,
    and their gradient buffer becomes that projection output's gradient without a copy."""
    torch.manual_seed(0)
    dtype = torch.bfloat16 if ON_CUDA else torch.float32
    mha = te.MultiheadAttention(128, 2, attention_dropout=0.0, attention_type="cross", params_dtype=dtype,
                                qkv_weight_interleaved=interleaved, device=DEVICE)
    x = torch.randn(16, 2, 128, dtype=dtype, device=DEVICE)
    enc = torch.randn(24, 2, 128, dtype=dtype, device=DEVICE)
    dy = torch.randn(16, 2, 128, dtype=dtype, device=DEVICE)
    assert_fused_packed_matches_unfused(monkeypatch, mha, (x, enc), dy, lambda m, xi, ei: m(xi, encoder_output=ei))


def test_cat_rows_of_back_to_back_parameters_is_a_view():
    """MultiheadAttention's split QKV parameters are rows of one buffer: the forward's concatenation
    is a view (no copy), and gradients reach each parameter as with torch.cat."""
    mha = te.MultiheadAttention(64, 2, attention_dropout=0.0, device=DEVICE)
    qkv = mha.layernorm_qkv if hasattr(mha, "layernorm_qkv") else mha.qkv
    ws = [qkv.query_weight, qkv.key_weight, qkv.value_weight]
    w = pk.cat_rows(ws)
    assert w.data_ptr() == ws[0].data_ptr() and torch.equal(w, torch.cat([t.detach() for t in ws]))
    g = torch.randn(w.shape, device=DEVICE)
    w.backward(g)
    for t, part in zip(ws, g.split(64)):
        assert torch.equal(t.grad, part)
    # parameters that no longer lie together (replaced, moved, converted): concatenated by copy
    qkv.key_weight = torch.nn.Parameter(qkv.key_weight.detach().clone())
    ws = [qkv.query_weight, qkv.key_weight, qkv.value_weight]
    w = pk.cat_rows(ws)
    assert w.data_ptr() != ws[0].data_ptr() and torch.equal(w, torch.cat([t.detach() for t in ws]))
    x = torch.randn(5, 2, 64, device=DEVICE, requires_grad=True)
    mha(x).sum().backward()  # still trains
    assert qkv.key_weight.grad is not None
