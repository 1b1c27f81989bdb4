"""FP8 fused attention for DotProductAttention under fp8_autocast with a recipe's fp8_dpa=True:
nvte_fused_attn_fwd / _bwd with float8_e4m3 Q, K, V (fused_attn.h, "FP8 attention"), as two
torch.library custom ops inside one autograd Function.

Quantization points and the delayed-scaling slots of DotProductAttention's FP8Meta:
  forward  (recipe's forward format, E4M3)   slot 0: Q, K and V (one scale, one amax over all
           three), slot 1: S (the softmax output), slot 2: O;
  backward (recipe's backward format: E5M2 under HYBRID, E4M3 under E4M3)   slot 0: dO,
           slot 1: dP (dS), slot 2: dQ, dK and dV (one scale, one amax).
Q, K, V and dO are cast by the library's cast (custom_ops.quantize, which max-accumulates their
amaxes); the attention calls max-accumulate the amaxes of S, O, dP and dQKV into row 0 of the
same histories, so the library's recipe step (nvte_delayed_scaling_recipe_amax_and_scale_update)
updates every scale like those of the Linear layers: the forward scales when the outermost
fp8_autocast exits, the backward scales at the start of this backward. The scale S was quantized
with is kept from the forward (the backward must rebuild the very same P~), not re-read.

The first backward (delayed scaling; FP8Meta.take_bwd_seed) does not use the initial scales: at
scale 1 the E5M2 casts of dO, dP and dQKV flush typical gradients (1e-4 and below), so the first
step's dQ/dK came out 80% wrong. It casts dO with current scaling, runs the backward twice more
to measure dP's and then dQKV's amaxes (each set from its own amax, dQKV's after dP is scaled),
and leaves those scales in bwd_scale and the amaxes in the histories; from the second backward on
it is TE's delayed scaling. Under fp8_mha dO arrives in FP8 from the output projection's dgrad.

NVTE_FP8_DPA_BWD=0 (as in TE; fp8_dpa only): the forward is the FP8 one above, the backward the
high-precision fused attention backward on the saved high-precision Q, K, V, the decoded O and
the FP8 forward's softmax statistics; the backward FP8 state is not touched. It keeps
high-precision Q, K, V and O for the backward (more memory); on an H200 it ran at 1.04-1.08x of
BF16 attention against the FP8 backward's 1.09-1.30x (benchmarks/RESULTS.md).

O and dQ/dK/dV leave the library in FP8 and are decoded to the input dtype (fp8_dpa); the FP8
copy of O is what the backward reads (D = dO . O), as in TE.

fp8_mha (MultiheadAttention; FusedAttnFP8MHAFunc): Q, K, V are not cast here but cut (byte copies)
from the FP8 hand-off (fp8_handoff.py) the QKV projection's GEMM wrote, with its scale_inv, so
slot 0 of the forward state records nothing; O stays in FP8 and leaves as a hand-off for the
output projection's GEMM. In backward dO arrives as the hand-off the output projection's dgrad
GEMM wrote (no cast: backward slot 0 records nothing), and dQ, dK, dV (one scale, so one
scale_inv) are put back (byte copies) into the layout of the QKV projection's output, as the
hand-off its backward reads.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor
from torch.library import custom_op

from transformer_engine import _nvte as _nv

from . import _ops
from . import custom_ops as ops
from . import attn_packing as _pk
from . import fused_attention as _fa
from .fp8_handoff import handoff_parts, handoff_words, new_handoff

E4M3 = int(_nv.DType.kFloat8E4M3)
SLOT_QKV, SLOT_S, SLOT_O = 0, 1, 2      # forward
SLOT_DO, SLOT_DP, SLOT_DQKV = 0, 1, 2   # backward
NUM_FWD, NUM_BWD = 3, 3
# TE's DotProductAttention keeps three GEMMs' worth of slots (9 forward, 6 backward) with Q/K/V at
# 2, O at 3, S at 8 and dQKV at 0, dO at 3, dP at 5: the columns of its checkpoints that are ours
TE_SLOTS = {"fwd": (9, {SLOT_QKV: 2, SLOT_S: 8, SLOT_O: 3}), "bwd": (6, {SLOT_DO: 3, SLOT_DP: 5, SLOT_DQKV: 0})}


def from_te_slots(state):
    """A saved FP8 state in TE's DotProductAttention slot layout ([len, 9] / [len, 6] histories and
    scales) as this module's ([len, 3] / [len, 3]); any other state as it is."""
    if not isinstance(state, dict) or "amax_history_fwd" not in state:
        return state
    if any(state[f"amax_history_{k}"].dim() != 2 or state[f"amax_history_{k}"].shape[1] != n
           or tuple(state[f"scale_{k}"].shape) != (n,) for k, (n, _) in TE_SLOTS.items()):
        return state
    out = dict(state)
    for k, (_, cols) in TE_SLOTS.items():
        idx = [cols[i] for i in range(len(cols))]
        out[f"amax_history_{k}"] = state[f"amax_history_{k}"][:, idx]
        out[f"scale_{k}"] = state[f"scale_{k}"][idx]
    return out


def _fp8(data: Optional[Tensor], fp8_dtype: int, scale_inv: Optional[Tensor] = None, scale: int = 0,
         amax: int = 0):
    """A handle: FP8 data (uint8 storage) and/or float32 [1] metadata: scale_inv a tensor, scale and
    amax addresses (0: none; slots of the module's buffers, see _ops._slot_ptr)."""
    return _ops._make(0 if data is None else data.data_ptr(), None if data is None else data.shape,
                      ops._dtype(fp8_dtype), 0 if scale_inv is None else scale_inv.data_ptr(), 0, None, scale, amax)


def _o_shape(q: Tensor, v: Tensor):
    return tuple(q.shape[:-1]) + (v.shape[-1],)


def _o_rows_cols(q: Tensor, v: Tensor) -> Tuple[int, int]:
    """O as a 2D [tokens, h * d_v] tensor (its hand-off shape)."""
    rows = 1
    for n in q.shape[:-2]:
        rows *= n
    return rows, q.shape[-2] * v.shape[-1]


def _attn_fp8_fwd(qd, kd, vd, q_si, k_si, v_si, cu, rng_state, fwd_scale, fwd_hist, o, o_si, max_sq, max_skv,
                  is_training, scale, dropout, layout, mask, wl, wr, br):
    """The forward call, writing O's bytes into o and its scale_inv into o_si -> (the S scale used,
    softmax statistics, rng_state copy)."""
    c = _fa.AttnCfg(max_sq, max_skv, scale, dropout, layout, int(_fa.BT.NVTE_NO_BIAS), mask, wl, wr, br)
    dev = qd.device
    qkv = (qd, kd, vd)
    H = [_fp8(x, E4M3, si) for x, si in zip(qkv, (q_si, k_si, v_si))]
    s_scale = fwd_scale[SLOT_S:SLOT_S + 1].clone()
    s_h = _fp8(None, E4M3, scale=s_scale.data_ptr(), amax=_ops._slot_ptr(fwd_hist, SLOT_S))
    o_h = _fp8(o, E4M3, o_si, _ops._slot_ptr(fwd_scale, SLOT_O), _ops._slot_ptr(fwd_hist, SLOT_O))
    stats = torch.empty(_fa.stats_shape(qd, layout, max_sq, cu_q=cu[0]), dtype=torch.float32, device=dev)
    rng_copy = torch.empty(_fa.rng_copy_size(dropout), dtype=torch.int64, device=dev)
    aux = [_fa._handle(stats), _fa.rng_slot(rng_copy)] if is_training else None
    _fa.call_fwd(c, qkv, H, None, s_h, o_h, aux, cu, rng_state, is_training)
    return s_scale, stats, rng_copy


# ------------------------------------------------------------------ custom ops
@custom_op("transformer_engine::fused_attn_fp8_fwd", mutates_args=("fwd_hist",))
def fused_attn_fp8_fwd(qd: Tensor, kd: Tensor, vd: Tensor, q_si: Tensor, k_si: Tensor, v_si: Tensor,
                       cu_q: Optional[Tensor], cu_kv: Optional[Tensor], cu_q_pad: Optional[Tensor],
                       cu_kv_pad: Optional[Tensor], rng_state: Tensor, fwd_scale: Tensor, fwd_hist: Tensor,
                       max_sq: int, max_skv: int, is_training: bool, scale: float, dropout: float, layout: int,
                       mask: int, wl: int, wr: int, br: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """qd, kd, vd: float8_e4m3 bytes (uint8) in the layout's shapes, with their scale_inv [1].
    Returns (O bytes (E4M3, uint8), O's scale_inv, the S scale used, softmax statistics,
    rng_state copy); S and O max-accumulate their amaxes into fwd_hist[0, 1] / [0, 2]."""
    o = torch.empty(_o_shape(qd, vd), dtype=torch.uint8, device=qd.device)
    o_si = torch.empty(1, dtype=torch.float32, device=qd.device)
    s_scale, stats, rng_copy = _attn_fp8_fwd(qd, kd, vd, q_si, k_si, v_si, (cu_q, cu_kv, cu_q_pad, cu_kv_pad),
                                             rng_state, fwd_scale, fwd_hist, o, o_si, max_sq, max_skv, is_training,
                                             scale, dropout, layout, mask, wl, wr, br)
    return o, o_si, s_scale, stats, rng_copy


@fused_attn_fp8_fwd.register_fake
def _(qd, kd, vd, q_si, k_si, v_si, cu_q, cu_kv, cu_q_pad, cu_kv_pad, rng_state, fwd_scale, fwd_hist, max_sq,
      max_skv, is_training, scale, dropout, layout, mask, wl, wr, br):
    f32 = torch.float32
    return (qd.new_empty(_o_shape(qd, vd)), q_si.new_empty(1), q_si.new_empty(1),
            q_si.new_empty(_fa.stats_shape(qd, layout, max_sq, cu_q), dtype=f32),
            qd.new_empty(_fa.rng_copy_size(dropout), dtype=torch.int64))


@custom_op("transformer_engine::fused_attn_fp8_fwd_handoff", mutates_args=("fwd_hist",))
def fused_attn_fp8_fwd_handoff(qd: Tensor, kd: Tensor, vd: Tensor, q_si: Tensor, k_si: Tensor, v_si: Tensor,
                               cu_q: Optional[Tensor], cu_kv: Optional[Tensor], cu_q_pad: Optional[Tensor],
                               cu_kv_pad: Optional[Tensor], rng_state: Tensor, fwd_scale: Tensor, fwd_hist: Tensor,
                               max_sq: int, max_skv: int, is_training: bool, scale: float, dropout: float,
                               layout: int, mask: int, wl: int, wr: int,
                               br: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """fused_attn_fp8_fwd with O (E4M3 bytes [tokens, h * d_v] and scale_inv) written into an FP8
    hand-off (fp8_handoff.py) -> (O's hand-off, the S scale used, softmax statistics, rng_state copy)."""
    rows, cols = _o_rows_cols(qd, vd)
    h = new_handoff(rows, cols, qd.device)
    o, o_si = handoff_parts(h, rows, cols)
    s_scale, stats, rng_copy = _attn_fp8_fwd(qd, kd, vd, q_si, k_si, v_si, (cu_q, cu_kv, cu_q_pad, cu_kv_pad),
                                             rng_state, fwd_scale, fwd_hist, o.view(_o_shape(qd, vd)), o_si,
                                             max_sq, max_skv, is_training, scale, dropout, layout, mask, wl, wr, br)
    return h, s_scale, stats, rng_copy


@fused_attn_fp8_fwd_handoff.register_fake
def _(qd, kd, vd, q_si, k_si, v_si, cu_q, cu_kv, cu_q_pad, cu_kv_pad, rng_state, fwd_scale, fwd_hist, max_sq,
      max_skv, is_training, scale, dropout, layout, mask, wl, wr, br):
    f32 = torch.float32
    return (q_si.new_empty(handoff_words(*_o_rows_cols(qd, vd))), q_si.new_empty(1),
            q_si.new_empty(_fa.stats_shape(qd, layout, max_sq, cu_q), dtype=f32),
            qd.new_empty(_fa.rng_copy_size(dropout), dtype=torch.int64))


def _new_grad_bytes(layout: int, qd: Tensor, kd: Tensor, vd: Tensor):
    """(the bwd op's three outputs, (dq, dk, dv) FP8 bytes to write): attn_packing's buffers for a
    packed layout; for separate Q, K, V one buffer holding dQ, dK, dV one after the other (they
    share one scale, so one decode serves all three), returned as the first output."""
    if _pk.group(layout):
        return _pk.new_grads(layout, qd, kd, vd, torch.uint8)
    buf = torch.empty(qd.numel() + kd.numel() + vd.numel(), dtype=torch.uint8, device=qd.device)
    return (buf, buf.new_empty(0), buf.new_empty(0)), _split_flat(buf, (qd, kd, vd))


def _split_flat(buf: Tensor, like) -> tuple:
    """Views of a buffer holding tensors shaped like `like` one after the other."""
    return tuple(x.view(t.shape) for x, t in zip(torch.split_with_sizes(buf, [t.numel() for t in like]), like))


def _grad_bytes(layout: int, outs, like) -> tuple:
    """(dQ, dK, dV) FP8 bytes from the bwd op's three outputs, shaped like `like`."""
    if _pk.group(layout):
        return _pk.grads_from(layout, outs, like)
    return _split_flat(outs[0], like)


@custom_op("transformer_engine::fused_attn_fp8_bwd", mutates_args=("bwd_scale", "bwd_hist"))
def fused_attn_fp8_bwd(qd: Tensor, kd: Tensor, vd: Tensor, q_si: Tensor, k_si: Tensor, v_si: Tensor, od: Tensor,
                       o_si: Tensor, dod: Tensor, do_si: Tensor, stats: Tensor, rng_copy: Tensor, s_scale: Tensor,
                       cu_q: Optional[Tensor], cu_kv: Optional[Tensor], cu_q_pad: Optional[Tensor],
                       cu_kv_pad: Optional[Tensor], bwd_scale: Tensor, bwd_hist: Tensor, max_sq: int, max_skv: int,
                       scale: float, dropout: float, layout: int, mask: int, wl: int, wr: int, br: bool,
                       bwd_dtype: int, seed: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """dO bytes (format bwd_dtype) -> (dQ, dK, dV bytes in bwd_dtype, their scale_invs); dP and
    dQKV max-accumulate their amaxes into bwd_hist[0, 1] / [0, 2]. The gradients come in
    attn_packing's three-output form for packed layouts (one packed buffer for what is packed);
    for separate Q, K, V the first output holds dQ, dK, dV one after the other (_new_grad_bytes).

    seed (the first backward of the histories, see the module doc): the scales of dP and dQKV
    come from their own amaxes, which two extra runs measure, and every backward scale
    (dO's from the amax its current-scaled cast wrote) is left in bwd_scale."""
    c = _fa.AttnCfg(max_sq, max_skv, scale, dropout, layout, int(_fa.BT.NVTE_NO_BIAS), mask, wl, wr, br)
    dev = qd.device
    qkv = (qd, kd, vd)
    H = [_fp8(x, E4M3, si) for x, si in zip(qkv, (q_si, k_si, v_si))]
    o_h = _fp8(od, E4M3, o_si)
    do_h = _fp8(dod, bwd_dtype, do_si)
    s_h = _fp8(None, E4M3, scale=s_scale.data_ptr())
    dp_h = _fp8(None, bwd_dtype, scale=_ops._slot_ptr(bwd_scale, SLOT_DP), amax=_ops._slot_ptr(bwd_hist, SLOT_DP))
    outs, grads = _new_grad_bytes(layout, qd, kd, vd)
    sis = [torch.empty(1, dtype=torch.float32, device=dev) for _ in range(3)]
    g_scale, g_amax = _ops._slot_ptr(bwd_scale, SLOT_DQKV), _ops._slot_ptr(bwd_hist, SLOT_DQKV)
    G = [_fp8(g, bwd_dtype, si, g_scale, g_amax) for g, si in zip(grads, sis)]
    aux = [_fa._handle(stats), _fa.rng_slot(rng_copy)]
    cu = (cu_q, cu_kv, cu_q_pad, cu_kv_pad)
    if seed:
        _ops.scale_from_history(dod, ops._dtype(bwd_dtype), bwd_scale, bwd_hist, SLOT_DO)
        # run 1 measures dP's amax (taken before its quantization, so exact with any scale);
        # run 2, with dP's scale, measures dQKV's (run 1's came from a flushed dS: dropped)
        for slot in (SLOT_DP, SLOT_DQKV):
            _fa.call_bwd(c, qkv, H, o_h, do_h, s_h, dp_h, aux, G, None, cu)
            if slot == SLOT_DP:
                bwd_hist[0, SLOT_DQKV] = 0.0
            _ops.scale_from_history(grads[0], ops._dtype(bwd_dtype), bwd_scale, bwd_hist, slot)
    _fa.call_bwd(c, qkv, H, o_h, do_h, s_h, dp_h, aux, G, None, cu)
    return outs[0], outs[1], outs[2], sis[0], sis[1], sis[2]


@fused_attn_fp8_bwd.register_fake
def _(qd, kd, vd, q_si, k_si, v_si, od, o_si, dod, do_si, stats, rng_copy, s_scale, cu_q, cu_kv, cu_q_pad, cu_kv_pad,
      bwd_scale, bwd_hist, max_sq, max_skv, scale, dropout, layout, mask, wl, wr, br, bwd_dtype, seed):
    sis = (q_si.new_empty(1), q_si.new_empty(1), q_si.new_empty(1))
    if not _pk.group(layout):
        n = qd.numel() + kd.numel() + vd.numel()
        return (qd.new_empty(n), qd.new_empty(0), qd.new_empty(0)) + sis
    return _pk.fake_grads(layout, qd, kd, vd, torch.uint8) + sis


# eager calls run the bodies directly (the dispatcher's custom-op path costs tens of microseconds)
fused_attn_fp8_fwd = ops.eager_or_op(fused_attn_fp8_fwd)
fused_attn_fp8_fwd_handoff = ops.eager_or_op(fused_attn_fp8_fwd_handoff)
fused_attn_fp8_bwd = ops.eager_or_op(fused_attn_fp8_bwd)


# ------------------------------------------------------------------ autograd
def _cast(x: Tensor, scale: Optional[Tensor], hist: Tensor, slot: int, fp8_dtype: int) -> Tuple[Tensor, Tensor]:
    """(FP8 bytes shaped like x, scale_inv) through the library's cast; amax into hist[0, slot].
    scale None: current scaling (the amax, written to hist[0, slot], sets the scale)."""
    data, _, si, _ = ops.quantize(x.contiguous(), scale, hist, slot, fp8_dtype, True, False, False, False, 0.0)
    return data.view(x.shape), si


def _decode(data: Tensor, si: Tensor, fp8_dtype: int, dtype: torch.dtype) -> Tensor:
    return ops.dequantize(data.view(-1, data.shape[-1]), si, fp8_dtype, dtype).view(data.shape)


def _cast_qkv(q: Tensor, k: Tensor, v: Tensor, layout: int, scale: Tensor, hist: Tensor):
    """((qd, q_si), (kd, k_si), (vd, v_si)): Q, K, V in E4M3 (one scale, one amax: forward slot 0),
    in one library call. Tensors packed in one buffer (attn_packing) are cast as that buffer."""
    g = _pk.group(layout)
    if g == 3:
        data, si = _cast(_pk.region(q, 3), scale, hist, SLOT_QKV, E4M3)
        return tuple((x, si) for x in _pk.views(data, (q, k, v)))
    # otherwise one library call casts Q and the K/V buffer, or Q, K and V, into one buffer
    parts = (q, _pk.region(k, 2)) if g == 2 else (q, k, v)
    buf, si = ops.quantize_many(list(parts), scale, hist, SLOT_QKV, E4M3)
    cast = _split_flat(buf, parts)
    if g == 2:
        return ((cast[0], si),) + tuple((x, si) for x in _pk.views(cast[1], (k, v)))
    return tuple((x, si) for x in cast)


def _decode_grads(outs, sis, like, layout: int, fp8_dtype: int, dtype: torch.dtype):
    """dQ, dK, dV in dtype from fused_attn_fp8_bwd's gradient outputs (one scale: backward slot 2),
    decoded in one call (two when only K and V are packed) and cut into views shaped like `like`."""
    g = _pk.group(layout)
    if g == 3:
        return _pk.grads_from(layout, (ops.dequantize(outs[0], sis[0], fp8_dtype, dtype),), like)
    if g == 2:
        dec = (_decode(outs[0], sis[0], fp8_dtype, dtype), ops.dequantize(outs[1], sis[1], fp8_dtype, dtype))
        return _pk.grads_from(layout, dec, like)
    dec = ops.dequantize(outs[0].view(1, -1), sis[0], fp8_dtype, dtype)  # dQ, dK, dV one after the other
    return _split_flat(dec.view(-1), like)


class FusedAttnFP8Func(torch.autograd.Function):
    """(q, k, v high precision) -> O in q's dtype, through FP8 attention. cfg: (max_sq, max_skv,
    is_training, scale, dropout, layout, mask, wl, wr, br, bwd_dtype, amax_compute_algo, margin,
    seed_bwd, f16_bwd); seed_bwd: this backward seeds the empty backward histories (module doc);
    f16_bwd (NVTE_FP8_DPA_BWD=0): the backward is the high-precision fused attention backward on
    the saved high-precision Q, K, V, the decoded O and the FP8 forward's statistics."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_kv, cu_q_pad, cu_kv_pad, rng_state, fwd_scale, fwd_hist, bwd_scale, bwd_hist,
                cfg):
        (max_sq, max_skv, is_training, scale, dropout, layout, mask, wl, wr, br, _, _, _, _, f16_bwd) = cfg
        (qd, q_si), (kd, k_si), (vd, v_si) = _cast_qkv(q, k, v, layout, fwd_scale, fwd_hist)
        od, o_si, s_scale, stats, rng_copy = fused_attn_fp8_fwd(
            qd, kd, vd, q_si, k_si, v_si, cu_q, cu_kv, cu_q_pad, cu_kv_pad, rng_state, fwd_scale, fwd_hist,
            max_sq, max_skv, is_training, scale, dropout, layout, mask, wl, wr, br)
        o = _decode(od, o_si, E4M3, q.dtype)
        if f16_bwd:
            ctx.save_for_backward(q, k, v, o, stats, rng_copy, cu_q, cu_kv, cu_q_pad, cu_kv_pad)
        else:
            ctx.save_for_backward(qd, kd, vd, q_si, k_si, v_si, od, o_si, stats, rng_copy, s_scale, cu_q, cu_kv,
                                  cu_q_pad, cu_kv_pad)
        # updated in place by the backward's recipe step: kept on ctx, not saved
        ctx.bwd_scale, ctx.bwd_hist = bwd_scale, bwd_hist
        ctx.cfg, ctx.dtype = cfg, q.dtype
        return o

    @staticmethod
    def backward(ctx, do):
        if ctx.cfg[-1]:
            return FusedAttnFP8Func._f16_backward(ctx, do)
        (qd, kd, vd, q_si, k_si, v_si, od, o_si, stats, rng_copy, s_scale, cu_q, cu_kv, cu_q_pad,
         cu_kv_pad) = ctx.saved_tensors
        (max_sq, max_skv, _, scale, dropout, layout, mask, wl, wr, br, bwd_dtype, algo, margin, seed, _) = ctx.cfg
        dtype = ctx.dtype
        do = do if do.dtype == dtype else do.to(dtype)
        ops.delayed_scaling_update(ctx.bwd_hist, ctx.bwd_scale, algo, bwd_dtype, margin)
        dod, do_si = _cast(do, None if seed else ctx.bwd_scale, ctx.bwd_hist, SLOT_DO, bwd_dtype)
        dqd, dkd, dvd, dq_si, dk_si, dv_si = fused_attn_fp8_bwd(
            qd, kd, vd, q_si, k_si, v_si, od, o_si, dod, do_si, stats, rng_copy, s_scale, cu_q, cu_kv, cu_q_pad,
            cu_kv_pad, ctx.bwd_scale, ctx.bwd_hist, max_sq, max_skv, scale, dropout, layout, mask, wl, wr, br,
            bwd_dtype, seed)
        dq, dk, dv = _decode_grads((dqd, dkd, dvd), (dq_si, dk_si, dv_si), (qd, kd, vd), layout, bwd_dtype, dtype)
        return (dq, dk, dv) + (None,) * 10

    @staticmethod
    def _f16_backward(ctx, do):
        """NVTE_FP8_DPA_BWD=0: the high-precision backward (no FP8 tensors, no backward recipe step)."""
        q, k, v, o, stats, rng_copy, cu_q, cu_kv, cu_q_pad, cu_kv_pad = ctx.saved_tensors
        (max_sq, max_skv, _, scale, dropout, layout, mask, wl, wr, br) = ctx.cfg[:10]
        do = do if do.dtype == ctx.dtype else do.to(ctx.dtype)
        dq, dk, dv, _, _ = _fa.fused_attn_bwd(q, k, v, o, do, stats, rng_copy, q.new_empty(0), cu_q, cu_kv, cu_q_pad,
                                           cu_kv_pad, max_sq, max_skv, scale, dropout, layout,
                                           int(_fa.BT.NVTE_NO_BIAS), mask, wl, wr, br, False)
        dq, dk, dv = _pk.grads_from(layout, (dq, dk, dv), (q, k, v))
        return (dq, dk, dv) + (None,) * 10


# ------------------------------------------------------------------ fp8_mha: FP8 hand-offs in and out
def split_qkv(mixed: Tensor, h: int, g: int, d: int, interleaved: bool, grouped_q: bool = False):
    """Q [.., h, d], K and V [.., g, d] of the output [.., (h + 2g) d] of a QKV projection
    (MultiheadAttention's weight row order: per GQA group [its h/g query heads | k | v] when
    interleaved, else [all q | all k | all v]). Any dtype (values, or FP8 bytes). All are views,
    except the interleaved Q with h > g, a strided view that [.., h, d] copies: grouped_q returns
    that view as [.., g, h/g, d] instead (to write into)."""
    lead = mixed.shape[:-1]
    if interleaved:
        per = h // g
        x = mixed.view(*lead, g, per + 2, d)
        q = x[..., :per, :]
        return (q if grouped_q else q.reshape(*lead, h, d)), x[..., per, :], x[..., per + 1, :]
    q, k, v = torch.split(mixed, [h * d, g * d, g * d], dim=-1)
    return q.reshape(*lead, h, d), k.reshape(*lead, g, d), v.reshape(*lead, g, d)


def split_kv(mixed: Tensor, g: int, d: int, interleaved: bool):
    """K, V [.., g, d]: views into the output [.., 2 g d] of a key/value projection (per group
    [k | v] when interleaved, else [all k | all v])."""
    lead = mixed.shape[:-1]
    if interleaved:
        x = mixed.view(*lead, g, 2, d)
        return x[..., 0, :], x[..., 1, :]
    k, v = torch.split(mixed, [g * d, g * d], dim=-1)
    return k.reshape(*lead, g, d), v.reshape(*lead, g, d)


def _rows(lead) -> int:
    n = 1
    for x in lead:
        n *= x
    return n


def _grad_handoff(rows: int, cols: int, lead, parts, scale_inv: Tensor, split) -> Tensor:
    """A hand-off [rows, cols] receiving the FP8 gradient bytes `parts` at the places `split` (the
    forward's split of the projection output) takes them from, and scale_inv."""
    h = new_handoff(rows, cols, scale_inv.device)
    data, si = handoff_parts(h, rows, cols)
    for dst, src in zip(split(data.view(*lead, cols)), parts):
        dst.copy_(src.view(dst.shape))  # (src is contiguous: any view of it is)
    si.copy_(scale_inv)
    return h


class FusedAttnFP8MHAFunc(torch.autograd.Function):
    """FP8 attention between FP8 hand-offs (recipe fp8_mha, MultiheadAttention).

    src_a: the hand-off of the QKV projection output [tokens_q, (h + 2g) d] (self attention,
    src_b None) or of the query projection [tokens_q, h d]; src_b: the key/value projection's
    [tokens_kv, 2 g d] (cross attention). Returns O's hand-off [tokens_q, h d_v] (E4M3); the
    backward takes dO's hand-off (the backward format) and returns the gradients of src_a / src_b
    as hand-offs in the backward format. cfg as in FusedAttnFP8Func; spec: (h, g, d, interleaved,
    lead_q, lead_kv), the heads, head size, weight row order and the token dimensions of the
    layout (e.g. (s, b) for sbhd)."""

    @staticmethod
    def forward(ctx, src_a, src_b, cu_q, cu_kv, cu_q_pad, cu_kv_pad, rng_state, fwd_scale, fwd_hist, bwd_scale,
                bwd_hist, cfg, spec):
        (max_sq, max_skv, is_training, scale, dropout, layout, mask, wl, wr, br, _, _, _, _, f16_bwd) = cfg
        h, g, d, inter, lead_q, lead_kv = spec
        rows_q = _rows(lead_q)
        if src_b is None:
            mixed, si = handoff_parts(src_a, rows_q, (h + 2 * g) * d)
            q, k, v = split_qkv(mixed.view(*lead_q, -1), h, g, d, inter)
            q_si = k_si = si.clone()  # (a copy: saving the view would keep all of src_a alive)
        else:
            qb, q_si = handoff_parts(src_a, rows_q, h * d)
            kvb, k_si = handoff_parts(src_b, _rows(lead_kv), 2 * g * d)
            q = qb.view(*lead_q, h, d)
            k, v = split_kv(kvb.view(*lead_kv, -1), g, d, inter)
            q_si, k_si = q_si.clone(), k_si.clone()
        qd, kd, vd = q.contiguous(), k.contiguous(), v.contiguous()  # byte copies: the layout wants them apart
        o_h, s_scale, stats, rng_copy = fused_attn_fp8_fwd_handoff(
            qd, kd, vd, q_si, k_si, k_si, cu_q, cu_kv, cu_q_pad, cu_kv_pad, rng_state, fwd_scale, fwd_hist,
            max_sq, max_skv, is_training, scale, dropout, layout, mask, wl, wr, br)
        ctx.save_for_backward(qd, kd, vd, q_si, k_si, o_h, stats, rng_copy, s_scale, cu_q, cu_kv, cu_q_pad,
                              cu_kv_pad)
        ctx.bwd_scale, ctx.bwd_hist = bwd_scale, bwd_hist  # updated in place by the backward's recipe step
        ctx.cfg, ctx.spec, ctx.cross = cfg, spec, src_b is not None
        return o_h

    @staticmethod
    def backward(ctx, do_h):
        qd, kd, vd, q_si, k_si, o_h, stats, rng_copy, s_scale, cu_q, cu_kv, cu_q_pad, cu_kv_pad = ctx.saved_tensors
        (max_sq, max_skv, _, scale, dropout, layout, mask, wl, wr, br, bwd_dtype, algo, margin, seed, _) = ctx.cfg
        h, g, d, inter, lead_q, lead_kv = ctx.spec
        ops.delayed_scaling_update(ctx.bwd_hist, ctx.bwd_scale, algo, bwd_dtype, margin)
        rows, cols = _o_rows_cols(qd, vd)
        od, o_si = handoff_parts(o_h, rows, cols)
        dod, do_si = handoff_parts(do_h.contiguous(), rows, cols)
        o_shape = _o_shape(qd, vd)
        *outs, dq_si, _, _ = fused_attn_fp8_bwd(
            qd, kd, vd, q_si, k_si, k_si, od.view(o_shape), o_si, dod.view(o_shape), do_si, stats, rng_copy,
            s_scale, cu_q, cu_kv, cu_q_pad, cu_kv_pad, ctx.bwd_scale, ctx.bwd_hist, max_sq, max_skv, scale, dropout,
            layout, mask, wl, wr, br, bwd_dtype, seed)
        dqd, dkd, dvd = _grad_bytes(layout, outs, (qd, kd, vd))
        # dQ, dK, dV share one scale (backward slot 2): one scale_inv serves the merged gradient
        rows_q = _rows(lead_q)
        if not ctx.cross:
            ga = _grad_handoff(rows_q, (h + 2 * g) * d, lead_q, (dqd, dkd, dvd), dq_si,
                               lambda t: split_qkv(t, h, g, d, inter, grouped_q=True))
            gb = None
        else:
            ga = _grad_handoff(rows_q, h * d, lead_q, (dqd,), dq_si, lambda t: (t.view(*lead_q, h, d),))
            gb = _grad_handoff(_rows(lead_kv), 2 * g * d, lead_kv, (dkd, dvd), dq_si,
                               lambda t: split_kv(t, g, d, inter))
        return (ga, gb) + (None,) * 11
