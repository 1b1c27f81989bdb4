"""Float8Tensor parameters (quantized_model_init) and autograd / dtype conversion:

* the dequantizing conversions (.float(), .dequantize(), .half(), .bfloat16(), .cpu()) are
  differentiable: the gradient of their result reaches the FP8 parameter's .grad, unchanged, in the
  parameter's nominal dtype (as that of `w * 1` does); under no_grad they build no graph;
* `param.data = t` with t of another floating dtype makes that the nominal dtype, so
  nn.Module.to(dtype) / .half() / .bfloat16() convert FP8 weights with their module (the FP8 bytes
  and scale_inv are kept: the value assigned is the parameter's own).
Modules run on NVTE_TEST_DEVICE (default: the CPU backend); references are float64 on the CPU."""
import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common import recipe
from transformer_engine.pytorch.tensor import Float8Tensor
from _util import DEVICE, cpu64, dev, fp8_emulate, gemm_dim, rel_err, seeded
from test_current_scaling import cs_q, cs_scale

RECIPES = {"delayed": lambda: recipe.DelayedScaling(amax_history_len=4), "current": recipe.Float8CurrentScaling}
KINDS = list(RECIPES)
NOMINAL = (torch.float32, torch.float16, torch.bfloat16)
CONVERSIONS = {
    "float": (lambda w: w.float(), lambda w: torch.float32),
    "dequantize": (lambda w: w.dequantize(), lambda w: w.dtype),
    "dequantize_f32": (lambda w: w.dequantize(torch.float32), lambda w: torch.float32),
    "half": (lambda w: w.half(), lambda w: torch.float16),
    "bfloat16": (lambda w: w.bfloat16(), lambda w: torch.bfloat16),
    "cpu": (lambda w: w.cpu(), lambda w: w.dtype),
}


def _fp8_linear(kind, dtype=torch.float32, bias=True, inp=32, out=16):
    with te.quantized_model_init(recipe=RECIPES[kind]()):
        m = te.Linear(inp, out, bias=bias, params_dtype=dtype, device=DEVICE)
    assert isinstance(m.weight, Float8Tensor) and m.weight.dtype == dtype and m.weight.requires_grad
    return m


def _exact_grad(shape, g):
    """A float64 upstream gradient exact in float32, float16 and bfloat16 (multiples of 1/16 below
    4): every cast on its way to .grad is exact, so the expected .grad is known bit for bit."""
    return torch.randint(-64, 64, shape, generator=g).double() / 16


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("nominal", NOMINAL, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("conv", list(CONVERSIONS))
def test_conversion_gradient_reaches_param(rng, kind, nominal, conv):
    """d(sum(f(w) * g)) / dw = g in w's nominal dtype, landing in w.grad (it stayed None: the
    conversions returned tensors cut off from autograd)."""
    f, out_dtype = CONVERSIONS[conv]
    m = _fp8_linear(kind, nominal)
    w = m.weight
    g = _exact_grad(tuple(w.shape), seeded(rng))
    y = f(w)
    assert type(y) is torch.Tensor and y.dtype == out_dtype(w) and y.requires_grad and y.grad_fn is not None
    with torch.no_grad():
        assert torch.equal(y.detach().cpu(), w.dequantize(out_dtype(w)).cpu())  # the value is unchanged
    (y.double().cpu() * g).sum().backward()
    assert w.grad is not None and w.grad.dtype == nominal and tuple(w.grad.shape) == tuple(w.shape)
    assert torch.equal(w.grad.cpu(), g.to(nominal))
    # the same gradient as the dispatched ops give (w * 1)
    w.grad = None
    ((w * 1).double().cpu() * g).sum().backward()
    assert torch.equal(w.grad.cpu(), g.to(nominal))


def test_conversion_of_view_gradient_reaches_param(rng):
    """A view's conversion: the gradient reaches the rows of the parameter it covers."""
    m = _fp8_linear("current")
    w = m.weight
    g = _exact_grad((6, 32), seeded(rng))
    (w[2:8].float().double().cpu() * g).sum().backward()
    want = torch.zeros(16, 32, dtype=torch.float64)
    want[2:8] = g
    assert torch.equal(w.grad.double().cpu(), want)


@pytest.mark.parametrize("conv", list(CONVERSIONS))
def test_conversion_graph_only_when_grad_needed(conv):
    """A graph is recorded where the parameter requires grad and grad mode is on (it never was),
    and only then: under no_grad, or for a tensor not requiring grad, a plain dequantized copy."""
    f, _ = CONVERSIONS[conv]
    m = _fp8_linear("delayed")
    w = m.weight
    y = f(w)
    assert y.requires_grad and y.grad_fn is not None
    with torch.no_grad():
        y = f(w)
    assert type(y) is torch.Tensor and not y.requires_grad and y.grad_fn is None
    assert torch.equal(y.cpu(), w.dequantize(y.dtype).detach().cpu())
    w.requires_grad_(False)
    y = f(w)
    assert not y.requires_grad and y.grad_fn is None
    with torch.no_grad():  # the parameter is untouched by a write to a copy
        before = w.dequantize().clone()
        f(w).mul_(0)
        assert torch.equal(w.dequantize(), before)
    assert w.grad is None


def _module_reference(m, x):
    """float64 reference of m(x) with the FP8 weight's value (high precision input)."""
    y = cpu64(x) @ cpu64(m.weight.dequantize()).t()
    return y + cpu64(m.bias) if m.bias is not None else y


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("target", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("how", ["to", "method"])
def test_module_to_dtype_converts_fp8_weight(rng, kind, target, how):
    """module.to(dtype) / .bfloat16() / .half(): the FP8 weight becomes a Float8Tensor of that
    nominal dtype (it stayed float32 while the bias converted), keeping its FP8 bytes, scale_inv,
    transpose and quantizer (no re-cast: the amax history is untouched); FP8 and high-precision
    forwards then compute in that dtype, matching the float64 reference to FP8 tolerance."""
    g = seeded(rng)
    r = RECIPES[kind]()
    m = _fp8_linear(kind, torch.float32, inp=32, out=gemm_dim(16))
    w0 = m.weight
    data, tr, si = w0._data.clone(), w0._transpose.clone(), w0._scale_inv.clone()
    quantizer = w0._quantizer
    value = w0.dequantize().detach().clone()
    hist = m.fp8_meta.amax_history["fwd"].clone() if kind == "delayed" else None
    m2 = m.to(target) if how == "to" else (m.bfloat16() if target == torch.bfloat16 else m.half())
    assert m2 is m
    w = m.weight
    assert w is w0 and isinstance(w, Float8Tensor) and isinstance(w, torch.nn.Parameter)
    assert w.dtype == target and m.bias.dtype == target and w.requires_grad
    assert torch.equal(w._data, data) and torch.equal(w._scale_inv, si) and torch.equal(w._transpose, tr)
    assert w._quantizer is quantizer
    if kind == "delayed":
        assert torch.equal(m.fp8_meta.amax_history["fwd"], hist)
    assert torch.equal(w.dequantize().cpu(), value.to(target).cpu())
    x = dev(torch.randn(gemm_dim(4), 32, generator=g).to(target)).requires_grad_()
    with te.fp8_autocast(fp8_recipe=r):
        y = m(x)
    assert y.dtype == target
    assert rel_err(y, _module_reference(m, x)) < 6e-2
    if kind == "current":  # exact emulation of the FP8 GEMM (input cast with its own amax)
        ref = cs_q(x, "e4m3") @ cpu64(w.dequantize()).t() + cpu64(m.bias)
        assert rel_err(y, ref) < 1e-2
    y.float().square().mean().backward()
    assert x.grad.dtype == target and w.grad is not None and w.grad.dtype == target
    assert m.bias.grad.dtype == target
    y_hp = m(x.detach())
    assert y_hp.dtype == target and rel_err(y_hp, _module_reference(m, x)) < 1e-2


def test_module_dtype_round_trip_keeps_bytes(rng):
    """float32 -> bfloat16 -> float32: the FP8 bytes never change, and the float32 value is the
    FP8 value itself again (not its bfloat16 rounding)."""
    m = _fp8_linear("current")
    data, value = m.weight._data.clone(), m.weight.dequantize().detach().clone()
    m.to(torch.bfloat16)
    assert m.weight.dtype == torch.bfloat16
    m.to(torch.float32)
    assert m.weight.dtype == torch.float32 and torch.equal(m.weight._data, data)
    assert torch.equal(m.weight.dequantize(), value)


@pytest.mark.parametrize("kind", KINDS)
def test_data_assignment_of_other_dtype_changes_nominal_dtype(rng, kind):
    """w.data = t (float16 t, float32 w): w becomes a float16-nominal Float8Tensor holding the FP8
    cast of t by its quantizer (the module's scale / t's own amax); the shape check stays."""
    g = seeded(rng)
    m = _fp8_linear(kind, torch.float32, bias=False, out=gemm_dim(16))
    w = m.weight
    quantizer = w._quantizer
    t = torch.randn(tuple(w.shape), generator=g).half()
    w.data = dev(t)
    assert isinstance(m.weight, Float8Tensor) and m.weight is w and w.dtype == torch.float16
    assert w._quantizer is quantizer and w.requires_grad
    scale = m.fp8_meta.scale["fwd"][quantizer.slot].item() if kind == "delayed" else cs_scale(t.float(), "e4m3")
    assert torch.equal(w.dequantize().cpu(), fp8_emulate(t, scale, "e4m3").half())
    assert torch.equal(w._transpose, w._data.t())  # the kept transpose follows the new bytes
    with pytest.raises(ValueError, match=r"shape \(2, 32\)"):
        w.data = dev(torch.zeros(2, 32, dtype=torch.bfloat16))
    assert w.dtype == torch.float16
    x = dev(torch.randn(gemm_dim(4), 32, generator=g).half())
    with te.fp8_autocast(fp8_recipe=RECIPES[kind]()):
        y = m(x)
    assert y.dtype == torch.float16 and rel_err(y, _module_reference(m, x)) < 6e-2
    # an optimizer step re-casts with the quantizer, in the new nominal dtype
    w.grad = torch.ones_like(w.dequantize())
    torch.optim.SGD([w], lr=0.5).step()
    assert w.dtype == torch.float16 and isinstance(w, Float8Tensor)
    want = fp8_emulate(t, scale, "e4m3").half().double() - 0.5
    assert rel_err(w.dequantize(), want) < 6e-2


def test_data_assignment_of_float64_raises():
    m = _fp8_linear("current")
    with pytest.raises(TypeError, match="nominal dtype"):
        m.weight.data = torch.zeros(tuple(m.weight.shape), dtype=torch.float64, device=DEVICE)
    assert m.weight.dtype == torch.float32
