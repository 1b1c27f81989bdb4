"""The score softmax of DotProductAttention's unfused path when it carries more than a scale and a
mask: an attention bias (pre_scale_bias / post_scale_bias), ALiBi, or the attention sink of
softmax_type. One library call each way (nvte_attn_softmax_forward / _backward, softmax.h), which
builds the logits with fused attention's conventions (fused_attn.h), so a call gives the same
probabilities on either path. This module only shapes the operands and wires autograd: the bias
gradient is the library's logit gradient (post-scale; for a bias broadcast over batch or heads the
score gradient's sum over those dimensions divided by the scale) or score gradient (pre-scale)
summed over the bias's broadcast dimensions, the sink gradient the library's per-row terms summed
over batch and queries."""
from __future__ import annotations

from typing import Optional

import torch

from . import custom_ops

BIAS_TYPES = ("no_bias", "pre_scale_bias", "post_scale_bias", "alibi")


class _AttnSoftmaxFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias, offset, scale: float, bias_type: str, slopes, diag, mask, causal: str, exact: bool):
        y, sink = custom_ops.attn_softmax_forward(x, scale, bias_type, bias, slopes, diag, mask, causal, offset,
                                                  torch.float32 if exact else x.dtype)
        ctx.scale, ctx.bias_type, ctx.causal = scale, bias_type, causal
        ctx.has_offset = offset is not None
        ctx.bias_shape = None if bias is None else bias.shape
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.offset_dtype = None if offset is None else offset.dtype
        ctx.save_for_backward(y, mask, sink if offset is not None else None)
        return y.to(x.dtype) if exact else y

    @staticmethod
    def backward(ctx, dy):
        y, mask, sink = ctx.saved_tensors
        want_bias = ctx.bias_shape is not None and ctx.needs_input_grad[1]
        post = want_bias and ctx.bias_type == "post_scale_bias"
        dims = [d for d in range(4) if ctx.bias_shape[d] == 1 and dy.shape[d] != 1] if want_bias else []
        # A post-scale bias broadcast over batch or heads takes sum(dx) / scale (dx = scale * the logit
        # gradient): the logit gradient is then not written out, a quarter of the backward's traffic.
        lg_out = post and (not dims or ctx.scale == 0.0)
        dx, lg, dsink = custom_ops.attn_softmax_backward(dy.contiguous(), y, mask,
                                                         sink if ctx.needs_input_grad[2] else None, ctx.scale, lg_out,
                                                         ctx.causal)
        dbias = None
        if want_bias:  # pre-scale: d(scale * (x + bias)) = dx; post-scale: the logit gradient
            g = lg if lg_out else dx
            # (summed in float32: a float32 bias broadcast over batch or heads keeps its precision)
            dbias = g.sum(dims, keepdim=True, dtype=torch.float32) if dims else g
            if post and not lg_out:
                dbias = dbias / ctx.scale
            dbias = dbias.to(ctx.bias_dtype)
        doff = dsink.sum((0, 2)).to(ctx.offset_dtype) if ctx.has_offset and ctx.needs_input_grad[2] else None
        return (dx if ctx.needs_input_grad[0] else None), dbias, doff, None, None, None, None, None, None, None


def attn_softmax(scores: torch.Tensor, scale: float, bias_type: str = "no_bias", bias: Optional[torch.Tensor] = None,
                 alibi_slopes: Optional[torch.Tensor] = None, alibi_diagonal: Optional[torch.Tensor] = None,
                 mask: Optional[torch.Tensor] = None, causal: str = "no_mask",
                 offset: Optional[torch.Tensor] = None) -> torch.Tensor:
    """softmax over the last dim of the unscaled scores [b, h, sq, sk] (nvte_attn_softmax_forward),
    differentiable in scores, bias and offset.

    bias: [1 or b, 1 or h, sq, sk] (or [h, sq, sk]) for pre/post_scale_bias. ALiBi: slopes [h] or
    [b, h] (None: TE's default slopes), alibi_diagonal int64 [1 or b] (attn_bias.mask_diagonal).
    mask: bool broadcastable to [b, h, sq, sk], True = hidden (TE's -10000 rule); causal:
    "no_mask", "causal" (top-left) or "causal_bottom_right" (keys past the diagonal left out).
    offset: the sink logits [h] of softmax_type, or None. ALiBi slopes get no gradient (as in TE)."""
    if bias_type not in BIAS_TYPES:
        raise ValueError(f"unknown core_attention_bias_type {bias_type!r}")
    b, h, sq, sk = scores.shape
    if bias is not None:
        if bias.dim() == 3:
            bias = bias.unsqueeze(0)
        if bias.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            bias = bias.float()  # (the library takes these three; autograd casts the gradient back)
        bias = bias.contiguous()
    slopes = None if alibi_slopes is None else alibi_slopes.to(device=scores.device, dtype=torch.float32).contiguous()
    diag = None if alibi_diagonal is None else alibi_diagonal.to(device=scores.device, dtype=torch.int64).contiguous()
    if mask is not None:
        if mask.dim() != 4:
            raise ValueError(f"attention mask must be 4D (broadcastable to [b, h, sq, sk]), got {tuple(mask.shape)}")
        if mask.shape[0] not in (1, b) or mask.shape[1] not in (1, h):
            raise ValueError(f"attention mask of shape {tuple(mask.shape)} does not broadcast to {(b, h, sq, sk)}")
        mask = mask.expand(mask.shape[0], mask.shape[1], sq, sk).to(device=scores.device, dtype=torch.uint8)
        mask = mask.contiguous()
    if offset is not None:
        offset = offset.to(device=scores.device)
        if offset.dtype != torch.float32:
            offset = offset.float()
    # The sink's gradient sums -p_sink * (dy . y) over every row of the batch: with y rounded to 16
    # bits that sum drifts (a few times autograd's error through float32 probabilities), so a sink
    # that is being trained keeps float32 probabilities for the backward.
    exact = (offset is not None and offset.requires_grad and torch.is_grad_enabled()
             and scores.dtype != torch.float32)
    return _AttnSoftmaxFn.apply(scores.contiguous(), bias, offset, float(scale), bias_type, slopes, diag, mask, causal,
                                exact)
