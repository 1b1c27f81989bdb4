"""quantized_model_init / fp8_model_init: modules built inside keep their GEMM weights only as FP8
(Float8Tensor parameters: uint8 bytes + scale_inv), and train, save and load that way.
The modules run on NVTE_TEST_DEVICE (default the CPU backend); inputs are drawn on the CPU and moved
with dev(), the float64 emulations stay on the CPU."""
import copy
import gc
import io

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common import recipe
from transformer_engine.pytorch.tensor import Float8Tensor
from _util import DEVICE, FP8, cpu64, dev, fp8_emulate, fp8_gemm_tol, gemm_dim, rel_err, seeded
from test_current_scaling import cs_q, cs_scale

RECIPES = {"delayed": lambda: recipe.DelayedScaling(amax_history_len=4), "current": recipe.Float8CurrentScaling}
KINDS = list(RECIPES)
HP_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def fp8_bytes(x, scale, fmt="e4m3"):
    """The FP8 bytes of the cast of x with `scale` (float32 multiply, saturating), as uint8."""
    dt, mx = FP8[fmt]
    s = torch.tensor(float(scale), dtype=torch.float32)
    return (x.detach().float().cpu() * s).clamp(-mx, mx).to(dt).view(torch.uint8)


def _fp8_weights(module):
    return {n: p for n, p in module.named_parameters() if isinstance(p, Float8Tensor)}


def _hp_twin(fp8_module, make):
    """A module built without quantized_model_init whose parameters hold the FP8 module's values
    (the FP8 weights dequantized)."""
    twin = make()
    with torch.no_grad():
        for (n, p), (n2, q) in zip(fp8_module.named_parameters(), twin.named_parameters()):
            assert n == n2
            q.copy_(p.dequantize() if isinstance(p, Float8Tensor) else p)
    return twin


def _plain_float_tensors(shapes):
    """Plain (non-FP8) floating tensors alive in this process whose shape is one of `shapes`."""
    gc.collect()
    found = []
    for o in gc.get_objects():
        try:
            # (tensors a torch.compile trace left alive have symbolic sizes: not ours, skipped)
            if type(o) in (torch.Tensor, torch.nn.Parameter) and o.dtype in HP_DTYPES and \
                    all(type(d) is int for d in o.shape) and tuple(o.shape) in shapes:
                found.append(o)
        except ReferenceError:
            pass
    return found


MODULES = {
    "Linear": lambda: te.Linear(48, 80, device=DEVICE),
    "LayerNormLinear": lambda: te.LayerNormLinear(48, 80, device=DEVICE),
    "LayerNormMLP": lambda: te.LayerNormMLP(48, 80, device=DEVICE),
    "GroupedLinear": lambda: te.GroupedLinear(2, 48, 80, device=DEVICE),
    "TransformerLayer": lambda: te.TransformerLayer(48, 80, 4, hidden_dropout=0.0, attention_dropout=0.0,
                                                    device=DEVICE),
}
FP8_WEIGHT_NAMES = {
    "Linear": {"weight"}, "LayerNormLinear": {"weight"}, "LayerNormMLP": {"fc1_weight", "fc2_weight"},
    "GroupedLinear": {"weight0", "weight1"},
    "TransformerLayer": {"self_attention.layernorm_qkv.query_weight", "self_attention.layernorm_qkv.key_weight",
                         "self_attention.layernorm_qkv.value_weight", "self_attention.proj.weight",
                         "layernorm_mlp.fc1_weight", "layernorm_mlp.fc2_weight"},
}


def _call(m, name, x):
    x = dev(x)
    return m(x, [x.shape[0] // 2, x.shape[0] - x.shape[0] // 2]) if name == "GroupedLinear" else m(x)


def _input(name, g):
    # tokens: 6 (12 for the layer) on the CPU; on CUDA 16 (32), and 2 x 16 for GroupedLinear's two
    # halves: every FP8 GEMM dimension (per-group sizes included) a multiple of 16
    if name == "TransformerLayer":
        return torch.randn(gemm_dim(6), 2, 48, generator=g)
    return torch.randn(2 * gemm_dim(3) if name == "GroupedLinear" else gemm_dim(6), 48, generator=g)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", list(MODULES))
def test_only_fp8_weights_are_held(rng, kind, name):
    """The GEMM weights are Float8Tensors (uint8 bytes, no high-precision storage anywhere in the
    process, also after a training step); norm weights and biases stay high precision."""
    with te.quantized_model_init(recipe=RECIPES[kind]()):
        m = MODULES[name]()
    f8 = _fp8_weights(m)
    assert set(f8) == FP8_WEIGHT_NAMES[name]
    for n, p in m.named_parameters():
        if n in f8:
            assert isinstance(p, torch.nn.Parameter) and p.requires_grad and p.dtype == torch.float32
            assert p._data.dtype == torch.uint8 and tuple(p._data.shape) == tuple(p.shape)
            assert p._transpose.dtype == torch.uint8 and tuple(p._transpose.shape) == tuple(p.shape)[::-1]
            assert p._scale_inv.dtype == torch.float32 and p._scale_inv.numel() == 1
        else:
            assert type(p) is torch.nn.Parameter  # norm weights, biases
    shapes = {tuple(p.shape) for p in f8.values()} | {tuple(p.shape)[::-1] for p in f8.values()}
    assert _plain_float_tensors(shapes) == []
    # a training step: forward + backward under fp8_autocast, SGD, gradients dropped
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    with te.fp8_autocast(fp8_recipe=RECIPES[kind]()):
        y = _call(m, name, _input(name, seeded(rng)))  # (on DEVICE)
    y.float().square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    del y
    assert all(isinstance(p, Float8Tensor) for p in _fp8_weights(m).values()) and len(_fp8_weights(m)) == len(f8)
    assert _plain_float_tensors(shapes) == []


@pytest.mark.parametrize("name", list(MODULES))
def test_outside_autocast_equals_dequantized_module(rng, name):
    """Outside fp8_autocast the FP8 weights are dequantized: the module computes exactly what a
    module whose weights are those dequantized values computes (forward and all gradients)."""
    torch.manual_seed(int(rng.integers(1 << 30)))
    with te.quantized_model_init(recipe=recipe.Float8CurrentScaling()):
        m = MODULES[name]()
    ref = _hp_twin(m, MODULES[name])
    x = _input(name, seeded(rng)).requires_grad_()
    xr = x.detach().clone().requires_grad_()
    y, yr = _call(m, name, x), _call(ref, name, xr)
    dy = dev(torch.randn(y.shape, generator=seeded(rng)))
    y.backward(dy)
    yr.backward(dy)
    assert torch.equal(y, yr) and torch.equal(x.grad, xr.grad)
    for (n, p), (_, q) in zip(m.named_parameters(), ref.named_parameters()):
        assert type(p.grad) is torch.Tensor and p.grad.dtype == p.dtype, n
        assert torch.equal(p.grad, q.grad), n


def test_transformer_layer_fp8_equals_dequantized_module(rng):
    """Delayed scaling, first step (all scales 1): the FP8-parameter layer and a layer holding the
    dequantized weights cast to the same bytes, so outputs and gradients are identical."""
    torch.manual_seed(int(rng.integers(1 << 30)))
    make = MODULES["TransformerLayer"]
    r = recipe.DelayedScaling(fp8_format=recipe.Format.HYBRID)
    with te.quantized_model_init(recipe=r):
        m = make()
    ref = _hp_twin(m, make)
    x = _input("TransformerLayer", seeded(rng)).requires_grad_()
    xr = x.detach().clone().requires_grad_()
    with te.fp8_autocast(fp8_recipe=r):
        y = m(dev(x))
    with te.fp8_autocast(fp8_recipe=r):
        yr = ref(dev(xr))
    dy = dev(torch.randn(y.shape, generator=seeded(rng)) * 1e-2)
    y.backward(dy)
    yr.backward(dy)
    assert torch.equal(y, yr) and torch.equal(x.grad, xr.grad)
    for (n, p), (_, q) in zip(m.named_parameters(), ref.named_parameters()):
        assert torch.equal(p.grad, q.grad), n


@pytest.mark.parametrize("kind", KINDS)
def test_linear_training_matches_emulation(rng, kind):
    """Three SGD steps of an FP8-parameter Linear under fp8_autocast against a float64 emulation:
    the forward GEMMs read the stored FP8 weight, and each SGD update (computed in high
    precision) is cast back with the quantizer's scale: the module's current weight scale
    (delayed) or the new value's own amax (current)."""
    g = seeded(rng)
    r = RECIPES[kind]()
    with te.quantized_model_init(recipe=r):
        m = te.Linear(32, 16, bias=False, device=DEVICE)
    w = m.weight
    meta = m.fp8_meta
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    tokens = gemm_dim(8)  # 8 on the CPU, 16 on CUDA (the wgrad GEMM's inner dimension)
    for step in range(3):
        x = torch.randn(tokens, 32, generator=g) * (1 + step)
        dy = torch.randn(tokens, 16, generator=g) * 0.1
        s_x = meta.scale["fwd"][0].item()
        w_deq = cpu64(w.dequantize())
        with te.fp8_autocast(fp8_recipe=r):
            y = m(dev(x))
        y.backward(dev(dy))
        if kind == "delayed":
            xq = fp8_emulate(x, s_x, "e4m3")
            # the first backward casts the gradient with its own scale (seeding the empty history)
            gq = cs_q(dy, "e5m2") if step == 0 else fp8_emulate(dy, meta.scale["bwd"][0].item(), "e5m2")
        else:
            xq, gq = cs_q(x, "e4m3"), cs_q(dy, "e5m2")
        assert rel_err(y, xq @ w_deq.t()) < fp8_gemm_tol(1e-6), step
        assert rel_err(m.weight.grad, gq.t() @ xq) < fp8_gemm_tol(1e-5), step
        twin = torch.nn.Parameter(w.dequantize())  # the same update on a high-precision copy
        twin.grad = m.weight.grad.clone()
        torch.optim.SGD([twin], lr=0.05).step()
        new_hp = twin.detach()
        s_w = meta.scale["fwd"][1].item() if kind == "delayed" else cs_scale(new_hp, "e4m3")
        opt.step()
        opt.zero_grad(set_to_none=True)
        assert m.weight is w and isinstance(w, Float8Tensor)
        assert torch.equal(w._data.cpu(), fp8_bytes(new_hp, s_w)), step
        assert w._scale_inv.item() == torch.tensor(s_w, dtype=torch.float32).reciprocal().item(), step
        # the transposed bytes follow
        assert torch.equal(w._transpose, w._data.t())
    if kind == "delayed":  # the updates' amaxes reached the weight slot's history: its scale moved
        assert meta.scale["fwd"][1].item() != 1.0


@pytest.mark.parametrize("kind", KINDS)
def test_copy_requantizes(rng, kind):
    g = seeded(rng)
    r = RECIPES[kind]()
    with te.quantized_model_init(recipe=r):
        m = te.Linear(16, 8, device=DEVICE)
    hp = torch.randn(8, 16, generator=g)
    hist_before = m.fp8_meta.amax_history["fwd"][0, 1].item()
    with torch.no_grad():
        m.weight.copy_(dev(hp))
    s = m.fp8_meta.scale["fwd"][1].item() if kind == "delayed" else cs_scale(hp, "e4m3")
    assert torch.equal(m.weight._data.cpu(), fp8_bytes(hp, s))
    if kind == "delayed":  # the cast recorded the new value's amax for the recipe step
        assert m.fp8_meta.amax_history["fwd"][0, 1].item() == max(hist_before, hp.abs().max().item())
    # param.data.copy_ writes the same parameter (bf16 source, converted first)
    hp2 = torch.randn(8, 16, generator=g).bfloat16()
    m.weight.data.copy_(dev(hp2))
    s2 = m.fp8_meta.scale["fwd"][1].item() if kind == "delayed" else cs_scale(hp2.float(), "e4m3")
    assert torch.equal(m.weight._data.cpu(), fp8_bytes(hp2.float(), s2))
    assert isinstance(m.weight, Float8Tensor) and m.weight._data.dtype == torch.uint8


@pytest.mark.parametrize("opt_cls,kw", [(torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=0.01)),
                                        (torch.optim.Adam, dict(lr=0.01)),
                                        (torch.optim.SGD, dict(lr=0.1, momentum=0.9, foreach=True)),
                                        (torch.optim.Adam, dict(lr=0.01, foreach=True)),
                                        (torch.optim.AdamW, dict(lr=0.01, fused=True))],
                         ids=["SGD_momentum_wd", "Adam", "SGD_foreach", "Adam_foreach", "AdamW_fused"])
def test_optimizers_update_fp8_params(rng, opt_cls, kw):
    """An optimizer step on an FP8 parameter equals the same step on a high-precision copy of its
    value, cast back to FP8 (current scaling: scale from the new value). foreach / fused steps
    update whole lists in place (torch's _foreach_* / _fused_* ops): they had left FP8 parameters
    unchanged."""
    g = seeded(rng)
    with te.quantized_model_init(recipe=recipe.Float8CurrentScaling()):
        m = te.Linear(16, 8, bias=False, device=DEVICE)
    twin = torch.nn.Parameter(m.weight.dequantize())
    opt, opt_twin = opt_cls([m.weight], **kw), opt_cls([twin], **kw)
    for _ in range(2):
        grad = torch.randn(8, 16, generator=g)
        m.weight.grad, twin.grad = dev(grad).clone(), dev(grad).clone()
        opt.step()
        opt_twin.step()
        assert isinstance(m.weight, Float8Tensor)
        assert torch.equal(m.weight._data.cpu(), fp8_bytes(twin, cs_scale(twin, "e4m3")))
        with torch.no_grad():
            twin.copy_(m.weight.dequantize())  # continue from the FP8 value, as the FP8 parameter does


@pytest.mark.parametrize("kind", KINDS)
def test_state_dict_round_trip(rng, kind, tmp_path):
    torch.manual_seed(int(rng.integers(1 << 30)))
    r = RECIPES[kind]()
    make = lambda: te.LayerNormMLP(16, 32, device=DEVICE)  # noqa: E731
    with te.quantized_model_init(recipe=r):
        m = make()
    x = dev(torch.randn(gemm_dim(4), 16, generator=seeded(rng)))  # tokens 4 on the CPU, 16 on CUDA
    with te.fp8_autocast(fp8_recipe=r):  # move the recipe state away from its initial values
        m(x).sum().backward()
    path = tmp_path / "sd.pt"
    torch.save(m.state_dict(), path)
    sd = torch.load(path)  # weights_only=True (the default): Float8Tensor is an allowed global
    assert isinstance(sd["fc1_weight"], Float8Tensor)
    with te.quantized_model_init(recipe=r):
        torch.manual_seed(12345)
        m2 = make()
    assert not torch.equal(m2.fc1_weight._data, m.fc1_weight._data)
    m2.load_state_dict(sd)
    for n, p in _fp8_weights(m).items():
        q = getattr(m2, n)
        assert isinstance(q, Float8Tensor) and torch.equal(q._data, p._data) and torch.equal(q._transpose, p._transpose)
        assert torch.equal(q._scale_inv, p._scale_inv)
    for key in ("fwd", "bwd"):
        assert torch.equal(m2.fp8_meta.scale[key], m.fp8_meta.scale[key])
        assert torch.equal(m2.fp8_meta.amax_history[key], m.fp8_meta.amax_history[key])
    with torch.no_grad(), te.fp8_autocast(fp8_recipe=r):
        assert torch.equal(m2(x), m(x))
    # into a high-precision module: the dequantized values
    hp = make()
    hp.load_state_dict(sd)
    assert torch.equal(hp.fc2_weight, m.fc2_weight.dequantize())
    # a high-precision checkpoint into an FP8 module: cast on load (current scaling: exact emulation)
    if kind == "current":
        src = make()
        m2.load_state_dict(src.state_dict())
        assert torch.equal(m2.fc1_weight._data.cpu(), fp8_bytes(src.fc1_weight, cs_scale(src.fc1_weight, "e4m3")))


def test_preserve_high_precision_init_val(rng):
    torch.manual_seed(int(rng.integers(1 << 30)))
    with te.quantized_model_init(recipe=recipe.Float8CurrentScaling(), preserve_high_precision_init_val=True):
        m = te.Linear(48, 80, device=DEVICE)
    init = m.weight.get_high_precision_init_val()
    # TE keeps the preserved value in CPU memory (whatever the module's device), to seed master weights
    assert init is not None and init.device.type == "cpu" and init.dtype == torch.float32
    assert torch.equal(m.weight._data.cpu(), fp8_bytes(init, cs_scale(init, "e4m3")))
    assert not torch.equal(m.weight.dequantize().cpu(), init)  # the FP8 value differs: the init value is extra
    assert len(_plain_float_tensors({(80, 48)})) == 1
    del init
    m.weight.clear_high_precision_init_val()
    assert m.weight.get_high_precision_init_val() is None
    assert _plain_float_tensors({(80, 48)}) == []
    with te.quantized_model_init(recipe=recipe.Float8CurrentScaling()):
        m2 = te.Linear(8, 8, device=DEVICE)
    assert m2.weight.get_high_precision_init_val() is None


def test_context_scope_and_options(rng):
    with te.fp8_model_init(enabled=True):  # the TE 1.x name, default recipe (DelayedScaling)
        a = te.Linear(8, 8, device=DEVICE)
        with te.quantized_model_init(enabled=False):
            b = te.Linear(8, 8, device=DEVICE)
        c = te.LayerNorm(8, device=DEVICE)
    d = te.Linear(8, 8, device=DEVICE)
    assert isinstance(a.weight, Float8Tensor) and a.weight.fp8_dtype == int(te._ops.DType.kFloat8E4M3)
    assert a.fp8_meta.initialized and a.get_extra_state() is not None
    assert type(b.weight) is torch.nn.Parameter and type(d.weight) is torch.nn.Parameter
    assert type(c.weight) is torch.nn.Parameter
    with te.quantized_model_init(recipe=recipe.DelayedScaling(fp8_format=recipe.Format.E5M2)):
        e = te.Linear(8, 8, device=DEVICE)
    assert e.weight.fp8_dtype == int(te._ops.DType.kFloat8E5M2)
    with pytest.raises(NotImplementedError, match="DelayedScaling and Float8CurrentScaling"):
        with te.quantized_model_init(recipe=recipe.MXFP8BlockScaling()):
            pass
    with pytest.raises(TypeError, match="Recipe"):
        with te.quantized_model_init(recipe="delayed"):
            pass


def test_meta_device_then_reset_parameters():
    with te.quantized_model_init(recipe=recipe.Float8CurrentScaling()):
        m = te.Linear(8, 4, device="meta")
    assert m.weight.device.type == "meta" and not isinstance(m.weight, Float8Tensor)
    m.reset_parameters()  # outside the region: the module remembers it was built inside
    # materialised on the default device: CUDA when available, else the CPU (any NVTE_TEST_DEVICE)
    assert isinstance(m.weight, Float8Tensor) and m.weight.device.type == ("cuda" if torch.cuda.is_available()
                                                                           else "cpu")


def test_no_grad_build_keeps_no_transpose(rng):
    """Built under no_grad (inference) the parameter keeps only the rowwise bytes; a forward that
    needs a dgrad transposes them on the fly."""
    with torch.no_grad(), te.quantized_model_init(recipe=recipe.Float8CurrentScaling()):
        # out features and tokens: 8 and 4 on the CPU, 16 on CUDA (FP8 GEMM dims 16-aligned)
        m = te.Linear(16, gemm_dim(8), bias=False, device=DEVICE)
    assert m.weight._transpose is None
    x = torch.randn(gemm_dim(4), 16, generator=seeded(rng), requires_grad=True)
    with te.fp8_autocast(fp8_recipe=recipe.Float8CurrentScaling()):
        y = m(dev(x))
    dy = torch.randn(gemm_dim(4), gemm_dim(8), generator=seeded(rng))
    y.backward(dev(dy))
    assert rel_err(x.grad, cs_q(dy, "e5m2") @ cpu64(m.weight.dequantize())) < fp8_gemm_tol(1e-6)


def test_deepcopy_and_clone(rng):
    with te.quantized_model_init(recipe=recipe.DelayedScaling()):
        m = te.Linear(8, 4, device=DEVICE)
    c = copy.deepcopy(m)
    assert isinstance(c.weight, Float8Tensor) and isinstance(c.weight, torch.nn.Parameter)
    assert c.weight._quantizer.meta is c.fp8_meta and c.weight._data.data_ptr() != m.weight._data.data_ptr()
    assert torch.equal(c.weight._data, m.weight._data)
    k = m.weight.detach().clone()
    assert isinstance(k, Float8Tensor) and k._data.data_ptr() != m.weight._data.data_ptr()
    buf = io.BytesIO()
    torch.save(m.weight.detach(), buf)
    buf.seek(0)
    assert torch.equal(torch.load(buf).dequantize(), m.weight.dequantize())


def test_data_assignment_and_conversions(rng):
    """param.data = t casts t into the parameter's bytes (TE's setter); .float() / .bfloat16() /
    .cpu() are dequantized copies (writing to them leaves the parameter alone)."""
    with te.quantized_model_init(recipe=recipe.Float8CurrentScaling()):
        m = te.Linear(8, 4, bias=False, device=DEVICE)
    w = m.weight
    w.data = dev(torch.full((4, 8), 0.5))
    assert isinstance(m.weight, Float8Tensor) and torch.equal(w.dequantize().cpu(), torch.full((4, 8), 0.5))
    with pytest.raises(ValueError, match=r"shape \(2, 8\) to one of shape \(4, 8\)"):
        w.data = dev(torch.zeros(2, 8))
    for conv, dt in ((w.float, torch.float32), (w.bfloat16, torch.bfloat16), (w.cpu, w.dtype)):
        c = conv()
        assert type(c) is torch.Tensor and c.dtype == dt
        c.mul_(0)
    assert torch.equal(w.dequantize().cpu(), torch.full((4, 8), 0.5))


def test_is_fp8_available_signature():
    assert isinstance(te.is_fp8_available(), bool)
    ok, reason = te.is_fp8_available(return_reason=True)
    assert isinstance(ok, bool) and isinstance(reason, str)
