"""The FP8 conversion rule of cast.h, checked exhaustively through nvte_quantize /
nvte_dequantize: every bfloat16 bit pattern, ~1e6 float32 values aimed at the hard cases
(ties, subnormals, the saturation edge, inf/NaN/-0), against util.fp8_encode_ref and,
where the formats agree, torch's own float8 casts."""
import ml_dtypes
import numpy as np
import pytest
import torch

from test_cast import tensor
from util import BF16, DT, FP8_MAX, FP8_NP, NVTE_DTYPE, assert_bits_equal, fp8_encode_ref, nvte, scalar

FMTS = ["e4m3", "e5m2"]
# util.fp8_encode_ref casts NaN through ml_dtypes before overwriting it; numpy warns about that cast.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered in cast:RuntimeWarning")

TORCH_FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
MIN_SUBNORMAL = {"e4m3": 2.0**-9, "e5m2": 2.0**-16}


def quantize_np(x, fmt, scale=1.0):
    """nvte_quantize of a numpy array (float32/bfloat16/float16) -> (uint8 codes, amax, scale_inv)."""
    out = np.full(x.shape, 0xAB, np.uint8)
    amax, scale_inv = scalar(0.0), scalar(-1.0)
    nvte.quantize(tensor(x), nvte.Tensor(out, dtype=NVTE_DTYPE[fmt], scale=scalar(scale), amax=amax,
                                              scale_inv=scale_inv))
    return out, amax[0], scale_inv[0]


def torch_codes(x32, fmt):
    return torch.from_numpy(np.ascontiguousarray(x32)).to(TORCH_FP8[fmt]).view(torch.uint8).numpy()


def all_finite_fp8(fmt):
    v = np.arange(256, dtype=np.uint8).view(FP8_NP[fmt]).astype(np.float64)
    return np.unique(v[np.isfinite(v)])


def hard_cases(fmt, rng, n=1_000_000):
    """float32 values around every FP8 value and tie, subnormals, the max, specials, random magnitudes."""
    vals = all_finite_fp8(fmt)
    pos = vals[vals >= 0]
    mids = (pos[:-1] + pos[1:]) / 2  # exact ties between neighbours (exact in float32)
    top = FP8_MAX[fmt]
    next_up = top + (pos[-1] - pos[-2]) * 2  # the value the next code would have had
    edges = np.array([top, (top + next_up) / 2, next_up, top * 1.5, 3.0e38, np.finfo(np.float32).max,
                      MIN_SUBNORMAL[fmt], MIN_SUBNORMAL[fmt] / 2, MIN_SUBNORMAL[fmt] / 4, 1e-30, 1e-45])
    base = np.concatenate([pos, mids, edges]).astype(np.float32)
    with np.errstate(over="ignore"):  # nextafter(FLT_MAX, inf) is inf, which is wanted
        near = np.concatenate([base, np.nextafter(base, np.float32(np.inf)), np.nextafter(base, np.float32(0))])
    special = np.array([np.inf, -np.inf, np.nan, -np.nan, 0.0, -0.0], np.float32)
    structured = np.concatenate([near, -near, special])
    # Random: log-uniform magnitudes over 2^-30 .. 2^20 (covers FP8 subnormals and overflow), random signs.
    m = n - structured.size
    mags = np.exp2(rng.uniform(-30, 20, m)).astype(np.float32)
    rand = np.where(rng.random(m) < 0.5, -mags, mags).astype(np.float32)
    return np.concatenate([structured, rand])


@pytest.mark.parametrize("fmt", FMTS)
def test_every_bfloat16_pattern(fmt):
    x = np.arange(2**16, dtype=np.uint32).astype(np.uint16).view(BF16)
    got, _, _ = quantize_np(x, fmt)
    x32 = x.astype(np.float32)
    assert_bits_equal(got, fp8_encode_ref(x32, fmt))
    inr = np.isfinite(x32) & (np.abs(x32) <= FP8_MAX[fmt])
    assert_bits_equal(got[inr], torch_codes(x32[inr], fmt))


@pytest.mark.parametrize("fmt", FMTS)
def test_million_float32_values(fmt, rng):
    x = hard_cases(fmt, rng)
    got, amax, scale_inv = quantize_np(x, fmt)
    assert_bits_equal(got, fp8_encode_ref(x, fmt))
    inr = np.isfinite(x) & (np.abs(x) <= FP8_MAX[fmt])
    assert_bits_equal(got[inr], torch_codes(x[inr], fmt))
    assert amax == np.inf and scale_inv == 1.0  # +-inf are in the input; NaN is ignored by amax


@pytest.mark.parametrize("fmt", FMTS)
def test_ties_round_to_even(fmt):
    pos = all_finite_fp8(fmt)
    pos = pos[pos > 0]
    mids = ((pos[:-1] + pos[1:]) / 2).astype(np.float32)
    got, _, _ = quantize_np(mids, fmt)
    lo = np.arange(1, pos.size, dtype=np.uint8)  # code of pos[i] is i for i >= 1 (0 is +0)
    assert_bits_equal(got, np.where(lo % 2 == 0, lo, lo + 1).astype(np.uint8))


@pytest.mark.parametrize("fmt", FMTS)
def test_specials(fmt):
    top = {"e4m3": 0x7E, "e5m2": 0x7B}[fmt]
    x = np.array([np.inf, -np.inf, np.nan, -np.nan, 0.0, -0.0, 1e30, -1e30], np.float32)
    got, amax, _ = quantize_np(x, fmt)
    assert list(got) == [top, 0x80 | top, 0x7F, 0x7F, 0x00, 0x80, top, 0x80 | top]
    assert amax == np.inf


@pytest.mark.parametrize("fmt", FMTS)
def test_torch_differs_on_purpose_out_of_range(fmt):
    """Documents a deliberate difference beyond the finite range: the library always
    saturates (like the GPU's satfinite conversion). torch's float8_e5m2 cast maps overflow
    to inf; its float8_e4m3fn cast mapped overflow to NaN in older releases and saturates
    (as we do) in recent ones (2.13 does), so both e4m3fn behaviours are accepted here."""
    x = np.array([1e6, -1e6, np.inf, 2 * FP8_MAX[fmt]], np.float32)
    got, _, _ = quantize_np(x, fmt)
    ours = got.view(FP8_NP[fmt]).astype(np.float32)
    np.testing.assert_array_equal(ours, [FP8_MAX[fmt], -FP8_MAX[fmt], FP8_MAX[fmt], FP8_MAX[fmt]])
    theirs = torch.from_numpy(x).to(TORCH_FP8[fmt]).float().numpy()
    if fmt == "e4m3":
        assert np.isnan(theirs).all() or np.array_equal(theirs, ours), theirs
    else:
        np.testing.assert_array_equal(theirs, [np.inf, -np.inf, np.inf, np.inf])


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("out_name", ["float32", "float16", "bfloat16"])
def test_dequantize_every_code_and_round_trip(fmt, out_name):
    codes = np.arange(256, dtype=np.uint8)
    ref32 = codes.view(FP8_NP[fmt]).astype(np.float32)
    out_t = {"float32": np.float32, "float16": np.float16, "bfloat16": BF16}[out_name]
    out = np.full(256, np.nan, out_t)
    nvte.dequantize(nvte.Tensor(codes, dtype=NVTE_DTYPE[fmt], scale_inv=scalar(1.0)), tensor(out))
    # Every FP8 value is exact in each of these dtypes, so the decode is bit-exact.
    assert_bits_equal(out.view(np.uint8), ref32.astype(out_t).view(np.uint8))
    # Back to FP8: finite codes return unchanged; NaNs become the canonical 0x7F; E5M2 inf saturates.
    back, _, _ = quantize_np(out, fmt)
    expect = codes.copy()
    expect[np.isnan(ref32)] = 0x7F
    top = {"e4m3": 0x7E, "e5m2": 0x7B}[fmt]
    expect[ref32 == np.inf] = top
    expect[ref32 == -np.inf] = 0x80 | top
    assert_bits_equal(back, expect)


def test_ml_dtypes_reference_is_what_we_think():
    """fp8_encode_ref is ml_dtypes' RNE cast in range: spot-check a few known encodings."""
    x = np.array([1.0, 448.0, 2.0**-9, 2.0**-10 * 3, 0.1], np.float32)
    assert list(fp8_encode_ref(x, "e4m3")) == [0x38, 0x7E, 0x01, 0x02, 0x1D]
    assert ml_dtypes.float8_e4m3fn(0.1).view(np.uint8) == 0x1D
    assert DT.kFloat8E4M3 == NVTE_DTYPE["e4m3"]
