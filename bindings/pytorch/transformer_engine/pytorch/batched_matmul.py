"""Batched matrix products through the library's GEMM (nvte_batched_gemm), differentiable: the
score and context products of the unfused attention paths (attention/, kv_cache_attention.py),
which used torch.matmul before."""
from __future__ import annotations

import torch

from . import custom_ops as ops


def _stack(t: torch.Tensor) -> torch.Tensor:
    """[.., rows, cols] -> a dense [batch, rows, cols] stack."""
    return t.reshape(-1, *t.shape[-2:]).contiguous()


class _BatchedMatmul(torch.autograd.Function):
    """x [B, n, k] @ y [B, k, m] (y_t: @ y[B, m, k]^T) -> [B, n, m]. In TE's convention D =
    op(B) @ op(A) with B = x and A = y (transa = y_t)."""

    @staticmethod
    def forward(ctx, x, y, y_t: bool):
        ctx.save_for_backward(x, y)
        ctx.y_t = y_t
        return ops.batched_gemm(y, x, y_t, False)

    @staticmethod
    def backward(ctx, dd):
        x, y = ctx.saved_tensors
        dd = dd.contiguous().to(x.dtype)
        dx = dy = None
        if ctx.needs_input_grad[0]:  # dD @ y^T (y_t: dD @ y)
            dx = ops.batched_gemm(y, dd, not ctx.y_t, False)
        if ctx.needs_input_grad[1]:  # x^T @ dD (y_t: dD^T @ x)
            dy = ops.batched_gemm(x, dd, False, True) if ctx.y_t else ops.batched_gemm(dd, x, False, True)
        return dx, dy, None


def matmul(x: torch.Tensor, y: torch.Tensor, y_transposed: bool = False) -> torch.Tensor:
    """x [.., n, k] @ y [.., k, m] (y_transposed: y [.., m, k], x @ y^T) over matching leading
    dimensions, in x's dtype, through the library's batched GEMM."""
    lead = x.shape[:-2]
    if y.shape[:-2] != lead:
        raise ValueError(f"matmul: leading dimensions differ, {tuple(x.shape)} and {tuple(y.shape)}")
    out = _BatchedMatmul.apply(_stack(x), _stack(y), y_transposed)
    return out.reshape(*lead, *out.shape[-2:])
