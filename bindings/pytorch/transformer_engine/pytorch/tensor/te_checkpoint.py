"""Loading Float8Tensors that NVIDIA Transformer Engine 2.x pickled (torch.save of a module's
state_dict holding FP8 parameters made under fp8_model_init / quantized_model_init).

What TE 2.x writes for one Float8Tensor (module transformer_engine.pytorch.tensor.float8_tensor,
the same path as this package's):
  * the callable: either the class method `Float8Tensor._make_in_reduce_ex` (pickled as
    `getattr(Float8Tensor, "_make_in_reduce_ex")`, most TE 2.x releases) or, in the newest
    releases, the module function `_make_float8_tensor_in_reduce_ex`;
  * the arguments (data, fp8_dtype, fp8_scale_inv, dtype[, shape]): the uint8 bytes, the FP8 format,
    the float32 scale_inv, the nominal torch dtype and (not in the first 2.x releases) the shape.
float8_tensor.py provides both callables; they build this package's Float8Tensor (no transpose,
no quantizer: a parameter loads it with copy_, which takes the bytes and scale_inv as they are).

The FP8 format is TE's DType, pickled in one of three ways:
  A. the pybind11 enum `transformer_engine_torch.DType` with pybind11's default pickling: an object
     made with `DType.__new__(DType)` whose state is set to the enum's int (most TE 2.x releases);
  B. the same enum with TE's own __reduce_ex__: `transformer_engine_torch.DType(int)`;
  C. the Python IntEnum `transformer_engine.pytorch.constants.DType(int)` (newest releases).
B and C come from TE releases whose DType numbering has kInt16 = 1, hence kFloat8E4M3 = 7 and
kFloat8E5M2 = 8, as this package's DType. The int of A depends on the TE release that wrote it:
earlier 2.x releases had no kInt16 (kFloat8E4M3 = 6, kFloat8E5M2 = 7), later ones do (7, 8). A
Float8Tensor is never in BFloat16 (6 in the later numbering) or E8M0 (8 in the earlier one), so 6
is E4M3 and 8 is E5M2 in either; 7 is E5M2 in the earlier numbering and E4M3 in the later one and
cannot be told from the pickle. Loading an A-pickled 7 therefore raises unless the numbering is
given with `te_dtype_numbering(e4m3=6 or 7)`: the value `int(transformer_engine_torch.DType.
kFloat8E4M3)` had in the TE that wrote the checkpoint.

The module `transformer_engine_torch` (TE's compiled extension) does not exist here. Loading:
  * torch.load(f) / torch.load(f, weights_only=True) (the default since torch 2.6): works for all
    three forms. Importing transformer_engine.pytorch registers with torch's weights-only
    unpickler the stand-in DType of this module under the name `transformer_engine_torch.DType`,
    the class and the function above, and, under the name `builtins.getattr`, a getattr that
    fetches only `Float8Tensor._make_in_reduce_ex` (the class-method form needs a getattr call; it
    behaves as the real getattr when that is allowlisted too). TE itself cannot load the
    class-method form with weights_only=True.
  * torch.load(f, weights_only=False): pickle imports `transformer_engine_torch` for forms A and B
    and fails with ModuleNotFoundError; pass `pickle_module=` this module
    (`torch.load(f, weights_only=False, pickle_module=te_checkpoint)`), whose Unpickler maps that
    name to the stand-in. Form C loads as it is.
TE 1.x checkpoints (module transformer_engine.pytorch.float8_tensor) are not handled.
"""
from __future__ import annotations

import contextlib
import pickle
import threading
from typing import Optional

__all__ = ["DType", "te_dtype_numbering", "fp8_dtype_from_te", "Unpickler", "load", "loads"]

# this package's DType numbering (include/transformer_engine/transformer_engine.h), which is TE's
# numbering with kInt16
_E4M3, _E5M2 = 7, 8
_LATER = {7: _E4M3, 8: _E5M2}            # TE releases with kInt16 (forms B and C always)
_EARLIER = {6: _E4M3, 7: _E5M2}          # TE releases without kInt16
_numbering = threading.local()          # .e4m3: set by te_dtype_numbering, per thread


class DType:
    """Stand-in for TE's pybind11 enum `transformer_engine_torch.DType` while unpickling. Made by
    pybind11's default pickling (form A: __new__ then __setstate__(int)) or by TE's own
    (form B: DType(int)); records which, since only A leaves the numbering open."""

    __slots__ = ("value", "from_state")

    def __new__(cls, value: Optional[int] = None):
        self = object.__new__(cls)
        self.value = None if value is None else int(value)
        self.from_state = False
        return self

    def __setstate__(self, state) -> None:
        self.value = int(state)
        self.from_state = True

    def __int__(self) -> int:
        return int(self.value)

    def __repr__(self) -> str:
        return f"transformer_engine_torch.DType({self.value})"


@contextlib.contextmanager
def te_dtype_numbering(e4m3: int):
    """Within the block, TE DType ints pickled by pybind11's default pickling (form A) are read
    in the numbering whose kFloat8E4M3 is `e4m3`: 6 (TE releases without DType.kInt16) or 7 (with
    it); the value of `int(transformer_engine_torch.DType.kFloat8E4M3)` in the TE that wrote the
    checkpoint."""
    if e4m3 not in (6, 7):
        raise ValueError(f"te_dtype_numbering: kFloat8E4M3 is 6 or 7 in TE's numberings, got {e4m3!r}")
    prev, _numbering.e4m3 = getattr(_numbering, "e4m3", None), int(e4m3)
    try:
        yield
    finally:
        _numbering.e4m3 = prev


def fp8_dtype_from_te(obj) -> int:
    """This package's DType int of the FP8 format TE pickled as `obj` (see the module docstring)."""
    from .. import constants  # the IntEnum of form C

    if isinstance(obj, constants.DType):
        value, open_numbering = int(obj), False
    elif isinstance(obj, DType):
        if obj.value is None:
            raise ValueError("TE checkpoint: a transformer_engine_torch.DType without a value")
        value, open_numbering = obj.value, obj.from_state
    elif type(obj) is int:  # not what TE writes: taken in this package's numbering
        value, open_numbering = obj, False
    elif type(obj).__module__ == "transformer_engine_torch" and hasattr(obj, "__int__"):
        # the real TE extension is importable: its enum member carries the int the checkpoint held,
        # in the numbering of the TE that wrote it, which need not be the installed one
        value, open_numbering = int(obj), True
    else:
        raise TypeError(f"TE checkpoint: unexpected FP8 format object {obj!r} ({type(obj).__module__}."
                        f"{type(obj).__qualname__})")
    if not open_numbering:
        if value not in _LATER:
            raise ValueError(f"TE checkpoint: DType value {value} is not an FP8 format of a Float8Tensor "
                             "(kFloat8E4M3 = 7, kFloat8E5M2 = 8)")
        return _LATER[value]
    e4m3_value = getattr(_numbering, "e4m3", None)
    if e4m3_value is not None:
        table = _EARLIER if e4m3_value == 6 else _LATER
        if value not in table:
            raise ValueError(f"TE checkpoint: DType value {value} is not an FP8 format in the numbering with "
                             f"kFloat8E4M3 = {e4m3_value} (te_dtype_numbering)")
        return table[value]
    if value == 6:
        return _E4M3  # kFloat8E4M3 without kInt16 (with it, 6 is kBFloat16: never a Float8Tensor's)
    if value == 8:
        return _E5M2  # kFloat8E5M2 with kInt16 (without it, 8 is kFloat8E8M0: never a Float8Tensor's)
    if value == 7:
        raise ValueError(
            "TE checkpoint: this Float8Tensor's FP8 format was pickled as transformer_engine_torch.DType "
            "value 7, which is kFloat8E5M2 in TE releases without DType.kInt16 and kFloat8E4M3 in those with "
            "it; the pickle does not say which TE wrote it. Load inside `with transformer_engine.pytorch."
            "tensor.te_checkpoint.te_dtype_numbering(e4m3=N):` where N is int(transformer_engine_torch.DType."
            "kFloat8E4M3) in the TE that saved the checkpoint (6 or 7).")
    raise ValueError(f"TE checkpoint: DType value {value} is not an FP8 format of a Float8Tensor in either TE "
                     "numbering")


def restricted_getattr(obj, name):
    """`builtins.getattr` for torch's weights-only unpickler: fetches only
    Float8Tensor._make_in_reduce_ex (TE's class-method pickling), unless the real getattr is
    allowlisted as well, in which case it is the real getattr."""
    import torch

    from .float8_tensor import Float8Tensor

    if obj is Float8Tensor and name == "_make_in_reduce_ex":
        return Float8Tensor._make_in_reduce_ex
    # the real getattr allowlisted by the caller, bare or in torch's (object, name) form
    if any(g is getattr or (isinstance(g, tuple) and g and g[0] is getattr)
           for g in torch.serialization.get_safe_globals()):
        return getattr(obj, name)
    raise pickle.UnpicklingError(
        f"weights-only load: getattr({obj!r}, {name!r}) is not allowed (transformer_engine allows only "
        "getattr(Float8Tensor, '_make_in_reduce_ex'), which TE checkpoints use)")


class Unpickler(pickle.Unpickler):
    """pickle's Unpickler, with TE's `transformer_engine_torch.DType` read as this module's
    stand-in (for torch.load(..., weights_only=False, pickle_module=te_checkpoint))."""

    def find_class(self, module, name):
        if (module, name) == ("transformer_engine_torch", "DType"):
            return DType
        return super().find_class(module, name)


def load(file, **kwargs):
    return Unpickler(file, **kwargs).load()


def loads(data: bytes, **kwargs):
    import io

    return Unpickler(io.BytesIO(data), **kwargs).load()


# what torch.load / torch.save may also ask a pickle_module for
Pickler = pickle.Pickler
dump, dumps = pickle.dump, pickle.dumps
UnpicklingError = pickle.UnpicklingError
