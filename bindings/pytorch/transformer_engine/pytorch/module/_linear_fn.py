"""The autograd function of one linear layer y = act(x W^T + b), shared by Linear,
LayerNormLinear and LayerNormMLP. Every numeric step is one call of `_ops`.

FP8 path (DelayedScaling): x and W are cast to the forward FP8 format with their delayed
scales (rowwise for the forward GEMM, plus transposed copies kept for backward), fprop is an
FP8 TN GEMM; in backward the output gradient is cast (with the bias gradient fused) to the
backward format, dgrad (NN) and wgrad (NT) are FP8 GEMMs fed with the transposed copies,
so every GEMM also runs in the TN layout Hopper's FP8 GEMMs need.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .. import _ops
from ..fp8 import FP8Meta


@dataclass
class LinearCfg:
    meta: FP8Meta
    fp8: bool = False
    calibrating: bool = False
    fwd_slot: int = 0        # forward meta slots used: input = fwd_slot, weight = fwd_slot + 1
    bwd_slot: int = 0        # backward meta slot of the output gradient
    update_bwd: bool = True  # run the backward delayed-scaling step before casting gradients
    gelu: bool = False       # y = gelu(x W^T + b)
    need_dgrad: bool = True  # set by linear_fn (grad mode is off inside Function.forward)
    need_wgrad: bool = True


class _LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], cfg: LinearCfg):
        # x2: contiguous [tokens, in] in weight's dtype
        meta = cfg.meta
        need_dgrad, need_wgrad = cfg.need_dgrad, cfg.need_wgrad
        w = weight.contiguous()
        b = bias if bias is not None and bias.numel() else None
        xq = wq = None
        if cfg.fp8:
            fdt = meta.fp8_dtype("fwd")
            i, j = cfg.fwd_slot, cfg.fwd_slot + 1
            xq = _ops.quantize(x2, meta.scale_of("fwd", i), meta.amax("fwd", i), fdt,
                               rowwise=True, columnwise=need_wgrad)
            wq = _ops.quantize(w, meta.scale_of("fwd", j), meta.amax("fwd", j), fdt,
                               rowwise=True, columnwise=need_dgrad)
            res = _ops.gemm(wq, xq, x2.dtype, transa=True, transb=False, bias=b, gelu=cfg.gelu)
            xq.drop_rowwise()
            wq.drop_rowwise()
        else:
            if cfg.calibrating:  # record amaxes only (the FP8 copies are discarded)
                fdt = meta.fp8_dtype("fwd")
                for k, t in ((cfg.fwd_slot, x2), (cfg.fwd_slot + 1, w)):
                    _ops.quantize(t, meta.scale_of("fwd", k), meta.amax("fwd", k), fdt)
            res = _ops.gemm(w, x2, x2.dtype, transa=True, transb=False, bias=b, gelu=cfg.gelu)
        out, pre = res if cfg.gelu else (res, None)
        ctx.cfg = cfg
        ctx.fp8 = cfg.fp8
        ctx.xq, ctx.wq = xq, wq
        ctx.has_bias = bias is not None
        ctx.save_for_backward(None if cfg.fp8 else x2, None if cfg.fp8 else w, pre)
        ctx.weight_dtype = weight.dtype
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x2, w, pre = ctx.saved_tensors
        cfg = ctx.cfg
        need_dx, need_dw, need_db = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        dtype = grad_out.dtype if pre is None else pre.dtype
        g = grad_out.reshape(-1, grad_out.shape[-1])
        g = (g if g.dtype == dtype else g.to(dtype)).contiguous()
        if pre is not None:
            g = _ops.dgelu(g, pre)
        dx = dw = db = None
        if ctx.fp8:
            meta = cfg.meta
            if cfg.update_bwd:
                meta.update("bwd")
            k = cfg.bwd_slot
            args = (g, meta.scale_of("bwd", k), meta.amax("bwd", k), meta.fp8_dtype("bwd"))
            if need_db:
                gq, db = _ops.quantize_dbias(*args, rowwise=need_dx, columnwise=need_dw or not need_dx)
            else:
                gq = _ops.quantize(*args, rowwise=need_dx, columnwise=need_dw)
            if need_dx:
                dx = _ops.gemm(ctx.wq, gq, dtype, transa=False, transb=False)
            if need_dw:
                gq_t = _ops.FP8Tensor(None, gq.transpose, gq.scale_inv, gq.fp8_dtype, gq.shape)
                dw = _ops.gemm(ctx.xq, gq_t, ctx.weight_dtype, transa=False, transb=True)
        else:
            if need_dx:
                dx = _ops.gemm(w, g, dtype, transa=False, transb=False)
            if need_dw or need_db:
                db = torch.empty(g.shape[1], dtype=dtype, device=g.device) if need_db else None
                dw = _ops.gemm(x2, g, ctx.weight_dtype, transa=False, transb=True, bias=db, grad=True)
        ctx.xq = ctx.wq = None
        if db is not None and not need_db:
            db = None
        return dx, (dw if need_dw else None), db, None


def linear_fn(x2: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], cfg: LinearCfg) -> torch.Tensor:
    grad = torch.is_grad_enabled()
    cfg.need_dgrad = grad and x2.requires_grad
    cfg.need_wgrad = grad and (weight.requires_grad or (bias is not None and bias.requires_grad))
    return _LinearFn.apply(x2, weight, bias, cfg)
