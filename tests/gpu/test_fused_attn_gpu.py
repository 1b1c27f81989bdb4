"""Fused attention on the CUDA backend (cuDNN SDPA) against the CPU backend and float64.

Tolerance (flash-attention's rule): the CUDA result's largest error against a float64
reference must be at most 2x the error of a naive same-precision implementation (torch on the
GPU: scores, softmax and products in the input dtype) plus a small floor. The CPU backend is
the oracle too: its result (float64 accumulation, rounded once) is within one output ulp of
the float64 reference, so the same bound holds against it. Padded positions must be zero in
O and in the gradients. Dropout (different random streams on the two backends) is checked for
determinism per rng_state and for its keep rate. THD layouts are in
test_fused_attn_thd_gpu.py, FP8 attention in test_fused_attn_fp8_gpu.py."""
import pytest
import torch

from transformer_engine import _nvte as nvte

from attn_gpu_util import BT, Case, check, handle, inputs, nv_dtype, run, scalars, to_layout
from gpu_util import T

LAYOUTS = ["NVTE_BSHD_BSHD_BSHD", "NVTE_SBHD_SBHD_SBHD", "NVTE_BS3HD", "NVTE_SB3HD", "NVTE_BSH3D",
           "NVTE_BSHD_BS2HD", "NVTE_SBHD_SBH2D"]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_layouts(layout, dtype):
    check(Case(layout=layout, dtype=dtype, sq=80, skv=80, mask="causal"))


@pytest.mark.parametrize("mask", ["no_mask", "causal", "padding", "padding_causal", "causal_bottom_right",
                                  "padding_causal_bottom_right"])
def test_masks(mask):
    padded = mask.startswith("padding")
    check(Case(mask=mask, sq=48, skv=72, lens_q=[48, 17] if padded else None, lens_kv=[72, 30] if padded else None))


@pytest.mark.parametrize("hq,hkv", [(8, 2), (8, 1)])
def test_gqa_mqa(hq, hkv):
    check(Case(hq=hq, hkv=hkv, sq=96, skv=96, mask="causal"))


@pytest.mark.parametrize("d", [64, 128])
def test_head_dims_and_odd_lengths(d):
    check(Case(d=d, sq=77, skv=77, b=3))


def test_post_scale_bias():
    check(Case(bias=True, sq=64, skv=64))


def test_inference_forward_only():
    check(Case(mask="causal"), backward=False)


def test_dropout_deterministic_per_rng_state():
    c = Case(dropout=0.25, sq=128, skv=128)
    q, k, v, do, bias = inputs(c)
    a = run(c, "cuda", q, k, v, do, bias, torch.tensor([7, 0], dtype=torch.int64))
    b = run(c, "cuda", q, k, v, do, bias, torch.tensor([7, 0], dtype=torch.int64))
    d = run(c, "cuda", q, k, v, do, bias, torch.tensor([7, 4096], dtype=torch.int64))
    for key in ("o", "dq", "dk", "dv"):
        assert torch.equal(a[key], b[key]), f"{key}: same rng_state gave different results"
        assert not torch.isnan(a[key]).any()
    assert not torch.equal(a["o"], d["o"]), "a different offset must draw a different dropout mask"
    # The expectation over masks is attention without dropout: the mean over many offsets approaches it.
    no = run(Case(sq=128, skv=128), "cuda", q, k, v, do, bias, torch.tensor([0, 0]), backward=False)["o"]
    mean = sum(run(c, "cuda", q, k, v, do, bias, torch.tensor([7, 4096 * i]), backward=False)["o"]
               for i in range(32)) / 32
    assert (mean - no).abs().mean() < 0.25 * no.abs().mean()


def test_unsupported_config_is_a_clear_error():
    c = Case(dtype="bfloat16")
    q, k, v, do, bias = inputs(c)
    (tq, tk, tv), keep = to_layout(c, (q, k, v), "cuda")
    H = [handle(x, nv_dtype(c)) for x in (tq, tk, tv)]
    sc = scalars(c)
    sc["bias_type"] = BT.NVTE_PRE_SCALE_BIAS
    bias_t = torch.zeros(1, c.hq, c.sq, c.skv, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(nvte.Error, match="pre-scale bias"):
        nvte.fused_attn_fwd_workspace_size(*H, T(bias_t).t, c.sq, c.skv, True, False, 0.0, sc["qkv_layout"],
                                           sc["bias_type"], sc["attn_mask_type"], sc["softmax_type"])
