"""Forwards under torch.no_grad() / torch.inference_mode() skip torch.autograd.Function.apply
(custom_ops.run_function calls the Function's forward directly): outputs must be bit-identical to
the same forward through Function.apply (high precision, where they also equal the grad-enabled
forward; FP8 delayed scaling; FP8 weights from fp8_model_init), carry no autograd graph, and with
grad enabled the Function must still be recorded (gradients flow)."""
from collections import OrderedDict

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common import recipe
from transformer_engine.pytorch import custom_ops

from _util import DEVICE, gemm_dim


def layer(seed=0, **kw):
    torch.manual_seed(seed)
    h = gemm_dim(64)
    return te.TransformerLayer(h, 4 * h, 4, num_gqa_groups=2, hidden_dropout=0.0, attention_dropout=0.0,
                               self_attn_mask_type="causal", attn_input_format="bshd", fuse_qkv_params=True,
                               device=DEVICE, **kw).eval(), h


def run(model, x, fp8, grad_mode):
    ctx = {"grad": torch.enable_grad(), "no_grad": torch.no_grad(), "inference": torch.inference_mode()}[grad_mode]
    rec = recipe.DelayedScaling(margin=0, fp8_format=recipe.Format.HYBRID)
    with ctx, te.fp8_autocast(enabled=fp8, fp8_recipe=rec):
        return model(x)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("grad_mode", ["no_grad", "inference"])
def test_no_grad_forward_is_bit_identical(monkeypatch, fp8, grad_mode):
    """The same no-grad forward with Function.apply (run_function patched to always apply) and
    with the direct forward. (Delayed scaling moves its scales only in grad-enabled forwards, so
    both see the same FP8 scales: those of the grad-enabled warm-up forward.)"""
    model, h = layer()
    x = torch.randn(2, gemm_dim(16), h, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    warm = run(model, x, fp8, "grad")
    assert warm.grad_fn is not None
    got = run(model, x, fp8, grad_mode)
    assert got.grad_fn is None and not got.requires_grad
    with monkeypatch.context() as m:
        m.setattr(custom_ops, "run_function", lambda fn, *args: fn.apply(*args))
        ref = run(model, x, fp8, grad_mode)
    assert torch.equal(got, ref)
    if not fp8:
        assert torch.equal(got, warm.detach())


def test_fp8_weights_under_no_grad():
    """fp8_model_init weights are tensor subclasses: their Functions keep Function.apply."""
    h = gemm_dim(64)
    with te.fp8_model_init(enabled=True):
        lin = te.Linear(h, h, device=DEVICE)
    x = torch.randn(gemm_dim(16), h, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    rec = recipe.DelayedScaling(margin=0, fp8_format=recipe.Format.HYBRID)
    with te.fp8_autocast(fp8_recipe=rec):
        ref = lin(x)
        with torch.no_grad():
            got = lin(x)
    assert torch.equal(got, ref.detach()) and got.grad_fn is None


def test_grad_enabled_still_records_the_function():
    model, h = layer()
    x = torch.randn(2, 8, h, generator=torch.Generator().manual_seed(3)).to(DEVICE).requires_grad_(True)
    model(x).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0


def test_run_function_paths():
    """run_function calls forward only with grad mode off and plain tensors."""
    calls = []

    class Fn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            calls.append(type(ctx).__name__)
            ctx.save_for_backward(t)
            return t * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2

    t = torch.ones(3, requires_grad=True)
    assert custom_ops.run_function(Fn, t).grad_fn is not None  # grad mode on: apply
    with torch.no_grad():
        out = custom_ops.run_function(Fn, t)
    assert out.grad_fn is None and torch.equal(out, torch.full((3,), 2.0))
    assert calls[0] != "_NoGradCtx" and calls[1] == "_NoGradCtx"


def test_kv_cache_decode_under_inference_mode():
    """A decode step through TransformerLayer with a K/V cache under inference_mode gives the
    no_grad result."""
    outs = []
    for mode in (torch.no_grad, torch.inference_mode):
        model, h = layer(seed=4, layer_number=1)
        params = te.InferenceParams(2, 32, 2, h // 4, torch.float32)
        x = torch.randn(2, 5, h, generator=torch.Generator().manual_seed(5)).to(DEVICE)
        with mode():
            params.pre_step(OrderedDict((i, 5) for i in range(2)))
            model(x, inference_params=params)
            params.pre_step(OrderedDict((i, 1) for i in range(2)))
            outs.append(model(x[:, :1].contiguous(), inference_params=params).clone())
    assert torch.equal(outs[0], outs[1])
