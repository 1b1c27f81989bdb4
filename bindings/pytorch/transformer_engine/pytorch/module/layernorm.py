"""te.LayerNorm and te.RMSNorm (over the last dimension), plus the autograd functions the
fused modules reuse."""
from __future__ import annotations

import math
import numbers
from typing import Optional, Tuple

import torch

from .. import custom_ops
from .base import TransformerEngineBaseModule, as_2d, autocast_params, check_input, check_same_device

__all__ = ["LayerNorm", "RMSNorm", "layernorm_fn", "rmsnorm_fn", "norm_fn"]


class _LayerNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, weight, bias, eps, zero_centered_gamma):
        w, b = weight.contiguous(), bias.contiguous()
        z, mu, rs = custom_ops.layernorm_fwd(x2, w, b, eps, zero_centered_gamma)
        ctx.save_for_backward(x2, w, mu, rs)
        ctx.zcg = zero_centered_gamma
        return z

    @staticmethod
    def backward(ctx, dz):
        x2, w, mu, rs = ctx.saved_tensors
        dz = (dz if dz.dtype == x2.dtype else dz.to(x2.dtype)).contiguous()
        dx, dg, db = custom_ops.layernorm_bwd(dz, x2, mu, rs, w, ctx.zcg)
        return dx, dg, db, None, None


class _RMSNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, weight, eps, zero_centered_gamma):
        w = weight.contiguous()
        z, rs = custom_ops.rmsnorm_fwd(x2, w, eps, zero_centered_gamma)
        ctx.save_for_backward(x2, w, rs)
        ctx.zcg = zero_centered_gamma
        return z

    @staticmethod
    def backward(ctx, dz):
        x2, w, rs = ctx.saved_tensors
        dz = (dz if dz.dtype == x2.dtype else dz.to(x2.dtype)).contiguous()
        dx, dg = custom_ops.rmsnorm_bwd(dz, x2, rs, w, ctx.zcg)
        return dx, dg, None, None


def layernorm_fn(x2, weight, bias, eps: float, zero_centered_gamma: bool):
    return custom_ops.run_function(_LayerNormFn, x2, weight, bias, float(eps), bool(zero_centered_gamma))


def rmsnorm_fn(x2, weight, eps: float, zero_centered_gamma: bool):
    return custom_ops.run_function(_RMSNormFn, x2, weight, float(eps), bool(zero_centered_gamma))


def norm_fn(normalization: str, x2, weight, bias, eps: float, zero_centered_gamma: bool):
    """LayerNorm (with bias) or RMSNorm (bias unused) of x2, as `normalization` names."""
    if normalization == "LayerNorm":
        return layernorm_fn(x2, weight, bias, eps, zero_centered_gamma)
    return rmsnorm_fn(x2, weight, eps, zero_centered_gamma)


def check_normalization(normalization: str, name: str) -> str:
    if normalization not in ("LayerNorm", "RMSNorm"):
        raise ValueError(f"{name}: normalization must be 'LayerNorm' or 'RMSNorm', got {normalization!r}")
    return normalization


def _norm_shape(name: str, normalized_shape, hidden_size) -> Tuple[int, ...]:
    """TE 2.x's normalized_shape (an int or the inner dims), or the deprecated hidden_size."""
    def dims_of(shape):
        dims = (shape,) if isinstance(shape, numbers.Integral) else tuple(shape)
        if not dims or not all(isinstance(d, numbers.Integral) and d > 0 for d in dims):
            raise ValueError(f"{name}: normalized_shape must be a positive int or a non-empty iterable of them, "
                             f"got {shape!r}")
        return tuple(int(d) for d in dims)
    if normalized_shape is None and hidden_size is None:
        raise TypeError(f"{name}: normalized_shape (the normalized inner dimensions) is required")
    if normalized_shape is None:
        return dims_of(hidden_size)
    dims = dims_of(normalized_shape)
    if hidden_size is not None and dims_of(hidden_size) != dims:
        raise ValueError(f"{name}: normalized_shape={normalized_shape!r} and hidden_size={hidden_size!r} disagree")
    return dims


class _NormBase(TransformerEngineBaseModule):
    def __init__(self, normalized_shape, eps: float, sequence_parallel, params_dtype, zero_centered_gamma,
                 device, with_bias: bool, hidden_size, dtype, sm_margin):
        name = type(self).__name__
        if dtype is not None and params_dtype is not None and dtype != params_dtype:
            raise ValueError(f"{name}: dtype={dtype} and params_dtype={params_dtype} disagree")
        if not isinstance(sm_margin, numbers.Integral) or sm_margin < 0:  # (an SM budget for overlap: no-op here)
            raise ValueError(f"{name}: sm_margin must be a non-negative int, got {sm_margin!r}")
        super().__init__(device, params_dtype if params_dtype is not None else dtype)
        self.normalized_shape = _norm_shape(name, normalized_shape, hidden_size)
        self.hidden_size = math.prod(self.normalized_shape)  # the flattened row the library normalizes
        self.eps = float(eps)
        self.zero_centered_gamma, self.sequence_parallel = bool(zero_centered_gamma), sequence_parallel
        self.weight = self._new_param(*self.normalized_shape)
        if with_bias:
            self.bias = self._new_param(*self.normalized_shape)
        for p in self.parameters(recurse=False):  # (Megatron-LM reads it to all-reduce their gradients)
            p.sequence_parallel = bool(sequence_parallel)
        if self._device_arg.type != "meta":
            self.reset_parameters()

    def _init_parameters(self) -> None:
        # the effective scale starts at 1 (gamma = 0 when zero-centred)
        self.weight.fill_(0.0 if self.zero_centered_gamma else 1.0)
        if getattr(self, "bias", None) is not None:
            self.bias.zero_()

    def _rows(self, inp: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """inp as [rows, prod(normalized_shape)] in dtype, after checking its inner dims."""
        k = len(self.normalized_shape)
        check_input(inp, self.normalized_shape[-1], type(self).__name__)
        if tuple(inp.shape[inp.dim() - k:]) != self.normalized_shape:
            raise ValueError(f"{type(self).__name__}: input's inner dims must be {list(self.normalized_shape)}, got "
                             f"shape {tuple(inp.shape)}")
        return as_2d(inp if k == 1 else inp.reshape(-1, self.hidden_size), dtype)


class LayerNorm(_NormBase):
    """y = (x - mean) / sqrt(var + eps) * g + bias over the inner dims normalized_shape (an int:
    the last dim), g = weight (or 1 + weight with zero_centered_gamma). Parameters `weight`,
    `bias` shaped normalized_shape. hidden_size: TE's deprecated name of normalized_shape; dtype:
    params_dtype's; sm_margin (TE's SM budget for communication overlap) is accepted, unused."""

    def __init__(self, normalized_shape=None, eps: float = 1e-5, sequence_parallel: Optional[bool] = None,
                 params_dtype: Optional[torch.dtype] = None, zero_centered_gamma: bool = False, hidden_size=None,
                 device=None, dtype: Optional[torch.dtype] = None, sm_margin: int = 0):
        super().__init__(normalized_shape, eps, sequence_parallel, params_dtype, zero_centered_gamma, device, True,
                         hidden_size, dtype, sm_margin)

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        weight, bias = self.weight, self.bias  # read once: nn.Module's parameter lookup is slow
        check_same_device(inp, (weight, bias), "LayerNorm")
        weight, bias = autocast_params(weight.device, weight, bias)
        z = layernorm_fn(self._rows(inp, weight.dtype), weight.reshape(-1), bias.reshape(-1), self.eps,
                         self.zero_centered_gamma)
        return z.view(inp.shape)


class RMSNorm(_NormBase):
    """y = x / sqrt(mean(x^2) + eps) * g over the inner dims normalized_shape, g = weight (or
    1 + weight with zero_centered_gamma). Parameter `weight` shaped normalized_shape. Arguments as
    LayerNorm's."""

    def __init__(self, normalized_shape=None, eps: float = 1e-5, sequence_parallel: Optional[bool] = None,
                 params_dtype: Optional[torch.dtype] = None, zero_centered_gamma: bool = False, hidden_size=None,
                 device=None, dtype: Optional[torch.dtype] = None, sm_margin: int = 0):
        super().__init__(normalized_shape, eps, sequence_parallel, params_dtype, zero_centered_gamma, device, False,
                         hidden_size, dtype, sm_margin)

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        weight = self.weight  # read once: nn.Module's parameter lookup is slow
        check_same_device(inp, (weight,), "RMSNorm")
        weight, = autocast_params(weight.device, weight)
        z = rmsnorm_fn(self._rows(inp, weight.dtype), weight.reshape(-1), self.eps, self.zero_centered_gamma)
        return z.view(inp.shape)


def norm_writes_fp8(scaling: str, return_layernorm_output: bool) -> bool:
    """Whether LayerNormLinear / LayerNormMLP run their norm with its output cast to FP8 by the norm
    kernel (custom_ops.norm_fwd_fp8) instead of norm + separate cast: delayed scaling and the norm
    output not returned (it would be needed in high precision). The transposed FP8 copy that the
    weight gradient reads comes from the same call (on CUDA: the norm's row kernel, then a tiled
    byte transpose of its FP8 output)."""
    return scaling == "delayed" and not return_layernorm_output
