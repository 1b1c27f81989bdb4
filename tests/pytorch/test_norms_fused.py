"""te.LayerNorm / te.RMSNorm / te.LayerNormLinear / te.LayerNormMLP vs float64 PyTorch.
The modules run on NVTE_TEST_DEVICE (default the CPU backend); inputs are drawn on the CPU and moved
with dev(), the float64 references stay on the CPU."""
import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common import recipe
from _util import DEVICE, cpu64, dev, gelu_tanh, gemm_dim, rel_err, seeded


def ref_norm(x, w, b, eps, zcg, kind):
    x = x.double()
    g = w.double() + 1 if zcg else w.double()
    if kind == "LayerNorm":
        y = (x - x.mean(-1, keepdim=True)) / torch.sqrt(x.var(-1, unbiased=False, keepdim=True) + eps) * g
        return y + b.double()
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * g


def _leaf64(t):
    return cpu64(t).requires_grad_()


def _randomize(m, g):
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.dim() == 2 else 1.0))


@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("zcg", [False, True])
def test_norm_fwd_bwd(rng, kind, zcg):
    g = seeded(rng)
    m = (te.LayerNorm if kind == "LayerNorm" else te.RMSNorm)(24, eps=1e-3, zero_centered_gamma=zcg, device=DEVICE)
    init = torch.zeros(24) if zcg else torch.ones(24)
    assert torch.equal(m.weight.detach().cpu(), init)
    _randomize(m, g)
    x = (torch.randn(2, 5, 24, generator=g) * 2 + 1).requires_grad_()
    y = m(dev(x))
    assert y.shape == x.shape
    x64, w64 = _leaf64(x), _leaf64(m.weight)
    b64 = _leaf64(m.bias) if kind == "LayerNorm" else None
    ref = ref_norm(x64, w64, b64, 1e-3, zcg, kind)
    assert rel_err(y, ref) < 1e-5
    dy = torch.randn(y.shape, generator=g)
    y.backward(dev(dy))
    ref.backward(dy.double())
    assert rel_err(x.grad, x64.grad) < 1e-5
    assert rel_err(m.weight.grad, w64.grad) < 1e-5
    if kind == "LayerNorm":
        assert rel_err(m.bias.grad, b64.grad) < 1e-5


def test_norm_meta_and_errors():
    m = te.RMSNorm(8, device="meta")
    m.reset_parameters()
    assert m.weight.device.type != "meta" and torch.equal(m.weight.detach().cpu(), torch.ones(8))
    ln = te.LayerNorm(8, device=DEVICE)
    with pytest.raises(ValueError, match="last dimension must be 8"):
        ln(dev(torch.randn(3, 4)))
    with pytest.raises(TypeError, match="params_dtype"):
        te.LayerNorm(8, params_dtype=torch.int32)


def _lnl_ref(m, x64, params):
    ln_w, ln_b, w, b = params
    ln = ref_norm(x64, ln_w, ln_b, m.eps, m.zero_centered_gamma, m.normalization)
    return ln @ w.t() + b, ln


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_layernorm_linear_fwd_bwd(rng, normalization):
    g = seeded(rng)
    m = te.LayerNormLinear(16, 12, normalization=normalization, return_layernorm_output=True, device=DEVICE)
    _randomize(m, g)
    names = ["layer_norm_weight", "layer_norm_bias", "weight", "bias"]
    x = torch.randn(3, 4, 16, generator=g, requires_grad=True)
    y, ln = m(dev(x))
    assert y.shape == (3, 4, 12) and ln.shape == x.shape
    x64 = _leaf64(x)
    p64 = [_leaf64(getattr(m, n)) if getattr(m, n) is not None else None for n in names]
    ref, ln_ref = _lnl_ref(m, x64, [p if p is not None else torch.zeros(16, dtype=torch.float64) for p in p64])
    assert rel_err(y, ref) < 1e-5 and rel_err(ln, ln_ref) < 1e-5
    dy = torch.randn(y.shape, generator=g)
    y.backward(dev(dy))
    ref.backward(dy.double())
    assert rel_err(x.grad, x64.grad) < 1e-5
    for n, p in zip(names, p64):
        if p is not None:
            assert rel_err(getattr(m, n).grad, p.grad) < 1e-5, n


def _mlp_ref(m, x64, p):
    ln = ref_norm(x64, p["layer_norm_weight"], p["layer_norm_bias"], m.eps, False, "LayerNorm")
    h = gelu_tanh(ln @ p["fc1_weight"].t() + p["fc1_bias"])
    return h @ p["fc2_weight"].t() + p["fc2_bias"]


@pytest.mark.parametrize("fp8", [False, True])
def test_layernorm_mlp_fwd_bwd(rng, fp8):
    g = seeded(rng)
    m = te.LayerNormMLP(16, 48, device=DEVICE)
    _randomize(m, g)
    names = [n for n, _ in m.named_parameters()]  # (TE's registration order)
    assert names == ["layer_norm_weight", "layer_norm_bias", "fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias"]
    seq = gemm_dim(10)  # tokens 2 x 10 on the CPU, 2 x 16 on CUDA (FP8 GEMM dims 16-aligned)
    x = torch.randn(2, seq, 16, generator=g, requires_grad=True)
    dy = torch.randn(2, seq, 16, generator=g)
    # E4M3 gradients (3 mantissa bits) keep the twice-propagated FP8 error of fc1 well below 0.1
    r = recipe.DelayedScaling(amax_history_len=2, fp8_format=recipe.Format.E4M3)
    for _ in range(3 if fp8 else 1):  # FP8: let the delayed scales settle
        x.grad = None
        m.zero_grad(set_to_none=True)
        with te.fp8_autocast(enabled=fp8, fp8_recipe=r):
            y = m(dev(x))
        y.backward(dev(dy))
    x64 = _leaf64(x)
    p64 = {n: _leaf64(p) for n, p in m.named_parameters()}
    ref = _mlp_ref(m, x64, p64)
    ref.backward(dy.double())
    tol = 0.1 if fp8 else 1e-5
    e = rel_err(y, ref)
    assert e < tol and (e > 1e-4 or not fp8)
    assert rel_err(x.grad, x64.grad) < tol
    for n, p in m.named_parameters():
        # norm-parameter grads are sums over tokens of a twice-FP8-propagated gradient: cancellation
        # makes their relative error larger (still FP8-sized)
        t = 0.3 if fp8 and n.startswith("layer_norm") else tol
        assert rel_err(p.grad, p64[n].grad) < t, n
    if fp8:
        h = m.fp8_meta.amax_history
        assert h["fwd"].shape == (2, 6) and h["bwd"].shape == (2, 4)
        assert bool((m.fp8_meta.scale["fwd"][[0, 1, 3, 4]] != 1).all())  # fc1/fc2 inputs and weights
        assert bool((m.fp8_meta.scale["bwd"][[0, 2]] != 1).all())  # fc1/fc2 output grads


def test_layernorm_linear_fp8(rng):
    g = seeded(rng)
    m = te.LayerNormLinear(32, 16, device=DEVICE)
    _randomize(m, g)
    x = torch.randn(gemm_dim(8), 32, generator=g)  # tokens 8 on the CPU, 16 on CUDA
    for _ in range(2):
        with te.fp8_autocast(fp8_recipe=recipe.DelayedScaling(amax_history_len=2)):
            y = m(dev(x))
        y.sum().backward()
    with torch.no_grad():
        ref, _ = _lnl_ref(m, x.double(), [cpu64(p) for p in
                                          (m.layer_norm_weight, m.layer_norm_bias, m.weight, m.bias)])
    e = rel_err(y, ref)
    assert 1e-4 < e < 0.1


@pytest.mark.parametrize("module,normalization", [("LayerNormLinear", "LayerNorm"), ("LayerNormLinear", "RMSNorm"),
                                                  ("LayerNormMLP", "LayerNorm"), ("LayerNormMLP", "RMSNorm")])
def test_norm_writes_fp8_directly_under_delayed_scaling(rng, module, normalization):
    """Under DelayedScaling the norm's output goes to FP8 inside the norm kernel (no high-precision
    copy; custom_ops.norm_fwd_fp8). It must equal the unfused path (norm in the module's float32
    dtype, then the FP8 cast), which return_layernorm_output=True keeps: outputs, every gradient
    and the recipe state after three steps (weight gradients read the norm's transposed FP8
    copy), and only the fused module calls norm_fwd_fp8."""
    from transformer_engine.pytorch import custom_ops
    g = seeded(rng)
    mods = []
    for _ in range(2):
        kw = dict(normalization=normalization, device=DEVICE, bias=True)
        m = te.LayerNormLinear(32, 16, **kw) if module == "LayerNormLinear" else te.LayerNormMLP(32, 48, **kw)
        mods.append(m)
    _randomize(mods[0], g)
    mods[1].load_state_dict(mods[0].state_dict())
    mods[1].return_layernorm_output = True  # keeps the high-precision norm output: the unfused path
    x = torch.randn(gemm_dim(8), 32, generator=g)
    dy = torch.randn(gemm_dim(8), 32 if module == "LayerNormMLP" else 16, generator=g)
    r = recipe.DelayedScaling(amax_history_len=2)
    calls = []
    fused_op = custom_ops.norm_fwd_fp8
    custom_ops.norm_fwd_fp8 = lambda *a, **k: calls.append(1) or fused_op(*a, **k)
    try:
        res = []
        for i, m in enumerate(mods):
            xs = dev(x).requires_grad_()
            for _ in range(3):
                xs.grad = None
                m.zero_grad(set_to_none=True)
                with te.fp8_autocast(fp8_recipe=r):
                    y = m(xs)
                y = y[0] if isinstance(y, tuple) else y
                y.backward(dev(dy))
            if i == 0:
                assert len(calls) == 3
            res.append((y.detach(), xs.grad, {n: p.grad for n, p in m.named_parameters()}, m.fp8_meta))
    finally:
        custom_ops.norm_fwd_fp8 = fused_op
    assert len(calls) == 3  # the unfused module did not call it
    (y0, dx0, g0, m0), (y1, dx1, g1, m1) = res
    torch.testing.assert_close(y0, y1, rtol=0, atol=0)
    torch.testing.assert_close(dx0, dx1, rtol=0, atol=0)
    for n in g0:
        if g0[n] is not None or g1[n] is not None:
            torch.testing.assert_close(g0[n], g1[n], rtol=0, atol=0, msg=n)
    for key in ("fwd", "bwd"):
        torch.testing.assert_close(m0.amax_history[key], m1.amax_history[key], rtol=0, atol=0)
        torch.testing.assert_close(m0.scale[key], m1.scale[key], rtol=0, atol=0)


def test_mlp_bad_activation():
    with pytest.raises(ValueError, match="activation"):
        te.LayerNormMLP(8, 16, activation="tanh", device=DEVICE)
