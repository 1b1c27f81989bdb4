"""Shared machinery of the TE modules: device / dtype defaults, meta-device materialisation,
FP8 metadata ownership and its state_dict entry (`_extra_state`), FP8 weight parameters
(quantized_model_init)."""
from __future__ import annotations

import contextlib

from typing import Callable, Optional

import torch

from transformer_engine.common.recipe import DelayedScaling

from .. import _ops, custom_ops
from ..fp8 import FP8GlobalState, FP8Meta, FP8ModelInitState
from ..tensor import Float8Tensor, WeightQuantizer
from ._linear_fn import LinearCfg, QuantizedWeight, grad_needs, linear_fn

_PARAM_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def default_device() -> torch.device:
    """CUDA when available, else the CPU (where the library's CPU backend runs)."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def resolve_device(device) -> torch.device:
    if device is None:
        return default_device()
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type not in ("cpu", "cuda", "meta"):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'meta', got {device}")
    return device


def resolve_dtype(params_dtype) -> torch.dtype:
    dt = torch.get_default_dtype() if params_dtype is None else params_dtype
    if dt not in _PARAM_DTYPES:
        raise TypeError(f"params_dtype must be one of {[str(d) for d in _PARAM_DTYPES]}, got {dt}")
    return dt


def default_init_method(std: float = 0.023) -> Callable[[torch.Tensor], None]:
    def init(w: torch.Tensor) -> None:
        torch.nn.init.normal_(w, mean=0.0, std=std)
    return init


class TransformerEngineBaseModule(torch.nn.Module):
    """Base of the TE modules. Subclasses set `_num_fp8_fwd/_num_fp8_bwd` and implement
    `_init_parameters()` (fills the parameters in place)."""

    _num_fp8_fwd = 0
    _num_fp8_bwd = 0

    def __init__(self, device=None, params_dtype=None):
        super().__init__()
        self._device_arg = resolve_device(device)
        self.params_dtype = resolve_dtype(params_dtype)
        self.fp8_meta = FP8Meta(self._num_fp8_fwd, self._num_fp8_bwd)
        if self._device_arg.type != "meta" and (self._num_fp8_fwd or self._num_fp8_bwd):
            self.fp8_meta.allocate(self._device_arg)
        self._fp8_weight_cache = {}  # slot -> QuantizedWeight kept by is_first_microbatch=True
        self._linear_cfgs = {}  # configuration key -> LinearCfg (see _linear_cfg)
        # quantized_model_init: the recipe the GEMM weights are kept in FP8 with (None: high precision)
        init = FP8ModelInitState
        self._fp8_param_recipe = init.recipe if init.enabled and (self._num_fp8_fwd or self._num_fp8_bwd) else None
        self._preserve_hp_init_val = init.preserve_high_precision_init_val

    def _new_param(self, *shape) -> torch.nn.Parameter:
        return torch.nn.Parameter(torch.empty(*shape, dtype=self.params_dtype, device=self._device_arg))

    def reset_parameters(self, defer_init: bool = False) -> None:
        """(Re)initialise the parameters; parameters on the meta device are first materialised
        on the default device (CUDA when available, else the CPU)."""
        if defer_init:
            return
        for name, p in list(self.named_parameters(recurse=False)):
            if p.device.type == "meta":
                new = torch.nn.Parameter(torch.empty_like(p, device=default_device()), requires_grad=p.requires_grad)
                setattr(self, name, new)
        if not self.fp8_meta.amax_history and (self._num_fp8_fwd or self._num_fp8_bwd):
            self.fp8_meta.allocate(default_device())
        # get_rng_state_tracker (TE's, for Megatron's model-parallel RNG): initialise in its stream
        tracker, name = getattr(self, "_init_rng", (None, None))
        fork = contextlib.nullcontext() if tracker is None else (tracker().fork(name) if name else tracker().fork())
        with torch.no_grad(), fork:
            self._init_parameters()
        self._make_fp8_params()

    def _init_parameters(self) -> None:  # pragma: no cover - subclasses
        raise NotImplementedError

    def _fp8_weight_slots(self):
        """{parameter name: forward FP8 meta slot} of the GEMM weights (kept in FP8 under
        quantized_model_init)."""
        return {}

    def _make_fp8_params(self) -> None:
        """quantized_model_init: replace each high-precision GEMM weight by its FP8 cast (a
        Float8Tensor parameter); the high-precision tensor is dropped (or kept on the CPU when
        preserve_high_precision_init_val)."""
        recipe = self._fp8_param_recipe
        if recipe is None:
            return
        weights = {n: getattr(self, n) for n in self._fp8_weight_slots()}
        live = [p for p in weights.values() if p is not None and p.device.type != "meta"]
        if not live:
            return
        self.fp8_meta.prepare(recipe, live[0].device)
        fwd_dtype = self.fp8_meta.fp8_dtype("fwd")
        columnwise = torch.is_grad_enabled()  # built for training: keep the transpose the dgrad GEMM reads
        for name, slot in self._fp8_weight_slots().items():
            p = weights[name]
            if p is None or isinstance(p, Float8Tensor) or p.device.type == "meta":
                continue
            quantizer = WeightQuantizer(recipe, fwd_dtype, self.fp8_meta, slot)
            with torch.no_grad():
                q = Float8Tensor.quantize(p, quantizer, columnwise=columnwise)
            param = torch.nn.Parameter(q, requires_grad=p.requires_grad)
            if self._preserve_hp_init_val:
                param._high_precision_init_val = p.detach().to("cpu", copy=True)
            setattr(self, name, param)

    # ------------------------------------------------------------------ FP8
    def _fp8_mode(self, device: torch.device) -> str:
        """The scaling mode of this forward: "none", "calibrate" (high precision, amaxes recorded),
        "delayed" or "current"; prepares the metadata when FP8 or calibration is on."""
        st = FP8GlobalState
        fp8 = bool(st.enabled)
        calibrating = bool(st.calibrating) and not fp8
        if not (fp8 or calibrating):
            return "none"
        if device.type == "meta":
            raise RuntimeError("parameters are on the meta device; call reset_parameters() first")
        self.fp8_meta.prepare(st.recipe, device)
        delayed = isinstance(st.recipe, DelayedScaling)
        if delayed:
            st.register_forward(self.fp8_meta)
            if st.recompute_stash is not None:  # activation recompute: the forward's scales, scratch amaxes
                scale = st.recompute_stash.get(self.fp8_meta, self.fp8_meta.scale["fwd"])
                self._recompute_fwd_meta = (scale, torch.zeros_like(self.fp8_meta.amax_history["fwd"]))
        if calibrating:
            return "calibrate" if delayed else "none"  # current scaling keeps no amaxes to calibrate
        return "delayed" if delayed else "current"

    def _linear_cfg(self, scaling: str, fwd_slot: int = 0, bwd_slot: int = 0, update_bwd: bool = True,
                    gelu: bool = False, need_dgrad: bool = True, need_wgrad: bool = True,
                    norm: tuple = (), handoff: tuple = (), seed_bwd: bool = False,
                    fuse_wgrad: bool = False, wgrad_overwrite: bool = False) -> LinearCfg:
        """The constant configuration of one linear layer's autograd function for this forward;
        norm: () or (kind, eps, zero_centered_gamma) of a fused norm; handoff: () or (fp8_input,
        fp8_output). Kept per distinct configuration and recipe settings (building the frozen
        dataclass every forward costs microseconds)."""
        key = (scaling, fwd_slot, bwd_slot, update_bwd, gelu, need_dgrad, need_wgrad, norm, handoff, seed_bwd,
               fuse_wgrad, wgrad_overwrite, self._recipe_settings(scaling))
        if torch.compiler.is_compiling():  # no cache updates inside a traced graph
            return self._new_linear_cfg(*key)
        cfg = self._linear_cfgs.get(key)
        if cfg is None:
            cfg = self._linear_cfgs[key] = self._new_linear_cfg(*key)
        return cfg

    def _recipe_settings(self, scaling: str) -> tuple:
        """The recipe values a LinearCfg takes: FP8 dtypes and the scaling options."""
        if scaling == "none":
            return ()
        r = self.fp8_meta.recipe
        dtypes = (self.fp8_meta.fp8_dtype("fwd"), self.fp8_meta.fp8_dtype("bwd"))
        if scaling == "current":
            inp, grad = r.fp8_quant_fwd_inp, r.fp8_quant_bwd_grad
            return dtypes + (inp.power_2_scale, float(inp.amax_epsilon), grad.power_2_scale,
                             float(grad.amax_epsilon))
        return dtypes + (r.amax_compute_algo, float(r.margin))

    @staticmethod
    def _new_linear_cfg(scaling, fwd_slot, bwd_slot, update_bwd, gelu, need_dgrad, need_wgrad, norm, handoff,
                        seed_bwd, fuse_wgrad, wgrad_overwrite, settings) -> LinearCfg:
        flags = dict(gelu=gelu, need_dgrad=need_dgrad, need_wgrad=need_wgrad, fuse_wgrad=fuse_wgrad,
                     wgrad_overwrite=wgrad_overwrite)
        if norm:
            flags.update(norm=norm[0], norm_eps=float(norm[1]), norm_zero_centered=bool(norm[2]))
        if handoff:
            flags.update(fp8_input=bool(handoff[0]), fp8_output=bool(handoff[1]))
        if scaling == "none":
            return LinearCfg(**flags)
        if scaling == "current":
            fwd, bwd, inp_pow2, inp_eps, grad_pow2, grad_eps = settings
            extra = dict(inp_pow2=inp_pow2, inp_eps=inp_eps, grad_pow2=grad_pow2, grad_eps=grad_eps)
        else:
            fwd, bwd, algo, margin = settings
            extra = dict(amax_compute_algo=algo, margin=margin)
        return LinearCfg(scaling=scaling, fwd_dtype=fwd, bwd_dtype=bwd, fwd_slot=fwd_slot, bwd_slot=bwd_slot,
                         update_bwd=update_bwd, seed_bwd=seed_bwd, **flags, **extra)

    def _take_bwd_seed(self, scaling: str, bwd_slot: int, grad: bool) -> bool:
        """Whether this forward's backward casts the gradient of bwd_slot with current scaling and
        seeds its empty amax history (LinearCfg.seed_bwd; FP8Meta.take_bwd_seed): the first
        delayed-scaling forward run with gradients enabled."""
        return scaling == "delayed" and grad and self.fp8_meta.take_bwd_seed(1 << bwd_slot)

    def _meta_tensors(self, scaling: str):
        """(fwd scale, fwd amax history, bwd scale, bwd amax history), or Nones without delayed state."""
        if scaling not in ("delayed", "calibrate"):
            return None, None, None, None
        m = self.fp8_meta
        return (*self._fwd_scale_and_history(), m.scale["bwd"], m.amax_history["bwd"])

    def _fwd_scale_and_history(self):
        """The forward scales and amax history the casts of this forward use."""
        if FP8GlobalState.recompute_stash is not None:
            return self._recompute_fwd_meta
        return self.fp8_meta.scale["fwd"], self.fp8_meta.amax_history["fwd"]

    def _quantized_weight(self, weight: torch.Tensor, cfg: LinearCfg, slot: int,
                          is_first_microbatch: Optional[bool]) -> Optional[QuantizedWeight]:
        """The FP8 copy of `weight` for this forward (None in high precision).

        is_first_microbatch (TE semantics): None -> cast every call; True -> cast and keep the copy;
        False -> reuse the kept copy (the weight is assumed unchanged since), casting only if none
        is kept. Calibration records the weight's amax and returns None."""
        if cfg.scaling == "none":
            return None
        if isinstance(weight, Float8Tensor):  # an FP8 parameter: its bytes are the GEMM operand
            if cfg.scaling == "calibrate":
                return None
            return QuantizedWeight(*weight.fp8_operand(cfg.fwd_dtype, cfg.need_dgrad), cfg.fwd_dtype)
        if cfg.scaling != "calibrate" and is_first_microbatch is False:
            cached = self._fp8_weight_cache.get(slot)
            if cached is not None and cached.fp8_dtype == cfg.fwd_dtype:
                return cached
        w = weight.detach()
        w = w if w.is_contiguous() else w.contiguous()
        caching = is_first_microbatch is not None and cfg.scaling != "calibrate"
        if cfg.scaling == "current":
            r = self.fp8_meta.recipe.fp8_quant_fwd_weight
            scale, hist, pow2, eps = None, None, r.power_2_scale, float(r.amax_epsilon)
        else:
            (scale, hist), pow2, eps = self._fwd_scale_and_history(), False, 0.0
        data, transpose, scale_inv, _ = custom_ops.quantize(
            w, scale, hist, slot, cfg.fwd_dtype, True, cfg.need_dgrad or caching, False, pow2, eps)
        if cfg.scaling == "calibrate":
            return None
        q = QuantizedWeight(data, transpose, scale_inv, cfg.fwd_dtype)
        if caching:
            self._fp8_weight_cache[slot] = q
        return q

    def _linear(self, x2: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], scaling: str,
                is_first_microbatch: Optional[bool], fwd_slot: int = 0, bwd_slot: int = 0, update_bwd: bool = True,
                gelu: bool = False, norm=None, fp8_input: bool = False, fp8_output: bool = False,
                rows: int = 0, wgrad_to: Optional[tuple] = None) -> torch.Tensor:
        """act(x2 W^T + b) through the shared linear autograd function, in this forward's scaling mode.
        Delayed-scaling slots: input fwd_slot, weight fwd_slot + 1, output gradient bwd_slot.
        norm = (kind, weight, bias, eps, zero_centered_gamma): x2 is the input of that norm, which
        runs inside the linear's autograd function with its output cast to FP8 by the norm kernel
        (delayed scaling only; callers pass the norm's output and no norm otherwise).
        fp8_input: x2 is the FP8 hand-off of a [rows, in] input; fp8_output: the output is returned
        as an FP8 hand-off (fp8_handoff.py; delayed scaling only: output slot fwd_slot + 2, input
        gradient slot bwd_slot + 1). wgrad_to: the Parameters (rows of `weight` in order) whose
        main_grad receives the weight gradient (fuse_wgrad_accumulation); None -> _wgrad_params()."""
        if (fp8_input or fp8_output) and scaling != "delayed":
            raise RuntimeError(f"FP8 hand-offs between modules need delayed scaling, got scaling mode {scaling!r}")
        need_dgrad, need_wgrad = grad_needs(x2, weight, bias)
        if wgrad_to is None:
            wgrad_to = self._wgrad_params() if hasattr(self, "_wgrad_params") else ()
        fuse_wgrad = bool(wgrad_to) and need_wgrad and weight.requires_grad
        if fuse_wgrad:
            check_main_grads(wgrad_to, type(self).__name__)
        if norm is not None:
            need_dgrad = need_dgrad or (torch.is_grad_enabled() and any(
                p is not None and p.requires_grad for p in norm[1:3]))
        norm_w = norm_b = None
        norm_cfg = ()
        if norm is not None:
            kind, norm_w, norm_b, eps, zc = norm
            norm_cfg = (kind, eps, zc)
        handoff = (fp8_input, fp8_output) if (fp8_input or fp8_output) else ()
        seed = not fp8_output and self._take_bwd_seed(scaling, bwd_slot, need_dgrad or need_wgrad)
        cfg = self._linear_cfg(scaling, fwd_slot, bwd_slot, update_bwd, gelu, need_dgrad, need_wgrad, norm_cfg,
                               handoff, seed, fuse_wgrad, fuse_wgrad and is_first_microbatch is True)
        qweight = self._quantized_weight(weight, cfg, fwd_slot + 1, is_first_microbatch)
        return linear_fn(x2, weight, bias, cfg, qweight, self._meta_tensors(scaling), norm_w, norm_b, rows,
                         wgrad_to if fuse_wgrad else ())

    def reset_fp8_meta_tensors(self) -> None:
        """TE's: zero the amax histories and set the scales to 1 (the FP8 state of a fresh module)."""
        self.fp8_meta.reset_tensors()
        self._fp8_weight_cache.clear()

    def set_tensor_parallel_group(self, tp_group) -> None:
        """TE's: the tensor-parallel group. Only a group of one rank (or None) is implemented."""
        self.tp_group = check_tp_group(tp_group, type(self).__name__)

    def get_extra_state(self):
        return self.fp8_meta.state()

    def set_extra_state(self, state) -> None:
        dev = next((p.device for p in self.parameters() if p.device.type != "meta"), default_device())
        self.fp8_meta.load(state, dev)


def check_input(inp: torch.Tensor, features: int, name: str) -> None:
    if not isinstance(inp, torch.Tensor):
        raise TypeError(f"{name}: input must be a torch.Tensor, got {type(inp).__name__}")
    if not inp.is_floating_point():
        raise TypeError(f"{name}: input must be a floating-point tensor, got {inp.dtype}")
    if inp.dim() < 1 or inp.shape[-1] != features:
        raise ValueError(f"{name}: input's last dimension must be {features}, got shape {tuple(inp.shape)}")
    if inp.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{name}: input must be on the CPU or a CUDA device, got {inp.device}")


def check_tp_group(tp_group, name: str):
    """tp_group, if it has one rank (or is None); tensor parallelism over more is not implemented."""
    if tp_group is not None and torch.distributed.is_available() and torch.distributed.is_initialized():
        size = torch.distributed.get_world_size(tp_group)
        if size != 1:
            raise NotImplementedError(f"{name}: tensor parallelism over a group of {size} ranks is not implemented")
    return tp_group


def reset_fp8_meta_tensors(module: torch.nn.Module) -> None:
    """reset_fp8_meta_tensors() of every TE module inside `module` (MultiheadAttention,
    TransformerLayer: containers of them)."""
    for m in module.modules():
        if m is not module and isinstance(getattr(m, "fp8_meta", None), FP8Meta):  # (attention's too)
            m.fp8_meta.reset_tensors()
            getattr(m, "_fp8_weight_cache", {}).clear()


def set_tensor_parallel_group(module: torch.nn.Module, tp_group) -> None:
    """set_tensor_parallel_group(tp_group) of every TE module inside `module`."""
    check_tp_group(tp_group, type(module).__name__)
    module.tp_group = tp_group
    for m in module.modules():
        if m is not module and hasattr(m, "set_tensor_parallel_group"):
            m.tp_group = tp_group


def check_main_grads(params, name: str) -> None:
    """fuse_wgrad_accumulation: every weight carries a `main_grad` buffer of its shape on its device
    (TE: "a pre-allocated buffer of the correct size to accumulate gradients in")."""
    for p in params:
        if not p.requires_grad or hasattr(p, "__fsdp_param__"):
            continue  # (a frozen split takes no gradient; Megatron-FSDP makes main_grad before backward)
        g = getattr(p, "main_grad", None)
        if not isinstance(g, torch.Tensor):
            raise RuntimeError(f"{name}: fuse_wgrad_accumulation=True needs each weight's `main_grad` (a buffer of "
                               f"the weight's shape the weight gradient is accumulated into); a weight of shape "
                               f"{tuple(p.shape)} has none")
        if tuple(g.shape) != tuple(p.shape) or g.device != p.device or \
                g.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"{name}: a weight's main_grad must have the weight's shape {tuple(p.shape)} and device "
                             f"{p.device} and be float32 / bfloat16 / float16, got {tuple(g.shape)} {g.dtype} on "
                             f"{g.device}")


def check_same_device(inp: torch.Tensor, params, name: str) -> None:
    device = inp.device
    for p in params:
        if p is not None and p.device != device:
            raise ValueError(f"{name}: input is on {device} but the module's parameters are on {p.device}")


def autocast_params(device: torch.device, *params):
    """params as this forward computes with them: under torch.autocast on their device (TE's
    semantics: the module runs in autocast's dtype), high-precision parameters of another dtype
    are cast to it by a differentiable copy, so their gradients still arrive in the parameter's
    own dtype; FP8 parameters (quantized_model_init) are GEMM operands as they are."""
    dev = device.type
    if dev not in ("cpu", "cuda") or not torch.is_autocast_enabled(dev):
        return params
    dt = torch.get_autocast_dtype(dev)
    return tuple(p if p is None or p.dtype == dt or isinstance(p, Float8Tensor) else p.to(dt) for p in params)


def as_2d(inp: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Contiguous [tokens, features] view/copy of inp in the compute dtype."""
    x = inp if inp.dim() == 2 else inp.reshape(-1, inp.shape[-1])
    if x.dtype != dtype:
        x = x.to(dtype)
    return x.contiguous()


__all__ = ["TransformerEngineBaseModule", "default_device", "resolve_device", "resolve_dtype",
           "default_init_method", "check_input", "check_same_device", "check_main_grads", "check_tp_group",
           "reset_fp8_meta_tensors", "set_tensor_parallel_group", "autocast_params", "as_2d", "_ops"]
