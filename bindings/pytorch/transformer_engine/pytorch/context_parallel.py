"""Context parallelism for DotProductAttention (TE's cp_group / cp_global_ranks / cp_comm_type).

Each rank of the CP group holds a slice of every sequence, in TE's load-balanced order: the
sequence is cut into 2 * cp_size equal chunks and rank r holds chunks r and 2 cp_size - 1 - r,
concatenated (so that with a causal mask every rank gets the same amount of work). Q, K and V
come in that order and the output goes out in it. The same order is what apply_rotary_pos_emb's
cp_size / cp_rank expect.

Four ways to exchange K/V (cp_comm_type), each computing the same attention:
  * "p2p": a ring. K/V blocks travel to the next rank while the current block is attended to; each
    step is one fused attention call whose output and softmax statistics (the log-sum-exp the
    library returns) are merged into the running result. The backward runs the ring again with
    the merged output and statistics, so every step sees the final softmax; the K/V gradients
    travel with their blocks back to their owners.
  * "all_gather": K/V of the whole sequence are gathered on every rank (the backward reduce-scatters
    their gradients); each local query chunk attends to the keys up to its own end with a
    bottom-right causal mask, or, with a sliding window, to the keys its window can reach.
  * "a2a" (Ulysses): two all-to-alls trade the sequence split for a head split (heads and key/value
    heads must be multiples of cp_size); every rank attends to the whole sequence for its heads,
    and the output is traded back. Sliding windows run here and with "all_gather".
  * "a2a+p2p" (hierarchical; cp_group a list [a2a group, p2p group], as TE and Megatron's
    hierarchical_context_parallel_sizes): an all-to-all inside the a2a group (size A: the ranks
    p A .. p A + A - 1 of the whole CP group) trades heads for the group's chunks, which are
    coarse chunks p and 2 P - 1 - p of the sequence cut in 2 P; the p2p ring then runs over the
    p2p group (size P: the ranks a, A + a, ..., strided), and the output is traded back. Heads and
    key/value heads must be multiples of A. THD too (the trade lands in the THD ring's layout).
All four take bshd / sbhd with no_mask or causal (self attention: equal query and key lengths
for causal); all four take THD too (context_parallel_thd.py: self attention,
cu_seqlens of the whole sequences, each a multiple of 2 cp_size long or padded to such lengths by
cu_seqlens_q_padded; windows with "a2a", and causal ones with "all_gather"). Attention sinks
(softmax_type): the ring folds the sink in as one more softmax term after its steps (and computes
the learnable offsets' gradient from its statistics), "all_gather" and "a2a" (with its heads'
offsets) in their local attention; not with FP8 nor THD "all_gather". An attention bias
(post_scale_bias, TE's [b | 1, h | 1, local queries, whole keys]) with the ring over bshd / sbhd:
each step takes its block's columns, and the bias gradient comes back in the same layout. Anything
else is a clear error.
FP8 attention (fp8_dpa, and fp8_mha's attention): the ring over bshd / sbhd
(context_parallel_fp8.py: K/V travel in FP8) and "a2a" (its local attention is the module's FP8
attention); not "all_gather", whose causal attention is two calls per rank while FP8 attention's
recipe state takes one per step. Dropout: the ring gives each step its own rng_state (the
backward reuses it), drawn in the module's get_rng_state_tracker stream when it has one (as TE);
"all_gather" and "a2a" run it inside their local attention calls. The learnable sink offsets'
gradient on each rank is that rank's part (its queries; with "a2a", its heads), summed over the
group as every other parameter's is (TE all-gathers it under "a2a").
cp_stream is accepted and unused (the ring overlaps its transfers with the attention calls on the
current stream). The ring's merge (a few torch operations on the statistics) is adapter code, as
in TE; every attention call is the library's.
"""
from __future__ import annotations

import contextlib

import functools
from typing import Callable, List, NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist

from . import dpa_fused as _df
from . import fused_attention as _fa
from .context_parallel_ring import _RingAttention, _sdim

COMM_TYPES = ("p2p", "all_gather", "a2a")
RING_TYPES = ("p2p", "a2a+p2p")  # the comm types that run the ring


class CPGroup(NamedTuple):
    group: object
    ranks: List[int]  # global ranks, in group-rank order
    size: int
    rank: int
    comm_type: str
    inner: Optional["CPGroup"] = None  # "a2a+p2p": the a2a group (A ranks) ...
    outer: Optional["CPGroup"] = None  # ... and the p2p group (P ranks); size = A P, rank = p A + a


def make_group(cp_group, cp_global_ranks: Optional[Sequence[int]], cp_comm_type: str) -> Optional[CPGroup]:
    """The CP description of a module, or None when there is no group or it has one rank."""
    if cp_group is None:
        return None
    hier = cp_comm_type == "a2a+p2p"
    if isinstance(cp_group, (list, tuple)) != hier:
        raise ValueError("DotProductAttention: cp_comm_type 'a2a+p2p' takes cp_group as a list [a2a group, p2p "
                         "group], and only it takes a list" + ("" if hier else f" (got {cp_comm_type!r})"))
    if cp_comm_type not in COMM_TYPES + ("a2a+p2p",):
        raise ValueError(f"DotProductAttention: cp_comm_type must be one of {COMM_TYPES + ('a2a+p2p',)}, "
                         f"got {cp_comm_type!r}")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("DotProductAttention: context parallelism needs torch.distributed to be initialized")
    if hier:
        return _hierarchical_group(cp_group, cp_global_ranks)
    size, rank = dist.get_world_size(cp_group), dist.get_rank(cp_group)
    ranks = [dist.get_global_rank(cp_group, i) for i in range(size)]
    if cp_global_ranks is not None and list(cp_global_ranks) != ranks:
        raise ValueError(f"DotProductAttention: cp_global_ranks {list(cp_global_ranks)} are not the ranks of "
                         f"cp_group {ranks}")
    return CPGroup(cp_group, ranks, size, rank, cp_comm_type) if size > 1 else None


def _hierarchical_group(groups, cp_global_ranks) -> Optional[CPGroup]:
    """The CP description of cp_comm_type "a2a+p2p" from [a2a group, p2p group] (module text). As
    in TE, a level of one rank drops out: the other runs alone ("p2p" or "a2a"), and with both of
    one rank there is no CP (Megatron's hierarchical sizes [1, N] / [N, 1])."""
    if len(groups) != 2:
        raise ValueError(f"DotProductAttention: cp_comm_type 'a2a+p2p' takes two groups [a2a, p2p], got {len(groups)}")
    inner, outer = (make_group(g, None, c) for g, c in zip(groups, ("a2a", "p2p")))
    if inner is None or outer is None:
        alone = inner if outer is None else outer
        if alone is not None and cp_global_ranks is not None and list(cp_global_ranks) != alone.ranks:
            raise ValueError(f"DotProductAttention: cp_global_ranks {list(cp_global_ranks)} are not the ranks of the "
                             f"CP group {alone.ranks} ('a2a+p2p' with a level of one rank)")
        return alone
    a_size, p_size = inner.size, outer.size
    rank = outer.rank * a_size + inner.rank
    me = inner.ranks[inner.rank]
    # the a2a group is the ranks p A .. p A + A - 1 of the whole group, the p2p group every A-th one
    whole = list(cp_global_ranks) if cp_global_ranks is not None else None
    ok = outer.ranks[outer.rank] == me
    if whole is not None:
        ok = ok and (len(whole) == a_size * p_size and whole[rank] == me
                     and inner.ranks == whole[outer.rank * a_size:(outer.rank + 1) * a_size]
                     and outer.ranks == whole[inner.rank::a_size])
    if not ok:
        raise ValueError(f"DotProductAttention: cp_comm_type 'a2a+p2p' needs the a2a group to be consecutive ranks "
                         f"of the CP group (cp_global_ranks) and the p2p group every A-th one; got a2a "
                         f"{inner.ranks}, p2p {outer.ranks}, cp_global_ranks {whole}")
    return CPGroup(None, whole if whole is not None else [], a_size * p_size, rank, "a2a+p2p", inner, outer)


def module_forward(dpa, q, k, v, fmt: str, mask_type: str, window, attention_mask, bias_type: str,
                   inference_params, fp8: bool, cu, bias=None) -> torch.Tensor:
    """DotProductAttention.forward under context parallelism (dpa.cp set); window: normalized;
    fp8: FP8 attention asked for; cu: (cu_seqlens_q, _kv, _q_padded, _kv_padded) as given; bias:
    core_attention_bias (post_scale_bias with "p2p": [b | 1, h | 1, local queries, whole keys])."""
    if inference_params is not None:
        raise NotImplementedError("DotProductAttention: inference_params (K/V-cache generation) with context "
                                  "parallelism is not implemented")
    cu_q, cu_kv, cu_q_pad, cu_kv_pad = cu
    if fmt == "thd":
        if cu_q is None:
            raise ValueError("DotProductAttention: qkv_format 'thd' needs cu_seqlens_q (with context parallelism: "
                             "those of the whole sequences)")
        for a, b, kv, q_name in ((cu_q, cu_kv, "cu_seqlens_kv", "cu_seqlens_q"),
                                 (cu_q_pad, cu_kv_pad, "cu_seqlens_kv_padded", "cu_seqlens_q_padded")):
            if b is not None and b is not a and (a is None or not same_values(a, b)):
                raise NotImplementedError(f"DotProductAttention: context parallelism over THD is self attention: "
                                          f"{kv} must equal {q_name}")
    elif any(t is not None for t in cu):
        raise NotImplementedError(f"DotProductAttention: context parallelism with qkv_format {fmt!r} takes no "
                                  f"cu_seqlens (padding masks are not supported there)")
    dropout = dpa.attention_dropout if dpa.training else 0.0
    check_call(dpa.cp, q, k, v, fmt, mask_type, window, bias_type, dpa.softmax_type, fp8, attention_mask,
               dpa.num_attention_heads, dpa.num_gqa_groups, dropout, bias)
    ring_fp8 = _ring_fp8_state(dpa, q, k, v) if fp8 and dpa.cp.comm_type in RING_TYPES else None

    def local(q_, k_, v_, mt, w):  # the module's own attention (THD: over the whole sequences, "a2a")
        return dpa.forward(q_, k_, v_, qkv_format=fmt, attn_mask_type=mt, window_size=w if w is not None else (-1, -1),
                           cu_seqlens_q=cu_q, cu_seqlens_kv=cu_q, cu_seqlens_q_padded=cu_q_pad,
                           cu_seqlens_kv_padded=cu_q_pad, _cp_local=True)
    sink = dpa.sink_offset(q.device)
    return attend(dpa.cp, q, k, v, fmt, mask_type, window, dpa.softmax_scale, dropout, local, cu_q, ring_fp8,
                  cu_q_pad, None if sink is None else sink.float(),
                  bias.to(q.dtype) if bias_type != "no_bias" else None, rng=dpa.dropout_rng)


_SAME = _fa.TensorMemo(8)


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors hold the same values: one host synchronization per unchanged pair
    (fused_attention.TensorMemo; a model's layers share their cu_seqlens tensors)."""
    return _SAME.get((a, b), "same", lambda: a.shape == b.shape and torch.equal(a.cpu(), b.cpu()))


def _ring_fp8_state(dpa, q, k, v):
    """(FP8 state tensors, cfg) of context_parallel_fp8.RingAttentionFP8 for this forward; prepares
    the module's FP8 state and registers it for the forward recipe step, as without CP."""
    r = _df.fp8_dpa_recipe(dpa, q.device)
    meta = dpa.fp8_meta
    grads = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    cfg = (meta.fp8_dtype("bwd"), r.amax_compute_algo, float(r.margin), grads and meta.take_bwd_seed(1))
    return (*_df._fp8_fwd_meta(dpa), meta.scale["bwd"], meta.amax_history["bwd"]), cfg


def check_call(cp: CPGroup, q, k, v, fmt: str, mask_type: str, window, bias_type: str,
               softmax_type: str, fp8: bool, attention_mask, h: int, g: int, dropout: float = 0.0,
               bias=None) -> None:
    """Raises for what context parallelism does not take (see the module text)."""
    what = f"context parallelism (cp_comm_type {cp.comm_type!r})"
    thd = fmt == "thd"
    masks = ("no_mask", "causal", "padding", "padding_causal") if thd else ("no_mask", "causal")
    if mask_type not in masks:
        raise NotImplementedError(f"DotProductAttention: {what} takes attn_mask_type {' or '.join(map(repr, masks))}"
                                  f" with qkv_format {fmt!r}, got {mask_type!r}")
    if attention_mask is not None:
        raise NotImplementedError(f"DotProductAttention: {what} takes no attention_mask")
    if window is not None and (cp.comm_type not in ("a2a", "all_gather") or
                               (thd and cp.comm_type == "all_gather" and ("causal" not in mask_type or window[1] > 0))):
        raise NotImplementedError(f"DotProductAttention: a sliding window {window} with context parallelism runs "
                                  f"with cp_comm_type 'a2a' or 'all_gather'" + (" (over THD: causal windows (left, 0))"
                                                                               if thd else ""))
    if bias_type != "no_bias" and (bias_type != "post_scale_bias" or cp.comm_type != "p2p" or thd or fp8):
        raise NotImplementedError(f"DotProductAttention: {what} takes an attention bias only as 'post_scale_bias' "
                                  f"with cp_comm_type 'p2p' over bshd / sbhd, without FP8 attention (got "
                                  f"core_attention_bias_type {bias_type!r}{', FP8' if fp8 else ''}"
                                  f"{', THD' if thd else ''}); no ALiBi")
    if softmax_type != "vanilla" and (fp8 or (thd and cp.comm_type == "all_gather")):
        raise NotImplementedError(f"DotProductAttention: {what} takes an attention sink (softmax_type "
                                  f"{softmax_type!r}) {'without FP8 attention' if fp8 else 'with bshd / sbhd'}")
    if fp8 and cp.comm_type == "all_gather":
        raise NotImplementedError(f"DotProductAttention: FP8 attention (fp8_dpa / fp8_mha) with {what} is not "
                                  f"implemented (its causal attention is two calls per rank, FP8 attention's recipe "
                                  f"state takes one per step): use 'p2p' or 'a2a'")
    if fp8 and cp.comm_type in RING_TYPES:
        if thd:
            raise NotImplementedError(f"DotProductAttention: FP8 attention with {what} takes qkv_format 'bshd' or "
                                      f"'sbhd' (the GPU's FP8 attention takes no THD); 'a2a' runs THD")
        if _fa._env("NVTE_FP8_DPA_BWD") == "0":
            raise NotImplementedError(f"DotProductAttention: NVTE_FP8_DPA_BWD=0 (a high-precision backward of FP8 "
                                      f"attention) is not implemented with {what}; 'a2a' runs it")
    sdim = _sdim(fmt)
    sq, sk = q.shape[sdim], k.shape[sdim]
    if thd:
        if sq != sk:
            raise ValueError(f"DotProductAttention: {what} over THD needs self attention (the same tokens for query "
                             f"and key/value), got {sq} and {sk} tokens")
    elif mask_type == "causal" or window is not None:
        if sq != sk:
            raise ValueError(f"DotProductAttention: {what} with a causal mask or window needs equal local query and "
                             f"key/value lengths, got {sq} and {sk}")
        if sq % 2:
            raise ValueError(f"DotProductAttention: {what} with a causal mask or window needs an even local "
                             f"sequence length (two chunks per rank), got {sq}")
    if bias_type == "post_scale_bias":
        _check_bias(bias, q.shape[0 if fmt == "bshd" else 1], h, sq, sk, cp.size, sq % 2 == 0)
    if cp.comm_type in RING_TYPES and q.is_cuda:
        # the ring runs fused attention only (it merges the steps through their softmax statistics);
        # FP8 steps with a causal mask attend over half chunks; "a2a+p2p" rings over A ranks' chunks
        n = (cp.inner.size if cp.inner is not None else 1) / (2 if fp8 and mask_type == "causal" else 1)
        ok, why = _fa.fused_backend_supports(q, k, v, _fa.LAYOUTS[fmt], _fa.BIAS_INT[bias_type],
                                             _fa.MASK_INT["padding" if thd else "no_mask"], dropout if fp8 else 0.0,
                                             True, int(sq * n), int(sk * n), -1, -1, fp8=fp8)
        if not ok:
            raise NotImplementedError(f"DotProductAttention: cp_comm_type {cp.comm_type!r} runs fused attention only, "
                                      f"which cannot "
                                      f"run these tensors{' in FP8' if fp8 else ''} ({why}); "
                                      + ("'a2a' runs the module's own FP8 attention" if fp8 else
                                         "'all_gather' and 'a2a' can fall back to the unfused path"))
    if thd and cp.comm_type == "all_gather" and q.is_cuda:  # THD runs fused attention only
        mask = "padding_causal_bottom_right" if "causal" in mask_type else "padding"
        wl = window[0] if window is not None else -1
        ok, why = _fa.fused_backend_supports(q, k, v, _fa.LAYOUTS["thd"], _fa.BIAS_INT["no_bias"], _fa.MASK_INT[mask],
                                             dropout, True, sq, sk * cp.size, wl, 0 if wl >= 0 else -1)
        if not ok:
            raise NotImplementedError(f"DotProductAttention: {what} over THD runs fused attention only, which cannot "
                                      f"run these tensors ({why})")
    a2a = cp.size if cp.comm_type == "a2a" else cp.inner.size if cp.inner is not None else None
    if a2a is not None and (h % a2a or g % a2a):
        raise ValueError(f"DotProductAttention: cp_comm_type {cp.comm_type!r} needs heads ({h}) and key/value heads "
                         f"({g}) that are multiples of its a2a group's size ({a2a})")


def _check_bias(bias, b: int, h: int, sq: int, sk: int, size: int, even: bool) -> None:
    """The ring's post_scale_bias: [b | 1, h | 1, local queries, the whole sequence's keys] (TE's)."""
    want = f"[{b} or 1, {h} or 1, {sq}, {sk * size}] (this rank's queries, every key in sequence order)"
    if bias is None:
        raise ValueError(f"DotProductAttention: core_attention_bias_type 'post_scale_bias' needs "
                         f"core_attention_bias {want}")
    if (bias.dim() != 4 or bias.shape[0] not in (1, b) or bias.shape[1] not in (1, h) or bias.shape[2] != sq
            or bias.shape[3] != sk * size):
        raise ValueError(f"DotProductAttention: with context parallelism core_attention_bias must be {want}, got "
                         f"{list(bias.shape)}")
    if not even:
        raise ValueError(f"DotProductAttention: context parallelism with an attention bias needs an even local "
                         f"sequence length (two chunks per rank), got {sq}")


def attend(cp: CPGroup, q, k, v, fmt: str, mask_type: str, window, scale: float, dropout: float,
           local: Callable, cu_seqlens=None, ring_fp8=None, cu_padded=None, sink=None, bias=None,
           rng: Callable = contextlib.nullcontext) -> torch.Tensor:
    """The attention of this rank's queries over the whole sequence, [.., h * d_v] as the module
    returns it. local(q, k, v, mask_type, window) is the module's own (non-CP) attention (with its
    dropout); dropout: the probability the ring applies (0 outside training); cu_seqlens: THD's,
    of the whole sequences (cu_padded: their padded offsets, or None); ring_fp8: (FP8 state, cfg)
    when the ring runs in FP8 (context_parallel_fp8.RingAttentionFP8); sink: the attention sink's
    float32 logits [heads] (softmax_type; the ring folds it in after its steps, local() has its own);
    bias: the post-scale bias of the "p2p" ring (_check_bias's shape); rng: the dropout RNG context
    the ring's own dropout draws in (the module's dropout_rng: its tracker's stream, as local()
    draws in it)."""
    ordered = mask_type == "causal" or window is not None
    sdim = _sdim(fmt)
    if fmt == "thd":
        from . import context_parallel_thd as _thd
        sp = _thd.split(cu_seqlens, q.shape[0], cp.size, cu_padded)
        if cp.comm_type == "a2a+p2p":  # as for bshd, with the ring's THD layout of coarse chunks
            a_size = cp.inner.size
            coarse = _thd.split(cu_seqlens, q.shape[0] * a_size, cp.outer.size, cu_padded)
            order = _thd.token_order(sp, a_size, coarse)
            qf, kf, vf = (_Trade.apply(t, cp.inner, 0, order, True).contiguous() for t in (q, k, v))
            with rng():
                o = _thd.RingAttentionTHD.apply(qf, kf, vf, cp.outer, coarse, "causal" in mask_type, float(scale),
                                                float(dropout), _inner_heads(sink, cp))
            o = _Trade.apply(o, cp.inner, 0, order, False)
            return o.reshape(o.shape[0], -1)
        if cp.comm_type == "p2p":
            with rng():
                o = _thd.RingAttentionTHD.apply(q.contiguous(), k.contiguous(), v.contiguous(), cp, sp,
                                                "causal" in mask_type, float(scale), float(dropout), sink)
            return o.reshape(o.shape[0], -1)
        order = _thd.token_order(sp, cp.size)  # the whole sequences, packed
        if cp.comm_type == "all_gather":
            kf, vf = (_GatherSeq.apply(t, cp, 0, order) for t in (k, v))
            with rng():
                o = _thd.attend_gathered(q.contiguous(), kf.contiguous(), vf.contiguous(), sp, cp.rank, cp.size,
                                         "causal" in mask_type, float(scale), float(dropout),
                                         window[0] if window is not None else -1)
            return o.reshape(o.shape[0], -1)
    elif cp.comm_type == "p2p":
        with rng():
            o = _ring(cp, q, k, v, fmt, mask_type == "causal", scale, dropout, ring_fp8, sink, bias)
        return o.reshape(*o.shape[:-2], -1)
    elif cp.comm_type == "a2a+p2p":
        # heads traded for the a2a group's chunks (coarse chunks p and 2 P - 1 - p, in sequence
        # order: the a2a group's chunk order), the ring over the p2p group, and back
        order = chunk_order(cp.inner.size) if ordered else None
        qf, kf, vf = (_Trade.apply(t, cp.inner, sdim, order, True) for t in (q, k, v))
        with rng():
            o = _ring(cp.outer, qf, kf, vf, fmt, mask_type == "causal", scale, dropout, ring_fp8,
                      _inner_heads(sink, cp))
        o = _Trade.apply(o, cp.inner, sdim, order, False)
        return o.reshape(*o.shape[:-2], -1)
    else:
        order = chunk_order(cp.size) if ordered else None
    if cp.comm_type == "all_gather":
        kf = _GatherSeq.apply(k, cp, sdim, order)
        vf = _GatherSeq.apply(v, cp, sdim, order)
        if mask_type == "no_mask" and window is None:
            return local(q, kf, vf, "no_mask", None)
        c = q.shape[sdim] // 2
        outs = []
        for half, chunk in enumerate(_chunks_of(cp.rank, cp.size)):
            lo, hi, mt, w = _gathered_keys(chunk * c, c, kf.shape[sdim], mask_type == "causal", window)
            outs.append(local(q.narrow(sdim, half * c, c), kf.narrow(sdim, lo, hi - lo), vf.narrow(sdim, lo, hi - lo),
                              mt, w))
        return torch.cat(outs, dim=sdim)
    # a2a: sequence split -> head split, attention over the whole sequence, and back
    qf, kf, vf = (_Trade.apply(t, cp, sdim, order, True) for t in (q, k, v))
    o = local(qf, kf, vf, mask_type, window)
    o = o.view(*o.shape[:-1], qf.shape[-2], -1)
    o = _Trade.apply(o, cp, sdim, order, False)
    return o.reshape(*o.shape[:-2], -1)


def _gathered_keys(start: int, c: int, s: int, causal: bool, window):
    """(lo, hi, mask type, window) of the all_gather call for the query chunk [start, start + c) of
    a sequence of s: the keys [lo, hi) it can see, and its mask and window over them. A window is
    aligned to the bottom-right diagonal, here key start - lo for the chunk's first query: with
    keys ending at the chunk's end (causal, or an unbounded right side) that is the call's own;
    otherwise the call's diagonal sits e = hi - end further, and the window shifts by e."""
    end = start + c
    wl, wr = window if window is not None else (-1, -1)
    lo = 0 if wl < 0 else max(0, start - wl)
    if causal:  # (a causal window is (left, 0))
        return lo, end, "causal_bottom_right", None if wl < 0 else (wl, 0)
    hi = s if wr < 0 else min(s, end + wr)
    e = hi - end
    return lo, hi, "no_mask", (wl + e if wl >= 0 else -1, wr - e if wr >= 0 else -1)


def _ring(cp: CPGroup, q, k, v, fmt: str, causal: bool, scale: float, dropout: float, ring_fp8, sink=None,
          bias=None):
    """The p2p ring over cp's ranks -> O [.., h, d_v] in q's dtype (FP8 attention with ring_fp8;
    sink: the attention sink's logits of these heads; bias: a post-scale bias, _check_bias's)."""
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    if ring_fp8 is not None:
        from .context_parallel_fp8 import RingAttentionFP8
        return RingAttentionFP8.apply(q, k, v, cp, fmt, causal, float(scale), float(dropout), *ring_fp8)
    return _RingAttention.apply(q, k, v, cp, fmt, causal, float(scale), float(dropout), sink, bias)


def _inner_heads(sink, cp: CPGroup):
    """"a2a+p2p": the sink logits of the heads this rank holds after the a2a group's trade."""
    if sink is None:
        return None
    n = sink.shape[0] // cp.inner.size
    return sink[cp.inner.rank * n:(cp.inner.rank + 1) * n]


# ------------------------------------------------------------------ chunk order
def _chunks_of(rank: int, size: int):
    return rank, 2 * size - 1 - rank


def _order(size: int, ordered: bool, to_natural: bool) -> Optional[torch.Tensor]:
    """The chunk permutation between rank order (rank 0's two chunks, rank 1's, ...) and sequence
    order; None when the order does not matter (no mask: attention does not see positions)."""
    if not ordered:
        return None
    rank_order = [c for r in range(size) for c in _chunks_of(r, size)]  # position i holds chunk rank_order[i]
    if to_natural:  # natural chunk n is at position rank_order.index(n)
        return torch.tensor([rank_order.index(n) for n in range(2 * size)])
    return torch.tensor(rank_order)


def _permute_chunks(t: torch.Tensor, sdim: int, perm: Optional[torch.Tensor]) -> torch.Tensor:
    if perm is None:
        return t
    n = perm.numel()
    shape = list(t.shape)
    v = t.reshape(*shape[:sdim], n, shape[sdim] // n, *shape[sdim + 1:])
    return v.index_select(sdim, perm).reshape(shape)


class ChunkOrder:
    """Between rank order and sequence order for bshd / sbhd (whole chunks). An order object has
    natural(t, dim) and ranks(t, dim); None stands for "the order does not matter". One per size
    (chunk_order), its index tensors copied to each device once (a host-to-device copy per call
    would wait for the device)."""

    def __init__(self, size: int):
        self.perms = {True: _order(size, True, True), False: _order(size, True, False)}
        self.on = {}

    def _perm(self, natural: bool, device) -> torch.Tensor:
        key = (natural, device)
        if key not in self.on:
            self.on[key] = self.perms[natural].to(device)
        return self.on[key]

    def natural(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        return _permute_chunks(t, dim, self._perm(True, t.device))

    def ranks(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        return _permute_chunks(t, dim, self._perm(False, t.device))


@functools.lru_cache(maxsize=None)
def chunk_order(size: int) -> ChunkOrder:
    return ChunkOrder(size)


def _natural(t, dim, order):
    return t if order is None else order.natural(t, dim)


def _ranks(t, dim, order):
    return t if order is None else order.ranks(t, dim)


# ------------------------------------------------------------------ collectives
def _all_gather_seq(x: torch.Tensor, cp: CPGroup, sdim: int) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(cp.size)]
    dist.all_gather(parts, x.contiguous(), group=cp.group)
    return torch.cat(parts, dim=sdim)


def _reduce_scatter_seq(g: torch.Tensor, cp: CPGroup, sdim: int) -> torch.Tensor:
    """Sum over the group of g's rank-order pieces along sdim; this rank's piece."""
    parts = [p.contiguous() for p in g.chunk(cp.size, dim=sdim)]
    if dist.get_backend(cp.group) == "gloo":  # gloo has no reduce_scatter
        whole = g.contiguous()
        dist.all_reduce(whole, group=cp.group)
        return whole.chunk(cp.size, dim=sdim)[cp.rank].contiguous()
    out = torch.empty_like(parts[0])
    dist.reduce_scatter(out, parts, group=cp.group)
    return out


def _all_to_all(pieces: torch.Tensor, cp: CPGroup) -> torch.Tensor:
    """pieces [size, ...]: piece j goes to rank j; returns [size, ...] with rank j's piece for us at j."""
    out = torch.empty_like(pieces)
    dist.all_to_all_single(out, pieces.contiguous(), group=cp.group)
    return out


def _seq_to_heads(x: torch.Tensor, cp: CPGroup, sdim: int, order) -> torch.Tensor:
    """[.., s_local, heads, d] (s at sdim) -> [.., s_whole, heads / size, d] in sequence order."""
    hd = x.dim() - 2
    pieces = torch.stack(x.chunk(cp.size, dim=hd), dim=0)  # [size, .., s_local, heads/size, d]
    got = _all_to_all(pieces, cp)  # got[j]: rank j's chunks, our heads
    whole = torch.cat(got.unbind(0), dim=sdim)
    return _natural(whole, sdim, order)


def _heads_to_seq(y: torch.Tensor, cp: CPGroup, sdim: int, order) -> torch.Tensor:
    """The inverse of _seq_to_heads."""
    y = _ranks(y, sdim, order)
    pieces = torch.stack(y.chunk(cp.size, dim=sdim), dim=0)  # piece j: rank j's chunks
    got = _all_to_all(pieces, cp)  # got[j]: our chunks, rank j's heads
    return torch.cat(got.unbind(0), dim=y.dim() - 2)


class _Trade(torch.autograd.Function):
    """The a2a trade: sequence split -> head split (to_heads) or back; the backward trades the
    other way."""

    @staticmethod
    def forward(ctx, x, cp, sdim, order, to_heads: bool):
        ctx.args = (cp, sdim, order)
        ctx.to_heads = to_heads
        return (_seq_to_heads if to_heads else _heads_to_seq)(x, cp, sdim, order)

    @staticmethod
    def backward(ctx, g):
        return (_heads_to_seq if ctx.to_heads else _seq_to_heads)(g, *ctx.args), None, None, None, None


class _GatherSeq(torch.autograd.Function):
    """All ranks' slices of K or V, in sequence order; the backward sums the gradients of each
    rank's slice over the group."""

    @staticmethod
    def forward(ctx, x, cp, sdim, order):
        ctx.args = (cp, sdim, order)
        return _natural(_all_gather_seq(x, cp, sdim), sdim, order)

    @staticmethod
    def backward(ctx, g):
        cp, sdim, order = ctx.args
        g = _ranks(g, sdim, order)
        return _reduce_scatter_seq(g, cp, sdim), None, None, None
