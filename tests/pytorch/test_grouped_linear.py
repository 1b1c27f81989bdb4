"""te.GroupedLinear against float64 references: per-block linear layers, high precision and FP8
(delayed scaling: one scale per block / weight from the module's metadata; current scaling)."""
import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common import recipe
from _util import fp8_emulate, rel_err, seeded
from test_current_scaling import cs_q


def _ref(xs, ws, bs, gs):
    """float64 per-block y, dx, dw, db from (possibly FP8-rounded) blocks."""
    ys = [x @ w.t() + (b if b is not None else 0) for x, w, b in zip(xs, ws, bs)]
    dxs = [gi @ w for gi, w in zip(gs, ws)]
    dws = [gi.t() @ x for gi, x in zip(gs, xs)]
    return torch.cat(ys), torch.cat(dxs), dws, [gi.sum(0) for gi in gs]


def _setup(rng, splits, bias=True, n=3):
    g = seeded(rng)
    m = te.GroupedLinear(n, 16, 24, bias=bias, device="cpu")
    with torch.no_grad():
        for i in range(n):
            if bias:
                getattr(m, f"bias{i}").normal_(generator=g)
    x = (torch.randn(sum(splits), 16, generator=g) * 2).requires_grad_()
    dy = torch.randn(sum(splits), 24, generator=g) * 1e-2
    return m, x, dy


@pytest.mark.parametrize("splits", [[5, 0, 7], [1, 1, 1], [0, 12, 0]])
@pytest.mark.parametrize("bias", [True, False])
def test_grouped_linear_high_precision(rng, splits, bias):
    m, x, dy = _setup(rng, splits, bias)
    y = m(x, splits)
    y.backward(dy)
    ws = [getattr(m, f"weight{i}").detach().double() for i in range(3)]
    bs = [getattr(m, f"bias{i}").detach().double() if bias else None for i in range(3)]
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
            torch.testing.assert_close(getattr(m, f"bias{i}").grad.double(), dbr[i])


def test_grouped_linear_fp8_delayed_matches_emulation(rng):
    splits = [6, 3, 9]
    m, x, dy = _setup(rng, splits)
    r = recipe.DelayedScaling(amax_history_len=2)
    meta = m.fp8_meta
    for step in range(3):
        x.grad = None
        m.zero_grad(set_to_none=True)
        s_f = meta.scale["fwd"].clone()
        with te.fp8_autocast(fp8_recipe=r):
            y = m(x, splits)
        y.backward(dy)
        s_b = meta.scale["bwd"]  # updated at the start of this backward
        ws = [fp8_emulate(getattr(m, f"weight{i}"), s_f[3 + i].item(), "e4m3") for i in range(3)]
        xs = [fp8_emulate(xi, s_f[i].item(), "e4m3") for i, xi in enumerate(torch.split(x.detach(), splits))]
        gs = [fp8_emulate(gi, s_b[i].item(), "e5m2") for i, gi in enumerate(torch.split(dy, splits))]
        bs = [getattr(m, f"bias{i}").detach().double() for i in range(3)]
        yr, dxr, dwr, _ = _ref(xs, ws, bs, gs)
        assert rel_err(y, yr) < 1e-5 and rel_err(x.grad, dxr) < 1e-5, step
        for i in range(3):
            assert rel_err(getattr(m, f"weight{i}").grad, dwr[i]) < 1e-5, (step, i)
            torch.testing.assert_close(getattr(m, f"bias{i}").grad.double(), torch.split(dy, splits)[i].double().sum(0))
    # each block and weight has its own slot: the amaxes differ per block
    h = meta.amax_history["fwd"]
    assert h.shape == (2, 9) and len(set(h[1, :6].tolist())) == 6


def test_grouped_linear_fp8_current_scaling(rng):
    splits = [4, 8]
    m, x, dy = _setup(rng, splits, n=2)
    with torch.no_grad():
        x[:4] *= 100  # very different amaxes per block: each block gets its own scale
    with te.fp8_autocast(fp8_recipe=recipe.Float8CurrentScaling()):
        y = m(x, splits)
    y.backward(dy)
    xs = [cs_q(xi, "e4m3") for xi in torch.split(x.detach(), splits)]
    ws = [cs_q(getattr(m, f"weight{i}"), "e4m3") for i in range(2)]
    gs = [cs_q(gi, "e5m2") for gi in torch.split(dy, splits)]
    yr, dxr, dwr, _ = _ref(xs, ws, [getattr(m, f"bias{i}").detach().double() for i in range(2)], gs)
    assert rel_err(y, yr) < 1e-5 and rel_err(x.grad, dxr) < 1e-5
    for i in range(2):
        assert rel_err(getattr(m, f"weight{i}").grad, dwr[i]) < 1e-5


def test_grouped_linear_api(rng):
    m = te.GroupedLinear(2, 8, 4, return_bias=True, device="cpu")
    assert [n for n, _ in m.named_parameters()] == ["weight0", "bias0", "weight1", "bias1"]
    x = torch.randn(2, 3, 8, generator=seeded(rng))
    y, bs = m(x, [2, 4])
    assert y.shape == (2, 3, 4) and bs[0] is m.bias0
    torch.testing.assert_close(y.reshape(6, 4)[:2], x.reshape(6, 8)[:2] @ m.weight0.detach().t())
    with pytest.raises(ValueError, match="m_splits"):
        m(x, [3, 4])
    with pytest.raises(ValueError, match="m_splits"):
        m(x, [6])
    with pytest.raises(NotImplementedError, match="tensor parallelism"):
        te.GroupedLinear(2, 8, 4, tp_size=2, device="cpu")
