"""parameters_split of te.Linear / te.LayerNormLinear (TE's argument): the weight and bias held as
one Parameter per named split along dim 0 (`<name>_weight`, `<name>_bias`; trailing underscores
dropped), concatenated by the forward. Checked against a float64 reference of the concatenated
layer, for parameter names, shapes, gradients per split, state dicts and misuse."""
import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common import recipe
from _util import DEVICE, cpu64, dev, gemm_dim, rel_err, seeded


def _cat(m, names, kind):
    return torch.cat([cpu64(getattr(m, f"{n}_{kind}")) for n in names])


@pytest.mark.parametrize("split,names,sizes", [
    (("query_", "key_", "value_"), ["query", "key", "value"], [8, 8, 8]),
    ({"a": 5, "bb": 17, "c": 2}, ["a", "bb", "c"], [5, 17, 2]),
    (["only"], ["only"], [24]),
])
@pytest.mark.parametrize("module", ["Linear", "LayerNormLinear"])
def test_split_names_forward_and_grads(rng, split, names, sizes, module):
    g = seeded(rng)
    n_in = 11
    cls = getattr(te, module)
    m = cls(n_in, 24, parameters_split=split, device=DEVICE)
    params = dict(m.named_parameters())
    for n, k in zip(names, sizes):
        assert tuple(params[f"{n}_weight"].shape) == (k, n_in) and tuple(params[f"{n}_bias"].shape) == (k,)
    assert "weight" not in params and "bias" not in params
    with torch.no_grad():
        for n in names:
            getattr(m, f"{n}_bias").copy_(torch.randn(getattr(m, f"{n}_bias").shape, generator=g))
    x = torch.randn(3, 4, n_in, generator=g, requires_grad=True)
    dy = torch.randn(3, 4, 24, generator=g)
    y = m(dev(x))
    y.backward(dev(dy))
    w, b = _cat(m, names, "weight"), _cat(m, names, "bias")
    xr = cpu64(x)
    if module == "LayerNormLinear":  # default LayerNorm: weight 1, bias 0
        xr = torch.nn.functional.layer_norm(xr, (n_in,), eps=m.eps)
    assert rel_err(y, xr @ w.t() + b) < 1e-6
    dw = dy.double().reshape(-1, 24).t() @ xr.reshape(-1, n_in)
    start = 0
    for n, k in zip(names, sizes):  # each split gets its rows of the gradient
        assert rel_err(getattr(m, f"{n}_weight").grad, dw[start:start + k]) < 1e-6
        assert rel_err(getattr(m, f"{n}_bias").grad, dy.double().reshape(-1, 24).sum(0)[start:start + k]) < 1e-6
        start += k


def test_state_dict_round_trip(rng):
    g = seeded(rng)
    a = te.Linear(8, 12, parameters_split=("x", "y"), bias=False, device=DEVICE)
    b = te.Linear(8, 12, parameters_split=("x", "y"), bias=False, device=DEVICE)
    assert [k for k in a.state_dict() if not k.endswith("_extra_state")] == ["x_weight", "y_weight"]
    b.load_state_dict(a.state_dict())
    x = dev(torch.randn(2, 8, generator=g))
    assert torch.equal(a(x), b(x))


def test_split_under_fp8_matches_unsplit(rng):
    g = seeded(rng)
    n_in, n_out, tokens = gemm_dim(16), gemm_dim(32), gemm_dim(16)
    split = te.Linear(n_in, n_out, parameters_split=("p", "q"), device=DEVICE)
    whole = te.Linear(n_in, n_out, device=DEVICE)
    with torch.no_grad():
        whole.weight.copy_(torch.cat([split.p_weight, split.q_weight]))
        whole.bias.copy_(torch.cat([split.p_bias, split.q_bias]))
    x = torch.randn(tokens, n_in, generator=g)
    r = recipe.DelayedScaling()
    outs = []
    for m in (split, whole):
        with te.fp8_autocast(fp8_recipe=r):
            outs.append(m(dev(x)))
    assert torch.equal(outs[0], outs[1])  # the same FP8 casts and GEMM of the same concatenated weight


def test_meta_device_then_reset(rng):
    m = te.Linear(6, 4, parameters_split={"a": 3, "b": 1}, device="meta")
    assert m.a_weight.device.type == "meta"
    m.reset_parameters()
    assert m.a_weight.device.type != "meta" and m.b_bias.abs().sum() == 0
    assert m.a_weight.abs().sum() > 0  # init_method ran on the split weight


@pytest.mark.parametrize("split,err,match", [
    (("a", "b", "c"), ValueError, r"does not split into 3 equal parameters"),
    ({"a": 4, "b": 4}, ValueError, r"must sum to out_features \(10\)"),
    ({"a": 10, "b": 0}, ValueError, r"sizes must be positive ints"),
    (("a", "a_"), ValueError, r"distinct and non-empty"),
    (("_", "b"), ValueError, r"distinct and non-empty"),
    ("ab", TypeError, r"tuple/list of names or a dict"),
])
def test_bad_splits_raise(split, err, match):
    with pytest.raises(err, match=match):
        te.Linear(4, 10, parameters_split=split, device=DEVICE)
