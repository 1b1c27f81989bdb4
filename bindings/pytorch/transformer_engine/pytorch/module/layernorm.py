"""te.LayerNorm and te.RMSNorm (over the last dimension), plus the autograd functions the
fused modules reuse."""
from __future__ import annotations

from typing import Optional

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


class _NormBase(TransformerEngineBaseModule):
    def __init__(self, hidden_size: int, eps: float, sequence_parallel: bool, params_dtype, zero_centered_gamma,
                 device, with_bias: bool):
        super().__init__(device, params_dtype)
        if hidden_size <= 0:
            raise ValueError(f"{type(self).__name__}: hidden_size must be positive, got {hidden_size}")
        self.hidden_size, self.eps = int(hidden_size), float(eps)
        self.zero_centered_gamma, self.sequence_parallel = bool(zero_centered_gamma), sequence_parallel
        self.weight = self._new_param(self.hidden_size)
        if with_bias:
            self.bias = self._new_param(self.hidden_size)
        if self._device_arg.type != "meta":
            self.reset_parameters()

    def _init_parameters(self) -> None:
        # the effective scale starts at 1 (gamma = 0 when zero-centred)
        self.weight.fill_(0.0 if self.zero_centered_gamma else 1.0)
        if getattr(self, "bias", None) is not None:
            self.bias.zero_()


class LayerNorm(_NormBase):
    """y = (x - mean) / sqrt(var + eps) * g + bias over the last dim, g = weight
    (or 1 + weight with zero_centered_gamma). Parameters `weight`, `bias` [hidden_size]."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, sequence_parallel: Optional[bool] = None,
                 params_dtype: Optional[torch.dtype] = None, zero_centered_gamma: bool = False, device=None):
        super().__init__(hidden_size, eps, sequence_parallel, params_dtype, zero_centered_gamma, device, True)

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        check_input(inp, self.hidden_size, "LayerNorm")
        weight, bias = self.weight, self.bias  # read once: nn.Module's parameter lookup is slow
        check_same_device(inp, (weight, bias), "LayerNorm")
        weight, bias = autocast_params(weight.device, weight, bias)
        z = layernorm_fn(as_2d(inp, weight.dtype), weight, bias, self.eps, self.zero_centered_gamma)
        return z.view(inp.shape)


class RMSNorm(_NormBase):
    """y = x / sqrt(mean(x^2) + eps) * g over the last dim, g = weight (or 1 + weight with
    zero_centered_gamma). Parameter `weight` [hidden_size]."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, sequence_parallel: Optional[bool] = None,
                 params_dtype: Optional[torch.dtype] = None, zero_centered_gamma: bool = False, device=None):
        super().__init__(hidden_size, eps, sequence_parallel, params_dtype, zero_centered_gamma, device, False)

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        check_input(inp, self.hidden_size, "RMSNorm")
        weight = self.weight  # read once: nn.Module's parameter lookup is slow
        check_same_device(inp, (weight,), "RMSNorm")
        weight, = autocast_params(weight.device, weight)
        z = rmsnorm_fn(as_2d(inp, weight.dtype), weight, self.eps, self.zero_centered_gamma)
        return z.view(inp.shape)


def norm_writes_fp8(scaling: str, return_layernorm_output: bool) -> bool:
    """Whether LayerNormLinear / LayerNormMLP run their norm with its output cast to FP8 by the norm
    kernel (custom_ops.norm_fwd_fp8) instead of norm + separate cast: delayed scaling and the norm
    output not returned (it would be needed in high precision). The transposed FP8 copy that the
    weight gradient reads comes from the same call (on CUDA: the norm's row kernel, then a tiled
    byte transpose of its FP8 output)."""
    return scaling == "delayed" and not return_layernorm_output
