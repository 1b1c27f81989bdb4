"""MultiheadAttention (parameter names and layouts as TE registers them, self and cross attention,
GQA, fused / interleaved QKV, return_bias / return_layernorm_output, meta device) against float64
references written in plain torch. The modules run on NVTE_TEST_DEVICE (default the CPU backend);
inputs are drawn on the CPU and moved with dev(). (DotProductAttention itself: test_attention.py.)"""
import math

import pytest
import torch

from transformer_engine.pytorch.attention import DotProductAttention, MultiheadAttention

from _util import DEVICE, dev, rel_err
from test_attention import TOL, _c64, dev_mask, padding_masks, ref_attention, ref_mask

def ref_mha(x, wq, bq, wk, bk, wv, bv, wo, bo, h, g, d, fmt, mask, ln=None, enc=None):
    x = _c64(x)
    if ln is not None:
        x = torch.nn.functional.layer_norm(x, (x.shape[-1],), _c64(ln[0]), _c64(ln[1]), 1e-5)
    kv_in = x if enc is None else _c64(enc)
    lin = lambda t, w, b: t @ _c64(w).t() + (0 if b is None else _c64(b))
    q = lin(x, wq, bq).view(*x.shape[:2], h, d)
    k = lin(kv_in, wk, bk).view(*kv_in.shape[:2], g, d)
    v = lin(kv_in, wv, bv).view(*kv_in.shape[:2], g, d)
    ctx = ref_attention(q, k, v, fmt, 1 / math.sqrt(d), mask)
    return lin(ctx, wo, bo)


def interleaved_split(w, h, g, d):
    """(q, k, v) row blocks of a fused per-group interleaved QKV weight/bias."""
    per = h // g
    x = w.view(g, per + 2, d, *w.shape[1:])
    return (x[:, :per].reshape(h * d, *w.shape[1:]), x[:, per].reshape(g * d, *w.shape[1:]),
            x[:, per + 1].reshape(g * d, *w.shape[1:]))


@pytest.mark.parametrize("input_layernorm", [False, True])
@pytest.mark.parametrize("fuse", [False, True])
def test_mha_parameter_names(input_layernorm, fuse):
    m = MultiheadAttention(32, 4, input_layernorm=input_layernorm, fuse_qkv_params=fuse, device=DEVICE)
    names = sorted(n for n, _ in m.named_parameters())
    pre = "layernorm_qkv." if input_layernorm else "qkv."
    qkv = ["weight", "bias"] if fuse else ["query_weight", "query_bias", "key_weight", "key_bias",
                                           "value_weight", "value_bias"]
    lnp = ["layer_norm_weight", "layer_norm_bias"] if input_layernorm else []
    expected = sorted([pre + n for n in qkv + lnp] + ["proj.weight", "proj.bias"])
    assert names == expected
    assert isinstance(m.core_attention, DotProductAttention)
    if not fuse:
        sub = getattr(m, pre[:-1])
        assert sub.query_weight.shape == (32, 32) and sub.key_weight.shape == (32, 32)


def test_mha_gqa_and_cross_parameter_names():
    m = MultiheadAttention(32, 4, num_gqa_groups=2, input_layernorm=True, device=DEVICE)
    assert m.layernorm_qkv.key_weight.shape == (16, 32) and m.layernorm_qkv.value_bias.shape == (16,)
    m = MultiheadAttention(32, 4, attention_type="cross", input_layernorm=True, device=DEVICE)
    names = sorted(n for n, _ in m.named_parameters())
    assert names == sorted(["layernorm_query.layer_norm_weight", "layernorm_query.layer_norm_bias",
                            "layernorm_query.query_weight", "layernorm_query.query_bias",
                            "key_value.key_weight", "key_value.key_bias", "key_value.value_weight",
                            "key_value.value_bias", "proj.weight", "proj.bias"])
    m = MultiheadAttention(32, 4, attention_type="cross", fuse_qkv_params=True, device=DEVICE)
    names = sorted(n for n, _ in m.named_parameters())
    assert names == sorted(["query_layer.weight", "query_layer.bias", "key_value.weight", "key_value.bias",
                            "proj.weight", "proj.bias"])
    m = MultiheadAttention(32, 4, bias=False, normalization="RMSNorm", input_layernorm=True, device=DEVICE)
    assert sorted(n for n, _ in m.named_parameters()) == sorted(
        ["layernorm_qkv.layer_norm_weight", "layernorm_qkv.query_weight", "layernorm_qkv.key_weight",
         "layernorm_qkv.value_weight", "proj.weight"])


def _randomize(m, seed=11):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)


@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
@pytest.mark.parametrize("fuse", [False, True])
@pytest.mark.parametrize("input_layernorm", [False, True])
@pytest.mark.parametrize("g", [4, 2])
def test_mha_self_numerics(fmt, fuse, input_layernorm, g):
    hidden, h, d, b, s = 32, 4, 8, 2, 6
    m = MultiheadAttention(hidden, h, num_gqa_groups=g, attention_dropout=0.0, input_layernorm=input_layernorm,
                           fuse_qkv_params=fuse, qkv_format=fmt, attn_mask_type="causal", device=DEVICE)
    _randomize(m)
    sub = m.layernorm_qkv if input_layernorm else m.qkv
    if fuse:
        wq, wk, wv = interleaved_split(sub.weight, h, g, d)
        bq, bk, bv = interleaved_split(sub.bias, h, g, d)
    else:
        wq, wk, wv, bq, bk, bv = (sub.query_weight, sub.key_weight, sub.value_weight, sub.query_bias,
                                  sub.key_bias, sub.value_bias)
    ln = (sub.layer_norm_weight.detach(), sub.layer_norm_bias.detach()) if input_layernorm else None
    wq, wk, wv, bq, bk, bv = (t.detach() for t in (wq, wk, wv, bq, bk, bv))
    shape = (s, b, hidden) if fmt == "sbhd" else (b, s, hidden)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(2), requires_grad=True)
    out = m(dev(x))
    assert out.shape == shape
    x64 = x.detach().double().requires_grad_(True)
    ref = ref_mha(x64, wq, bq, wk, bk, wv, bv, m.proj.weight.detach(), m.proj.bias.detach(), h, g, d, fmt,
                  ref_mask("causal", b, s, s), ln=ln)
    assert rel_err(out, ref) < TOL
    dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    out.backward(dev(dy))
    ref.backward(dy.double())
    assert rel_err(x.grad, x64.grad) < 1e-4
    # parameter gradients vs autograd of the float64 reference (same parameters, as float64 leaves)
    params = dict(m.named_parameters())
    p64 = {n: _c64(p.detach()).requires_grad_(True) for n, p in params.items()}
    pre = "layernorm_qkv." if input_layernorm else "qkv."
    if fuse:
        wq, wk, wv = interleaved_split(p64[pre + "weight"], h, g, d)
        bq, bk, bv = interleaved_split(p64[pre + "bias"], h, g, d)
    else:
        wq, wk, wv, bq, bk, bv = (p64[pre + n] for n in ("query_weight", "key_weight", "value_weight",
                                                          "query_bias", "key_bias", "value_bias"))
    ln = (p64[pre + "layer_norm_weight"], p64[pre + "layer_norm_bias"]) if input_layernorm else None
    ref2 = ref_mha(x.detach().double(), wq, bq, wk, bk, wv, bv, p64["proj.weight"], p64["proj.bias"], h, g, d,
                   fmt, ref_mask("causal", b, s, s), ln=ln)
    ref2.backward(dy.double())
    for n, p in params.items():
        assert p.grad is not None, n
        # (key_bias has an exactly zero gradient: a per-key constant cancels in the softmax)
        err = float((_c64(p.grad) - p64[n].grad).norm())
        assert err < 1e-4 * float(p64[n].grad.norm()) + 1e-5, n


def test_mha_fused_matches_tutorial_layout():
    """fuse_qkv_params=True: the plain layer's [s, b, heads, 3*kv] view split along the last dim."""
    hidden, h, s, b = 32, 4, 5, 2
    d = hidden // h
    m = MultiheadAttention(hidden, h, attention_dropout=0.0, input_layernorm=True, fuse_qkv_params=True,
                           attn_mask_type="no_mask", device=DEVICE)
    _randomize(m)
    x = torch.randn(s, b, hidden, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():  # float32 reference on the CPU (.cpu(): the module's parameters)
        qkv = torch.nn.functional.layer_norm(x, (hidden,), m.layernorm_qkv.layer_norm_weight.cpu(),
                                             m.layernorm_qkv.layer_norm_bias.cpu(), 1e-5)
        qkv = torch.nn.functional.linear(qkv, m.layernorm_qkv.weight.cpu(),
                                         m.layernorm_qkv.bias.cpu()).view(s, b, h, 3 * d)
        q, k, v = torch.split(qkv, d, dim=3)
        ref = torch.nn.functional.linear(ref_attention(q, k, v, "sbhd", 1 / math.sqrt(d), None).float(),
                                         m.proj.weight.cpu(), m.proj.bias.cpu())
        assert rel_err(m(dev(x)), ref) < TOL


def test_mha_noninterleaved_fused():
    hidden, h, g, d = 32, 4, 2, 8
    m = MultiheadAttention(hidden, h, num_gqa_groups=g, attention_dropout=0.0, fuse_qkv_params=True,
                           qkv_weight_interleaved=False, attn_mask_type="no_mask", device=DEVICE)
    _randomize(m)
    w, bb = m.qkv.weight, m.qkv.bias
    x = torch.randn(6, 2, hidden, generator=torch.Generator().manual_seed(1))
    sizes = [h * d, g * d, g * d]
    wq, wk, wv = torch.split(w, sizes)
    bq, bk, bv = torch.split(bb, sizes)
    ref = ref_mha(x, wq, bq, wk, bk, wv, bv, m.proj.weight, m.proj.bias, h, g, d, "sbhd", None)
    assert rel_err(m(dev(x)), ref) < TOL


@pytest.mark.parametrize("fuse", [False, True])
@pytest.mark.parametrize("input_layernorm", [False, True])
def test_mha_cross(fuse, input_layernorm):
    hidden, h, g, d, b, sq, sk = 32, 4, 2, 8, 2, 5, 7
    m = MultiheadAttention(hidden, h, num_gqa_groups=g, attention_dropout=0.0, attention_type="cross",
                           input_layernorm=input_layernorm, fuse_qkv_params=fuse, attn_mask_type="padding",
                           device=DEVICE)
    _randomize(m)
    qmod = m.layernorm_query if input_layernorm else m.query_layer
    if fuse:
        wq, bq = qmod.weight, qmod.bias
        kvw = m.key_value.weight.view(g, 2, d, hidden)
        kvb = m.key_value.bias.view(g, 2, d)
        wk, wv = kvw[:, 0].reshape(g * d, hidden), kvw[:, 1].reshape(g * d, hidden)
        bk, bv = kvb[:, 0].reshape(-1), kvb[:, 1].reshape(-1)
    else:  # (TE's query_layer is one Linear; layernorm_query is split)
        wq, bq = (qmod.query_weight, qmod.query_bias) if input_layernorm else (qmod.weight, qmod.bias)
        wk, bk, wv, bv = (m.key_value.key_weight, m.key_value.key_bias, m.key_value.value_weight,
                          m.key_value.value_bias)
    ln = (qmod.layer_norm_weight, qmod.layer_norm_bias) if input_layernorm else None
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(sq, b, hidden, generator=gen, requires_grad=True)
    enc = torch.randn(sk, b, hidden, generator=gen, requires_grad=True)
    masks = padding_masks(b, sq, sk)
    out = m(dev(x), attention_mask=dev_mask(masks), encoder_output=dev(enc))
    ref = ref_mha(x, wq, bq, wk, bk, wv, bv, m.proj.weight, m.proj.bias, h, g, d, "sbhd",
                  ref_mask("padding", b, sq, sk, masks), ln=ln, enc=enc)
    assert rel_err(out, ref) < TOL
    out.sum().backward()
    assert enc.grad is not None and all(p.grad is not None for p in m.parameters())


def test_mha_return_bias_and_layernorm_output():
    hidden = 32
    m = MultiheadAttention(hidden, 4, attention_dropout=0.0, input_layernorm=True, return_bias=True,
                           return_layernorm_output=True, attn_mask_type="no_mask", device=DEVICE)
    _randomize(m)
    x = torch.randn(5, 2, hidden, generator=torch.Generator().manual_seed(8))
    out, bias, ln_out = m(dev(x))
    assert bias is m.proj.bias
    sub = m.layernorm_qkv
    ref_ln = torch.nn.functional.layer_norm(x, (hidden,), sub.layer_norm_weight.cpu(), sub.layer_norm_bias.cpu(),
                                            1e-5)
    assert rel_err(ln_out, ref_ln) < TOL
    m2 = MultiheadAttention(hidden, 4, attention_dropout=0.0, input_layernorm=True, attn_mask_type="no_mask",
                            device=DEVICE)
    m2.load_state_dict(m.state_dict())
    assert rel_err(out + bias, m2(dev(x))) < TOL


def test_mha_forward_mask_override_and_state_dict_names():
    m = MultiheadAttention(32, 4, attention_dropout=0.0, attn_mask_type="causal", device=DEVICE)
    _randomize(m)
    x = dev(torch.randn(6, 2, 32, generator=torch.Generator().manual_seed(6)))
    a = m(x)
    b_ = m(x, attn_mask_type="no_mask")
    assert not torch.allclose(a, b_)
    mask = dev(torch.ones(6, 6, dtype=torch.bool).triu(1).view(1, 1, 6, 6))
    c = m(x, attention_mask=mask, attn_mask_type="arbitrary")
    assert rel_err(a, c) < TOL
    keys = [k for k in m.state_dict() if not k.endswith("_extra_state")]
    assert "qkv.query_weight" in keys and "qkv.weight" not in keys


def test_mha_split_params_follow_assignment_and_reset():
    m = MultiheadAttention(32, 4, attention_dropout=0.0, attn_mask_type="no_mask", device=DEVICE)
    x = dev(torch.randn(4, 1, 32, generator=torch.Generator().manual_seed(1)))
    before = m(x)
    m.qkv.query_weight = torch.nn.Parameter(torch.zeros_like(m.qkv.query_weight))
    m.qkv.query_bias = torch.nn.Parameter(torch.zeros_like(m.qkv.query_bias))
    after = m(x)  # zero queries: uniform attention over keys
    assert not torch.allclose(before, after)
    with torch.no_grad():
        m.qkv.reset_parameters()
    assert float(m.qkv.query_weight.detach().abs().sum()) > 0 and float(m.qkv.query_bias.detach().abs().sum()) == 0


def test_mha_meta_device():
    m = MultiheadAttention(32, 4, device="meta", input_layernorm=True)
    assert m.layernorm_qkv.query_weight.device.type == "meta"
    for mod in (m.layernorm_qkv, m.proj):
        mod.reset_parameters()
    assert m.layernorm_qkv.query_weight.device.type != "meta"
    assert float(m.layernorm_qkv.layer_norm_weight.detach().sum()) == 32
    out = m(torch.randn(3, 1, 32, device=m.proj.weight.device))
    assert out.shape == (3, 1, 32)

