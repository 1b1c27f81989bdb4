"""Rotary position embedding (TE's RotaryPositionEmbedding and apply_rotary_pos_emb) over
nvte_fused_rope_forward / _backward (fused_rope.h): the library applies the rotation on either
backend; this file makes the angle table and wires autograd (two custom ops, so torch.compile
sees each call as one node).

RotaryPositionEmbedding(dim)(max_seq_len) gives the angles [max_seq_len, 1, 1, dim] (float32):
position p, channel k: (p + offset) / interpolation * inv_freq[k mod dim/2], inv_freq[j] =
rotary_base^(-2j/dim), the dim/2 frequencies repeated as two halves, or each twice in a row when
interleaved. apply_rotary_pos_emb rotates the first freqs.shape[-1] channels of t ("sbhd",
"bshd" or "thd" with cu_seqlens); start_positions [b] shift each sequence's positions (K/V-cache
generation: the tokens cached before this step). `fused` is accepted for TE's signature: both
settings run the library's op."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.library import custom_op

from transformer_engine import _nvte

from . import _ops
from . import custom_ops
from .custom_ops import eager_or_op
from .module.base import default_device

__all__ = ["RotaryPositionEmbedding", "apply_rotary_pos_emb"]

_FORMATS = {"sbhd": _nvte.NVTE_QKV_Format.NVTE_SBHD, "bshd": _nvte.NVTE_QKV_Format.NVTE_BSHD,
            "thd": _nvte.NVTE_QKV_Format.NVTE_THD}
_FORMAT_NAMES = tuple(_FORMATS)


class RotaryPositionEmbedding(torch.nn.Module):
    """The angle table of RoPE (see the module docstring). rotary_percent < 1 rotates that share of
    the head size (dim is then int(dim * rotary_percent)). Position interpolation, as TE does it,
    needs both seq_len_interpolation_factor and pretrained_max_position_embeddings: positions are
    divided by the factor, or by max_seq_len / pretrained for a table longer than pretrained *
    factor; with only one of the two set, positions are not scaled (TE's rule, kept so that a
    model's angles are TE's)."""

    def __init__(self, dim: int, rotary_percent: float = 1.0, seq_len_interpolation_factor: Optional[float] = None,
                 pretrained_max_position_embeddings: Optional[int] = None, rotary_base: float = 10000.0,
                 interleaved: bool = False):
        super().__init__()
        if not 0.0 < rotary_percent <= 1.0:
            raise ValueError(f"RotaryPositionEmbedding: rotary_percent must be in (0, 1], got {rotary_percent}")
        if rotary_percent < 1.0:
            dim = int(dim * rotary_percent)
        if dim < 2 or dim % 2:
            raise ValueError(f"RotaryPositionEmbedding: the rotated size must be even and >= 2, got {dim}")
        self.dim, self.interleaved = int(dim), bool(interleaved)
        self.seq_len_interpolation_factor = seq_len_interpolation_factor
        self.pretrained_max_position_embeddings = pretrained_max_position_embeddings
        self.rotary_base = float(rotary_base)
        exponents = torch.arange(0, dim, 2, dtype=torch.float32, device=default_device()) / dim
        self.register_buffer("inv_freq", 1.0 / (self.rotary_base ** exponents))

    def forward(self, max_seq_len: int, offset: int = 0) -> Tensor:
        pos = torch.arange(max_seq_len, dtype=torch.float32, device=self.inv_freq.device) + offset
        factor, pre = self.seq_len_interpolation_factor, self.pretrained_max_position_embeddings
        if factor is not None and pre is not None:
            pos = pos * (pre / max_seq_len if max_seq_len > pre * factor else 1.0 / factor)
        angles = torch.outer(pos, self.inv_freq.float())  # [s, dim / 2]
        if self.interleaved:
            emb = angles.repeat_interleave(2, dim=-1)
        else:
            emb = torch.cat([angles, angles], dim=-1)
        return emb.reshape(max_seq_len, 1, 1, self.dim)


def _geometry(t: Tensor, fmt: str, cu_seqlens: Optional[Tensor]):
    """(s, b, h, d, strides (s_or_t, b, h, d)) of fused_rope.h for t in format fmt."""
    st = t.stride()
    if fmt == "thd":
        return t.shape[0], cu_seqlens.shape[0] - 1, t.shape[1], t.shape[2], (st[0], 0, st[1], st[2])
    if fmt == "sbhd":
        return t.shape[0], t.shape[1], t.shape[2], t.shape[3], (st[0], st[1], st[2], st[3])
    return t.shape[1], t.shape[0], t.shape[2], t.shape[3], (st[1], st[0], st[2], st[3])


def _strided(t: Tensor):
    """A handle over t's elements as the library reads them: from t's first element to its last."""
    extent = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride())) if t.numel() else 0
    return _ops._make(t.data_ptr(), [extent], _ops._TORCH_TO_NVTE[t.dtype])


def _call(backward: bool, x: Tensor, freqs: Tensor, start: Optional[Tensor], cu: Optional[Tensor], fmt: str,
          interleaved: bool, cp_size: int, cp_rank: int) -> Tensor:
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    s, b, h, d, strides = _geometry(x, fmt, cu)
    fn = _nvte.fused_rope_backward if backward else _nvte.fused_rope_forward
    fn(_strided(x), None if cu is None else _ops._tensor(cu), _ops._tensor(freqs),
       None if start is None else _ops._tensor(start), _ops._tensor(y), _FORMATS[fmt], interleaved, cp_size, cp_rank, s, b, h, d,
       freqs.shape[-1], *strides, _ops._stream(x))
    return y


@custom_op("transformer_engine::fused_rope_fwd", mutates_args=())
def fused_rope_fwd(x: Tensor, freqs: Tensor, start: Optional[Tensor], cu: Optional[Tensor], fmt: str,
                   interleaved: bool, cp_size: int, cp_rank: int) -> Tensor:
    return _call(False, x, freqs, start, cu, fmt, interleaved, cp_size, cp_rank)


@custom_op("transformer_engine::fused_rope_bwd", mutates_args=())
def fused_rope_bwd(g: Tensor, freqs: Tensor, start: Optional[Tensor], cu: Optional[Tensor], fmt: str,
                   interleaved: bool, cp_size: int, cp_rank: int) -> Tensor:
    return _call(True, g, freqs, start, cu, fmt, interleaved, cp_size, cp_rank)


@fused_rope_fwd.register_fake
def _(x, freqs, start, cu, fmt, interleaved, cp_size, cp_rank):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@fused_rope_bwd.register_fake
def _(g, freqs, start, cu, fmt, interleaved, cp_size, cp_rank):
    return torch.empty_like(g, memory_format=torch.contiguous_format)


fused_rope_fwd = eager_or_op(fused_rope_fwd)
fused_rope_bwd = eager_or_op(fused_rope_bwd)


class _FusedRoPE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, freqs, start, cu, fmt, interleaved, cp_size, cp_rank):
        ctx.save_for_backward(freqs, start, cu)
        ctx.fmt, ctx.interleaved, ctx.cp = fmt, interleaved, (cp_size, cp_rank)
        return fused_rope_fwd(t, freqs, start, cu, fmt, interleaved, cp_size, cp_rank)

    @staticmethod
    def backward(ctx, g):
        freqs, start, cu = ctx.saved_tensors
        return (fused_rope_bwd(g, freqs, start, cu, ctx.fmt, ctx.interleaved, *ctx.cp),
                None, None, None, None, None, None, None)


def apply_rotary_pos_emb(t: Tensor, freqs: Tensor, tensor_format: str = "sbhd", start_positions: Optional[Tensor] = None,
                         interleaved: bool = False, fused: bool = False, cu_seqlens: Optional[Tensor] = None,
                         cp_size: int = 1, cp_rank: int = 0) -> Tensor:
    """t rotated by the angles freqs ([s_f, 1, 1, d2]: row p for position p), as TE's function: t
    [s, b, h, d] ("sbhd"), [b, s, h, d] ("bshd") or [t, h, d] ("thd", cu_seqlens int32 [b + 1]
    required); the first d2 channels rotate (d2 <= d), the rest pass through. Differentiable in t;
    the result is a new contiguous tensor. cp_size > 1: t holds context-parallel rank cp_rank's two
    chunks of every sequence (TE's split into 2 cp_size chunks: rank k holds k and 2 cp_size - 1 - k),
    rotated at their positions in the whole sequence; "thd" then takes the whole sequences'
    cu_seqlens (TE's cu_seqlens_padded, lengths multiples of 2 cp_size); no start_positions."""
    if tensor_format not in _FORMATS:
        raise ValueError(f"apply_rotary_pos_emb: tensor_format must be one of {_FORMAT_NAMES}, got {tensor_format!r}")
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"apply_rotary_pos_emb: needs 0 <= cp_rank < cp_size, got cp_rank={cp_rank}, cp_size={cp_size}")
    if cp_size > 1 and start_positions is not None:
        raise ValueError("apply_rotary_pos_emb: start_positions (inference) with cp_size > 1 is not supported")
    if not isinstance(t, Tensor) or t.dim() != (3 if tensor_format == "thd" else 4):
        raise ValueError(f"apply_rotary_pos_emb: t must be {'3' if tensor_format == 'thd' else '4'}D in "
                         f"{tensor_format!r}, got {tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__}")
    if tensor_format == "thd" and cu_seqlens is None:
        raise ValueError("apply_rotary_pos_emb: tensor_format 'thd' needs cu_seqlens")
    if t.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"apply_rotary_pos_emb: t must be float32, float16 or bfloat16, got {t.dtype}")
    if not isinstance(freqs, Tensor) or freqs.dim() != 4 or freqs.shape[1] != 1 or freqs.shape[2] != 1:
        raise ValueError(f"apply_rotary_pos_emb: freqs must be [s2, 1, 1, d2] (RotaryPositionEmbedding's table), got "
                         f"{tuple(freqs.shape) if isinstance(freqs, Tensor) else type(freqs).__name__}")
    if freqs.shape[-1] > t.shape[-1]:
        raise ValueError(f"apply_rotary_pos_emb: freqs' last dim ({freqs.shape[-1]}) must not exceed the head size "
                         f"({t.shape[-1]})")
    if tensor_format != "thd" and start_positions is None:
        s = (t.shape[0] if tensor_format == "sbhd" else t.shape[1]) * cp_size
        rows = freqs.shape[0]
        if rows < s:
            raise ValueError(f"apply_rotary_pos_emb: freqs has {rows} positions, fewer than the sequence length {s}"
                             + (f" (the whole sequence of the {cp_size} context-parallel ranks)" if cp_size > 1 else ""))
    dev = t.device
    freqs = freqs.to(device=dev, dtype=torch.float32).contiguous()
    start = None if start_positions is None else start_positions.to(device=dev, dtype=torch.int32).contiguous()
    cu = None if cu_seqlens is None or tensor_format != "thd" else cu_seqlens.to(device=dev, dtype=torch.int32).contiguous()
    return custom_ops.run_function(_FusedRoPE, t, freqs, start, cu, tensor_format, bool(interleaved), int(cp_size),
                                   int(cp_rank))
