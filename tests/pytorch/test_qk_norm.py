"""MultiheadAttention / TransformerLayer query-key normalization (TE's qk_norm_type, qk_norm_eps,
qk_norm_before_rope): the norm modules against float64 formulas (values and input gradients, odd
head sizes), where the norm sits (on the q / k that reach DotProductAttention, after RoPE or
before it), TE's parameter names, the error for an unknown type, and a FP8 (fp8_mha) run."""
import math

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling
from transformer_engine.pytorch.attention.qk_norm import L2Normalization, make_qk_norms

from _util import DEVICE, dev, rel_err

TYPES = ["RMSNorm", "LayerNorm", "L2Normalization"]


def norm_ref(kind, x, eps, w=None, b=None):
    """float64 normalization over the last dimension."""
    x = x.double()
    if kind == "L2Normalization":
        return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)
    if kind == "RMSNorm":
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w.double()
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + eps) * w.double() + b.double()


@pytest.mark.parametrize("kind", TYPES)
@pytest.mark.parametrize("d", [8, 13, 64])
def test_norm_modules_against_float64(kind, d):
    g = torch.Generator().manual_seed(d)
    eps = 1e-3
    qn, kn = make_qk_norms(kind, d, eps, DEVICE)
    assert (qn is kn) == (kind == "L2Normalization")  # (TE shares its parameter-free instance)
    w = b = None
    if kind != "L2Normalization":
        with torch.no_grad():
            qn.weight.copy_(torch.rand(d, generator=g) + 0.5)
            if kind == "LayerNorm":
                qn.bias.copy_(torch.randn(d, generator=g))
        w, b = qn.weight.detach().cpu(), (qn.bias.detach().cpu() if kind == "LayerNorm" else None)
    for x in (torch.randn(3, 5, 2, d, generator=g) * 3, torch.arange(2 * d, dtype=torch.float32).view(2, 1, d)):
        x = x.requires_grad_()
        y = qn(dev(x))
        assert y.dtype == x.dtype and y.shape == x.shape
        x64 = x.detach().double().requires_grad_()
        ref = norm_ref(kind, x64, eps, w, b)
        assert rel_err(y, ref) < 1e-5, kind
        dy = torch.randn(x.shape, generator=g)
        y.backward(dev(dy))
        ref.backward(dy.double())
        assert rel_err(x.grad, x64.grad) < 1e-4, kind


def _capture(mha, monkeypatch):
    """The q, k MultiheadAttention hands its DotProductAttention, per call."""
    seen = []
    real = mha.core_attention.forward

    def spy(q, k, v, *a, **kw):
        seen.append((q.detach().cpu(), k.detach().cpu()))
        return real(q, k, v, *a, **kw)
    monkeypatch.setattr(mha.core_attention, "forward", spy)
    return seen


@pytest.mark.parametrize("kind", TYPES)
@pytest.mark.parametrize("before_rope", [False, True])
def test_mha_normalizes_q_and_k_where_te_does(kind, before_rope, monkeypatch):
    """The q / k reaching attention are norm(rope(q)) (default) or rope(norm(q)) (qk_norm_before_rope),
    with q, k those of the same module without a QK norm; TE's parameter names; the output moves."""
    torch.manual_seed(0)
    s, b, hidden, heads, groups, eps = 6, 2, 48, 4, 2, 1e-5
    kw = dict(num_gqa_groups=groups, attention_dropout=0.0, device=DEVICE, attn_mask_type="causal")
    mha = te.MultiheadAttention(hidden, heads, qk_norm_type=kind, qk_norm_eps=eps, qk_norm_before_rope=before_rope,
                                **kw)
    plain = te.MultiheadAttention(hidden, heads, **kw)
    names = {n for n, _ in mha.named_parameters()} - {n for n, _ in plain.named_parameters()}
    want = {"RMSNorm": {"q_norm.weight", "k_norm.weight"}, "L2Normalization": set(),
            "LayerNorm": {"q_norm.weight", "k_norm.weight", "q_norm.bias", "k_norm.bias"}}[kind]
    assert names == want
    plain.load_state_dict({k: v for k, v in mha.state_dict().items() if not k.startswith(("q_norm", "k_norm"))})
    if kind != "L2Normalization":
        with torch.no_grad():  # distinct gains for q and k, so a swap shows
            mha.q_norm.weight.uniform_(0.5, 1.5)
            mha.k_norm.weight.uniform_(0.5, 1.5)
    rope = te.RotaryPositionEmbedding(hidden // heads)(s).to(DEVICE)
    x = dev(torch.randn(s, b, hidden))
    got_qk, plain_qk = _capture(mha, monkeypatch), _capture(plain, monkeypatch)
    out = mha(x, rotary_pos_emb=rope)
    plain(x, rotary_pos_emb=None if before_rope else rope)
    (q, k), (q0, k0) = got_qk[0], plain_qk[0]

    def ref(t, norm):
        w = None if kind == "L2Normalization" else norm.weight.detach().cpu()
        bb = norm.bias.detach().cpu() if kind == "LayerNorm" else None
        return norm_ref(kind, t, eps, w, bb)
    if before_rope:
        want_q = te.apply_rotary_pos_emb(ref(q0, mha.q_norm).float(), rope.cpu(), "sbhd")
        want_k = te.apply_rotary_pos_emb(ref(k0, mha.k_norm).float(), rope.cpu(), "sbhd")
    else:
        want_q, want_k = ref(q0, mha.q_norm), ref(k0, mha.k_norm)
    assert rel_err(q, want_q) < 1e-5 and rel_err(k, want_k) < 1e-5
    assert q.dtype == x.dtype and k.dtype == x.dtype
    out.float().sum().backward()
    if kind != "L2Normalization":
        assert mha.q_norm.weight.grad is not None and mha.k_norm.weight.grad.abs().sum() > 0


def test_transformer_layer_and_errors():
    layer = te.TransformerLayer(32, 64, 4, qk_norm_type="RMSNorm", qk_norm_eps=1e-6, hidden_dropout=0.0,
                                attention_dropout=0.0, device=DEVICE)
    assert {"self_attention.q_norm.weight", "self_attention.k_norm.weight"} <= set(layer.state_dict())
    y = layer(dev(torch.randn(5, 2, 32)))
    y.float().sum().backward()
    assert layer.self_attention.q_norm.weight.grad is not None
    with pytest.raises(ValueError, match="qk_norm_type must be None or one of"):
        te.MultiheadAttention(32, 4, qk_norm_type="rms", device=DEVICE)


def test_qk_norm_under_fp8_mha():
    """fp8_mha hands FP8 Q, K, V from the projection to attention; a QK norm needs them in high
    precision in between, so such a module runs its attention as fp8_dpa does: the same result
    as a copy of it under fp8_dpa alone (fresh FP8 state each)."""
    import copy
    torch.manual_seed(1)
    mha = te.MultiheadAttention(64, 4, qk_norm_type="L2Normalization", attention_dropout=0.0, device=DEVICE)
    twin = copy.deepcopy(mha)
    x = dev(torch.randn(128, 2, 64))  # (cuDNN's FP8 backward: sequence lengths multiples of 128)
    with te.fp8_autocast(fp8_recipe=DelayedScaling(fp8_dpa=True, fp8_mha=True)):
        a = mha(x)
    with te.fp8_autocast(fp8_recipe=DelayedScaling(fp8_dpa=True, fp8_mha=False)):
        b = twin(x)
    assert torch.isfinite(a).all()
    assert torch.equal(a, b)
