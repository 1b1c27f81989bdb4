"""te.GroupedLinear: num_gemms independent linear layers applied to consecutive row blocks of one
input (mixture-of-experts style): rows [s_0, s_0 + m_splits[i]) go through weight{i} / bias{i}.

Each of fprop, dgrad and wgrad is one grouped GEMM (nvte_multi_tensor_gemm through
custom_ops.grouped_gemm). Under fp8_autocast every row block and every weight gets its own cast
(delayed scaling: forward slots [inputs | weights | outputs], backward slots [grad outputs |
grad inputs], num_gemms each; current scaling: a scale per block from its own amax)."""
from __future__ import annotations

from typing import Callable, List, Optional

import torch

from .. import custom_ops as ops
from ._linear_fn import LinearCfg, add_wgrad, high_precision, main_grad_of, wgrad_placeholder
from .base import (TransformerEngineBaseModule, as_2d, autocast_params, check_input, check_main_grads,
                   check_same_device, default_init_method)
from .linear import check_parallel_mode, check_unsupported

__all__ = ["GroupedLinear"]

HP = ops.HIGH_PRECISION_OPERAND


def _hp_operands(ts):
    """Operand lists (data, transpose, scale_inv) of high-precision tensors."""
    empty = [ops.missing(t.device) for t in ts]
    return list(ts), empty, [e.float() for e in empty]


class _GroupedLinearFn(torch.autograd.Function):
    """Arguments: x2, the row splits (a tuple of ints), the LinearCfg, the bias count, the
    fuse_wgrad_accumulation targets (a MainGrads or None), then a flat run of tensors: the n weights, the biases (n or none), the FP8 weights as (data, transpose,
    scale_inv) triples (FP8 modes only) and the 4 meta tensors (or Nones). Only tensors and
    constants cross apply(), no containers of tensors, so torch.compile sees every tensor input."""

    @staticmethod
    def forward(ctx, x2, splits, cfg: LinearCfg, n_bias: int, main_grads, *tensors):
        n = len(splits)
        weights, biases = tensors[:n], tensors[n:n + n_bias]
        qflat = tensors[n + n_bias:len(tensors) - 4]
        fwd_scale, fwd_hist, bwd_scale, bwd_hist = tensors[len(tensors) - 4:]
        ctx.n_tensors = len(tensors)
        live = [i for i in range(n) if splits[i] > 0]  # empty row blocks take no GEMM
        xs = torch.split(x2, list(splits))
        delayed = cfg.scaling == "delayed"
        bias = [biases[i] if n_bias > 0 else ops.missing(x2.device).to(x2.dtype) for i in live]
        if cfg.fp8:
            xq = [ops.quantize(xs[i], fwd_scale if delayed else None, fwd_hist if delayed else None, i, cfg.fwd_dtype,
                               True, cfg.need_wgrad, False, cfg.inp_pow2, cfg.inp_eps) for i in live]
            wq = [qflat[3 * i:3 * i + 3] for i in live]  # (data, transpose, scale_inv)
            outs, _ = ops.grouped_gemm([w[0] for w in wq], [w[1] for w in wq], [w[2] for w in wq],
                                       cfg.fwd_dtype, [q[0] for q in xq], [q[1] for q in xq], [q[2] for q in xq],
                                       cfg.fwd_dtype, x2.dtype, True, False, bias, False)
            saved = [q[1] for q in xq] + [q[2] for q in xq] + [w[1] for w in wq] + [w[2] for w in wq]
        else:
            if cfg.scaling == "calibrate":
                for i in live:
                    ops.quantize(xs[i], fwd_scale, fwd_hist, i, cfg.fwd_dtype, True, False, False, False, 0.0)
            ws = [high_precision(weights[i]) for i in live]
            xl = [xs[i] for i in live]
            outs, _ = ops.grouped_gemm(*_hp_operands(ws), HP, *_hp_operands(xl), HP, x2.dtype, True, False, bias,
                                       False)
            saved = xl + ws
        ctx.save_for_backward(*saved)
        ctx.live, ctx.splits, ctx.cfg, ctx.main_grads = live, tuple(splits), cfg, main_grads
        ctx.bwd_scale, ctx.bwd_hist = bwd_scale, bwd_hist
        ctx.has_bias, ctx.weight_dtype = n_bias > 0, weights[0].dtype  # n_bias, not bool(tuple): traceable on torch 2.11 too
        ctx.weight_shapes = [tuple(w.shape) for w in weights]
        out = torch.empty((x2.shape[0], weights[0].shape[0]), dtype=x2.dtype, device=x2.device)
        for i, o in zip(live, outs):
            start = sum(splits[:i])
            out[start:start + splits[i]] = o
        return out

    @staticmethod
    def backward(ctx, grad_out):
        cfg, live, splits = ctx.cfg, ctx.live, ctx.splits
        n, k = len(splits), len(live)
        g = grad_out.contiguous()
        gs = torch.split(g, list(splits))
        need_dx = ctx.needs_input_grad[0]
        need_dw = any(ctx.needs_input_grad[5:5 + n])
        need_db = ctx.has_bias and any(ctx.needs_input_grad[5 + n:5 + 2 * n])
        fuse = need_dw and ctx.main_grads is not None
        if fuse and ctx.main_grads.overwrite:  # (an empty row block's gradient is zero: written as such)
            for i in set(range(n)) - set(live):
                if ctx.main_grads.params[i].requires_grad:
                    main_grad_of(ctx.main_grads.params[i]).zero_()
        saved = ctx.saved_tensors
        dbs = None
        if cfg.fp8:
            xt, x_si, w_t, w_si = saved[:k], saved[k:2 * k], saved[2 * k:3 * k], saved[3 * k:]
            delayed = cfg.scaling == "delayed"
            if delayed:
                ops.delayed_scaling_update(ctx.bwd_hist, ctx.bwd_scale, cfg.amax_compute_algo, cfg.bwd_dtype,
                                           cfg.margin)
            # seed_bwd: the module's first backward casts each GEMM's gradient with current scaling and
            # seeds its history (a GEMM with no rows in that step keeps TE's initial scale)
            gq = [ops.quantize(gs[i], ctx.bwd_scale if delayed and not cfg.seed_bwd else None,
                               ctx.bwd_hist if delayed else None, i,
                               cfg.bwd_dtype, True, True, need_db, cfg.grad_pow2, cfg.grad_eps) for i in live]
            none = [ops.missing(g.device) for _ in live]
            dxs = ops.grouped_gemm(none, list(w_t), list(w_si), cfg.fwd_dtype, [q[0] for q in gq], none,
                                   [q[2] for q in gq], cfg.bwd_dtype, g.dtype, False, False, [], False)[0] \
                if need_dx else None
            if fuse:  # main_grad += x^T g, one accumulating GEMM per weight
                for j, i in enumerate(live):
                    add_wgrad((none[j], xt[j], x_si[j], cfg.fwd_dtype, none[j], gq[j][1], gq[j][2], cfg.bwd_dtype),
                              (ctx.main_grads.params[i],), True, g.dtype, ctx.weight_dtype, False,
                              ctx.main_grads.overwrite)
            dws = ops.grouped_gemm(none, list(xt), list(x_si), cfg.fwd_dtype, none, [q[1] for q in gq],
                                   [q[2] for q in gq], cfg.bwd_dtype, ctx.weight_dtype, False, True, [], False)[0] \
                if need_dw and not fuse else None
            dbs = [q[3] for q in gq] if need_db else None
        else:
            xl, ws = saved[:k], saved[k:]
            gl = [gs[i] for i in live]
            dxs = ops.grouped_gemm(*_hp_operands(ws), HP, *_hp_operands(gl), HP, g.dtype, False, False, [],
                                   False)[0] if need_dx else None
            if fuse:
                dbs = [add_wgrad((xl[j], None, None, HP, gl[j], None, None, HP), (ctx.main_grads.params[i],),
                                 False, xl[j].dtype, ctx.weight_dtype, need_db, ctx.main_grads.overwrite)
                       for j, i in enumerate(live)]
                dbs = dbs if need_db else None
            elif need_dw or need_db:
                dws, dbs = ops.grouped_gemm(*_hp_operands(xl), HP, *_hp_operands(gl), HP, ctx.weight_dtype, False,
                                            True, [], need_db)
                dbs = dbs if need_db else None
        dx = None
        if need_dx:
            dx = torch.zeros((g.shape[0], ctx.weight_shapes[0][1]), dtype=g.dtype, device=g.device)
            for i, d in zip(live, dxs):
                start = sum(splits[:i])
                dx[start:start + splits[i]] = d
        dw_all = [None] * n
        db_all = [None] * n if ctx.has_bias else []
        if fuse:
            dw_all = ctx.main_grads.grads(ctx.weight_shapes, ctx.weight_dtype)
        elif need_dw:
            for i in range(n):
                dw_all[i] = torch.zeros(ctx.weight_shapes[i], dtype=ctx.weight_dtype, device=g.device)
            for i, d in zip(live, dws):
                dw_all[i] = d
        if need_db:
            for i in range(n):
                db_all[i] = torch.zeros(ctx.weight_shapes[i][0], dtype=ctx.weight_dtype, device=g.device)
            for i, d in zip(live, dbs):
                db_all[i] = d.to(ctx.weight_dtype)
        rest = ctx.n_tensors - n - len(db_all)
        return (dx, None, None, None, None, *dw_all, *db_all, *([None] * rest))


class MainGrads:
    """The weights of a GroupedLinear with fuse_wgrad_accumulation: their main_grad buffers receive
    the weight gradients (_linear_fn._accumulate_wgrad says what .grad gets)."""

    def __init__(self, params, overwrite: bool = False):
        self.params = tuple(params)
        self.overwrite = overwrite  # (is_first_microbatch=True: written, not added, as in TE)

    def grads(self, shapes, dtype):
        """What each weight's .grad receives (_linear_fn.wgrad_placeholder)."""
        return [wgrad_placeholder((p,), shape, dtype) for p, shape in zip(self.params, shapes)]


class GroupedLinear(TransformerEngineBaseModule):
    """num_gemms linear layers y_i = x_i W_i^T + b_i over the row blocks x_i of the input given by
    forward's m_splits. Parameters `weight{i}` [out_features, in_features] and `bias{i}`
    [out_features], i < num_gemms. return_bias=True returns (y without bias, [bias0, ...])."""

    def __init__(self, num_gemms: int, in_features: int, out_features: int, sequence_parallel: bool = False,
                 fuse_wgrad_accumulation: bool = False, tp_group=None, tp_size: int = 1,
                 get_rng_state_tracker: Optional[Callable] = None, rng_tracker_name: Optional[str] = None,
                 init_method: Optional[Callable] = None, bias: bool = True, return_bias: bool = False,
                 params_dtype: Optional[torch.dtype] = None, parallel_mode: Optional[str] = None, device=None,
                 ub_overlap_rs: bool = False, ub_overlap_ag: bool = False, ub_name: Optional[str] = None,
                 delay_wgrad_compute: bool = False, save_original_input: bool = False, name: Optional[str] = None):
        check_unsupported("GroupedLinear", tp_size, ub_overlap_rs=ub_overlap_rs,
                          ub_overlap_ag=ub_overlap_ag, delay_wgrad_compute=delay_wgrad_compute)
        if num_gemms <= 0 or in_features <= 0 or out_features <= 0:
            raise ValueError(f"GroupedLinear: num_gemms, in_features and out_features must be positive, got "
                             f"{num_gemms}, {in_features}, {out_features}")
        self.num_gemms = int(num_gemms)
        self._num_fp8_fwd = 3 * self.num_gemms  # [inputs | weights | outputs]
        self._num_fp8_bwd = 2 * self.num_gemms  # [grad outputs | grad inputs]
        super().__init__(device, params_dtype)
        self._init_rng = (get_rng_state_tracker, rng_tracker_name)  # weights drawn in the tracker's stream (TE)
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.use_bias, self.return_bias = bool(bias), bool(return_bias)
        self.init_method = init_method if init_method is not None else default_init_method()
        self.sequence_parallel, self.name = sequence_parallel, name
        self.parallel_mode = check_parallel_mode(parallel_mode, "GroupedLinear")
        self.fuse_wgrad_accumulation = bool(fuse_wgrad_accumulation)  # main_grad += wgrad (Linear's)
        for i in range(self.num_gemms):
            setattr(self, f"weight{i}", self._new_param(self.out_features, self.in_features))
            if self.use_bias:
                setattr(self, f"bias{i}", self._new_param(self.out_features))
            else:
                self.register_parameter(f"bias{i}", None)
        if self._device_arg.type != "meta":
            self.reset_parameters()

    def _init_parameters(self) -> None:
        for i in range(self.num_gemms):
            self.init_method(getattr(self, f"weight{i}"))
            b = getattr(self, f"bias{i}")
            if b is not None:
                b.zero_()

    def _fp8_weight_slots(self):
        return {f"weight{i}": self.num_gemms + i for i in range(self.num_gemms)}

    def forward(self, inp: torch.Tensor, m_splits: List[int], is_first_microbatch: Optional[bool] = None):
        """inp [..., in_features] viewed as rows; m_splits: rows per GEMM (sums to the row count)."""
        check_input(inp, self.in_features, "GroupedLinear")
        if isinstance(m_splits, torch.Tensor):
            m_splits = m_splits.tolist()
        if any(isinstance(s, bool) or int(s) != s for s in m_splits):  # (2.5 rows would be truncated)
            raise TypeError(f"GroupedLinear: m_splits must be integers, got {list(m_splits)}")
        splits = [int(s) for s in m_splits]
        rows = inp.numel() // self.in_features
        if len(splits) != self.num_gemms or any(s < 0 for s in splits) or sum(splits) != rows:
            raise ValueError(f"GroupedLinear: m_splits must hold {self.num_gemms} non-negative sizes summing to "
                             f"the {rows} input rows, got {list(m_splits)}")
        weights = [getattr(self, f"weight{i}") for i in range(self.num_gemms)]
        biases = [getattr(self, f"bias{i}") for i in range(self.num_gemms)] if self.use_bias else []
        check_same_device(inp, weights + biases, "GroupedLinear")
        cast = autocast_params(weights[0].device, *weights, *biases)
        weights, biases = list(cast[:self.num_gemms]), list(cast[self.num_gemms:])
        scaling = self._fp8_mode(weights[0].device)
        x2 = as_2d(inp, weights[0].dtype)
        grad = torch.is_grad_enabled()
        need_wgrad = grad and any(p.requires_grad for p in weights + biases)
        need_dgrad = grad and x2.requires_grad
        cfg = self._linear_cfg(scaling, need_dgrad=need_dgrad, need_wgrad=need_wgrad,
                               seed_bwd=self._take_bwd_seed(scaling, 0, need_dgrad or need_wgrad))
        qweights = [self._quantized_weight(w, cfg, self.num_gemms + i, is_first_microbatch)
                    for i, w in enumerate(weights)]
        fwd_biases = [] if self.return_bias else biases
        qflat = [t for q in qweights if q is not None for t in (q.data, q.transpose, q.scale_inv)]
        main_grads = None
        if self.fuse_wgrad_accumulation and need_wgrad and weights[0].requires_grad:
            params = [getattr(self, f"weight{i}") for i in range(self.num_gemms)]
            check_main_grads(params, "GroupedLinear")
            main_grads = MainGrads(params, is_first_microbatch is True)
        out = _GroupedLinearFn.apply(x2, tuple(splits), cfg, len(fwd_biases), main_grads, *weights, *fwd_biases,
                                     *qflat, *self._meta_tensors(scaling))
        out = out.view(*inp.shape[:-1], self.out_features)
        if self.return_bias:
            return out, biases
        return out
