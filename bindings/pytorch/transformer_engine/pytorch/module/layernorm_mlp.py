"""te.LayerNormMLP: y = fc2(act(fc1(Norm(x)))).

Activations are the library's (activation.h): elementwise gelu (tanh form, fused into fc1's GEMM
epilogue), relu, qgelu, srelu, silu, and the gated units geglu, reglu, swiglu, qgeglu, sreglu, for
which fc1 produces 2 * ffn_hidden_size features, act(first half) * second half."""
from __future__ import annotations

from typing import Callable, Optional

import torch

from .. import _ops, custom_ops
from .base import (TransformerEngineBaseModule, as_2d, autocast_params, check_input, check_same_device,
                   default_init_method)
from .layernorm import check_normalization, norm_fn, norm_writes_fp8
from .linear import check_kwargs, check_unsupported

__all__ = ["LayerNormMLP", "ACTIVATIONS", "GATED_ACTIVATIONS"]

_ELEMENTWISE = _ops.ELEMENTWISE_ACTIVATIONS
GATED_ACTIVATIONS = _ops.GATED_ACTIVATIONS
ACTIVATIONS = _ELEMENTWISE + GATED_ACTIVATIONS


class _ActFn(torch.autograd.Function):
    """y = act(x) through the library's activation kernels (one registered op each way)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, name: str):
        x = x.contiguous()
        ctx.name = name
        ctx.save_for_backward(x)
        return custom_ops.activation(x, name)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (x,) = ctx.saved_tensors
        g = grad.to(x.dtype).contiguous()
        return custom_ops.dactivation(g, x, ctx.name), None


def activation_fn(x: torch.Tensor, name: str) -> torch.Tensor:
    """The library activation `name` applied to x ([tokens, features]); gated ones halve the features."""
    if name not in ACTIVATIONS:
        raise ValueError(f"unknown activation {name!r}; expected one of {list(ACTIVATIONS)}")
    return custom_ops.run_function(_ActFn, x, name)


# TE 2.x parameters of LayerNormMLP outside the signature below (accepted when unset; ub_* at tp_size 1)
_TE_KWARGS = frozenset({"ub_overlap_ag", "ub_overlap_rs", "ub_overlap_rs_dgrad", "ub_bulk_dgrad", "ub_bulk_wgrad",
                        "delay_wgrad_compute", "symmetric_ar_type", "activation_params", "checkpoint"})


class LayerNormMLP(TransformerEngineBaseModule):
    """Parameters `layer_norm_weight`, `layer_norm_bias` (LayerNorm only) [hidden_size],
    `fc1_weight` [ffn_hidden_size, hidden_size], `fc1_bias`, `fc2_weight` [hidden_size,
    ffn_hidden_size], `fc2_bias`. activation: one of ACTIVATIONS ('gelu' is the tanh approximation,
    fused into the fc1 GEMM's epilogue); for the gated ones fc1_weight is [2 * ffn_hidden_size, hidden_size]. Both GEMMs run in FP8 under fp8_autocast; the norm in high precision."""

    # forward slots: fc1 input, fc1 weight, fc1 output, fc2 input, fc2 weight, fc2 output
    _num_fp8_fwd = 6
    # backward slots: fc1 grad_output, fc1 grad_input, fc2 grad_output, fc2 grad_input
    _num_fp8_bwd = 4

    def __init__(self, hidden_size: int, ffn_hidden_size: int, eps: float = 1e-5, sequence_parallel: bool = False,
                 return_bias: bool = False, get_rng_state_tracker: Optional[Callable] = None, tp_group=None,
                 tp_size: int = 1, init_method: Optional[Callable] = None, bias: bool = True,
                 normalization: str = "LayerNorm", activation: str = "gelu",
                 output_layer_init_method: Optional[Callable] = None, fuse_wgrad_accumulation: bool = False,
                 params_dtype: Optional[torch.dtype] = None, return_layernorm_output: bool = False,
                 return_layernorm_output_gathered: bool = False, seq_length: Optional[int] = None,
                 micro_batch_size: Optional[int] = None, set_parallel_mode: bool = False,
                 zero_centered_gamma: bool = False, device=None, name: Optional[str] = None, **kwargs):
        # set_parallel_mode picks column / row-parallel GEMMs: nothing to pick with tp_size 1
        check_kwargs("LayerNormMLP.__init__", _TE_KWARGS, kwargs)
        check_unsupported("LayerNormMLP", tp_size, **kwargs)
        if activation not in ACTIVATIONS:
            raise ValueError(f"LayerNormMLP: activation {activation!r} is not supported; "
                             f"expected one of {list(ACTIVATIONS)}")
        super().__init__(device, params_dtype)
        self._init_rng = (get_rng_state_tracker, None)  # weights drawn in the tracker's stream (TE)
        if hidden_size <= 0 or ffn_hidden_size <= 0:
            raise ValueError(f"LayerNormMLP: sizes must be positive, got {hidden_size}, {ffn_hidden_size}")
        self.hidden_size, self.ffn_hidden_size = int(hidden_size), int(ffn_hidden_size)
        self.eps, self.normalization = float(eps), check_normalization(normalization, "LayerNormMLP")
        self.activation, self.zero_centered_gamma = activation, bool(zero_centered_gamma)
        self.use_bias, self.return_bias = bool(bias), bool(return_bias)
        self.return_layernorm_output = bool(return_layernorm_output)
        self.init_method = init_method if init_method is not None else default_init_method()
        # (TE: an unset output_layer_init_method is the default one, not init_method)
        self.output_layer_init_method = (output_layer_init_method if output_layer_init_method is not None
                                         else default_init_method())
        self.sequence_parallel, self.name = sequence_parallel, name
        self.fuse_wgrad_accumulation = bool(fuse_wgrad_accumulation)  # (_linear_fn.py: weight.main_grad)
        h, f = self.hidden_size, self.ffn_hidden_size
        self.layer_norm_weight = self._new_param(h)
        if self.normalization == "LayerNorm":
            self.layer_norm_bias = self._new_param(h)
        else:
            self.register_parameter("layer_norm_bias", None)
        f1 = 2 * f if activation in GATED_ACTIVATIONS else f
        # registered in TE's order (fc1 weight, fc1 bias, fc2 weight, fc2 bias): optimizer states
        # index parameters by position
        self.fc1_weight = self._new_param(f1, h)
        if self.use_bias:
            self.fc1_bias = self._new_param(f1)
        else:
            self.register_parameter("fc1_bias", None)
        self.fc2_weight = self._new_param(h, f)
        if self.use_bias:
            self.fc2_bias = self._new_param(h)
        else:
            self.register_parameter("fc2_bias", None)
        if self._device_arg.type != "meta":
            self.reset_parameters()

    def _init_parameters(self) -> None:
        self.layer_norm_weight.fill_(0.0 if self.zero_centered_gamma else 1.0)
        if self.layer_norm_bias is not None:
            self.layer_norm_bias.zero_()
        self.init_method(self.fc1_weight)
        self.output_layer_init_method(self.fc2_weight)
        for b in (self.fc1_bias, self.fc2_bias):
            if b is not None:
                b.zero_()

    def _fp8_weight_slots(self):
        return {"fc1_weight": 1, "fc2_weight": 4}  # fwd_slot + 1 of each GEMM

    def forward(self, inp: torch.Tensor, is_first_microbatch: Optional[bool] = None):
        """is_first_microbatch: as in Linear.forward (FP8 weight caching, both weights)."""
        check_input(inp, self.hidden_size, "LayerNormMLP")
        # each parameter read once: nn.Module's parameter lookup is slow
        params = ln_w, ln_b, w1, b1, w2, b2 = (self.layer_norm_weight, self.layer_norm_bias, self.fc1_weight,
                                               self.fc1_bias, self.fc2_weight, self.fc2_bias)
        check_same_device(inp, params, "LayerNormMLP")
        ln_w, ln_b, w1, b1, w2, b2 = autocast_params(w1.device, *params)
        x2 = as_2d(inp, w1.dtype)
        scaling = self._fp8_mode(w1.device)
        ln, norm = x2, None
        if norm_writes_fp8(scaling, self.return_layernorm_output):
            # the norm writes FP8 directly (no high-precision copy of its output)
            norm = (self.normalization, ln_w, ln_b, self.eps, self.zero_centered_gamma)
        else:
            ln = norm_fn(self.normalization, x2, ln_w, ln_b, self.eps, self.zero_centered_gamma)
        # fc2's backward runs first: it performs the backward delayed-scaling step for the module
        fuse = self.fuse_wgrad_accumulation
        act = self._linear(ln, w1, b1, scaling, is_first_microbatch, fwd_slot=0, bwd_slot=0,
                           update_bwd=False, gelu=self.activation == "gelu", norm=norm,
                           wgrad_to=(self.fc1_weight,) if fuse else ())
        if self.activation != "gelu":
            act = activation_fn(act, self.activation)
        out = self._linear(act, w2, None if self.return_bias else b2, scaling,
                           is_first_microbatch, fwd_slot=3, bwd_slot=2, update_bwd=True,
                           wgrad_to=(self.fc2_weight,) if fuse else ())
        out = out.view(inp.shape)
        res = [out]
        if self.return_bias:
            res.append(b2)
        if self.return_layernorm_output:
            res.append(ln.view(inp.shape))
        return res[0] if len(res) == 1 else tuple(res)
