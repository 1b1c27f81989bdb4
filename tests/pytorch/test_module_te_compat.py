"""TE 2.x constructor conventions of the modules: LayerNorm / RMSNorm over normalized_shape (an int
or several inner dims, hidden_size as TE's deprecated name, dtype, sm_margin), the
sequence_parallel attribute Megatron-LM reads on norm parameters, and weights initialised in the
stream of get_rng_state_tracker (TE's reset_parameters forks it); TE's parameter names of the
cross-attention projections, its tensor-parallel-only options at tp_size 1,
set_tensor_parallel_group and reset_fp8_meta_tensors."""
import contextlib

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common import recipe

from _util import DEVICE, dev, gemm_dim, rel_err


def norm_ref(x, w, b, eps, dims, rms):
    x = x.double()
    red = tuple(range(x.dim() - dims, x.dim()))
    if rms:
        y = x / torch.sqrt((x * x).mean(red, keepdim=True) + eps)
    else:
        y = (x - x.mean(red, keepdim=True)) / torch.sqrt(x.var(red, unbiased=False, keepdim=True) + eps)
    return y * w.double() + (b.double() if b is not None else 0.0)


@pytest.mark.parametrize("cls", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("shape", [5, (5,), [3, 4], (2, 3, 4)])
def test_normalized_shape(cls, shape):
    m = getattr(te, cls)(shape, eps=1e-3, device=DEVICE)
    dims = (shape,) if isinstance(shape, int) else tuple(shape)
    assert tuple(m.weight.shape) == dims and m.normalized_shape == dims
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        m.weight.copy_(torch.rand(dims, generator=g) + 0.5)
        if cls == "LayerNorm":
            m.bias.copy_(torch.randn(dims, generator=g))
    x = torch.randn(2, 3, *dims, generator=g).requires_grad_()
    y = m(dev(x))
    ref = norm_ref(x, m.weight.detach().cpu(), None if cls == "RMSNorm" else m.bias.detach().cpu(), 1e-3, len(dims),
                   cls == "RMSNorm")
    assert y.shape == x.shape and rel_err(y, ref) < 1e-5
    dy = torch.randn(x.shape, generator=g)
    y.backward(dev(dy))
    x64 = x.detach().double().requires_grad_()
    w64 = m.weight.detach().cpu().double().requires_grad_()
    norm_ref(x64, w64, None if cls == "RMSNorm" else m.bias.detach().cpu(), 1e-3, len(dims),
             cls == "RMSNorm").backward(dy.double())
    assert rel_err(x.grad, x64.grad) < 1e-4 and rel_err(m.weight.grad, w64.grad) < 1e-4
    with pytest.raises(ValueError, match="last dimension must be|inner dims must be"):
        m(dev(torch.randn(2, dims[-1] + 1)) if len(dims) == 1 else dev(torch.randn(2, 7, dims[-1])))


def test_norm_keywords():
    a = te.LayerNorm(hidden_size=8, device=DEVICE)  # TE's deprecated name
    assert te.LayerNorm((8,), hidden_size=8, device=DEVICE).normalized_shape == (8,)
    b = te.RMSNorm(normalized_shape=8, dtype=torch.bfloat16, sm_margin=4, device=DEVICE)
    assert a.normalized_shape == (8,) and b.weight.dtype == torch.bfloat16
    for bad, match in ((dict(normalized_shape=8, hidden_size=4), "disagree"), (dict(), "required"),
                       (dict(normalized_shape=(4, 0)), "positive"), (dict(normalized_shape=4, sm_margin=-1), "sm_margin"),
                       (dict(normalized_shape=4, dtype=torch.float16, params_dtype=torch.float32), "disagree")):
        with pytest.raises((ValueError, TypeError), match=match):
            te.LayerNorm(**bad)


@pytest.mark.parametrize("sp", [False, True])
def test_sequence_parallel_attribute_on_norm_parameters(sp):
    for m in (te.LayerNorm(8, sequence_parallel=sp, device=DEVICE), te.RMSNorm(8, sequence_parallel=sp, device=DEVICE)):
        assert all(p.sequence_parallel is sp for p in m.parameters())


class Tracker:
    """Megatron's get_rng_state_tracker() stand-in: fork(name) draws in the named stream."""

    def __init__(self, seed):
        self.states, self.seed, self.names = {}, seed, []

    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        self.names.append(name)
        orig = torch.get_rng_state()
        if name not in self.states:
            torch.manual_seed(self.seed)
            self.states[name] = torch.get_rng_state()
        torch.set_rng_state(self.states[name])
        try:
            yield
        finally:
            self.states[name] = torch.get_rng_state()
            torch.set_rng_state(orig)


@pytest.mark.parametrize("make", [
    lambda t: te.Linear(8, gemm_dim(8), get_rng_state_tracker=lambda: t, rng_tracker_name="expert", device="cpu"),
    lambda t: te.LayerNormLinear(8, gemm_dim(8), get_rng_state_tracker=lambda: t, device="cpu"),
    lambda t: te.LayerNormMLP(8, 16, get_rng_state_tracker=lambda: t, device="cpu"),
    lambda t: te.GroupedLinear(2, 8, gemm_dim(8), get_rng_state_tracker=lambda: t, device="cpu"),
])
def test_weights_are_drawn_in_the_rng_tracker(make):
    """The weights depend on the tracker's seed, not on torch's global one, and the global
    generator does not move."""
    weights = []
    for tracker_seed, global_seed in ((1, 10), (1, 20), (2, 10)):
        torch.manual_seed(global_seed)
        before = torch.get_rng_state()
        t = Tracker(tracker_seed)
        m = make(t)
        assert torch.equal(before, torch.get_rng_state()), "the global RNG moved"
        assert t.names, "the tracker was not used"
        weights.append(torch.cat([p.detach().flatten() for p in m.parameters()]))
    assert torch.equal(weights[0], weights[1]) and not torch.equal(weights[0], weights[2])


def test_cross_attention_parameter_names():
    """TE's names: the query projection without an input norm is a plain Linear (`query_layer.weight`);
    with one it is split (`layernorm_query.query_weight`); `key_value` is split into key / value."""
    plain = te.MultiheadAttention(32, 4, attention_type="cross", device=DEVICE)
    keys = [k for k in plain.state_dict() if not k.endswith("_extra_state")]
    assert [k for k in keys if k.startswith("query_layer.")] == ["query_layer.weight", "query_layer.bias"]
    assert {"key_value.key_weight", "key_value.value_weight"} <= set(keys)
    normed = te.MultiheadAttention(32, 4, attention_type="cross", input_layernorm=True, device=DEVICE)
    assert "layernorm_query.query_weight" in normed.state_dict()


def _same_layer_output(make_a, make_b):
    torch.manual_seed(3)
    a = make_a()
    torch.manual_seed(3)
    b = make_b()
    x = torch.randn(4, 2, 32, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    a.eval(), b.eval()
    return torch.equal(a(x), b(x))


def test_tensor_parallel_only_options_accepted_at_tp_size_1():
    """sequence_parallel, set_parallel_mode and the userbuffer overlaps act on tensor-parallel
    communication only: with tp_size 1 (TE too) they are accepted and change nothing."""
    opts = dict(sequence_parallel=True, set_parallel_mode=True, ub_overlap_ag=True, ub_overlap_rs=True,
                ub_bulk_dgrad=True, ub_bulk_wgrad=True)
    assert _same_layer_output(lambda: te.TransformerLayer(32, 64, 4, device=DEVICE, **opts),
                              lambda: te.TransformerLayer(32, 64, 4, device=DEVICE))
    assert _same_layer_output(lambda: te.LayerNormMLP(32, 64, set_parallel_mode=True, device=DEVICE),
                              lambda: te.LayerNormMLP(32, 64, device=DEVICE))
    with pytest.raises(NotImplementedError, match="tensor parallelism"):
        te.TransformerLayer(32, 64, 4, tp_size=2, device=DEVICE)


@pytest.mark.parametrize("make", [lambda: te.Linear(8, 8, device=DEVICE),
                                  lambda: te.MultiheadAttention(32, 4, device=DEVICE),
                                  lambda: te.TransformerLayer(32, 64, 4, device=DEVICE)])
def test_set_tensor_parallel_group_of_one_rank(make):
    m = make()
    m.set_tensor_parallel_group(None)
    assert m.tp_group is None


def test_reset_fp8_meta_tensors():
    layer = te.TransformerLayer(32, 64, 4, hidden_dropout=0.0, attention_dropout=0.0, device=DEVICE)
    x = torch.randn(16, 2, 32, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    with te.fp8_autocast(fp8_recipe=recipe.DelayedScaling()):
        layer(x).sum().backward()
    metas = [m.fp8_meta for m in layer.modules() if hasattr(m, "fp8_meta")]
    attn = layer.self_attention.core_attention.fp8_meta  # (its FP8 attention did not run: filled by hand)
    attn.amax_history["fwd"].fill_(1.0)
    attn.scale["bwd"].fill_(2.0)
    assert len(metas) >= 4 and all(m.amax_history["fwd"].any() for m in metas)
    layer.reset_fp8_meta_tensors()
    for m in metas:
        for key in ("fwd", "bwd"):
            assert not m.amax_history[key].any() and bool((m.scale[key] == 1).all())


def test_parameter_order_and_init_as_te():
    """TE's registration order (optimizer states index parameters by position): LayerNormMLP's
    layer_norm_weight, layer_norm_bias, fc1_weight, fc1_bias, fc2_weight, fc2_bias; a split
    Linear's every weight, then every bias. TE initialises each split on its own (a shape-dependent
    init such as xavier sees the split's shape) and LayerNormMLP's fc2 with the default init when
    only init_method is given."""
    mlp = te.LayerNormMLP(16, 32, device=DEVICE)
    assert [n for n, _ in mlp.named_parameters()] == ["layer_norm_weight", "layer_norm_bias", "fc1_weight",
                                                      "fc1_bias", "fc2_weight", "fc2_bias"]
    lin = te.Linear(64, 192, parameters_split=("query", "key", "value"), device=DEVICE)
    assert [n for n, _ in lin.named_parameters()] == ["query_weight", "key_weight", "value_weight", "query_bias",
                                                      "key_bias", "value_bias"]
    torch.manual_seed(0)
    lin = te.Linear(64, 192, parameters_split=("query", "key", "value"), init_method=torch.nn.init.xavier_uniform_,
                    device=DEVICE)
    bound_split, bound_whole = (6 / (64 + 64)) ** 0.5, (6 / (64 + 192)) ** 0.5
    for n in ("query", "key", "value"):
        w = getattr(lin, f"{n}_weight")
        assert bound_whole * 1.05 < w.abs().max().item() <= bound_split, n
    mlp = te.LayerNormMLP(16, 32, init_method=lambda w: torch.nn.init.constant_(w, 0.5), device=DEVICE)
    assert (mlp.fc1_weight == 0.5).all()
    assert 0.015 < mlp.fc2_weight.std().item() < 0.031  # TE's default normal(0, 0.023)
