"""The attention bias of DotProductAttention's unfused path: core_attention_bias ("pre_scale_bias",
"post_scale_bias") and ALiBi folded into the score matrix before the library's softmax, with the
fused path's conventions (fused_attn.h), so that a call gives the same result on either path:

- pre_scale_bias: softmax(scale * (Q K^T + bias)); post_scale_bias: softmax(scale * Q K^T + bias);
  bias [1 or b, 1 or h, sq, skv] (or [h, sq, skv]), its gradient from autograd.
- alibi: post-scale, -slope[h] * |i + diag - j| with slopes [h] or [b, h] (TE's default slopes when
  none are given); diag = len_kv - len_q of each sequence (its padding-mask lengths) when aligned
  bottom-right, as every mask type but "causal" / "padding_causal" is, and 0 otherwise.

The fused path is the one the library runs for these (cuDNN on the GPU); this one runs what it
rejects: NVTE_FUSED_ATTN=0, "arbitrary" masks, ALiBi with caller-given slopes on the GPU, dtypes
cuDNN does not take."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

BIASES = ("pre_scale_bias", "post_scale_bias")


def default_alibi_slopes(heads: int, device) -> torch.Tensor:
    """float32 [heads]: TE's default ALiBi slopes (the library's default_alibi_slope): with n the
    largest power of two <= heads, 2^(-8 k / n) for k = 1..n, then 2^(-4 m / n) for the odd m
    1, 3, ... over the remaining heads."""
    n = 1 << (heads.bit_length() - 1)
    k = torch.arange(1, n + 1, dtype=torch.float64)
    slopes = torch.exp2(-8.0 * k / n)
    if n < heads:
        m = torch.arange(1, 2 * (heads - n), 2, dtype=torch.float64)
        slopes = torch.cat([slopes, torch.exp2(-4.0 * m / n)])
    return slopes.to(device=device, dtype=torch.float32)


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


def alibi_diagonal(mask_type: str, attention_mask, b: int, sq: int, sk: int, device) -> torch.Tensor:
    """int64 [1 or b]: the diagonal offset of ALiBi's distances (module docstring)."""
    if "causal" in mask_type and not mask_type.endswith("bottom_right"):
        return torch.zeros(1, dtype=torch.int64, device=device)
    if "padding" in mask_type and attention_mask is not None:
        lq, lk = mask_lengths(attention_mask, b, sq, sk, device)
        return lk - lq
    return torch.full((1,), sk - sq, dtype=torch.int64, device=device)


def alibi_bias(slopes: Optional[torch.Tensor], heads: int, b: int, sq: int, sk: int, diag: torch.Tensor,
               device) -> torch.Tensor:
    """float32 [1 or b, heads, sq, sk]: -slope * |i + diag - j|, diag [1 or b] (alibi_diagonal; a K/V
    cache's: each sequence's cached minus new tokens)."""
    if slopes is None:
        slopes = default_alibi_slopes(heads, device)
    slopes = slopes.to(device=device, dtype=torch.float32)
    if slopes.shape not in ((heads,), (b, heads)):
        raise ValueError(f"alibi_slopes must be [heads] or [batch, heads] = [{heads}] or [{b}, {heads}], got "
                         f"{tuple(slopes.shape)}")
    slopes = slopes.reshape(-1, heads)
    i = torch.arange(sq, device=device).view(1, sq, 1)
    j = torch.arange(sk, device=device).view(1, 1, sk)
    dist = (i + diag.view(-1, 1, 1) - j).abs().float()  # [1 or b, sq, sk]
    return -slopes.view(-1, heads, 1, 1) * dist.unsqueeze(1)


def _check_bias(bias: torch.Tensor, b: int, h: int, sq: int, sk: int) -> torch.Tensor:
    if not bias.is_floating_point():
        raise TypeError(f"core_attention_bias must be a floating-point tensor, got {bias.dtype}")
    t = bias if bias.dim() == 4 else (bias.view(1, *bias.shape) if bias.dim() == 3 else None)
    if t is None or t.shape[0] not in (1, b) or t.shape[1] not in (1, h) or tuple(t.shape[2:]) != (sq, sk):
        raise ValueError(f"core_attention_bias must be [1 or b, 1 or h, sq, skv] = [1 or {b}, 1 or {h}, {sq}, {sk}], "
                         f"got {tuple(bias.shape)}")
    return t


def biased_scores(scores: torch.Tensor, scale: float, bias_type: str, bias: Optional[torch.Tensor],
                  alibi_slopes: Optional[torch.Tensor], mask_type: str, attention_mask) -> Tuple[torch.Tensor, float]:
    """(scores with the bias folded in, the scale the softmax still applies) for unscaled scores
    Q K^T [b, h, sq, sk]; the sum is taken in float32 and returned in the scores' dtype."""
    if bias_type == "no_bias":
        return scores, scale
    b, h, sq, sk = scores.shape
    if bias_type in BIASES:
        if bias is None:
            raise ValueError(f"core_attention_bias_type {bias_type!r} needs core_attention_bias")
        t = _check_bias(bias, b, h, sq, sk).float()
        z = scores.float() + t if bias_type == "pre_scale_bias" else scores.float() * scale + t
        return z.to(scores.dtype), (scale if bias_type == "pre_scale_bias" else 1.0)
    if bias_type == "alibi":
        diag = alibi_diagonal(mask_type, attention_mask, b, sq, sk, scores.device)
        return add_alibi(scores, scale, alibi_slopes, diag), 1.0
    raise ValueError(f"unknown core_attention_bias_type {bias_type!r}")


def add_alibi(scores: torch.Tensor, scale: float, slopes: Optional[torch.Tensor], diag: torch.Tensor) -> torch.Tensor:
    """scale * scores + the ALiBi term (float32 sum, the scores' dtype out); scores [b, h, sq, sk]."""
    b, h, sq, sk = scores.shape
    return (scores.float() * scale + alibi_bias(slopes, h, b, sq, sk, diag, scores.device)).to(scores.dtype)
