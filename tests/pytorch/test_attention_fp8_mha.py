"""fp8_mha (DelayedScaling(fp8_mha=True)) in MultiheadAttention and TransformerLayer: FP8 tensors
between the QKV projection, attention and the output projection (fp8_handoff.py), against the same
modules under fp8_dpa (same recipe otherwise: the casts at attention's boundaries instead of the
hand-offs) and against float64 attention; the recipe state (which amax slots fill); that the
hand-offs really skip the high-precision copies and casts; torch.compile; activation recompute;
and the clear errors.

Device-agnostic (NVTE_TEST_DEVICE): on the CPU, float32 modules with odd sequence lengths and
token counts (the CPU backend runs every shape); on CUDA, the shapes cuDNN's FP8 attention trains
(max_seqlen 128, head dim 128 for Hopper's backward), bf16 parameters (cuBLASLt's FP8 GEMMs with an
FP8 output take a bf16/fp16 bias) and FP8 GEMM dimensions that are multiples of 16.

Tolerances (relative L2 errors): with E4M3 forward and E5M2 backward quantization (the gradients
through attention's dS have 2 mantissa bits) both FP8 runs are far from float64: on the CPU, over
all configurations and steps, at most 0.088 (fp8_mha) / 0.114 (fp8_dpa) for the output and 0.22 /
0.22 for the gradients, and the two runs differ by up to 0.15 (the roundings fp8_mha removes: the
re-casts of O and of the gradients at attention's boundaries). TOL keeps ~2x over those. Summed
over all tensors and steps, fp8_mha is never farther from float64 than fp8_dpa (measured: at most
0.4% farther, usually closer; 5% slack); single tensors and steps go both ways (up to 1.28x) by
the luck of their roundings."""
import copy
import math

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common import recipe
from transformer_engine.pytorch import custom_ops
from transformer_engine.pytorch import fused_attention as fa
from transformer_engine.pytorch import fused_attention_fp8 as fa8
from transformer_engine.pytorch.fp8_handoff import handoff_words

from _util import DEVICE, ON_CUDA, dev, rel_err

OPS = torch.ops.transformer_engine
cpu_only = pytest.mark.skipif(ON_CUDA, reason="CPU-only check (torch.compile / op registration run on the CPU)")

if ON_CUDA:
    H, D, S, S_KV, B, DTYPE = 2, 128, 128, 128, 2, torch.bfloat16
else:
    H, D, S, S_KV, B, DTYPE = 4, 16, 7, 9, 3, torch.float32  # odd lengths and token counts
HID = H * D
G = H // 2
TOL = {"out": 0.2, "grad": 0.4, "pair": 0.3}  # see the module docstring
FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}


def _zero_in_exact_math(name):
    """The key bias: adding a constant to every key of a softmax row changes nothing, so its exact
    gradient is 0 and an FP8 run's is rounding noise (no relative error exists)."""
    return name.endswith("key_bias")


def _assert_same_bits(got, want):
    """(output, input gradient, {parameter: gradient}) of two runs: bit for bit equal."""
    (y1, dx1, g1), (y0, dx0, g0) = got, want
    torch.testing.assert_close(y1, y0, rtol=0, atol=0)
    torch.testing.assert_close(dx1, dx0, rtol=0, atol=0)
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=0, atol=0)


def _check_zero_grad(grads, name, other=None):
    """Rounding noise only: small against the value bias's gradient (5%, as on the CPU), or, where
    the E5M2 dK noise is larger (bf16 on CUDA, 128-token rows: ~12%), at most twice the noise of
    the same gradient in `other` (the fp8_dpa run: dK through the same E5M2 codes)."""
    got = grads[name].norm()
    if got < 0.05 * grads[name.replace("key_bias", "value_bias")].norm():
        return
    assert other is not None and got <= 2 * other[name].norm(), (name, float(got), None if other is None else float(other[name].norm()))


def _recipe(mha: bool, **kw):
    return recipe.DelayedScaling(fp8_dpa=True, fp8_mha=mha, amax_history_len=4, **kw)


CONFIGS = {
    "split": {},
    "fused_interleaved": dict(fuse_qkv_params=True),
    "fused_blocked": dict(fuse_qkv_params=True, qkv_weight_interleaved=False),
    "gqa_interleaved": dict(fuse_qkv_params=True, num_gqa_groups=G),
    "gqa_split": dict(num_gqa_groups=G),
    "layernorm": dict(input_layernorm=True),
    "layernorm_output": dict(input_layernorm=True, return_layernorm_output=True),
    "rmsnorm_no_bias": dict(input_layernorm=True, normalization="RMSNorm", bias=False),
    "cross": dict(attention_type="cross", attn_mask_type="no_mask"),
    "cross_layernorm_gqa": dict(attention_type="cross", attn_mask_type="no_mask", input_layernorm=True,
                                num_gqa_groups=G, fuse_qkv_params=True),
}


def _mha(fmt="sbhd", **kw):
    torch.manual_seed(0)
    init = lambda w: torch.nn.init.normal_(w, 0.0, 0.12)  # noqa: E731  (attention far from uniform)
    m = te.MultiheadAttention(HID, H, attention_dropout=0.0, qkv_format=fmt, init_method=init,
                              output_layer_init_method=init, params_dtype=DTYPE, device=DEVICE, **kw)
    with torch.no_grad():  # non-zero biases (their gradients and epilogues are checked too)
        for n, p in m.named_parameters():
            if n.endswith("bias") and "layer_norm" not in n:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(n))) * 0.1)
    return m


def _shape(fmt, s):
    return (s, B, HID) if fmt == "sbhd" else (B, s, HID)


def _draw(gen, fmt):
    """Inputs of one step, of the same distribution every step (delayed scaling takes each step's
    scales from the amaxes of the steps before, so growing inputs would saturate)."""
    x = torch.randn(*_shape(fmt, S), generator=gen)
    enc = torch.randn(*_shape(fmt, S_KV), generator=gen)
    dy = torch.randn(*_shape(fmt, S), generator=gen)
    return x, enc, dy


def _step(m, r, x, enc, dy):
    """One forward (under fp8_autocast) + backward: (outputs as float32 CPU tensors, input grads, param grads)."""
    xs = [None if t is None else dev(t.to(DTYPE)).detach().requires_grad_(True) for t in (x, enc)]
    kw = dict(encoder_output=xs[1]) if m.attention_type == "cross" else {}
    with te.fp8_autocast(fp8_recipe=r):
        out = m(xs[0], **kw)
    outs = out if isinstance(out, tuple) else (out,)
    outs[0].backward(dev(dy.to(DTYPE)))
    grads = {"x": xs[0].grad}
    if m.attention_type == "cross":
        grads["encoder_output"] = xs[1].grad
    grads.update({n: p.grad for n, p in m.named_parameters()})
    res = ([o.detach().float().cpu() for o in outs],
           {n: None if g is None else g.detach().float().cpu() for n, g in grads.items()})
    m.zero_grad(set_to_none=True)
    return res


def _mha_ref(m, x, enc, dy, fmt):
    """float64 MultiheadAttention of m's parameters (rounded to the module dtype) on (x, enc): output and
    the gradients of x, encoder_output and every parameter for the output gradient dy."""
    P = {n: p.detach().double().cpu().requires_grad_(True) for n, p in m.named_parameters()}
    rnd = lambda t: t.to(DTYPE).double().requires_grad_(True)  # noqa: E731  (the inputs the module saw)
    x64, enc64 = rnd(x), rnd(enc)
    h, g, d = m.num_attention_heads, m.num_gqa_groups, m.hidden_size_per_attention_head

    def linear(prefix, inp, names):
        if f"{prefix}.weight" in P:
            w, b = P[f"{prefix}.weight"], P.get(f"{prefix}.bias")
        else:
            w = torch.cat([P[f"{prefix}.{n}_weight"] for n in names])
            bs = [P.get(f"{prefix}.{n}_bias") for n in names]
            b = None if bs[0] is None else torch.cat(bs)
        y = inp @ w.t()
        return y if b is None else y + b

    def norm(prefix, inp):
        lw, lb = P[f"{prefix}.layer_norm_weight"], P.get(f"{prefix}.layer_norm_bias")
        if lb is not None:
            return torch.nn.functional.layer_norm(inp, (HID,), lw, lb, 1e-5)
        return inp * torch.rsqrt(inp.pow(2).mean(-1, keepdim=True) + 1e-5) * lw

    ln = None
    if m.attention_type == "self":
        prefix = "layernorm_qkv" if m.input_layernorm else "qkv"
        inp = norm(prefix, x64) if m.input_layernorm else x64
        ln = inp if m.input_layernorm else None
        q, k, v = fa8.split_qkv(linear(prefix, inp, ("query", "key", "value")), h, g, d, m.qkv_weight_interleaved)
    else:
        prefix = "layernorm_query" if m.input_layernorm else "query_layer"
        inp = norm(prefix, x64) if m.input_layernorm else x64
        ln = inp if m.input_layernorm else None
        q = linear(prefix, inp, ("query",)).unflatten(-1, (h, d))
        k, v = fa8.split_kv(linear("key_value", enc64, ("key", "value")), g, d, m.qkv_weight_interleaved)
    to_bhsd = (lambda t: t.permute(1, 2, 0, 3)) if fmt == "sbhd" else (lambda t: t.permute(0, 2, 1, 3))
    qb, kb, vb = to_bhsd(q), to_bhsd(k).repeat_interleave(h // g, 1), to_bhsd(v).repeat_interleave(h // g, 1)
    z = qb @ kb.transpose(-1, -2) / math.sqrt(d)
    if m.attn_mask_type == "causal":
        z = z.masked_fill(torch.ones(z.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    o = torch.softmax(z, -1) @ vb  # [b, h, s, d]
    o = (o.permute(2, 0, 1, 3) if fmt == "sbhd" else o.permute(0, 2, 1, 3)).flatten(-2)
    y = linear("proj", o, ())
    y.backward(dy.to(DTYPE).double())
    grads = {"x": x64.grad, **({"encoder_output": enc64.grad} if m.attention_type == "cross" else {}),
             **{n: p.grad for n, p in P.items()}}
    return y.detach(), ln, grads


# ------------------------------------------------------------------ accuracy
@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_fp8_mha_matches_fp8_dpa_and_float64(config, fmt):
    m_dpa = _mha(fmt, **CONFIGS[config])
    m_mha = copy.deepcopy(m_dpa)
    gen = torch.Generator().manual_seed(17)
    worst, sums = {}, (0.0, 0.0)
    for step in range(3):  # step 0 with unit scales, then the recipe's
        x, enc, dy = _draw(gen, fmt)
        outs_d, grads_d = _step(m_dpa, _recipe(False), x, enc, dy)
        outs_m, grads_m = _step(m_mha, _recipe(True), x, enc, dy)
        ref, ln_ref, grads_ref = _mha_ref(m_mha, x, enc, dy, fmt)
        assert outs_m[0].shape == _shape(fmt, S) and len(outs_m) == len(outs_d)
        if m_mha.return_layernorm_output:  # the norm output is high precision, the same in both runs
            torch.testing.assert_close(outs_m[1], outs_d[1], rtol=0, atol=0)
            assert rel_err(outs_m[1], ln_ref.reshape(outs_m[1].shape)) < 1e-2
        pairs = [("out", outs_m[0], outs_d[0], ref)] + [(n, grads_m[n], grads_d[n], grads_ref[n]) for n in grads_ref]
        assert set(grads_m) == set(grads_ref)
        for name, got, other, want in pairs:
            if _zero_in_exact_math(name):
                _check_zero_grad(grads_m, name, grads_d)
                continue
            tol = TOL["out"] if name == "out" else TOL["grad"]
            e_mha, e_dpa, e_pair = rel_err(got, want), rel_err(other, want), rel_err(got, other)
            worst[name] = max(worst.get(name, (0, 0, 0)), (e_mha, e_dpa, e_pair))
            assert e_mha < tol and e_pair < TOL["pair"], (step, name, e_mha, e_dpa, e_pair)
            sums = (sums[0] + e_mha, sums[1] + e_dpa)
    # one rounding less at each hand-off: over all tensors and steps, fp8_mha is as close to float64 as
    # fp8_dpa (single tensors, and single steps, differ both ways by the luck of their roundings)
    assert sums[0] <= 1.05 * sums[1], sums
    print(config, fmt, {k: tuple(f"{v:.3f}" for v in t) for k, t in worst.items()})


# ------------------------------------------------------------------ recipe state
@pytest.mark.parametrize("seeded", [True, False])
def test_fp8_mha_first_backward_keeps_small_gradients(seeded, monkeypatch):
    """Under fp8_mha attention's dO arrives in FP8 from the output projection's dgrad GEMM, so that
    GEMM's FP8 output is seeded in the first backward too (custom_ops.gemm_fp8_output seed: a run
    measures the amax, the scale comes from it), as are attention's dP and dQKV: with output
    gradients of ~1e-6, the first step's input and weight gradients are as close to float64 as
    later steps' (TOL). seeded False (NVTE_FP8_SEED_FIRST_BACKWARD=0) is TE's first backward, at
    the initial scales: its E5M2 hand-offs flush the gradients to zero (errors ~1, checked: the
    test can fail)."""
    if not seeded:
        monkeypatch.setenv("NVTE_FP8_SEED_FIRST_BACKWARD", "0")
    m = _mha()
    x, enc, dy = _draw(torch.Generator().manual_seed(8), "sbhd")
    dy = dy * 1e-6
    _, grads = _step(m, _recipe(True), x, enc, dy)
    _, _, ref = _mha_ref(m, x, enc, dy, "sbhd")
    errs = {n: rel_err(g, ref[n].float()) for n, g in grads.items() if g is not None and not _zero_in_exact_math(n)}
    print(seeded, errs)
    if seeded:
        assert max(errs.values()) < TOL["grad"], errs
    else:  # (the output projection's bias gradient is a high-precision column sum of dy)
        assert min(e for n, e in errs.items() if n != "proj.bias") > 0.9, errs


def _filled(meta, key):
    """Per slot: whether any history row holds an amax."""
    return [bool(x) for x in (meta.amax_history[key] != 0).any(0).tolist()]


def test_fp8_mha_recipe_state():
    """Which tensors' amax histories fill (TE's slots): under fp8_mha the QKV projection's GEMM output
    (forward slot 2) instead of attention's Q/K/V cast (slot 0), attention's O (slot 2) instead of the
    output projection's input cast (slot 0), the output projection's dgrad output (backward slot 1)
    instead of attention's dO cast (slot 0), attention's dQKV (slot 2) instead of the QKV projection's
    output-gradient cast (slot 0). At step 0 (unit scales) the amaxes moved are the same values. Every
    scale follows the library's recipe step: fp8_max / max(history)."""
    m_dpa = _mha("sbhd")
    m_mha = copy.deepcopy(m_dpa)
    gen = torch.Generator().manual_seed(5)
    for step in range(3):
        x, enc, dy = _draw(gen, "sbhd")
        _step(m_dpa, _recipe(False), x, enc, dy)
        _step(m_mha, _recipe(True), x, enc, dy)
        if step == 0:  # rolled once: row -1 holds step 0's amaxes
            exact = dict(rtol=1e-2, atol=0) if ON_CUDA else dict(rtol=0, atol=0)
            fwd = lambda mod: mod.fp8_meta.amax_history["fwd"][-1].cpu()  # noqa: E731
            bwd = lambda mod: mod.fp8_meta.amax_history["bwd"][0].cpu()  # noqa: E731  (not rolled yet)
            torch.testing.assert_close(fwd(m_mha.qkv)[2], fwd(m_dpa.core_attention)[0], **exact)  # QKV
            torch.testing.assert_close(fwd(m_mha.core_attention)[1:], fwd(m_dpa.core_attention)[1:], **exact)  # S, O
            torch.testing.assert_close(bwd(m_mha.proj)[1], bwd(m_dpa.core_attention)[0], **exact)  # dO
    want = {  # (fp8_dpa, fp8_mha) per module and direction, slots in FP8Meta order
        ("qkv", "fwd"): ([True, True, False], [True, True, True]),          # input, weight, output
        ("qkv", "bwd"): ([True, False], [False, False]),                    # grad_output, grad_input
        ("core_attention", "fwd"): ([True, True, True], [False, True, True]),   # QKV, S, O
        ("core_attention", "bwd"): ([True, True, True], [False, True, True]),   # dO, dP, dQKV
        ("proj", "fwd"): ([True, True, False], [False, True, False]),
        ("proj", "bwd"): ([True, False], [True, True]),
    }
    for (mod, key), (w_dpa, w_mha) in want.items():
        assert _filled(getattr(m_dpa, mod).fp8_meta, key) == w_dpa, (mod, key)
        assert _filled(getattr(m_mha, mod).fp8_meta, key) == w_mha, (mod, key)
    for mod, key, slot, fmt in (("qkv", "fwd", 2, "e4m3"), ("core_attention", "fwd", 2, "e4m3"),
                                ("proj", "bwd", 1, "e5m2"), ("core_attention", "bwd", 2, "e5m2")):
        meta = getattr(m_mha, mod).fp8_meta
        # forward: set at the last autocast exit from the whole history (then rolled: row 0 is empty);
        # backward: set at the start of the last backward, whose amaxes row 0 holds
        hist = meta.amax_history[key][:, slot] if key == "fwd" else meta.amax_history[key][1:, slot]
        torch.testing.assert_close(meta.scale[key][slot], FP8_MAX[fmt] / hist.max())


# ------------------------------------------------------------------ the hand-offs skip copies and casts
class _Calls:
    NAMES = ("quantize", "dequantize", "gemm", "gemm_fp8_output", "transpose")

    def __init__(self, monkeypatch):
        self.n = {k: 0 for k in self.NAMES}
        self.fp8_outputs = []
        for name in self.NAMES:
            fn = getattr(custom_ops, name)
            monkeypatch.setattr(custom_ops, name, self._wrap(name, fn))

    def _wrap(self, name, fn):
        def call(*a, **kw):
            self.n[name] += 1
            res = fn(*a, **kw)
            if name == "gemm_fp8_output":
                self.fp8_outputs.append(res)
            return res
        return call

    def take(self):
        n, self.n = self.n, {k: 0 for k in self.NAMES}
        return n


@pytest.mark.parametrize("bias", [True, False])
def test_fp8_mha_hands_fp8_between_modules(monkeypatch, bias):
    """The library calls of one step. fp8_mha forward: the QKV GEMM writes FP8 (a hand-off of
    tokens x (h + 2g) d bytes + scale_inv, a quarter of a float32 output), Q/K/V and the output
    projection's input are not cast, nothing is decoded; backward: the output projection's dgrad
    writes FP8 (dO is not cast), dQ/dK/dV are not decoded, the wgrad operands of the output
    projection (and, without a bias gradient, of the QKV projection) are byte transposes. fp8_dpa
    casts Q/K/V (here one cast: they are views of the QKV projection's output in the packed sbh3d
    placement), decodes O and casts it again for the output projection, and in backward casts dO,
    decodes dQ/dK/dV (one packed buffer, one decode) and casts them again."""
    calls = _Calls(monkeypatch)
    x, enc, dy = _draw(torch.Generator().manual_seed(3), "sbhd")
    per_recipe = {}
    for mha in (False, True):
        m = _mha("sbhd", bias=bias)
        xs = dev(x.to(DTYPE)).requires_grad_(True)
        with te.fp8_autocast(fp8_recipe=_recipe(mha)):
            y = m(xs)
        fwd = calls.take()
        y.backward(dev(dy.to(DTYPE)))
        per_recipe[mha] = (fwd, calls.take())
    (fwd_d, bwd_d), (fwd_m, bwd_m) = per_recipe[False], per_recipe[True]
    # forward: x, the QKV weight, the proj weight are cast; fp8_dpa also the packed Q, K, V (one
    # call) and O (decoded first)
    assert fwd_m == dict(quantize=3, dequantize=0, gemm=1, gemm_fp8_output=1, transpose=0), fwd_m
    assert fwd_d == dict(quantize=5, dequantize=1, gemm=2, gemm_fp8_output=0, transpose=0), fwd_d
    # backward: the proj's output gradient is cast; with a bias the QKV gradient is decoded once for
    # its bias gradient (and its transposed copy cast from that), without one it is byte-transposed
    assert bwd_m == dict(quantize=1 + bias, dequantize=int(bias), gemm=3, gemm_fp8_output=1,
                         transpose=2 - bias), bwd_m
    assert bwd_d == dict(quantize=3, dequantize=1, gemm=4, gemm_fp8_output=0, transpose=0), bwd_d
    h = calls.fp8_outputs[0]  # the QKV projection's output: FP8 bytes + scale_inv
    tokens, cols = S * B, (H + 2 * H) * D
    assert h.dtype == torch.float32 and h.shape == (handoff_words(tokens, cols),)
    assert tokens * cols <= h.numel() * h.element_size() <= tokens * cols + 8


# ------------------------------------------------------------------ TransformerLayer, recompute, FP8 weights
@pytest.mark.parametrize("layer_type", ["encoder", "decoder"])
def test_transformer_layer_fp8_mha(layer_type):
    """TransformerLayer (self attention, and for the decoder cross attention over encoder_output) under
    fp8_mha is as close to fp8_dpa as the attention block itself, and its attention blocks run the
    hand-offs (their QKV projections' output slots fill)."""
    gen = torch.Generator().manual_seed(9)
    torch.manual_seed(0)
    a = te.TransformerLayer(HID, 2 * HID, H, hidden_dropout=0.0, attention_dropout=0.0, layer_type=layer_type,
                            params_dtype=DTYPE, device=DEVICE)
    b = copy.deepcopy(a)
    kw = {}
    if layer_type == "decoder":
        kw["encoder_output"] = dev(torch.randn(S_KV, B, HID, generator=gen).to(DTYPE))
    for step in range(2):
        x = torch.randn(S, B, HID, generator=gen) * (1 + step)
        dy = torch.randn(S, B, HID, generator=gen) * 0.1
        res = []
        for layer, mha in ((a, False), (b, True)):
            xs = dev(x.to(DTYPE)).requires_grad_(True)
            with te.fp8_autocast(fp8_recipe=_recipe(mha)):
                y = layer(xs, **kw)
            y.backward(dev(dy.to(DTYPE)))
            res.append((y.detach(), xs.grad, {n: p.grad.clone() for n, p in layer.named_parameters()}))
            layer.zero_grad(set_to_none=True)
        (ya, dxa, ga), (yb, dxb, gb) = res
        assert rel_err(yb, ya) < TOL["out"] and rel_err(dxb, dxa) < TOL["grad"]
        for n in ga:
            if _zero_in_exact_math(n):
                _check_zero_grad(gb, n, ga)
            else:
                assert rel_err(gb[n], ga[n]) < TOL["grad"], (step, n)
    attn = [b.self_attention] + ([b.inter_attention] if layer_type == "decoder" else [])
    for mha in attn:
        qkv = mha.layernorm_qkv if mha.attention_type == "self" else mha.layernorm_query
        assert _filled(qkv.fp8_meta, "fwd")[2] and not _filled(mha.core_attention.fp8_meta, "fwd")[0]
    if layer_type == "decoder":
        assert _filled(b.inter_attention.key_value.fp8_meta, "fwd")[2]


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_fp8_mha_under_activation_recompute(use_reentrant):
    """te.checkpoint over a MultiheadAttention under fp8_mha: the recompute casts and writes its FP8
    outputs with the forward's scales and records no amax again, so outputs, gradients and recipe
    state equal those of the plain run."""
    plain = _mha("sbhd", input_layernorm=True)
    ck = copy.deepcopy(plain)
    gen = torch.Generator().manual_seed(2)
    for step in range(3):
        x, _, dy = _draw(gen, "sbhd")
        res = []
        for m, ckpt in ((plain, False), (ck, True)):
            xs = dev(x.to(DTYPE)).requires_grad_(True)
            with te.fp8_autocast(fp8_recipe=_recipe(True)):
                y = te.checkpoint(m, xs, use_reentrant=use_reentrant) if ckpt else m(xs)
            y.backward(dev(dy.to(DTYPE)))
            res.append((y.detach(), xs.grad, {n: p.grad.clone() for n, p in m.named_parameters()}))
            m.zero_grad(set_to_none=True)
        _assert_same_bits(res[1], res[0])
        for (n, mp), mc in zip(plain.named_modules(), ck.modules()):
            if getattr(mp, "fp8_meta", None) is not None and mp.fp8_meta.initialized:
                for key in ("fwd", "bwd"):
                    assert torch.equal(mc.fp8_meta.amax_history[key], mp.fp8_meta.amax_history[key]), (step, n)
                    assert torch.equal(mc.fp8_meta.scale[key], mp.fp8_meta.scale[key]), (step, n)


def test_fp8_mha_inference_and_fp8_weights():
    """Without grad (no backward, no recipe step) and with FP8 weight parameters (quantized_model_init):
    the hand-offs run, and the output is as close to fp8_dpa's as in training."""
    x, _, _ = _draw(torch.Generator().manual_seed(4), "sbhd")
    with te.quantized_model_init(recipe=_recipe(True)):
        m = _mha("sbhd", fuse_qkv_params=True)
    outs = []
    for mha in (False, True):
        with torch.no_grad(), te.fp8_autocast(fp8_recipe=_recipe(mha)):
            outs.append(m(dev(x.to(DTYPE))).float().cpu())
    assert rel_err(outs[1], outs[0]) < TOL["out"]
    assert torch.all(m.qkv.fp8_meta.amax_history["fwd"][0] > 0)  # input, weight, output recorded
    assert torch.all(m.qkv.fp8_meta.scale["fwd"] == 1.0)  # no recipe step without grad


def test_fp8_mha_return_bias():
    """return_bias=True: the output projection's GEMM (reading O's hand-off) leaves the bias out and
    returns the parameter, as without fp8_mha."""
    x, _, dy = _draw(torch.Generator().manual_seed(6), "sbhd")
    m_dpa = _mha("sbhd", return_bias=True)
    m_mha = copy.deepcopy(m_dpa)
    (yd, bd), gd = _step(m_dpa, _recipe(False), x, None, dy)
    (ym, bm), gm = _step(m_mha, _recipe(True), x, None, dy)
    assert torch.equal(bm, m_mha.proj.bias.detach().float().cpu()) and torch.equal(bm, bd)
    assert rel_err(ym, yd) < TOL["pair"] and gm["proj.bias"] is None and gd["proj.bias"] is None
    assert rel_err(gm["proj.weight"], gd["proj.weight"]) < TOL["pair"]


# ------------------------------------------------------------------ errors
def test_fp8_mha_unsupported_are_clear_errors(monkeypatch):
    m = _mha("sbhd")
    x = dev(torch.randn(S, B, HID, generator=torch.Generator().manual_seed(0)).to(DTYPE))
    cases = [(recipe.Float8CurrentScaling(fp8_mha=True),
              "MultiheadAttention: fp8_mha is implemented for the DelayedScaling recipe only"),
             (recipe.DelayedScaling(fp8_mha=True, fp8_format=recipe.Format.E5M2), "float8_e4m3")]
    for r, msg in cases:
        with pytest.raises(NotImplementedError, match=msg), te.fp8_autocast(fp8_recipe=r):
            m(x)
    with pytest.raises(NotImplementedError, match="FP8 attention has no attention bias"), \
            te.fp8_autocast(fp8_recipe=_recipe(True)):
        m(x, core_attention_bias_type="post_scale_bias", core_attention_bias=dev(torch.zeros(1, H, S, S)))
    monkeypatch.setenv("NVTE_FUSED_ATTN", "0")
    with pytest.raises(NotImplementedError, match="fp8_mha.*NVTE_FUSED_ATTN=0"), \
            te.fp8_autocast(fp8_recipe=_recipe(True)):
        m(x)
    monkeypatch.delenv("NVTE_FUSED_ATTN")
    monkeypatch.setattr(fa, "fused_backend_supports", lambda *a, **kw: (False, "no FP8 attention here"))
    with pytest.raises(NotImplementedError, match="does not fall back"), te.fp8_autocast(fp8_recipe=_recipe(True)):
        m(x)


@pytest.mark.skipif(not ON_CUDA, reason="the CUDA backend's FP8 attention limits (NVTE_TEST_DEVICE=cuda only)")
def test_fp8_mha_cuda_sequence_length_limit_is_a_clear_error():
    """cuDNN's FP8 attention trains only at max_seqlen multiples of 128 (fused_attn.h): a length of 96
    is refused before anything runs, with the backend's reason, and no high-precision fallback."""
    ok, why = te.is_fp8_available(return_reason=True)
    if not ok:
        pytest.skip(why)
    m = _mha("sbhd")
    x = dev(torch.randn(96, B, HID, generator=torch.Generator().manual_seed(0)).to(DTYPE)).requires_grad_(True)
    with pytest.raises(NotImplementedError, match="(?s)fp8_mha.*cannot run this call.*does not fall back"), \
            te.fp8_autocast(fp8_recipe=_recipe(True)):
        m(x)


# ------------------------------------------------------------------ torch.compile / op registration
@cpu_only
def test_compile_transformer_layer_fp8_mha():
    """torch.compile(fullgraph=True) of a TransformerLayer under fp8_mha: the FP8-output GEMMs, the
    hand-off attention op and the byte transposes are graph nodes (forward and backward), and three
    steps match eager exactly (outputs, gradients, recipe state)."""
    from test_compile import GraphRecorder, _meta_state
    torch._dynamo.reset()
    r = _recipe(True)
    torch.manual_seed(0)
    eager = te.TransformerLayer(32, 64, 4, hidden_dropout=0.0, attention_dropout=0.0, device="cpu")
    gen = torch.Generator().manual_seed(8)
    with te.fp8_autocast(fp8_recipe=r):  # FP8 metadata is adopted eagerly (fp8.FP8Meta.prepare)
        eager(torch.randn(6, 2, 32, generator=gen).requires_grad_()).sum().backward()
    eager.zero_grad(set_to_none=True)
    src = copy.deepcopy(eager)
    rec = GraphRecorder()
    compiled = torch.compile(src, fullgraph=True, backend=rec.backend())
    try:
        for step in range(3):
            x = torch.randn(5, 3, 32, generator=gen) * (1 + step)
            dy = torch.randn(5, 3, 32, generator=gen) * 0.1
            res = []
            for model, params in ((eager, eager), (compiled, src)):
                xs = x.clone().requires_grad_()
                with te.fp8_autocast(fp8_recipe=r):
                    y = model(xs)
                y.backward(dy)
                res.append((y.detach(), xs.grad, {n: p.grad.clone() for n, p in params.named_parameters()}))
                params.zero_grad(set_to_none=True)
            _assert_same_bits(res[1], res[0])
            se, sc = _meta_state(eager), _meta_state(src)
            for k in se:
                torch.testing.assert_close(sc[k], se[k], rtol=0, atol=0)
    finally:
        torch._dynamo.reset()
    fw, bw = rec.targets["fw"], rec.targets["bw"]
    assert OPS.gemm_fp8_output.default in fw and OPS.fused_attn_fp8_fwd_handoff.default in fw
    assert OPS.dequantize.default not in fw  # nothing is decoded between the modules
    assert OPS.gemm_fp8_output.default in bw and OPS.fused_attn_fp8_bwd.default in bw
    assert OPS.transpose.default in bw


def _new_op_args():
    from transformer_engine import _nvte
    g = torch.Generator().manual_seed(0)
    e4, e5 = int(_nvte.DType.kFloat8E4M3), int(_nvte.DType.kFloat8E5M2)
    scale, hist = torch.tensor([20.0, 40.0, 30.0]), torch.zeros(2, 3)
    w = custom_ops.quantize(torch.randn(24, 16, generator=g), scale, hist.clone(), 1, e4, True, True, False,
                            False, 0.0)
    x = custom_ops.quantize(torch.randn(7, 16, generator=g), scale, hist.clone(), 0, e4, True, False, False,
                            False, 0.0)
    bias = torch.randn(24, generator=g)
    gemm = (w[0], w[1], w[2], e4, x[0], None, x[2], e4, e5, scale, hist, 2, True, False, bias, False)
    q, k, v = (torch.randn(2, 5, 2, 8, generator=g) for _ in range(3))
    (qd, q_si), (kd, k_si), (vd, v_si) = (fa8._cast(t, scale, hist.clone(), 0, e4) for t in (q, k, v))
    attn = (qd, kd, vd, q_si, k_si, v_si, None, None, None, None, torch.zeros(2, dtype=torch.int64), scale,
            torch.zeros(2, 3), 5, 5, True, 0.35, 0.0, fa.LAYOUTS["bshd"], int(fa.MASKS["causal"]), -1, -1, False)
    return {"gemm_fp8_output": (OPS.gemm_fp8_output, gemm), "gemm_fp8_output_seed": (OPS.gemm_fp8_output, gemm[:-1] + (True,)),
            "transpose": (OPS.transpose, (x[0],)),
            "fused_attn_fp8_fwd_handoff": (OPS.fused_attn_fp8_fwd_handoff, attn)}


@cpu_only
@pytest.mark.parametrize("which", ["gemm_fp8_output", "gemm_fp8_output_seed", "transpose", "fused_attn_fp8_fwd_handoff"])
def test_handoff_op_registration(which):
    """torch.library.opcheck of the ops fp8_mha adds: schema (declared scale / amax-history mutations), fake
    implementation (hand-off sizes) and dispatcher registration agree with what they really do."""
    op, args = _new_op_args()[which]
    torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))
