"""FP8 attention with context parallelism: the "p2p" ring under a recipe's fp8_dpa (or fp8_mha).

Q, K and V are cast to E4M3 once, with the module's forward scale (slot 0 of its FP8 state,
fused_attention_fp8.py, as without CP). K/V go round the ring in FP8 together with their
scale_inv: half the bytes of the BF16 ring, and every block is read with its owner's scale, so
ranks need not share scales (an fp8_group makes them equal, as for the other modules).
Each step is one library FP8 attention call (the step rules of context_parallel.py). Its E4M3
output is decoded to float32 and merged through the softmax statistics like the BF16 ring's.
The merged output is cast to E4M3 once more (forward slot 2, O's). That FP8 O is what the module
returns (decoded) and what every backward step reads (D = dO . O), as without CP.
The backward casts dO once (backward slot 0) and runs the ring again. Each step's FP8 dQ / dK /
dV are decoded and summed in float32; dK / dV travel home with their blocks.
The amaxes of S, O, dP and dQKV max-accumulate over the steps into the module's histories, so
its recipe step sees the maxima of the whole attention.

The first backward (FP8Meta.take_bwd_seed) seeds the backward scales as without CP, per step:
each step measures its own dP and dQKV amaxes before its final run (fused_attn_fp8_bwd's seed),
and the history then keeps the largest of the steps' dQKV amaxes.
"""
from __future__ import annotations

import torch

from . import context_parallel_ring as _cp
from . import custom_ops as ops
from . import dpa_fused as _df
from . import fused_attention as _fa
from . import fused_attention_fp8 as _fa8

E4M3 = _fa8.E4M3


def _decode(data: torch.Tensor, si: torch.Tensor, fp8_dtype: int) -> torch.Tensor:
    return _fa8._decode(data, si, fp8_dtype, torch.float32)


class RingAttentionFP8(torch.autograd.Function):
    """(q, k, v high precision, this rank's chunks) -> O in q's dtype [.., h, d_v], through FP8
    attention on the ring. meta: (forward scale, forward history, backward scale, backward history)
    of the module's FP8 state; cfg: (backward FP8 dtype, amax_compute_algo, margin, seed)."""

    @staticmethod
    def forward(ctx, q, k, v, cp, fmt: str, causal: bool, scale: float, dropout: float, meta, cfg):
        fwd_scale, fwd_hist = meta[:2]
        sdim, layout = _cp._sdim(fmt), _fa.LAYOUTS[fmt]
        c = q.shape[sdim] // 2
        (qd, q_si), (kd, k_si), (vd, _) = _fa8._cast_qkv(q, k, v, layout, fwd_scale, fwd_hist)  # one scale
        zero_rng = _df._zero_rng_state(q.device)
        rngs, out, lse, s_scale = [], None, None, None
        for step, (kb, vb, kv_si) in _cp.ring_blocks(cp, kd, vd, k_si):
            qp, kp, mask = _cp._step_parts(cp, step, causal, c)
            qs = _cp._rows(qd, sdim, qp).contiguous()
            ks, vs = (_cp._rows(t, sdim, kp).contiguous() for t in (kb, vb))
            rng = _fa.new_rng_state(q.device) if dropout > 0.0 else zero_rng
            od, o_si, s_scale, lse_i, rng_i = _fa8.fused_attn_fp8_fwd(
                qs, ks, vs, q_si, kv_si, kv_si, None, None, None, None, rng, fwd_scale, fwd_hist, qs.shape[sdim],
                ks.shape[sdim], True, scale, dropout, layout, _fa.MASK_INT[mask], -1, -1, mask == "no_mask")
            rngs.append(rng_i)
            out, lse = _cp.merge_step(out, lse, _decode(od, o_si, E4M3), lse_i, qp, fmt)
        od, o_si = _fa8._cast(out.to(q.dtype), fwd_scale, fwd_hist, _fa8.SLOT_O, E4M3)
        ctx.save_for_backward(qd, kd, vd, q_si, k_si, od, o_si, lse, s_scale, *rngs)
        ctx.bwd_meta = meta[2:]  # updated in place by the backward's recipe step: kept on ctx, not saved
        ctx.args = (cp, fmt, causal, scale, dropout, cfg, q.dtype)
        return _fa8._decode(od, o_si, E4M3, q.dtype)

    @staticmethod
    def backward(ctx, dout):
        qd, kd, vd, q_si, k_si, od, o_si, lse, s_scale, *rngs = ctx.saved_tensors
        cp, fmt, causal, scale, dropout, (bwd_dtype, algo, margin, seed), dtype = ctx.args
        bwd_scale, bwd_hist = ctx.bwd_meta
        sdim, layout = _cp._sdim(fmt), _fa.LAYOUTS[fmt]
        c = qd.shape[sdim] // 2
        ops.delayed_scaling_update(bwd_hist, bwd_scale, algo, bwd_dtype, margin)
        dod, do_si = _fa8._cast(dout.to(dtype), None if seed else bwd_scale, bwd_hist, _fa8.SLOT_DO, bwd_dtype)
        g_amax = bwd_hist[0, _fa8.SLOT_DQKV].clone() if seed else None  # the steps' largest dQKV amax
        dq, dkv = None, _cp.BlockGrads(cp, dtype)
        for step, (kb, vb, kv_si) in _cp.ring_blocks(cp, kd, vd, k_si):
            qp, kp, mask = _cp._step_parts(cp, step, causal, c)
            qs, os_, dos = (_cp._rows(t, sdim, qp).contiguous() for t in (qd, od, dod))
            ls = _cp._rows(lse, 2, qp).contiguous()
            ks, vs = (_cp._rows(t, sdim, kp).contiguous() for t in (kb, vb))
            *outs, dq_si, dk_si, dv_si = _fa8.fused_attn_fp8_bwd(
                qs, ks, vs, q_si, kv_si, kv_si, os_, o_si, dos, do_si, ls, rngs[step], s_scale, None, None, None,
                None, bwd_scale, bwd_hist, qs.shape[sdim], ks.shape[sdim], scale, dropout, layout,
                _fa.MASK_INT[mask], -1, -1, mask == "no_mask", bwd_dtype, seed)
            if seed:  # (a seeded step resets the dQKV amax before measuring its own)
                torch.maximum(g_amax, bwd_hist[0, _fa8.SLOT_DQKV], out=g_amax)
            dq_i, dk_i, dv_i = _fa8._decode_grads(outs, (dq_si, dk_si, dv_si), (qs, ks, vs), layout, bwd_dtype,
                                                  torch.float32)
            dq = _cp.add_rows(dq, dq_i, sdim, qp)
            dkv.add(dk_i, dv_i, lambda t: _cp._rows(t, sdim, kp))
        if seed:
            bwd_hist[0, _fa8.SLOT_DQKV] = g_amax
        dk, dv = dkv.result()
        return dq.to(dtype), dk.to(dtype), dv.to(dtype), None, None, None, None, None, None, None
