"""te.LayerNormLinear: y = Linear(Norm(x)), the norm output optionally returned too."""
from __future__ import annotations

from typing import Callable, Optional

import torch

from .base import (TransformerEngineBaseModule, as_2d, autocast_params, check_input, check_same_device,
                   default_init_method)
from .layernorm import check_normalization, norm_fn, norm_writes_fp8
from .linear import check_kwargs, check_parallel_mode, check_unsupported
from .split_params import SplitParams, parse_parameters_split

__all__ = ["LayerNormLinear"]


# TE 2.x parameters of LayerNormLinear outside the signature below (accepted when unset; ub_* at tp_size 1)
_TE_KWARGS = frozenset({"ub_overlap_ag", "ub_overlap_rs", "ub_overlap_rs_dgrad", "ub_bulk_dgrad", "ub_bulk_wgrad",
                        "ub_name", "delay_wgrad_compute", "symmetric_ar_type"})


class LayerNormLinear(SplitParams, TransformerEngineBaseModule):
    """Parameters `layer_norm_weight`, `layer_norm_bias` (LayerNorm only) [in_features],
    `weight` [out_features, in_features], `bias` [out_features] (with parameters_split:
    `<name>_weight` / `<name>_bias`). The norm runs in high precision; the linear part follows
    te.Linear (FP8 under fp8_autocast; fuse_wgrad_accumulation as there)."""

    _num_fp8_fwd = 3
    _num_fp8_bwd = 2

    def __init__(self, in_features: int, out_features: int, eps: float = 1e-5, sequence_parallel: bool = False,
                 fuse_wgrad_accumulation: bool = False, tp_group=None, tp_size: int = 1,
                 get_rng_state_tracker: Optional[Callable] = None, init_method: Optional[Callable] = None,
                 bias: bool = True, normalization: str = "LayerNorm", return_bias: bool = False,
                 params_dtype: Optional[torch.dtype] = None, parallel_mode: Optional[str] = None,
                 return_layernorm_output: bool = False, return_layernorm_output_gathered: bool = False,
                 parameters_split=None, zero_centered_gamma: bool = False, device=None,
                 name: Optional[str] = None, **kwargs):
        check_kwargs("LayerNormLinear.__init__", _TE_KWARGS, kwargs)
        check_unsupported("LayerNormLinear", tp_size, **kwargs)
        splits = parse_parameters_split(parameters_split, out_features, "LayerNormLinear")
        super().__init__(device, params_dtype)
        self._splits = None if splits else []
        self.fuse_wgrad_accumulation = bool(fuse_wgrad_accumulation)
        self._init_rng = (get_rng_state_tracker, None)  # weights drawn in the tracker's stream (TE)
        if in_features <= 0 or out_features <= 0:
            raise ValueError(f"LayerNormLinear: features must be positive, got {in_features}, {out_features}")
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.eps, self.normalization = float(eps), check_normalization(normalization, "LayerNormLinear")
        self.zero_centered_gamma = bool(zero_centered_gamma)
        self.use_bias, self.return_bias = bool(bias), bool(return_bias)
        self.return_layernorm_output = bool(return_layernorm_output)
        self.init_method = init_method if init_method is not None else default_init_method()
        self.sequence_parallel, self.name = sequence_parallel, name
        self.parallel_mode = check_parallel_mode(parallel_mode, "LayerNormLinear")
        self.layer_norm_weight = self._new_param(self.in_features)
        if self.normalization == "LayerNorm":
            self.layer_norm_bias = self._new_param(self.in_features)
        else:
            self.register_parameter("layer_norm_bias", None)
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
        """is_first_microbatch: as in Linear.forward (FP8 weight caching over micro-batches)."""
        if fp8_output or fp8_grad:
            raise NotImplementedError("LayerNormLinear: fp8_output / fp8_grad are not implemented")
        check_input(inp, self.in_features, "LayerNormLinear")
        weight, bias = self._weight_and_bias()
        ln_w, ln_b = self.layer_norm_weight, self.layer_norm_bias  # read once: nn.Module's lookup is slow
        check_same_device(inp, (ln_w, ln_b, weight, bias), "LayerNormLinear")
        ln_w, ln_b, weight, bias = autocast_params(weight.device, ln_w, ln_b, weight, bias)
        x2 = as_2d(inp, weight.dtype)
        scaling = self._fp8_mode(weight.device)
        if norm_writes_fp8(scaling, self.return_layernorm_output):
            # the norm writes FP8 directly (no high-precision copy of its output)
            norm = (self.normalization, ln_w, ln_b, self.eps, self.zero_centered_gamma)
            out = self._linear(x2, weight, None if self.return_bias else bias, scaling, is_first_microbatch,
                               norm=norm)
            out = out.view(*inp.shape[:-1], self.out_features)
            return (out, bias) if self.return_bias else out
        ln = norm_fn(self.normalization, x2, ln_w, ln_b, self.eps, self.zero_centered_gamma)
        out = self._linear(ln, weight, None if self.return_bias else bias, scaling, is_first_microbatch)
        out = out.view(*inp.shape[:-1], self.out_features)
        res = [out]
        if self.return_bias:
            res.append(bias)
        if self.return_layernorm_output:
            res.append(ln.view(inp.shape))
        return res[0] if len(res) == 1 else tuple(res)

    def _fp8_handoff_out(self, inp: torch.Tensor, is_first_microbatch: Optional[bool] = None):
        """(the FP8 hand-off of y = Linear(Norm(x)) [tokens, out], the norm output or None): the GEMM
        writes y in FP8 with this module's output slot (MultiheadAttention under fp8_mha; see
        fp8_handoff.py); the norm output is returned when return_layernorm_output. Delayed scaling only."""
        check_input(inp, self.in_features, "LayerNormLinear")
        weight, bias = self._weight_and_bias()
        ln_w, ln_b = self.layer_norm_weight, self.layer_norm_bias
        check_same_device(inp, (ln_w, ln_b, weight, bias), "LayerNormLinear")
        ln_w, ln_b, weight, bias = autocast_params(weight.device, ln_w, ln_b, weight, bias)
        x2 = as_2d(inp, weight.dtype)
        scaling = self._fp8_mode(weight.device)
        bias = None if self.return_bias else bias
        if norm_writes_fp8(scaling, self.return_layernorm_output):
            norm = (self.normalization, ln_w, ln_b, self.eps, self.zero_centered_gamma)
            return self._linear(x2, weight, bias, scaling, is_first_microbatch, norm=norm, fp8_output=True), None
        ln = norm_fn(self.normalization, x2, ln_w, ln_b, self.eps, self.zero_centered_gamma)
        h = self._linear(ln, weight, bias, scaling, is_first_microbatch, fp8_output=True)
        return h, (ln.view(inp.shape) if self.return_layernorm_output else None)
