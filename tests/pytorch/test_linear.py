"""te.Linear against float64 PyTorch references (on NVTE_TEST_DEVICE, default the CPU backend)."""
import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common import recipe
from _util import DEVICE, cpu64, dev, fp8_emulate, fp8_gemm_tol, gemm_dim, rel_err, seeded
from test_current_scaling import cs_scale


def _ref_linear(x, w, b):
    y = cpu64(x) @ cpu64(w).t()
    return y + cpu64(b) if b is not None else y


@pytest.mark.parametrize("shape", [(16,), (5, 16), (2, 3, 16)])
@pytest.mark.parametrize("bias", [True, False])
def test_linear_high_precision_fwd_bwd(rng, shape, bias):
    g = seeded(rng)
    m = te.Linear(16, 24, bias=bias, device=DEVICE)
    with torch.no_grad():
        m.weight.copy_(torch.randn(m.weight.shape, generator=g))
        if bias:
            m.bias.copy_(torch.randn(m.bias.shape, generator=g))
    x = torch.randn(*shape, generator=g, requires_grad=True)
    y = m(dev(x))
    assert y.shape == (*shape[:-1], 24) and y.dtype == torch.float32
    assert rel_err(y, _ref_linear(x, m.weight, m.bias)) < 1e-6
    dy = torch.randn(y.shape, generator=g)
    y.backward(dev(dy))
    d2, x2 = dy.double().reshape(-1, 24), x.detach().double().reshape(-1, 16)
    assert rel_err(x.grad, (d2 @ cpu64(m.weight)).reshape(x.shape)) < 1e-6
    assert rel_err(m.weight.grad, d2.t() @ x2) < 1e-6
    if bias:
        assert rel_err(m.bias.grad, d2.sum(0)) < 1e-6


def test_linear_bf16_params(rng):
    g = seeded(rng)
    m = te.Linear(32, 8, params_dtype=torch.bfloat16, device=DEVICE)
    x = torch.randn(4, 32, generator=g, dtype=torch.bfloat16, requires_grad=True)
    y = m(dev(x))
    assert y.dtype == torch.bfloat16
    assert rel_err(y, _ref_linear(x, m.weight, m.bias)) < 1e-2
    y.float().sum().backward()
    assert x.grad.dtype == torch.bfloat16 and m.weight.grad.dtype == torch.bfloat16


def test_linear_fp8_matches_emulation(rng):
    """FP8 forward = float64 GEMM of the FP8-rounded operands with the scales the recipe holds;
    backward (HYBRID: gradient in E5M2) likewise for dgrad and wgrad, the first backward's
    gradient with its own (current) scale, which seeds the empty amax history."""
    g = seeded(rng)
    m = te.Linear(32, 48, device=DEVICE)
    with torch.no_grad():
        m.bias.copy_(torch.randn(48, generator=g))
    r = recipe.DelayedScaling(margin=0, fp8_format=recipe.Format.HYBRID, amax_history_len=2)
    tokens = gemm_dim(20)  # 20 on the CPU, 32 on CUDA (the wgrad GEMM's inner dimension)
    x = (torch.randn(tokens, 32, generator=g) * 3).requires_grad_()
    dy = torch.randn(tokens, 48, generator=g) * 1e-3
    for step in range(3):
        x.grad = None
        m.zero_grad(set_to_none=True)
        meta = m.fp8_meta
        s_x, s_w = (meta.scale["fwd"][0].item(), meta.scale["fwd"][1].item()) if meta.initialized else (1.0, 1.0)
        with te.fp8_autocast(fp8_recipe=r):
            y = m(dev(x))
        y.backward(dev(dy))
        if step == 0:  # the first backward casts the gradient with current scaling; its amax seeds the history
            s_g = cs_scale(dy, "e5m2")
            assert meta.amax_history["bwd"][0, 0].item() == float(dy.float().abs().max())
            assert meta.scale["bwd"][0].item() == 1.0  # the (empty-history) recipe step left the scale alone
        else:
            s_g = meta.scale["bwd"][0].item()  # updated at the start of this backward
        xq, wq = fp8_emulate(x, s_x, "e4m3"), fp8_emulate(m.weight, s_w, "e4m3")
        gq = fp8_emulate(dy, s_g, "e5m2")
        assert rel_err(y, xq @ wq.t() + cpu64(m.bias)) < fp8_gemm_tol(1e-5), step
        assert rel_err(x.grad, gq @ wq) < fp8_gemm_tol(1e-5), step
        assert rel_err(m.weight.grad, gq.t() @ xq) < fp8_gemm_tol(1e-5), step
        assert rel_err(m.bias.grad, dy.double().sum(0)) < 1e-5
        # FP8-sized error against the exact result once the scales settled
        e = rel_err(y, _ref_linear(x, m.weight, m.bias))
        assert e < 0.1
        if step == 2:  # delayed scales in use: the error is FP8-sized, not float32-sized
            assert e > 1e-4 and s_x != 1.0 and s_g != 1.0


def test_linear_parameter_assignment_takes_effect(rng):
    g = seeded(rng)
    m = te.Linear(8, 4, device=DEVICE)
    x = torch.randn(3, 8, generator=g)
    w = torch.randn(4, 8, generator=g)
    m.weight = torch.nn.Parameter(dev(w).clone())
    m.bias = torch.nn.Parameter(torch.ones(4, device=DEVICE))
    assert rel_err(m(dev(x)), x.double() @ w.double().t() + 1) < 1e-6
    with torch.no_grad():
        m.weight.mul_(2)
    assert rel_err(m(dev(x)), 2 * x.double() @ w.double().t() + 1) < 1e-6


def test_linear_return_bias_and_init_method():
    m = te.Linear(8, 4, return_bias=True, init_method=lambda w: torch.nn.init.constant_(w, 0.5), device=DEVICE)
    x = torch.ones(2, 8, device=DEVICE)
    y, b = m(x)
    assert b is m.bias
    assert torch.allclose(y, torch.full((2, 4), 4.0, device=DEVICE))


def test_linear_default_device_and_meta_init():
    m = te.Linear(8, 4)
    assert m.weight.device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    mm = te.Linear(8, 4, device="meta")
    assert mm.weight.is_meta and mm.bias.is_meta
    mm.reset_parameters()
    assert mm.weight.device == m.weight.device and mm.bias.device == m.weight.device
    assert float(mm.bias.detach().abs().sum()) == 0.0 and float(mm.weight.detach().std()) > 0
    x = torch.randn(3, 8, device=m.weight.device)
    assert rel_err(mm(x), _ref_linear(x, mm.weight, mm.bias)) < 1e-6


def test_linear_meta_forward_needs_reset():
    mm = te.Linear(8, 4, device="meta")
    with pytest.raises(ValueError, match="meta"):
        mm(torch.randn(2, 8))


def test_linear_bad_inputs():
    m = te.Linear(8, 4, device="cpu")
    with pytest.raises(ValueError, match="last dimension must be 8"):
        m(torch.randn(2, 7))
    with pytest.raises(TypeError, match="floating-point"):
        m(torch.ones(2, 8, dtype=torch.int32))
    with pytest.raises(TypeError, match="torch.Tensor"):
        m([1.0] * 8)
    with pytest.raises(TypeError, match="params_dtype"):
        te.Linear(8, 4, params_dtype=torch.float64, device="cpu")
    with pytest.raises(NotImplementedError, match="tensor parallelism"):
        te.Linear(8, 4, tp_size=2, device="cpu")
    with pytest.raises(ValueError, match="positive"):
        te.Linear(0, 4, device="cpu")


def test_linear_noncontiguous_and_float64_input(rng):
    g = seeded(rng)
    m = te.Linear(8, 4, device=DEVICE)
    x = dev(torch.randn(8, 6, generator=g, dtype=torch.float64)).t()  # non-contiguous float64
    y = m(x)
    assert y.dtype == torch.float32
    assert rel_err(y, _ref_linear(x, m.weight, m.bias)) < 1e-6


def test_linear_no_grad_fp8_skips_update(rng):
    m = te.Linear(16, 16, device=DEVICE)
    r = recipe.DelayedScaling(amax_history_len=4)
    with torch.no_grad(), te.fp8_autocast(fp8_recipe=r):
        m(dev(torch.randn(4, 16, generator=seeded(rng))))
    h = m.fp8_meta.amax_history["fwd"]
    assert float(h[0, 0]) > 0 and float(h[1:].abs().sum()) == 0  # recorded, not rolled
    assert torch.equal(m.fp8_meta.scale["fwd"].cpu(), torch.ones(3))


def test_linear_fp8_first_backward_keeps_small_gradients(rng, monkeypatch):
    """Gradients far below E5M2's smallest subnormal (2^-16) at the first FP8 step: cast with TE's
    initial scale 1 they all flush to zero (dgrad and wgrad 0: checked with the seeding turned off,
    NVTE_FP8_SEED_FIRST_BACKWARD=0); the first backward's current-scaled cast keeps them
    FP8-accurate, and the next step's delayed scale comes from the seeded amax."""
    g = seeded(rng)
    m = te.Linear(32, 48, bias=False, device=DEVICE)
    r = recipe.DelayedScaling(fp8_format=recipe.Format.HYBRID, amax_history_len=4)
    tokens = gemm_dim(20)
    amaxes = []
    for step in range(2):
        m.zero_grad(set_to_none=True)
        x = torch.randn(tokens, 32, generator=g).requires_grad_()
        dy = torch.randn(tokens, 48, generator=g) * 1e-7
        amaxes.append(dy.abs().max())
        with te.fp8_autocast(fp8_recipe=r):
            y = m(dev(x))
        y.backward(dev(dy))
        assert rel_err(x.grad, cpu64(dy) @ cpu64(m.weight)) < 0.1, step
        assert rel_err(m.weight.grad, cpu64(dy).t() @ cpu64(x)) < 0.1, step
    # the second backward's delayed scale: E5M2 max over the first step's (seeded) amax
    assert m.fp8_meta.scale["bwd"][0].item() == (torch.tensor(57344.0) / amaxes[0]).item()
    monkeypatch.setenv("NVTE_FP8_SEED_FIRST_BACKWARD", "0")
    m = te.Linear(32, 48, bias=False, device=DEVICE)
    x = torch.randn(tokens, 32, generator=g).requires_grad_()
    with te.fp8_autocast(fp8_recipe=r):
        y = m(dev(x))
    y.backward(dev(torch.randn(tokens, 48, generator=g) * 1e-7))
    assert not x.grad.any() and not m.weight.grad.any()
