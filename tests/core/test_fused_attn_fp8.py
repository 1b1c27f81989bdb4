"""FP8 fused attention (fused_attn.h "FP8 attention") on the CPU backend against the float64
emulation of TE's quantized dataflow (fused_attn_fp8_ref.py, driven by fused_attn_fp8_case.py):
layouts (BSHD, SBHD, packed, THD), masks, GQA, odd sizes, dropout, softmax types, every output
format TE allows (FP8 E4M3/E5M2 with scale, amax, scale_inv; float16/bfloat16 under current
scaling), saturation at every quantization point, amax max-accumulation, the backend query and
the error messages of invalid FP8 combinations.

FP8 outputs are compared code for code (at most one FP8 step off, and only at rounding
boundaries; see fused_attn_fp8_case.py for why this bound is the right one); every output
element is poisoned with NaN codes before the call, input padding positions hold NaN codes."""
import numpy as np
import pytest

from fused_attn_case import BT, Case, L, M, ST, T
from fused_attn_fp8_case import Fp8Cfg, Fp8Run, Meta, run_fp8_case
from fused_attn_fp8_ref import fp8_attn_bwd_ref, fp8_attn_fwd_ref
from fused_attn_ref import AttnCfg, AttnExtras, dropout_keep, fused_attn_bwd_ref, fused_attn_ref
from util import assert_close
from transformer_engine import _nvte as nvte

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered in subtract:RuntimeWarning")
Status = nvte.Status


# ------------------------------------------------------------------ the reference itself


@pytest.mark.parametrize("softmax", ["vanilla", "learnable"])
def test_reference_without_quantization_is_attention(softmax, rng):
    """With both quantization points off, the FP8 reference is the high-precision reference
    (whose backward is checked against autograd in test_fused_attn.py)."""
    b, sq, skv, hq, hkv, d = 2, 5, 7, 4, 2, 6
    cfg = AttnCfg(scale=0.3, causal=True, bottom_right=True, softmax=softmax, dropout=0.25)
    ex = AttnExtras(np.array([5, 3]), np.array([7, 4]), alpha=rng.normal(0, 1, hq) if softmax == "learnable" else None,
                    keep=dropout_keep(3, 4, 0.25, b, hq, sq, skv))
    q, k, v, do = (rng.normal(0, 1, s) for s in [(b, sq, hq, d), (b, skv, hkv, d), (b, skv, hkv, d), (b, sq, hq, d)])
    o_ref, lse_ref, _ = fused_attn_ref(q, k, v, cfg, ex)
    o, lse, _ = fp8_attn_fwd_ref(q, k, v, cfg, ex, 1.0, None)
    assert_close(o, o_ref, atol=1e-13, rtol=1e-12)
    assert np.array_equal(lse, lse_ref)
    want = fused_attn_bwd_ref(q, k, v, o, do, lse, cfg, ex)
    got = fp8_attn_bwd_ref(q, k, v, o, do, lse, cfg, ex, 1.0, 1.0, None, None)
    for g, w in zip(got[:4], (want[0], want[1], want[2], want[4])):
        if w is not None:
            assert_close(g, w, atol=1e-13, rtol=1e-12)


def test_quantized_output_is_close_to_high_precision(rng):
    """Sanity of the emulated dataflow: FP8 O stays within a few E4M3 steps of exact attention."""
    r = run_fp8_case(Case(b=2, sq=16, skv=16, hq=2, hkv=2, dqk=32, dv=32, mask="causal"), rng, backward=False)
    o_ref, _, _ = fused_attn_ref(r.q, r.k, r.v, r.cfg, r.ex)
    got = r.o_values()
    scale = np.abs(o_ref).max()
    assert np.abs(got - o_ref).max() <= 0.25 * scale  # E4M3 steps are 2^-3 relative; P~ adds its own


# ------------------------------------------------------------------ layouts, masks, GQA

LAYOUT_CASES = ["NVTE_BSHD_BSHD_BSHD", "NVTE_SBHD_SBHD_SBHD", "NVTE_BS3HD", "NVTE_SBHD_SB2HD", "NVTE_THD_THD_THD"]
# THD takes its lengths from cu_seqlens: padding masks only (as TE's FP8 path requires).
LAYOUT_MASKS = [(l, m) for l in LAYOUT_CASES for m in ("no_mask", "causal", "padding", "padding_causal")
                if "THD" not in l or "padding" in m]


@pytest.mark.parametrize("layout,mask", LAYOUT_MASKS)
def test_layouts_masks_gqa(layout, mask, rng):
    packed_all, packed_kv = layout in ("NVTE_BS3HD",), layout in ("NVTE_SBHD_SB2HD",)
    case = Case(layout=layout, b=3, sq=7, skv=7 if packed_all else 9, hq=4, hkv=4 if packed_all else 2,
                dqk=12, dv=12 if packed_all or packed_kv else 8, mask=mask)
    run_fp8_case(case, rng)


@pytest.mark.parametrize("mask,wl,wr", [("causal", 3, 0), ("no_mask", 2, 1), ("padding_causal", 4, -1),
                                         ("causal_bottom_right", 2, 0)])
def test_sliding_windows(mask, wl, wr, rng):
    """Windows in FP8 attention (the CUDA backend runs left windows through cuDNN's band mask; the
    CPU backend, the oracle, takes every window)."""
    run_fp8_case(Case(b=2, sq=9, skv=11 if "bottom_right" in mask else 9, hq=4, hkv=2, dqk=16, dv=16, mask=mask,
                      wl=wl, wr=wr), rng)


# ------------------------------------------------------------------ formats and recipes

FORMATS = [("e4m3", "e4m3", "e4m3"),            # all E4M3
           ("e4m3", "e5m2", "e5m2"),            # HYBRID: E5M2 dO, dS~ and gradients
           ("e5m2", "e5m2", "e4m3"),
           ("bfloat16", "e5m2", "bfloat16"),    # current scaling: high-precision O and gradients
           ("float16", "e4m3", "float16")]


@pytest.mark.parametrize("fmt", FORMATS, ids=["-".join(f) for f in FORMATS])
def test_output_formats(fmt, rng):
    f = Fp8Cfg(o=fmt[0], do=fmt[1], dqkv=fmt[2])
    run_fp8_case(Case(b=2, sq=9, skv=11, hq=3, hkv=1, dqk=16, dv=24, mask="causal_bottom_right"), rng, f)


@pytest.mark.parametrize("dropout", [0.0, 0.3])
@pytest.mark.parametrize("softmax", ["vanilla", "off_by_one", "learnable"])
def test_softmax_types_and_dropout(softmax, dropout, rng):
    run_fp8_case(Case(sq=6, skv=8, hq=4, hkv=2, softmax=softmax, mask="padding_causal", dropout=dropout,
                      seed=2**35 + 3, offset=11), rng)


@pytest.mark.parametrize("sizes", [(1, 1, 8, 8), (5, 13, 24, 8), (33, 17, 64, 40), (3, 0, 8, 8)])
def test_odd_sizes(sizes, rng):
    sq, skv, dqk, dv = sizes
    run_fp8_case(Case(b=2, sq=sq, skv=skv, hq=2, hkv=1, dqk=dqk, dv=dv, mask="causal_bottom_right"), rng)


def test_saturation_at_every_quantization_point(rng):
    """Scales 16x too large: P~, O, dS~ and the gradients saturate to +-max, never NaN/inf."""
    r = run_fp8_case(Case(b=2, sq=8, skv=8, hq=2, hkv=2, dqk=16, dv=16, mask="causal"), rng,
                     Fp8Cfg(o="e4m3", do="e5m2", dqkv="e4m3", boost=16.0))
    assert (r.o_arr & 0x7F == 0x7E).any(), "some O values saturated to 448"
    assert any((g & 0x7F == 0x7E).any() for g in r.grad_views), "some gradients saturated"


@pytest.mark.parametrize("amax_init", [1e6, 1e-6])
def test_amax_max_accumulates(amax_init, rng):
    """amax buffers are max-accumulated (as every FP8 output of the library), scale_inv = 1/scale."""
    r = run_fp8_case(Case(mask="padding"), rng, Fp8Cfg(amax_init=amax_init))
    for meta in [r.o_meta, r.s_meta, r.dp_meta] + r.grad_meta:
        assert (meta.amax[0] == np.float32(1e6)) == (amax_init == 1e6)


def test_inference_needs_no_pack(rng):
    r = Fp8Run(Case(dropout=0.5, is_training=False, mask="causal"), rng)
    r.forward(aux=None)
    r.check_forward()


def test_aux_pack_matches_f16_protocol(rng):
    r = Fp8Run(Case(b=2, sq=5, hq=2, softmax="learnable"), rng)
    r.forward()
    assert [(list(s), d) for s, d in r.described] == [
        ([2, 2, 5, 1], nvte.DType.kFloat32), ([2], nvte.DType.kInt64), ([1, 2, 1, 1], nvte.DType.kFloat32)]


# ------------------------------------------------------------------ backend query


def test_backend_query():
    DT = nvte.DType
    args = dict(is_training=True, qkv_layout=L.NVTE_BSHD_BSHD_BSHD, bias_type=BT.NVTE_NO_BIAS,
                attn_mask_type=M.NVTE_CAUSAL_MASK, softmax_type=ST.NVTE_VANILLA_SOFTMAX, dropout=0.1,
                num_attn_heads=8, num_gqa_groups=2, max_seqlen_q=128, max_seqlen_kv=256, head_dim_qk=64,
                head_dim_v=64)
    no, fp8 = nvte.NVTE_Fused_Attn_Backend.NVTE_No_Backend, nvte.NVTE_Fused_Attn_Backend.NVTE_FP8
    want = no if nvte.cuda_backend_available() else fp8  # the GPU has no FP8 attention yet
    assert nvte.get_fused_attn_backend(q_dtype=DT.kFloat8E4M3, kv_dtype=DT.kFloat8E4M3, **args) == want
    for over, msg in ((dict(bias_type=BT.NVTE_POST_SCALE_BIAS), "has no bias"),
                      (dict(return_max_logit=True), "max logit"),
                      (dict(q_dtype=DT.kFloat8E5M2, kv_dtype=DT.kFloat8E5M2), "float8_e4m3 Q, K"),
                      (dict(kv_dtype=DT.kBFloat16), "one dtype for Q, K and V")):
        kw = dict(q_dtype=DT.kFloat8E4M3, kv_dtype=DT.kFloat8E4M3, **args)
        kw.update(over)
        assert nvte.get_fused_attn_backend(**kw) == no
        assert msg in nvte.get_last_error()


# ------------------------------------------------------------------ errors


def fwd_call(r, **over):
    kw = dict(**r.side(), S=r.s_meta.tensor(), page_table_k=None, page_table_v=None, rng_state=T(r.rng_state),
              is_training=True, return_max_logit=False, cuda_graph=False, **r.scalars())
    kw.update(over)
    tensors = kw.pop("tensors", r.tq)
    return nvte.fused_attn_fwd(*tensors, O=kw.pop("O", r.o_t), aux=kw.pop("aux", r.aux), **kw)


def plain(shape, dtype, np_t=np.uint8, **meta):
    arr = np.zeros(shape, np_t)
    t = nvte.Tensor(arr, dtype=dtype)
    return Meta(**meta).attach(t)


def test_forward_errors(rng):
    r = Fp8Run(Case(), rng)
    r.forward()
    DT = nvte.DType
    shp = (2, 5, 2, 8)
    e4m3 = lambda **m: plain(shp, DT.kFloat8E4M3, **m)
    cases = [
        (dict(S=None), "S is NULL", Status.INVALID_ARGUMENT),
        (dict(S=Meta(amax=0.0).tensor()), "S needs its scale", Status.INVALID_ARGUMENT),
        (dict(tensors=[e4m3(), r.tq[1], r.tq[2]]), "Q needs its scale_inv", Status.INVALID_ARGUMENT),
        (dict(tensors=[plain(shp, DT.kFloat8E5M2, scale_inv=1.0)] * 3), "float8_e4m3 Q, K and V",
         Status.NOT_SUPPORTED),
        (dict(tensors=[r.tq[0], plain(shp, DT.kBFloat16, np.uint16), plain(shp, DT.kBFloat16, np.uint16)]),
         "Q has dtype float8_e4m3 but K/V have bfloat16", Status.INVALID_ARGUMENT),
        (dict(O=plain(shp, DT.kFloat32, np.float32)), "O of FP8 attention must be", Status.INVALID_ARGUMENT),
        (dict(O=e4m3(amax=0.0)), "O needs its scale", Status.INVALID_ARGUMENT),
        (dict(O=plain((2, 5, 2, 4), DT.kFloat8E4M3, scale=1.0)), r"O has shape \[2, 5, 2, 4\]",
         Status.INVALID_ARGUMENT),
        (dict(bias_type=BT.NVTE_POST_SCALE_BIAS, Bias=T(np.zeros((1, 1, 5, 5), np.float32))), "has no bias",
         Status.NOT_SUPPORTED),
        (dict(bias_type=BT.NVTE_ALIBI), "has no bias", Status.NOT_SUPPORTED),
        (dict(return_max_logit=True), "does not return the max logit", Status.NOT_SUPPORTED),
    ]
    for over, match, status in cases:
        with pytest.raises(nvte.Error, match=match) as e:
            fwd_call(r, **over)
        assert e.value.args[1] == int(status), match
    fwd_call(r)  # still usable


def test_backward_errors(rng):
    r = Fp8Run(Case(), rng)
    r.forward()
    r.backward()
    DT = nvte.DType
    shp = (2, 5, 2, 8)
    g = r.grads_t
    cases = [
        (dict(dP=None), "dP is NULL"),
        (dict(S=Meta(amax=1.0).tensor()), "S needs its scale"),
        (dict(dO=plain(shp, DT.kBFloat16, np.uint16)), "dO of FP8 attention must be float8_e4m3 or float8_e5m2"),
        (dict(dO=plain(shp, DT.kFloat8E5M2)), "dO needs its scale_inv"),
        (dict(O=plain(shp, DT.kFloat8E4M3)), "O needs its scale_inv"),
        (dict(grads=[g[0], plain(shp, DT.kFloat8E4M3, scale=1.0), g[2]]), "dK must be float8_e5m2"),
        (dict(grads=[plain(shp, DT.kFloat8E5M2), g[1], g[2]]), "dQ needs its scale"),
        (dict(grads=[plain(shp, DT.kFloat32, np.float32)] * 3), "dQ of FP8 attention must be"),
    ]
    for over, match in cases:
        with pytest.raises(nvte.Error, match=match):
            r.backward(**over)
    r.backward()
    r.check_backward()


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan")])
def test_scales_must_be_finite_and_positive(bad, rng):
    """A zero, negative, infinite or NaN scale / scale_inv (S, O, dP, dQ's scales; Q, K, V, O, dO's
    scale_invs) is refused with an error naming the tensor, before any output is written (the
    poisoned O and gradients keep their NaN codes): it would otherwise give zeros or NaNs with an
    amax that looks valid. (CPU backend: the GPU's scales stay on the device.)"""
    r = Fp8Run(Case(), rng)
    r.forward()
    o_before = r.o_arr.copy()
    DT = nvte.DType
    shp = (2, 5, 2, 8)
    fwd_cases = [
        (dict(S=Meta(scale=bad, amax=0.0).tensor()), "S has scale"),
        (dict(O=plain(shp, DT.kFloat8E4M3, scale=bad)), "O has scale"),
        (dict(tensors=[Meta(scale_inv=bad).attach(plain(shp, DT.kFloat8E4M3)), r.tq[1], r.tq[2]]), "Q has scale_inv"),
        (dict(tensors=[r.tq[0], r.tq[1], Meta(scale_inv=bad).attach(plain(shp, DT.kFloat8E4M3))]), "V has scale_inv"),
    ]
    for over, match in fwd_cases:
        with pytest.raises(nvte.Error, match=match + ".*finite and positive"):
            fwd_call(r, **over)
    assert np.array_equal(r.o_arr, o_before, equal_nan=True)
    fwd_call(r)
    r.backward()
    g = r.grads_t
    bwd_cases = [
        (dict(dP=Meta(scale=bad, amax=0.0).tensor()), "dP"),
        (dict(dO=Meta(scale_inv=bad).attach(plain(shp, DT.kFloat8E5M2))), "dO has scale_inv"),
        (dict(O=Meta(scale_inv=bad).attach(plain(shp, DT.kFloat8E4M3))), "O has scale_inv"),
        (dict(grads=[Meta(scale=bad).attach(plain(shp, DT.kFloat8E5M2)), g[1], g[2]]), "dQ has scale"),
        (dict(tensors=[r.tq[0], Meta(scale_inv=bad).attach(plain(shp, DT.kFloat8E4M3)), r.tq[2]]), "K has scale_inv"),
    ]
    for over, match in bwd_cases:
        with pytest.raises(nvte.Error, match=match + ".*finite and positive"):
            r.backward(**over)
    r.backward()
    r.check_backward()
