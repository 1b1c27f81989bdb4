"""te.DotProductAttention and te.MultiheadAttention (transformer_engine.pytorch.attention; its
submodules rope, inference, dot_product_attention and multi_head_attention give TE 2.x's import
paths for the same objects).

DotProductAttention computes softmax(scale * q k^T, masked) v on one of two paths. The fused path
(dpa_fused.py: nvte_fused_attn_fwd/bwd, high precision or FP8 under fp8_dpa) is the only one for
qkv_format "thd" and FP8 attention. On the unfused path (this file) q k^T and p v are the
library's batched GEMM (batched_matmul.py), and the softmax (with its scale and mask) is one call
into the library's fused softmax kernels (softmax.h), forward and backward, through
`_FusedSoftmaxFn`; with an attention bias, ALiBi or an attention sink, one call into the library's
attention softmax instead (attn_bias.py, attn_softmax.py).

Masks follow TE: `attention_mask` is boolean with True = masked out. For "padding" types it is a
[b, 1, 1, s] tensor (self attention) or a pair ([b, 1, 1, sq], [b, 1, 1, skv]); for "arbitrary" it
broadcasts to [b, h, sq, skv].
"""
from __future__ import annotations

import contextlib
import math
import numbers
import warnings
from typing import Callable, Optional, Tuple, Union

import torch

from .. import _ops, custom_ops
from .. import attn_bias as _ab
from .. import batched_matmul as _bm
from .. import context_parallel as _cp
from .. import dpa_fused as _df
from .. import fused_attention as _fa
from .. import fused_attention_fp8 as _fa8
from .. import kv_cache_attention as _kv
from ..distributed import checkpoint as _checkpoint
from ..fp8 import FP8Meta, fp8_autocast
from ..fp8 import _te_extra_state as te_extra_state
from ..inference import InferenceParams  # noqa: F401  (TE's te.attention.InferenceParams)
from ..rope import RotaryPositionEmbedding, apply_rotary_pos_emb  # noqa: F401  (also te.attention.*)
from ..module.base import default_device
from ..module.linear import check_kwargs

__all__ = ["DotProductAttention", "MultiheadAttention"]

MASK_TYPES = ("no_mask", "padding", "causal", "padding_causal", "causal_bottom_right",
              "padding_causal_bottom_right", "arbitrary")
MASK_ALIASES = {"padding,causal": "padding_causal", "causal,padding": "padding_causal"}  # (TE's older spellings)
QKV_FORMATS = ("sbhd", "bshd", "thd")


# ---------------------------------------------------------------- softmax
class _FusedSoftmaxFn(torch.autograd.Function):
    """y = softmax(scale * x) over the last dim with the library's fused kernels (registered ops).

    kind: "scaled" (no mask), "upper_triang" (top-left causal, square), "aligned_causal"
    (bottom-right causal), "masked" (explicit uint8 mask, 1 = masked; TE's -10000 fill)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, kind: str, scale: float, mask: Optional[torch.Tensor]):
        y = custom_ops.softmax_forward(x.contiguous(), kind, scale, mask)
        ctx.kind, ctx.scale = kind, scale
        ctx.save_for_backward(y, mask)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        y, mask = ctx.saved_tensors
        dy = dy.contiguous()
        if dy.dtype != y.dtype:
            dy = dy.to(y.dtype)
        dx = custom_ops.softmax_backward(dy, y, ctx.kind, ctx.scale)
        if ctx.kind == "masked":
            # Masked logits are replaced by a constant: their gradient is exactly zero (this matters
            # for fully masked rows, whose probabilities are uniform rather than zero).
            dx = dx.masked_fill(mask.bool(), 0.0)
        return dx, None, None, None


def fused_scale_mask_softmax(scores: torch.Tensor, kind: str, scale: float,
                             mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """scores: [b, h, sq, sk] in float32/float16/bfloat16. mask (kind "masked"): bool broadcastable
    to [b, h, sq, sk], True = masked."""
    if scores.dtype not in _ops.HIGH_PRECISION:
        raise TypeError(f"DotProductAttention: dtype {scores.dtype} is not supported by the fused softmax "
                        f"(float32, float16, bfloat16)")
    if kind != "masked":
        return _FusedSoftmaxFn.apply(scores, kind, float(scale), None)
    b, h, sq, sk = scores.shape
    if mask.dim() != 4:
        raise ValueError(f"attention mask must be 4D (broadcastable to [b, h, sq, sk]), got {tuple(mask.shape)}")
    mb, mh = mask.shape[0], mask.shape[1]
    if mb not in (1, b) or mh not in (1, h):
        raise ValueError(f"attention mask of shape {tuple(mask.shape)} does not broadcast to {(b, h, sq, sk)}")
    if mh == 1:  # the kernel's own layout: [b or 1, 1, sq, sk]
        m = mask.expand(mb, 1, sq, sk).to(torch.uint8).contiguous()
        return _FusedSoftmaxFn.apply(scores, kind, float(scale), m)
    # per-head mask: fold heads into the batch so the kernel sees [b*h, 1, sq, sk]
    m = mask.expand(b, h, sq, sk).to(torch.uint8).reshape(b * h, 1, sq, sk).contiguous()
    y = _FusedSoftmaxFn.apply(scores.reshape(b * h, 1, sq, sk), kind, float(scale), m)
    return y.view(b, h, sq, sk)


# ------------------------------------------------------------ mask helpers
# the causal rule of nvte_attn_softmax_forward for each kernel family of DotProductAttention._softmax_plan
# ("masked": the causal part, if any, is in the explicit mask)
_CAUSAL_OF_KIND = {"scaled": "no_mask", "upper_triang": "causal", "aligned_causal": "causal_bottom_right",
                   "masked": "no_mask"}


def _padding_mask(attention_mask, b: int, sq: int, sk: int) -> torch.Tensor:
    """[b, 1, sq, sk] bool from a [b, 1, 1, s] mask or a (q_mask, kv_mask) pair."""
    qm, km = _ab.split_padding_mask(attention_mask, b, sq, sk)
    return qm.reshape(b, 1, sq, 1) | km.reshape(b, 1, 1, sk)


def _check_window(window_size) -> Optional[Tuple[int, int]]:
    """window_size as a pair of ints >= -1 (-1: unbounded), or None; raises for anything else."""
    if window_size is None:
        return None
    ok = isinstance(window_size, (tuple, list)) and len(window_size) == 2
    w = tuple(int(x) for x in window_size) if ok and all(isinstance(x, numbers.Integral) for x in window_size) else None
    if w is None or min(w) < -1:
        raise ValueError(f"DotProductAttention: window_size must be a pair (left, right) of ints >= -1 "
                         f"(-1: unbounded), got {window_size!r}")
    return w


def _normalize_window(window_size, mask_type: str, te_rule: bool = True) -> Optional[Tuple[int, int]]:
    """None when no sliding window applies beyond the mask type itself. (-1, 0) is TE's spelling of
    "causal": on a causal mask type it adds nothing, and on a non-causal one TE replaces a caller's
    by (-1, -1) with a warning (a causal window is asked for with a causal mask type), so no window
    applies (te_rule=False: a window context parallelism derived for one rank's keys, kept)."""
    w = _check_window(window_size)
    if w is None:
        return None
    if w == (-1, 0) and "causal" not in mask_type and te_rule:
        warnings.warn(f"DotProductAttention: window_size (-1, 0) with attn_mask_type {mask_type!r} is treated as "
                      f"(-1, -1), as TE does: use a causal mask type for causal attention", stacklevel=3)
        return None
    if w == (-1, -1) or ("causal" in mask_type and w == (-1, 0)):
        return None
    return w


# forward arguments of TE's that cannot change a result here: flash-attention's split count (speed only)
_FORWARD_NOOPS = ("num_splits",)
# TE 2.x constructor / forward arguments of DotProductAttention outside the signatures below
# (accepted when unset)
_DPA_TE_KWARGS = frozenset(("name", "bottom_right_diagonal", "return_max_logit"))
_DPA_TE_FORWARD_KWARGS = frozenset(_FORWARD_NOOPS + (
    "bottom_right_diagonal", "fp8_output", "bf16_backward", "score_mod", "score_mod_bprop", "score_mod_tensors",
    "score_mod_bprop_tensors"))


def _top_left(brd, mask_type: str) -> bool:
    """TE's bottom_right_diagonal=False on a non-causal mask type: windows and ALiBi aligned to the
    top-left corner (query i's diagonal key is i) instead of the bottom-right one (i + skv - sq, per
    sequence under padding). The causal types fix their alignment themselves, and None means
    bottom-right for the others, as in TE."""
    return brd is not None and not bool(brd) and "causal" not in mask_type


def _check_diagonal(brd, mask_type: str, window_size, bias_type: str, equal_lengths: bool = False) -> None:
    """Raises for a top-left alignment (_top_left) where it changes the result (a window or ALiBi,
    unequal query and key lengths or padding masks) on the paths that do not implement it: context
    parallelism and K/V-cache inference."""
    if not _top_left(brd, mask_type) or (equal_lengths and "padding" not in mask_type):
        return
    w = _check_window(window_size)
    if (w is not None and w not in ((-1, -1), (-1, 0))) or bias_type == "alibi":
        raise NotImplementedError(f"DotProductAttention: bottom_right_diagonal=False (a window / ALiBi aligned to "
                                  f"the top-left corner with attn_mask_type {mask_type!r}) is not implemented for "
                                  f"context parallelism or K/V-cache inference; None or True align them bottom-right")


def _check_forward_kwargs(who: str, kwargs) -> None:
    """Raises for TE forward arguments this adapter does not implement (fp8_output, score_mod,
    bottom_right_diagonal, ...) unless they are left at None / False: ignoring them would change
    results silently. (Names TE does not know are check_kwargs' TypeError before.)"""
    on = sorted(k for k, v in kwargs.items()
                if k not in _FORWARD_NOOPS + ("bottom_right_diagonal",) and v is not None and v is not False)
    if on:
        raise NotImplementedError(f"{who}.forward: arguments not implemented in this adapter: {on}")


# ------------------------------------------------------------- DotProductAttention
class DotProductAttention(torch.nn.Module):
    """Scaled dot-product attention over [s, b, h, d] ("sbhd"), [b, s, h, d] ("bshd") or [t, h, d]
    ("thd", sequences given by cu_seqlens; see dpa_fused.py) inputs.

    Returns [s, b, h * d_v] (sbhd), [b, s, h * d_v] (bshd) or [t, h * d_v] (thd). Under
    fp8_autocast with a DelayedScaling recipe whose fp8_dpa (or fp8_mha) is True, attention runs in FP8
    (fused_attention_fp8.py) with the module's own delayed-scaling state (`fp8_meta`); called on its
    own it takes and returns high-precision tensors under fp8_mha too (MultiheadAttention hands it
    FP8 tensors).
    num_gqa_groups < heads shares each key/value head among heads / groups consecutive query
    heads. Dropout applies to the softmax probabilities in training mode. With inference_params
    (an InferenceParams) the call is one generation step over the layer's K/V cache
    (kv_cache_attention.py), keyed by layer_number."""

    def __init__(self, num_attention_heads: int, kv_channels: Union[int, Tuple[int, int]],
                 num_gqa_groups: Optional[int] = None, attention_dropout: float = 0.0, qkv_format: str = "sbhd",
                 attn_mask_type: str = "causal", window_size: Optional[Tuple[int, int]] = None,
                 sequence_parallel: bool = False, tp_size: int = 1, get_rng_state_tracker: Optional[Callable] = None,
                 tp_group=None, layer_number: Optional[int] = None, attention_type: str = "self",
                 cp_group=None, cp_global_ranks=None, cp_stream=None, cp_comm_type: str = "p2p",
                 softmax_scale: Optional[float] = None, softmax_type: str = "vanilla", **kwargs):
        super().__init__()
        check_kwargs("DotProductAttention.__init__", _DPA_TE_KWARGS, kwargs)
        if tp_size != 1:
            raise NotImplementedError(f"DotProductAttention: tensor parallelism (tp_size={tp_size}) is not implemented")
        self.name = kwargs.pop("name", None)  # (TE's debugging name)
        self.bottom_right_diagonal = kwargs.pop("bottom_right_diagonal", None)  # (_check_diagonal)
        on = [k for k, v in kwargs.items() if v]
        if on:
            raise NotImplementedError(f"DotProductAttention: options not implemented in this adapter: {on}")
        self.num_attention_heads = int(num_attention_heads)
        if isinstance(kv_channels, (tuple, list)):
            self.hidden_size_per_attention_head_k, self.hidden_size_per_attention_head_v = map(int, kv_channels)
        else:
            self.hidden_size_per_attention_head_k = self.hidden_size_per_attention_head_v = int(kv_channels)
        self.kv_channels = kv_channels
        self.num_gqa_groups = self.num_attention_heads if num_gqa_groups is None else int(num_gqa_groups)
        if self.num_gqa_groups <= 0 or self.num_attention_heads % self.num_gqa_groups:
            raise ValueError(f"DotProductAttention: num_attention_heads ({self.num_attention_heads}) must be a "
                             f"multiple of num_gqa_groups ({self.num_gqa_groups})")
        self.attention_dropout = float(attention_dropout)
        if not 0.0 <= self.attention_dropout <= 1.0:  # (TE's torch.nn.Dropout raises for these; NaN too)
            raise ValueError(f"DotProductAttention: attention_dropout must be in [0, 1], got {attention_dropout}")
        self.qkv_format = self._check_format(qkv_format)
        self.attn_mask_type = self._check_mask_type(attn_mask_type)
        self.window_size = _check_window(window_size)
        self.layer_number = layer_number
        if attention_type not in ("self", "cross"):
            raise ValueError(f"attention_type must be 'self' or 'cross', got {attention_type!r}")
        self.attention_type = attention_type
        self.softmax_scale = (1.0 / math.sqrt(self.hidden_size_per_attention_head_k) if softmax_scale is None
                              else float(softmax_scale))
        # The attention sink (TE's softmax_type): the softmax of each row gets one more term in its
        # denominator, exp(0) ("off-by-one") or exp(alpha_h) with a learnable alpha [heads] ("learnable",
        # zeros at first, as in TE); "vanilla" has none.
        if softmax_type not in _fa.SOFTMAX_INT:
            raise ValueError(f"softmax_type must be one of {list(_fa.SOFTMAX_INT)}, got {softmax_type!r}")
        self.softmax_type = softmax_type
        if softmax_type == "learnable":
            self.softmax_offset = torch.nn.Parameter(torch.zeros(self.num_attention_heads, device=default_device()))
        elif softmax_type == "off-by-one":
            self.softmax_offset = torch.zeros(self.num_attention_heads, device=default_device())
        else:
            self.softmax_offset = None
        self.sequence_parallel, self.get_rng_state_tracker, self.tp_group = (
            sequence_parallel, get_rng_state_tracker, tp_group)
        self.set_context_parallel_group(cp_group, cp_global_ranks, cp_stream, cp_comm_type)
        # delayed-scaling state of FP8 attention (fused_attention_fp8.py names the slots)
        self.fp8_meta = FP8Meta(_fa8.NUM_FWD, _fa8.NUM_BWD)
        self.fp8_meta.allocate(default_device())

    def set_context_parallel_group(self, cp_group, cp_global_ranks=None, cp_stream=None,
                                   cp_comm_type: str = "p2p") -> None:
        """Context parallelism (context_parallel.py): this rank holds chunks cp_rank and
        2 cp_size - 1 - cp_rank of every sequence; cp_comm_type "p2p", "all_gather", "a2a", or
        "a2a+p2p" with cp_group a list [a2a group, p2p group] (cp_rank = p2p rank * a2a size + a2a
        rank). cp_group None (or of one rank) turns it off; cp_stream is accepted and unused."""
        self.cp = _cp.make_group(cp_group, cp_global_ranks, cp_comm_type)
        self.cp_stream = cp_stream

    @staticmethod
    def _check_format(fmt: str) -> str:
        if fmt not in QKV_FORMATS:
            raise ValueError(f"qkv_format must be one of {QKV_FORMATS}, got {fmt!r}")
        return fmt

    @staticmethod
    def _check_mask_type(mt: str) -> str:
        mt = MASK_ALIASES.get(mt, mt)
        if mt not in MASK_TYPES:
            raise ValueError(f"attn_mask_type must be one of {MASK_TYPES}, got {mt!r}")
        return mt

    def forward(self, query_layer: torch.Tensor, key_layer: torch.Tensor, value_layer: torch.Tensor,
                attention_mask=None, qkv_format: Optional[str] = None, cu_seqlens_q=None, cu_seqlens_kv=None,
                cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None, max_seqlen_q=None, max_seqlen_kv=None,
                attn_mask_type: Optional[str] = None, window_size: Optional[Tuple[int, int]] = None,
                checkpoint_core_attention: bool = False, core_attention_bias_type: str = "no_bias",
                core_attention_bias=None, alibi_slopes=None, fast_zero_fill: bool = True,
                inference_params=None, pad_between_seqs=None, _fp8_handoff=None, _cp_local=False,
                **kwargs) -> torch.Tensor:
        """_fp8_handoff (MultiheadAttention under fp8_mha, not part of TE's API): ((src_a, src_b), spec)
        of fused_attention_fp8.FusedAttnFP8MHAFunc; query/key/value_layer are then uint8 views of the
        FP8 bytes (they give the shapes) and the result is O's FP8 hand-off. _cp_local: one rank's
        own attention inside context parallelism (context_parallel.attend)."""
        check_kwargs("DotProductAttention.forward", _DPA_TE_FORWARD_KWARGS, kwargs)
        brd = kwargs.pop("bottom_right_diagonal", None)
        brd = self.bottom_right_diagonal if brd is None else brd
        # (a rank's own call inside context parallelism: the windows CP derived are bottom-right)
        top_left = not _cp_local and _top_left(brd, attn_mask_type or self.attn_mask_type)
        if top_left and ((self.cp is not None and not _cp_local) or inference_params is not None):
            sdim = {"bshd": 1, "sbhd": 0}.get(qkv_format or self.qkv_format)
            _check_diagonal(brd, attn_mask_type or self.attn_mask_type,
                            window_size if window_size is not None else self.window_size, core_attention_bias_type,
                            inference_params is None and sdim is not None and query_layer.dim() == 4
                            and key_layer.dim() == 4 and query_layer.shape[sdim] == key_layer.shape[sdim])
        _check_forward_kwargs("DotProductAttention", kwargs)
        if checkpoint_core_attention and self._checkpointable(query_layer, key_layer, value_layer, core_attention_bias,
                                                              inference_params, _fp8_handoff, _cp_local):
            # TE's recompute of the core attention in backward: only the inputs are kept (the unfused
            # path's [b, h, sq, skv] probabilities are not); torch's RNG state and the states of the
            # module's RNG tracker are replayed (te.checkpoint), so dropout (torch's on the unfused
            # path, the library's seed drawn from torch on the fused one) repeats
            def run(q, k, v, bias):
                with fp8_autocast(enabled=False):  # (as the forward ran: outside FP8 attention)
                    return self.forward(q, k, v, attention_mask=attention_mask, qkv_format=qkv_format,
                                        cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_kv,
                                        cu_seqlens_q_padded=cu_seqlens_q_padded, cu_seqlens_kv_padded=cu_seqlens_kv_padded,
                                        max_seqlen_q=max_seqlen_q, max_seqlen_kv=max_seqlen_kv,
                                        attn_mask_type=attn_mask_type, window_size=window_size,
                                        core_attention_bias_type=core_attention_bias_type, core_attention_bias=bias,
                                        alibi_slopes=alibi_slopes, pad_between_seqs=pad_between_seqs,
                                        bottom_right_diagonal=brd)
            return _checkpoint(run, query_layer, key_layer, value_layer, core_attention_bias,
                               get_rng_state_tracker=self.get_rng_state_tracker, use_reentrant=False)
        fmt = self._check_format(qkv_format or self.qkv_format)
        mask_type = self._check_mask_type(attn_mask_type or self.attn_mask_type)
        if core_attention_bias_type not in _fa.BIASES:
            raise ValueError(f"core_attention_bias_type must be one of {list(_fa.BIASES)}, "
                             f"got {core_attention_bias_type!r}")
        if alibi_slopes is not None and core_attention_bias_type != "alibi":
            raise ValueError(f"DotProductAttention: alibi_slopes given with core_attention_bias_type "
                             f"{core_attention_bias_type!r} (they need 'alibi')")
        _ab.check_mask_dtype(attention_mask)
        if core_attention_bias is not None and core_attention_bias_type not in _ab.BIASES:
            raise ValueError(f"DotProductAttention: core_attention_bias given with core_attention_bias_type "
                             f"{core_attention_bias_type!r} (it needs 'pre_scale_bias' or 'post_scale_bias')")
        if core_attention_bias is not None and not core_attention_bias.is_floating_point():
            raise TypeError(f"DotProductAttention: core_attention_bias must be a floating-point tensor, got "
                            f"{core_attention_bias.dtype}")
        h, g = self.num_attention_heads, self.num_gqa_groups
        # the heads of this call's sink offsets (None: all); (set through __dict__: nn.Module's
        # __setattr__ costs microseconds per call, and this runs in every decode step)
        self.__dict__["_sink_heads"] = None
        if _cp_local and self.cp is not None and self.cp.comm_type == "a2a":  # this rank's share of the heads
            h, g = h // self.cp.size, g // self.cp.size
            self._sink_heads = slice(self.cp.rank * h, (self.cp.rank + 1) * h)
        _df.check_qkv(query_layer, key_layer, value_layer, fmt, h, g, self.hidden_size_per_attention_head_k,
                      self.hidden_size_per_attention_head_v)
        cb = core_attention_bias
        if cb is not None and cb.dim() == 4 and cb.shape[2] == 1 and fmt != "thd":
            # a bias shared by every query ([1 or b, 1 or h, 1, skv]; TE's "111s"): broadcast over the
            # queries as a view (its gradient is summed over them by autograd)
            sq = query_layer.shape[0 if fmt == "sbhd" else 1]
            core_attention_bias = cb.expand(cb.shape[0], cb.shape[1], sq, cb.shape[3])
        if self.cp is not None and not _cp_local:
            return self._context_parallel(query_layer, key_layer, value_layer, fmt, mask_type, window_size,
                                          attention_mask, core_attention_bias_type, inference_params, _fp8_handoff,
                                          (cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded),
                                          core_attention_bias)
        if inference_params is not None:
            if _fp8_handoff is not None:
                raise RuntimeError("DotProductAttention: inference_params takes high-precision inputs, "
                                   "not FP8 hand-offs")
            window = _normalize_window(window_size if window_size is not None else self.window_size, mask_type)
            return _kv.attend(self, inference_params, query_layer, key_layer, value_layer, fmt, mask_type, window,
                              core_attention_bias_type, core_attention_bias, alibi_slopes)
        if fmt == "thd":
            mask_type = _df.thd_mask_type(mask_type)
        window = _normalize_window(window_size if window_size is not None else self.window_size, mask_type,
                                   te_rule=not _cp_local)
        seq = _df.sequences(fmt, mask_type, query_layer, key_layer, cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded,
                            cu_seqlens_kv_padded, max_seqlen_q, max_seqlen_kv)
        if seq is not None and fmt != "thd":  # cu_seqlens describe the padding (for the unfused path too)
            attention_mask = _df.padding_masks(seq)
        cb = core_attention_bias
        if fmt == "thd" and cb is not None and cb.dim() == 4 and cb.shape[2] == 1 and seq is not None:
            # (THD's bias is [1 or b, 1 or h, max_seqlen_q, max_seqlen_kv]: "111s" broadcast as above)
            core_attention_bias = cb.expand(cb.shape[0], cb.shape[1], seq.max_sq, cb.shape[3])
        fp8 = _df.fp8_dpa_recipe(self, query_layer.device)
        if _fp8_handoff is not None and fp8 is None:
            raise RuntimeError("DotProductAttention: FP8 hand-offs need fp8_autocast with a recipe whose fp8_mha is True")
        fused = _df.run_fused(self, query_layer, key_layer, value_layer, fmt, mask_type, window, attention_mask,
                              core_attention_bias_type, core_attention_bias, alibi_slopes, seq, fp8, _fp8_handoff,
                              top_left=top_left)
        if fused is not None:
            return fused
        # Unfused path -> [b, h, s, d]
        perm = (1, 2, 0, 3) if fmt == "sbhd" else (0, 2, 1, 3)
        q, k, v = (t.permute(*perm) for t in (query_layer, key_layer, value_layer))
        b, _, sq, _ = q.shape
        sk = k.shape[2]
        if k.shape[0] != b or v.shape[0] != b or v.shape[2] != sk:
            raise ValueError("DotProductAttention: query/key/value batch or key/value sequence sizes differ")
        if g != h:
            rep = h // g
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        scores = _bm.matmul(q, k, y_transposed=True)  # [b, h, sq, sk], unscaled (the library's GEMM)
        if core_attention_bias_type == "no_bias" and self.softmax_type == "vanilla":
            kind, mask = self._softmax_plan(mask_type, attention_mask, window, b, sq, sk, scores.device, top_left)
            probs = fused_scale_mask_softmax(scores, kind, self.softmax_scale, mask)
        else:  # the library's attention softmax: bias / ALiBi / sink applied there
            if mask_type == "causal" and window is None:  # (top-left at any sq, sk: its rule, not a mask)
                kind, mask = "upper_triang", None
            else:
                kind, mask = self._softmax_plan(mask_type, attention_mask, window, b, sq, sk, scores.device,
                                                top_left)
            probs = _ab.biased_softmax(scores, self.softmax_scale, core_attention_bias_type, core_attention_bias,
                                       alibi_slopes, mask_type, attention_mask, mask, _CAUSAL_OF_KIND[kind],
                                       self.sink_offset(scores.device), top_left)
        if self.training and self.attention_dropout > 0.0:
            with self.dropout_rng():
                probs = torch.nn.functional.dropout(probs, p=self.attention_dropout, training=True)
        ctx = _bm.matmul(probs, v)  # [b, h, sq, dv]
        if fmt == "sbhd":
            ctx = ctx.permute(2, 0, 1, 3)
        else:
            ctx = ctx.permute(0, 2, 1, 3)
        return ctx.reshape(ctx.shape[0], ctx.shape[1], -1)

    def _checkpointable(self, q, k, v, bias, inference_params, handoff, cp_local) -> bool:
        """Whether checkpoint_core_attention recomputes this call: a call that builds a graph, outside
        FP8 attention (whose recipe state a second forward would advance), context parallelism and
        K/V-cache inference; elsewhere the flag changes memory only, so it is then left unused."""
        grads = _df.needs_grad(self, q, k, v, bias)
        return (grads and inference_params is None and handoff is None and not cp_local and self.cp is None
                and not _df.fp8_attention_on())

    def _context_parallel(self, q, k, v, fmt, mask_type, window_size, attention_mask, bias_type, inference_params,
                          handoff, cu, bias=None):
        window = _normalize_window(window_size if window_size is not None else self.window_size, mask_type)
        return _cp.module_forward(self, q, k, v, fmt, mask_type, window, attention_mask, bias_type, inference_params,
                                  handoff is not None or _df.fp8_attention_on(), cu, bias)

    def dropout_rng(self):
        """The RNG context of attention dropout: get_rng_state_tracker().fork() when the module was
        given a tracker (TE's, for Megatron's model-parallel RNG stream), else none (torch's
        default generator). Both paths draw in it: the unfused path's dropout, the fused path's
        seed."""
        if self.get_rng_state_tracker is None:
            return contextlib.nullcontext()
        return self.get_rng_state_tracker().fork()

    def sink_offset(self, device) -> Optional[torch.Tensor]:
        """The per-head sink logits [heads] of softmax_type (zeros for "off-by-one"), None for "vanilla";
        inside "a2a" context parallelism, those of this rank's heads."""
        heads = getattr(self, "_sink_heads", None) or slice(None)
        if self.softmax_type == "learnable":
            return self.softmax_offset[heads]
        if self.softmax_type == "off-by-one":  # the module's zeros, made again only on another device
            if self.softmax_offset.device != torch.device(device):
                self.softmax_offset = torch.zeros(self.num_attention_heads, device=device)
            return self.softmax_offset[heads]
        return None

    def fused_softmax_offset(self) -> Optional[torch.Tensor]:
        """The library's SoftmaxOffset: the learnable offsets as float32 [1, heads, 1, 1] (a view of
        the parameter when it is float32, so its gradient lands there), None otherwise."""
        off = self.sink_offset(None) if self.softmax_type == "learnable" else None
        return off.float().view(1, -1, 1, 1) if off is not None else None

    def _fused(self, q, k, v, fmt, mask_type, window, attention_mask, bias_type, bias, alibi_slopes, seq=None,
               fp8=None):
        """The fused attention path (dpa_fused.run_fused), or None when the unfused path should run;
        raises when neither path can run the call."""
        return _df.run_fused(self, q, k, v, fmt, mask_type, window, attention_mask, bias_type, bias, alibi_slopes,
                             seq, fp8)

    # FP8 attention state (fp8_dpa): TE's `_extra_state` entry, as the other modules keep it
    def get_extra_state(self):
        return self.fp8_meta.state()

    def set_extra_state(self, state) -> None:
        """Our state, or TE's `_extra_state` (its pickled bytes; its slot layout mapped to ours)."""
        if isinstance(state, torch.Tensor):
            state = te_extra_state(state)
        h = self.fp8_meta.amax_history.get("fwd")
        self.fp8_meta.load(_fa8.from_te_slots(state), h.device if h is not None else default_device())

    @staticmethod
    def _softmax_plan(mask_type, attention_mask, window, b, sq, sk, device, top_left: bool = False):
        """(softmax kernel family, bool mask or None) for this mask type (top_left: _top_left)."""
        if window is None:
            if mask_type == "no_mask":
                return "scaled", None
            if mask_type == "causal" and sq == sk:
                return "upper_triang", None
            if mask_type == "causal_bottom_right" or (mask_type == "causal" and sq == sk):
                return "aligned_causal", None
        mask = None
        if "padding" in mask_type:
            mask = _padding_mask(attention_mask, b, sq, sk)
        elif mask_type == "arbitrary":
            if attention_mask is None:
                raise ValueError("attn_mask_type 'arbitrary' needs attention_mask (bool, True = masked out)")
            mask = attention_mask.bool()
            if mask.dim() == 2:
                mask = mask.view(1, 1, *mask.shape)
        if "causal" in mask_type or window is not None:
            # key j is after query i's diagonal key when j > i + offset; a window keeps
            # [i + offset - left, i + offset + right] (-1: unbounded)
            off = _ab.mask_diagonal(mask_type, attention_mask, b, sq, sk, device, top_left).view(-1, 1, 1, 1)
            i = torch.arange(sq, device=device).view(1, 1, sq, 1) + off
            j = torch.arange(sk, device=device).view(1, 1, 1, sk)
            hidden = [j > i] if "causal" in mask_type else []
            if window is not None and window[0] >= 0:
                hidden.append(j < i - window[0])
            if window is not None and window[1] >= 0:
                hidden.append(j > i + window[1])
            for c in hidden:
                mask = c if mask is None else (mask | c)
        if mask is None:
            return "scaled", None
        return "masked", mask.to(device)


from .multi_head_attention import MultiheadAttention  # noqa: E402  (it builds on DotProductAttention)
