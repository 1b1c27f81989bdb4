"""Fused attention (fused_attn.h) on the CPU backend against float64 references
(fused_attn_ref.py, driven by fused_attn_case.py): every layout (packed views into one buffer,
SBHD/BSHD/THD, mixed formats, THD with gaps between sequences), mask types, sliding windows,
bias types (pre/post scale bias, ALiBi with default and given slopes), softmax types, GQA/MQA,
odd sizes, dropout, the aux-pack protocol, the queries and error messages.

Outputs are poisoned with NaN and compared in full, so padding positions and THD gaps must be
written (0); padding positions of inputs hold NaN, so reading them would show. The backward
reference takes the forward's stored O and statistics, exactly as the kernel does, so both
directions are compared with the central tolerance table (one rounding of a float64 result)."""
import numpy as np
import pytest
import torch

from fused_attn_case import (BT, DTYPES, LAYOUTS, MASKS, PAGED_LAYOUTS, Case, L, M, Run, ST, T, layout_info, run_case,
                             view)
from fused_attn_ref import AttnCfg, AttnExtras, dropout_keep, fused_attn_bwd_ref, fused_attn_ref, logits
from util import NP_TYPE, assert_close
from transformer_engine import _nvte as nvte

# -inf statistics compare equal in util.assert_close; numpy warns while computing -inf - -inf.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered in subtract:RuntimeWarning")


# ------------------------------------------------------------------ reference self-check


def torch_attn(q, k, v, bias, alpha, cfg, ex):
    """The same attention written with torch autograd ops (masked softmax, optional sink
    column, dropout), to check the explicit backward formulas of fused_attn_bwd_ref."""
    hq = q.shape[2]
    g = hq // k.shape[2]
    kk, vv = k.repeat_interleave(g, 2), v.repeat_interleave(g, 2)
    z = torch.einsum("bihd,bjhd->bhij", q, kk)
    z = cfg.scale * (z + bias) if cfg.bias_type == "pre" else cfg.scale * z + (bias if bias is not None else 0)
    _, vis = logits(q.detach().numpy(), k.detach().numpy(), cfg, ex)
    vis = torch.tensor(np.broadcast_to(vis, z.shape).copy())
    z = torch.where(vis, z, torch.tensor(-np.inf, dtype=torch.float64))
    if alpha is not None:
        sink = alpha.view(1, hq, 1, 1).expand(z.shape[0], hq, z.shape[2], 1)
        p = torch.softmax(torch.cat([z, sink], -1), -1)[..., :-1]
    else:
        empty = ~vis.any(-1, keepdim=True)
        p = torch.softmax(torch.where(empty, torch.zeros_like(z), z), -1) * ~empty
    if ex.keep is not None:
        p = p * torch.tensor(ex.keep) / (1.0 - float(np.float32(cfg.dropout)))
    return torch.einsum("bhij,bjhd->bihd", p, vv)


@pytest.mark.parametrize("softmax", ["vanilla", "learnable"])
@pytest.mark.parametrize("bias", ["post", "pre"])
def test_reference_backward_matches_autograd(bias, softmax, rng):
    b, sq, skv, hq, hkv, d = 2, 4, 6, 4, 2, 5
    cfg = AttnCfg(scale=0.4, causal=True, bottom_right=True, wl=3, bias_type=bias, softmax=softmax,
                  dropout=0.3)
    ex = AttnExtras(np.array([4, 2]), np.array([6, 1]), bias=rng.normal(0, 1, (b, 1, sq, skv)),
                    alpha=rng.normal(0, 1, hq) if softmax == "learnable" else None,
                    keep=dropout_keep(5, 9, 0.3, b, hq, sq, skv))
    q, k, v, do = (rng.normal(0, 1, s) for s in [(b, sq, hq, d), (b, skv, hkv, d), (b, skv, hkv, d), (b, sq, hq, d)])
    o, lse, _ = fused_attn_ref(q, k, v, cfg, ex)
    tq, tk, tv, tb = (torch.tensor(x, requires_grad=True) for x in (q, k, v, ex.bias))
    ta = torch.tensor(ex.alpha, requires_grad=True) if ex.alpha is not None else None
    out = torch_attn(tq, tk, tv, tb, ta, cfg, ex)
    assert_close(out.detach().numpy(), o, atol=1e-12, rtol=1e-12)
    out.backward(torch.tensor(do))
    dq, dk, dv, dbias, dalpha = fused_attn_bwd_ref(q, k, v, o, do, lse, cfg, ex, ex.bias.shape)
    for got, ref in ((tq.grad, dq), (tk.grad, dk), (tv.grad, dv), (tb.grad, dbias)):
        assert_close(ref, got.numpy(), atol=1e-12, rtol=1e-10)
    if ta is not None:
        assert_close(dalpha, ta.grad.numpy(), atol=1e-12, rtol=1e-10)


# ------------------------------------------------------------------ layouts and dtypes


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_layouts(layout, dtype, rng):
    qf, kvf, group = layout_info(layout)
    packed_all, packed_kv = group in ("3hd", "h3d"), group in ("2hd", "h2d")
    thd = "thd" in (qf, kvf)
    case = Case(layout=layout, dtype=dtype, b=3, sq=7, skv=7 if packed_all else 9,
                hq=4, hkv=4 if packed_all else 2, dqk=16, dv=16 if packed_all or packed_kv else 8,
                mask="padding_causal" if thd else "padding", bias="post" if not thd else "no_bias",
                bias_shape=(0, 1))
    run_case(case, rng)


# ------------------------------------------------------------------ masks, bias, GQA


@pytest.mark.parametrize("heads", [(2, 2), (4, 2), (3, 1)])
@pytest.mark.parametrize("bias", ["no_bias", "pre", "post", "alibi", "alibi_slopes"])
@pytest.mark.parametrize("mask", list(MASKS))
def test_masks_bias_gqa(mask, bias, heads, rng):
    case = Case(sq=5, skv=9, hq=heads[0], hkv=heads[1], mask=mask, bias=bias.replace("_slopes", ""),
                custom_slopes=bias == "alibi_slopes", bias_shape=(0, 0))
    run_case(case, rng)
    # The same in THD (sequences from cu_seqlens, gaps between them) with sq != skv per sequence.
    if "padding" in mask:
        case.layout = "NVTE_THD_THD_THD"
        run_case(case, rng)


@pytest.mark.parametrize("bias", ["pre", "post"])
@pytest.mark.parametrize("bias_shape", [(1, 1), (1, 0), (0, 1), (0, 0)])
def test_bias_broadcast_shapes(bias_shape, bias, rng):
    run_case(Case(b=3, sq=4, skv=6, hq=4, hkv=2, bias=bias, bias_shape=bias_shape, mask="padding_causal"), rng)


def test_minus_inf_bias_masks_keys(rng):
    """An arbitrary boolean mask as a post-scale bias of 0 / -inf; a fully masked row gives O = 0
    and zero gradients, never NaN."""
    b, h, sq, skv = 2, 2, 5, 6
    masked = rng.random((b, h, sq, skv)) < 0.4
    masked[0, 1, 2, :] = True
    bias = np.where(masked, -np.inf, 0.0)
    r = run_case(Case(b=b, hq=h, hkv=h, sq=sq, skv=skv, bias="post", extra={"bias": bias}), rng)
    o = r.o_arr.reshape(b, sq, h, -1)
    assert np.all(o[0, 2, 1] == 0.0) and np.isneginf(r.aux_arrays[0][0, 1, 2, 0])
    assert not np.isnan(r.dbias_arr).any() and np.all(r.dbias_arr[masked] == 0.0)


# ------------------------------------------------------------------ windows and alignment


@pytest.mark.parametrize("lengths", [(6, 10), (9, 4)])
@pytest.mark.parametrize("bottom_right", [False, True])
@pytest.mark.parametrize("mask", ["no_mask", "padding", "causal", "padding_causal_bottom_right"])
@pytest.mark.parametrize("window", [(0, 0), (2, 0), (1, 3), (-1, 2), (3, -1)])
def test_sliding_windows(window, mask, bottom_right, lengths, rng):
    run_case(Case(sq=lengths[0], skv=lengths[1], mask=mask, wl=window[0], wr=window[1],
                  bottom_right_diagonal=bottom_right, bias="alibi"), rng)


def test_causal_diagonals_structured():
    """sq=3, skv=5: top-left causal lets query 0 see key 0 only; bottom-right lets it see keys
    0..2. V = one-hot keys, Q = K = 0, so O row i is the uniform distribution over its keys."""
    for mask, counts in (("causal", [1, 2, 3]), ("causal_bottom_right", [3, 4, 5])):
        case = Case(b=1, sq=3, skv=5, hq=1, hkv=1, dqk=4, dv=5, mask=mask)
        r = Run(case, np.random.default_rng(0))
        r.q[:] = 0.0
        r.k[:] = 0.0
        r.v[:] = np.eye(5)[None, :, None, :]
        r.forward()
        o = r.o_arr.reshape(3, 5).astype(np.float64)
        for i, n in enumerate(counts):
            assert_close(o[i], np.r_[np.full(n, 1.0 / n), np.zeros(5 - n)])


# ------------------------------------------------------------------ softmax types, max logit


@pytest.mark.parametrize("dropout", [0.0, 0.3])
@pytest.mark.parametrize("mask", ["no_mask", "padding_causal"])
@pytest.mark.parametrize("softmax", ["vanilla", "off_by_one", "learnable"])
def test_softmax_types(softmax, mask, dropout, rng):
    run_case(Case(sq=6, skv=7, hq=4, hkv=2, softmax=softmax, mask=mask, dropout=dropout), rng)


@pytest.mark.parametrize("layout", ["NVTE_BSHD_BSHD_BSHD", "NVTE_THD_THD_THD"])
def test_return_max_logit(layout, rng):
    r = run_case(Case(layout=layout, mask="padding", return_max_logit=True, bias="post"), rng)
    assert len(r.described) == 4  # stats, max, rng_state, bias


@pytest.mark.parametrize("softmax", ["vanilla", "learnable"])
def test_return_max_logit_with_alibi_slopes(softmax, rng):
    """The pack then holds stats, max, rng_state, slopes (and the offset): the backward must take it."""
    r = run_case(Case(bias="alibi", custom_slopes=True, return_max_logit=True, softmax=softmax, mask="causal"), rng)
    assert len(r.described) == 4 + (softmax == "learnable")


@pytest.mark.parametrize("mask", ["no_mask", "causal", "padding_causal_bottom_right"])
def test_windows_beyond_any_sequence_are_unbounded(mask, rng):
    """A window of 2^40 or more reaches every key (no int64 overflow in i + diagonal + window)."""
    big = 2**63 - 1
    for wl, wr in ((big, big), (-1, big), (big, 0 if "causal" in mask else -1)):
        run_case(Case(sq=3, skv=5, mask=mask, wl=wl, wr=wr, bottom_right_diagonal=True), rng)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_outputs_are_rounded_once(dtype):
    """O = mean(V) (all logits 0) exactly 1 + half an ulp + a little: correctly rounded it is 1 + ulp;
    through float32 first it becomes a tie and rounds to even (1.0)."""
    npdt = NP_TYPE[dtype]
    if dtype == "bfloat16":
        vals, ulp = [2.0, 2.0, 2.0**-6, 2.0**-28], 2.0**-7  # mean 1 + 2^-8 + 2^-30
    else:
        vals, ulp = [2.0] * 32 + [2.0**-5, 2.0**-20] + [0.0] * 30, 2.0**-10  # mean 1 + 2^-11 + 2^-26
    n = len(vals)
    v = np.array(vals, np.float64).reshape(1, n, 1, 1).astype(npdt)
    assert (v.astype(np.float64).ravel() == vals).all()
    q, k, o = np.zeros((1, 1, 1, 1), npdt), np.zeros((1, n, 1, 1), npdt), np.full((1, 1, 1, 1), np.nan, npdt)
    nvte.fused_attn_fwd(Q=T(q), K=T(k), V=T(v), Bias=None, SoftmaxOffset=None, S=None, O=T(o), aux=None,
                        cu_seqlens_q=None, cu_seqlens_kv=None, cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None,
                        page_table_k=None, page_table_v=None, rng_state=None, max_seqlen_q=1, max_seqlen_kv=n,
                        is_training=False, return_max_logit=False, cuda_graph=False, attn_scale=1.0, dropout=0.0,
                        qkv_layout=L.NVTE_BSHD_BSHD_BSHD, bias_type=BT.NVTE_NO_BIAS, attn_mask_type=M.NVTE_NO_MASK,
                        softmax_type=ST.NVTE_VANILLA_SOFTMAX, window_size_left=-1, window_size_right=-1,
                        bottom_right_diagonal=False)
    assert float(o.ravel()[0]) == 1.0 + ulp


# ------------------------------------------------------------------ sizes


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sizes", [(1, 1, 8, 8), (1, 7, 24, 8), (7, 1, 64, 24), (33, 33, 64, 64),
                                   (33, 7, 8, 24), (3, 0, 8, 8)])
def test_odd_sizes(sizes, dtype, rng):
    sq, skv, dqk, dv = sizes
    run_case(Case(dtype=dtype, b=2, sq=sq, skv=skv, hq=2, hkv=1, dqk=dqk, dv=dv, mask="causal_bottom_right"), rng)


def test_empty_batch(rng):
    run_case(Case(b=0, mask="padding"), rng)
    run_case(Case(b=0, layout="NVTE_THD_THD_THD", mask="padding", thd_gaps=False), rng)


def test_thd_zero_length_and_gaps(rng):
    for layout in ("NVTE_T3HD", "NVTE_TH3D", "NVTE_THD_T2HD", "NVTE_THD_TH2D", "NVTE_THD_THD_THD"):
        _, _, group = layout_info(layout)
        hkv, dv = (3, 8) if group in ("3hd", "h3d") else (1, 8)
        run_case(Case(layout=layout, b=4, sq=6, skv=6, hq=3, hkv=hkv, dv=dv, mask="padding_causal_bottom_right",
                      lens_q=[0, 6, 2, 5], lens_kv=None if group in ("3hd", "h3d") else [3, 6, 0, 5]), rng)


# ------------------------------------------------------------------ dropout


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("layout", ["NVTE_BSHD_BSHD_BSHD", "NVTE_SBH3D", "NVTE_THD_THD_THD"])
def test_dropout_matches_philox_reference(layout, dtype, rng):
    """The keep mask is the documented Philox draw (fused_attn_ref.dropout_keep), in both
    directions, with GQA, padding and a bias."""
    _, _, group = layout_info(layout)
    hkv = 4 if group in ("3hd", "h3d") else 2
    run_case(Case(layout=layout, dtype=dtype, b=2, sq=9, skv=9, hq=4, hkv=hkv, dropout=0.35,
                  mask="padding_causal", seed=2**40 + 17, offset=2**33 + 5), rng)


def recover_keep(seed, offset, p, b=2, h=3, s=16):
    """Reads the dropout mask off the forward output: Q = K = 0 gives uniform probabilities
    1/s and V = one-hot keys, so O[b, i, h, j] = keep / ((1 - p) s)."""
    case = Case(b=b, sq=s, skv=s, hq=h, hkv=h, dqk=4, dv=s, dropout=p, seed=seed, offset=offset)
    r = Run(case, np.random.default_rng(0))
    r.q[:] = 0.0
    r.k[:] = 0.0
    r.v[:] = np.eye(s)[None, :, None, :]
    r.forward()
    o = r.o_arr.reshape(b, s, h, s).transpose(0, 2, 1, 3)  # [b, h, i, j]
    scale = 1.0 / ((1.0 - float(np.float32(p))) * s)
    assert np.all(np.isclose(o, 0.0) | np.isclose(o, scale, rtol=1e-6))
    return o > 0.5 * scale, r


def test_dropout_mask_from_forward_is_used_by_backward(rng):
    keep, r = recover_keep(seed=99, offset=3, p=0.4)
    assert np.array_equal(keep, dropout_keep(99, 3, 0.4, 2, 3, 16, 16))
    # Backward with the same pack: dV = (P * keep / (1 - p))^T dO with P = 1/s uniform.
    r.backward()
    p_drop = keep / ((1.0 - float(np.float32(0.4))) * 16)
    dv_ref = np.einsum("bhij,bihd->bjhd", p_drop, r.do)
    assert_close(r.grad_views[2], dv_ref.reshape(-1, 3, 16))
    r.check_backward()


def test_dropout_statistics_and_streams():
    p = 0.3
    keep, _ = recover_keep(seed=2024, offset=0, p=p, b=2, h=4, s=64)
    n = keep.size
    frac = keep.mean()
    assert abs(frac - (1 - p)) < 5 * np.sqrt(p * (1 - p) / n), f"kept {frac:.4f}, expected {1 - p}"
    # Heads, batch entries, rows and columns draw independently (no repeated patterns).
    flat = keep.reshape(8, -1)
    assert len({row.tobytes() for row in flat}) == 8
    assert abs(np.corrcoef(keep[..., :-1].ravel(), keep[..., 1:].ravel())[0, 1]) < 0.05
    # Same (seed, offset) -> same mask; another offset or seed -> another mask.
    again, _ = recover_keep(seed=2024, offset=0, p=p, b=2, h=4, s=64)
    assert np.array_equal(again, keep)
    assert not np.array_equal(recover_keep(seed=2024, offset=1, p=p, b=2, h=4, s=64)[0], keep)
    assert not np.array_equal(recover_keep(seed=2025, offset=0, p=p, b=2, h=4, s=64)[0], keep)


def test_inference_ignores_dropout_and_needs_no_pack(rng):
    r = Run(Case(dropout=0.5, is_training=False, mask="causal"), rng)
    r.forward(aux=None)
    r.check_forward()  # reference built with dropout 0 for inference


# ------------------------------------------------------------------ aux pack protocol


@pytest.mark.parametrize("variant", ["plain", "bias", "learnable", "max", "slopes"])
def test_aux_pack_description(variant, rng):
    case = Case(bias={"bias": "post", "slopes": "alibi"}.get(variant, "no_bias"), custom_slopes=variant == "slopes",
                softmax="learnable" if variant == "learnable" else "vanilla",
                return_max_logit=variant == "max", dtype="bfloat16", bias_shape=(1, 0))
    r = Run(case, rng)
    r.forward()
    stats = ([2, 2, 5, 1], nvte.DType.kFloat32)
    want = [stats] + ([stats] if variant == "max" else []) + [([2], nvte.DType.kInt64)]
    want += {"bias": [([1, 2, 5, 5], nvte.DType.kBFloat16)], "slopes": [([2], nvte.DType.kFloat32)],
             "learnable": [([1, 2, 1, 1], nvte.DType.kFloat32)]}.get(variant, [])
    assert [(list(s), d) for s, d in r.described] == want
    r.check_forward()
    r.backward()
    r.check_backward()


def test_aux_slots_without_buffers_alias_the_inputs(rng):
    r = Run(Case(bias="post"), rng)
    r.forward()
    stats = r.aux[0]
    rng_slot, bias_slot = nvte.Tensor(), nvte.Tensor()
    rng_slot.set_param(nvte.Param.kRowwiseData, 0, [2], nvte.DType.kInt64)
    bias_slot.set_param(nvte.Param.kRowwiseData, 0, list(r.bias_arr.shape), nvte.DType.kFloat32)
    rng_t, bias_t = T(r.rng_state), T(r.bias_arr)
    side = r.side()
    side["Bias"] = bias_t
    nvte.fused_attn_fwd(*r.tq, O=r.o_t, aux=[stats, rng_slot, bias_slot], S=None, page_table_k=None,
                        page_table_v=None, rng_state=rng_t, is_training=True, return_max_logit=False,
                        cuda_graph=False, **side, **r.scalars())
    assert rng_slot.param_ptr(nvte.Param.kRowwiseData) == rng_t.param_ptr(nvte.Param.kRowwiseData)
    assert bias_slot.param_ptr(nvte.Param.kRowwiseData) == bias_t.param_ptr(nvte.Param.kRowwiseData)


# ------------------------------------------------------------------ queries


def test_layout_queries():
    for name, value in L.__members__.items():
        qf, kvf, group = layout_info(name.replace("Paged_KV_", ""))
        fmt = {"sbhd": nvte.NVTE_QKV_Format.NVTE_SBHD, "bshd": nvte.NVTE_QKV_Format.NVTE_BSHD,
               "thd": nvte.NVTE_QKV_Format.NVTE_THD}
        assert nvte.get_q_format(value) == fmt[qf] and nvte.get_kv_format(value) == fmt[kvf], name
        combined = nvte.get_qkv_format(value)
        if qf == kvf:
            assert combined == fmt[qf], name
        else:
            assert combined.name == f"NVTE_{qf.upper()}_2{kvf.upper()}", name
        want_group = "NVTE_Paged_KV_HD_HD_HD" if "Paged" in name else \
            {"3hd": "NVTE_3HD", "h3d": "NVTE_H3D", "2hd": "NVTE_HD_2HD", "h2d": "NVTE_HD_H2D"}.get(group, "NVTE_HD_HD_HD")
        assert nvte.get_qkv_layout_group(value).name == want_group, name
    with pytest.raises(nvte.Error, match="not an NVTE_QKV_Layout value"):
        nvte.get_qkv_format(L(99))


def test_backend_query():
    DT = nvte.DType
    args = dict(is_training=True, qkv_layout=L.NVTE_BSHD_BSHD_BSHD, bias_type=BT.NVTE_NO_BIAS,
                attn_mask_type=M.NVTE_CAUSAL_MASK, softmax_type=ST.NVTE_VANILLA_SOFTMAX, dropout=0.1,
                num_attn_heads=8, num_gqa_groups=2, max_seqlen_q=128, max_seqlen_kv=256, head_dim_qk=64,
                head_dim_v=32)
    for dt in (DT.kFloat32, DT.kFloat16, DT.kBFloat16):
        assert nvte.get_fused_attn_backend(q_dtype=dt, kv_dtype=dt, **args) == \
            nvte.NVTE_Fused_Attn_Backend.NVTE_F16_arbitrary_seqlen
    no = nvte.NVTE_Fused_Attn_Backend.NVTE_No_Backend
    # FP8 (E4M3 Q/K/V) is answered in test_fused_attn_fp8.py; E5M2 inputs are not TE's format.
    assert nvte.get_fused_attn_backend(q_dtype=DT.kFloat8E5M2, kv_dtype=DT.kFloat8E5M2, **args) == no
    assert "FP8" in nvte.get_last_error()
    args["qkv_layout"] = L.NVTE_Paged_KV_BSHD_BSHD_BSHD  # paged caches take their lengths from cu_seqlens_kv
    assert nvte.get_fused_attn_backend(q_dtype=DT.kBFloat16, kv_dtype=DT.kBFloat16, **args) == no
    assert "use a padding mask type" in nvte.get_last_error()
    args.update(qkv_layout=L.NVTE_BSHD_BSHD_BSHD, num_gqa_groups=3)
    assert nvte.get_fused_attn_backend(q_dtype=DT.kBFloat16, kv_dtype=DT.kBFloat16, **args) == no
    assert "divide" in nvte.get_last_error()


def test_backend_query_paged_layouts_are_inference_only():
    DT, F = nvte.DType, nvte.NVTE_Fused_Attn_Backend
    args = dict(q_dtype=DT.kBFloat16, kv_dtype=DT.kBFloat16, qkv_layout=L.NVTE_Paged_KV_BSHD_BSHD_BSHD,
                bias_type=BT.NVTE_NO_BIAS, attn_mask_type=M.NVTE_PADDING_CAUSAL_MASK,
                softmax_type=ST.NVTE_VANILLA_SOFTMAX, dropout=0.0, num_attn_heads=4, num_gqa_groups=2,
                max_seqlen_q=1, max_seqlen_kv=64, head_dim_qk=64, head_dim_v=64)
    assert nvte.get_fused_attn_backend(is_training=False, **args) == F.NVTE_F16_arbitrary_seqlen
    assert nvte.get_fused_attn_backend(is_training=True, **args) == F.NVTE_No_Backend
    assert "no backward" in nvte.get_last_error()


def test_workspace_queries_are_zero_on_cpu(rng):
    r = Run(Case(layout="NVTE_BS3HD", mask="causal"), rng)
    tq, _ = r.qkv_tensors(r.qkv_rows(r.q, r.k, r.v, 0.0))
    common = dict(qkv_layout=L.NVTE_BS3HD, bias_type=BT.NVTE_NO_BIAS, attn_mask_type=M.NVTE_CAUSAL_MASK,
                  softmax_type=ST.NVTE_VANILLA_SOFTMAX, max_seqlen_q=5, max_seqlen_kv=5, dropout=0.1)
    assert nvte.fused_attn_fwd_workspace_size(*tq, None, is_training=True, return_max_logit=False, **common) == 0
    assert nvte.fused_attn_bwd_workspace_size(*tq, None, **common) == 0


# ------------------------------------------------------------------ errors


def fwd_call(r, tensors=None, aux="alloc", **over):
    """A forward call of run r with some arguments replaced."""
    kw = dict(**r.side(), S=None, page_table_k=None, page_table_v=None, rng_state=T(r.rng_state),
              is_training=True, return_max_logit=False, cuda_graph=False, **r.scalars())
    kw.update(over)
    return nvte.fused_attn_fwd(*(tensors or r.tq), O=kw.pop("O", r.o_t),
                               aux=r.aux if aux == "alloc" else aux, **kw)


def separate_bs3hd(r):
    """Q, K, V as three separate buffers while the layout says bs3hd."""
    return [T(np.zeros((2, 5, 2, 8), np.float32)) for _ in range(3)]


Status = nvte.Status
FWD_ERRORS = [
    ("bad layout", dict(qkv_layout=L(99)), "not an NVTE_QKV_Layout value", Status.INVALID_ARGUMENT),
    ("paged mask", dict(qkv_layout=L.NVTE_Paged_KV_BSHD_BSHD_BSHD), "use a padding mask type",
     Status.INVALID_ARGUMENT),
    ("tables, not paged", dict(page_table_k=T(np.zeros((2, 3), np.int32))), "is not a paged layout",
     Status.INVALID_ARGUMENT),
    ("arbitrary", dict(attn_mask_type=M.NVTE_ARBITRARY_MASK), "post_scale_bias", Status.NOT_SUPPORTED),
    ("dropout 1", dict(dropout=1.0), r"dropout probability must be in \[0, 1\)", Status.INVALID_ARGUMENT),
    ("window", dict(window_size_left=-2), "window sizes must be >= -1", Status.INVALID_ARGUMENT),
    ("max_seqlen", dict(max_seqlen_q=6), "must equal max_seqlen_q = 6", Status.INVALID_ARGUMENT),
    ("no cu_seqlens", dict(attn_mask_type=M.NVTE_PADDING_MASK), "cu_seqlens_q is required",
     Status.INVALID_ARGUMENT),
    ("cu int64", dict(attn_mask_type=M.NVTE_PADDING_MASK, cu_seqlens_q=T(np.zeros(3, np.int64)),
                      cu_seqlens_kv=T(np.zeros(3, np.int32))), "must be int32", Status.INVALID_ARGUMENT),
    ("cu length", dict(attn_mask_type=M.NVTE_PADDING_MASK, cu_seqlens_q=T(np.zeros(4, np.int32)),
                       cu_seqlens_kv=T(np.zeros(3, np.int32))), r"expected \[3\] \(batch 2 \+ 1\)",
     Status.INVALID_ARGUMENT),
    ("cu decreasing", dict(attn_mask_type=M.NVTE_PADDING_MASK, cu_seqlens_q=T(np.array([0, 3, 2], np.int32)),
                           cu_seqlens_kv=T(np.array([0, 1, 2], np.int32))), "must be non-decreasing",
     Status.INVALID_ARGUMENT),
    ("cu too long", dict(attn_mask_type=M.NVTE_PADDING_MASK, cu_seqlens_q=T(np.array([0, 6, 7], np.int32)),
                         cu_seqlens_kv=T(np.array([0, 1, 2], np.int32))), "more than max_seqlen 5",
     Status.INVALID_ARGUMENT),
    ("no bias", dict(bias_type=BT.NVTE_POST_SCALE_BIAS), "needs a Bias tensor", Status.INVALID_ARGUMENT),
    ("bias shape", dict(bias_type=BT.NVTE_PRE_SCALE_BIAS, Bias=T(np.zeros((2, 2, 5, 4), np.float32))),
     r"expected \[1 or 2, 1 or 2, 5, 5\]", Status.INVALID_ARGUMENT),
    ("slopes shape", dict(bias_type=BT.NVTE_ALIBI, Bias=T(np.zeros(3, np.float32))), "ALiBi slopes",
     Status.INVALID_ARGUMENT),
    ("no offset", dict(softmax_type=ST.NVTE_LEARNABLE_SOFTMAX), "needs SoftmaxOffset", Status.INVALID_ARGUMENT),
    ("no rng", dict(dropout=0.2, rng_state=None), "needs rng_state", Status.INVALID_ARGUMENT),
    ("pack size", dict(aux=[T(np.zeros((2, 2, 5, 1), np.float32))]), "expected 0 .* or 2",
     Status.INVALID_ARGUMENT),
    ("no pack", dict(aux=None), "is_training needs Aux_CTX_Tensors", Status.INVALID_ARGUMENT),
    ("stats shape", dict(aux=[T(np.zeros((2, 2, 4, 1), np.float32)), T(np.zeros(2, np.int64))]),
     r"softmax statistics\) has shape \[2, 2, 4, 1\]", Status.INVALID_ARGUMENT),
    ("O shape", dict(O=T(np.zeros((2, 5, 2, 4), np.float32))), r"O has shape .*expected \[2, 5, 2, 8\]",
     Status.INVALID_ARGUMENT),
]


@pytest.mark.parametrize("what,over,match,status", FWD_ERRORS, ids=[e[0] for e in FWD_ERRORS])
def test_forward_errors(what, over, match, status, rng):
    r = Run(Case(), rng)
    r.forward()
    over = dict(over)
    aux = over.pop("aux", "alloc")
    with pytest.raises(nvte.Error, match=match) as e:
        fwd_call(r, aux=aux, **over)
    assert e.value.args[1] == int(status)
    fwd_call(r)  # the library is still usable


def test_tensor_errors(rng):
    r = Run(Case(), rng)
    r.forward()
    f32 = lambda *s: T(np.zeros(s, np.float32))
    cases = [
        ([f32(2, 5, 16), f32(2, 5, 2, 8), f32(2, 5, 2, 8)], {}, r"Q has shape \[2, 5, 16\].*needs 4D \[b, s, h, d\]"),
        ([f32(2, 5, 2, 8), T(np.zeros((2, 5, 2, 8), np.float16)), f32(2, 5, 2, 8)], {}, "K has dtype float16 but V"),
        ([T(np.zeros((2, 5, 2, 8), np.float16)), f32(2, 5, 2, 8), f32(2, 5, 2, 8)], {},
         "Q has dtype float16 but K/V have float32"),
        ([f32(2, 5, 3, 8), f32(2, 5, 2, 8), f32(2, 5, 2, 8)], {}, "must be >= 1 and divide the Q head count"),
        ([f32(2, 5, 2, 8), f32(2, 5, 2, 4), f32(2, 5, 2, 8)], {}, "Q and K need the same head_dim_qk"),
        (separate_bs3hd(r), dict(qkv_layout=L.NVTE_BS3HD), "must be a view 64 bytes .* past Q in the packed bs3hd"),
        ([f32(2, 5, 2, 8)] * 3, dict(qkv_layout=L.NVTE_T3HD, attn_mask_type=M.NVTE_PADDING_MASK),
         r"layout t3hd needs 3D \[t, h, d\]"),
    ]
    buf = np.zeros((10, 3, 2, 8), np.float32)
    t3hd = [view(buf[:, 0], (10, 2, 8), nvte.DType.kFloat32)] + \
        [view(buf[:, r], (8, 2, 8), nvte.DType.kFloat32) for r in (1, 2)]
    cases.append((t3hd, dict(qkv_layout=L.NVTE_T3HD, attn_mask_type=M.NVTE_PADDING_MASK),
                  r"t3hd shares token rows between Q \(10\) and K/V \(8\)"))
    for tensors, over, match in cases:
        with pytest.raises(nvte.Error, match=match):
            fwd_call(r, tensors=tensors, **over)
    # FP8 inputs take the FP8 path (test_fused_attn_fp8.py), which needs their scale_inv.
    e4m3 = view(np.zeros((2, 5, 2, 8), np.uint8), (2, 5, 2, 8), nvte.DType.kFloat8E4M3)
    with pytest.raises(nvte.Error, match="Q needs its scale_inv") as e:
        fwd_call(r, tensors=[e4m3, e4m3, e4m3])
    assert e.value.args[1] == int(Status.INVALID_ARGUMENT)


def test_thd_overlap_and_bounds_errors(rng):
    r = Run(Case(layout="NVTE_THD_THD_THD", mask="padding", lens_q=[2, 2], lens_kv=[2, 2], thd_gaps=False), rng)
    r.forward()
    cu = T(np.array([0, 2, 4], np.int32))
    with pytest.raises(nvte.Error, match="makes sequences 0 and 1 overlap"):
        fwd_call(r, cu_seqlens_q=cu, cu_seqlens_q_padded=T(np.array([0, 1, 4], np.int32)))
    with pytest.raises(nvte.Error, match=r"places sequence 1 at tokens \[3, 5\) but the THD tensor has 4"):
        fwd_call(r, cu_seqlens_q=cu, cu_seqlens_q_padded=T(np.array([0, 3, 5], np.int32)))


def test_backward_errors(rng):
    r = Run(Case(bias="post", dropout=0.2), rng)
    r.forward()
    with pytest.raises(nvte.Error, match="Aux_CTX_Tensors is NULL"):
        r.backward(aux=None)
    with pytest.raises(nvte.Error, match="Aux_CTX_Tensors has 0 tensors"):
        r.backward(aux=[])
    with pytest.raises(nvte.Error, match="Aux_CTX_Tensors has 2 tensors"):
        r.backward(aux=r.aux[:2])
    bad = list(r.aux)
    bad[0] = T(np.zeros((2, 2, 5), np.float32))
    with pytest.raises(nvte.Error, match=r"softmax statistics\) must be float32|has shape \[2, 2, 5\]"):
        r.backward(aux=bad)
    r.backward()
    r.check_backward()


# ------------------------------------------------------------------ paged K/V caches (forward only)


@pytest.mark.parametrize("layout", PAGED_LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_layouts(layout, dtype, rng):
    """K, V as page caches read through separate, shuffled page tables (unused entries -1, unused
    slots NaN) against the float64 reference over the contiguous K, V."""
    run_case(Case(layout=layout, dtype=dtype, mask="padding_causal_bottom_right", b=3, sq=4, skv=7, hq=4,
                  hkv=2, page_size=3), rng, backward=False)


@pytest.mark.parametrize("mask", ["padding", "padding_causal", "padding_causal_bottom_right"])
@pytest.mark.parametrize("page_size,skv", [(1, 5), (4, 8), (5, 3)])
def test_paged_masks_and_page_sizes(mask, page_size, skv, rng):
    run_case(Case(layout="NVTE_Paged_KV_BSHD_BSHD_BSHD", mask=mask, sq=6, skv=skv, hq=2, hkv=1,
                  dqk=8, dv=6, page_size=page_size, bias="post", is_training=True), rng, backward=False)


def test_paged_decode_step(rng):
    """One new query per sequence against cached keys of different lengths (the decode step)."""
    run_case(Case(layout="NVTE_Paged_KV_BSHD_BSHD_BSHD", mask="padding_causal_bottom_right", b=4, sq=1,
                  skv=16, hq=4, hkv=1, page_size=4, lens_q=[1, 1, 0, 1], lens_kv=[16, 3, 0, 9],
                  is_training=False), rng, backward=False)


def test_paged_errors(rng):
    r = Run(Case(layout="NVTE_Paged_KV_SBHD_BSHD_BSHD", mask="padding", sq=4, skv=6, page_size=2,
                 lens_kv=[6, 3]), rng)
    r.forward()
    r.check_forward()
    tk, tv = r.tables
    cases = [
        (dict(page_table_v=None), "needs page_table_v: int32 \\[batch, pages per sequence\\]"),
        (dict(page_table_k=T(tk.astype(np.int64))), "page_table_k must be int32"),
        (dict(page_table_k=T(tk[:1])), r"page_table_k has shape \[1, 3\]; expected \[2 \(batch\)"),
        (dict(page_table_v=T(tv[:, :2])), "page_table_v has 2 pages per sequence but page_table_k 3"),
        (dict(page_table_k=T(tk[:, :2]), page_table_v=T(tv[:, :2])),
         r"max_seqlen_kv 6 exceeds what 2 pages of 2 tokens per sequence hold \(4\)"),
    ]
    bad = tk.copy()
    bad[1, 1] = 9  # sequence 1 has 3 keys: entries 0 and 1 are read; the caches hold 9 pages
    cases.append((dict(page_table_k=T(bad)), r"page_table_k\[1\]\[1\] is 9, but the K/V caches hold pages 0..8"))
    bad = tk.copy()
    bad[1, 2] = 99  # unread entry (sequence 1 uses 2 pages): ignored
    for over, match in cases:
        with pytest.raises(nvte.Error, match=match):
            fwd_call(r, **{"page_table_k": T(tk), "page_table_v": T(tv), **over})
    fwd_call(r, page_table_k=T(bad), page_table_v=T(tv))
    r.check_forward()
    with pytest.raises(nvte.Error, match=r"has no backward: paged caches are for inference") as e:
        nvte.fused_attn_bwd(*r.tq, r.o_t, r.o_t, None, None, r.aux, *r.tq, None, None, r.side()["cu_seqlens_q"],
                            r.side()["cu_seqlens_kv"], None, None, deterministic=True, cuda_graph=False,
                            **r.scalars())
    assert e.value.args[1] == int(Status.NOT_SUPPORTED)
    with pytest.raises(nvte.Error, match="has no backward"):
        nvte.fused_attn_bwd_workspace_size(*r.tq, None, **{k: v for k, v in r.scalars().items() if k != "attn_scale"})
