"""TE 2.x public names and argument names: te.autocast(recipe=, amax_reduction_group=) (TE 2.8+'s
form of fp8_autocast), the availability queries, get_default_recipe, make_graphed_callables' new
argument names, LayerNormLinear.forward(fp8_grad=)."""
import inspect

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common import recipe
from _util import DEVICE, dev


def _twin_linears():
    a = te.Linear(16, 16, device=DEVICE)
    b = te.Linear(16, 16, device=DEVICE)
    b.load_state_dict(a.state_dict())
    return a, b


@pytest.mark.parametrize("make", [recipe.DelayedScaling, recipe.Float8CurrentScaling])
def test_autocast_takes_te28_names(make):
    x = dev(torch.randn(16, 16, generator=torch.Generator().manual_seed(1)))
    a, b = _twin_linears()
    for _ in range(2):  # (the second step uses the scales the first one's exit set)
        with te.autocast(recipe=make(), amax_reduction_group=None):
            ya = a(x)
        with te.fp8_autocast(fp8_recipe=make(), fp8_group=None):
            yb = b(x)
        assert torch.equal(ya, yb)
    with te.autocast(fp8_recipe=make()):  # (the older names are taken too)
        a(x)
    with pytest.raises(TypeError, match="recipie"):
        with te.autocast(recipie=make()):
            pass
    with pytest.raises(TypeError, match="not both"):
        with te.autocast(recipe=make(), fp8_recipe=make()):
            pass


def test_availability_queries():
    for fn in (te.is_fp8_available, te.is_bf16_available, te.is_mxfp8_available, te.is_fp8_block_scaling_available,
               te.is_nvfp4_available):
        assert isinstance(fn(), bool)
        ok, reason = fn(return_reason=True)
        assert isinstance(ok, bool) and isinstance(reason, str)
    assert not te.is_mxfp8_available() and "not implemented" in te.is_nvfp4_available(return_reason=True)[1]
    assert isinstance(te.get_default_recipe(), recipe.DelayedScaling)


def test_make_graphed_callables_takes_te28_names():
    params = inspect.signature(te.make_graphed_callables).parameters
    assert {"enabled", "calibrating", "recipe", "amax_reduction_group", "cache_quantized_params"} <= set(params)


def test_layernorm_linear_fp8_grad_argument():
    m = te.LayerNormLinear(8, 8, device=DEVICE)
    x = dev(torch.randn(2, 8))
    assert torch.equal(m(x, fp8_grad=False), m(x))
    with pytest.raises(NotImplementedError, match="fp8_grad"):
        m(x, fp8_grad=True)


def test_quantized_tensor_names():
    """te.QuantizedTensor / te.Float8Tensor (TE's top-level names): FP8 parameters are instances,
    high-precision ones are not."""
    from transformer_engine.pytorch.tensor import QuantizedTensor
    with te.quantized_model_init(recipe=recipe.Float8CurrentScaling()):
        m = te.Linear(8, 8, device=DEVICE)
    assert isinstance(m.weight, te.QuantizedTensor) and isinstance(m.weight, te.Float8Tensor)
    assert QuantizedTensor is te.QuantizedTensor
    assert not isinstance(m.bias, te.QuantizedTensor)
    assert not isinstance(te.Linear(8, 8, device=DEVICE).weight, te.QuantizedTensor)
