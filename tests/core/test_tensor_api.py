"""The tensor-handle part of the C API (transformer_engine.h), called through ctypes on the
shared library itself, plus the Python Tensor wrapper and error reporting."""
import ctypes
import glob
import os

import numpy as np
import pytest

import transformer_engine
from transformer_engine import _nvte as nvte

MAX_DIMS = 15


class Shape(ctypes.Structure):
    _fields_ = [("data", ctypes.c_size_t * MAX_DIMS), ("ndim", ctypes.c_size_t)]


class BasicTensor(ctypes.Structure):
    _fields_ = [("data_ptr", ctypes.c_void_p), ("dtype", ctypes.c_int), ("shape", Shape)]


@pytest.fixture(scope="module")
def lib():
    path = sorted(glob.glob(os.path.join(transformer_engine.get_library_dir(), "libtransformer_engine.so*")))[0]
    lib = ctypes.CDLL(path)
    lib.nvte_create_tensor.restype = ctypes.c_void_p
    lib.nvte_create_tensor.argtypes = [ctypes.c_int]
    lib.nvte_destroy_tensor.argtypes = [ctypes.c_void_p]
    lib.nvte_set_tensor_param.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.POINTER(BasicTensor)]
    lib.nvte_set_tensor_param.restype = ctypes.c_int
    lib.nvte_tensor_shape.argtypes = [ctypes.c_void_p]
    lib.nvte_tensor_shape.restype = Shape
    lib.nvte_tensor_type.argtypes = [ctypes.c_void_p]
    lib.nvte_tensor_numel.argtypes = [ctypes.c_void_p]
    lib.nvte_tensor_numel.restype = ctypes.c_size_t
    lib.nvte_tensor_element_size.argtypes = [ctypes.c_void_p]
    lib.nvte_tensor_element_size.restype = ctypes.c_size_t
    lib.nvte_tensor_data.argtypes = [ctypes.c_void_p]
    lib.nvte_tensor_data.restype = ctypes.c_void_p
    lib.nvte_get_last_error.restype = ctypes.c_char_p
    lib.nvte_make_shape.argtypes = [ctypes.POINTER(ctypes.c_size_t), ctypes.c_size_t]
    lib.nvte_make_shape.restype = Shape
    lib.nvte_dtype_name.restype = ctypes.c_char_p
    lib.nvte_create_quantization_config.restype = ctypes.c_void_p
    lib.nvte_destroy_quantization_config.argtypes = [ctypes.c_void_p]
    lib.nvte_set_quantization_config_attribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t]
    lib.nvte_get_quantization_config_attribute.argtypes = [
        ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t)]
    return lib


def basic(ptr, dtype, dims):
    s = Shape()
    s.ndim = len(dims)
    for i, d in enumerate(dims):
        s.data[i] = d
    return BasicTensor(ptr, dtype, s)


def test_dtype_numbering_matches_te_2_4():
    expected = ["kByte", "kInt16", "kInt32", "kInt64", "kFloat32", "kFloat16", "kBFloat16",
                "kFloat8E4M3", "kFloat8E5M2", "kFloat8E8M0", "kFloat4E2M1"]
    assert [int(getattr(nvte.DType, n)) for n in expected] == list(range(11))


def test_params_numbering_matches_te():
    names = ["kRowwiseData", "kColumnwiseData", "kScale", "kAmax", "kRowwiseScaleInv", "kColumnwiseScaleInv"]
    assert [int(getattr(nvte.Param, n)) for n in names] == list(range(6))


def test_handle_roundtrip(lib):
    buf = np.zeros((3, 5, 7), np.float32)
    t = ctypes.c_void_p(lib.nvte_create_tensor(0))
    assert lib.nvte_set_tensor_param(ctypes.byref(t), 0, ctypes.byref(basic(buf.ctypes.data, 4, buf.shape))) == 0
    s = lib.nvte_tensor_shape(t)
    assert list(s.data[: s.ndim]) == [3, 5, 7]
    assert lib.nvte_tensor_type(t) == 4 and lib.nvte_tensor_numel(t) == 105 and lib.nvte_tensor_element_size(t) == 4
    assert lib.nvte_tensor_data(t) == buf.ctypes.data
    lib.nvte_destroy_tensor(t)


def test_columnwise_only_tensor_reports_logical_shape(lib):
    col = np.zeros((8, 2, 3), np.uint8)  # transpose of a [2, 3, 8] tensor
    t = ctypes.c_void_p(lib.nvte_create_tensor(0))
    lib.nvte_set_tensor_param(ctypes.byref(t), 1, ctypes.byref(basic(col.ctypes.data, 7, col.shape)))
    s = lib.nvte_tensor_shape(t)
    assert list(s.data[: s.ndim]) == [2, 3, 8]
    assert lib.nvte_tensor_type(t) == 7
    lib.nvte_destroy_tensor(t)


def test_set_param_rejects_bad_values(lib):
    t = ctypes.c_void_p(lib.nvte_create_tensor(0))
    assert lib.nvte_set_tensor_param(ctypes.byref(t), 99, ctypes.byref(basic(None, 4, (1,)))) == 1
    assert b"unknown tensor param 99" in lib.nvte_get_last_error()
    assert lib.nvte_set_tensor_param(ctypes.byref(t), 0, ctypes.byref(basic(None, 42, (1,)))) == 1
    assert b"unknown dtype 42" in lib.nvte_get_last_error()
    assert lib.nvte_set_tensor_param(None, 0, ctypes.byref(basic(None, 4, (1,)))) == 1
    lib.nvte_destroy_tensor(t)


def test_make_shape_clamps_and_reports(lib):
    dims = (ctypes.c_size_t * 20)(*range(1, 21))
    s = lib.nvte_make_shape(dims, 20)
    assert s.ndim == MAX_DIMS
    assert b"20 dims requested" in lib.nvte_get_last_error()


def test_dtype_names(lib):
    assert lib.nvte_dtype_name(7) == b"float8_e4m3" and lib.nvte_dtype_name(99) == b"invalid"


def test_quantization_config_attributes(lib):
    cfg = ctypes.c_void_p(lib.nvte_create_quantization_config())
    eps = ctypes.c_float(0.5)
    assert lib.nvte_set_quantization_config_attribute(cfg, 1, ctypes.byref(eps), 4) == 0
    out = ctypes.c_float(0)
    written = ctypes.c_size_t(0)
    assert lib.nvte_get_quantization_config_attribute(cfg, 1, ctypes.byref(out), 4, ctypes.byref(written)) == 0
    assert out.value == 0.5 and written.value == 4
    written.value = 0  # a NULL buf asks for the size only (TE's documented query)
    assert lib.nvte_get_quantization_config_attribute(cfg, 1, None, 0, ctypes.byref(written)) == 0
    assert written.value == 4
    assert lib.nvte_get_quantization_config_attribute(cfg, 1, ctypes.byref(out), 2, ctypes.byref(written)) == 1
    assert b"4 bytes" in lib.nvte_get_last_error()
    assert lib.nvte_set_quantization_config_attribute(cfg, 1, ctypes.byref(eps), 8) == 1
    assert b"4 bytes" in lib.nvte_get_last_error()
    assert lib.nvte_set_quantization_config_attribute(cfg, 1, None, 4) == 1
    assert b"buffer is NULL" in lib.nvte_get_last_error()  # (it said "must hold 4 bytes, got 4")
    assert lib.nvte_set_quantization_config_attribute(cfg, 77, ctypes.byref(eps), 4) == 1
    assert b"unknown quantization config attribute 77" in lib.nvte_get_last_error()
    lib.nvte_destroy_quantization_config(cfg)


def test_only_nvte_symbols_are_exported():
    path = sorted(glob.glob(os.path.join(transformer_engine.get_library_dir(), "libtransformer_engine.so*")))[0]
    import subprocess

    out = subprocess.run(["nm", "-D", "--defined-only", path], capture_output=True, text=True, check=True).stdout
    names = [line.split()[-1] for line in out.splitlines() if line.strip()]
    assert names and all(n.startswith("nvte_") for n in names), [n for n in names if not n.startswith("nvte_")][:5]


def test_python_tensor_wrapper_keeps_arrays_and_reports_shape():
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    t = nvte.Tensor(x)
    del x
    assert t.shape == [3, 4] and t.dtype == nvte.DType.kFloat32 and t.numel == 12
    with pytest.raises(ValueError, match="C-contiguous"):
        nvte.Tensor(np.zeros((4, 4), np.float32)[:, ::2])
    with pytest.raises(ValueError, match="itemsize"):
        nvte.Tensor(np.zeros(4, np.float32), dtype=nvte.DType.kFloat8E4M3)


def test_tensor_make_sets_every_buffer_in_one_call():
    P, D = nvte.Param, nvte.DType
    t = nvte.Tensor.make(0x1000, (4, 8), D.kBFloat16)  # plain rowwise data
    assert (t.param_ptr(P.kRowwiseData), t.param_shape(P.kRowwiseData), t.dtype) == (0x1000, [4, 8], D.kBFloat16)
    assert t.param_ptr(P.kRowwiseScaleInv) == 0 and t.param_ptr(P.kScale) == 0
    # FP8: both layouts share one scale_inv; scale and amax are float32 [1]
    t = nvte.Tensor.make(0x1000, (4, 8), D.kFloat8E4M3, 0x2000, 0x3000, (8, 4), 0x4000, 0x5000)
    assert t.param_shape(P.kColumnwiseData) == [8, 4] and t.param_dtype(P.kColumnwiseData) == D.kFloat8E4M3
    for p, ptr in ((P.kRowwiseScaleInv, 0x2000), (P.kColumnwiseScaleInv, 0x2000), (P.kScale, 0x4000),
                   (P.kAmax, 0x5000)):
        assert (t.param_ptr(p), t.param_shape(p), t.param_dtype(p)) == (ptr, [1], D.kFloat32)
    # columnwise only: scale_inv goes with it; no data at all: scale_inv is the rowwise one
    t = nvte.Tensor.make(0, None, D.kFloat8E5M2, 0x2000, 0x3000, (8, 4))
    assert t.param_ptr(P.kRowwiseData) == 0 and t.param_ptr(P.kRowwiseScaleInv) == 0
    assert t.param_ptr(P.kColumnwiseScaleInv) == 0x2000
    t = nvte.Tensor.make(0, None, D.kFloat8E4M3, 0x2000, scale=0x4000)
    assert t.param_ptr(P.kRowwiseScaleInv) == 0x2000 and t.param_ptr(P.kScale) == 0x4000
    # an empty buffer (NULL data, 0 elements) is still a buffer
    t = nvte.Tensor.make(0, (0, 8), D.kFloat32)
    assert t.param_shape(P.kRowwiseData) == [0, 8] and t.numel == 0


def test_errors_carry_op_name_and_status_and_process_survives():
    x = nvte.Tensor(np.zeros((2, 3), np.float32))
    bad = nvte.Tensor()
    bad.set_param(nvte.Param.kRowwiseData, 0, [2, 3], nvte.DType.kFloat8E4M3)  # NULL data, 6 elements
    with pytest.raises(nvte.Error) as e:
        nvte.quantize(x, bad)
    msg, status = e.value.args
    assert "nvte_quantize" in msg and "NULL" in msg and "[2, 3]" in msg
    assert status == int(nvte.Status.INVALID_ARGUMENT)
    # The library keeps working after the failure.
    out = nvte.Tensor(np.zeros((2, 3), np.float32))
    nvte.quantize(x, out)


def test_unsupported_scaling_mode_is_not_supported_error():
    x = nvte.Tensor(np.zeros((2, 32), np.float32))
    out = nvte.Tensor(np.zeros((2, 32), np.uint8), dtype=nvte.DType.kFloat8E4M3,
                      scale=np.ones(1, np.float32), scaling_mode=1)  # MXFP8
    with pytest.raises(nvte.Error, match="scaling mode 1") as e:
        nvte.quantize(x, out)
    assert e.value.args[1] == int(nvte.Status.NOT_SUPPORTED)


def test_version():
    assert nvte.get_version() == nvte.VERSION == 100
    assert transformer_engine.__version__ == "0.1.0"
