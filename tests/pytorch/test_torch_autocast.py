"""torch.autocast around TE modules with float32 parameters (TE's semantics, the usual mixed-precision
set-up of integrations that keep float32 weights): the module computes in autocast's dtype, its
outputs come in that dtype and its parameters' gradients in float32. Checked exactly against the
same module built with bfloat16 parameters (same kernels, same operands): outputs equal bit for bit
and the float32 gradients equal the bfloat16 twin's gradients converted, in high precision and over
several FP8 delayed-scaling steps (whose recipe state must match too)."""
import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common import recipe
from _util import DEVICE, gemm_dim, seeded

BF16 = torch.bfloat16


def _twins(make):
    """(module with float32 parameters, the same module with those parameters in bfloat16)."""
    m32 = make(torch.float32)
    m16 = make(BF16)
    m16.load_state_dict(m32.state_dict())  # copy_ rounds each parameter to bfloat16
    return m32, m16


def _check(make, in_shape, rng, fp8, extra=(), steps=1, input_dtype=torch.float32):
    m32, m16 = _twins(make)
    gen = seeded(rng)
    for _ in range(steps):
        x = torch.randn(*in_shape, generator=gen).to(input_dtype)
        x32 = x.to(DEVICE).clone().requires_grad_()
        x16 = x.to(BF16).to(DEVICE).clone().requires_grad_()
        for m in (m32, m16):
            m.zero_grad(set_to_none=True)
        with torch.autocast(DEVICE.type, dtype=BF16), \
                te.fp8_autocast(enabled=fp8, fp8_recipe=recipe.DelayedScaling(amax_history_len=4)):
            y32 = m32(x32, *extra)
        with te.fp8_autocast(enabled=fp8, fp8_recipe=recipe.DelayedScaling(amax_history_len=4)):
            y16 = m16(x16, *extra)
        assert y32.dtype == BF16, f"output under autocast is {y32.dtype}, expected bfloat16"
        assert torch.equal(y32, y16), f"outputs differ: max |diff| {(y32.float() - y16.float()).abs().max()}"
        dy = torch.randn(y16.shape, generator=gen).to(BF16).to(DEVICE)
        y32.backward(dy)
        y16.backward(dy)
        assert x32.grad.dtype == input_dtype
        assert torch.equal(x32.grad, x16.grad.to(input_dtype)), "input gradients differ"
        p16 = dict(m16.named_parameters())
        for name, p in m32.named_parameters():
            assert p.dtype == torch.float32
            assert p.grad is not None and p.grad.dtype == torch.float32, f"{name}: gradient {p.grad}"
            assert torch.equal(p.grad, p16[name].grad.float()), f"{name}: gradients differ"
    if fp8:
        s32, s16 = m32.state_dict(), m16.state_dict()
        keys = [k for k in s32 if k.endswith("_extra_state") and s32[k] is not None]
        assert keys, "no FP8 state was recorded"
        for key in keys:
            torch.testing.assert_close(s32[key], s16[key], rtol=0, atol=0)


@pytest.mark.parametrize("fp8", [False, True])
def test_linear_under_torch_autocast(rng, fp8):
    k, n, tokens = gemm_dim(48), gemm_dim(40), gemm_dim(24)
    _check(lambda dt: te.Linear(k, n, params_dtype=dt, device=DEVICE), (tokens, k), rng, fp8, steps=3)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_layernorm_linear_under_torch_autocast(rng, fp8, normalization):
    k, n = gemm_dim(32), gemm_dim(48)
    _check(lambda dt: te.LayerNormLinear(k, n, normalization=normalization, params_dtype=dt, device=DEVICE),
           (2, gemm_dim(8), k), rng, fp8, steps=3)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_layernorm_mlp_under_torch_autocast(rng, fp8, activation):
    h, f = gemm_dim(32), gemm_dim(64)
    _check(lambda dt: te.LayerNormMLP(h, f, activation=activation, params_dtype=dt, device=DEVICE),
           (gemm_dim(16), h), rng, fp8, steps=3)


@pytest.mark.parametrize("norm", ["LayerNorm", "RMSNorm"])
def test_norms_under_torch_autocast(rng, norm):
    _check(lambda dt: getattr(te, norm)(37, params_dtype=dt, device=DEVICE), (5, 37), rng, False)


@pytest.mark.parametrize("fp8", [False, True])
def test_grouped_linear_under_torch_autocast(rng, fp8):
    k, n, m = gemm_dim(32), gemm_dim(48), gemm_dim(16)
    _check(lambda dt: te.GroupedLinear(3, k, n, params_dtype=dt, device=DEVICE), (3 * m, k), rng, fp8,
           extra=([m, 2 * m, 0] if DEVICE.type == "cpu" else [m, m, m],), steps=2)


@pytest.mark.parametrize("fp8", [False, True])
def test_transformer_layer_under_torch_autocast(rng, fp8):
    """A bfloat16 input (as from a previous layer): the residual stream stays bfloat16 and every
    GEMM, norm and attention call runs on the parameters cast to bfloat16."""
    h, heads, s, b = gemm_dim(64), 4, gemm_dim(16), 2

    def make(dt):
        torch.manual_seed(0)
        return te.TransformerLayer(h, gemm_dim(128), heads, hidden_dropout=0.0, attention_dropout=0.0,
                                   self_attn_mask_type="causal", params_dtype=dt, device=DEVICE)

    _check(make, (s, b, h), rng, fp8, steps=2, input_dtype=BF16)


def test_autocast_off_keeps_float32(rng):
    """Without autocast a float32 module computes in float32 (a bfloat16 input is cast up)."""
    lin = te.Linear(16, 8, device=DEVICE)
    x = torch.randn(4, 16, generator=seeded(rng)).to(BF16).to(DEVICE)
    with torch.autocast(DEVICE.type, dtype=BF16, enabled=False):
        assert lin(x).dtype == torch.float32
