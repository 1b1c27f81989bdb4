"""is_first_microbatch (TE semantics): True casts the weights to FP8 and keeps the copies, False
reuses the kept copies (no cast, no weight amax recorded), None casts in every call."""
import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common import recipe
from _util import DEVICE, dev, fp8_emulate, fp8_gemm_tol, gemm_dim, rel_err, seeded
from test_current_scaling import cs_scale

RECIPES = {"delayed": lambda: recipe.DelayedScaling(amax_history_len=4), "current": recipe.Float8CurrentScaling}


def _scale_weights_(module, factor):
    with torch.no_grad():
        for n, p in module.named_parameters():
            if "weight" in n and "layer_norm" not in n:
                p.mul_(factor)


@pytest.mark.parametrize("kind", list(RECIPES))
@pytest.mark.parametrize("make", [lambda: te.Linear(16, 24, device=DEVICE),
                                  lambda: te.LayerNormLinear(16, 24, device=DEVICE),
                                  lambda: te.LayerNormMLP(16, 32, device=DEVICE),
                                  lambda: te.TransformerLayer(16, 32, 2, hidden_dropout=0.0, attention_dropout=0.0,
                                                              device=DEVICE)],
                         ids=["Linear", "LayerNormLinear", "LayerNormMLP", "TransformerLayer"])
def test_cached_weights_are_reused(rng, kind, make):
    """After True, changing the weights does not change a False forward (the FP8 copies are reused),
    while a None forward casts the new weights."""
    g = seeded(rng)
    m = make()
    x = dev(torch.randn(3, 2, 16, generator=g))
    r = RECIPES[kind]()
    with torch.no_grad(), te.fp8_autocast(fp8_recipe=r):  # no_grad: no recipe step between the calls
        y_first = m(x, is_first_microbatch=True)
        _scale_weights_(m, 2.0)
        y_cached = m(x, is_first_microbatch=False)
        y_fresh = m(x, is_first_microbatch=None)
        y_fresh2 = m(x)
    assert torch.equal(y_cached, y_first)
    assert torch.equal(y_fresh, y_fresh2)
    assert not torch.allclose(y_fresh, y_first, rtol=1e-2, atol=1e-3)


def test_linear_microbatches_fp8_weight_reuse_and_grads(rng):
    """Gradient accumulation over micro-batches: the forward uses the FP8 weight cast at the first
    micro-batch (its delayed scale then), the weight amax is recorded only then, and the gradients
    accumulate as the float64 emulation says."""
    g = seeded(rng)
    m = te.Linear(32, 16, bias=False, device=DEVICE)
    r = recipe.DelayedScaling(amax_history_len=4, margin=0)
    tokens = gemm_dim(8)  # 8 on the CPU, 16 on CUDA (the wgrad GEMM's inner dimension)
    for step in range(2):
        m.zero_grad(set_to_none=True)
        meta = m.fp8_meta
        s_w = meta.scale["fwd"][1].item()  # the weight's scale at the first micro-batch of this step
        dw_ref = torch.zeros(16, 32, dtype=torch.float64)
        for mb in range(3):
            s_x = meta.scale["fwd"][0].item()
            x = torch.randn(tokens, 32, generator=g) * (1 + mb)
            dy = torch.randn(tokens, 16, generator=g) * 1e-2
            with te.fp8_autocast(fp8_recipe=r):
                y = m(dev(x), is_first_microbatch=(mb == 0))
                # the weight's amax is recorded only when it is cast (row 0 is zeroed by each recipe step)
                assert (float(meta.amax_history["fwd"][0, 1]) > 0.0) == (mb == 0)
            y.backward(dev(dy))
            # the very first backward casts the gradient with its own scale (seeding the empty history)
            s_g = cs_scale(dy, "e5m2") if step == mb == 0 else meta.scale["bwd"][0].item()
            wq = fp8_emulate(m.weight, s_w, "e4m3")
            xq, gq = fp8_emulate(x, s_x, "e4m3"), fp8_emulate(dy, s_g, "e5m2")
            assert rel_err(y, xq @ wq.t()) < fp8_gemm_tol(1e-5), (step, mb)
            dw_ref += gq.t() @ xq
        assert rel_err(m.weight.grad, dw_ref) < fp8_gemm_tol(1e-5), step
        with torch.no_grad():
            m.weight.add_(dev(torch.randn(16, 32, generator=g)) * 0.01)  # an optimizer step changes the weight


def test_cache_refreshed_by_true(rng):
    g = seeded(rng)
    m = te.Linear(16, 8, device=DEVICE)
    x = dev(torch.randn(4, 16, generator=g))
    r = recipe.Float8CurrentScaling()
    with torch.no_grad(), te.fp8_autocast(fp8_recipe=r):
        m(x, is_first_microbatch=True)
        _scale_weights_(m, 3.0)
        y_new = m(x, is_first_microbatch=True)
        y_reuse = m(x, is_first_microbatch=False)
        y_none = m(x)
    assert torch.equal(y_new, y_reuse) and torch.equal(y_new, y_none)


def test_is_first_microbatch_without_fp8_is_plain(rng):
    g = seeded(rng)
    m = te.Linear(16, 8, device=DEVICE)
    x = dev(torch.randn(4, 16, generator=g))
    y1 = m(x, is_first_microbatch=True)
    _scale_weights_(m, 2.0)
    y2 = m(x, is_first_microbatch=False)  # high precision: nothing is cached, the new weight is used
    torch.testing.assert_close(y2, x @ m.weight.detach().t() + m.bias.detach())  # all on DEVICE
    assert not torch.allclose(y1, y2)


def test_cached_weight_keeps_its_amax_history_between_casts():
    """TE's per-step recipe update leaves a tensor's history and scale alone in a step that did not
    cast it (its newest amax is 0): with is_first_microbatch=False the cached FP8 weight is not cast,
    so the weight column holds one entry per weight cast, not per micro-batch (a per-micro-batch
    roll pushed the weight's amax out of the "max" window after amax_history_len micro-batches)."""
    from transformer_engine.common.recipe import DelayedScaling
    L = 4
    torch.manual_seed(0)
    m = te.Linear(gemm_dim(16), gemm_dim(16), bias=False, params_dtype=torch.float32, device=DEVICE)
    w_amaxes = []
    for k, first in enumerate([True, False, False, False, True]):
        x = dev(torch.randn(gemm_dim(16), gemm_dim(16)))
        with te.fp8_autocast(fp8_recipe=DelayedScaling(amax_history_len=L)):
            y = m(x, is_first_microbatch=first)
        y.float().sum().backward()
        if first:
            w_amaxes.append(float(m.weight.detach().abs().max()))
        hist = m.fp8_meta.amax_history["fwd"][:, 1].cpu()
        casts = len(w_amaxes)
        # the newest weight amax sits in the last row rolled so far; earlier rows hold the earlier casts
        want = torch.zeros(L)
        want[L - casts:] = torch.tensor(w_amaxes[-L:], dtype=torch.float32)
        assert torch.equal(hist, want), (k, hist.tolist(), want.tolist())
        assert float(m.fp8_meta.scale["fwd"][1]) == pytest.approx(448.0 / max(w_amaxes), rel=1e-6)
