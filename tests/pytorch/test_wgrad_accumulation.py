"""fuse_wgrad_accumulation (Linear, LayerNormLinear, LayerNormMLP, GroupedLinear, MultiheadAttention,
TransformerLayer): the weight gradient is added into each weight's `main_grad` by the wgrad GEMM,
and `.grad` gets a zero tensor (weights flagged `grad_added_to_main_grad`, Megatron's contract,
the flag set to True) or nothing. Checked against float64 references and against the same module
without the option (same weights, same inputs). Modules run on NVTE_TEST_DEVICE."""
import copy

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common import recipe
from _util import DEVICE, cpu64, dev, gemm_dim, rel_err, seeded


def _main_grads(module, g, dtype=torch.float32, flag=None, scale=1.0):
    """Random main_grad buffers (their initial values kept) for every 2-D weight of module; scale:
    their size (near the gradients', so that subtracting it again loses no float32 digits)."""
    init = {}
    for name, p in module.named_parameters():
        if p.dim() == 2:
            p.main_grad = dev((torch.randn(p.shape, generator=g) * scale).to(dtype))
            init[name] = p.main_grad.detach().clone()
            if flag is not None:
                p.grad_added_to_main_grad = flag
    return init


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("flagged", [False, True])
@pytest.mark.parametrize("main_dtype", [torch.float32, torch.bfloat16])
def test_linear_accumulates_into_main_grad(rng, bias, flagged, main_dtype):
    g = seeded(rng)
    n_in, n_out, tokens = 19, 13, 7
    m = te.Linear(n_in, n_out, bias=bias, fuse_wgrad_accumulation=True, device=DEVICE)
    init = _main_grads(m, g, main_dtype, False if flagged else None)
    xs = [torch.randn(tokens, n_in, generator=g) for _ in range(2)]
    dys = [torch.randn(tokens, n_out, generator=g) for _ in range(2)]
    for x, dy in zip(xs, dys):  # two micro-batches accumulate
        m(dev(x)).backward(dev(dy))
    ref = init["weight"].double().cpu() + sum(dy.double().t() @ x.double() for x, dy in zip(xs, dys))
    tol = 1e-6 if main_dtype == torch.float32 else 1e-2
    assert rel_err(m.weight.main_grad, ref) < tol
    assert m.weight.main_grad.dtype == main_dtype
    if flagged:
        assert m.weight.grad_added_to_main_grad is True
        assert m.weight.grad is not None and not m.weight.grad.any()
    else:
        assert m.weight.grad is None
    if bias:  # the bias gradient still goes to .grad
        assert rel_err(m.bias.grad, sum(dy.double().sum(0) for dy in dys)) < 1e-6


def _twins(make, g):
    """(module with fuse_wgrad_accumulation, the same module without it, same weights)."""
    fused = make(True)
    plain = make(False)
    plain.load_state_dict(fused.state_dict())
    return fused, plain


def _compare(fused, plain, init, atol_rel):
    """main_grad - its initial value of every weight of `fused` equals the .grad of `plain`."""
    for name, p in fused.named_parameters():
        q = dict(plain.named_parameters())[name]
        if p.dim() == 2:
            got = cpu64(p.main_grad) - init[name].double().cpu()
            assert rel_err(got, q.grad) < atol_rel, name
            assert p.grad is None, name
        elif q.grad is not None:
            assert rel_err(p.grad, q.grad) < atol_rel, name


@pytest.mark.parametrize("kind", ["LayerNormLinear", "LayerNormMLP", "MultiheadAttention", "TransformerLayer"])
def test_modules_match_unfused(rng, kind):
    g = seeded(rng)
    h = 32
    makers = {
        "LayerNormLinear": lambda f: te.LayerNormLinear(h, 24, fuse_wgrad_accumulation=f, device=DEVICE),
        "LayerNormMLP": lambda f: te.LayerNormMLP(h, 48, fuse_wgrad_accumulation=f, device=DEVICE),
        "MultiheadAttention": lambda f: te.MultiheadAttention(h, 4, attention_dropout=0.0, input_layernorm=True,
                                                              fuse_wgrad_accumulation=f, device=DEVICE),
        "TransformerLayer": lambda f: te.TransformerLayer(h, 48, 4, hidden_dropout=0.0, attention_dropout=0.0,
                                                          fuse_wgrad_accumulation=f, device=DEVICE),
    }
    fused, plain = _twins(makers[kind], g)
    init = _main_grads(fused, g, scale=1e-3)
    assert len(init) >= (1 if kind == "LayerNormLinear" else 2)
    shape = (5, 2, h) if kind in ("MultiheadAttention", "TransformerLayer") else (10, h)
    x = torch.randn(shape, generator=g)
    dy = torch.randn(shape if kind != "LayerNormLinear" else (10, 24), generator=g)
    for mod in (fused, plain):
        out = mod(dev(x))
        out = out[0] if isinstance(out, tuple) else out
        out.backward(dev(dy))
    _compare(fused, plain, init, 1e-6)


@pytest.mark.parametrize("fp8", ["delayed", "current"])
def test_fp8_linear_matches_unfused(rng, fp8):
    g = seeded(rng)
    n_in, n_out, tokens = gemm_dim(24), gemm_dim(40), gemm_dim(16)
    fused, plain = _twins(lambda f: te.LayerNormLinear(n_in, n_out, fuse_wgrad_accumulation=f, device=DEVICE), g)
    init = _main_grads(fused, g, scale=1e-3)
    r = (recipe.DelayedScaling(amax_history_len=4) if fp8 == "delayed" else recipe.Float8CurrentScaling())
    for step in range(3):  # delayed: the first backward seeds the gradient scale, later ones use it
        x = torch.randn(tokens, n_in, generator=g)
        dy = torch.randn(tokens, n_out, generator=g)
        for mod in (fused, plain):
            with te.fp8_autocast(fp8_recipe=r):
                out = mod(dev(x))
            out.backward(dev(dy))
    _compare(fused, plain, init, 1e-6)


@pytest.mark.parametrize("fp8", [False, True])
def test_grouped_linear(rng, fp8):
    g = seeded(rng)
    splits = [gemm_dim(5), 0, gemm_dim(11)]
    n_in, n_out = gemm_dim(16), gemm_dim(24)
    fused, plain = _twins(lambda f: te.GroupedLinear(3, n_in, n_out, fuse_wgrad_accumulation=f, device=DEVICE), g)
    init = _main_grads(fused, g, flag=False)
    x = torch.randn(sum(splits), n_in, generator=g)
    dy = torch.randn(sum(splits), n_out, generator=g)
    for mod in (fused, plain):
        with te.fp8_autocast(enabled=fp8, fp8_recipe=recipe.DelayedScaling()):
            out = mod(dev(x), splits)
        out.backward(dev(dy))
    for i in range(3):
        p, q = getattr(fused, f"weight{i}"), getattr(plain, f"weight{i}")
        got = cpu64(p.main_grad) - init[f"weight{i}"].double().cpu()
        if splits[i]:
            assert rel_err(got, q.grad) < 1e-6
        else:
            assert not got.any()  # no rows, nothing added
        assert p.grad_added_to_main_grad is True and not p.grad.any()
        assert rel_err(getattr(fused, f"bias{i}").grad, getattr(plain, f"bias{i}").grad) < 1e-6


def test_split_parameters_accumulate_into_each_main_grad(rng):
    g = seeded(rng)
    m = te.Linear(16, 12, parameters_split={"a": 8, "b": 4}, fuse_wgrad_accumulation=True, device=DEVICE)
    init = _main_grads(m, g)
    x, dy = torch.randn(6, 16, generator=g), torch.randn(6, 12, generator=g)
    m(dev(x)).backward(dev(dy))
    dw = dy.double().t() @ x.double()
    assert rel_err(cpu64(m.a_weight.main_grad) - init["a_weight"].double().cpu(), dw[:8]) < 1e-6
    assert rel_err(cpu64(m.b_weight.main_grad) - init["b_weight"].double().cpu(), dw[8:]) < 1e-6
    assert m.a_weight.grad is None and m.b_weight.grad is None


def test_frozen_weight_needs_no_main_grad(rng):
    m = te.Linear(8, 8, fuse_wgrad_accumulation=True, device=DEVICE)
    m.weight.requires_grad_(False)
    x = dev(torch.randn(3, 8, generator=seeded(rng))).requires_grad_()
    m(x).sum().backward()  # no weight gradient: no main_grad read
    assert m.weight.grad is None and m.bias.grad is not None


def test_missing_or_wrong_main_grad_raises(rng):
    m = te.Linear(8, 6, fuse_wgrad_accumulation=True, device=DEVICE)
    x = dev(torch.randn(3, 8, generator=seeded(rng)))
    with pytest.raises(RuntimeError, match="needs each weight's `main_grad`"):
        m(x)
    m.weight.main_grad = dev(torch.zeros(8, 6))
    with pytest.raises(ValueError, match=r"main_grad must have the weight's shape \(6, 8\)"):
        m(x)
    m.weight.main_grad = dev(torch.zeros(6, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="float32 / bfloat16 / float16"):
        m(x)
    with torch.no_grad():  # no gradient, no buffer needed
        m(x)


def test_deepcopy_keeps_option():
    m = te.Linear(8, 6, fuse_wgrad_accumulation=True, device=DEVICE)
    assert copy.deepcopy(m).fuse_wgrad_accumulation


def test_overwrite_main_grad(rng):
    """A weight with `overwrite_main_grad` = True (TE's attribute) gets the gradient written into
    main_grad instead of added; for split weights too."""
    g = seeded(rng)
    for split in (None, ("a", "b")):
        m = te.Linear(16, 12, parameters_split=split, fuse_wgrad_accumulation=True, device=DEVICE)
        init = _main_grads(m, g)
        for p in m.parameters():
            if p.dim() == 2:
                p.main_grad.fill_(100.0)
                p.overwrite_main_grad = True
        x, dy = torch.randn(6, 16, generator=g), torch.randn(6, 12, generator=g)
        m(dev(x)).backward(dev(dy))
        got = torch.cat([cpu64(p.main_grad) for p in m.parameters() if p.dim() == 2])
        assert len(init) == (1 if split is None else 2)
        assert rel_err(got, dy.double().t() @ x.double()) < 1e-6


@pytest.mark.parametrize("module", ["Linear", "LayerNormLinear", "LayerNormMLP", "GroupedLinear"])
def test_first_microbatch_overwrites_main_grad(rng, module):
    """TE: a forward with is_first_microbatch=True writes its weight gradient into main_grad instead
    of adding it (stale contents are dropped); later micro-batches (False / None) add. GroupedLinear's
    empty row block gets zeros written on the first micro-batch."""
    g = seeded(rng)
    n_in, n_out, tokens = 16, 24, 6  # (24: cuBLASLt's GELU epilogue on CUDA takes multiples of 8)
    make = {"Linear": lambda: te.Linear(n_in, n_out, fuse_wgrad_accumulation=True, device=DEVICE),
            "LayerNormLinear": lambda: te.LayerNormLinear(n_in, n_out, fuse_wgrad_accumulation=True, device=DEVICE),
            "LayerNormMLP": lambda: te.LayerNormMLP(n_in, n_out, fuse_wgrad_accumulation=True, device=DEVICE),
            "GroupedLinear": lambda: te.GroupedLinear(2, n_in, n_out, fuse_wgrad_accumulation=True, device=DEVICE)}
    m = make[module]()
    for p in m.parameters():
        if p.dim() == 2:
            p.main_grad = dev(torch.full(p.shape, 100.0))  # stale contents the first micro-batch drops
    xs = [torch.randn(tokens, n_in, generator=g) for _ in range(2)]
    dys = [torch.randn(tokens, n_in if module == "LayerNormMLP" else n_out, generator=g) for _ in range(2)]
    call = (lambda mod, x, first: mod(dev(x), [0, tokens], is_first_microbatch=first)) if module == "GroupedLinear" \
        else (lambda mod, x, first: mod(dev(x), is_first_microbatch=first))
    for x, dy, first in zip(xs, dys, (True, False)):
        call(m, x, first).backward(dev(dy))
    # the reference: the same weights without the option, .grad summed over both micro-batches
    plain2 = {"Linear": lambda: te.Linear(n_in, n_out, device=DEVICE),
              "LayerNormLinear": lambda: te.LayerNormLinear(n_in, n_out, device=DEVICE),
              "LayerNormMLP": lambda: te.LayerNormMLP(n_in, n_out, device=DEVICE),
              "GroupedLinear": lambda: te.GroupedLinear(2, n_in, n_out, device=DEVICE)}[module]()
    plain2.load_state_dict(m.state_dict())
    for x, dy in zip(xs, dys):
        call(plain2, x, None).backward(dev(dy))
    got = {n: p.main_grad for n, p in m.named_parameters() if p.dim() == 2}
    want = {n: p.grad for n, p in plain2.named_parameters() if p.dim() == 2}
    assert set(got) == set(want) and got
    for n in got:
        assert rel_err(got[n], want[n]) < 1e-6, n  # no trace of the 100s


def test_frozen_split_gets_nothing(rng):
    g = seeded(rng)
    m = te.Linear(16, 12, parameters_split={"a": 4, "b": 8}, fuse_wgrad_accumulation=True, device=DEVICE)
    m.a_weight.requires_grad_(False)  # (Megatron allocates main_grad for trainable weights only)
    m.b_weight.main_grad = dev(torch.zeros(8, 16))
    x, dy = torch.randn(6, 16, generator=g), torch.randn(6, 12, generator=g)
    m(dev(x)).backward(dev(dy))
    assert rel_err(m.b_weight.main_grad, (dy.double().t() @ x.double())[4:]) < 1e-6


def test_main_grad_made_before_backward(rng):
    """Megatron-FSDP parameters (`__fsdp_param__`) make main_grad on demand: get_main_grad() is read
    in backward (as TE does), none is needed at forward."""
    g = seeded(rng)
    m = te.Linear(16, 12, fuse_wgrad_accumulation=True, device=DEVICE)
    buf = dev(torch.zeros(12, 16))
    calls = []
    m.weight.__fsdp_param__ = True
    m.weight.get_main_grad = lambda: (calls.append(1), buf)[1]
    x, dy = torch.randn(6, 16, generator=g), torch.randn(6, 12, generator=g)
    y = m(dev(x))
    assert not calls
    y.backward(dev(dy))
    assert calls and rel_err(buf, dy.double().t() @ x.double()) < 1e-6
