"""Float8CurrentScaling: every FP8 cast takes its scale from the tensor being cast, in the same
call (nvte_compute_amax + nvte_compute_scale_from_amax + the cast). Checked against a float64
re-computation that emulates each cast with scale = fp8_max / max(amax, eps) (optionally
rounded down to a power of two). The modules run on NVTE_TEST_DEVICE (default the CPU backend);
inputs are drawn on the CPU and moved with dev(), the float64 references stay on the CPU."""
import itertools
import math
import types

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common import recipe
from _util import DEVICE, ON_CUDA, cpu64, dev, fp8_emulate, fp8_gemm_tol, gelu_tanh, gemm_dim, rel_err, seeded

FMT_MAX = {"e4m3": 448.0, "e5m2": 57344.0}


def cs_scale(x, fmt, pow2=False, eps=0.0):
    """float32 scale of current scaling for x (float64 math, float32 result as the library stores it)."""
    amax = max(float(x.detach().abs().max()), eps)
    if amax == 0.0 or not math.isfinite(amax):
        return 1.0
    s = float(torch.tensor(FMT_MAX[fmt] / amax, dtype=torch.float32))
    if pow2:
        s = 2.0 ** math.floor(math.log2(s))
    return s


def cs_q(x, fmt, pow2=False, eps=0.0):
    """float64 value of x after a current-scaling FP8 round trip."""
    return fp8_emulate(x, cs_scale(x, fmt, pow2, eps), fmt)


def _grads_ref_linear(x2, w, dy2, fmt_fwd="e4m3", fmt_bwd="e5m2", r=None):
    """(y, dx, dw) of y = q(x) q(w)^T with current-scaling casts (no bias)."""
    pi, pw, pg = (r.fp8_quant_fwd_inp, r.fp8_quant_fwd_weight, r.fp8_quant_bwd_grad) if r else (None,) * 3
    args = (lambda p: (p.power_2_scale, p.amax_epsilon) if p else (False, 0.0))
    xq, wq = cs_q(x2, fmt_fwd, *args(pi)), cs_q(w, fmt_fwd, *args(pw))
    gq = cs_q(dy2, fmt_bwd, *args(pg))
    return xq @ wq.t(), gq @ wq, gq.t() @ xq


@pytest.mark.parametrize("qparams", [None, "pow2", "eps"])
@pytest.mark.parametrize("fmt", ["HYBRID", "E4M3"])
def test_linear_current_scaling_matches_float64(rng, fmt, qparams):
    g = seeded(rng)
    q = {None: recipe.QParams(), "pow2": recipe.QParams(power_2_scale=True),
         "eps": recipe.QParams(amax_epsilon=1e3)}[qparams]  # eps above every amax: the clamp decides the scale
    r = recipe.Float8CurrentScaling(fp8_format=getattr(recipe.Format, fmt), fp8_quant_fwd_inp=q,
                                    fp8_quant_fwd_weight=q, fp8_quant_bwd_grad=q)
    # out features and tokens (2 x seq): 24 and 20 on the CPU, 32 and 32 on CUDA (FP8 GEMM dims 16-aligned)
    n_out, seq = gemm_dim(24), gemm_dim(10)
    m = te.Linear(32, n_out, device=DEVICE)
    with torch.no_grad():
        m.bias.copy_(torch.randn(m.bias.shape, generator=g))
    bwd_fmt = "e5m2" if fmt == "HYBRID" else "e4m3"
    for step, mag in enumerate([3.0, 0.02, 40.0]):  # scales follow each step's own amax, no history
        x = (torch.randn(2, seq, 32, generator=g) * mag).requires_grad_()
        dy = torch.randn(2, seq, n_out, generator=g) * mag * 1e-3
        m.zero_grad(set_to_none=True)
        with te.fp8_autocast(fp8_recipe=r):
            y = m(dev(x))
        y.backward(dev(dy))
        x2, dy2 = x.detach().double().reshape(-1, 32), dy.double().reshape(-1, n_out)
        yr, dxr, dwr = _grads_ref_linear(x2, m.weight, dy2, "e4m3", bwd_fmt, r)
        assert rel_err(y.reshape(-1, n_out), yr + cpu64(m.bias)) < fp8_gemm_tol(1e-5), step
        assert rel_err(x.grad.reshape(-1, 32), dxr) < fp8_gemm_tol(1e-5), step
        assert rel_err(m.weight.grad, dwr) < fp8_gemm_tol(1e-5), step
        assert rel_err(m.bias.grad, dy2.sum(0)) < 1e-5, step
        exact = x2 @ cpu64(m.weight).t()
        prod = cpu64(y).reshape(-1, n_out) - cpu64(m.bias)
        assert 1e-3 < rel_err(prod, exact) < 0.1  # FP8-sized error, not float32-sized
    assert not m.fp8_meta.initialized  # current scaling keeps no delayed-scaling state
    assert m.fp8_meta.state() is None


def test_current_scaling_independent_of_history(rng):
    """The same input gives the same output whatever ran before (no amax history)."""
    g = seeded(rng)
    m = te.Linear(16, 16, device=DEVICE)
    x = dev(torch.randn(4, 16, generator=g))
    r = recipe.Float8CurrentScaling()
    with torch.no_grad(), te.fp8_autocast(fp8_recipe=r):
        y1 = m(x)
        m(dev(torch.randn(4, 16, generator=g) * 1e4))
        y2 = m(x)
    assert torch.equal(y1, y2)


def test_layernorm_linear_current_scaling(rng):
    g = seeded(rng)
    m = te.LayerNormLinear(32, 16, return_layernorm_output=True, device=DEVICE)
    with torch.no_grad():
        m.layer_norm_weight.copy_(torch.empty(32).uniform_(0.5, 1.5, generator=g))
    tokens = gemm_dim(12)  # 12 on the CPU, 16 on CUDA (the wgrad GEMM's inner dimension)
    x = (torch.randn(tokens, 32, generator=g) * 2).requires_grad_()
    dy = torch.randn(tokens, 16, generator=g) * 1e-2
    with te.fp8_autocast(fp8_recipe=recipe.Float8CurrentScaling()):
        y, ln = m(dev(x))
    y.backward(dev(dy))
    ln64 = cpu64(ln)  # the norm runs in high precision: feed its exact output to the reference
    ref_ln = torch.nn.functional.layer_norm(x.detach().double(), (32,), cpu64(m.layer_norm_weight),
                                            cpu64(m.layer_norm_bias), 1e-5)
    assert rel_err(ln64, ref_ln) < 1e-6
    yr, dlnr, dwr = _grads_ref_linear(ln64, m.weight, dy.double())
    assert rel_err(y, yr + cpu64(m.bias)) < fp8_gemm_tol(1e-5)
    assert rel_err(m.weight.grad, dwr) < fp8_gemm_tol(1e-5)
    # dx = layernorm backward of the FP8 dgrad (float64 autograd through the reference norm)
    xr = x.detach().double().requires_grad_()
    lnr = torch.nn.functional.layer_norm(xr, (32,), cpu64(m.layer_norm_weight), cpu64(m.layer_norm_bias), 1e-5)
    lnr.backward(dlnr)
    assert rel_err(x.grad, xr.grad) < fp8_gemm_tol(1e-5)


# Relative size of the device's accumulation error in an FP8 GEMM's output, as a fraction of the
# sum of |products| (+ |bias| + |result|): Hopper's FP8 tensor cores keep about 14 mantissa bits
# (see FP8_GEMM_CUDA_TOL), bounded here with a factor 4; the CPU backend accumulates in float32.
GEMM_ERR_REL = 2.0 ** -12 if ON_CUDA else 2.0 ** -20


def flip_tolerant_rel_err(y, a, a_err, fmt, w, b, enumerate_top=8):
    """(error, flips): rel_err of y against q(a) @ w^T + b (q: the current-scaling round trip of a),
    where the elements of a that lie within a_err (the device's error bound on them) of a rounding
    boundary of the cast may round to their other neighbour, as the device may round them.

    Rows are independent (an element of a only feeds its own row of y). Per row, the `enumerate_top`
    boundary elements whose flip would move y most are tried in every combination (the closest to y
    is kept); the others' largest possible effect is subtracted from the row's remaining distance
    (a lower bound of the error that flips cannot explain). Elements away from boundaries keep their
    exact rounding, so a skipped or mis-scaled cast still fails. The device's scale comes from its
    own amax: the amax's error widens every element's bound in proportion."""
    s = cs_scale(a, fmt)
    top = int(a.abs().argmax())
    a_err = a_err + a.abs() * float(a_err.flatten()[top] / a.abs().flatten()[top])
    q, lo, hi = (fp8_emulate(v, s, fmt) for v in (a, a - a_err, a + a_err))
    y = y.detach().double().cpu()
    wn = w.norm(dim=0)  # effect on y's row of a unit change of each element of a
    err2, flips = 0.0, 0
    for r in range(a.shape[0]):
        amb = [i for i in range(a.shape[1]) if lo[r, i] != q[r, i] or hi[r, i] != q[r, i]]
        reach = {i: max(abs(float(lo[r, i] - q[r, i])), abs(float(hi[r, i] - q[r, i]))) * float(wn[i]) for i in amb}
        amb.sort(key=lambda i: -reach[i])
        tried, rest = amb[:enumerate_top], amb[enumerate_top:]
        best, best_flips = None, 0
        for pick in itertools.product(*[sorted({float(q[r, i]), float(lo[r, i]), float(hi[r, i])}) for i in tried]):
            row = q[r].clone()
            row[tried] = torch.tensor(pick, dtype=torch.float64)
            e = float((y[r] - (row @ w.t() + b)).norm())
            if best is None or e < best:
                best, best_flips = e, int((row != q[r]).sum())
        err2 += max(0.0, best - sum(reach[i] for i in rest)) ** 2
        flips += best_flips
    return err2 ** 0.5 / max(float((q @ w.t() + b).norm()), 1e-30), flips


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_layernorm_mlp_current_scaling(rng, activation):
    """fc1 -> activation -> fc2 with a current-scaling cast before each GEMM, against float64. The
    activation's cast rounds values computed on the device (FP8 GEMM, its bias and activation in
    float32): an element within that computation's error of an E4M3 rounding boundary may round
    either way, so such elements may take either neighbour (flip_tolerant_rel_err)."""
    g = seeded(rng)
    m = te.LayerNormMLP(16, 32, activation=activation, return_layernorm_output=True, device=DEVICE)
    with torch.no_grad():
        m.fc1_bias.copy_(torch.randn(m.fc1_bias.shape, generator=g))
    x = torch.randn(gemm_dim(10), 16, generator=g)  # tokens 10 on the CPU, 16 on CUDA
    with torch.no_grad(), te.fp8_autocast(fp8_recipe=recipe.Float8CurrentScaling()):
        y, ln = m(dev(x))
    ln64 = cpu64(ln)
    lnq, w1q, b1 = cs_q(ln64, "e4m3"), cs_q(m.fc1_weight, "e4m3"), cpu64(m.fc1_bias)
    h = lnq @ w1q.t() + b1
    h_err = GEMM_ERR_REL * (lnq.abs() @ w1q.abs().t() + b1.abs() + h.abs())
    if activation == "gelu":
        a = gelu_tanh(h)
        a_err = 1.13 * h_err  # |gelu_tanh'| <= 1.13
    else:
        h1, h2 = h[:, :32], h[:, 32:]
        a = torch.nn.functional.silu(h1) * h2
        a_err = 1.1 * h_err[:, :32] * h2.abs() + torch.nn.functional.silu(h1).abs() * h_err[:, 32:]  # |silu'| <= 1.1
    a_err = a_err + GEMM_ERR_REL * a.abs()  # the activation itself, in float32
    e, flips = flip_tolerant_rel_err(y, a, a_err, "e4m3", cs_q(m.fc2_weight, "e4m3"), cpu64(m.fc2_bias))
    assert e < fp8_gemm_tol(1e-5), f"rel_err {e:.3g} (with {flips} boundary flips allowed)"
    # Allowing flips near boundaries does not hide a missing cast: the unquantized activation is far off.
    assert rel_err(y, a @ cs_q(m.fc2_weight, "e4m3").t() + cpu64(m.fc2_bias)) > 10 * fp8_gemm_tol(1e-5)


def _fc2_boundary_flips(y, yr, a, aq, wq, margin=1e-5):
    """yr with the last GEMM's (fc2's) input elements that lie within `margin` (relative) of an E4M3
    rounding boundary taken at whichever neighbour brings their output row closer to y. fc2's input
    is the device's float32 GELU output, so such an element may round either way there (as in
    test_layernorm_mlp_current_scaling); fc2 feeds the output directly (y = residual + fc2), so a
    flip moves its row by (other - q) * w[:, i]. One E4M3 step is >= 6% relative, so a 1e-5 margin
    makes a few elements in 1e4 ambiguous; every other element keeps its exact rounding."""
    s = cs_scale(a, "e4m3")
    a, aq = a.reshape(-1, a.shape[-1]), aq.reshape(-1, aq.shape[-1])
    lo, hi = (fp8_emulate(a * f, s, "e4m3") for f in (1 - margin, 1 + margin))
    y2 = y.detach().double().cpu().reshape(-1, y.shape[-1])
    out = yr.reshape(-1, yr.shape[-1]).clone()
    for r, i in ((lo != aq) | (hi != aq)).nonzero().tolist():
        other = lo[r, i] if lo[r, i] != aq[r, i] else hi[r, i]
        moved = out[r] + (other - aq[r, i]) * wq[:, i]
        if (moved - y2[r]).norm() < (out[r] - y2[r]).norm():
            out[r] = moved
    return out.reshape(yr.shape)


def test_transformer_layer_current_scaling_forward(rng, monkeypatch):
    """Every GEMM of the layer (fused QKV, proj, fc1, fc2) runs with current-scaling casts of its
    input and weight; the float64 reference layer emulates exactly that, except that fc2's input
    elements at an E4M3 rounding boundary may take either neighbour (_fc2_boundary_flips: with
    NVTE_TEST_SEED=1610868575 one such element rounded the other way on the CPU, e = 1.5e-5)."""
    import test_transformer_layer as ttl
    g = seeded(rng)
    torch.manual_seed(0)
    layer = te.TransformerLayer(32, 64, 4, hidden_dropout=0.0, attention_dropout=0.0, fuse_qkv_params=True,
                                device=DEVICE)
    x = torch.randn(6, 2, 32, generator=g)
    with torch.no_grad(), te.fp8_autocast(fp8_recipe=recipe.Float8CurrentScaling()):
        y = layer(dev(x))

    calls = []

    def fp8_linear(h, w, b=None):
        hq, wq = cs_q(h, "e4m3"), cs_q(w, "e4m3")
        calls.append((h, hq, wq))
        out = hq @ wq.t()
        return out if b is None else out + b
    monkeypatch.setattr(ttl, "F", types.SimpleNamespace(linear=fp8_linear,
                                                        layer_norm=torch.nn.functional.layer_norm))
    yr = _fc2_boundary_flips(y, ttl.ref_layer(layer, x.double()), *calls[-1])
    e, tol = rel_err(y, yr), fp8_gemm_tol(1e-5)
    assert e < tol
    with torch.no_grad():
        y_hp = layer(dev(x))
    # The reference really differs from the high-precision layer: by several times the FP8 layer's
    # distance to it, and by more than the tolerance above (else a layer that skipped the casts would
    # pass that check). The residual stream dilutes the casts here: y_hp is only ~8e-4 from yr
    # (6.8e-4 .. 1.1e-3 over 60 seeds on the CPU), while e is ~4e-8 on the CPU and was 7.8e-5 on an
    # H200 (FP8 tensor-core accumulation, see fp8_gemm_tol): a factor 10 on e has no margin there.
    assert rel_err(y_hp, yr) > max(3 * e, 2 * tol)


def test_current_scaling_recipe_not_mixed_with_delayed_state(rng):
    """Switching a module from DelayedScaling to current scaling and back leaves the delayed state alone."""
    g = seeded(rng)
    d = gemm_dim(8)  # features and tokens: 8 and 4 on the CPU, 16 on CUDA (FP8 GEMM dims 16-aligned)
    m = te.Linear(d, d, device=DEVICE)
    x = dev(torch.randn(gemm_dim(4), d, generator=g))
    with te.fp8_autocast(fp8_recipe=recipe.DelayedScaling(amax_history_len=2)):
        m(x).sum().backward()
    h, s = m.fp8_meta.amax_history["fwd"].clone(), m.fp8_meta.scale["fwd"].clone()
    with te.fp8_autocast(fp8_recipe=recipe.Float8CurrentScaling()):
        m(x * 100).sum().backward()
    assert torch.equal(m.fp8_meta.amax_history["fwd"], h) and torch.equal(m.fp8_meta.scale["fwd"], s)


def test_power_2_scales_follow_te_environment_variable(tmp_path):
    """TE's Float8CurrentScaling takes use_power_2_scales, and NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES=1
    (read at import) makes power-of-two scales the QParams' default; it was ignored."""
    import subprocess
    import sys
    code = ("from transformer_engine.common.recipe import Float8CurrentScaling as R; r = R(); "
            "print(r.use_power_2_scales, r.fp8_quant_fwd_inp.power_2_scale, r.fp8_quant_fwd_weight.power_2_scale, "
            "r.fp8_quant_bwd_grad.power_2_scale, R(use_power_2_scales=True).use_power_2_scales)")
    import os
    for env, want in (("1", "True True True True True"), ("0", "False False False False True")):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             env={**os.environ, "NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES": env}).stdout.strip()
        assert out == want, (env, out)
