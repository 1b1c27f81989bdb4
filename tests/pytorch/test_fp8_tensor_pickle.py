"""Loading Float8Tensors pickled by NVIDIA Transformer Engine 2.x (tensor/te_checkpoint.py).

TE 2.x's Float8Tensor.__reduce_ex__ returns (Float8Tensor._make_in_reduce_ex, (data, fp8_dtype,
scale_inv, dtype, shape)) (the first 2.x releases: without shape; the newest: the module function
_make_float8_tensor_in_reduce_ex with the same arguments), with fp8_dtype TE's DType. The
checkpoints here are written by torch.save from stand-ins that pickle exactly so: a stand-in tensor
whose __reduce_ex__ returns that callable (our class sits at TE's module path, so the bound class
method pickles as getattr(<that class>, "_make_in_reduce_ex"), as TE's does) and stand-ins of TE's
DType: the pybind11 enum `transformer_engine_torch.DType` with pybind11's default pickling (form A:
__getstate__ gives the int; checked against bytes assembled by hand), with TE's own __reduce_ex__
(form B: DType(int)), and the IntEnum transformer_engine.pytorch.constants.DType (form C). The
opcodes of each stream are checked, and the module `transformer_engine_torch` exists only while
writing."""
import contextlib
import io
import pickle
import pickletools
import sys
import types
import zipfile

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common import recipe
from transformer_engine.pytorch import _ops, constants
from transformer_engine.pytorch.tensor import Float8Tensor, te_checkpoint
from transformer_engine.pytorch.tensor import float8_tensor as f8t
from _util import DEVICE, seeded

E4M3, E5M2 = int(_ops.DType.kFloat8E4M3), int(_ops.DType.kFloat8E5M2)
TORCH_FP8 = {E4M3: torch.float8_e4m3fn, E5M2: torch.float8_e5m2}
SHAPES = [(3, 5), (1, 7), (17, 3), (16, 32)]


# ------------------------------------------------------------------ stand-ins of what TE pickles
class _PybindDType:
    """transformer_engine_torch.DType pickled as a pybind11 enum is by default (form A): the
    object's state is the enum's int (pybind11's enum __getstate__), rebuilt with __new__ + BUILD."""

    def __init__(self, value):
        self.value = value

    def __getstate__(self):
        return self.value

    def __setstate__(self, state):
        self.value = state


class _PybindDTypeReduce:
    """transformer_engine_torch.DType with TE's own __reduce_ex__ (form B): DType(int)."""

    def __init__(self, value):
        self.value = value

    def __reduce_ex__(self, protocol):
        return (type(self), (self.value,))


class _TEFloat8Tensor:
    """What TE's Float8Tensor pickles as: its __reduce_ex__'s (callable, arguments)."""

    def __init__(self, fn, args):
        self.fn, self.args = fn, args

    def __reduce_ex__(self, protocol):
        return (self.fn, self.args)


@contextlib.contextmanager
def _tex_module(cls):
    """A module `transformer_engine_torch` whose DType is `cls`, while a checkpoint is written
    (pickle checks that a class is found under the name it writes)."""
    mod = types.ModuleType("transformer_engine_torch")
    old = (cls.__module__, cls.__qualname__, cls.__name__)
    cls.__module__, cls.__qualname__, cls.__name__ = "transformer_engine_torch", "DType", "DType"
    mod.DType = cls
    sys.modules["transformer_engine_torch"] = mod
    try:
        yield
    finally:
        del sys.modules["transformer_engine_torch"]
        cls.__module__, cls.__qualname__, cls.__name__ = old


def _te_dtype(form, value):
    return {"A": _PybindDType, "B": _PybindDTypeReduce}[form](value) if form in "AB" else constants.DType(value)


def _te_save(obj_fn, form):
    """torch.save of {"w": obj_fn()} with the DType stand-in of `form` -> the checkpoint's bytes."""
    buf = io.BytesIO()
    if form in "AB":
        with _tex_module(_PybindDType if form == "A" else _PybindDTypeReduce):
            torch.save({"w": obj_fn()}, buf)
    else:
        torch.save({"w": obj_fn()}, buf)
    return buf.getvalue()


def _data_pkl_ops(blob):
    """[(opcode name, argument)] of the checkpoint's pickle (data.pkl in torch.save's zip)."""
    z = zipfile.ZipFile(io.BytesIO(blob))
    name = [n for n in z.namelist() if n.endswith("data.pkl")][0]
    return [(op.name, arg) for op, arg, _ in pickletools.genops(z.read(name))]


def _fp8_input(gen, shape, fmt, structured):
    """(uint8 bytes of FP8 values, float32 scale_inv) of a TE Float8Tensor."""
    n = shape[0] * shape[1]
    if structured:  # every byte pattern in turn, NaN / Inf patterns excepted
        b = torch.arange(n * 2, dtype=torch.int64) % 256
        ok = torch.isfinite(b.to(torch.uint8).view(TORCH_FP8[fmt]).float())
        data = b[ok][:n].to(torch.uint8).reshape(shape)
        scale_inv = torch.tensor([0.375])
    else:
        x = torch.randn(shape, generator=gen) * 3
        data = x.to(TORCH_FP8[fmt]).view(torch.uint8)
        scale_inv = torch.rand(1, generator=gen) * 2 + 1e-3
    return data, scale_inv.to(torch.float32)


def _expected(data, scale_inv, fmt):
    return data.view(TORCH_FP8[fmt]).to(torch.float32) * scale_inv


def _assert_loaded(w, data, scale_inv, fmt, dtype, shape):
    assert isinstance(w, Float8Tensor)
    assert w.fp8_dtype == fmt and w.dtype == dtype and tuple(w.shape) == tuple(shape)
    assert torch.equal(w._data.cpu(), data.reshape(shape)) and torch.equal(w._scale_inv.cpu(), scale_inv)
    torch.testing.assert_close(w.dequantize(torch.float32).cpu(), _expected(data, scale_inv, fmt).reshape(shape),
                               rtol=0, atol=0)


# TE's DType int of each format: (form, DType value, numbering given to te_dtype_numbering, format)
DTYPE_CASES = [
    ("A", 6, None, E4M3),   # releases without kInt16: kFloat8E4M3 = 6 (with it, 6 is kBFloat16)
    ("A", 8, None, E5M2),   # releases with kInt16: kFloat8E5M2 = 8 (without it, 8 is kFloat8E8M0)
    ("A", 7, 7, E4M3),      # 7 is ambiguous: the numbering given says which
    ("A", 7, 6, E5M2),
    ("A", 6, 6, E4M3),
    ("A", 8, 7, E5M2),
    ("B", 7, None, E4M3),   # forms B and C come from releases with kInt16
    ("B", 8, None, E5M2),
    ("C", 7, None, E4M3),
    ("C", 8, None, E5M2),
]


def _numbering(n):
    return te_checkpoint.te_dtype_numbering(n) if n is not None else contextlib.nullcontext()


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("form,value,numbering,fmt", DTYPE_CASES)
@pytest.mark.parametrize("callable_", ["classmethod", "function"])
@pytest.mark.parametrize("structured", [False, True])
def test_te_pickled_float8_tensor_loads(rng, shape, form, value, numbering, fmt, callable_, structured):
    data, scale_inv = _fp8_input(seeded(rng), shape, fmt, structured)
    dtype = torch.bfloat16 if structured else torch.float32
    fn = Float8Tensor._make_in_reduce_ex if callable_ == "classmethod" else f8t._make_float8_tensor_in_reduce_ex
    blob = _te_save(lambda: _TEFloat8Tensor(fn, (data, _te_dtype(form, value), scale_inv, dtype,
                                                 torch.Size(shape))), form)

    ops = _data_pkl_ops(blob)
    mod = "transformer_engine.pytorch.tensor.float8_tensor"
    if callable_ == "classmethod":  # getattr(Float8Tensor, "_make_in_reduce_ex"), as TE's bound method pickles
        i = ops.index(("GLOBAL", "__builtin__ getattr"))
        assert ops[i + 2] == ("GLOBAL", f"{mod} Float8Tensor") and ops[i + 4] == ("BINUNICODE", "_make_in_reduce_ex")
        assert [o for o, _ in ops[i + 6:i + 9]] == ["TUPLE2", "BINPUT", "REDUCE"]
    else:
        assert ("GLOBAL", f"{mod} _make_float8_tensor_in_reduce_ex") in ops
    dt_global = "transformer_engine.pytorch.constants DType" if form == "C" else "transformer_engine_torch DType"
    j = ops.index(("GLOBAL", dt_global))
    if form == "A":  # pybind11's default: DType.__new__(DType), then BUILD with the int
        assert [o for o, _ in ops[j + 2:j + 7]] == ["EMPTY_TUPLE", "NEWOBJ", "BINPUT", "BININT1", "BUILD"]
        assert ops[j + 5][1] == value
    else:  # DType(int)
        assert [o for o, _ in ops[j + 2:j + 5]] == ["BININT1", "TUPLE1", "BINPUT"] and ops[j + 2][1] == value
        assert ops[j + 5][0] == "REDUCE"

    with _numbering(numbering):
        w = torch.load(io.BytesIO(blob), map_location=DEVICE)["w"]  # weights_only=True (the default)
    _assert_loaded(w, data, scale_inv, fmt, dtype, shape)
    with _numbering(numbering):
        w2 = torch.load(io.BytesIO(blob), map_location=DEVICE, weights_only=False, pickle_module=te_checkpoint)["w"]
    _assert_loaded(w2, data, scale_inv, fmt, dtype, shape)
    if form == "C":  # no module outside this package is named
        _assert_loaded(torch.load(io.BytesIO(blob), weights_only=False)["w"], data, scale_inv, fmt, dtype, shape)
    else:  # pickle imports transformer_engine_torch, which does not exist here (te_checkpoint.py)
        with pytest.raises(ModuleNotFoundError, match="transformer_engine_torch"):
            torch.load(io.BytesIO(blob), weights_only=False)


def test_pybind_enum_stand_in_pickles_as_pybind11_does():
    """Form A's stand-in gives the bytes pybind11's default pickling of an enum gives (object's
    protocol-2 reduce: __newobj__ of the class, state = __getstate__() = the int), by hand:"""
    with _tex_module(_PybindDType):
        got = pickle.dumps(_PybindDType(7), protocol=2)
    want = (b"\x80\x02"                                   # PROTO 2
            b"ctransformer_engine_torch\nDType\n"         # GLOBAL
            b"q\x00"                                      # BINPUT 0
            b")"                                          # EMPTY_TUPLE
            b"\x81"                                       # NEWOBJ
            b"q\x01"                                      # BINPUT 1
            b"K\x07"                                      # BININT1 7
            b"b"                                          # BUILD
            b".")                                         # STOP
    assert got == want
    # and the stand-in te_checkpoint reads it as: value 7, from pybind11's state (form A)
    d = te_checkpoint.loads(want)
    assert isinstance(d, te_checkpoint.DType) and d.value == 7 and d.from_state


@pytest.mark.parametrize("form", ["A", "B"])
def test_hand_assembled_checkpoint_pickle(form):
    """The whole TE pickle of one Float8Tensor assembled by hand (opcodes), its tensors as
    torch.save's persistent ids; loaded with torch's unpickler via the te_checkpoint module."""
    data = torch.tensor([[0x38, 0x40, 0xB8], [0x00, 0x7E, 0x01]], dtype=torch.uint8)  # E4M3: 1, 2, -1, 0, 448, 2^-9
    si = torch.tensor([0.5])
    dtype_ops = (b"ctransformer_engine_torch\nDType\n)\x81K\x07b" if form == "A"
                 else b"ctransformer_engine_torch\nDType\nK\x07\x85R")
    stream = (b"\x80\x02"
              b"c__builtin__\ngetattr\n"
              b"ctransformer_engine.pytorch.tensor.float8_tensor\nFloat8Tensor\n"
              b"X\x12\x00\x00\x00_make_in_reduce_ex"
              b"\x86R"                                     # TUPLE2 REDUCE: the bound class method
              b"("                                         # MARK: its arguments
              b"K\x00Q"                                    # data: persistent id 0
              + dtype_ops +
              b"K\x01Q"                                    # scale_inv: persistent id 1
              b"ctorch\nfloat32\n"
              b"ctorch\nSize\nK\x02K\x03\x86\x85R"         # torch.Size((2, 3))
              b"tR.")                                      # TUPLE REDUCE STOP
    tensors = [data, si]

    class Loader(te_checkpoint.Unpickler):
        def persistent_load(self, pid):
            return tensors[pid]

    with te_checkpoint.te_dtype_numbering(7):
        w = Loader(io.BytesIO(stream)).load()
    _assert_loaded(w, data, si, E4M3, torch.float32, (2, 3))
    assert w.dequantize(torch.float32).tolist() == [[0.5, 1.0, -0.5], [0.0, 224.0, 2.0 ** -10]]


def test_four_argument_form_of_early_te2():
    """The first TE 2.x releases pickle (data, fp8_dtype, scale_inv, dtype): the shape is data's."""
    data = torch.arange(12, dtype=torch.uint8).reshape(4, 3)
    si = torch.tensor([2.0])
    blob = _te_save(lambda: _TEFloat8Tensor(Float8Tensor._make_in_reduce_ex,
                                            (data, _PybindDType(6), si, torch.float16)), "A")
    w = torch.load(io.BytesIO(blob))["w"]
    _assert_loaded(w, data, si, E4M3, torch.float16, (4, 3))


def test_ambiguous_value_without_numbering_raises():
    data = torch.zeros(2, 2, dtype=torch.uint8)
    blob = _te_save(lambda: _TEFloat8Tensor(Float8Tensor._make_in_reduce_ex,
                                            (data, _PybindDType(7), torch.ones(1), torch.float32, torch.Size((2, 2)))),
                    "A")
    with pytest.raises(ValueError, match="te_dtype_numbering"):
        torch.load(io.BytesIO(blob))
    with pytest.raises(ValueError, match="te_dtype_numbering"):
        torch.load(io.BytesIO(blob), weights_only=False, pickle_module=te_checkpoint)
    # a value that is no FP8 format in the numbering given
    with te_checkpoint.te_dtype_numbering(7), pytest.raises(ValueError, match="not an FP8 format"):
        te_checkpoint.fp8_dtype_from_te(_state_dtype(6))  # kBFloat16 in that numbering
    with pytest.raises(ValueError, match="not an FP8 format"):
        te_checkpoint.fp8_dtype_from_te(constants.DType.kBFloat16)
    with pytest.raises(ValueError):
        te_checkpoint.te_dtype_numbering(8).__enter__()


def _state_dtype(v):
    d = te_checkpoint.DType.__new__(te_checkpoint.DType)
    d.__setstate__(v)
    return d


def test_weights_only_getattr_is_restricted():
    """The getattr registered for TE's class-method form fetches nothing else."""
    class Other:
        def __reduce_ex__(self, protocol):
            return (getattr, (Float8Tensor, "__init_subclass__"))

    buf = io.BytesIO()
    torch.save({"x": Other()}, buf)
    with pytest.raises(pickle.UnpicklingError, match="not allowed"):
        torch.load(io.BytesIO(buf.getvalue()))


@pytest.mark.parametrize("kind", ["delayed", "current"])
def test_te_state_dict_loads_into_module(rng, kind):
    """A TE state_dict whose weight is TE's pickled Float8Tensor loads into an FP8 module: the
    parameter takes TE's bytes and scale_inv."""
    rec = recipe.DelayedScaling(amax_history_len=4) if kind == "delayed" else recipe.Float8CurrentScaling()
    with te.fp8_model_init(enabled=True, recipe=rec):
        m = te.Linear(32, 16, device=DEVICE)
    data, si = _fp8_input(seeded(rng), (16, 32), E4M3, False)
    sd = m.state_dict()

    def obj():
        d = dict(sd)
        d["weight"] = _TEFloat8Tensor(Float8Tensor._make_in_reduce_ex,
                                      (data, _PybindDType(7), si, torch.float32, torch.Size((16, 32))))
        return d

    buf = io.BytesIO()
    with _tex_module(_PybindDType):
        torch.save(obj(), buf)
    with te_checkpoint.te_dtype_numbering(7):
        loaded = torch.load(io.BytesIO(buf.getvalue()), map_location=DEVICE)
    m.load_state_dict(loaded)
    _assert_loaded(m.weight, data, si, E4M3, torch.float32, (16, 32))
    if m.weight._transpose is not None:
        assert torch.equal(m.weight._transpose, m.weight._data.t())


@pytest.mark.parametrize("scale_inv", [torch.tensor([2.0], dtype=torch.float64), torch.tensor([2.0], dtype=torch.float16),
                                       torch.tensor([2.0, 3.0]), torch.tensor(2.0, dtype=torch.int32)])
def test_rebuild_refuses_a_scale_inv_the_library_would_misread(scale_inv):
    """This package's pickle with a scale_inv that is not one float32 (the library reads one float32:
    a float64 was misread, a float16 read past its end) is refused; TE's form converts a one-element
    scale_inv of another float dtype by value and refuses more than one element."""
    from transformer_engine.pytorch.tensor import float8_tensor as f8
    data = torch.full((2, 3), 0x38, dtype=torch.uint8)  # E4M3 1.0
    with pytest.raises(ValueError, match="scale_inv must be a float32 tensor of one element"):
        f8._rebuild_float8_tensor(data, None, scale_inv, 7, torch.float32, False)
    if scale_inv.numel() != 1:
        with pytest.raises(ValueError, match="one scale_inv"):
            f8.Float8Tensor._make_in_reduce_ex(data, f8._constants.DType.kFloat8E4M3, scale_inv, torch.float32, (2, 3))
    else:
        t = f8.Float8Tensor._make_in_reduce_ex(data, f8._constants.DType.kFloat8E4M3, scale_inv, torch.float32, (2, 3))
        assert torch.equal(t.dequantize(), torch.full((2, 3), 2.0))
    ok = f8._rebuild_float8_tensor(data, None, torch.tensor([2.0]), 7, torch.float32, False)
    assert torch.equal(ok.dequantize(), torch.full((2, 3), 2.0))


def test_getattr_allowlisted_by_the_caller_in_tuple_form_is_the_real_one():
    """The package registers a getattr that fetches only Float8Tensor._make_in_reduce_ex; a caller
    who allowlists the real getattr in torch's (object, name) form gets the real one whichever
    entry torch resolves (the two share the name builtins.getattr)."""
    class P:
        def __reduce__(self):
            return (getattr, (torch.float32, "is_floating_point"))
    b = io.BytesIO()
    torch.save(P(), b)
    with torch.serialization.safe_globals([(getattr, "builtins.getattr")]):
        b.seek(0)
        assert torch.load(b, weights_only=True) is True
    b.seek(0)
    with pytest.raises(pickle.UnpicklingError):
        torch.load(b, weights_only=True)
