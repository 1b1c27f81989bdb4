"""Helpers for the C API tests: tensors from numpy, the central tolerance table,
FP8 references via ml_dtypes, poisoning, and comparisons that explain failures."""
import ml_dtypes
import numpy as np

from transformer_engine import _nvte as nvte

DT = nvte.DType
BF16 = ml_dtypes.bfloat16
E4M3 = ml_dtypes.float8_e4m3fn
E5M2 = ml_dtypes.float8_e5m2

# numpy storage type and NVTE dtype of each name used in parametrisations.
NP_TYPE = {"float32": np.float32, "float16": np.float16, "bfloat16": BF16}
NVTE_DTYPE = {"float32": DT.kFloat32, "float16": DT.kFloat16, "bfloat16": DT.kBFloat16,
              "e4m3": DT.kFloat8E4M3, "e5m2": DT.kFloat8E5M2}
FP8_NP = {"e4m3": E4M3, "e5m2": E5M2}
FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}

# Central tolerance table: |got - ref| <= atol + rtol * |ref|, rtol = eps of the
# output dtype (unit roundoff times a small factor for the op's own rounding).
TOLERANCE = {
    "float32": (1e-6, 2.0**-20),
    "float16": (1e-4, 2.0**-10),
    "bfloat16": (1e-3, 2.0**-7),
}

# Shapes every elementwise/rowwise op is tried on: odd sizes, size 1, non-multiples of 16, empty.
SHAPES_2D = [(1, 1), (1, 17), (3, 5), (7, 33), (16, 16), (31, 129), (64, 48), (0, 8), (5, 0)]


def fp8_encode_ref(x32, fmt):
    """float32 -> FP8 bytes with the library's rule: RNE, saturate beyond max, NaN -> 0x7F.
    In range this is ml_dtypes' cast; saturation is applied before it (ml_dtypes gives NaN/inf)."""
    x = np.asarray(x32, np.float32)
    m = np.float32(FP8_MAX[fmt])
    sat = np.where(np.isnan(x), x, np.clip(x, -m, m)).astype(np.float32)
    out = sat.astype(FP8_NP[fmt]).view(np.uint8).copy()
    out[np.isnan(x)] = 0x7F
    return out


def fp8_decode(u8, fmt):
    return np.asarray(u8, np.uint8).view(FP8_NP[fmt]).astype(np.float64)


def to_np(a, name):
    """Cast float64/float32 data to the numpy storage type of dtype `name`."""
    return np.asarray(a, dtype=np.float32).astype(NP_TYPE[name])


def scalar(v=0.0):
    return np.array([v], dtype=np.float32)


class FP8Out:
    """An FP8 output: rowwise [rows, cols] and/or columnwise [cols, rows] data, scale, amax, scale_inv."""

    def __init__(self, shape, fmt, scale=1.0, amax=0.0, rowwise=True, columnwise=False, poison=True):
        rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
        cols = shape[-1] if shape else 1
        fill = 0xAB if poison else 0
        self.fmt = fmt
        self.data = np.full(shape, fill, np.uint8) if rowwise else None
        self.col = np.full((cols, rows), fill, np.uint8) if columnwise else None
        self.scale = scalar(scale)
        self.amax = scalar(amax)
        self.scale_inv = scalar(-1.0)
        self.tensor = nvte.Tensor(self.data, dtype=NVTE_DTYPE[fmt], scale=self.scale, amax=self.amax,
                                  scale_inv=self.scale_inv, columnwise_data=self.col)

    def values(self):
        return fp8_decode(self.data, self.fmt)


def poisoned(shape, name):
    """An output array filled with NaN (float) so unwritten elements show."""
    return np.full(shape, np.nan, dtype=NP_TYPE[name])


def explain(got, ref, bad, n=5):
    idx = np.argwhere(bad)
    err = np.abs(np.asarray(got, np.float64) - np.asarray(ref, np.float64))
    err = np.where(np.isnan(err), np.inf, err)
    worst = np.unravel_index(np.argmax(err), err.shape) if err.size else ()
    lines = [f"{len(idx)} of {bad.size} elements differ; worst at {tuple(int(i) for i in worst)}: "
             f"got {np.asarray(got)[worst]!r} ref {np.asarray(ref)[worst]!r}"]
    for i in idx[:n]:
        t = tuple(int(v) for v in i)
        lines.append(f"  at {t}: got {np.asarray(got)[t]!r} ref {np.asarray(ref)[t]!r}")
    return "\n".join(lines)


def assert_close(got, ref, dtype="float32", atol=None, rtol=None):
    """Compare with the central table (or explicit atol/rtol); NaN must match NaN."""
    a0, r0 = TOLERANCE[dtype]
    atol = a0 if atol is None else atol
    rtol = r0 if rtol is None else rtol
    g = np.asarray(got, np.float64)
    r = np.asarray(ref, np.float64)
    assert g.shape == r.shape, f"shape {g.shape} != reference shape {r.shape}"
    bad = ~((np.abs(g - r) <= atol + rtol * np.abs(r)) | (np.isnan(g) & np.isnan(r)) | (g == r))
    assert not bad.any(), explain(got, ref, bad)


def assert_bits_equal(got, ref):
    g = np.asarray(got)
    r = np.asarray(ref)
    assert g.shape == r.shape, f"shape {g.shape} != reference shape {r.shape}"
    bad = g != r
    assert not bad.any(), explain(g, r, bad)
