"""The softmax calls of the adapter (_ops.py's conventions: validate, wrap, one _nvte call): the
fused scale + mask softmax families and the attention softmax of unfused attention (softmax.h)."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from transformer_engine import _nvte

from ._ops import HIGH_PRECISION, _check, _stream, _tensor


# ------------------------------------------------------------------- softmax
SOFTMAX_KINDS = ("scaled", "upper_triang", "aligned_causal", "masked")


def softmax_forward(kind: str, x: torch.Tensor, scale: float, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """softmax(scale * x) over the last dim of x [b, h, sq, sk] with the library's fused kernels.

    kind: "scaled" (no mask), "upper_triang" (top-left causal, square), "aligned_causal"
    (bottom-right causal), "masked" (uint8 mask [b or 1, 1, sq, sk], 1 = masked)."""
    _check(x, "input", HIGH_PRECISION)
    y = torch.empty_like(x)
    stream = _stream(x)
    if kind == "scaled":
        _nvte.scaled_softmax_forward(_tensor(x), _tensor(y), scale, stream)
    elif kind == "upper_triang":
        s3 = (-1, x.shape[-2], x.shape[-1])
        _nvte.scaled_upper_triang_masked_softmax_forward(_tensor(x.view(s3)), _tensor(y.view(s3)), scale, stream)
    elif kind == "aligned_causal":
        _nvte.scaled_aligned_causal_masked_softmax_forward(_tensor(x), _tensor(y), scale, stream)
    elif kind == "masked":
        _check(mask, "mask", (torch.uint8,), x.device)
        _nvte.scaled_masked_softmax_forward(_tensor(x), _tensor(mask), _tensor(y), scale, stream)
    else:
        raise ValueError(f"unknown softmax kind {kind!r}; expected one of {SOFTMAX_KINDS}")
    return y


def softmax_backward(kind: str, dy: torch.Tensor, y: torch.Tensor, scale: float) -> torch.Tensor:
    """Input gradient of softmax_forward(kind, ...) from its output y and output gradient dy."""
    _check(y, "softmax output", HIGH_PRECISION)
    _check(dy, "grad", (y.dtype,), y.device)
    dx = torch.empty_like(y)
    stream = _stream(y)
    if kind == "scaled":
        _nvte.scaled_softmax_backward(_tensor(dy), _tensor(y), _tensor(dx), scale, stream)
    elif kind == "upper_triang":
        s3 = (-1, y.shape[-2], y.shape[-1])
        _nvte.scaled_upper_triang_masked_softmax_backward(_tensor(dy.view(s3)), _tensor(y.view(s3)),
                                                          _tensor(dx.view(s3)), scale, stream)
    elif kind == "aligned_causal":
        _nvte.scaled_aligned_causal_masked_softmax_backward(_tensor(dy), _tensor(y), _tensor(dx), scale, stream)
    elif kind == "masked":
        _nvte.scaled_masked_softmax_backward(_tensor(dy), _tensor(y), _tensor(dx), scale, stream)
    else:
        raise ValueError(f"unknown softmax kind {kind!r}; expected one of {SOFTMAX_KINDS}")
    return dx


# -------------------------------------------------------- attention-score softmax
ATTN_SOFTMAX_BIAS = {"no_bias": _nvte.NVTE_Bias_Type.NVTE_NO_BIAS,
                     "pre_scale_bias": _nvte.NVTE_Bias_Type.NVTE_PRE_SCALE_BIAS,
                     "post_scale_bias": _nvte.NVTE_Bias_Type.NVTE_POST_SCALE_BIAS,
                     "alibi": _nvte.NVTE_Bias_Type.NVTE_ALIBI}
ATTN_SOFTMAX_CAUSAL = {"no_mask": _nvte.NVTE_Mask_Type.NVTE_NO_MASK,
                       "causal": _nvte.NVTE_Mask_Type.NVTE_CAUSAL_MASK,
                       "causal_bottom_right": _nvte.NVTE_Mask_Type.NVTE_CAUSAL_BOTTOM_RIGHT_MASK}


def _opt(t: Optional[torch.Tensor]):
    return None if t is None else _tensor(t)


def attn_softmax_forward(x: torch.Tensor, scale: float, bias_type: str, bias: Optional[torch.Tensor],
                         alibi_slopes: Optional[torch.Tensor], alibi_diagonal: Optional[torch.Tensor],
                         mask: Optional[torch.Tensor], causal: str, offset: Optional[torch.Tensor],
                         out_dtype: Optional[torch.dtype] = None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(y, sink_probs or None) of nvte_attn_softmax_forward (softmax.h) for the unscaled scores x
    [b, h, sq, sk]: bias [1 or b, 1 or h, sq, sk] (pre/post-scale), ALiBi slopes float32 [h] or
    [b, h] (None: TE's default) and diagonal int64 [1 or b], mask uint8 [1 or b, 1 or h, sq, sk]
    (1 = hidden), causal "no_mask" / "causal" / "causal_bottom_right", sink logits float32 [h];
    y in out_dtype (x's dtype or float32; None: x's)."""
    _check(x, "scores", HIGH_PRECISION)
    for t, name in ((bias, "bias"), (alibi_slopes, "alibi_slopes"), (alibi_diagonal, "alibi_diagonal"),
                    (mask, "mask"), (offset, "softmax_offset")):
        if t is not None:
            _check(t, name, None, x.device)
    y = torch.empty_like(x, dtype=out_dtype or x.dtype)
    sink = None if offset is None else torch.empty(x.shape[:3], dtype=torch.float32, device=x.device)
    _nvte.attn_softmax_forward(_tensor(x), _opt(bias), _opt(alibi_slopes), _opt(alibi_diagonal), _opt(mask),
                               _opt(offset), _tensor(y), _opt(sink), scale, ATTN_SOFTMAX_BIAS[bias_type],
                               ATTN_SOFTMAX_CAUSAL[causal], _stream(x))
    return y, sink


def attn_softmax_backward(dy: torch.Tensor, y: torch.Tensor, mask: Optional[torch.Tensor],
                          sink_probs: Optional[torch.Tensor], scale: float, logit_grads: bool, causal: str = "no_mask"
                          ) -> Tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(gradient of the scores, of the logits when logit_grads (a post-scale bias's), per-row
    gradient of the sink logits [b, h, sq] when sink_probs is given) of attn_softmax_forward (causal:
    its causal rule); the gradients in dy's dtype."""
    _check(y, "softmax output", HIGH_PRECISION)
    _check(dy, "grad", HIGH_PRECISION, y.device)
    for t, name in ((mask, "mask"), (sink_probs, "sink_probs")):
        if t is not None:
            _check(t, name, None, y.device)
    dx = torch.empty_like(dy)
    lg = torch.empty_like(dy) if logit_grads else None
    dsink = None if sink_probs is None else torch.empty_like(sink_probs)
    _nvte.attn_softmax_backward(_tensor(dy), _tensor(y), _opt(mask), _opt(sink_probs), _tensor(dx), _opt(lg),
                                _opt(dsink), scale, ATTN_SOFTMAX_CAUSAL[causal], _stream(y))
    return dx, lg, dsink
