"""Fused attention on the CUDA backend (cuDNN SDPA) against the CPU backend and float64.

Tolerance (flash-attention's rule): the CUDA result's largest error against a float64
reference must be at most 2x the error of a naive same-precision implementation (torch on the
GPU: scores, softmax and products in the input dtype) plus a small floor. The CPU backend is
the oracle too: its result (float64 accumulation, rounded once) is within one output ulp of
the float64 reference, so the same bound holds against it. Padded positions must be zero in
O and in the gradients. Dropout (different random streams on the two backends) is checked for
determinism per rng_state and for its keep rate. return_max_logit: the statistics and max
logits of the aux pack against the CPU backend's (check_logit_aux). THD layouts are in
test_fused_attn_thd_gpu.py, FP8 attention in test_fused_attn_fp8_gpu.py."""
import pytest
import torch

from transformer_engine import _nvte as nvte

from attn_gpu_util import BT, L, M, ST, Case, check, check_logit_aux, compare_rows, handle, inputs, nv_dtype, run, \
    scalars, to_layout
from gpu_util import T

LAYOUTS = ["NVTE_BSHD_BSHD_BSHD", "NVTE_SBHD_SBHD_SBHD", "NVTE_BS3HD", "NVTE_SB3HD", "NVTE_BSH3D",
           "NVTE_BSHD_BS2HD", "NVTE_SBHD_SBH2D"]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_layouts(layout, dtype):
    check(Case(layout=layout, dtype=dtype, sq=80, skv=80, mask="causal"))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mask,lens_q,lens_kv", [("padding_causal", [80, 33], [80, 57]),
                                                  ("padding_causal_bottom_right", [80, 0], [20, 80])])
def test_layouts_with_padding(layout, mask, lens_q, lens_kv):
    """Padding masks in every layout, which run as ragged tensors (ragged_padding: offsets b * s *
    row stride in BSHD, b * row stride in SBHD; packed strides included); with rows that see no key
    and a sequence without queries."""
    check(Case(layout=layout, sq=80, skv=80, mask=mask, lens_q=lens_q, lens_kv=lens_kv))


def test_padding_with_dropout_is_deterministic():
    """Dropout under a padding mask (a ragged graph for BSHD): the same rng_state gives the same
    forward and backward, and nothing is NaN."""
    c = Case(sq=128, skv=128, mask="padding", lens_q=[128, 70], lens_kv=[128, 99], dropout=0.2)
    q, k, v, do, bias = inputs(c)
    a, b = (run(c, "cuda", q, k, v, do, bias, torch.tensor([5, 0], dtype=torch.int64)) for _ in range(2))
    for key in ("o", "dq", "dk", "dv"):
        assert torch.equal(a[key], b[key]) and not torch.isnan(a[key]).any(), key


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


@pytest.mark.parametrize("d,dv", [(128, 64), (64, 128), (192, 128)])
def test_head_dim_v_differs(d, dv):
    """head_dim_qk != head_dim_v (V, O and dO have d_v; MLA-style 192 / 128 included), forward and
    backward, with GQA and a causal mask."""
    check(Case(d=d, dv=dv, hq=4, hkv=2, sq=72, skv=72, mask="causal"))


@pytest.mark.parametrize("mask,wl", [("causal", 20), ("no_mask", 33), ("padding_causal", 9), ("causal", 2**32 + 3),
                                     ("no_mask", 2**31 + 5)])
def test_sliding_window(mask, wl):
    """Left (sliding) windows, top-left aligned (cuDNN's diagonal band). Windows of 2^31 - 1 or more
    reach every key (unbounded, as on the CPU): cuDNN's int band bound had truncated them."""
    padded = mask.startswith("padding")
    check(Case(mask=mask, wl=wl, sq=96, skv=96, lens_q=[96, 41] if padded else None,
               lens_kv=[96, 41] if padded else None))


@pytest.mark.parametrize("mask,sq,skv,lens_q,lens_kv,wl", [
    ("causal_bottom_right", 48, 96, None, None, 20),  # more keys than queries: the band ends at the last key
    ("causal_bottom_right", 72, 48, None, None, 9),  # more queries than keys (cuDNN: its padding graph)
    ("padding_causal_bottom_right", 64, 64, [64, 40], [30, 64], 9),  # each sequence its own diagonal
    ("padding_causal_bottom_right", 80, 96, [33, 80], [96, 41], 1),  # a window of two keys
])
def test_bottom_right_causal_window(mask, sq, skv, lens_q, lens_kv, wl):
    """A left window with a bottom-right causal mask: the band of keys j in [i + diag - wl, i + diag]
    (diag = len_kv - len_q per sequence), which cuDNN >= 9.10 takes (the adapter's context
    parallelism over THD with 'all_gather' relies on it)."""
    check(Case(mask=mask, sq=sq, skv=skv, lens_q=lens_q, lens_kv=lens_kv, wl=wl, b=2, hq=4, hkv=2, d=64))


@pytest.mark.parametrize("mask,sq,skv,lens_q,lens_kv,wl,wr,br", [
    ("no_mask", 96, 96, None, None, 7, 5, False),  # a band of both bounds
    ("no_mask", 48, 96, None, None, 10, 3, True),  # on the bottom-right diagonal, more keys than queries
    ("no_mask", 72, 48, None, None, 6, 2, True),  # more queries than keys (cuDNN: its padding graph)
    ("no_mask", 72, 48, None, None, -1, 4, False),  # the right bound alone: rows from 43 on see every key
    ("padding", 64, 80, [64, 40], [80, 33], 9, 0, True),  # each sequence its own diagonal
    ("padding", 64, 64, [64, 20], [64, 50], 3, -1, False),  # the left bound alone, top-left
])
def test_window_band(mask, sq, skv, lens_q, lens_kv, wl, wr, br):
    """Windows without a causal mask (cuDNN's diagonal band, either bound), top-left or (with
    bottom_right_diagonal) bottom-right aligned, forward and backward."""
    check(Case(mask=mask, sq=sq, skv=skv, lens_q=lens_q, lens_kv=lens_kv, wl=wl, wr=wr, br=br, b=2, hq=4, hkv=2,
               d=64))


@pytest.mark.parametrize("bias_type,dropout,softmax", [("NVTE_POST_SCALE_BIAS", 0.0, "NVTE_VANILLA_SOFTMAX"),
                                                       ("NVTE_NO_BIAS", 0.1, "NVTE_VANILLA_SOFTMAX"),
                                                       ("NVTE_NO_BIAS", 0.0, "NVTE_OFF_BY_ONE_SOFTMAX")])
def test_window_band_with_bias_dropout_or_sink_is_not_supported(bias_type, dropout, softmax):
    """A band without the causal mask that has a right bound was checked with the vanilla softmax and
    without bias and dropout only: with those the backend query answers NVTE_No_Backend (a left
    window alone still runs)."""
    BK = nvte.NVTE_Fused_Attn_Backend
    bf16 = nvte.DType.kBFloat16
    args = dict(is_training=True, q_dtype=bf16, kv_dtype=bf16, qkv_layout=L.NVTE_BSHD_BSHD_BSHD,
                bias_type=getattr(BT, bias_type), attn_mask_type=M.NVTE_NO_MASK, softmax_type=getattr(ST, softmax),
                dropout=dropout, num_attn_heads=4, num_gqa_groups=4, max_seqlen_q=64, max_seqlen_kv=64,
                head_dim_qk=64, head_dim_v=64, window_size_left=8)
    assert nvte.get_fused_attn_backend(window_size_right=-1, **args) == BK.NVTE_F16_arbitrary_seqlen
    assert nvte.get_fused_attn_backend(window_size_right=2, **args) == BK.NVTE_No_Backend
    assert "takes no bias, ALiBi, dropout or attention sink" in nvte.get_last_error()


@pytest.mark.parametrize("mask,lens_q,lens_kv", [("causal_bottom_right", None, None),
                                                  ("padding_causal_bottom_right", [1, 0, 1], [200, 5, 0]),
                                                  ("padding", [1, 0, 1], [200, 5, 0])])
def test_decode_step(mask, lens_q, lens_kv):
    """One query row per sequence (cuDNN's decode kernel): a bottom-right causal mask is left out of
    the graph (it hides nothing there); forward and backward must match, and a sequence without
    queries must keep zero O / gradient rows and -inf statistics (the decode kernel writes its row
    0: the library zeroes it again)."""
    c = Case(b=3, sq=1, skv=200, hq=8, hkv=2, d=128, mask=mask, lens_q=lens_q, lens_kv=lens_kv)
    check(c)
    q, k, v, do, bias = inputs(c)
    rng_state = torch.tensor([123, 0], dtype=torch.int64)
    got, cpu = (run(c, dev, q, k, v, do, bias, rng_state, backward=False) for dev in ("cuda", "cpu"))
    compare_rows("statistics", got["aux"][0], cpu["aux"][0])


@pytest.mark.parametrize("mask,sq,skv,lens_q,lens_kv,wl", [
    ("causal_bottom_right", 72, 48, None, None, -1),  # rows 0..23 see no key (cuDNN: its padding graph)
    ("causal", 48, 72, None, None, -1),  # keys 48..71: seen by no query
    ("padding_causal_bottom_right", 72, 48, [72, 30], [48, 48], -1),  # max_seqlen_q > max_seqlen_kv
    ("padding_causal_bottom_right", 64, 64, [64, 40], [30, 64], -1),  # sequence 0: rows 0..33 see no key
    ("padding_causal", 96, 96, [96, 80], [20, 96], 9),  # sequence 0: rows from 29 on see no key
    ("padding", 64, 80, [0, 64, 33], [80, 0, 17], -1),  # no queries / no keys at all
])
def test_rows_and_keys_outside_the_mask(mask, sq, skv, lens_q, lens_kv, wl):
    """Query rows that see no key (O and dQ zero, statistics -inf) and keys that no query sees
    (dK, dV zero), with and without padding. The CUDA backend sets those rows after cuDNN ran
    (the outputs start as NaN here), and must leave the rows in use as cuDNN wrote them."""
    c = Case(b=len(lens_q) if lens_q else 2, sq=sq, skv=skv, hq=4, hkv=2, d=64, mask=mask, lens_q=lens_q,
             lens_kv=lens_kv, wl=wl)
    check(c)
    q, k, v, do, bias = inputs(c)
    rng_state = torch.tensor([123, 0], dtype=torch.int64)
    got, cpu = (run(c, dev, q, k, v, do, bias, rng_state, backward=False) for dev in ("cuda", "cpu"))
    compare_rows("statistics", got["aux"][0], cpu["aux"][0])


def test_post_scale_bias():
    check(Case(bias=True, sq=64, skv=64))


@pytest.mark.parametrize("mask,bias", [("no_mask", False), ("causal", True), ("padding_causal", False)])
def test_deterministic_backward(mask, bias):
    """deterministic=True (cuDNN's deterministic SDPA backward, which needs a larger workspace: the
    query is asked with the flag): within the bound, and bitwise the same over repeated calls
    (GQA: dK / dV sum over heads; the default backward accumulates dQ with atomics)."""
    padded = mask.startswith("padding")
    c = Case(mask=mask, bias=bias, hq=8, hkv=2, sq=256, skv=256, deterministic=True,
             lens_q=[256, 101] if padded else None, lens_kv=[256, 77] if padded else None)
    check(c)
    q, k, v, do, b = inputs(c)
    rng = torch.tensor([1, 0], dtype=torch.int64)
    runs = [run(c, "cuda", q, k, v, do, b, rng) for _ in range(3)]
    for key in ("dq", "dk", "dv"):
        assert all(torch.equal(runs[0][key], r[key]) for r in runs[1:]), key


def test_bias_of_another_dtype_is_refused():
    """cuDNN's graph reads Bias in Q's dtype: a float32 bias with bfloat16 Q would be misread."""
    c = Case(bias=True, sq=64, skv=64)
    q, k, v, do, bias = inputs(c)
    with pytest.raises(nvte.Error, match="takes Bias in Q's dtype bfloat16, got float32"):
        run(c, "cuda", q, k, v, do, bias, torch.tensor([1, 0], dtype=torch.int64), bias_dtype=torch.float32)


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


@pytest.mark.parametrize("mask,skv", [("NVTE_CAUSAL_BOTTOM_RIGHT_MASK", 96), ("NVTE_PADDING_CAUSAL_BOTTOM_RIGHT_MASK", 64)])
def test_bottom_right_causal_with_bias_or_dropout_is_not_supported(mask, skv):
    """cuDNN's SDPA rejects a bottom-right causal mask with a bias, ALiBi or dropout: the backend
    query answers NVTE_No_Backend with the reason (not a call that fails inside cuDNN). With
    padding the alignment stays bottom-right at equal maximum lengths (each sequence has its own);
    without padding and with equal lengths it is the top-left one, which cuDNN takes with a bias."""
    BK = nvte.NVTE_Fused_Attn_Backend
    bf16 = nvte.DType.kBFloat16
    args = dict(q_dtype=bf16, kv_dtype=bf16, qkv_layout=L.NVTE_BSHD_BSHD_BSHD, softmax_type=ST.NVTE_VANILLA_SOFTMAX,
                attn_mask_type=getattr(M, mask), num_attn_heads=4, num_gqa_groups=4, max_seqlen_q=64,
                max_seqlen_kv=skv, head_dim_qk=64, head_dim_v=64)
    same = dict(args, attn_mask_type=M.NVTE_CAUSAL_BOTTOM_RIGHT_MASK, max_seqlen_kv=64)
    assert nvte.get_fused_attn_backend(is_training=True, bias_type=BT.NVTE_POST_SCALE_BIAS, dropout=0.0,
                                       **same) == BK.NVTE_F16_arbitrary_seqlen
    query = lambda **kw: nvte.get_fused_attn_backend(**args, **kw)
    assert query(is_training=True, bias_type=BT.NVTE_NO_BIAS, dropout=0.0) == BK.NVTE_F16_arbitrary_seqlen
    assert query(is_training=False, bias_type=BT.NVTE_NO_BIAS, dropout=0.1) == BK.NVTE_F16_arbitrary_seqlen
    for bias, dropout, what in ((BT.NVTE_POST_SCALE_BIAS, 0.0, "bias"), (BT.NVTE_ALIBI, 0.0, "ALiBi"),
                                (BT.NVTE_NO_BIAS, 0.1, "dropout")):
        assert query(is_training=True, bias_type=bias, dropout=dropout) == BK.NVTE_No_Backend, what
        assert what in nvte.get_last_error() and "bottom-right" in nvte.get_last_error()


@pytest.mark.parametrize("dtype", ["kBFloat16", "kFloat8E4M3"])
@pytest.mark.parametrize("d_qk,d_v", [(6, 6), (64, 12), (264, 128), (128, 272)])
def test_head_sizes_cudnn_rejects_are_no_backend(dtype, d_qk, d_v):
    """Head sizes that are not multiples of 8 or exceed 256: NVTE_No_Backend with the reason from the
    query (cuDNN's graph validation would reject them only at the call), for BF16 and FP8 alike."""
    dt = getattr(nvte.DType, dtype)
    got = nvte.get_fused_attn_backend(is_training=True, q_dtype=dt, kv_dtype=dt, qkv_layout=L.NVTE_BSHD_BSHD_BSHD,
                                      bias_type=BT.NVTE_NO_BIAS, attn_mask_type=M.NVTE_CAUSAL_MASK,
                                      softmax_type=ST.NVTE_VANILLA_SOFTMAX, dropout=0.0, num_attn_heads=4,
                                      num_gqa_groups=4, max_seqlen_q=64, max_seqlen_kv=64, head_dim_qk=d_qk,
                                      head_dim_v=d_v)
    assert got == nvte.NVTE_Fused_Attn_Backend.NVTE_No_Backend
    assert "multiples of 8 and at most 256" in nvte.get_last_error()


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


# ------------------------------------------------------------------ return_max_logit
#
# cuDNN's Max and Sum_exp outputs replace its Stats (fused_attn_cudnn.cpp): the max logit (the
# largest scaled, biased, masked logit of each row) and the statistics must match the CPU
# backend's, -inf exactly where the CPU's are; the pack must be laid out as on the CPU; and the
# backward fed that pack must pass check()'s bound (the Max slot is skipped, the statistics are
# the ones computed from Max and Sum_exp). Sizes are odd on purpose.


@pytest.mark.parametrize("layout", ["NVTE_BSHD_BSHD_BSHD", "NVTE_SBHD_SBHD_SBHD", "NVTE_BS3HD", "NVTE_SBHD_SBH2D"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_max_logit_layouts(layout, dtype):
    check(Case(layout=layout, dtype=dtype, b=3, sq=77, skv=77, mask="causal"), max_logit=True)


@pytest.mark.parametrize("mask", ["no_mask", "causal", "padding", "padding_causal", "causal_bottom_right",
                                  "padding_causal_bottom_right"])
def test_max_logit_masks(mask):
    padded = mask.startswith("padding")
    check(Case(mask=mask, sq=45, skv=71, lens_q=[45, 17] if padded else None, lens_kv=[71, 30] if padded else None),
          max_logit=True)


@pytest.mark.parametrize("hq,hkv", [(8, 2), (8, 1)])
def test_max_logit_gqa(hq, hkv):
    check(Case(hq=hq, hkv=hkv, sq=96, skv=83, mask="padding_causal", lens_q=[96, 33], lens_kv=[83, 41]),
          max_logit=True)


def test_max_logit_post_scale_bias():
    """The max logit includes the bias (added after the scale)."""
    check(Case(bias=True, sq=65, skv=65, mask="padding", lens_q=[65, 20], lens_kv=[65, 51]), max_logit=True)


def test_max_logit_alibi():
    """ALiBi (cuDNN's default slopes, causal): the max logit includes the ALiBi term. The float64
    reference has no ALiBi, so O and the gradients are compared with the CPU backend's only."""
    c = Case(alibi=True, mask="causal", sq=75, skv=75, hq=8, hkv=2)
    q, k, v, do, bias = inputs(c)
    rs = torch.tensor([0, 0], dtype=torch.int64)
    got = run(c, "cuda", q, k, v, do, bias, rs, max_logit=True)
    cpu = run(c, "cpu", q, k, v, do, bias, rs, max_logit=True)
    check_logit_aux(got, cpu, run(c, "cuda", q, k, v, do, bias, rs, backward=False))
    for key in ("o", "dq", "dk", "dv"):
        assert not torch.isnan(got[key]).any()
        err = (got[key] - cpu[key]).abs().max().item()
        assert err <= 2e-2 * cpu[key].abs().max().item(), f"{key}: {err:.3g} from the CPU's"


def test_max_logit_head_dim_128():
    check(Case(d=128, sq=50, skv=93, b=3), max_logit=True)


def test_max_logit_inference():
    """An inference forward with the pack: the max logit and statistics are written too (as on the
    CPU), O as without the flag."""
    check(Case(mask="padding_causal", sq=70, skv=70, lens_q=[70, 9], lens_kv=[70, 40]), backward=False,
          max_logit=True, training=False)


def test_max_logit_with_dropout():
    """Dropout acts after the softmax: the max logit and statistics are the CPU's whatever the mask.
    The flagged forward must draw the mask the backward regenerates: its O and the gradients from
    its pack equal (up to summation order) those of the run without the flag."""
    c = Case(dropout=0.25, sq=128, skv=128, mask="causal")
    q, k, v, do, bias = inputs(c)
    rs = torch.tensor([7, 4096], dtype=torch.int64)
    got = run(c, "cuda", q, k, v, do, bias, rs, max_logit=True)
    again = run(c, "cuda", q, k, v, do, bias, rs, max_logit=True)
    plain = run(c, "cuda", q, k, v, do, bias, rs)
    cpu = run(c, "cpu", q, k, v, do, bias, rs, backward=False, max_logit=True)
    check_logit_aux(got, cpu, plain)
    for key in ("o", "dq", "dk", "dv"):
        assert torch.equal(got[key], again[key]), f"{key}: same rng_state gave different results"
        assert not torch.isnan(got[key]).any()
        err = (got[key] - plain[key]).abs().max().item()
        assert err <= 2e-2 * plain[key].abs().max().item(), f"{key}: {err:.3g} from the run without the flag"


def test_max_logit_without_aux_pack():
    """return_max_logit with no aux pack (inference) keeps nothing: the plain graph runs, in the
    workspace the flagged query asked for, and O is that of a call without the flag."""
    c = Case(mask="padding", lens_q=[64, 23], lens_kv=[64, 47])
    q, k, v, do, bias = inputs(c)
    (tq, tk, tv), keep = to_layout(c, (q, k, v), "cuda")
    H = [handle(x, nv_dtype(c)) for x in (tq, tk, tv)]
    sc = scalars(c)
    cu = lambda ls: T(torch.tensor([0] + list(torch.tensor(ls).cumsum(0)), dtype=torch.int32, device="cuda"))
    cuq, cukv = cu(c.lens_q), cu(c.lens_kv)
    outs = []
    for flag in (True, False):
        ws = nvte.fused_attn_fwd_workspace_size(*H, None, c.sq, c.skv, False, flag, 0.0, sc["qkv_layout"],
                                                sc["bias_type"], sc["attn_mask_type"], sc["softmax_type"])
        wst = torch.empty(max(ws, 1), dtype=torch.uint8, device="cuda")
        o = torch.full((c.b, c.sq, c.hq, c.dv), float("nan"), dtype=torch.bfloat16, device="cuda")
        nvte.fused_attn_fwd(*H, O=handle(o, nv_dtype(c)), aux=None, Bias=None, SoftmaxOffset=None, S=None,
                            cu_seqlens_q=cuq.t, cu_seqlens_kv=cukv.t, cu_seqlens_q_padded=None,
                            cu_seqlens_kv_padded=None, page_table_k=None, page_table_v=None, rng_state=None,
                            is_training=False, return_max_logit=flag, cuda_graph=False, workspace=T(wst).t, **sc)
        outs.append(o)
    torch.cuda.synchronize()
    assert not torch.isnan(outs[0]).any()
    assert torch.equal(outs[0], outs[1])


def test_max_logit_backend_query():
    """nvte_get_fused_attn_backend with return_max_logit: the float16/bfloat16 path for BSHD/SBHD and
    THD; FP8 stays NVTE_No_Backend (no max logit for FP8 attention, as in TE)."""
    BK = nvte.NVTE_Fused_Attn_Backend
    args = dict(is_training=True, bias_type=BT.NVTE_NO_BIAS, attn_mask_type=M.NVTE_PADDING_CAUSAL_MASK,
                softmax_type=ST.NVTE_VANILLA_SOFTMAX, dropout=0.0, num_attn_heads=4, max_seqlen_q=128,
                max_seqlen_kv=128, head_dim_qk=64, head_dim_v=64, return_max_logit=True)
    bf16 = dict(q_dtype=nvte.DType.kBFloat16, kv_dtype=nvte.DType.kBFloat16)
    for layout, hkv in ((L.NVTE_BSHD_BSHD_BSHD, 2), (L.NVTE_SB3HD, 4), (L.NVTE_THD_THD_THD, 2)):
        got = nvte.get_fused_attn_backend(qkv_layout=layout, num_gqa_groups=hkv, **bf16, **args)
        assert got == BK.NVTE_F16_arbitrary_seqlen, (layout, nvte.get_last_error())
    fp8 = dict(q_dtype=nvte.DType.kFloat8E4M3, kv_dtype=nvte.DType.kFloat8E4M3)
    args.update(head_dim_qk=128, head_dim_v=128)
    got = nvte.get_fused_attn_backend(qkv_layout=L.NVTE_BSHD_BSHD_BSHD, num_gqa_groups=2, **fp8, **args)
    assert got == BK.NVTE_No_Backend
    assert "max logit" in nvte.get_last_error()
