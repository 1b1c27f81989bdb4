"""FP8 attention (recipe fp8_dpa=True) in DotProductAttention: outputs and gradients against a
float64 emulation of the same quantization points (_attn_ref.dpa_thd_ref with fp8 scales), the
delayed-scaling state of the attention's FP8 tensors, the custom ops under torch.compile, and
the clear errors (unsupported recipes, bias, a backend without FP8 attention). fp8_mha (FP8
hand-offs inside MultiheadAttention) is tested in test_attention_fp8_mha.py; DotProductAttention on
its own runs it as fp8_dpa (checked here).

The emulation comparisons hold to float64 rounding, which only the CPU backend's float64 FP8
reference reaches, so they run in the CPU mode and are skipped with NVTE_TEST_DEVICE=cuda; there
test_fp8_dpa_cuda_forward_matches_the_cpu_backend / ..._gradients_... compare the CUDA backend
(cuDNN's FP8 attention) with the CPU one.

Comparison rule: the emulation reproduces every FP8 rounding of the library, so the two differ by
float64 summation order and the float32 rounding of decoded values (~1e-8 relative); 1e-6 is
held, while the same attention without quantization is ~5e-2 away (checked too, so the
emulation is not trivially the high-precision math)."""
import copy
import math

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine import _nvte
from transformer_engine.common import recipe
from transformer_engine.pytorch import fused_attention as fa
from transformer_engine.pytorch import fused_attention_fp8 as fa8
from transformer_engine.pytorch.attention import DotProductAttention

from _attn_ref import dpa_thd_ref, from_thd, qdq, seqs_from_cu, to_thd
from _util import ON_CUDA, dev, rel_err

OPS = torch.ops.transformer_engine
cpu_only = pytest.mark.skipif(ON_CUDA, reason="float64-exact FP8 emulation comparisons: the CPU backend only (CUDA is "
                                              "compared with it in test_fp8_dpa_cuda_*_match*_the_cpu_backend)")
FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}


def _recipe(fmt="HYBRID", **kw):
    return recipe.DelayedScaling(fp8_dpa=True, fp8_format=getattr(recipe.Format, fmt), amax_history_len=4, **kw)


class Case:
    """Inputs of one layout: bshd / sbhd [b, s, h, d] or thd with gaps between sequences."""

    def __init__(self, fmt, h=4, g=2, d=16):
        self.fmt, self.h, self.g, self.d, self.b = fmt, h, g, d, 2
        if fmt == "thd":
            self.cu = torch.tensor([0, 5, 12], dtype=torch.int32)
            self.pad = torch.tensor([0, 6, 14], dtype=torch.int32)  # a gap before sequence 1, one at the end
            self.shape = lambda n, _=None: (15, n, d)
        else:
            s = 9
            self.cu = self.pad = torch.arange(self.b + 1, dtype=torch.int32) * s
            self.shape = (lambda n, _=None: (self.b, s, n, d)) if fmt == "bshd" else (lambda n, _=None: (s, self.b, n, d))

    def draw(self, gen, scale=1.0):
        q, k, v = (torch.randn(*self.shape(n), generator=gen) * scale for n in (self.h, self.g, self.g))
        dy = torch.randn(*self.shape(self.h), generator=gen) * 0.1
        return [t.requires_grad_(True) for t in (q, k, v)], dy

    def kwargs(self):
        if self.fmt != "thd":
            return {}
        return dict(cu_seqlens_q=dev(self.cu), cu_seqlens_kv=dev(self.cu), cu_seqlens_q_padded=dev(self.pad),
                    cu_seqlens_kv_padded=dev(self.pad))

    def ref(self, qkv, dy, mask, fp8):
        th = (lambda t: t) if self.fmt == "thd" else (lambda t: to_thd(t, self.fmt))
        back = (lambda t: t) if self.fmt == "thd" else (lambda t: from_thd(t, self.fmt, self.b))
        seqs = seqs_from_cu(self.cu, self.cu, self.pad, self.pad)
        o, grads, am = dpa_thd_ref(*(th(t) for t in qkv), seqs, mask, 1.0 / math.sqrt(self.d), th(dy), fp8)
        return back(o), [back(x) for x in grads], am


def fp8_scales(meta_fwd, meta_bwd, fmt):
    return dict(s_qkv=meta_fwd[0], s_s=meta_fwd[1], s_o=meta_fwd[2], s_do=meta_bwd[0], s_dp=meta_bwd[1],
                s_dqkv=meta_bwd[2], fmt_bwd="e5m2" if fmt == "HYBRID" else "e4m3")


def fp8_step(dpa, r, case, qkv, dy):
    """One forward (under fp8_autocast) + backward; returns out, the forward scales it used, the
    forward amaxes it recorded (before the autocast exit rolls the history) and the backward's."""
    sf = dpa.fp8_meta.scale["fwd"].clone()
    with te.fp8_autocast(fp8_recipe=r):
        out = dpa(*(dev(t) for t in qkv), **case.kwargs())
        am_f = dpa.fp8_meta.amax_history["fwd"][0].clone()
    out.backward(dev(dy.reshape(out.shape)))
    return out, sf, am_f, dpa.fp8_meta.scale["bwd"].clone(), dpa.fp8_meta.amax_history["bwd"][0].clone()


@cpu_only
@pytest.mark.parametrize("fmt,mask", [("bshd", "no_mask"), ("sbhd", "causal"), ("bshd", "causal_bottom_right"),
                                      ("thd", "padding_causal")])
@pytest.mark.parametrize("fp8_format", ["HYBRID", "E4M3"])
def test_fp8_dpa_matches_emulation(fmt, mask, fp8_format):
    case = Case(fmt)
    r = _recipe(fp8_format)
    dpa = DotProductAttention(case.h, case.d, num_gqa_groups=case.g, qkv_format=fmt, attn_mask_type=mask)
    gen = torch.Generator().manual_seed(7)
    for step in range(3):  # step 0 runs with unit scales, later steps with the recipe's scales
        qkv, dy = case.draw(gen, scale=1.0 + step)
        out, sf, am_f, sb, am_b = fp8_step(dpa, r, case, qkv, dy)
        assert out.dtype == torch.float32 and out.shape == (*case.shape(case.h)[:-2], case.h * case.d)
        ref, grads, am = case.ref(qkv, dy, mask, fp8_scales(sf, sb, fp8_format))
        hp, _, _ = case.ref(qkv, dy, mask, None)
        e = rel_err(out, ref.reshape(out.shape))
        assert e < 1e-6 and rel_err(out, hp.reshape(out.shape)) > 100 * max(e, 1e-6), (step, e)
        for name, t, gr in zip("qkv", qkv, grads):
            e = rel_err(t.grad, gr)
            assert e < 1e-6, (step, "d" + name, e)
        for got, keys in ((am_f, ("qkv", "s", "o")), (am_b, ("do", "dp", "dqkv"))):
            torch.testing.assert_close(got, torch.tensor([am[k] for k in keys], dtype=torch.float32),
                                       rtol=1e-6, atol=0)
    assert not torch.equal(sf, torch.ones(3)) and not torch.equal(sb, torch.ones(3))


@cpu_only
def test_fp8_recipe_state_follows_the_library_recipe():
    """The attention's six FP8 tensors get amax histories that roll once per step and scales
    fp8_max / max(history) (amax_compute_algo "max", margin 0): forward at the autocast exit
    (E4M3), backward at the start of each backward (E5M2 under HYBRID)."""
    case = Case("bshd")
    r = _recipe("HYBRID")
    dpa = DotProductAttention(case.h, case.d, num_gqa_groups=case.g, qkv_format="bshd", attn_mask_type="causal")
    meta = dpa.fp8_meta
    assert not meta.initialized and dpa.get_extra_state() is None
    gen = torch.Generator().manual_seed(3)
    seen = []
    for step in range(3):
        qkv, dy = case.draw(gen, scale=1.0 + step)
        _, _, am_f, _, am_b = fp8_step(dpa, r, case, qkv, dy)
        seen.append(am_f)
        hist = meta.amax_history["fwd"]
        assert meta.initialized and hist.shape == (4, 3)
        assert int((hist != 0).any(1).sum()) == step + 1  # one history row per step
        torch.testing.assert_close(hist.max(0).values, torch.stack(seen).max(0).values)
        torch.testing.assert_close(meta.scale["fwd"], FP8_MAX["e4m3"] / hist.max(0).values)
        assert torch.all(am_b > 0)
    # the backward scales were set by the step before the last backward (from the histories then)
    assert torch.all(meta.scale["bwd"] != 1.0)
    # _extra_state round trip (TE's DotProductAttention keeps it too)
    fresh = DotProductAttention(case.h, case.d, num_gqa_groups=case.g, qkv_format="bshd")
    fresh.load_state_dict(dpa.state_dict())
    for key in ("fwd", "bwd"):
        assert torch.equal(fresh.fp8_meta.amax_history[key], meta.amax_history[key].cpu())
        assert torch.equal(fresh.fp8_meta.scale[key], meta.scale[key].cpu())


def test_te_dpa_checkpoint_extra_state_loads():
    """TE 2.x's DotProductAttention `_extra_state` (its pickled dict as uint8 bytes) keeps three GEMMs'
    worth of slots, [len, 9] forward / [len, 6] backward, with Q/K/V at 2, O at 3, S at 8 and dQKV at
    0, dO at 3, dP at 5: those columns land in this module's slots (every column distinct, so a
    wrong mapping shows); a state of another width is refused with the shapes named."""
    import pickle
    hist_f = torch.arange(4 * 9, dtype=torch.float32).reshape(4, 9) + 1
    hist_b = torch.arange(4 * 6, dtype=torch.float32).reshape(4, 6) + 100
    scale_f, scale_b = torch.arange(9, dtype=torch.float32) + 1, torch.arange(6, dtype=torch.float32) + 20
    state = {"recipe": _recipe(), "scale_fwd": scale_f, "amax_history_fwd": hist_f, "scale_bwd": scale_b,
             "amax_history_bwd": hist_b, "extra_fp8_variables": {"num_gemms": 3}}
    blob = torch.frombuffer(bytearray(pickle.dumps(state)), dtype=torch.uint8)
    dpa = DotProductAttention(2, 8, qkv_format="bshd")
    sd = dpa.state_dict()
    sd["_extra_state"] = blob
    dpa.load_state_dict(sd)
    meta = dpa.fp8_meta
    from transformer_engine.pytorch import fused_attention_fp8 as fa8
    for slot, col in ((fa8.SLOT_QKV, 2), (fa8.SLOT_O, 3), (fa8.SLOT_S, 8)):
        assert torch.equal(meta.amax_history["fwd"][:, slot].cpu(), hist_f[:, col])
        assert float(meta.scale["fwd"][slot]) == float(scale_f[col])
    for slot, col in ((fa8.SLOT_DQKV, 0), (fa8.SLOT_DO, 3), (fa8.SLOT_DP, 5)):
        assert torch.equal(meta.amax_history["bwd"][:, slot].cpu(), hist_b[:, col])
        assert float(meta.scale["bwd"][slot]) == float(scale_b[col])
    bad = dict(state, amax_history_fwd=hist_f[:, :7], scale_fwd=scale_f[:7])
    with pytest.raises(ValueError, match=r"\(4, 7\)"):
        dpa.set_extra_state(torch.frombuffer(bytearray(pickle.dumps(bad)), dtype=torch.uint8))


@cpu_only
def test_fp8_dpa_inference():
    case = Case("sbhd", h=2, g=2, d=8)
    dpa = DotProductAttention(2, 8, qkv_format="sbhd", attn_mask_type="causal")
    qkv, _ = case.draw(torch.Generator().manual_seed(1))
    with torch.no_grad(), te.fp8_autocast(fp8_recipe=_recipe()):
        out = dpa(*qkv)
    ref, _, _ = dpa_thd_ref(*(to_thd(t, "sbhd") for t in qkv), seqs_from_cu(case.cu, case.cu), "causal",
                            1.0 / math.sqrt(8), None, fp8_scales(torch.ones(3), torch.ones(3), "HYBRID"))
    assert rel_err(out, from_thd(ref, "sbhd", 2).reshape(out.shape)) < 1e-6
    # amaxes recorded; no recipe step without grad (as for the other modules)
    assert torch.all(dpa.fp8_meta.amax_history["fwd"][0] > 0) and torch.all(dpa.fp8_meta.scale["fwd"] == 1.0)


def test_fp8_dpa_off_runs_high_precision(monkeypatch):
    """fp8_autocast with fp8_dpa=False (the default) leaves attention in high precision."""
    called = []
    monkeypatch.setattr(fa8.FusedAttnFP8Func, "apply", lambda *a: called.append(1))
    dpa = DotProductAttention(2, 8, qkv_format="bshd", attn_mask_type="causal")
    q = dev(torch.randn(2, 5, 2, 8, generator=torch.Generator().manual_seed(0)))
    want = dpa(q, q, q)
    with te.fp8_autocast(fp8_recipe=recipe.DelayedScaling()):
        got = dpa(q, q, q)
    assert torch.equal(got, want) and not called and not dpa.fp8_meta.initialized


def test_fp8_mha_on_dot_product_attention_alone_runs_as_fp8_dpa():
    """fp8_mha implies fp8_dpa (as in TE); DotProductAttention called directly takes and returns
    high-precision tensors, so it runs exactly as under fp8_dpa (the FP8 hand-offs are
    MultiheadAttention's)."""
    s, d, dtype = (128, 128, torch.bfloat16) if ON_CUDA else (4, 8, torch.float32)  # cuDNN's FP8 training shapes
    q = torch.randn(1, s, 2, d, generator=torch.Generator().manual_seed(0))
    res = []
    for r in (recipe.DelayedScaling(fp8_dpa=True), recipe.DelayedScaling(fp8_mha=True)):
        dpa = DotProductAttention(2, d, qkv_format="bshd", attn_mask_type="no_mask")
        x = dev(q.to(dtype)).detach().requires_grad_(True)
        with te.fp8_autocast(fp8_recipe=r):
            out = dpa(x, x, x)
        out.sum().backward()
        res.append((out.detach(), x.grad, dpa.fp8_meta.amax_history["bwd"].clone()))
    for a, b in zip(*res):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_unsupported_fp8_attention_recipes_are_clear_errors(monkeypatch):
    dpa = DotProductAttention(2, 8, qkv_format="bshd", attn_mask_type="no_mask")
    q = dev(torch.randn(1, 4, 2, 8, generator=torch.Generator().manual_seed(0)))
    cases = [(recipe.Float8CurrentScaling(fp8_dpa=True), "fp8_dpa is implemented for the DelayedScaling recipe only"),
             (recipe.Float8CurrentScaling(fp8_mha=True), "fp8_mha is implemented for the DelayedScaling recipe only"),
             (recipe.DelayedScaling(fp8_dpa=True, fp8_format=recipe.Format.E5M2), "float8_e4m3")]
    for r, msg in cases:
        with pytest.raises(NotImplementedError, match=msg), te.fp8_autocast(fp8_recipe=r):
            dpa(q, q, q)
    with pytest.raises(NotImplementedError, match="FP8 attention has no attention bias"), \
            te.fp8_autocast(fp8_recipe=_recipe()):
        dpa(q, q, q, core_attention_bias_type="post_scale_bias", core_attention_bias=dev(torch.zeros(1, 2, 4, 4)))
    monkeypatch.setenv("NVTE_FUSED_ATTN", "0")
    with pytest.raises(NotImplementedError, match="NVTE_FUSED_ATTN=0"), te.fp8_autocast(fp8_recipe=_recipe()):
        dpa(q, q, q)
    monkeypatch.delenv("NVTE_FUSED_ATTN")
    # a backend without FP8 attention for the call refuses: no silent high-precision fallback
    monkeypatch.setattr(fa, "fused_backend_supports", lambda *a, **kw: (False, "FP8 runs on the CPU backend only"))
    with pytest.raises(NotImplementedError, match="does not fall back"), te.fp8_autocast(fp8_recipe=_recipe()):
        dpa(q, q, q)


def _first_step_grad_errors(grad_scale: float):
    """Relative errors of dQ, dK, dV of DotProductAttention's first FP8 step (causal, bshd) against
    float64 attention, for an output gradient of size ~grad_scale, and the backward scales and
    amaxes it leaves."""
    b, s, h, d, dtype = (2, 128, 2, 128, torch.bfloat16) if ON_CUDA else (2, 33, 2, 16, torch.float32)
    gen = torch.Generator().manual_seed(21)
    q, k, v = (torch.randn(b, s, h, d, generator=gen).to(dtype).double() for _ in range(3))
    dy = (torch.randn(b, s, h * d, generator=gen) * grad_scale).to(dtype).double()
    ref = [t.clone().requires_grad_(True) for t in (q, k, v)]
    z = torch.einsum("bqhd,bkhd->bhqk", ref[0], ref[1]) / math.sqrt(d)
    z = z.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    torch.einsum("bhqk,bkhd->bqhd", torch.softmax(z, -1), ref[2]).reshape(b, s, h * d).backward(dy)
    dpa = DotProductAttention(h, d, qkv_format="bshd", attn_mask_type="causal")
    x = [dev(t.to(dtype)).requires_grad_(True) for t in (q, k, v)]
    with te.fp8_autocast(fp8_recipe=_recipe()):
        out = dpa(*x)
    out.backward(dev(dy.to(dtype)))
    sb, am_b = dpa.fp8_meta.scale["bwd"].cpu(), dpa.fp8_meta.amax_history["bwd"][0].cpu()
    return [rel_err(t.grad.double().cpu(), r.grad) for t, r in zip(x, ref)], sb, am_b


@pytest.mark.parametrize("grad_scale", [1e-1, 1e-6])
def test_fp8_dpa_first_backward_keeps_small_gradients(grad_scale, monkeypatch):
    """The first backward takes its FP8 scales from the gradients' own amaxes (dO by a current-scaled
    cast, dP and dQKV from amaxes measured by extra runs; fused_attention_fp8's module doc), not
    the initial scale 1 at which E5M2 flushes small gradients: the first step's dQ/dK/dV are as
    close to float64 as FP8 attention is (~0.1; TOL 0.25) for large and tiny gradients alike. The
    same step without the seeding (NVTE_FP8_SEED_FIRST_BACKWARD=0: TE's initial scales) loses the
    tiny gradients entirely (error ~1, checked: the test can fail), and the backward scales it
    leaves are fp8_max / the recorded amaxes."""
    errs, sb, am_b = _first_step_grad_errors(grad_scale)
    print("seeded", grad_scale, errs)
    assert max(errs) < 0.25, errs
    torch.testing.assert_close(sb, FP8_MAX["e5m2"] / am_b, rtol=1e-6, atol=0)
    if grad_scale < 1e-3:
        monkeypatch.setenv("NVTE_FP8_SEED_FIRST_BACKWARD", "0")
        unseeded, sb0, _ = _first_step_grad_errors(grad_scale)
        print("initial scales", grad_scale, unseeded)
        assert min(unseeded) > 0.9 and torch.equal(sb0, torch.ones(3)), unseeded


def _fp8_fwd_f16_bwd_ref(q, k, v, dy, causal, sf):
    """float64 emulation of NVTE_FP8_DPA_BWD=0 (bshd [b, s, h, d]): O of the FP8 forward (scales sf)
    and the gradients of the high-precision backward on the unquantized q, k, v with that
    forward's float32 softmax statistics and its decoded O."""
    d = q.shape[-1]
    scale = 1.0 / math.sqrt(d)
    q, k, v, do = (t.double().permute(0, 2, 1, 3) for t in (q, k, v, dy))   # [b, h, s, d]
    masked = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).triu(1) if causal else None
    logits = lambda a, b: (scale * a @ b.transpose(-1, -2)).masked_fill(masked, -math.inf) \
        if causal else scale * a @ b.transpose(-1, -2)  # noqa: E731
    q8, k8, v8 = (qdq(t, sf[0], "e4m3") for t in (q, k, v))
    z8 = logits(q8, k8)
    lse = torch.logsumexp(z8, -1, keepdim=True)
    m = z8.amax(-1, keepdim=True)
    o = qdq((qdq(torch.exp(z8 - m), sf[1], "e4m3") @ v8) / torch.exp(lse - m), sf[2], "e4m3")
    p = torch.exp(logits(q, k) - lse.float().double())
    ds = scale * p * (do @ v.transpose(-1, -2) - (do * o).sum(-1, keepdim=True))
    back = lambda t: t.permute(0, 2, 1, 3)  # noqa: E731
    return back(o), [back(ds @ k), back(ds.transpose(-1, -2) @ q), back(p.transpose(-1, -2) @ do)]


@cpu_only
@pytest.mark.parametrize("mask", ["no_mask", "causal"])
def test_fp8_dpa_bwd_off_runs_the_high_precision_backward(mask, monkeypatch):
    """NVTE_FP8_DPA_BWD=0 (TE's switch): the FP8 forward is unchanged (bit for bit), the backward is
    the high-precision one on the unquantized Q, K, V with the FP8 forward's statistics and O, so
    the gradients equal that float64 emulation (to float32 rounding) and differ from the FP8
    backward's; the backward FP8 state stays untouched. Two steps (the second with recipe scales)."""
    b, s, h, d = 2, 9, 2, 16
    gen = torch.Generator().manual_seed(17)
    mods = {flag: DotProductAttention(h, d, qkv_format="bshd", attn_mask_type=mask) for flag in ("1", "0")}
    for step in range(2):
        q, k, v = (torch.randn(b, s, h, d, generator=gen) for _ in range(3))
        dy = torch.randn(b, s, h * d, generator=gen) * 0.1
        res = {}
        for flag, dpa in mods.items():
            monkeypatch.setenv("NVTE_FP8_DPA_BWD", flag)
            x = [t.clone().requires_grad_(True) for t in (q, k, v)]
            sf = dpa.fp8_meta.scale["fwd"].clone()
            with te.fp8_autocast(fp8_recipe=_recipe()):
                out = dpa(*x)
            out.backward(dy)
            res[flag] = (out.detach(), [t.grad for t in x], sf)
        out, grads, sf = res["0"]
        assert torch.equal(out, res["1"][0]), step
        o_ref, g_ref = _fp8_fwd_f16_bwd_ref(q, k, v, dy.view(b, s, h, d), mask == "causal", sf)
        assert rel_err(out, o_ref.reshape(out.shape)) < 1e-6, step
        for name, g, r, g8 in zip("qkv", grads, g_ref, res["1"][1]):
            e = rel_err(g, r)
            assert e < 1e-6 and rel_err(g8, r) > 100 * max(e, 1e-6), (step, name, e, rel_err(g8, r))
    meta = mods["0"].fp8_meta
    assert not meta.amax_history["bwd"].any() and torch.equal(meta.scale["bwd"], torch.ones(3)) and meta.bwd_seeded == 0


def test_fp8_dpa_bwd_off_under_fp8_mha_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("NVTE_FP8_DPA_BWD", "0")
    d = 128 if ON_CUDA else 16
    m = te.MultiheadAttention(2 * d, 2, attention_dropout=0.0, params_dtype=torch.bfloat16 if ON_CUDA else torch.float32,
                              device=dev(torch.zeros(1)).device)
    x = dev(torch.randn(128 if ON_CUDA else 5, 1, 2 * d)).to(m.proj.weight.dtype).requires_grad_(True)
    with pytest.raises(NotImplementedError, match="NVTE_FP8_DPA_BWD=0"), \
            te.fp8_autocast(fp8_recipe=recipe.DelayedScaling(fp8_mha=True)):
        m(x)


def _cuda_vs_cpu_steps(mask):
    """The same module steps on both backends (bf16 Q/K/V, head dim 128: cuDNN's FP8 backward on
    Hopper takes 128 only): {(device, fp8): [per step: out, dq, dk, dv]} (CPU float32 copies)."""
    b, s, h, d = 2, 128, 2, 128
    gen = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(b, s, h, d, generator=gen) for _ in range(3))
    dy = torch.randn(b, s, h * d, generator=gen) * 0.1
    res = {}
    for device, fp8 in (("cpu", True), ("cuda", True), ("cpu", False)):
        dpa = DotProductAttention(h, d, qkv_format="bshd", attn_mask_type=mask)
        qkv = [t.to(device, torch.bfloat16).requires_grad_(True) for t in (q, k, v)]
        steps = []
        for _ in range(2):  # the second step runs with the recipe's scales
            for t in qkv:
                t.grad = None
            with te.fp8_autocast(enabled=fp8, fp8_recipe=_recipe()):
                out = dpa(*qkv)
            out.backward(dy.to(device, torch.bfloat16).reshape(out.shape))
            steps.append([x.float().cpu() for x in (out, *(t.grad for t in qkv))])
        res[(device, fp8)] = steps
    return res


def _exact(mask):
    """float64 attention on the same (bf16-rounded) inputs as _cuda_vs_cpu_steps: out, dq, dk, dv."""
    b, s, h, d = 2, 128, 2, 128
    gen = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(b, s, h, d, generator=gen).bfloat16().double().requires_grad_(True) for _ in range(3))
    dy = (torch.randn(b, s, h * d, generator=gen) * 0.1).bfloat16().double()
    z = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d)
    if mask == "causal":
        z = z.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(z, -1), v).reshape(b, s, h * d)
    out.backward(dy)
    return [out.detach(), q.grad, k.grad, v.grad]


def _cuda_vs_cpu_errors(res, mask, names):
    """(name, step, CUDA-vs-CPU error, FP8-vs-high-precision error) for the outputs in names."""
    rows = []
    for step in range(2):
        gpu, cpu, hp = (res[key][step] for key in (("cuda", True), ("cpu", True), ("cpu", False)))
        for i, name in enumerate(("out", "dq", "dk", "dv")):
            if name in names:
                rows.append((name, step, rel_err(gpu[i], cpu[i]), rel_err(cpu[i], hp[i])))
                print(f"{mask} step {step} {name}: cuda vs cpu {rows[-1][2]:.2e}, fp8 vs high precision "
                      f"{rows[-1][3]:.2e}")
    return rows


needs_cuda = pytest.mark.skipif(not ON_CUDA, reason="compares the CUDA backend (cuDNN FP8 attention) with the CPU "
                                                    "one: NVTE_TEST_DEVICE=cuda only")


@needs_cuda
@pytest.mark.parametrize("mask", ["no_mask", "causal"])
def test_fp8_dpa_cuda_forward_matches_the_cpu_backend(mask):
    """cuDNN accumulates in float32 in its own order, so some FP8 roundings of the exponentials and
    of O land on the other side of a boundary: the backends are compared by relative error
    against how far FP8 attention is from the same attention in high precision."""
    ok, why = te.is_fp8_available(return_reason=True)
    if not ok:
        pytest.skip(why)
    for name, step, e, fp8_effect in _cuda_vs_cpu_errors(_cuda_vs_cpu_steps(mask), mask, ("out",)):
        assert e < 2e-2 and e < 0.5 * fp8_effect, (name, step, e, fp8_effect)


@needs_cuda
@pytest.mark.xfail(strict=True, reason="open: on an H200 (cuDNN 9.19) the module's dQ and dK differ from the CPU "
                                       "backend's by 2.1e-2 to 2.8e-2 relative (over the 2e-2 asked here), while "
                                       "both are equally far from float64 (test_fp8_dpa_cuda_as_accurate_as_the_"
                                       "cpu_backend). benchmarks/fp8_attention_bwd_points.py: the CPU reference's "
                                       "dataflow is the closest of the variants tried, and perturbing its GEMMs at "
                                       "FP8 tensor-core accumulation level (~14 bits) moves it by the same 2%: E5M2 "
                                       "codes rounding the other way, not a different quantization point. (The "
                                       "causal dV gap, 15%, was the lost dV amax fold.)")
@pytest.mark.parametrize("mask", ["no_mask", "causal"])
def test_fp8_dpa_cuda_gradients_match_the_cpu_backend(mask):
    ok, why = te.is_fp8_available(return_reason=True)
    if not ok:
        pytest.skip(why)
    for name, step, e, fp8_effect in _cuda_vs_cpu_errors(_cuda_vs_cpu_steps(mask), mask, ("dq", "dk", "dv")):
        assert e < 2e-2 and e < 0.5 * fp8_effect, (name, step, e, fp8_effect)


@needs_cuda
@pytest.mark.parametrize("fp8_bwd", ["1", "0"])
@pytest.mark.parametrize("mask", ["no_mask", "causal"])
def test_fp8_dpa_cuda_as_accurate_as_the_cpu_backend(mask, fp8_bwd, monkeypatch):
    """GUIDE's rule for fused low-precision kernels: against float64 attention, the CUDA backend's
    FP8 attention (output and gradients, both steps) is at most 1.5x as far as the CPU backend's.
    Unlike a direct CUDA-vs-CPU comparison this does not require both backends to pick the same
    FP8 roundings (their step-1 scales come from each one's own amaxes). fp8_bwd "0":
    NVTE_FP8_DPA_BWD=0 (FP8 forward, cuDNN's BF16 backward)."""
    ok, why = te.is_fp8_available(return_reason=True)
    if not ok:
        pytest.skip(why)
    monkeypatch.setenv("NVTE_FP8_DPA_BWD", fp8_bwd)
    res, exact = _cuda_vs_cpu_steps(mask), _exact(mask)
    bad = []
    for step in range(2):
        for i, name in enumerate(("out", "dq", "dk", "dv")):
            e_gpu = rel_err(res[("cuda", True)][step][i].reshape(exact[i].shape), exact[i])
            e_cpu = rel_err(res[("cpu", True)][step][i].reshape(exact[i].shape), exact[i])
            print(f"{mask} step {step} {name}: vs float64 CUDA {e_gpu:.3e}, CPU {e_cpu:.3e}")
            if e_gpu > 1.5 * e_cpu + 1e-3:
                bad.append((step, name, e_gpu, e_cpu))
    assert not bad, bad


# ------------------------------------------------------------------ torch.compile / op registration
@cpu_only
def test_compile_fullgraph_aot_eager():
    """torch.compile(fullgraph=True) of DotProductAttention with fp8_dpa: the casts (Q, K, V in one
    quantize_many, dO in a quantize), the recipe step
    and both FP8 attention ops are graph nodes, and 3 steps match eager (outputs, grads, recipe state).
    The module runs one eager step first: FP8 metadata is adopted eagerly (fp8.FP8Meta.prepare)."""
    from test_compile import GraphRecorder
    torch._dynamo.reset()
    r = _recipe()
    case = Case("bshd")
    eager = DotProductAttention(case.h, case.d, num_gqa_groups=case.g, qkv_format="bshd", attn_mask_type="causal")
    gen = torch.Generator().manual_seed(5)
    fp8_step(eager, r, case, *case.draw(gen))
    src = copy.deepcopy(eager)
    rec = GraphRecorder()
    compiled = torch.compile(src, fullgraph=True, backend=rec.backend())
    try:
        for step in range(3):
            qkv, dy = case.draw(gen, scale=1.0 + step)
            qkv_c = [t.detach().clone().requires_grad_(True) for t in qkv]
            oe = fp8_step(eager, r, case, qkv, dy)[0]
            oc = fp8_step(compiled, r, case, qkv_c, dy)[0]
            torch.testing.assert_close(oc, oe, rtol=0, atol=0)
            for a, b in zip(qkv_c, qkv):
                torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)
            for key in ("fwd", "bwd"):
                assert torch.equal(src.fp8_meta.amax_history[key], eager.fp8_meta.amax_history[key])
                assert torch.equal(src.fp8_meta.scale[key], eager.fp8_meta.scale[key])
    finally:
        torch._dynamo.reset()
    assert OPS.fused_attn_fp8_fwd.default in rec.targets["fw"] and OPS.quantize_many.default in rec.targets["fw"]
    assert OPS.fused_attn_fp8_bwd.default in rec.targets["bw"] and OPS.quantize.default in rec.targets["bw"]
    assert OPS.delayed_scaling_update.default in rec.targets["bw"]


def _op_args():
    g = torch.Generator().manual_seed(0)
    e4, e5 = int(_nvte.DType.kFloat8E4M3), int(_nvte.DType.kFloat8E5M2)
    q, k, v = (torch.randn(2, 5, 2, 8, generator=g) for _ in range(3))
    scale, hist = torch.tensor([20.0, 400.0, 60.0]), torch.zeros(3, 3)
    (qd, q_si), (kd, k_si), (vd, v_si) = (fa8._cast(x, scale, hist.clone(), 0, e4) for x in (q, k, v))
    layout, mask = fa.LAYOUTS["bshd"], int(fa.MASKS["causal"])
    fwd = (qd, kd, vd, q_si, k_si, v_si, None, None, None, None, torch.zeros(2, dtype=torch.int64), scale, hist,
           5, 5, True, 0.35, 0.0, layout, mask, -1, -1, False)
    od, o_si, s_scale, stats, rng = fa8.fused_attn_fp8_fwd(*fwd[:12], hist.clone(), *fwd[13:])
    dod, do_si = fa8._cast(torch.randn(2, 5, 2, 8, generator=g), torch.full((3,), 1000.0), torch.zeros(3, 3), 0, e5)
    bwd = (qd, kd, vd, q_si, k_si, v_si, od, o_si, dod, do_si, stats, rng, s_scale, None, None, None, None,
           torch.tensor([1000.0, 5000.0, 2000.0]), torch.zeros(3, 3), 5, 5, 0.35, 0.0, layout, mask, -1, -1, False,
           e5, False)
    return {"fwd": (OPS.fused_attn_fp8_fwd, fwd), "bwd": (OPS.fused_attn_fp8_bwd, bwd),
            "bwd_seed": (OPS.fused_attn_fp8_bwd, bwd[:-1] + (True,))}


@cpu_only
@pytest.mark.parametrize("which", ["fwd", "bwd", "bwd_seed"])
def test_fp8_attention_op_registration(which):
    """torch.library.opcheck: schema (the declared amax-history / scale mutations), fake implementation and
    dispatcher registration agree with what the FP8 attention ops really do."""
    op, args = _op_args()[which]
    torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))


@pytest.mark.parametrize("bwd", ["fp8", "f16"])
def test_fp8_dpa_deterministic_refusal_is_a_clear_error_before_the_forward(bwd, monkeypatch):
    """NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 under fp8_dpa: the deterministic backward's workspace
    query is asked before the forward, of the FP8 graph (Q, K, V described as float8_e4m3) or, with
    NVTE_FP8_DPA_BWD=0, of the high-precision one. A refusal (simulated) is a NotImplementedError
    naming it, before any forward runs (FP8 attention has no high-precision fallback), instead of a
    failure at the backward; an acceptance trains (both steps' gradients finite)."""
    real = fa._nvte
    asked = []

    class Refuse:
        def __init__(self, refuse):
            self.refuse, self.fwd = refuse, 0

        def __getattr__(self, name):
            attr = getattr(real, name)
            if name == "fused_attn_fwd":
                def fwd(*a, **k):
                    self.fwd += 1
                    return attr(*a, **k)
                return fwd
            if name != "fused_attn_bwd_workspace_size":
                return attr

            def query(*a):
                asked.append((a[-1], a[0].dtype))
                if a[-1] and self.refuse:
                    raise real.Error("no deterministic backward for this graph (simulated)",
                                     int(real.Status.NOT_SUPPORTED))
                return attr(*a)
            return query

    monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
    monkeypatch.setenv("NVTE_FP8_DPA_BWD", "1" if bwd == "fp8" else "0")
    b, s, h, d = 2, (128 if ON_CUDA else 9), 2, (128 if ON_CUDA else 16)
    dt = torch.bfloat16 if ON_CUDA else torch.float32
    want = _nvte.DType.kFloat8E4M3 if bwd == "fp8" else fa._DT[dt]
    for refuse in (True, False):
        spy = Refuse(refuse)
        monkeypatch.setattr(fa, "_nvte", spy)
        monkeypatch.setattr(fa, "_WORKSPACE_ANSWERS", {})
        asked.clear()
        dpa = DotProductAttention(h, d, qkv_format="bshd", attn_mask_type="causal")
        q, k, v = (dev(torch.randn(b, s, h, d)).to(dt).requires_grad_(True) for _ in range(3))
        if refuse:
            with pytest.raises(NotImplementedError, match="simulated"), te.fp8_autocast(fp8_recipe=_recipe()):
                dpa(q, k, v)
            assert spy.fwd == 0 and asked == [(True, want)]
            continue
        for _ in range(2):
            with te.fp8_autocast(fp8_recipe=_recipe()):
                out = dpa(q, k, v)
            out.float().sum().backward()
        assert spy.fwd == 2 and asked[0] == (True, want)
        assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
