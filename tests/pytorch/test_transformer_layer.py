"""te.TransformerLayer against a float64 PyTorch layer built from the same parameters.

Two groups: the layer's own wiring (residuals, dropout, drop-path, decoder, post-norm options) with a
plain-torch stand-in for MultiheadAttention, so it is tested independently of attention/; and the
real layer (with transformer_engine.pytorch.attention), skipped while that module is absent.
The layers run on NVTE_TEST_DEVICE (default the CPU backend); inputs are drawn on the CPU and moved
with dev(), the float64 references stay on the CPU."""
import importlib.util
import math
import os

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling, Format
from transformer_engine.pytorch import transformer as te_transformer
from _util import DEVICE, dev, gelu_tanh, rel_err

F = torch.nn.functional
HAS_MHA = importlib.util.find_spec("transformer_engine.pytorch.attention") is not None and \
    te_transformer.MultiheadAttention is not None
needs_mha = pytest.mark.skipif(not HAS_MHA, reason="transformer_engine.pytorch.attention (MultiheadAttention) "
                                                   "is not present in this build")


# ----------------------------------------------------------------------------- float64 reference
_LEAVES = {}  # id(parameter) -> float64 leaf copy, while a reference runs with gradients


def _p(t):
    if t is None:
        return None
    return _LEAVES[id(t)] if id(t) in _LEAVES else t.detach().double().cpu()


def ref_norm(x, w, b, eps, normalization="LayerNorm"):
    if normalization == "LayerNorm":
        return F.layer_norm(x, (x.shape[-1],), w, b, eps)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def ref_qkv(qkv_mod, h, heads, kv):
    """q, k, v [s, b, heads, kv] from a layernorm_qkv holding split or fused (interleaved) weights."""
    names = dict(qkv_mod.named_parameters())
    if "query_weight" in names:
        return [F.linear(h, _p(names[f"{n}_weight"]), _p(names.get(f"{n}_bias"))).view(*h.shape[:2], heads, kv)
                for n in ("query", "key", "value")]
    qkv = F.linear(h, _p(names["weight"]), _p(names.get("bias"))).view(*h.shape[:2], heads, 3 * kv)
    return list(torch.split(qkv, kv, dim=3))


def ref_attention(q, k, v, causal, bias=None):
    s = q.shape[0]
    scores = torch.einsum("sbhd,tbhd->bhst", q, k) / math.sqrt(q.shape[-1])
    if bias is not None:  # post-scale: added to the scaled scores
        scores = scores + bias
    if causal:
        scores = scores.masked_fill(torch.ones(s, k.shape[0], dtype=torch.bool, device=q.device).triu(1),
                                    float("-inf"))
    out = torch.einsum("bhst,tbhd->sbhd", torch.softmax(scores, -1), v)
    return out.reshape(*out.shape[:2], -1)


def ref_layer(layer, x, causal=True, normalization="LayerNorm", bias=None):
    """float64 forward of `layer` ([s, b, h]) from its parameters (encoder, pre-norm); bias: the
    attention bias added to the scaled scores ([1 or b, heads, s, s])."""
    sa, mlp = layer.self_attention, layer.layernorm_mlp
    qkv_mod = sa.layernorm_qkv
    eps = mlp.eps
    h = ref_norm(x, _p(qkv_mod.layer_norm_weight), _p(getattr(qkv_mod, "layer_norm_bias", None)), eps, normalization)
    q, k, v = ref_qkv(qkv_mod, h, layer.num_attention_heads, layer.kv_channels)
    x = x + F.linear(ref_attention(q, k, v, causal, bias), _p(sa.proj.weight), _p(sa.proj.bias))
    h = ref_norm(x, _p(mlp.layer_norm_weight), _p(mlp.layer_norm_bias), eps, normalization)
    h = gelu_tanh(F.linear(h, _p(mlp.fc1_weight), _p(mlp.fc1_bias)))
    return x + F.linear(h, _p(mlp.fc2_weight), _p(mlp.fc2_bias))


# ----------------------------------------------------------------------------- stand-in attention
class _StubQKV(torch.nn.Module):
    def __init__(self, hidden, eps, input_layernorm):
        super().__init__()
        self.eps, self.input_layernorm = eps, input_layernorm
        if input_layernorm:
            self.layer_norm_weight = torch.nn.Parameter(1 + 0.1 * torch.randn(hidden))
            self.layer_norm_bias = torch.nn.Parameter(0.1 * torch.randn(hidden))
        for n in ("query", "key", "value"):
            setattr(self, f"{n}_weight", torch.nn.Parameter(0.2 * torch.randn(hidden, hidden)))
            setattr(self, f"{n}_bias", torch.nn.Parameter(0.1 * torch.randn(hidden)))


class StubMHA(torch.nn.Module):
    """Plain-torch MultiheadAttention with TE's interface subset the layer uses (sbhd only)."""

    def __init__(self, hidden_size, num_attention_heads, kv_channels=None, attn_mask_type="causal",
                 return_layernorm_output=False, input_layernorm=False, attention_type="self",
                 layernorm_epsilon=1e-5, **kwargs):
        super().__init__()
        self.heads, self.kv = num_attention_heads, kv_channels
        self.attn_mask_type, self.attention_type = attn_mask_type, attention_type
        self.return_layernorm_output = return_layernorm_output
        self.layernorm_qkv = _StubQKV(hidden_size, layernorm_epsilon, input_layernorm)
        self.proj = torch.nn.Linear(hidden_size, hidden_size)
        self.to(kwargs.get("device"))  # the layer's device (parameters drawn on the CPU first)

    def forward(self, x, attention_mask=None, encoder_output=None, attn_mask_type=None, **kw):
        self.last_kwargs = kw  # (what the layer passed on: test_bias_reaches_both_attentions)
        m = self.layernorm_qkv
        h = F.layer_norm(x, (x.shape[-1],), m.layer_norm_weight, m.layer_norm_bias, m.eps) \
            if m.input_layernorm else x
        kv_in = encoder_output if self.attention_type == "cross" else h
        q = F.linear(h, m.query_weight, m.query_bias).view(*h.shape[:2], self.heads, self.kv)
        k = F.linear(kv_in, m.key_weight, m.key_bias).view(*kv_in.shape[:2], self.heads, self.kv)
        v = F.linear(kv_in, m.value_weight, m.value_bias).view(*kv_in.shape[:2], self.heads, self.kv)
        mask_type = attn_mask_type or self.attn_mask_type
        out = self.proj(ref_attention(q, k, v, mask_type == "causal"))
        return (out, h) if self.return_layernorm_output else out


@pytest.fixture
def stub_mha(monkeypatch):
    monkeypatch.setattr(te_transformer, "MultiheadAttention", StubMHA)


def _stub_layer(**kw):
    torch.manual_seed(0)
    args = dict(hidden_dropout=0.0, attention_dropout=0.0, device=DEVICE)
    args.update(kw)
    return te.TransformerLayer(32, 64, 4, **args)


def test_stub_encoder_matches_reference(stub_mha):
    layer = _stub_layer()
    x = torch.randn(6, 2, 32, )
    assert rel_err(layer(dev(x)), ref_layer(layer, x.double())) < 1e-5
    assert rel_err(layer(dev(x), self_attn_mask_type="no_mask"), ref_layer(layer, x.double(), causal=False)) < 1e-5


@pytest.mark.parametrize("impl", ["stub", pytest.param("real", marks=needs_mha)])
def test_layer_options(impl, monkeypatch):
    if impl == "stub":
        monkeypatch.setattr(te_transformer, "MultiheadAttention", StubMHA)
    x = dev(torch.randn(6, 2, 32))  # float32 references from the layer's own submodules, on the device
    # post-layernorm residuals
    layer = _stub_layer(apply_residual_connection_post_layernorm=True)
    sa, mlp = layer.self_attention, layer.layernorm_mlp
    q = sa.layernorm_qkv
    h = F.layer_norm(x, (32,), q.layer_norm_weight, q.layer_norm_bias, 1e-5)
    y1 = h + sa(x)[0]
    h2 = F.layer_norm(y1, (32,), mlp.layer_norm_weight, mlp.layer_norm_bias, 1e-5)
    ref = h2 + F.linear(gelu_tanh(F.linear(h2, mlp.fc1_weight, mlp.fc1_bias)), mlp.fc2_weight, mlp.fc2_bias)
    assert rel_err(layer(x), ref) < 1e-5
    # output layernorm: the attention block has no input norm, the output is normalised
    layer = _stub_layer(output_layernorm=True)
    assert not any("layer_norm" in n for n, _ in layer.self_attention.named_parameters())
    y1 = x + layer.self_attention(x)
    y2 = y1 + layer.layernorm_mlp(y1)
    ref = F.layer_norm(y2, (32,), layer.layernorm.weight, layer.layernorm.bias, 1e-5)
    assert rel_err(layer(x), ref) < 1e-5
    # decoder: cross attention over encoder_output between self attention and the MLP
    layer = _stub_layer(layer_type="decoder")
    enc = dev(torch.randn(5, 2, 32))
    assert layer.inter_attention.attention_type == "cross"
    assert hasattr(layer.inter_attention, "proj")
    y1 = x + layer.self_attention(x)
    y2 = y1 + layer.inter_attention(y1, encoder_output=enc)
    ref = y2 + layer.layernorm_mlp(y2)
    assert rel_err(layer(x, encoder_output=enc), ref) < 1e-5
    with pytest.raises(ValueError, match="encoder_output"):
        layer(x)


def test_stub_dropout_drop_path_and_no_grad(stub_mha):
    x = torch.randn(6, 4, 32, requires_grad=True)
    layer = _stub_layer(hidden_dropout=0.5, drop_path_rate=0.5)
    y_train = layer(dev(x))
    layer.eval()
    y_eval = layer(dev(x))
    assert rel_err(y_eval, ref_layer(layer, x.detach().double())) < 1e-5
    assert rel_err(y_train, y_eval) > 1e-3  # dropout / drop-path active in training only
    layer.train()
    with torch.no_grad():
        y = layer(dev(x))
    assert not y.requires_grad
    y = layer(dev(x))
    y.sum().backward()
    assert x.grad is not None and layer.layernorm_mlp.fc1_weight.grad is not None


def test_decoder_drop_path_skips_cross_attention(stub_mha):
    """TE drops the self-attention and MLP paths of a decoder layer, not its cross attention."""
    layer = _stub_layer(layer_type="decoder", drop_path_rate=0.5)
    seen = []

    class Record(torch.nn.Module):
        def forward(self, t):
            seen.append(t)
            return torch.zeros_like(t)  # every dropped path: the layer is then its input plus the cross branch
    layer.drop_path = Record()
    x, enc = dev(torch.randn(5, 2, 32)), dev(torch.randn(5, 2, 32))
    y = layer(x, encoder_output=enc)
    assert len(seen) == 2
    assert rel_err(y, x + layer.inter_attention(x, encoder_output=enc)) < 1e-6


def test_drop_path_draws_along_dim_0_as_te(stub_mha):
    """TE's TransformerLayer drop path draws one keep/drop per index of dim 0 (the sequence of an
    sbhd input)."""
    torch.manual_seed(1)
    layer = _stub_layer(drop_path_rate=0.5)
    assert layer.drop_path.batch_dim == 0
    x = torch.ones(64, 3, 2, device=DEVICE)
    y = layer.drop_path(x)
    assert (y == y[:, 0:1, 0:1]).all() and set(y[:, 0, 0].tolist()) == {0.0, 2.0}


def test_autocast_casts_the_residual_stream(stub_mha):
    """TE casts hidden_states to torch.autocast's dtype, so the output (residual stream) is in it."""
    layer = te.TransformerLayer(32, 64, 4, hidden_dropout=0.0, attention_dropout=0.0, device=DEVICE)
    x = dev(torch.randn(5, 2, 32))
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.bfloat16
    assert layer(x).dtype == torch.float32


def test_drop_path_module():
    torch.manual_seed(0)
    dp = te_transformer.DropPath(0.5, batch_dim=1)
    x = torch.ones(3, 64, 2, device=DEVICE)
    y = dp(x)
    per_sample = y[0, :, 0]
    assert set(per_sample.tolist()) == {0.0, 2.0} and (y == y[0:1, :, 0:1]).all()
    dp.eval()
    assert torch.equal(dp(x), x)
    with pytest.raises(ValueError):
        te_transformer.DropPath(1.0)


def test_bad_arguments(stub_mha):
    with pytest.raises(ValueError, match="layer_type"):
        te.TransformerLayer(32, 64, 4, layer_type="bogus", device=DEVICE)
    with pytest.raises(ValueError, match="attn_input_format"):
        te.TransformerLayer(32, 64, 4, attn_input_format="thd_x", device=DEVICE)
    with pytest.raises(NotImplementedError):
        te.TransformerLayer(32, 64, 4, tp_size=2, device=DEVICE)
    layer = te.TransformerLayer(32, 64, 4, device=DEVICE)
    with pytest.raises(ValueError, match="hidden_states"):
        layer(dev(torch.randn(4, 32)))


def test_head_size_rounds_down_without_kv_channels():
    """hidden_size not divisible by the heads and no kv_channels: head size hidden // heads, as TE
    and MultiheadAttention take it (it raised); the layer's attention has 4 x 7 channels."""
    layer = te.TransformerLayer(30, 40, 4, device=DEVICE, hidden_dropout=0.0, attention_dropout=0.0)
    assert layer.self_attention.hidden_size_per_attention_head == 7
    assert te.MultiheadAttention(30, 4, device=DEVICE).hidden_size_per_attention_head == 7
    assert layer.self_attention.proj.weight.shape == (30, 28)
    x = dev(torch.randn(5, 2, 30)).requires_grad_()
    y = layer(x)
    y.sum().backward()
    assert y.shape == (5, 2, 30) and torch.isfinite(x.grad).all()


def test_bias_reaches_both_attentions(stub_mha):
    """The attention bias, ALiBi slopes, checkpointing and zero-fill arguments go to the self and the
    cross attention (as TE passes them); window, RoPE and the K/V cache to the self attention only."""
    layer = _stub_layer(layer_type="decoder")
    x, enc = dev(torch.randn(6, 2, 32)), dev(torch.randn(6, 2, 32))
    bias, slopes = dev(torch.randn(1, 4, 6, 6)), dev(torch.rand(4))
    layer(x, encoder_output=enc, core_attention_bias_type="post_scale_bias", core_attention_bias=bias,
          alibi_slopes=slopes, checkpoint_core_attention=True, fast_zero_fill=False, window_size=(2, 0))
    for m in (layer.self_attention, layer.inter_attention):
        kw = m.last_kwargs
        assert kw["core_attention_bias_type"] == "post_scale_bias" and kw["core_attention_bias"] is bias
        assert kw["alibi_slopes"] is slopes and kw["checkpoint_core_attention"] is True
        assert kw["fast_zero_fill"] is False
    assert layer.self_attention.last_kwargs["window_size"] == (2, 0)
    assert "window_size" not in layer.inter_attention.last_kwargs


def test_module_paths():
    assert te.TransformerLayer is te.transformer.TransformerLayer
    assert "TransformerLayer" in te.__all__


# ----------------------------------------------------------------------------- the real layer
def _real_layer(**kw):
    torch.manual_seed(0)
    args = dict(hidden_dropout=0.0, attention_dropout=0.0, device=DEVICE)
    args.update(kw)
    return te.TransformerLayer(64, 128, 4, **args)


@needs_mha
def test_default_parameter_names():
    layer = te.TransformerLayer(64, 256, 4, device=DEVICE)
    names = sorted(n for n, _ in layer.self_attention.layernorm_qkv.named_parameters())
    assert names == sorted(["layer_norm_weight", "layer_norm_bias", "query_weight", "query_bias", "key_weight",
                            "key_bias", "value_weight", "value_bias"])
    assert {"weight", "bias"} <= {n for n, _ in layer.self_attention.proj.named_parameters()}
    assert sorted(n for n, _ in layer.layernorm_mlp.named_parameters()) == sorted(
        ["layer_norm_weight", "layer_norm_bias", "fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias"])
    assert not hasattr(layer, "inter_attention") and not hasattr(layer, "layernorm")
    fused = te.TransformerLayer(64, 256, 4, fuse_qkv_params=True, device=DEVICE)
    assert {"weight", "bias"} <= {n for n, _ in fused.self_attention.layernorm_qkv.named_parameters()}


@needs_mha
@pytest.mark.parametrize("fuse_qkv_params", [False, True])
@pytest.mark.parametrize("mask", ["causal", "no_mask"])
def test_real_layer_matches_reference(fuse_qkv_params, mask):
    layer = _real_layer(fuse_qkv_params=fuse_qkv_params, self_attn_mask_type=mask)
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(dev(0.05 * torch.randn(p.shape)))
    x = torch.randn(8, 2, 64, requires_grad=True)
    y = layer(dev(x))
    xr = x.detach().double()
    assert rel_err(y, ref_layer(layer, xr, causal=mask == "causal")) < 1e-4
    # forward-time mask override
    other = "no_mask" if mask == "causal" else "causal"
    assert rel_err(layer(dev(x), self_attn_mask_type=other), ref_layer(layer, xr, causal=other == "causal")) < 1e-4
    # gradients against autograd of the reference run on float64 leaf copies of the parameters
    dy = torch.randn(y.shape)
    y.backward(dev(dy))
    params = dict(layer.named_parameters())
    _LEAVES.update({id(p): p.detach().double().cpu().clone().requires_grad_(True) for p in params.values()})
    try:
        xr = xr.clone().requires_grad_(True)
        ref_layer(layer, xr, causal=mask == "causal").backward(dy.double())
        assert rel_err(x.grad, xr.grad) < 1e-4
        for n, p in params.items():
            ref = _LEAVES[id(p)].grad
            # key biases get a zero gradient (softmax ignores a per-query constant): compare absolutely there
            ok = rel_err(p.grad, ref) < 1e-4 or float((p.grad.double().cpu() - ref).abs().max()) < 1e-6
            assert ok, n
    finally:
        _LEAVES.clear()


@needs_mha
def test_real_layer_bshd():
    sb = _real_layer()
    bs = _real_layer(attn_input_format="bshd")
    bs.load_state_dict(sb.state_dict())
    x = dev(torch.randn(8, 2, 64))
    assert rel_err(bs(x.transpose(0, 1)).transpose(0, 1), sb(x)) < 1e-5


@needs_mha
def test_real_layer_no_grad_and_backward():
    layer = _real_layer()
    x = torch.randn(8, 2, 64, requires_grad=True)
    with torch.no_grad():
        y = layer(dev(x))
    assert not y.requires_grad
    layer(dev(x)).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    for n, p in layer.named_parameters():
        assert p.grad is not None, n


@needs_mha
def test_real_layer_fp8():
    layer = _real_layer()
    x = torch.randn(16, 2, 64, requires_grad=True)
    with torch.no_grad():
        y_hp = layer(dev(x))
    recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=4)
    for _ in range(3):
        with te.fp8_autocast(enabled=True, fp8_recipe=recipe):
            y = layer(dev(x))
        y.sum().backward()
    e = rel_err(y, y_hp)
    assert 1e-5 < e < 0.1


def _alibi_ref_bias(heads, s):
    """[1, heads, s, s]: -slope * |i - j| with TE's default slopes (2^(-8k/heads), heads a power of 2)."""
    slopes = 2.0 ** (-8.0 / heads * torch.arange(1, heads + 1, dtype=torch.float64))
    i = torch.arange(s, dtype=torch.float64)
    return -slopes.view(1, heads, 1, 1) * (i.view(s, 1) - i.view(1, s)).abs()


@needs_mha
@pytest.mark.parametrize("kind", ["post_scale_bias", "alibi"])
@pytest.mark.parametrize("mask", ["causal", "no_mask"])
def test_real_layer_core_attention_bias(kind, mask):
    """TransformerLayer.forward's core_attention_bias_type / core_attention_bias reach attention:
    output, input gradient and (post_scale_bias) the bias's gradient against the float64 layer."""
    layer = _real_layer(self_attn_mask_type=mask)
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(dev(0.05 * torch.randn(p.shape)))
    s, heads = 8, 4
    x = torch.randn(s, 2, 64, requires_grad=True)
    if kind == "post_scale_bias":
        bias = torch.randn(1, heads, s, s, requires_grad=True)
        bias_dev = dev(bias.detach()).requires_grad_(True)
        y = layer(dev(x), core_attention_bias_type=kind, core_attention_bias=bias_dev)
        ref_bias = bias.detach().double().requires_grad_(True)
    else:
        y = layer(dev(x), core_attention_bias_type=kind)
        ref_bias = _alibi_ref_bias(heads, s)
    xr = x.detach().double().requires_grad_(True)
    ref = ref_layer(layer, xr, causal=mask == "causal", bias=ref_bias)
    assert rel_err(y, ref) < 1e-4
    assert rel_err(y, ref_layer(layer, xr.detach(), causal=mask == "causal")) > 1e-3  # the bias mattered
    dy = torch.randn(y.shape)
    y.backward(dev(dy))
    ref.backward(dy.double())
    assert rel_err(x.grad, xr.grad) < 1e-4
    if kind == "post_scale_bias":
        assert rel_err(bias_dev.grad, ref_bias.grad) < 1e-4


@needs_mha
def test_parallel_attention_mlp():
    """parallel_attention_mlp (TE, Falcon-style): attention and MLP read the same input, each with
    its own norm, and their sum joins the residual: x + attn(ln1(x)) + mlp(ln2(x))."""
    layer = _real_layer(parallel_attention_mlp=True)
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(dev(0.05 * torch.randn(p.shape)))
    x = torch.randn(8, 2, 64, requires_grad=True)
    y = layer(dev(x))
    sa, mlp = layer.self_attention, layer.layernorm_mlp
    xr = x.detach().double().requires_grad_(True)
    h = ref_norm(xr, _p(sa.layernorm_qkv.layer_norm_weight), _p(sa.layernorm_qkv.layer_norm_bias), mlp.eps)
    q, k, v = ref_qkv(sa.layernorm_qkv, h, layer.num_attention_heads, layer.kv_channels)
    attn = F.linear(ref_attention(q, k, v, True), _p(sa.proj.weight), _p(sa.proj.bias))
    h2 = ref_norm(xr, _p(mlp.layer_norm_weight), _p(mlp.layer_norm_bias), mlp.eps)
    m = F.linear(gelu_tanh(F.linear(h2, _p(mlp.fc1_weight), _p(mlp.fc1_bias))), _p(mlp.fc2_weight), _p(mlp.fc2_bias))
    ref = xr + attn + m
    assert rel_err(y, ref) < 1e-4
    dy = torch.randn(y.shape)
    y.backward(dev(dy))
    ref.backward(dy.double())
    assert rel_err(x.grad, xr.grad) < 1e-4
    with pytest.raises(NotImplementedError, match="parallel_attention_mlp"):
        _real_layer(parallel_attention_mlp=True, layer_type="decoder")


@needs_mha
def test_constructor_options_reach_attention_or_raise():
    """TE constructor options: the RoPE / QK-norm ones go to MultiheadAttention, bias_dropout_fusion
    changes nothing, an unimplemented one set raises, an unknown name is a TypeError."""
    layer = _real_layer(rotary_pos_interleaved=True, bias_dropout_fusion=True, qk_norm_eps=1e-6)
    assert layer.self_attention.rotary_pos_interleaved
    assert _real_layer(qk_norm_type="RMSNorm").self_attention.q_norm is not None  # (test_qk_norm.py)
    # (the ub_* overlaps are accepted at tp_size 1: test_module_te_compat.py)
    with pytest.raises(NotImplementedError, match="activation_params"):
        _real_layer(activation_params={"limit": 7.0})
    with pytest.raises(TypeError, match="unexpected keyword argument 'parallel_atention_mlp'"):  # (misspelt)
        _real_layer(parallel_atention_mlp=True)


@needs_mha
def test_decoder_cross_attention_keeps_its_norm_with_output_layernorm():
    """output_layernorm=True drops the self attention's input norm (post-norm); the cross attention
    keeps its own (layernorm_query), as in TE."""
    layer = _real_layer(layer_type="decoder", output_layernorm=True)
    assert not hasattr(layer.self_attention, "layernorm_qkv") and hasattr(layer.self_attention, "qkv")
    assert hasattr(layer.inter_attention, "layernorm_query")
    assert "inter_attention.layernorm_query.layer_norm_weight" in layer.state_dict()
