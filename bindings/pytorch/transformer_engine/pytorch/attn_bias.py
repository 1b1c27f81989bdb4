"""The attention bias of DotProductAttention's unfused path: core_attention_bias ("pre_scale_bias",
"post_scale_bias") and ALiBi, checked here and handed with the softmax's mask to the library's
attention softmax (attn_softmax.py, nvte_attn_softmax_forward), which applies them with the fused
path's conventions (fused_attn.h), so that a call gives the same result on either path:

- pre_scale_bias: softmax(scale * (Q K^T + bias)); post_scale_bias: softmax(scale * Q K^T + bias);
  bias [1 or b, 1 or h, sq, skv] (or [h, sq, skv]), its gradient through autograd.
- alibi: post-scale, -slope[h] * |i + diag - j| with slopes [h] or [b, h] (TE's default slopes when
  none are given); diag = len_kv - len_q of each sequence (its padding-mask lengths) when aligned
  bottom-right, as every mask type but "causal" / "padding_causal" is, and 0 otherwise.

The fused path is the one the library runs for these (cuDNN on the GPU); this one runs what it
rejects: NVTE_FUSED_ATTN=0, "arbitrary" masks, ALiBi with caller-given slopes on the GPU, dtypes
cuDNN does not take."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .attn_softmax import attn_softmax

BIASES = ("pre_scale_bias", "post_scale_bias")


def check_mask_dtype(attention_mask) -> None:
    """attention_mask (a tensor or a (q, kv) pair) must be bool, True = masked out, as TE requires: an
    integer or float "keep" mask (1 = token, HuggingFace's convention) would be read inverted."""
    masks = attention_mask if isinstance(attention_mask, (tuple, list)) else (attention_mask,)
    for m in masks:
        if isinstance(m, torch.Tensor) and m.dtype != torch.bool:
            raise TypeError(f"attention_mask must be a bool tensor (True = masked out), got {m.dtype}; a mask "
                            f"with 1 for the tokens to keep is ~mask.bool()")


def split_padding_mask(attention_mask, b: int, sq: int, sk: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(query mask, key/value mask), bool, of a padding attention_mask: one [b, 1, 1, s] tensor
    (self attention) or a (q_mask, kv_mask) pair (True = padded); their sizes checked."""
    if attention_mask is None:
        raise ValueError("padding mask types need attention_mask ([b, 1, 1, s] bool, True = padded)")
    if isinstance(attention_mask, (tuple, list)):
        if len(attention_mask) != 2:
            raise ValueError("a padding attention_mask pair must be (q_mask, kv_mask)")
        qm, km = attention_mask
    else:
        qm = km = attention_mask
    qm, km = qm.bool(), km.bool()
    if qm.numel() != b * sq or km.numel() != b * sk:
        raise ValueError(f"padding masks must be [b, 1, 1, s]: got {tuple(qm.shape)} / {tuple(km.shape)} for "
                         f"b={b}, sq={sq}, skv={sk}")
    return qm, km


def mask_lengths(attention_mask, b: int, sq: int, sk: int, device) -> Tuple[torch.Tensor, torch.Tensor]:
    """int64 [b] query and key/value lengths of a padding mask (split_padding_mask's forms)."""
    qm, km = split_padding_mask(attention_mask, b, sq, sk)
    return (~qm.reshape(b, sq)).sum(1).to(device), (~km.reshape(b, sk)).sum(1).to(device)


def mask_diagonal(mask_type: str, attention_mask, b: int, sq: int, sk: int, device,
                  top_left: bool = False) -> torch.Tensor:
    """int64 [1 or b]: the offset of the diagonal that a causal mask, a sliding window and ALiBi's
    distances are aligned to (query i's diagonal key is i + offset), as TE aligns them: top-left
    (0) for causal and padding_causal and where bottom_right_diagonal=False asks it (top_left),
    bottom-right for every other mask type, at each sequence's own lengths under padding masks."""
    if top_left or ("causal" in mask_type and not mask_type.endswith("bottom_right")):
        return torch.zeros(1, dtype=torch.int64, device=device)
    if "padding" in mask_type and attention_mask is not None:
        lq, lk = mask_lengths(attention_mask, b, sq, sk, device)
        return lk - lq
    return torch.full((1,), sk - sq, dtype=torch.int64, device=device)


def check_alibi_slopes(slopes: Optional[torch.Tensor], b: int, heads: int) -> None:
    """Raises unless slopes (when given) are [heads] or [b, heads] ([1, heads] is [b, heads] only at b = 1)."""
    if slopes is not None and tuple(slopes.shape) not in ((heads,), (b, heads)):
        raise ValueError(f"alibi_slopes must be [heads] or [batch, heads] = [{heads}] or [{b}, {heads}], got "
                         f"{tuple(slopes.shape)}")


def check_bias(bias: torch.Tensor, b: int, h: int, sq: int, sk: int) -> torch.Tensor:
    """The bias as [1 or b, 1 or h, sq, sk] (a [h, sq, sk] one viewed so); raises for other shapes and non-float dtypes."""
    if not bias.is_floating_point():
        raise TypeError(f"core_attention_bias must be a floating-point tensor, got {bias.dtype}")
    t = bias if bias.dim() == 4 else (bias.view(1, *bias.shape) if bias.dim() == 3 else None)
    if t is None or t.shape[0] not in (1, b) or t.shape[1] not in (1, h) or tuple(t.shape[2:]) != (sq, sk):
        raise ValueError(f"core_attention_bias must be [1 or b, 1 or h, sq, skv] = [1 or {b}, 1 or {h}, {sq}, {sk}], "
                         f"got {tuple(bias.shape)}")
    return t


def biased_softmax(scores: torch.Tensor, scale: float, bias_type: str, bias: Optional[torch.Tensor],
                   alibi_slopes: Optional[torch.Tensor], mask_type: str, attention_mask, softmax_mask,
                   causal: str, offset: Optional[torch.Tensor], top_left: bool = False) -> torch.Tensor:
    """The probabilities of the unscaled scores Q K^T [b, h, sq, sk] with the bias (checked here)
    or ALiBi (its diagonal from mask_type and the padding lengths), the softmax's mask (bool or
    None, True = hidden) and causal rule, and the sink logits `offset`: one library call
    (attn_softmax.py)."""
    b, h, sq, sk = scores.shape
    diag = None
    if bias_type in BIASES:
        if bias is None:
            raise ValueError(f"core_attention_bias_type {bias_type!r} needs core_attention_bias")
        bias = check_bias(bias, b, h, sq, sk)
    elif bias_type == "alibi":
        check_alibi_slopes(alibi_slopes, b, h)
        diag = mask_diagonal(mask_type, attention_mask, b, sq, sk, scores.device, top_left)
    return attn_softmax(scores, scale, bias_type, bias, alibi_slopes, diag, softmax_mask, causal, offset)
