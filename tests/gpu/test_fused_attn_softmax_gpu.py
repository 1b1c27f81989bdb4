"""The off-by-one and learnable softmax (NVTE_Softmax_Type; TE's softmax_type, the attention sink)
on the CUDA backend: cuDNN's sink token, with the learnable offset's gradient from the library's
own kernel. Held to test_fused_attn_gpu.py's rule against a float64 reference whose softmax has
the extra exp(offset[h]) term in every row (check() in attn_gpu_util.py), and to the CPU
backend; the statistics (which include the sink term) against the CPU's, rows that see no key
included (there they equal the offset); dSoftmaxOffset (float32 [1, h, 1, 1]) under the same
rule. Decode steps (max_seqlen_q 1) run forward only, as a rescaled vanilla forward (paged caches:
test_fused_attn_kv_cache_gpu.py). Configurations cuDNN 9.19 cannot run with a sink answer
NVTE_No_Backend with the reason."""
import pytest

from transformer_engine import _nvte as nvte

from attn_gpu_util import BT, L, M, ST, Case, check

SOFTMAX = ["off-by-one", "learnable"]


@pytest.mark.parametrize("softmax", SOFTMAX)
@pytest.mark.parametrize("layout,mask", [("NVTE_BSHD_BSHD_BSHD", "no_mask"), ("NVTE_SBHD_SBHD_SBHD", "causal"),
                                         ("NVTE_BS3HD", "causal"), ("NVTE_SBHD_SBH2D", "no_mask")])
def test_layouts_and_masks(softmax, layout, mask):
    check(Case(layout=layout, mask=mask, sq=80, skv=80, softmax=softmax))


@pytest.mark.parametrize("softmax", SOFTMAX)
@pytest.mark.parametrize("mask,sq,skv,lens_q,lens_kv", [
    ("padding_causal", 48, 72, [48, 17], [72, 30]),
    # bottom-right with more queries than keys: rows that see no key keep the sink alone
    ("padding_causal_bottom_right", 80, 80, [80, 0], [20, 80]),
    ("padding", 64, 64, [64, 9], [33, 64])])
def test_padding(softmax, mask, sq, skv, lens_q, lens_kv):
    check(Case(mask=mask, sq=sq, skv=skv, lens_q=lens_q, lens_kv=lens_kv, softmax=softmax))


@pytest.mark.parametrize("softmax", SOFTMAX)
def test_gqa_bias_and_head_dim_128(softmax):
    check(Case(hq=8, hkv=2, d=128, sq=96, skv=96, mask="causal", softmax=softmax))
    check(Case(bias=True, sq=64, skv=64, softmax=softmax))


@pytest.mark.parametrize("d,dv", [(64, 128), (128, 64), (32, 32)])
def test_head_dims_of_the_offset_gradient(d, dv):
    """The gradient kernel's lanes per row follow d_v (32 / 64 / 128: 4 / 8 / 16 lanes)."""
    check(Case(d=d, dv=dv, sq=64, skv=64, mask="causal", softmax="learnable"))


@pytest.mark.parametrize("softmax", SOFTMAX)
def test_float16_and_inference(softmax):
    check(Case(dtype="float16", mask="causal", sq=72, skv=72, softmax=softmax))
    check(Case(mask="causal", softmax=softmax), backward=False, training=False)


@pytest.mark.parametrize("softmax", SOFTMAX)
@pytest.mark.parametrize("layout", ["NVTE_BSHD_BSHD_BSHD", "NVTE_SBHD_SBHD_SBHD"])
def test_decode_step_rescales_a_vanilla_forward(softmax, layout):
    """max_seqlen_q 1 (cuDNN's decode mode takes no sink token), inference: the vanilla graph with
    statistics, each output row then scaled by its sink share; a sequence without keys stays zero."""
    check(Case(layout=layout, mask="padding_causal_bottom_right", sq=1, skv=200, hq=8, hkv=2, d=128, b=3,
               lens_q=[1, 1, 1], lens_kv=[200, 0, 57], softmax=softmax), backward=False, training=False)


@pytest.mark.parametrize("layout,sq,why", [("NVTE_THD_THD_THD", 64, "THD"),
                                           ("NVTE_BSHD_BSHD_BSHD", 1, "forward only")])
def test_unsupported_sink_configurations_answer_no_backend(layout, sq, why):
    BK = nvte.NVTE_Fused_Attn_Backend
    bf16 = nvte.DType.kBFloat16
    args = dict(q_dtype=bf16, kv_dtype=bf16, qkv_layout=getattr(L, layout), bias_type=BT.NVTE_NO_BIAS,
                attn_mask_type=M.NVTE_PADDING_CAUSAL_MASK, dropout=0.0, num_attn_heads=4, num_gqa_groups=4,
                max_seqlen_q=sq, max_seqlen_kv=64, head_dim_qk=64, head_dim_v=64, is_training=True)
    assert nvte.get_fused_attn_backend(softmax_type=ST.NVTE_VANILLA_SOFTMAX, **args) == BK.NVTE_F16_arbitrary_seqlen
    for st in (ST.NVTE_OFF_BY_ONE_SOFTMAX, ST.NVTE_LEARNABLE_SOFTMAX):
        assert nvte.get_fused_attn_backend(softmax_type=st, **args) == BK.NVTE_No_Backend
        assert why in nvte.get_last_error() and "softmax" in nvte.get_last_error()
