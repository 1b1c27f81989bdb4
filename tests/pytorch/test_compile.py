"""torch.compile over TE modules: the registered ops (custom_ops.py) must let dynamo trace a whole
TransformerLayer, forward and backward, without graph breaks (fullgraph=True), and the compiled
layer must compute what the eager one does, FP8 recipe state included.
CPU-only by design: the modules stay on the CPU in every NVTE_TEST_DEVICE mode (the inductor test
compiles CPU code; the graph/op-registration checks do not depend on the device)."""
import copy

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common import recipe
from transformer_engine.pytorch import custom_ops
from transformer_engine import _nvte
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from _util import seeded

OPS = torch.ops.transformer_engine


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class GraphRecorder:
    """An AOTAutograd backend that runs the graphs eagerly and keeps their op targets."""

    def __init__(self):
        self.targets = {"fw": [], "bw": []}

    def _keep(self, key):
        def compiler(gm, example_inputs):
            for n in gm.graph.nodes:
                if n.op != "call_function":
                    continue
                # ops that mutate inputs appear functionalized: auto_functionalized(op, ...)
                functionalized = "auto_functionalized" in str(n.target)
                self.targets[key].append(n.args[0] if functionalized else n.target)
            return make_boxed_func(gm.forward)
        return compiler

    def backend(self):
        return aot_autograd(fw_compiler=self._keep("fw"), bw_compiler=self._keep("bw"))


def _layer(**kw):
    torch.manual_seed(0)
    return te.TransformerLayer(32, 64, 4, hidden_dropout=0.0, attention_dropout=0.0, device="cpu", **kw)


def _step(model, x, dy, fp8_recipe, params=None):
    """One forward + backward; params: the module owning the parameters (the uncompiled one)."""
    params = model if params is None else params
    x = x.detach().clone().requires_grad_()
    if fp8_recipe is None:
        y = model(x)
    else:
        with te.fp8_autocast(fp8_recipe=fp8_recipe):
            y = model(x)
    y.backward(dy)
    grads = {n: p.grad.detach().clone() for n, p in params.named_parameters()}
    params.zero_grad(set_to_none=True)
    return y.detach(), x.grad, grads


def _meta_state(model):
    out = {}
    for name, mod in model.named_modules():
        meta = getattr(mod, "fp8_meta", None)
        if meta is not None and meta.initialized:
            for key in ("fwd", "bwd"):
                out[f"{name}.{key}.history"] = meta.amax_history[key].clone()
                out[f"{name}.{key}.scale"] = meta.scale[key].clone()
    return out


def _compare_compiled_to_eager(rng, fp8_recipe, backend, steps, **layer_kw):
    g = seeded(rng)
    eager = _layer(**layer_kw)
    compiled_src = copy.deepcopy(eager)
    compiled = torch.compile(compiled_src, fullgraph=True, backend=backend)
    for step in range(steps):
        x = torch.randn(6, 2, 32, generator=g) * (1 + step)
        dy = torch.randn(6, 2, 32, generator=g) * 1e-2
        ye, dxe, ge = _step(eager, x, dy, fp8_recipe)
        yc, dxc, gc = _step(compiled, x, dy, fp8_recipe, compiled_src)
        torch.testing.assert_close(yc, ye, msg=lambda m: f"step {step} output: {m}")
        torch.testing.assert_close(dxc, dxe, msg=lambda m: f"step {step} dgrad: {m}")
        assert ge.keys() == gc.keys()
        for n in ge:
            torch.testing.assert_close(gc[n], ge[n], msg=lambda m: f"step {step} grad of {n}: {m}")
        se, sc = _meta_state(eager), _meta_state(compiled_src)
        assert se.keys() == sc.keys()
        for k in se:
            torch.testing.assert_close(sc[k], se[k], msg=lambda m: f"step {step} {k}: {m}")
    return eager, compiled_src


def test_compile_transformer_layer_high_precision(rng):
    rec = GraphRecorder()
    _compare_compiled_to_eager(rng, None, rec.backend(), steps=2)
    # the library calls are opaque nodes of the graphs, forward and backward
    for key, ops in (("fw", [OPS.layernorm_fwd, OPS.gemm, OPS.softmax_forward]),
                     ("bw", [OPS.layernorm_bwd, OPS.gemm, OPS.softmax_backward, OPS.dactivation])):
        for op in ops:
            assert op.default in rec.targets[key], (key, op)
    assert OPS.quantize.default not in rec.targets["fw"]


def test_compile_transformer_layer_with_rope(rng):
    """rotary_pos_emb: the library's RoPE ops are graph nodes both ways, results as in eager mode."""
    g = seeded(rng)
    eager = _layer()
    src = copy.deepcopy(eager)
    rec = GraphRecorder()
    compiled = torch.compile(src, fullgraph=True, backend=rec.backend())
    emb = te.RotaryPositionEmbedding(8)(6)
    x = torch.randn(6, 2, 32, generator=g)
    dy = torch.randn(6, 2, 32, generator=g) * 1e-2
    outs = []
    for model in (eager, compiled):
        xi = x.clone().requires_grad_()
        y = model(xi, rotary_pos_emb=emb)
        y.backward(dy)
        outs.append((y.detach(), xi.grad))
    torch.testing.assert_close(outs[1][0], outs[0][0])
    torch.testing.assert_close(outs[1][1], outs[0][1])
    assert OPS.fused_rope_fwd.default in rec.targets["fw"] and OPS.fused_rope_bwd.default in rec.targets["bw"]


def test_compile_transformer_layer_fp8_delayed(rng):
    r = recipe.DelayedScaling(amax_history_len=1024, fp8_format=recipe.Format.HYBRID)
    rec = GraphRecorder()
    eager, compiled = _compare_compiled_to_eager(rng, r, rec.backend(), steps=3)
    assert OPS.quantize.default in rec.targets["fw"]
    assert OPS.delayed_scaling_update.default in rec.targets["bw"]  # the backward recipe step is in the graph
    # the recipe really ran: scales moved away from 1 and the state is identical to eager (checked above)
    meta = compiled.layernorm_mlp.fp8_meta
    assert meta.initialized and not torch.equal(meta.scale["fwd"], torch.ones_like(meta.scale["fwd"]))
    assert not torch.equal(meta.scale["bwd"], torch.ones_like(meta.scale["bwd"]))


def test_compile_transformer_layer_fp8_current_scaling(rng):
    rec = GraphRecorder()
    _compare_compiled_to_eager(rng, recipe.Float8CurrentScaling(), rec.backend(), steps=2,
                               normalization="RMSNorm", activation="swiglu")
    assert OPS.quantize.default in rec.targets["fw"] and OPS.quantize.default in rec.targets["bw"]
    assert OPS.delayed_scaling_update.default not in rec.targets["bw"]


def test_compile_aot_eager_fp8_other_history_len_after_eager_step(rng):
    """A history length other than the default resizes the metadata: that happens eagerly (a clear
    error inside torch.compile), after which the compiled module runs."""
    r = recipe.DelayedScaling(amax_history_len=4)
    m = te.LayerNormMLP(16, 32, device="cpu")
    x = torch.randn(4, 16, generator=seeded(rng))
    c = torch.compile(m, fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match="outside torch.compile"):
        with te.fp8_autocast(fp8_recipe=r):
            c(x)
    torch._dynamo.reset()
    with te.fp8_autocast(fp8_recipe=r):
        m(x)
    with te.fp8_autocast(fp8_recipe=r):
        c(x).sum().backward()
    assert m.fp8_meta.amax_history["fwd"].shape == (4, 6)


def test_compile_inductor_layernorm_mlp(rng):
    """The default backend (inductor) on a small module: inductor compiles the torch ops around
    the library calls, which stay opaque custom-op calls."""
    g = seeded(rng)
    torch.manual_seed(0)
    eager = te.LayerNormMLP(16, 32, device="cpu")
    src = copy.deepcopy(eager)
    compiled = torch.compile(src, fullgraph=True)
    r = recipe.DelayedScaling()
    for step in range(2):
        x = torch.randn(5, 16, generator=g)
        dy = torch.randn(5, 16, generator=g)
        ye, dxe, ge = _step(eager, x, dy, r)
        yc, dxc, gc = _step(compiled, x, dy, r, src)
        torch.testing.assert_close(yc, ye)
        torch.testing.assert_close(dxc, dxe)
        for n in ge:
            torch.testing.assert_close(gc[n], ge[n])
    torch.testing.assert_close(src.fp8_meta.scale["bwd"], eager.fp8_meta.scale["bwd"])


# ------------------------------------------------------------------ op registration checks
def _opcheck_cases():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 16, generator=g)
    w = torch.randn(8, 16, generator=g)
    gamma, beta = torch.rand(16, generator=g) + 0.5, torch.randn(16, generator=g)
    hist, scale = torch.zeros(3, 4), torch.ones(4)
    e4 = int(_nvte.DType.kFloat8E4M3)
    q = custom_ops.quantize(w, None, None, 0, e4, True, True, False, False, 0.0)
    qx = custom_ops.quantize(x, None, None, 0, e4, True, False, False, False, 0.0)
    hp = custom_ops.HIGH_PRECISION_OPERAND
    _, mu, rs = custom_ops.layernorm_fwd(x, gamma, beta, 1e-5, False)
    scores = torch.randn(2, 2, 4, 4, generator=g)
    y = custom_ops.softmax_forward(scores, "scaled", 0.5, None)
    return [
        ("quantize_delayed", OPS.quantize, (x, scale, hist, 1, e4, True, True, True, False, 0.0)),
        ("quantize_current", OPS.quantize, (x, None, None, 0, e4, False, True, False, True, 0.0)),
        ("quantize_many", OPS.quantize_many, ([x, w[:, :5], torch.randn(3, 7, generator=g)], scale, hist, 2, e4)),
        ("delayed_scaling_update", OPS.delayed_scaling_update, (hist.clone() + 1, scale.clone(), "max", e4, 0.0)),
        ("gemm_hp_bias_gelu", OPS.gemm, (w, None, None, hp, x, None, None, hp, torch.float32, True, False,
                                         torch.randn(8, generator=g), True, False)),
        ("gemm_hp_dbias", OPS.gemm, (x, None, None, hp, torch.randn(6, 8, generator=g), None, None, hp,
                                     torch.float32, False, True, None, False, True)),
        ("gemm_fp8", OPS.gemm, (q[0], q[1], q[2], e4, qx[0], None, qx[2], e4, torch.float32, True, False, None,
                                False, False)),
        ("grouped_gemm_hp_dbias", OPS.grouped_gemm,
         ([x[:2], x[2:]], [custom_ops.missing(x.device)] * 2, [torch.empty(0)] * 2, hp,
          [torch.randn(2, 8, generator=g), torch.randn(4, 8, generator=g)], [custom_ops.missing(x.device)] * 2,
          [torch.empty(0)] * 2, hp, torch.float32, False, True, [], True)),
        ("grouped_gemm_fp8", OPS.grouped_gemm, ([q[0], q[0]], [q[1], q[1]], [q[2], q[2]], e4, [qx[0], qx[0]],
                                                [custom_ops.missing(x.device)] * 2, [qx[2], qx[2]], e4,
                                                torch.float32, True, False, [torch.randn(8, generator=g),
                                                                             torch.empty(0)], False)),
        ("layernorm_fwd", OPS.layernorm_fwd, (x, gamma, beta, 1e-5, False)),
        ("norm_fwd_fp8_layernorm", OPS.norm_fwd_fp8, (x, gamma, beta, 1e-5, False, scale, hist.clone(), 1, e4, True)),
        ("norm_fwd_fp8_rmsnorm", OPS.norm_fwd_fp8, (x, gamma, None, 1e-5, True, scale, hist.clone(), 2, e4, False)),
        ("layernorm_bwd", OPS.layernorm_bwd, (torch.randn(6, 16, generator=g), x, mu, rs, gamma, False)),
        ("rmsnorm_fwd", OPS.rmsnorm_fwd, (x, gamma, 1e-5, True)),
        ("rmsnorm_bwd", OPS.rmsnorm_bwd, (torch.randn(6, 16, generator=g), x, rs, gamma, False)),
        ("activation_swiglu", OPS.activation, (x, "swiglu")),
        ("dactivation_gelu", OPS.dactivation, (torch.randn(6, 16, generator=g), x, "gelu")),
        ("softmax_forward_masked", OPS.softmax_forward,
         (scores, "masked", 0.5, (torch.rand(2, 1, 4, 4, generator=g) > 0.5).to(torch.uint8))),
        ("softmax_backward", OPS.softmax_backward, (torch.randn(2, 2, 4, 4, generator=g), y, "scaled", 0.5)),
    ]


@pytest.mark.parametrize("case", _opcheck_cases(), ids=lambda c: c[0])
def test_custom_op_registration(case):
    """torch.library.opcheck: schema (incl. declared mutations), fake implementation and
    dispatcher registration agree with what the op really does."""
    _, op, args = case
    torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))
