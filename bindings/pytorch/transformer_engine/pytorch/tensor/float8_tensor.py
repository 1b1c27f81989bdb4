"""Float8Tensor: a weight parameter stored only in FP8 (quantized_model_init / fp8_model_init).

The tensor presents itself to PyTorch as a tensor of its nominal (high-precision) dtype and
shape, but holds no storage of that dtype: only
  _data       uint8 [rows, cols]   the FP8 bytes (format `_fp8_dtype`, a DType value)
  _transpose  uint8 [cols, rows]   the same bytes transposed, or None (kept when the parameter is
                                   created with grad enabled: the backward's dgrad GEMM reads it)
  _scale_inv  float32 [1]          1 / the scale the bytes were produced with
plus a `WeightQuantizer` saying how a new high-precision value is cast (the module's forward
weight slot and the recipe given to quantized_model_init).

The modules' weight-cast step hands _data / _transpose / _scale_inv to the FP8 GEMMs directly
(no cast in the forward). Everything else goes through __torch_dispatch__:
  * detach / alias / same-shape view: another Float8Tensor sharing the buffers (so
    `param.data.copy_(x)` writes the parameter);
  * copy_: from a Float8Tensor of the same format, the bytes and scale_inv are copied; from
    anything else, the value is cast to FP8 with the parameter's quantizer (the library's cast);
  * clone / deepcopy / pickling: a Float8Tensor again;
  * cat along dim 0 of Float8Tensors with equal format and scale_inv (the split QKV weights of a
    MultiheadAttention): a Float8Tensor of the concatenated bytes;
  * every other op runs on the dequantized value (the library's dequantize); an op that writes
    one of its arguments in place (param.add_(grad) in torch.optim.SGD, addcdiv_ in Adam, the
    init methods' normal_) re-quantizes the result into that Float8Tensor.
So an optimizer updates the FP8 parameter as TE's does: the update is computed in high precision
and cast back (precision lost in that cast stays lost unless the optimizer keeps master weights).

Not supported: torch.compile over modules holding Float8Tensor parameters (no
__tensor_flatten__), moving such a module to another device after it was built (build it on its
device), views other than same-shape ones (they are dequantized copies, not views). The cat
above compares scale_invs with torch.equal, a device synchronisation on CUDA.
"""
from __future__ import annotations

import copy
from typing import Optional

import torch
from torch.utils._pytree import tree_map

from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling, Recipe

from .. import custom_ops

__all__ = ["Float8Tensor", "WeightQuantizer"]

aten = torch.ops.aten


class WeightQuantizer:
    """How a weight parameter is cast to FP8: its module's FP8Meta and forward slot (DelayedScaling:
    the slot's current scale is used and the weight's amax is max-accumulated into the slot's amax
    history, as a forward cast of a high-precision weight would), or the recipe's weight QParams
    (Float8CurrentScaling: the scale comes from the value's own amax)."""

    def __init__(self, recipe: Recipe, fp8_dtype: int, meta=None, slot: int = 0):
        if isinstance(recipe, DelayedScaling) and meta is None:
            raise ValueError("WeightQuantizer: DelayedScaling needs the module's FP8Meta")
        self.recipe, self.fp8_dtype, self.meta, self.slot = recipe, int(fp8_dtype), meta, int(slot)

    def __call__(self, src: torch.Tensor, columnwise: bool):
        """(data, transpose or None, scale_inv) of the FP8 cast of the 2D high-precision `src`."""
        if isinstance(self.recipe, Float8CurrentScaling):
            q = self.recipe.fp8_quant_fwd_weight
            d, t, si, _ = custom_ops.quantize(src, None, None, 0, self.fp8_dtype, True, columnwise, False,
                                              bool(q.power_2_scale), float(q.amax_epsilon))
        else:
            scale, hist = self.meta.scale["fwd"], self.meta.amax_history["fwd"]
            if scale.device != src.device:
                raise ValueError(f"FP8 parameter on {src.device} but its module's FP8 metadata is on {scale.device}")
            d, t, si, _ = custom_ops.quantize(src, scale, hist, self.slot, self.fp8_dtype, True, columnwise, False,
                                              False, 0.0)
        return d, (t if columnwise else None), si


def _rebuild_float8_tensor(data, transpose, scale_inv, fp8_dtype, dtype, requires_grad):
    return Float8Tensor(data, transpose, scale_inv, fp8_dtype, dtype, None, requires_grad)


# torch.load(weights_only=True) (the default) must be allowed to rebuild one
torch.serialization.add_safe_globals([_rebuild_float8_tensor])


class Float8Tensor(torch.Tensor):
    """A 2D tensor held only as FP8 bytes + scale_inv (see the module docstring)."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, data: torch.Tensor, transpose: Optional[torch.Tensor], scale_inv: torch.Tensor, fp8_dtype: int,
                dtype: torch.dtype, quantizer: Optional[WeightQuantizer] = None, requires_grad: bool = False):
        if data.dtype != torch.uint8 or data.dim() != 2:
            raise ValueError(f"Float8Tensor: data must be uint8 [rows, cols], got {data.dtype} {tuple(data.shape)}")
        self = torch.Tensor._make_wrapper_subclass(cls, tuple(data.shape), dtype=dtype, device=data.device,
                                                   requires_grad=requires_grad)
        self._data, self._transpose, self._scale_inv = data, transpose, scale_inv
        self._fp8_dtype, self._quantizer = int(fp8_dtype), quantizer
        return self

    # ------------------------------------------------------------------ construction / value
    @classmethod
    def quantize(cls, src: torch.Tensor, quantizer: WeightQuantizer, columnwise: bool = True,
                 requires_grad: bool = False) -> "Float8Tensor":
        """The FP8 cast of the high-precision 2D tensor `src` with `quantizer`."""
        x = src.detach().contiguous()
        d, t, si = quantizer(x, columnwise)
        return cls(d, t, si, quantizer.fp8_dtype, x.dtype, quantizer, requires_grad)

    def dequantize(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """A plain tensor of the value (float(data) * scale_inv) in `dtype` (default: the nominal dtype)."""
        return custom_ops.dequantize(self._data, self._scale_inv, self._fp8_dtype, dtype or self.dtype)

    def _alias(self) -> "Float8Tensor":
        out = Float8Tensor(self._data, self._transpose, self._scale_inv, self._fp8_dtype, self.dtype, self._quantizer)
        if hasattr(self, "_high_precision_init_val"):
            out._high_precision_init_val = self._high_precision_init_val
        return out

    def _quantize_from(self, src: torch.Tensor) -> None:
        """In place: this tensor's bytes and scale_inv become the FP8 cast of `src`."""
        if isinstance(src, Float8Tensor):
            if src._fp8_dtype == self._fp8_dtype and tuple(src.shape) == tuple(self.shape):
                self._data.copy_(src._data)
                if self._transpose is not None:
                    self._transpose.copy_(src._transpose if src._transpose is not None else src._data.t())
                self._scale_inv.copy_(src._scale_inv)
                return
            src = src.dequantize()
        x = src.to(device=self.device, dtype=self.dtype).expand(self.shape).contiguous()
        q = self._quantizer
        if q is None:  # e.g. a tensor unpickled on its own: current scaling in its own format
            q = WeightQuantizer(Float8CurrentScaling(), self._fp8_dtype)
        d, t, si = q(x, self._transpose is not None)
        self._data.copy_(d)
        if self._transpose is not None:
            self._transpose.copy_(t)
        self._scale_inv.copy_(si)

    # ------------------------------------------------------------------ what the modules use
    def fp8_operand(self, fp8_dtype: int, need_transpose: bool):
        """(data, transpose or the empty placeholder, scale_inv) in the FP8 format `fp8_dtype`: the
        stored bytes when the format matches (the transpose is made from them when not kept), else a
        current-scaling cast of the dequantized value."""
        if int(fp8_dtype) != self._fp8_dtype:
            d, t, si, _ = custom_ops.quantize(self.dequantize(), None, None, 0, int(fp8_dtype), True, need_transpose,
                                              False, False, 0.0)
            return d, t, si
        t = self._transpose
        if t is None:
            t = self._data.t().contiguous() if need_transpose else custom_ops.missing(self.device)
        return self._data, t, self._scale_inv

    def get_high_precision_init_val(self) -> Optional[torch.Tensor]:
        """The high-precision value this parameter was initialised from (CPU), when created with
        quantized_model_init(preserve_high_precision_init_val=True); else None."""
        return getattr(self, "_high_precision_init_val", None)

    def clear_high_precision_init_val(self) -> None:
        """Release the kept high-precision initial value."""
        if hasattr(self, "_high_precision_init_val"):
            del self._high_precision_init_val

    @property
    def fp8_dtype(self) -> int:
        return self._fp8_dtype

    # .data (TE's): reading gives an alias; assigning a tensor casts it into this tensor's bytes
    # (a Float8Tensor of the same format is taken as it is), as `param.data = new` is used to load
    # or reset weights. (torch.Tensor's own setter would swap in a plain tensor's storage.)
    def _get_data(self) -> "Float8Tensor":
        return self._alias()

    def _set_data(self, value: torch.Tensor) -> None:
        if tuple(value.shape) != tuple(self.shape):
            raise ValueError(f"Float8Tensor.data: cannot assign a tensor of shape {tuple(value.shape)} to one of "
                             f"shape {tuple(self.shape)}")
        self._quantize_from(value)

    data = property(_get_data, _set_data)

    # Conversions to a plain tensor (TE's QuantizedTensor: always a dequantized copy, never self)
    def float(self, memory_format=torch.preserve_format) -> torch.Tensor:
        return self.dequantize(torch.float32)

    def bfloat16(self, memory_format=torch.preserve_format) -> torch.Tensor:
        return self.dequantize(torch.bfloat16)

    def half(self, memory_format=torch.preserve_format) -> torch.Tensor:
        return self.dequantize(torch.float16)

    def cpu(self, memory_format=torch.preserve_format) -> torch.Tensor:
        return self.dequantize().cpu()

    # ------------------------------------------------------------------ python protocol
    def __repr__(self, *, tensor_contents=None):
        return (f"Float8Tensor(fp8_dtype={self._fp8_dtype}, scale_inv={float(self._scale_inv)}, "
                f"value={self.dequantize()!r})")

    def __reduce_ex__(self, protocol):
        return (_rebuild_float8_tensor, (self._data, self._transpose, self._scale_inv, self._fp8_dtype, self.dtype,
                                         self.requires_grad))

    def __deepcopy__(self, memo):
        if id(self) in memo:
            return memo[id(self)]
        out = Float8Tensor(self._data.clone(), None if self._transpose is None else self._transpose.clone(),
                           self._scale_inv.clone(), self._fp8_dtype, self.dtype,
                           copy.deepcopy(self._quantizer, memo), self.requires_grad)
        if getattr(self, "_is_param", False):
            out = torch.nn.Parameter(out, requires_grad=self.requires_grad)
        if hasattr(self, "_high_precision_init_val"):
            out._high_precision_init_val = self._high_precision_init_val.clone()
        memo[id(self)] = out
        return out

    # ------------------------------------------------------------------ dispatch
    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (aten.detach.default, aten.alias.default):
            return args[0]._alias()
        if func in (aten.view.default, aten._unsafe_view.default, aten.reshape.default) and \
                tuple(args[1]) == tuple(args[0].shape):
            return args[0]._alias()
        if func is aten.clone.default:
            s = args[0]
            return Float8Tensor(s._data.clone(), None if s._transpose is None else s._transpose.clone(),
                                s._scale_inv.clone(), s._fp8_dtype, s.dtype, s._quantizer)
        if func is aten.copy_.default:
            dst, src = args[0], args[1]
            if isinstance(dst, Float8Tensor):
                dst._quantize_from(src)
            else:
                dst.copy_(src.dequantize(dst.dtype) if isinstance(src, Float8Tensor) else src)
            return dst
        if func is aten._to_copy.default and set(kwargs) <= {"device"} and kwargs.get("device") is not None:
            s, dev = args[0], kwargs["device"]
            return Float8Tensor(s._data.to(dev), None if s._transpose is None else s._transpose.to(dev),
                                s._scale_inv.to(dev), s._fp8_dtype, s.dtype, s._quantizer)
        if func is aten.cat.default:
            out = cls._cat(*args, **kwargs)
            if out is not None:
                return out
        return cls._on_dequantized(func, args, kwargs)

    @classmethod
    def _cat(cls, tensors, dim=0):
        ts = list(tensors)
        if dim != 0 or not all(isinstance(t, Float8Tensor) for t in ts):
            return None
        first = ts[0]
        if any(t._fp8_dtype != first._fp8_dtype or t.dtype != first.dtype for t in ts):
            return None
        if not all(torch.equal(t._scale_inv, first._scale_inv) for t in ts[1:]):
            return None
        data = torch.cat([t._data for t in ts], 0)
        tr = None
        if all(t._transpose is not None for t in ts):
            tr = torch.cat([t._transpose for t in ts], 1)
        return Float8Tensor(data, tr, first._scale_inv.clone(), first._fp8_dtype, first.dtype, None)

    @classmethod
    def _on_dequantized(cls, func, args, kwargs):
        """Run func on dequantized values; write in-place results back into the FP8 arguments."""
        plain = {}

        def unwrap(t):
            if isinstance(t, Float8Tensor):
                if id(t) not in plain:
                    plain[id(t)] = (t, t.dequantize())
                return plain[id(t)][1]
            return t

        pargs, pkwargs = tree_map(unwrap, args), tree_map(unwrap, kwargs)
        out = func(*pargs, **pkwargs)
        written = {}
        for i, a in enumerate(func._schema.arguments):
            if a.alias_info is None or not a.alias_info.is_write:
                continue
            orig = args[i] if i < len(args) else kwargs.get(a.name)
            hp = pargs[i] if i < len(args) else pkwargs.get(a.name)
            # a list argument: the _foreach_* / _fused_* ops of torch's optimizers (foreach=True,
            # fused=True) update every parameter of the list in place
            pairs = zip(orig, hp) if isinstance(orig, (list, tuple)) else [(orig, hp)]
            for o, h in pairs:
                if isinstance(o, Float8Tensor):
                    o._quantize_from(h)
                    written[id(h)] = o
        if written:
            out = tree_map(lambda t: written.get(id(t), t) if isinstance(t, torch.Tensor) else t, out)
        return out
