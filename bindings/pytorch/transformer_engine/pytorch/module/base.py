"""Shared machinery of the TE modules: device / dtype defaults, meta-device materialisation,
FP8 metadata ownership and its state_dict entry (`_extra_state`)."""
from __future__ import annotations

from typing import Callable, Optional

import torch

from .. import _ops
from ..fp8 import FP8GlobalState, FP8Meta

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
        with torch.no_grad():
            self._init_parameters()

    def _init_parameters(self) -> None:  # pragma: no cover - subclasses
        raise NotImplementedError

    # ------------------------------------------------------------------ FP8
    def _fp8_mode(self, device: torch.device):
        """(fp8, calibrating) for this forward; prepares the metadata when either is on."""
        st = FP8GlobalState
        fp8 = bool(st.enabled)
        calibrating = bool(st.calibrating) and not fp8
        if fp8 or calibrating:
            if device.type == "meta":
                raise RuntimeError("parameters are on the meta device; call reset_parameters() first")
            self.fp8_meta.prepare(st.recipe, device)
            st.register_forward(self.fp8_meta)
        return fp8, calibrating

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


def check_same_device(inp: torch.Tensor, params, name: str) -> None:
    for p in params:
        if p is not None and p.device != inp.device:
            raise ValueError(f"{name}: input is on {inp.device} but the module's parameters are on {p.device}")


def as_2d(inp: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Contiguous [tokens, features] view/copy of inp in the compute dtype."""
    x = inp.reshape(-1, inp.shape[-1])
    if x.dtype != dtype:
        x = x.to(dtype)
    return x.contiguous()


__all__ = ["TransformerEngineBaseModule", "default_device", "resolve_device", "resolve_dtype",
           "default_init_method", "check_input", "check_same_device", "as_2d", "_ops"]
