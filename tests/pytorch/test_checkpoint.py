"""te.checkpoint / te.distributed.checkpoint: activation recomputation gives the outputs, gradients
and FP8 recipe state of a run without checkpointing (the recompute casts with the forward's scales
and records no amax a second time). The modules run on NVTE_TEST_DEVICE (default the CPU backend);
inputs are drawn on the CPU and moved with dev()."""
import copy

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common import recipe
from _util import DEVICE, dev, gemm_dim, seeded

RECIPES = {"none": None, "delayed": lambda: recipe.DelayedScaling(amax_history_len=3),
           "current": recipe.Float8CurrentScaling}


def _meta(model):
    out = {}
    for name, mod in model.named_modules():
        meta = getattr(mod, "fp8_meta", None)
        if meta is not None:
            for key in ("fwd", "bwd"):
                out[f"{name}.{key}.h"] = meta.amax_history[key].clone()
                out[f"{name}.{key}.s"] = meta.scale[key].clone()
    return out


def _run(layer, x, dy, r, ckpt, seed, use_reentrant, calls):
    x = dev(x).clone().requires_grad_()
    torch.manual_seed(seed)  # dropout masks: the recompute must draw the same ones

    def body(inp):
        calls.append(1)
        return layer(inp)
    with te.fp8_autocast(enabled=r is not None, fp8_recipe=r):
        y = te.checkpoint(body, x, use_reentrant=use_reentrant) if ckpt else body(x)
    y.backward(dev(dy))
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    layer.zero_grad(set_to_none=True)
    return y.detach(), x.grad, grads


@pytest.mark.parametrize("use_reentrant", [True, False])
@pytest.mark.parametrize("kind", list(RECIPES))
def test_checkpoint_matches_plain_run(rng, kind, use_reentrant):
    g = seeded(rng)
    torch.manual_seed(0)
    plain = te.TransformerLayer(32, 64, 4, hidden_dropout=0.1, attention_dropout=0.1, device=DEVICE)
    ck = copy.deepcopy(plain)
    r = RECIPES[kind]() if RECIPES[kind] else None
    seq = gemm_dim(5)  # 5 on the CPU; on CUDA 16: tokens (a dimension of the FP8 wgrad GEMMs) 16-aligned
    for step in range(3):
        x = torch.randn(seq, 2, 32, generator=g) * (1 + 3 * step)
        dy = torch.randn(seq, 2, 32, generator=g) * 1e-2
        calls_p, calls_c = [], []
        yp, dxp, gp = _run(plain, x, dy, r, False, step, use_reentrant, calls_p)
        yc, dxc, gc = _run(ck, x, dy, r, True, step, use_reentrant, calls_c)
        assert len(calls_p) == 1 and len(calls_c) == 2  # the checkpointed body really ran again
        torch.testing.assert_close(yc, yp, rtol=0, atol=0)
        torch.testing.assert_close(dxc, dxp)
        for n in gp:
            torch.testing.assert_close(gc[n], gp[n], msg=lambda m: f"step {step} {n}: {m}")
        mp, mc = _meta(plain), _meta(ck)
        for k in mp:  # recipe state identical: amaxes recorded once, scales updated once
            assert torch.equal(mc[k], mp[k]), (step, k)
    if kind == "delayed":
        assert not torch.equal(ck.layernorm_mlp.fp8_meta.scale["fwd"].cpu(), torch.ones(6))


def test_checkpoint_kwargs_rng_tracker_and_unsupported(rng):
    g = seeded(rng)
    m = te.Linear(8, 8, device=DEVICE)
    x = torch.randn(3, 8, generator=g, requires_grad=True)

    class Tracker:
        def __init__(self):
            self.state, self.sets = 0, []

        def get_states(self):
            return self.state

        def set_states(self, s):
            self.sets.append(s)
            self.state = s
    tr = Tracker()
    y = te.checkpoint(lambda inp, scale: m(inp) * scale, dev(x), scale=2.0, get_rng_state_tracker=lambda: tr)
    tr.state = 7  # changed after the forward: the recompute sees the forward's state, then it is restored
    y.sum().backward()
    assert tr.sets == [0, 7]
    torch.testing.assert_close(x.grad, 2 * m.weight.detach().cpu().sum(0).expand(3, 8))
    with pytest.raises(NotImplementedError, match="distribute_saved_activations"):
        te.distributed.checkpoint(m, dev(x), distribute_saved_activations=True)
