"""te.GroupedLinear against float64 references: per-block linear layers, high precision and FP8
(delayed scaling: one scale per block / weight from the module's metadata; current scaling).
The modules run on NVTE_TEST_DEVICE (default the CPU backend); inputs are drawn on the CPU and moved
with dev(), the float64 references stay on the CPU."""
import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common import recipe
from _util import DEVICE, cpu64, dev, fp8_emulate, fp8_gemm_tol, gemm_dim, rel_err, seeded
from test_current_scaling import cs_q


def _ref(xs, ws, bs, gs):
    """float64 per-block y, dx, dw, db from (possibly FP8-rounded) blocks."""
    ys = [x @ w.t() + (b if b is not None else 0) for x, w, b in zip(xs, ws, bs)]
    dxs = [gi @ w for gi, w in zip(gs, ws)]
    dws = [gi.t() @ x for gi, x in zip(gs, xs)]
    return torch.cat(ys), torch.cat(dxs), dws, [gi.sum(0) for gi in gs]


def _fp8_splits(splits):
    """m_splits of an FP8 test: as given on the CPU; on CUDA each block rounded up to a multiple of
    16 rows (empty blocks stay empty), as cuBLASLt's FP8 GEMMs need for every dimension."""
    return [gemm_dim(s) for s in splits]


def _setup(rng, splits, bias=True, n=3, out=24):
    g = seeded(rng)
    m = te.GroupedLinear(n, 16, out, bias=bias, device=DEVICE)
    with torch.no_grad():
        for i in range(n):
            if bias:
                getattr(m, f"bias{i}").copy_(torch.randn(out, generator=g))
    x = (torch.randn(sum(splits), 16, generator=g) * 2).requires_grad_()
    dy = torch.randn(sum(splits), out, generator=g) * 1e-2
    return m, x, dy


@pytest.mark.parametrize("splits", [[5, 0, 7], [1, 1, 1], [0, 12, 0]])
@pytest.mark.parametrize("bias", [True, False])
def test_grouped_linear_high_precision(rng, splits, bias):
    m, x, dy = _setup(rng, splits, bias)
    y = m(dev(x), splits)
    y.backward(dev(dy))
    ws = [cpu64(getattr(m, f"weight{i}")) for i in range(3)]
    bs = [cpu64(getattr(m, f"bias{i}")) if bias else None for i in range(3)]
    xs, gs = torch.split(x.detach().double(), splits), torch.split(dy.double(), splits)
    yr, dxr, dwr, dbr = _ref(xs, ws, bs, gs)
    assert rel_err(y, yr) < 1e-6 and rel_err(x.grad, dxr) < 1e-6
    for i in range(3):
        w_grad = getattr(m, f"weight{i}").grad
        if splits[i] == 0:  # no rows: zero gradient, not an error
            assert float(w_grad.abs().sum()) == 0.0
        else:
            assert rel_err(w_grad, dwr[i]) < 1e-6
        if bias:
            torch.testing.assert_close(cpu64(getattr(m, f"bias{i}").grad), dbr[i])


def test_grouped_linear_fp8_delayed_matches_emulation(rng):
    splits = _fp8_splits([6, 3, 9])
    m, x, dy = _setup(rng, splits, out=gemm_dim(24))  # out features 24 on the CPU, 32 on CUDA
    r = recipe.DelayedScaling(amax_history_len=2)
    meta = m.fp8_meta
    for step in range(3):
        x.grad = None
        m.zero_grad(set_to_none=True)
        s_f = meta.scale["fwd"].clone()
        with te.fp8_autocast(fp8_recipe=r):
            y = m(dev(x), splits)
        y.backward(dev(dy))
        s_b = meta.scale["bwd"]  # updated at the start of this backward
        ws = [fp8_emulate(getattr(m, f"weight{i}"), s_f[3 + i].item(), "e4m3") for i in range(3)]
        xs = [fp8_emulate(xi, s_f[i].item(), "e4m3") for i, xi in enumerate(torch.split(x.detach(), splits))]
        # the first backward casts each gradient with its own scale (seeding the empty histories)
        gs = [cs_q(gi, "e5m2") if step == 0 else fp8_emulate(gi, s_b[i].item(), "e5m2")
              for i, gi in enumerate(torch.split(dy, splits))]
        bs = [cpu64(getattr(m, f"bias{i}")) for i in range(3)]
        yr, dxr, dwr, _ = _ref(xs, ws, bs, gs)
        assert rel_err(y, yr) < fp8_gemm_tol(1e-5) and rel_err(x.grad, dxr) < fp8_gemm_tol(1e-5), step
        for i in range(3):
            assert rel_err(getattr(m, f"weight{i}").grad, dwr[i]) < fp8_gemm_tol(1e-5), (step, i)
            torch.testing.assert_close(cpu64(getattr(m, f"bias{i}").grad), torch.split(dy, splits)[i].double().sum(0))
    # each block and weight has its own slot: the amaxes differ per block
    h = meta.amax_history["fwd"]
    assert h.shape == (2, 9) and len(set(h[1, :6].tolist())) == 6


def test_grouped_linear_fp8_current_scaling(rng):
    splits = _fp8_splits([4, 8])
    m, x, dy = _setup(rng, splits, n=2, out=gemm_dim(24))  # out features 24 on the CPU, 32 on CUDA
    with torch.no_grad():
        x[:splits[0]] *= 100  # very different amaxes per block: each block gets its own scale
    with te.fp8_autocast(fp8_recipe=recipe.Float8CurrentScaling()):
        y = m(dev(x), splits)
    y.backward(dev(dy))
    xs = [cs_q(xi, "e4m3") for xi in torch.split(x.detach(), splits)]
    ws = [cs_q(getattr(m, f"weight{i}"), "e4m3") for i in range(2)]
    gs = [cs_q(gi, "e5m2") for gi in torch.split(dy, splits)]
    yr, dxr, dwr, _ = _ref(xs, ws, [cpu64(getattr(m, f"bias{i}")) for i in range(2)], gs)
    assert rel_err(y, yr) < fp8_gemm_tol(1e-5) and rel_err(x.grad, dxr) < fp8_gemm_tol(1e-5)
    for i in range(2):
        assert rel_err(getattr(m, f"weight{i}").grad, dwr[i]) < fp8_gemm_tol(1e-5)


def test_grouped_linear_api(rng):
    m = te.GroupedLinear(2, 8, 4, return_bias=True, device=DEVICE)
    assert [n for n, _ in m.named_parameters()] == ["weight0", "bias0", "weight1", "bias1"]
    x = dev(torch.randn(2, 3, 8, generator=seeded(rng)))
    y, bs = m(x, [2, 4])
    assert y.shape == (2, 3, 4) and bs[0] is m.bias0
    torch.testing.assert_close(y.reshape(6, 4)[:2], x.reshape(6, 8)[:2] @ m.weight0.detach().t())  # on DEVICE
    with pytest.raises(ValueError, match="m_splits"):
        m(x, [3, 4])
    with pytest.raises(ValueError, match="m_splits"):
        m(x, [6])
    with pytest.raises(NotImplementedError, match="tensor parallelism"):
        te.GroupedLinear(2, 8, 4, tp_size=2, device=DEVICE)


# ------------------------------------------------------------------------ torch.compile, caching
CACHE_RECIPES = {"delayed": lambda: recipe.DelayedScaling(amax_history_len=4), "current": recipe.Float8CurrentScaling}


@pytest.mark.parametrize("kind", ["none"] + list(CACHE_RECIPES))
def test_grouped_linear_compile_fullgraph(rng, kind):
    """torch.compile(fullgraph=True) traces GroupedLinear forward and backward (the grouped GEMMs
    and casts are opaque registered ops in both graphs) and computes what eager does over changing
    m_splits (empty blocks included), recipe state included."""
    import copy

    from test_compile import OPS, GraphRecorder, _meta_state

    torch._dynamo.reset()
    g = seeded(rng)
    torch.manual_seed(int(rng.integers(1 << 30)))
    n_out = gemm_dim(24)  # 24 on the CPU, 32 on CUDA (FP8 GEMM dims 16-aligned)
    eager = te.GroupedLinear(3, 16, n_out, device=DEVICE)
    src = copy.deepcopy(eager)
    rec = GraphRecorder()
    compiled = torch.compile(src, fullgraph=True, backend=rec.backend())
    # the default history length: other lengths resize the metadata, which must happen eagerly
    r = {"none": None, "delayed": recipe.DelayedScaling(), "current": recipe.Float8CurrentScaling()}[kind]
    for step, splits in enumerate([[5, 0, 7], [4, 4, 4], [0, 12, 0], [6, 3, 3]]):
        splits = _fp8_splits(splits)  # on CUDA 16-row blocks (empty ones stay empty)
        x = torch.randn(sum(splits), 16, generator=g) * (1 + step)
        dy = torch.randn(sum(splits), n_out, generator=g) * 1e-2
        res = []
        for mod, params in ((eager, eager), (compiled, src)):
            xx = dev(x).clone().requires_grad_()
            if r is None:
                y = mod(xx, splits)
            else:
                with te.fp8_autocast(fp8_recipe=r):
                    y = mod(xx, splits)
            y.backward(dev(dy))
            res.append((y.detach(), xx.grad, {n: p.grad.clone() for n, p in params.named_parameters()}))
            params.zero_grad(set_to_none=True)
        (ye, dxe, ge), (yc, dxc, gc) = res
        torch.testing.assert_close(yc, ye, rtol=0, atol=0, msg=lambda m: f"step {step} output: {m}")
        torch.testing.assert_close(dxc, dxe, rtol=0, atol=0, msg=lambda m: f"step {step} dgrad: {m}")
        for n in ge:
            torch.testing.assert_close(gc[n], ge[n], rtol=0, atol=0, msg=lambda m: f"step {step} grad {n}: {m}")
        se, sc = _meta_state(eager), _meta_state(src)
        assert se.keys() == sc.keys()
        for k in se:
            assert torch.equal(sc[k], se[k]), (step, k)
    assert OPS.grouped_gemm.default in rec.targets["fw"] and OPS.grouped_gemm.default in rec.targets["bw"]
    assert (OPS.quantize.default in rec.targets["fw"]) == (kind != "none")
    assert (OPS.delayed_scaling_update.default in rec.targets["bw"]) == (kind == "delayed")
    torch._dynamo.reset()


@pytest.mark.parametrize("kind", list(CACHE_RECIPES))
def test_grouped_linear_is_first_microbatch_caching(rng, kind):
    """True casts the weights and keeps the FP8 copies, False reuses them (the outputs ignore a
    weight change; delayed scaling records no weight amax), None casts the current weights."""
    g = seeded(rng)
    m = te.GroupedLinear(3, 16, gemm_dim(24), device=DEVICE)  # out features 24 on the CPU, 32 on CUDA
    splits = _fp8_splits([5, 3, 4])
    x = dev(torch.randn(sum(splits), 16, generator=g))
    r = CACHE_RECIPES[kind]()
    with torch.no_grad(), te.fp8_autocast(fp8_recipe=r):  # no_grad: no recipe step between the calls
        y_first = m(x, splits, is_first_microbatch=True)
        hist = m.fp8_meta.amax_history["fwd"]
        if kind == "delayed":
            w_amax = hist[0, 3:6].clone()
            assert bool((w_amax > 0).all())  # each weight's amax recorded at its own slot
            hist[0, 3:6] = 0.0
        with torch.no_grad():
            for i in range(3):
                getattr(m, f"weight{i}").mul_(2.0)
        y_cached = m(x, splits, is_first_microbatch=False)
        if kind == "delayed":
            assert bool((hist[0, 3:6] == 0).all())  # the kept copies were used: no weight cast
        y_fresh = m(x, splits, is_first_microbatch=None)
        y_fresh2 = m(x, splits)
    assert torch.equal(y_cached, y_first)
    assert torch.equal(y_fresh, y_fresh2)
    assert not torch.allclose(y_fresh, y_first, rtol=1e-2, atol=1e-3)
    # the cached forward is the emulated FP8 forward of the weights as they were at True
    if kind == "current":
        xs = torch.split(x, splits)
        ws = [cs_q(getattr(m, f"weight{i}").detach() / 2.0, "e4m3") for i in range(3)]
        yr = torch.cat([cs_q(xi, "e4m3") @ w.t() + cpu64(getattr(m, f"bias{i}"))
                        for i, (xi, w) in enumerate(zip(xs, ws))])
        assert rel_err(y_cached, yr) < fp8_gemm_tol(1e-6)


@pytest.mark.parametrize("kind", list(CACHE_RECIPES))
def test_grouped_linear_fp8_params(rng, kind):
    """GroupedLinear built under quantized_model_init: the FP8 weights feed the grouped GEMMs
    directly (forward = emulation with the dequantized weights), and an SGD step keeps them FP8."""
    from transformer_engine.pytorch.tensor import Float8Tensor

    g = seeded(rng)
    r = CACHE_RECIPES[kind]()
    with te.quantized_model_init(recipe=r):
        m = te.GroupedLinear(2, 16, gemm_dim(24), bias=False, device=DEVICE)  # 24 on the CPU, 32 on CUDA
    assert all(isinstance(getattr(m, f"weight{i}"), Float8Tensor) for i in range(2))
    splits = _fp8_splits([4, 8])
    x = torch.randn(sum(splits), 16, generator=g).requires_grad_()
    s_x = m.fp8_meta.scale["fwd"][:2].clone()
    with te.fp8_autocast(fp8_recipe=r):
        y = m(dev(x), splits)
    dy = torch.randn(sum(splits), gemm_dim(24), generator=g) * 1e-2
    y.backward(dev(dy))
    ws = [cpu64(getattr(m, f"weight{i}").dequantize()) for i in range(2)]
    xs = torch.split(x.detach(), splits)
    if kind == "current":
        xq = [cs_q(xi, "e4m3") for xi in xs]
        gq = [cs_q(gi, "e5m2") for gi in torch.split(dy, splits)]
    else:
        xq = [fp8_emulate(xi, s_x[i].item(), "e4m3") for i, xi in enumerate(xs)]
        gq = [cs_q(gi, "e5m2") for gi in torch.split(dy, splits)]  # first backward: seeded, current-scaled
    yr, dxr, dwr, _ = _ref(xq, ws, [None, None], gq)
    assert rel_err(y, yr) < fp8_gemm_tol(1e-6) and rel_err(x.grad, dxr) < fp8_gemm_tol(1e-6)
    for i in range(2):
        assert rel_err(getattr(m, f"weight{i}").grad, dwr[i]) < fp8_gemm_tol(1e-5)
    torch.optim.SGD(m.parameters(), lr=0.1).step()
    assert all(isinstance(getattr(m, f"weight{i}"), Float8Tensor) for i in range(2))


def test_m_splits_must_be_integers_and_parallel_mode_checked():
    """m_splits of non-integers raise (2.5 rows had been truncated); a tensor of ints is taken;
    parallel_mode is one of TE's values."""
    m = te.GroupedLinear(2, 4, 4, device=DEVICE)
    x = dev(torch.randn(9, 4, generator=torch.Generator().manual_seed(2)))
    with pytest.raises(TypeError, match="m_splits must be integers"):
        m(x, [2.5, 6.5])
    assert torch.equal(m(x, torch.tensor([3, 6])), m(x, [3, 6]))
    for cls, args in ((te.GroupedLinear, (2, 4, 4)), (te.Linear, (4, 4)), (te.LayerNormLinear, (4, 4))):
        with pytest.raises(ValueError, match="parallel_mode must be None, 'column' or 'row'"):
            cls(*args, parallel_mode="bogus", device=DEVICE)
        cls(*args, parallel_mode="row", device=DEVICE)
