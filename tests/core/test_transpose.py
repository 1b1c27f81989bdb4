"""nvte_transpose (any dtype, bit copy), nvte_cast_transpose, the fused cast + transpose +
dbias (+ dact) ops and nvte_multi_cast_transpose against numpy references."""
import numpy as np
import pytest

from test_cast import (ACTS, FMTS, IN_DTYPES, SHAPES, amax_ref, check_dbias_results, make_input,
                       quantize_ref, rows_cols, run_dbias, scale_inv_ref, tensor)
from util import DT, FP8Out, assert_bits_equal, nvte, poisoned, scalar, to_np

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered in cast:RuntimeWarning")

# numpy storage dtype and the NVTE dtype it is passed as (FP8 travels as uint8 bytes).
TRANSPOSE_DTYPES = {
    "float32": (np.float32, DT.kFloat32), "float16": (np.float16, DT.kFloat16),
    "bfloat16": (np.uint16, DT.kBFloat16), "e4m3": (np.uint8, DT.kFloat8E4M3),
    "e5m2": (np.uint8, DT.kFloat8E5M2), "uint8": (np.uint8, DT.kByte), "int16": (np.int16, DT.kInt16),
    "int32": (np.int32, DT.kInt32), "int64": (np.int64, DT.kInt64),
}
TRANSPOSE_SHAPES = SHAPES + [(97, 65), (33, 1), (1, 40), (4, 5, 6, 7)]


def random_bits(shape, np_type, rng):
    """Arbitrary bit patterns (NaN payloads included): transpose must copy them unchanged."""
    n = int(np.prod(shape)) * np.dtype(np_type).itemsize
    return rng.integers(0, 256, size=n, dtype=np.uint8).view(np_type).reshape(shape)


# ----------------------------------------------------------------------------- transpose
@pytest.mark.parametrize("shape", TRANSPOSE_SHAPES)
@pytest.mark.parametrize("name", list(TRANSPOSE_DTYPES))
def test_transpose_is_a_bit_copy(shape, name, rng):
    np_type, dt = TRANSPOSE_DTYPES[name]
    x = random_bits(shape, np_type, rng)
    r, c = rows_cols(shape)
    y = np.full((c, r), 0x5A, np.uint8).view(np_type) if np.dtype(np_type).itemsize == 1 else \
        random_bits((c, r), np_type, rng)
    nvte.transpose(nvte.Tensor(x, dtype=dt), nvte.Tensor(y, dtype=dt))
    ref = x.reshape(r, c).T
    assert_bits_equal(y.view(np.uint8), np.ascontiguousarray(ref).view(np.uint8))


def test_transpose_structured():
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    y = np.full((4, 3), np.nan, np.float32)
    nvte.transpose(nvte.Tensor(x), nvte.Tensor(y))
    np.testing.assert_array_equal(y, x.T)
    # A 3D input is its 2D view [6, 4]; the output may keep extra dims after the first.
    x3 = np.arange(24, dtype=np.int32).reshape(2, 3, 4)
    y3 = np.zeros((4, 2, 3), np.int32)
    nvte.transpose(nvte.Tensor(x3), nvte.Tensor(y3))
    np.testing.assert_array_equal(y3.reshape(4, 6), x3.reshape(6, 4).T)


def test_transpose_errors():
    x = nvte.Tensor(np.zeros((3, 4), np.float32))
    with pytest.raises(nvte.Error, match=r"nvte_transpose: transposed_output has shape \[3, 4\]; expected \[4, 3\]"):
        nvte.transpose(x, nvte.Tensor(np.zeros((3, 4), np.float32)))
    with pytest.raises(nvte.Error, match=r"nvte_transpose: input dtype float32 differs from transposed_output "
                                         r"dtype float16"):
        nvte.transpose(x, nvte.Tensor(np.zeros((4, 3), np.float16)))
    null = nvte.Tensor()
    null.set_param(nvte.Param.kRowwiseData, 0, [3, 4], DT.kFloat32)
    with pytest.raises(nvte.Error, match=r"nvte_transpose: input rowwise data pointer is NULL"):
        nvte.transpose(null, nvte.Tensor(np.zeros((4, 3), np.float32)))
    fp4 = np.zeros((2, 2), np.uint8)
    with pytest.raises(nvte.Error, match=r"nvte_transpose: transpose of float4_e2m1") as e:
        nvte.transpose(nvte.Tensor(fp4, dtype=DT.kFloat4E2M1), nvte.Tensor(fp4.copy(), dtype=DT.kFloat4E2M1))
    assert e.value.args[1] == int(nvte.Status.NOT_SUPPORTED)


# ----------------------------------------------------------------------------- cast + transpose
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("in_name", IN_DTYPES)
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("layouts", ["both", "rowwise", "columnwise"])
@pytest.mark.parametrize("scale", [1.0, 0.3])
def test_cast_transpose(shape, in_name, fmt, layouts, scale, rng):
    x = make_input(shape, in_name, rng)
    out = FP8Out(shape, fmt, scale=scale, amax=0.5, rowwise=layouts != "columnwise",
                 columnwise=layouts != "rowwise")
    nvte.cast_transpose(tensor(x), out.tensor)
    r, c = rows_cols(shape)
    x32 = x.astype(np.float32)
    ref = quantize_ref(x32, fmt, scale).reshape(r, c)
    if out.data is not None:
        assert_bits_equal(out.data.reshape(r, c), ref)
    if out.col is not None:
        assert_bits_equal(out.col, ref.T)
    assert out.amax[0] == amax_ref(x32, 0.5)
    if x.size:
        assert out.scale_inv[0] == scale_inv_ref(scale)


@pytest.mark.parametrize("kind", ["ones", "arange"])
def test_cast_transpose_structured_and_both_scale_invs(kind, rng):
    x = make_input((31, 129), "float32", rng, kind)
    data, col = np.zeros((31, 129), np.uint8), np.zeros((129, 31), np.uint8)
    amax, sinv, col_sinv = scalar(0.0), scalar(0.0), scalar(0.0)
    t = nvte.Tensor(data, dtype=DT.kFloat8E5M2, scale=scalar(0.125), amax=amax, scale_inv=sinv,
                    columnwise_data=col, columnwise_scale_inv=col_sinv)
    nvte.cast_transpose(tensor(x), t)
    ref = quantize_ref(x, "e5m2", 0.125)
    assert_bits_equal(data, ref)
    assert_bits_equal(col, ref.T)
    assert sinv[0] == 8.0 and col_sinv[0] == 8.0 and amax[0] == np.abs(x).max()


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("in_name", IN_DTYPES)
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("dbias_name", IN_DTYPES)
def test_cast_transpose_dbias(shape, in_name, fmt, dbias_name, rng):
    x = make_input(shape, in_name, rng)
    out = FP8Out(shape, fmt, scale=4.0, columnwise=True)
    dbias = poisoned((shape[-1],), dbias_name)
    nvte.cast_transpose_dbias(tensor(x), out.tensor, tensor(dbias))
    check_dbias_results(x, None, None, out, dbias, dbias_name, fmt, 4.0)


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("shape", [(1, 1), (7, 33), (31, 129), (0, 8), (5, 0), (2, 3, 5)])
@pytest.mark.parametrize("in_name", IN_DTYPES)
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("layouts", ["both", "columnwise"])
def test_cast_transpose_dbias_dact(act, shape, in_name, fmt, layouts, rng):
    x = to_np(rng.standard_normal(shape) * 4, in_name)
    act_x = to_np(rng.standard_normal(shape) * 3, in_name)
    out = FP8Out(shape, fmt, scale=0.5, rowwise=layouts == "both", columnwise=True)
    dbias = poisoned((shape[-1],), "bfloat16")
    run_dbias("cast_transpose_dbias_" + act, x, act_x, out, dbias)
    check_dbias_results(x, act, act_x, out, dbias, "bfloat16", fmt, 0.5)


def test_cast_transpose_dbias_matches_quantize_dbias(rng):
    """Same g, same codes, same dbias bits: the two families share one implementation rule."""
    x, a = make_input((64, 48), "bfloat16", rng), make_input((64, 48), "bfloat16", rng)
    o1, o2 = FP8Out(x.shape, "e4m3", scale=2.0), FP8Out(x.shape, "e4m3", scale=2.0, columnwise=True)
    d1, d2 = poisoned((48,), "float32"), poisoned((48,), "float32")
    nvte.quantize_dbias_dgelu(tensor(x), tensor(a), o1.tensor, tensor(d1))
    nvte.cast_transpose_dbias_dgelu(tensor(x), tensor(a), o2.tensor, tensor(d2))
    assert_bits_equal(o2.data, o1.data)
    assert_bits_equal(o2.col, o1.data.T)
    assert_bits_equal(d2.view(np.uint32), d1.view(np.uint32))
    assert o1.amax[0] == o2.amax[0]


def test_cast_transpose_dbias_errors():
    x = nvte.Tensor(np.ones((3, 5), np.float32))
    out = FP8Out((3, 5), "e4m3", columnwise=True)
    with pytest.raises(nvte.Error, match=r"nvte_cast_transpose_dbias: dbias has shape \[3\]; expected \[5\]"):
        nvte.cast_transpose_dbias(x, out.tensor, nvte.Tensor(np.zeros(3, np.float32)))
    with pytest.raises(nvte.Error, match=r"nvte_cast_transpose_dbias_drelu: act_input shape \[5, 3\] differs"):
        nvte.cast_transpose_dbias_drelu(x, nvte.Tensor(np.ones((5, 3), np.float32)), out.tensor,
                                        nvte.Tensor(np.zeros(5, np.float32)))
    with pytest.raises(nvte.Error, match=r"nvte_cast_transpose: output columnwise data has shape \[3, 5\]; "
                                         r"expected \[5, 3\]"):
        bad = nvte.Tensor(np.zeros((3, 5), np.uint8), dtype=DT.kFloat8E4M3, scale=scalar(1.0),
                          columnwise_data=np.zeros((3, 5), np.uint8))
        nvte.cast_transpose(x, bad)
    with pytest.raises(nvte.Error, match=r"nvte_cast_transpose: output has no data"):
        nvte.cast_transpose(x, nvte.Tensor(None, scale=scalar(1.0)))
    assert (out.data == 0xAB).all() and (out.col == 0xAB).all()


# ----------------------------------------------------------------------------- multi
def test_multi_cast_transpose(rng):
    shapes = [(7, 33), (1, 1), (0, 8), (2, 3, 5), (64, 48)]
    fmts = ["e4m3", "e5m2", "e4m3", "e5m2", "e4m3"]
    names = ["float32", "bfloat16", "float16", "float32", "bfloat16"]
    xs = [make_input(s, n, rng) for s, n in zip(shapes, names)]
    outs = [FP8Out(s, f, scale=0.5 + i, columnwise=True) for i, (s, f) in enumerate(zip(shapes, fmts))]
    nvte.multi_cast_transpose([tensor(x) for x in xs], [o.tensor for o in outs])
    for i, (x, o) in enumerate(zip(xs, outs)):
        r, c = rows_cols(x.shape)
        ref = quantize_ref(x.astype(np.float32), o.fmt, 0.5 + i).reshape(r, c)
        assert_bits_equal(o.data.reshape(r, c), ref)
        assert_bits_equal(o.col, ref.T)
        assert o.amax[0] == amax_ref(x.astype(np.float32), 0.0)
    nvte.multi_cast_transpose([], [])


def test_multi_cast_transpose_validates_every_pair_first(rng):
    xs = [make_input((3, 4), "float32", rng) for _ in range(3)]
    outs = [FP8Out((3, 4), "e4m3", columnwise=True) for _ in range(3)]
    outs[2] = FP8Out((4, 3), "e4m3", columnwise=True)  # wrong 2D view in the last pair
    with pytest.raises(nvte.Error, match=r"nvte_multi_cast_transpose: output_list\[2\] has shape \[4, 3\]"):
        nvte.multi_cast_transpose([tensor(x) for x in xs], [o.tensor for o in outs])
    assert all((o.data == 0xAB).all() and (o.col == 0xAB).all() for o in outs)
    with pytest.raises(nvte.Error, match=r"input_list\[1\] must be float32, float16 or bfloat16, got float8_e4m3"):
        nvte.multi_cast_transpose([tensor(xs[0]), outs[0].tensor], [outs[1].tensor, outs[2].tensor])
    with pytest.raises(ValueError, match="differ in length"):
        nvte.multi_cast_transpose([tensor(xs[0])], [])
