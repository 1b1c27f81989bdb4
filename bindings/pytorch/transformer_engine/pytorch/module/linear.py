"""te.Linear: y = x W^T + b, in FP8 inside fp8_autocast."""
from __future__ import annotations

from typing import Callable, Optional

import torch

from .base import (TransformerEngineBaseModule, as_2d, autocast_params, check_input, check_same_device,
                   default_init_method)
from .split_params import SplitParams, parse_parameters_split

__all__ = ["Linear"]


def check_parallel_mode(parallel_mode: Optional[str], name: str) -> Optional[str]:
    """TE's parallel_mode values (None, "column", "row"; with tp_size 1 they change nothing)."""
    if parallel_mode not in (None, "column", "row"):
        raise ValueError(f"{name}: parallel_mode must be None, 'column' or 'row', got {parallel_mode!r}")
    return parallel_mode


def check_kwargs(who: str, known, kwargs) -> None:
    """TypeError (as TE and Python raise) for keyword arguments of `who` ("Linear.__init__", ...)
    whose names are not in `known`: the TE parameters of `who` that its signature takes through
    **kwargs (their values are checked by the caller). A misspelt name must not pass silently."""
    unknown = [k for k in kwargs if k not in known]
    if unknown:
        raise TypeError(f"{who}() got an unexpected keyword argument {unknown[0]!r}")


def check_unsupported(name: str, tp_size: int = 1, **flags) -> None:
    """Reject TE options this adapter does not implement, when set to non-default values. TE's
    userbuffer overlaps (ub_*) act only on tensor-parallel communication: with tp_size 1 (the only
    size here) they change nothing, in TE too, and are accepted."""
    if tp_size != 1:
        raise NotImplementedError(f"{name}: tensor parallelism (tp_size={tp_size}) is not implemented")
    on = [k for k, v in flags.items() if v and not k.startswith("ub_")]
    if on:
        raise NotImplementedError(f"{name}: options not implemented in this adapter: {on}")


# TE 2.x parameters of Linear outside the signature below (accepted when unset; ub_* at tp_size 1)
_TE_KWARGS = frozenset({"ub_overlap_ag", "ub_overlap_rs", "ub_overlap_rs_dgrad", "ub_bulk_dgrad", "ub_bulk_wgrad",
                        "ub_name", "delay_wgrad_compute", "symmetric_ar_type", "save_original_input"})


class Linear(SplitParams, TransformerEngineBaseModule):
    """Applies y = x W^T + b. Parameters: `weight` [out_features, in_features], `bias` [out_features]
    (with parameters_split: `<name>_weight` / `<name>_bias`, rows of those in order).

    device: None -> CUDA when available, else the CPU; 'meta' defers allocation until
    reset_parameters(). Under fp8_autocast the GEMMs run in FP8 with delayed scaling.
    return_bias=True returns (y without bias, bias) for the caller to fuse the addition.
    fuse_wgrad_accumulation=True: the weight gradient is accumulated into `weight.main_grad` (a
    buffer the caller allocates, e.g. Megatron's float32 gradient buffer) by the wgrad GEMM
    (_linear_fn.py says what `.grad` then receives)."""

    _num_fp8_fwd = 3  # input, weight, output
    _num_fp8_bwd = 2  # grad_output, grad_input

    def __init__(self, in_features: int, out_features: int, sequence_parallel: bool = False,
                 fuse_wgrad_accumulation: bool = False, tp_group=None, tp_size: int = 1,
                 get_rng_state_tracker: Optional[Callable] = None, rng_tracker_name: Optional[str] = None,
                 init_method: Optional[Callable] = None, bias: bool = True, return_bias: bool = False,
                 params_dtype: Optional[torch.dtype] = None, parallel_mode: Optional[str] = None,
                 parameters_split=None, device=None, name: Optional[str] = None, **kwargs):
        check_kwargs("Linear.__init__", _TE_KWARGS, kwargs)
        check_unsupported("Linear", tp_size, **kwargs)
        splits = parse_parameters_split(parameters_split, out_features, "Linear")
        super().__init__(device, params_dtype)
        self._splits = None if splits else []
        self.fuse_wgrad_accumulation = bool(fuse_wgrad_accumulation)
        self._init_rng = (get_rng_state_tracker, rng_tracker_name)  # weights drawn in the tracker's stream (TE)
        if in_features <= 0 or out_features <= 0:
            raise ValueError(f"Linear: in_features and out_features must be positive, got {in_features}, {out_features}")
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.use_bias, self.return_bias = bool(bias), bool(return_bias)
        self.init_method = init_method if init_method is not None else default_init_method()
        self.sequence_parallel, self.parallel_mode, self.tp_group, self.name = (
            sequence_parallel, check_parallel_mode(parallel_mode, "Linear"), tp_group, name)
        self.weight = self._new_param(self.out_features, self.in_features)
        if self.use_bias:
            self.bias = self._new_param(self.out_features)
        else:
            self.register_parameter("bias", None)
        if splits:  # (before the initialisation: each split is initialised on its own, as in TE)
            self._split(splits)
        if self._device_arg.type != "meta":
            self.reset_parameters()

    def forward(self, inp: torch.Tensor, is_first_microbatch: Optional[bool] = None, fp8_output: bool = False,
                fp8_grad: bool = False):
        """is_first_microbatch: None casts the weight to FP8 in every call; True casts it and keeps the
        FP8 copy; False reuses the kept copy (for gradient accumulation over micro-batches while the
        weight does not change)."""
        if fp8_output or fp8_grad:
            raise NotImplementedError("Linear: fp8_output / fp8_grad are not implemented")
        check_input(inp, self.in_features, "Linear")
        weight, bias = self._weight_and_bias()
        check_same_device(inp, (weight, bias), "Linear")
        weight, bias = autocast_params(weight.device, weight, bias)
        scaling = self._fp8_mode(weight.device)
        x2 = as_2d(inp, weight.dtype)
        out = self._linear(x2, weight, None if self.return_bias else bias, scaling, is_first_microbatch)
        out = out.view(*inp.shape[:-1], self.out_features)
        if self.return_bias:
            return out, bias
        return out

    # FP8 hand-offs (MultiheadAttention under the recipe's fp8_mha; see fp8_handoff.py)
    def _fp8_handoff_out(self, inp: torch.Tensor, is_first_microbatch: Optional[bool] = None):
        """(the FP8 hand-off of y = x W^T + b [tokens, out], None): the GEMM writes y in FP8 with this
        module's output slot; its gradient comes back as a hand-off. Delayed scaling only."""
        check_input(inp, self.in_features, "Linear")
        weight, bias = self._weight_and_bias()
        check_same_device(inp, (weight, bias), "Linear")
        weight, bias = autocast_params(weight.device, weight, bias)
        scaling = self._fp8_mode(weight.device)
        x2 = as_2d(inp, weight.dtype)
        return self._linear(x2, weight, None if self.return_bias else bias, scaling, is_first_microbatch,
                            fp8_output=True), None

    def _fp8_handoff_in(self, h: torch.Tensor, lead, is_first_microbatch: Optional[bool] = None):
        """forward() of an input given as the FP8 hand-off h of [*lead, in_features] (no cast; the
        input gradient goes back as a hand-off). Delayed scaling only."""
        weight, bias = self._weight_and_bias()
        check_same_device(h, (weight, bias), "Linear")
        weight, bias = autocast_params(weight.device, weight, bias)
        scaling = self._fp8_mode(weight.device)
        rows = 1
        for n in lead:
            rows *= n
        out = self._linear(h, weight, None if self.return_bias else bias, scaling, is_first_microbatch,
                           fp8_input=True, rows=rows)
        out = out.view(*lead, self.out_features)
        return (out, bias) if self.return_bias else out
