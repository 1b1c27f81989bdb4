"""te.LayerNormMLP with every supported activation and both norms, against float64 PyTorch.
The module runs on NVTE_TEST_DEVICE (default the CPU backend); references stay on the CPU."""
import numpy as np
import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling
from _util import DEVICE, dev, gelu_tanh, rel_err

F = torch.nn.functional

ELEMENTWISE = {
    "gelu": gelu_tanh,
    "relu": F.relu,
    "qgelu": lambda x: x * torch.sigmoid(1.702 * x),
    "srelu": lambda x: F.relu(x) ** 2,
    "silu": F.silu,
}
GATED = {"geglu": "gelu", "reglu": "relu", "swiglu": "silu", "qgeglu": "qgelu", "sreglu": "srelu"}


def ref_act(name, x):
    if name in GATED:
        h = x.shape[-1] // 2
        return ELEMENTWISE[GATED[name]](x[..., :h]) * x[..., h:]
    return ELEMENTWISE[name](x)


def ref_mlp(m, x):
    """float64 reference from m's own parameters (leaf copies, for gradients)."""
    p = {n: t.detach().double().cpu().clone().requires_grad_(True) for n, t in m.named_parameters()}
    if m.normalization == "LayerNorm":
        h = F.layer_norm(x, (x.shape[-1],), p["layer_norm_weight"], p["layer_norm_bias"], m.eps)
    else:
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + m.eps) * p["layer_norm_weight"]
    h = ref_act(m.activation, F.linear(h, p["fc1_weight"], p.get("fc1_bias")))
    return F.linear(h, p["fc2_weight"], p.get("fc2_bias")), p


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("activation", list(ELEMENTWISE) + list(GATED))
def test_layernorm_mlp_activation_fwd_bwd(activation, normalization):
    torch.manual_seed(0)
    hidden, ffn = 32, 48
    m = te.LayerNormMLP(hidden, ffn, normalization=normalization, activation=activation, device=DEVICE,
                        init_method=lambda w: torch.nn.init.normal_(w, std=0.2))
    with torch.no_grad():
        m.layer_norm_weight.uniform_(0.5, 1.5)
        if m.layer_norm_bias is not None:
            m.layer_norm_bias.uniform_(-0.2, 0.2)
        m.fc1_bias.uniform_(-0.2, 0.2)
        m.fc2_bias.uniform_(-0.2, 0.2)
    f1 = 2 * ffn if activation in GATED else ffn
    assert tuple(m.fc1_weight.shape) == (f1, hidden) and tuple(m.fc1_bias.shape) == (f1,)
    assert tuple(m.fc2_weight.shape) == (hidden, ffn)
    x = torch.randn(5, 3, hidden, requires_grad=True)
    y = m(dev(x))
    dy = torch.randn(y.shape)
    y.backward(dev(dy))
    xr = x.detach().double().requires_grad_(True)
    yr, p = ref_mlp(m, xr)
    yr.backward(dy.double())
    assert rel_err(y, yr) < 1e-5
    assert rel_err(x.grad, xr.grad) < 1e-5
    for n, t in m.named_parameters():
        assert rel_err(t.grad, p[n].grad) < 1e-5, n


@pytest.mark.parametrize("activation", ["relu", "swiglu", "geglu"])
def test_layernorm_mlp_activation_fp8_runs(activation):
    torch.manual_seed(1)
    m = te.LayerNormMLP(64, 64, activation=activation, device=DEVICE)
    x = torch.randn(16, 64, requires_grad=True)
    with torch.no_grad():
        y_hp = m(dev(x))
    for _ in range(3):
        with te.fp8_autocast(enabled=True, fp8_recipe=DelayedScaling()):
            y = m(dev(x))
        y.sum().backward()
    e = rel_err(y, y_hp)
    assert np.isfinite(e) and 1e-6 < e < 0.1
    assert torch.isfinite(x.grad).all() and torch.isfinite(m.fc1_weight.grad).all()


def test_layernorm_mlp_bad_activation():
    with pytest.raises(ValueError, match="activation"):
        te.LayerNormMLP(8, 8, activation="tanh", device=DEVICE)


def test_layernorm_mlp_activation_no_grad():
    m = te.LayerNormMLP(16, 16, activation="swiglu", device=DEVICE)
    with torch.no_grad():
        y = m(dev(torch.randn(4, 16, requires_grad=True)))
    assert not y.requires_grad
