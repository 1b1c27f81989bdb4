"""te.checkpoint / te.distributed.checkpoint: activation recomputation gives the outputs, gradients
and FP8 recipe state of a run without checkpointing (the recompute casts with the forward's scales
and records no amax a second time). The modules run on NVTE_TEST_DEVICE (default the CPU backend);
inputs are drawn on the CPU and moved with dev()."""
import contextlib
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


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_fp8_autocast_inside_the_checkpointed_function(rng, use_reentrant):
    """fp8_autocast entered by the checkpointed function itself: its exit (without grad in the
    reentrant form's forward) still updates the forward scales, as the same function run without
    checkpoint does (they stayed at 1 for good, clipping every input beyond 448); under no_grad
    neither updates."""
    g = seeded(rng)
    torch.manual_seed(0)
    d = gemm_dim(8)
    plain = torch.nn.Sequential(te.Linear(d, d, device=DEVICE), te.Linear(d, d, device=DEVICE))
    ck = copy.deepcopy(plain)
    r = recipe.DelayedScaling(amax_history_len=4)

    def body(model):
        def f(inp):
            with te.fp8_autocast(fp8_recipe=r):
                return model(inp)
        return f
    for step in range(3):
        x = torch.randn(gemm_dim(4), d, generator=g) * 1000 * (step + 1)
        ys = []
        for model, ckpt in ((plain, False), (ck, True)):
            xi = dev(x).requires_grad_()
            y = te.checkpoint(body(model), xi, use_reentrant=use_reentrant) if ckpt else body(model)(xi)
            y.float().square().sum().backward()
            ys.append((y.detach(), xi.grad))
        assert torch.equal(ys[0][0], ys[1][0]) and torch.equal(ys[0][1], ys[1][1]), step
        mp, mc = _meta(plain), _meta(ck)
        for k in mp:
            assert torch.equal(mc[k], mp[k]), (step, k)
    assert float(ck[0].fp8_meta.scale["fwd"][0]) < 1.0  # (inputs ~1e3: the scale follows them)
    before = _meta(ck)
    with torch.no_grad():
        te.checkpoint(body(ck), dev(x), use_reentrant=use_reentrant)
    after = _meta(ck)  # (the casts still record amaxes into row 0; nothing is rolled or rescaled)
    assert all(torch.equal(before[k], after[k]) for k in before if k.endswith(".s"))


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


def _linear_grads(m, x0, fn, dy=None):
    """(output, dx, {name: grad}) of fn(x) for a fresh leaf x = x0, the module's grads cleared first."""
    m.zero_grad(set_to_none=True)
    x = x0.clone().requires_grad_(True)
    y = fn(x)
    y.float().backward(dy if dy is not None else torch.ones_like(y, dtype=torch.float32))
    return y.detach(), x.grad, {n: p.grad.clone() for n, p in m.named_parameters()}


def _assert_same(a, b):
    assert torch.equal(a[0], b[0]) and a[0].dtype == b[0].dtype
    assert torch.equal(a[1], b[1])
    assert a[2].keys() == b[2].keys() and all(torch.equal(a[2][n], b[2][n]) for n in a[2]), "parameter grads"


@pytest.mark.parametrize("use_reentrant", [True, False])
@pytest.mark.parametrize("module", ["te", "torch"])
def test_checkpoint_recomputes_under_the_forwards_torch_autocast(rng, module, use_reentrant):
    """Forward inside torch.autocast(bfloat16), backward outside it: the recompute re-enters the
    forward's autocast, so its GEMMs run in bfloat16 as the forward's did and the gradients are
    bit-identical to the plain run's (a float32 recompute gives other gradients)."""
    g = seeded(rng)
    torch.manual_seed(0)
    m = (te.Linear(32, 32, params_dtype=torch.float32, device=DEVICE) if module == "te"
         else torch.nn.Linear(32, 32, device=DEVICE))
    x0 = dev(torch.randn(16, 32, generator=g))
    dy = dev(torch.randn(16, 32, generator=g))

    def under_autocast(body):
        def fn(x):
            with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
                return body(x)
        return fn
    plain = _linear_grads(m, x0, under_autocast(m), dy)
    assert plain[0].dtype == torch.bfloat16
    ck = _linear_grads(m, x0, under_autocast(lambda x: te.checkpoint(m, x, use_reentrant=use_reentrant)), dy)
    _assert_same(ck, plain)

    # the autocast state is the forward's, not the backward's: a float32 forward recomputes in float32
    def backward_under_autocast(fn):
        m.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_(True)
        y = fn(x)
        with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
            y.backward(dy)
        return y.detach(), x.grad, {n: p.grad.clone() for n, p in m.named_parameters()}
    _assert_same(backward_under_autocast(lambda x: te.checkpoint(m, x, use_reentrant=use_reentrant)),
                 backward_under_autocast(m))


def test_reentrant_checkpoint_refuses_autograd_grad(rng):
    """torch.autograd.grad (or backward(inputs=...)) through the reentrant checkpoint raises instead
    of running the recompute's backward into the parameters' .grad behind the caller's back."""
    g = seeded(rng)
    m = te.Linear(8, 8, params_dtype=torch.float32, device=DEVICE)
    x = dev(torch.randn(4, 8, generator=g)).requires_grad_(True)
    with pytest.raises(RuntimeError, match=r"not compatible with \.grad\(\).*\.backward\(\)"):
        torch.autograd.grad(te.checkpoint(m, x, use_reentrant=True).sum(), x)
    with pytest.raises(RuntimeError, match=r"not compatible with \.grad\(\)"):
        te.checkpoint(m, x, use_reentrant=True).sum().backward(inputs=[x])
    assert m.weight.grad is None and x.grad is None
    # the non-reentrant form supports it
    (dx,) = torch.autograd.grad(te.checkpoint(m, x, use_reentrant=False).sum(), x)
    assert torch.equal(dx, torch.autograd.grad(m(x).sum(), x)[0]) and m.weight.grad is None


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_distribute_saved_activations_without_tensor_parallelism(rng, monkeypatch, use_reentrant):
    """distribute_saved_activations is a memory saving over the tensor-parallel group: without a
    group of more than one rank (or with use_reentrant=False, where TE documents it has no effect)
    it is accepted and changes nothing; over a real group (reentrant) it is not implemented."""
    g = seeded(rng)
    m = te.Linear(8, 8, params_dtype=torch.float32, device=DEVICE)
    x0 = dev(torch.randn(4, 8, generator=g))
    plain = _linear_grads(m, x0, m)
    ck = _linear_grads(m, x0, lambda x: te.checkpoint(m, x, distribute_saved_activations=True,
                                                      use_reentrant=use_reentrant))
    _assert_same(ck, plain)
    tp_group = object()  # a group of two ranks (torch.distributed's answers below)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2 if group is tp_group else 1)
    if use_reentrant:
        with pytest.raises(NotImplementedError, match="distribute_saved_activations"):
            te.distributed.checkpoint(m, x0, distribute_saved_activations=True, tp_group=tp_group)
    else:
        ck = _linear_grads(m, x0, lambda x: te.checkpoint(m, x, distribute_saved_activations=True,
                                                          tp_group=tp_group, use_reentrant=False))
        _assert_same(ck, plain)


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_checkpoint_drops_torch_checkpoint_keywords(rng, use_reentrant):
    """context_fn, determinism_check and debug are checkpoint's keywords, not the function's."""
    g = seeded(rng)
    m = te.Linear(8, 8, params_dtype=torch.float32, device=DEVICE)
    x0 = dev(torch.randn(4, 8, generator=g))
    seen = []

    def body(x, **kw):
        seen.append(kw)
        return m(x)
    plain = _linear_grads(m, x0, m)
    ck = _linear_grads(m, x0, lambda x: te.checkpoint(body, x, use_reentrant=use_reentrant, context_fn=None,
                                                      determinism_check="default", debug=False))
    _assert_same(ck, plain)
    assert seen == [{}, {}]  # forward and recompute, neither given the dropped keywords


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_checkpoint_legacy_positional_form(rng, use_reentrant):
    """TE's deprecated checkpoint(function, distribute_saved_activations, get_rng_state_tracker,
    tp_group, *args): a DeprecationWarning, then the options are used as such (the tracker's states
    are restored for the recompute) and the remaining arguments go to the function."""
    g = seeded(rng)
    m = te.Linear(8, 8, params_dtype=torch.float32, device=DEVICE)
    x0 = dev(torch.randn(4, 8, generator=g))
    tr = te.CudaRNGStatesTracker()
    tr.add("model-parallel-rng", 3)
    calls = []

    def body(x, scale):
        calls.append(1)
        with tr.fork():
            keep = (torch.rand(x.shape, device=x.device) > 0.5).to(x.dtype)
        return m(x) * keep * scale
    before = tr.get_states()
    plain = _linear_grads(m, x0, lambda x: body(x, 2.0))
    tr.set_states(before)
    with pytest.warns(DeprecationWarning, match="deprecated"):
        ck = _linear_grads(m, x0, lambda x: te.checkpoint(body, False, lambda: tr, None, x, 2.0,
                                                          use_reentrant=use_reentrant))
    assert len(calls) == 3  # plain, checkpointed forward, recompute
    _assert_same(ck, plain)
    with pytest.raises(TypeError, match="both positionally"):
        te.checkpoint(body, False, lambda: tr, None, x0, 2.0, get_rng_state_tracker=lambda: tr)


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_checkpoint_context_fn_wraps_forward_and_recompute(rng, use_reentrant):
    """context_fn (torch's keyword, used by TE): its first context wraps the forward, its second the
    recompute."""
    g = seeded(rng)
    m = te.Linear(8, 8, params_dtype=torch.float32, device=DEVICE)
    x0 = dev(torch.randn(4, 8, generator=g))
    entered = []

    @contextlib.contextmanager
    def tag(name):
        entered.append(name)
        yield

    plain = _linear_grads(m, x0, m)
    ck = _linear_grads(m, x0, lambda x: te.checkpoint(m, x, use_reentrant=use_reentrant,
                                                      context_fn=lambda: (tag("forward"), tag("recompute"))))
    _assert_same(ck, plain)
    assert entered == ["forward", "recompute"]


def test_checkpoint_args_that_only_look_like_the_legacy_form(rng):
    """A function whose own first arguments are (bool, None, tensor) is not the legacy form (TE's
    test wants a callable tracker and more than three arguments)."""
    g = seeded(rng)
    m = te.Linear(8, 8, params_dtype=torch.float32, device=DEVICE)
    x0 = dev(torch.randn(4, 8, generator=g))

    def f(use_m, unused, x):
        return m(x) if use_m else x
    plain = _linear_grads(m, x0, lambda x: f(True, None, x))
    ck = _linear_grads(m, x0, lambda x: te.checkpoint(f, True, None, x))
    _assert_same(ck, plain)
