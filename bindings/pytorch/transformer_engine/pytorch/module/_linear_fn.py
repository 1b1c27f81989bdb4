"""The autograd function of one linear layer y = act(x W^T + b), shared by Linear,
LayerNormLinear, LayerNormMLP and the attention projections. Every numeric step is one
registered op of `custom_ops` (one library call), so torch.compile traces it whole.

FP8 path: x is cast to the forward FP8 format (rowwise for the forward GEMM, plus a
transposed copy kept for wgrad); W arrives already cast (the module casts it, or reuses a kept
copy: is_first_microbatch, FP8 parameters). fprop is an FP8 TN GEMM; in backward the output
gradient is cast (with the bias gradient fused) to the backward format, dgrad (NN) and wgrad
(NT) are FP8 GEMMs fed with the transposed copies, so every GEMM also runs in the TN layout
Hopper's FP8 GEMMs need. Scales: "delayed" uses the module's FP8Meta (scale + amax history,
updated by the library's recipe step), "current" derives each cast's scale from the tensor itself.

FP8 hand-offs (delayed scaling, the recipe's fp8_mha; see fp8_handoff.py): with fp8_output the
forward GEMM writes y in FP8 (forward format, the module's forward slot fwd_slot + 2, TE's GEMM
output slot) and returns its hand-off, and the backward receives the output gradient as a hand-off
(FP8 in the backward format, cast by its producer: no cast here). With fp8_input the input
arrives as a hand-off (FP8 in the forward format: no cast, the input slot is unused), and the
dgrad GEMM writes the input gradient in FP8 (backward format, backward slot bwd_slot + 1, TE's
grad-input slot) as a hand-off. The transposed FP8 copy wgrad reads is made from the FP8 bytes
(the library's transpose) in backward; an FP8 output gradient whose bias needs a gradient is
decoded once for the bias gradient, which comes with its transposed cast (current scaling, no
recipe state), as the library has no bias-gradient kernel for FP8 input.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from .. import custom_ops as ops
from ..fp8_handoff import handoff_parts
from ..tensor import Float8Tensor

HP = ops.HIGH_PRECISION_OPERAND


class QuantizedWeight(NamedTuple):
    """An FP8 copy of a weight: rowwise data [out, in], transposed data [in, out] (or the empty
    placeholder), float32 scale_inv [1] and the FP8 DType as an int."""
    data: torch.Tensor
    transpose: torch.Tensor
    scale_inv: torch.Tensor
    fp8_dtype: int


@dataclass(frozen=True)
class LinearCfg:
    """Constants of one linear layer's forward (hashable: torch.compile guards on them)."""
    scaling: str = "none"         # "none" | "calibrate" | "delayed" | "current"
    fwd_dtype: int = HP           # DType values of the forward / backward FP8 casts
    bwd_dtype: int = HP
    fwd_slot: int = 0             # delayed: forward meta slot of the input (the weight uses fwd_slot + 1)
    bwd_slot: int = 0             # delayed: backward meta slot of the output gradient
    update_bwd: bool = True       # delayed: run the backward recipe step before casting gradients
    # delayed: the module's first backward for bwd_slot, whose amax history is still empty: the
    # output gradient is cast with current scaling and its amax seeds the history. (With TE's
    # initial scale 1 the first E5M2 gradient casts flush small gradients to zero, the layers
    # below see almost none, and the amaxes they record set far too large scales for the next
    # steps: on an H200 the quickstart's loss spiked at steps 3-5 with gradients saturating.)
    seed_bwd: bool = False
    amax_compute_algo: str = "max"
    margin: float = 0.0
    inp_pow2: bool = False        # current scaling options of the input / gradient casts
    inp_eps: float = 0.0
    grad_pow2: bool = False
    grad_eps: float = 0.0
    gelu: bool = False            # y = gelu(x W^T + b), fused into the GEMM epilogue
    need_dgrad: bool = True
    need_wgrad: bool = True
    # Delayed scaling only: x2 is the input of a norm (LayerNorm / RMSNorm, weights given to
    # linear_fn) whose output goes straight to FP8 in the norm kernel (no high-precision copy)
    norm: str = ""                # "" | "LayerNorm" | "RMSNorm"
    norm_eps: float = 0.0
    norm_zero_centered: bool = False
    # Delayed scaling only: FP8 hand-offs (fp8_handoff.py) of the input / the output
    fp8_input: bool = False
    fp8_output: bool = False
    # fuse_wgrad_accumulation: the weight gradient is added into the weights' main_grad (wgrad_to),
    # or written there (wgrad_overwrite: TE's is_first_microbatch=True skips the accumulation)
    fuse_wgrad: bool = False
    wgrad_overwrite: bool = False

    @property
    def fp8(self) -> bool:
        return self.scaling in ("delayed", "current")


class _LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, weight, bias, w_data, w_transpose, w_scale_inv, fwd_scale, fwd_hist, bwd_scale, bwd_hist,
                cfg: LinearCfg, norm_weight=None, norm_bias=None, rows: int = 0, wgrad_to: tuple = ()):
        # x2: contiguous [tokens, in] in weight's dtype (the norm's input with cfg.norm), or with
        # cfg.fp8_input the hand-off of FP8 [rows, in]; w_*: the FP8 weight (FP8 modes only)
        b = bias if bias is not None and bias.numel() else None
        delayed = cfg.scaling == "delayed"
        dtype = weight.dtype if cfg.fp8_input else x2.dtype
        ctx.rows = rows if cfg.fp8_input else x2.shape[0]
        if cfg.fp8:
            norm_saved = ()
            if cfg.fp8_input:  # already FP8: the hand-off is kept, wgrad's transpose is made in backward
                xd, x_si = handoff_parts(x2, rows, weight.shape[1])
                xt = x2
            elif cfg.norm:
                xd, xt, x_si, mu, rs = ops.norm_fwd_fp8(
                    x2, norm_weight, norm_bias if cfg.norm == "LayerNorm" else None, cfg.norm_eps,
                    cfg.norm_zero_centered, fwd_scale, fwd_hist, cfg.fwd_slot, cfg.fwd_dtype, cfg.need_wgrad)
                norm_saved = (x2, norm_weight, mu, rs)  # for the norm's backward
            else:
                xd, xt, x_si, _ = ops.quantize(x2, fwd_scale if delayed else None, fwd_hist if delayed else None,
                                               cfg.fwd_slot, cfg.fwd_dtype, True, cfg.need_wgrad, False,
                                               cfg.inp_pow2, cfg.inp_eps)
            if cfg.fp8_output:
                out = ops.gemm_fp8_output(w_data, w_transpose, w_scale_inv, cfg.fwd_dtype, xd, None, x_si,
                                          cfg.fwd_dtype, cfg.fwd_dtype, fwd_scale, fwd_hist, cfg.fwd_slot + 2, True,
                                          False, b, False)
                pre = ops.missing(xd.device)
            else:
                out, pre = ops.gemm(w_data, w_transpose, w_scale_inv, cfg.fwd_dtype, xd, None, x_si, cfg.fwd_dtype,
                                    dtype, True, False, b, cfg.gelu, False)
            # keep only the transposed copies: dgrad and wgrad read those
            ctx.save_for_backward(xt, x_si, w_transpose, w_scale_inv, pre, *norm_saved)
        else:
            if cfg.scaling == "calibrate":  # record the input's amax only (the FP8 copy is dropped)
                ops.quantize(x2, fwd_scale, fwd_hist, cfg.fwd_slot, cfg.fwd_dtype, True, False, False, False, 0.0)
            w = high_precision(weight)
            out, pre = ops.gemm(w, None, None, HP, x2, None, None, HP, x2.dtype, True, False, b, cfg.gelu, False)
            ctx.save_for_backward(x2, w, pre)
        # the backward meta is updated in place by the backward: kept on ctx, not saved (a saved tensor
        # may not change between forward and backward)
        ctx.bwd_scale, ctx.bwd_hist = bwd_scale, bwd_hist
        ctx.cfg = cfg
        ctx.wgrad_to = wgrad_to  # Parameters (not saved tensors): their main_grad is read in backward
        ctx.weight_dtype = weight.dtype
        ctx.act_dtype = dtype
        ctx.features = (weight.shape[1], weight.shape[0])
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        cfg = ctx.cfg
        need_dx, need_dw, need_db = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        dtype = ctx.act_dtype
        in_features, out_features = ctx.features
        if not cfg.fp8_output:
            g = grad_out if grad_out.dim() == 2 else grad_out.reshape(-1, grad_out.shape[-1])
            g = (g if g.dtype == dtype else g.to(dtype)).contiguous()
        dx = dw = db = None
        norm_grads = (None, None)
        if cfg.fp8:
            saved = ctx.saved_tensors  # unpacked once (activation checkpointing allows one unpack)
            xt, x_si, w_t, w_si, pre = saved[:5]
            if cfg.norm:  # dgrad of the linear part is the norm output's gradient
                need_dx = need_dx or ctx.needs_input_grad[11] or ctx.needs_input_grad[12]
            if cfg.gelu:
                g = ops.dactivation(g, pre, "gelu")
            delayed = cfg.scaling == "delayed"
            if delayed and cfg.update_bwd:
                ops.delayed_scaling_update(ctx.bwd_hist, ctx.bwd_scale, cfg.amax_compute_algo, cfg.bwd_dtype,
                                           cfg.margin)
            if cfg.fp8_output:  # the output gradient arrives in FP8 (no cast)
                gd, g_si = handoff_parts(grad_out.contiguous(), ctx.rows, out_features)
                none = ops.missing(gd.device)
                gt, gt_si, gb = none, g_si, none
                if need_db:  # decoded once for the bias gradient, which comes with wgrad's transposed cast
                    g = ops.dequantize(gd, g_si, cfg.bwd_dtype, dtype)
                    _, gt, gt_si, gb = ops.quantize(g, None, None, 0, cfg.bwd_dtype, False, True, True, False, 0.0)
                elif need_dw:
                    gt = ops.transpose(gd)
            else:
                gd, gt, g_si, gb = ops.quantize(g, ctx.bwd_scale if delayed and not cfg.seed_bwd else None,
                                                ctx.bwd_hist if delayed else None, cfg.bwd_slot, cfg.bwd_dtype,
                                                need_dx, need_dw or not need_dx, need_db, cfg.grad_pow2,
                                                cfg.grad_eps)
                gt_si = g_si
                none = ops.missing(g.device)  # the absent operand buffers (read-only: one serves them all)
            if cfg.fp8_input and need_dw:  # wgrad's transposed input, from the kept FP8 bytes
                xt = ops.transpose(handoff_parts(xt, ctx.rows, in_features)[0])
            if need_dx and cfg.fp8_input:  # the input gradient leaves in FP8, as a hand-off (seeded with
                # the output gradient: at the initial scale its E5M2 bytes would flush)
                dx = ops.gemm_fp8_output(none, w_t, w_si, cfg.fwd_dtype, gd, None, g_si, cfg.bwd_dtype,
                                         cfg.bwd_dtype, ctx.bwd_scale, ctx.bwd_hist, cfg.bwd_slot + 1, False, False,
                                         None, cfg.seed_bwd)
            elif need_dx:
                dx = ops.gemm(none, w_t, w_si, cfg.fwd_dtype, gd, None, g_si, cfg.bwd_dtype, dtype, False, False,
                              None, False, False)[0]
            if need_dw and cfg.fuse_wgrad:
                dw = _accumulate_wgrad(ctx, (none, xt, x_si, cfg.fwd_dtype, none, gt, gt_si, cfg.bwd_dtype), False)[0]
            elif need_dw:
                dw = ops.gemm(none, xt, x_si, cfg.fwd_dtype, none, gt, gt_si, cfg.bwd_dtype,
                              ctx.weight_dtype, False, True, None, False, False)[0]
            if need_db:
                db = gb
            if cfg.norm and dx is not None:
                x2, nw, mu, rs = saved[5:]
                if cfg.norm == "LayerNorm":
                    dx, dnw, dnb = ops.layernorm_bwd(dx, x2, mu, rs, nw, cfg.norm_zero_centered)
                else:
                    (dx, dnw), dnb = ops.rmsnorm_bwd(dx, x2, rs, nw, cfg.norm_zero_centered), None
                norm_grads = (dnw if ctx.needs_input_grad[11] else None, dnb if ctx.needs_input_grad[12] else None)
                dx = dx if ctx.needs_input_grad[0] else None
        else:
            x2, w, pre = ctx.saved_tensors
            if cfg.gelu:
                g = ops.dactivation(g, pre, "gelu")
            if need_dx:
                dx = ops.gemm(w, None, None, HP, g, None, None, HP, dtype, False, False, None, False, False)[0]
            if need_dw and cfg.fuse_wgrad:
                dw, db = _accumulate_wgrad(ctx, (x2, None, None, HP, g, None, None, HP), need_db)
            elif need_dw or need_db:
                dw, gb = ops.gemm(x2, None, None, HP, g, None, None, HP, ctx.weight_dtype, False, True, None, False,
                                  need_db)
                db = gb if need_db else None
        return (dx, (dw if need_dw else None), db, None, None, None, None, None, None, None, None) + norm_grads + \
            (None, None)


def _accumulate_wgrad(ctx, operands: tuple, need_db: bool):
    """fuse_wgrad_accumulation: main_grad += the weight gradient -> (what the weight's .grad
    receives, the bias gradient or None); add_wgrad and wgrad_placeholder say how."""
    gb = add_wgrad(operands, ctx.wgrad_to, ctx.cfg.fp8, ctx.act_dtype, ctx.weight_dtype, need_db,
                   ctx.cfg.wgrad_overwrite)
    out, inp = ctx.features[1], ctx.features[0]
    return wgrad_placeholder(ctx.wgrad_to, (out, inp), ctx.weight_dtype), gb


def main_grad_of(p: torch.Tensor) -> torch.Tensor:
    """A weight's main_grad; Megatron-FSDP parameters (`__fsdp_param__`) make theirs on demand
    (get_main_grad(), as TE reads it)."""
    return p.get_main_grad() if hasattr(p, "__fsdp_param__") else p.main_grad


def add_wgrad(operands: tuple, params, fp8: bool, act_dtype: torch.dtype, weight_dtype: torch.dtype,
              need_db: bool, overwrite_all: bool = False) -> Optional[torch.Tensor]:
    """The wgrad GEMM (NT) of `operands` into the main_grad of `params` (the weight's rows in order:
    one weight, or the splits of parameters_split) -> the bias gradient in weight_dtype, or None.
    A weight flagged `overwrite_main_grad` (TE's attribute), or every weight with overwrite_all (a
    forward with is_first_microbatch=True, as TE does), gets the gradient written, not added;
    a frozen split gets nothing. One weight whose main_grad the GEMM can write from these operands
    (float32, or the operands' dtype; any with FP8 operands) takes it as the GEMM's C = D;
    otherwise the gradient is made once in float32 and added to (copied into) each main_grad."""
    mains = [main_grad_of(p) if p.requires_grad else None for p in params]
    overwrite = [overwrite_all or bool(getattr(p, "overwrite_main_grad", False)) for p in params]
    m0 = mains[0]
    if len(params) == 1 and m0 is not None and m0.is_contiguous() and (fp8 or m0.dtype in (torch.float32, act_dtype)):
        gb = ops.gemm_accumulate(*operands, m0, False, True, need_db, dbias_dtype(weight_dtype, m0), not overwrite[0])
    else:
        dw, gb = ops.gemm(*operands, torch.float32, False, True, None, False, need_db)
        start = 0
        for p, m, ow in zip(params, mains, overwrite):
            rows = p.shape[0]
            if m is not None:
                (m.copy_ if ow else m.add_)(dw[start:start + rows])
            start += rows
    return gb.to(weight_dtype) if need_db else None


def wgrad_placeholder(params, shape, dtype: torch.dtype) -> Optional[torch.Tensor]:
    """What .grad receives under fuse_wgrad_accumulation (Megatron's contract, which TE follows): a
    weight carrying `grad_added_to_main_grad` gets that flag set and a zero gradient (its gradient
    hooks still run, and adding zeros changes nothing); otherwise None (nothing reaches .grad)."""
    flagged = [p for p in params if hasattr(p, "grad_added_to_main_grad")]
    for p in flagged:
        p.grad_added_to_main_grad = True
    return torch.zeros(shape, dtype=dtype, device=params[0].device) if flagged else None


def dbias_dtype(weight_dtype: torch.dtype, main_grad: torch.Tensor) -> torch.dtype:
    """The dtype the accumulating wgrad GEMM's bias gradient is made in: the parameters' own where
    the GEMM takes it (main_grad's dtype, float32 or bfloat16: gemm.h), else float32."""
    return weight_dtype if weight_dtype in (main_grad.dtype, torch.float32, torch.bfloat16) else torch.float32


def high_precision(weight: torch.Tensor) -> torch.Tensor:
    """A contiguous high-precision tensor of a weight (an FP8 parameter is dequantized)."""
    if isinstance(weight, Float8Tensor):
        return weight.dequantize()
    return weight if weight.is_contiguous() else weight.contiguous()


def linear_fn(x2: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], cfg: LinearCfg,
              qweight: Optional[QuantizedWeight] = None, meta=(None, None, None, None),
              norm_weight: Optional[torch.Tensor] = None, norm_bias: Optional[torch.Tensor] = None,
              rows: int = 0, wgrad_to: tuple = ()) -> torch.Tensor:
    """y = act(x2 W^T + b), or act(norm(x2) W^T + b) with cfg.norm (delayed scaling; norm_weight /
    norm_bias: the norm's parameters). qweight: the FP8 weight (FP8 modes); meta: the module's
    (fwd scale, fwd amax history, bwd scale, bwd amax history) for delayed scaling / calibration.
    cfg.fp8_input: x2 is the FP8 hand-off of a [rows, in] input; cfg.fp8_output: y is returned as
    the FP8 hand-off of [tokens, out] (fp8_handoff.py). wgrad_to: with cfg.fuse_wgrad, the
    Parameters (rows of weight, in order) whose main_grad receives the weight gradient."""
    if cfg.fuse_wgrad and not wgrad_to:
        raise RuntimeError("linear_fn: fuse_wgrad needs the Parameters whose main_grad receives the gradient")
    if cfg.fp8 and qweight is None:
        raise RuntimeError("linear_fn: an FP8 forward needs the quantized weight")
    if cfg.norm and not (cfg.scaling == "delayed" and norm_weight is not None):
        raise RuntimeError("linear_fn: the fused norm needs delayed scaling and the norm's weight")
    if (cfg.fp8_input or cfg.fp8_output) and (cfg.scaling != "delayed" or cfg.gelu):
        raise RuntimeError("linear_fn: FP8 hand-offs need delayed scaling and no GELU epilogue")
    w = (qweight.data, qweight.transpose, qweight.scale_inv) if qweight is not None else (None, None, None)
    return ops.run_function(_LinearFn, x2, weight, bias, *w, *meta, cfg, norm_weight, norm_bias, rows, wgrad_to)


def grad_needs(x2: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]):
    """(need_dgrad, need_wgrad) of a linear layer's inputs in the current grad mode."""
    grad = torch.is_grad_enabled()
    return (grad and x2.requires_grad,
            grad and (weight.requires_grad or (bias is not None and bias.requires_grad)))
