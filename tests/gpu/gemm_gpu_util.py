"""Shared pieces of the CUDA GEMM tests (test_gemm*_gpu.py): each runs nvte_cublas_gemm / _v2 /
nvte_multi_tensor_gemm on CUDA tensors and on CPU copies of the same inputs and compares.


Row-major view (gemm.h): D [n, m] = op(B) [n, k] @ op(A) [k, m]; A is [m, k] when transa else
[k, m], B is [k, n] when transb else [n, k].

Tolerances. Both backends accumulate in float32; summing k products in any order is within
(k + 2) * u * (|op(B)| @ |op(A)|) of the exact value (u = 2^-24, Higham Thm 3.1, + 2 for the
epilogue's roundings), so two such results differ by twice that; we allow 4x. A 16/8-bit
output adds one rounding on each side: the two stored values differ by at most one ulp of
the larger, i.e. 2^-7 (bf16) / 2^-10 (fp16) relative. FP8 operands decode exactly (q * scale_inv
has few significant bits); Hopper's FP8 tensor cores accumulate in reduced precision between
promotions, so FP8 GEMMs get (k + 2) * 2^-12 * S (fast accumulation) or 2^-16 (split).
An FP8 D is compared decoded: within one FP8 step of the larger magnitude, plus the float32
results' difference times D's scale (values near a rounding boundary may round either way).
"""
import ctypes
import os
import zlib

import pytest
import torch

import transformer_engine
from transformer_engine import _nvte as nvte

from gpu_util import T, cpu_copy, sync

DEV = "cuda"
U = 2.0**-24
HP = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
OUT_RTOL = {torch.float32: 0.0, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}
OUT_ATOL = {torch.float32: 0.0, torch.bfloat16: 1e-30, torch.float16: 2.0**-24}
FP8_REL_STEP = {"e4m3": 2.0**-3, "e5m2": 2.0**-2}
FP8_MIN_STEP = {"e4m3": 2.0**-9, "e5m2": 2.0**-16}
WS_BYTES = nvte.gemm_workspace_size(nvte.Backend.CUDA)
LAYOUTS = ["TN", "NN", "NT", "TT"]


def non_tn_fp8_supported():
    lib = ctypes.CDLL(os.path.join(transformer_engine.get_library_dir(), "libtransformer_engine.so"))
    return lib.nvte_is_non_tn_fp8_gemm_supported() == 1


def gen(*key):
    """A generator seeded from the test's parameters (stable across processes)."""
    g = torch.Generator()
    g.manual_seed(zlib.crc32(repr(key).encode()))
    return g


def uniform(shape, g, lo=-2.0, hi=2.0):
    return torch.rand(shape, generator=g, dtype=torch.float64) * (hi - lo) + lo


class Operand:
    """One GEMM input as NVTE tensors on both backends (.tg on the GPU, .tc on the CPU) and
    .val, the float64 values the library decodes. FP8 inputs get scale_inv != 1."""

    def __init__(self, shape, kind, g, rowwise=True, columnwise=False, offset=0, scale_inv=None):
        x = uniform(shape, g)
        if kind in FP8:
            si = scale_inv if scale_inv is not None else (0.375 if kind == "e4m3" else 3.0)
            data = (x / si).float().to(FP8[kind])
            self.val = data.double() * si
            si_t = torch.tensor([si], dtype=torch.float32)
        else:
            data = x.to(HP[kind])
            self.val = data.double()
            si_t = None
        self.bufs = {}
        for dev, attr in [(DEV, "tg"), ("cpu", "tc")]:
            row = col = si = None
            if rowwise:
                if offset and dev == DEV:  # a view starting `offset` elements into its allocation
                    flat = torch.empty(data.numel() + offset, dtype=data.dtype, device=dev)
                    row = flat[offset:].view(data.shape)
                    row.copy_(data.to(dev))
                else:
                    row = data.to(dev).contiguous()
            if columnwise:
                col = data.t().contiguous().to(dev)
            if si_t is not None:
                si = si_t.to(dev)
            t = T(row, scale_inv=si if rowwise else None, columnwise=col,
                  columnwise_scale_inv=si if columnwise else None)
            setattr(self, attr, t)


def op(v, trans):
    return v.t() if trans else v


def ab_shapes(n, m, k, transa, transb):
    return ((m, k) if transa else (k, m)), ((k, n) if transb else (n, k))


def product_ref(a, b, transa, transb):
    """Exact product (float64) and S = |op(B)| @ |op(A)| for the error bounds."""
    oa, ob = op(a.val, transa), op(b.val, transb)
    return ob @ oa, ob.abs() @ oa.abs()


class Pair:
    """An output (or optional input) buffer on both backends, same initial contents."""

    def __init__(self, init):
        self.g = init.to(DEV).contiguous().clone()
        self.c = cpu_copy(init).contiguous()
        self.tg, self.tc = T(self.g), T(self.c)


def nan_pair(shape, dtype):
    return Pair(torch.full(shape, float("nan"), dtype=dtype))


def rand_pair(shape, dtype, g, lo=-2.0, hi=2.0):
    return Pair(uniform(shape, g, lo, hi).to(dtype))


def workspace():
    return T(torch.empty(WS_BYTES, dtype=torch.uint8, device=DEV))


def both_gemm(a, b, d, transa, transb, bias=None, pre=None, grad=False, accumulate=False, split=True, sm=0,
              ws=True):
    nvte.gemm(a.tg.t, b.tg.t, d.tg.t, bias=bias.tg.t if bias else None, pre_gelu_out=pre.tg.t if pre else None,
              transa=transa, transb=transb, grad=grad, workspace=workspace().t if ws else None,
              accumulate=accumulate, use_split_accumulator=split, math_sm_count=sm)
    nvte.gemm(a.tc.t, b.tc.t, d.tc.t, bias=bias.tc.t if bias else None, pre_gelu_out=pre.tc.t if pre else None,
              transa=transa, transb=transb, grad=grad, accumulate=accumulate)
    sync()


def check_close(got, ref, tol, dtype):
    """|got - ref| <= tol + one output rounding (relative to the larger of the two)."""
    g, r = got.detach().cpu().double(), ref.detach().cpu().double()
    assert g.shape == r.shape, f"{g.shape} vs {r.shape}"
    assert not g.isnan().any(), f"{int(g.isnan().sum())} NaNs in the GPU result (unwritten elements?)"
    big = torch.maximum(g.abs(), r.abs())
    allowed = torch.as_tensor(tol, dtype=torch.float64) * 1.01 + OUT_RTOL[dtype] * big + OUT_ATOL[dtype]
    bad = ~((g - r).abs() <= allowed)
    if bad.any():
        i = tuple(bad.nonzero()[0].tolist())
        raise AssertionError(f"{int(bad.sum())} of {bad.numel()} differ; first at {i}: got {g[i].item()!r} "
                             f"ref {r[i].item()!r} allowed {torch.broadcast_to(allowed, r.shape)[i].item()!r}")


def acc_tol(S, k, fp8=False, split=True):
    if fp8:
        return (k + 2) * (2.0**-16 if split else 2.0**-12) * S + 8 * (k + 2) * U * S
    return 4.0 * (k + 2) * U * S


def fp8_decoded(x):
    return x.detach().cpu().double()


def check_fp8_within_one_step(got, ref, fmt, tol):
    """FP8 outputs (values * D's scale): within one FP8 step plus the float32 results' own
    difference `tol` (already scaled; it matters where cancellation leaves small values)."""
    g, r = fp8_decoded(got), fp8_decoded(ref)
    big = torch.maximum(g.abs(), r.abs())
    e = torch.floor(torch.log2(big.clamp_min(1e-30)))
    step = torch.maximum(torch.exp2(e) * FP8_REL_STEP[fmt], torch.full_like(e, FP8_MIN_STEP[fmt]))
    bad = ~((g - r).abs() <= step + tol)
    if bad.any():
        i = tuple(bad.nonzero()[0].tolist())
        raise AssertionError(f"{int(bad.sum())} FP8 values differ by more than one step; first at {i}: "
                             f"got {g[i].item()!r} ref {r[i].item()!r}")
    # Most values round identically (the float32 results agree to ~1e-6 relative).
    assert (g == r).double().mean() > 0.9


# cuBLASLt's AMAX_D of an FP8 D agrees with the float32 amax to ~2^-15 relative (it is not
# computed from the exact float32 values); 2^-10 is ample for a scaling factor.
AMAX_RTOL = 2.0**-10


def expect_error(status, match, fn):
    with pytest.raises(nvte.Error, match=match) as e:
        fn()
    assert e.value.args[1] == int(status), e.value.args


def fp8_out_pair(shape, fmt, scale, amax_init):
    d = Pair(torch.full(shape, 0xAB, dtype=torch.uint8).view(FP8[fmt]))
    extra = {k: Pair(torch.tensor([v], dtype=torch.float32))
             for k, v in (("scale", scale), ("amax", amax_init), ("scale_inv", -1.0))}
    d.tg = T(d.g, scale=extra["scale"].g, amax=extra["amax"].g, scale_inv=extra["scale_inv"].g)
    d.tc = T(d.c, scale=extra["scale"].c, amax=extra["amax"].c, scale_inv=extra["scale_inv"].c)
    return d, extra


def scalar_at(value, offset_floats):
    """A one-float tensor `offset_floats` elements into its allocation (4 * offset bytes past
    a 256-byte boundary): how one entry of a per-module scale array is passed."""
    buf = torch.full((64,), float("nan"), dtype=torch.float32, device=DEV)
    buf[offset_floats] = value
    return buf[offset_floats:offset_floats + 1]


def run_repeatedly(calls, fn):
    """fn() `calls` times, syncing every 8 calls so that the tuner's events complete."""
    for i in range(calls):
        fn()
        if i % 8 == 7:
            sync()
    sync()


def act_tol(x):
    # float32 evaluation of gelu / dgelu (tanhf ~2 ulp amplified <= 5x) on both sides.
    return 2.0**-18 * (1.0 + x.abs())
