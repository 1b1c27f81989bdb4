"""DotProductAttention with inference_params (inference.py): the new keys and values go into the
layer's cache, then one forward-only nvte_fused_attn_fwd reads the queries and the whole cache:
layouts {bshd, sbhd, thd}_bshd_bshd, or their NVTE_Paged_KV_ forms with the page table, a padding
mask with the sequences' cached lengths (cu_seqlens_kv) and, for causal mask types, the causal
mask aligned to the bottom-right diagonal (the new tokens are each sequence's last ones), as TE
turns padding_causal into padding_causal_bottom_right under KV caching. Sliding windows are
aligned the same way.

It is the library's fused path on both backends (cuDNN's paged / decode attention on the GPU,
the float64 reference on the CPU). Where the fused path is off (NVTE_FUSED_ATTN=0) or the backend
rejects the call (on the GPU: a window without a causal mask over a paged cache or under THD
queries), the unfused path runs it: K/V gathered from the cache, the library's batched GEMM and
masked softmax (NVTE_UNFUSED_ATTN=0 turns that off too: then it raises). ALiBi runs on the unfused
path (its term aligned bottom-right, at each sequence's cached length); a bias tensor and arbitrary
masks raise; an FP8 recipe's fp8_dpa / fp8_mha leave this attention in the inputs' precision, and
dropout is not applied. The call keeps no softmax statistics, so it has no backward: inputs that
need gradients raise."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.library import custom_op

from transformer_engine import _nvte

from . import _ops
from . import attn_bias as _ab
from .attn_softmax import attn_softmax
from . import batched_matmul as _bm
from . import fused_attention as _fa
from .dpa_fused import _zero_rng_state
from .custom_ops import eager_or_op
from .inference import InferenceParams, gather_pages

L = _nvte.NVTE_QKV_Layout


LAYOUTS = {(f, paged): int(getattr(L, f"NVTE_{'Paged_KV_' if paged else ''}{f.upper()}_BSHD_BSHD"))
           for f in ("bshd", "sbhd", "thd") for paged in (False, True)}  # (query format, paged) -> layout


@custom_op("transformer_engine::fused_attn_fwd_kv_cache", mutates_args=())
def fused_attn_fwd_kv_cache(q: Tensor, k_cache: Tensor, v_cache: Tensor, page_table: Optional[Tensor],
                            cu_q: Tensor, cu_kv: Tensor, max_sq: int, max_skv: int, scale: float, layout: int,
                            mask: int, wl: int, wr: int, softmax: int = 0, offset: Optional[Tensor] = None) -> Tensor:
    """O of q over the caches (page_table: the paged layouts' table, used for K and V); softmax /
    offset: the softmax type and the learnable softmax's float32 [1, h, 1, 1] (fused_attention.py)."""
    c = _fa.AttnCfg(max_sq, max_skv, scale, 0.0, layout, _fa.BIAS_INT["no_bias"], mask, wl, wr, True, softmax)
    o = torch.empty(q.shape[:-1] + (v_cache.shape[-1],), dtype=q.dtype, device=q.device)
    qkv = (q, k_cache, v_cache)
    keep = _ops._persistent  # (caches, index buffers, rng_state: handles kept across layers and steps)
    _fa.call_fwd(c, qkv, [_fa._handle(q), keep(k_cache), keep(v_cache)], None, None, _fa._handle(o), None,
                 (cu_q, cu_kv, None, None), _zero_rng_state(q.device), False, pages=(page_table, page_table),
                 offset=offset, handle=keep)
    return o


@fused_attn_fwd_kv_cache.register_fake
def _(q, k_cache, v_cache, page_table, cu_q, cu_kv, max_sq, max_skv, scale, layout, mask, wl, wr, softmax=0,
      offset=None):
    return q.new_empty(q.shape[:-1] + (v_cache.shape[-1],))


fused_attn_fwd_kv_cache = eager_or_op(fused_attn_fwd_kv_cache)


def attend(dpa, params: InferenceParams, q: Tensor, k: Tensor, v: Tensor, fmt: str, mask_type: str, window,
           bias_type: str, bias, alibi_slopes) -> Tensor:
    """DotProductAttention.forward's result ([..., h * d_v] in q's format) for this iteration."""
    who = "DotProductAttention (inference_params)"
    if not isinstance(params, InferenceParams):
        raise TypeError(f"{who}: inference_params must be an InferenceParams, got {type(params).__name__}")
    if bias_type not in ("no_bias", "alibi") or bias is not None:
        raise NotImplementedError(f"{who}: an attention bias tensor is not implemented with a K/V cache (ALiBi is)")
    if mask_type == "arbitrary":
        raise ValueError(f"{who}: attn_mask_type 'arbitrary' cannot be used with a K/V cache (its masks are the "
                         "cached lengths, and causal ones are bottom-right aligned)")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"{who}: query/key/value dtypes differ ({q.dtype}, {k.dtype}, {v.dtype})")
    args = (dpa, params, fmt, mask_type, window, bias_type, alibi_slopes)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        # generation with autograd on (TE's own K/V-cache tests run eval() modules so): the step runs,
        # and its output refuses a backward
        return _ForwardOnly.apply(args, q, k, v)
    return _attend(*args, q, k, v)


class _ForwardOnly(torch.autograd.Function):
    """A K/V-cache step under autograd: forward as without it, no backward."""

    @staticmethod
    def forward(ctx, args, q, k, v):
        return _attend(*args, q, k, v)

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("DotProductAttention (inference_params): K/V-cache attention is forward only; its "
                           "output has no backward (the cache holds earlier steps' keys without their graph)")


def _attend(dpa, params: InferenceParams, fmt: str, mask_type: str, window, bias_type: str, alibi_slopes,
            q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """attend() after its checks."""
    who = "DotProductAttention (inference_params)"
    key = dpa.layer_number if dpa.layer_number is not None else dpa  # (TE needs layer_number; a module is as unique)
    q, k_cache, v_cache, table, cu_q, cu_kv, max_sq, max_skv, _ = params.step(key, q, k, v, fmt)
    mask = _fa.MASK_INT["padding_causal_bottom_right" if "causal" in mask_type else "padding"]
    wl, wr = window if window is not None else (-1, -1)
    layout = LAYOUTS[fmt, table is not None]
    q = q.contiguous()
    why = "NVTE_FUSED_ATTN=0" if _fa._env("NVTE_FUSED_ATTN") == "0" else ""
    if bias_type == "alibi":  # (the unfused path adds it, aligned bottom-right as the new tokens are)
        why = why or "ALiBi with a K/V cache runs unfused"
    softmax_type = dpa.softmax_type
    if not why:
        ok, why = _fa.fused_backend_supports(q, k_cache, v_cache, layout, _fa.BIAS_INT["no_bias"], mask, 0.0, False,
                                             max_sq, max_skv, int(wl), int(wr), br=True,
                                             softmax=_fa.SOFTMAX_INT[softmax_type])
    if not why:
        o = fused_attn_fwd_kv_cache(q, k_cache, v_cache, table, cu_q, cu_kv, int(max_sq), int(max_skv),
                                    float(dpa.softmax_scale), layout, mask, int(wl), int(wr),
                                    _fa.SOFTMAX_INT[softmax_type], dpa.fused_softmax_offset())
    elif _fa.unfused_allowed():
        o = _unfused(q, k_cache, v_cache, table, cu_q, cu_kv, int(max_sq), max(params.sequences.values()), fmt,
                     "causal" in mask_type, (int(wl), int(wr)), float(dpa.softmax_scale), dpa.sink_offset(q.device),
                     alibi=(alibi_slopes,) if bias_type == "alibi" else None)
    else:
        raise NotImplementedError(f"{who}: the fused attention path cannot run this call ({why}) and the unfused "
                                  "path is disabled (NVTE_UNFUSED_ATTN=0)")
    o = params.post_step(key, o)
    return o.reshape(*o.shape[:-2], -1)


def _unfused(q, k_cache, v_cache, table, cu_q, cu_kv, max_sq: int, max_kv: int, fmt: str, causal: bool, window,
             scale: float, sink: Optional[Tensor] = None, alibi=None) -> Tensor:
    """The same attention unfused: each sequence's keys and values gathered from the cache
    ([b, max_kv]), queries as [b, max_sq] rows, the library's batched GEMM and masked softmax
    (with `sink` [h], the softmax with that extra term per row: softmax_type; with alibi = (slopes
    or None,), the ALiBi term at each sequence's bottom-right diagonal); rows of no query
    (padding) come out zero, as the fused path writes them."""
    from .attention import fused_scale_mask_softmax  # (the attention package imports this module)
    b = cu_kv.numel() - 1
    dev = q.device
    if table is not None:  # pages of each sequence in order: [b, pages * page_size, h_kv, d]
        k, v = (gather_pages(c, table, b) for c in (k_cache, v_cache))
    else:
        k, v = k_cache[:b], v_cache[:b]
    k, v = k[:, :max_kv], v[:, :max_kv]
    lq, lk = (cu_q[1:] - cu_q[:-1]).long(), (cu_kv[1:] - cu_kv[:-1]).long()
    i = torch.arange(max_sq, device=dev).view(1, max_sq, 1)
    if fmt == "thd":  # [t, h, d] -> [b, max_sq, h, d] (rows past a sequence: row 0, masked below)
        rows = cu_q[:-1].long().view(b, 1) + i.view(1, max_sq)
        qb = q[torch.where(i.view(1, max_sq) < lq.view(b, 1), rows, 0)]
    else:
        qb = q if fmt == "bshd" else q.transpose(0, 1)
    j = torch.arange(max_kv, device=dev).view(1, 1, max_kv)
    diag = (lk - lq).view(b, 1, 1)  # bottom-right: query row i is token i + diag of the sequence
    hidden = (j >= lk.view(b, 1, 1)) | (i >= lq.view(b, 1, 1))
    if causal:
        hidden |= j > i + diag
    if window[0] >= 0:
        hidden |= j < i + diag - window[0]
    if window[1] >= 0:
        hidden |= j > i + diag + window[1]
    rep = qb.shape[2] // k.shape[2]
    kh, vh = (x.repeat_interleave(rep, dim=2).transpose(1, 2) for x in (k, v))  # [b, h, skv, d]
    scores = _bm.matmul(qb.transpose(1, 2), kh, y_transposed=True)  # [b, h, sq, skv], unscaled
    if alibi is None and sink is None:
        probs = fused_scale_mask_softmax(scores, "masked", scale, hidden.view(b, 1, max_sq, max_kv))
    else:  # ALiBi at each sequence's bottom-right diagonal, the sink: the library's attention softmax
        if alibi is not None:
            _ab.check_alibi_slopes(alibi[0], b, scores.shape[1])
        probs = attn_softmax(scores, scale, "alibi" if alibi is not None else "no_bias",
                             alibi_slopes=alibi[0] if alibi is not None else None,
                             alibi_diagonal=diag.view(b) if alibi is not None else None,
                             mask=hidden.view(b, 1, max_sq, max_kv), offset=sink)
    o = _bm.matmul(probs, vh).transpose(1, 2)  # [b, sq, h, dv]
    o = o * (i.view(1, max_sq, 1, 1) < lq.view(b, 1, 1, 1))  # padding rows: zero
    if fmt == "thd":
        out = q.new_zeros(q.shape[:-1] + (v.shape[-1],))
        valid = i.view(1, max_sq) < lq.view(b, 1)
        out[rows[valid]] = o[valid]
        return out
    return o if fmt == "bshd" else o.transpose(0, 1).contiguous()
