"""nvte_cublas_gemm / _v2 / nvte_multi_tensor_gemm on CUDA tensors (cuBLASLt) against the CPU
backend on CPU copies of the same inputs.

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
import math
import os
import zlib

import pytest
import torch

import transformer_engine
from transformer_engine import _nvte as nvte

from gpu_util import DT, T, cpu_copy, assert_bits_equal, sync

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


# ------------------------------------------------------------------------- plain GEMMs
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("n,m,k", [(1, 1, 1), (3, 5, 7), (37, 129, 65), (200, 256, 1000), (64, 48, 96)])
def test_layouts(dtype, layout, n, m, k):
    transa, transb = layout[0] == "T", layout[1] == "T"
    g = gen(dtype, layout, n, m, k)
    sa, sb = ab_shapes(n, m, k, transa, transb)
    a, b = Operand(sa, dtype, g), Operand(sb, dtype, g)
    d = nan_pair((n, m), HP[dtype])
    both_gemm(a, b, d, transa, transb)
    _, S = product_ref(a, b, transa, transb)
    check_close(d.g, d.c, acc_tol(S, k), HP[dtype])


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_large(dtype):
    n, m, k = 1024, 768, 2048
    g = gen(7)
    a, b = Operand((m, k), dtype, g), Operand((n, k), dtype, g)
    d = nan_pair((n, m), HP[dtype])
    both_gemm(a, b, d, True, False)
    _, S = product_ref(a, b, True, False)
    check_close(d.g, d.c, acc_tol(S, k), HP[dtype])


@pytest.mark.parametrize("layout", ["TN", "NT"])
def test_misaligned_operands(layout):
    """Operands starting 1 element into their allocation (2-byte aligned): cuBLASLt must be told."""
    transa, transb = layout[0] == "T", layout[1] == "T"
    n, m, k = 33, 47, 81
    g = gen(11)
    sa, sb = ab_shapes(n, m, k, transa, transb)
    a, b = Operand(sa, "bfloat16", g, offset=1), Operand(sb, "bfloat16", g, offset=3)
    d = nan_pair((n, m), torch.bfloat16)
    both_gemm(a, b, d, transa, transb)
    _, S = product_ref(a, b, transa, transb)
    check_close(d.g, d.c, acc_tol(S, k), torch.bfloat16)


def test_repeated_call_same_result():
    """The second call of a shape reuses the cached plan; results are bit-identical."""
    g = gen(12)
    n, m, k = 96, 80, 144
    a, b = Operand((m, k), "bfloat16", g), Operand((n, k), "bfloat16", g)
    d1, d2 = nan_pair((n, m), torch.bfloat16), nan_pair((n, m), torch.bfloat16)
    both_gemm(a, b, d1, True, False)
    both_gemm(a, b, d2, True, False)
    assert_bits_equal(d1.g, d2.g)
    _, S = product_ref(a, b, True, False)
    check_close(d1.g, d1.c, acc_tol(S, k), torch.bfloat16)


def test_sm_count_and_no_workspace():
    g = gen(13)
    n, m, k = 128, 256, 512
    a, b = Operand((m, k), "bfloat16", g), Operand((n, k), "bfloat16", g)
    _, S = product_ref(a, b, True, False)
    d = nan_pair((n, m), torch.bfloat16)
    both_gemm(a, b, d, True, False, sm=16)
    check_close(d.g, d.c, acc_tol(S, k), torch.bfloat16)
    d = nan_pair((n, m), torch.bfloat16)
    both_gemm(a, b, d, True, False, ws=False)
    check_close(d.g, d.c, acc_tol(S, k), torch.bfloat16)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_accumulate(dtype):
    g = gen(14)
    n, m, k = 64, 72, 40
    a, b = Operand((k, m), dtype, g), Operand((n, k), dtype, g)
    d = rand_pair((n, m), HP[dtype], g)
    both_gemm(a, b, d, False, False, accumulate=True)
    P, S = product_ref(a, b, False, False)
    # cuBLASLt rounds the product to D's dtype before adding C = D when D is 16-bit (seen on
    # H200, cuBLASLt 13.1): one more rounding of |product| than the CPU.
    check_close(d.g, d.c, acc_tol(S + 2.0, k) + OUT_RTOL[HP[dtype]] * P.abs(), HP[dtype])


def test_amax_of_high_precision_output():
    g = gen(15)
    n, m, k = 50, 64, 32
    a, b = Operand((m, k), "bfloat16", g), Operand((n, k), "bfloat16", g)
    for init in (0.25, 1e6):  # max-accumulated: a small amax grows, a large one stays
        d = Pair(torch.full((n, m), float("nan"), dtype=torch.bfloat16))
        amax = Pair(torch.tensor([init], dtype=torch.float32))
        d.tg = T(d.g, amax=amax.g)
        d.tc = T(d.c, amax=amax.c)
        both_gemm(a, b, d, True, False)
        _, S = product_ref(a, b, True, False)
        check_close(d.g, d.c, acc_tol(S, k), torch.bfloat16)
        # The GPU reduces the stored bf16 D, the CPU the float32 values before rounding: one bf16 ulp.
        check_close(amax.g, amax.c, 1e-5 * amax.c.abs(), torch.bfloat16)
        if init > 1e5:
            assert amax.g.item() == init


# ------------------------------------------------------------------------------ FP8
FP8_PAIRS = [("e4m3", "e4m3"), ("e4m3", "e5m2"), ("e5m2", "e4m3")]


@pytest.mark.parametrize("fa,fb", FP8_PAIRS)
@pytest.mark.parametrize("out", ["bfloat16", "float32"])
@pytest.mark.parametrize("n,m,k", [(64, 48, 96), (37, 256, 512), (200, 16, 32)])
def test_fp8_tn(fa, fb, out, n, m, k):
    g = gen(fa, fb, out, n, m, k)
    a, b = Operand((m, k), fa, g), Operand((n, k), fb, g)
    d = nan_pair((n, m), HP[out])
    both_gemm(a, b, d, True, False)
    _, S = product_ref(a, b, True, False)
    check_close(d.g, d.c, acc_tol(S, k, fp8=True), HP[out])


def test_fp8_fast_accumulation():
    g = gen(21)
    n, m, k = 128, 96, 1024
    a, b = Operand((m, k), "e4m3", g), Operand((n, k), "e4m3", g)
    d = nan_pair((n, m), torch.bfloat16)
    both_gemm(a, b, d, True, False, split=False)
    _, S = product_ref(a, b, True, False)
    check_close(d.g, d.c, acc_tol(S, k, fp8=True, split=False), torch.bfloat16)


def fp8_out_pair(shape, fmt, scale, amax_init):
    d = Pair(torch.full(shape, 0xAB, dtype=torch.uint8).view(FP8[fmt]))
    extra = {k: Pair(torch.tensor([v], dtype=torch.float32))
             for k, v in (("scale", scale), ("amax", amax_init), ("scale_inv", -1.0))}
    d.tg = T(d.g, scale=extra["scale"].g, amax=extra["amax"].g, scale_inv=extra["scale_inv"].g)
    d.tc = T(d.c, scale=extra["scale"].c, amax=extra["amax"].c, scale_inv=extra["scale_inv"].c)
    return d, extra


@pytest.mark.parametrize("fa,fb,fd", [("e4m3", "e4m3", "e4m3"), ("e4m3", "e5m2", "e4m3"),
                                      ("e5m2", "e4m3", "e4m3"), ("e4m3", "e5m2", "e5m2")])
@pytest.mark.parametrize("amax_init", [0.25, 1e6])
def test_fp8_output(fa, fb, fd, amax_init):
    g = gen(22)
    n, m, k = 80, 64, 64
    a, b = Operand((m, k), fa, g), Operand((n, k), fb, g)
    scale = 2.0 if fd == "e4m3" else 64.0
    d, x = fp8_out_pair((n, m), fd, scale, amax_init)
    both_gemm(a, b, d, True, False)
    _, S = product_ref(a, b, True, False)
    check_fp8_within_one_step(d.g, d.c, fd, scale * acc_tol(S, k, fp8=True))
    assert_bits_equal(x["scale_inv"].g, x["scale_inv"].c)  # 1 / scale
    check_close(x["amax"].g, x["amax"].c, AMAX_RTOL * x["amax"].c.abs(), torch.float32)
    if amax_init > 1e5:
        assert x["amax"].g.item() == amax_init  # max-accumulated, not overwritten


def test_fp8_output_needs_workspace_for_amax():
    g = gen(23)
    a, b = Operand((32, 32), "e4m3", g), Operand((16, 32), "e4m3", g)
    d, _ = fp8_out_pair((16, 32), "e4m3", 1.0, 0.0)
    expect_error(nvte.Status.INVALID_ARGUMENT, r"amax needs the GEMM workspace",
                 lambda: nvte.gemm(a.tg.t, b.tg.t, d.tg.t, transa=True, transb=False, workspace=None))


@pytest.mark.parametrize("layout", ["NN", "NT", "TT"])
def test_fp8_columnwise_operands(layout):
    """Non-TN FP8 layouts use the columnwise data (the transpose) with the flag flipped on
    Hopper; the CPU uses the rowwise data. Same values, same result."""
    transa, transb = layout[0] == "T", layout[1] == "T"
    n, m, k = 48, 64, 96
    g = gen(24)
    sa, sb = ab_shapes(n, m, k, transa, transb)
    a = Operand(sa, "e4m3", g, columnwise=True)
    b = Operand(sb, "e5m2", g, columnwise=True)
    d = nan_pair((n, m), torch.bfloat16)
    both_gemm(a, b, d, transa, transb)
    _, S = product_ref(a, b, transa, transb)
    check_close(d.g, d.c, acc_tol(S, k, fp8=True), torch.bfloat16)


def test_fp8_columnwise_only():
    """Operands holding only columnwise data (as FP8 tensors quantized for the backward pass)."""
    n, m, k = 48, 64, 96
    g = gen(25)
    a = Operand((k, m), "e4m3", g, rowwise=False, columnwise=True)  # NN: A needs its transpose
    b = Operand((n, k), "e4m3", g)
    d = nan_pair((n, m), torch.bfloat16)
    both_gemm(a, b, d, False, False)
    _, S = product_ref(a, b, False, False)
    check_close(d.g, d.c, acc_tol(S, k, fp8=True), torch.bfloat16)


def test_fp8_non_tn_without_columnwise_is_not_supported_on_hopper():
    if non_tn_fp8_supported():
        pytest.skip("this GPU runs FP8 GEMMs in every layout")
    g = gen(26)
    a, b = Operand((32, 32), "e4m3", g), Operand((16, 32), "e4m3", g)
    d = nan_pair((16, 32), torch.bfloat16)
    expect_error(nvte.Status.NOT_SUPPORTED, r"only in TN layout.*A is FP8 with transa = false.*no columnwise data",
                 lambda: nvte.gemm(a.tg.t, b.tg.t, d.tg.t, transa=False, transb=False, workspace=workspace().t))


def test_fp8_shape_rules():
    g = gen(27)
    # k = 40: A's and B's leading dimension is 40 bytes, not a multiple of 16.
    a, b = Operand((32, 40), "e4m3", g), Operand((16, 40), "e4m3", g)
    d = nan_pair((16, 32), torch.bfloat16)
    expect_error(nvte.Status.NOT_SUPPORTED, r"leading dimensions of A and B to be multiples of 16 bytes",
                 lambda: nvte.gemm(a.tg.t, b.tg.t, d.tg.t, transa=True, workspace=workspace().t))
    # m = 12 with a bf16 D: 24 bytes.
    a, b = Operand((12, 32), "e4m3", g), Operand((16, 32), "e4m3", g)
    d = nan_pair((16, 12), torch.bfloat16)
    expect_error(nvte.Status.NOT_SUPPORTED, r"D's leading dimension \(m = 12",
                 lambda: nvte.gemm(a.tg.t, b.tg.t, d.tg.t, transa=True, workspace=workspace().t))
    # e5m2 x e5m2 has no cuBLASLt kernel.
    a, b = Operand((32, 32), "e5m2", g), Operand((16, 32), "e5m2", g)
    d = nan_pair((16, 32), torch.bfloat16)
    expect_error(nvte.Status.NOT_SUPPORTED, r"both operands in float8_e5m2",
                 lambda: nvte.gemm(a.tg.t, b.tg.t, d.tg.t, transa=True, workspace=workspace().t))


# ------------------------------------------------------------------------- epilogues
def gelu(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def act_tol(x):
    # float32 evaluation of gelu / dgelu (tanhf ~2 ulp amplified <= 5x) on both sides.
    return 2.0**-18 * (1.0 + x.abs())


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_bias(dtype, layout):
    transa, transb = layout[0] == "T", layout[1] == "T"
    n, m, k = 40, 72, 56
    g = gen(31)
    sa, sb = ab_shapes(n, m, k, transa, transb)
    a, b = Operand(sa, dtype, g), Operand(sb, dtype, g)
    bias = rand_pair((m,), HP[dtype], g)
    d = nan_pair((n, m), HP[dtype])
    both_gemm(a, b, d, transa, transb, bias=bias)
    _, S = product_ref(a, b, transa, transb)
    check_close(d.g, d.c, acc_tol(S + 2.0, k), HP[dtype])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("layout", ["TN", "NN"])
def test_gelu_aux(dtype, with_bias, layout):
    transa, transb = layout[0] == "T", layout[1] == "T"
    n, m, k = 48, 64, 40
    g = gen(32)
    sa, sb = ab_shapes(n, m, k, transa, transb)
    a, b = Operand(sa, dtype, g), Operand(sb, dtype, g)
    bias = rand_pair((m,), HP[dtype], g) if with_bias else None
    pre = nan_pair((n, m), HP[dtype])
    d = nan_pair((n, m), HP[dtype])
    both_gemm(a, b, d, transa, transb, bias=bias, pre=pre)
    _, S = product_ref(a, b, transa, transb)
    tol = acc_tol(S + 2.0, k)
    check_close(pre.g, pre.c, tol, HP[dtype])
    x = pre.c.double()
    check_close(d.g, d.c, 1.2 * tol + act_tol(x), HP[dtype])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("with_dbias", [False, True])
@pytest.mark.parametrize("layout", ["NN", "TN"])
def test_dgelu(dtype, with_dbias, layout):
    transa, transb = layout[0] == "T", layout[1] == "T"
    n, m, k = 48, 64, 40
    g = gen(33)
    sa, sb = ab_shapes(n, m, k, transa, transb)
    a, b = Operand(sa, dtype, g), Operand(sb, dtype, g)
    pre = rand_pair((n, m), HP[dtype], g, -3.0, 3.0)  # the GELU input, read
    dbias = nan_pair((m,), HP[dtype]) if with_dbias else None
    d = nan_pair((n, m), HP[dtype])
    both_gemm(a, b, d, transa, transb, bias=dbias, pre=pre, grad=True)
    _, S = product_ref(a, b, transa, transb)
    # |dgelu| <= 1.13: the product's error scales by it; dgelu's own error times |product|.
    tol = 1.2 * acc_tol(S, k) + act_tol(pre.c.double()) * S
    check_close(d.g, d.c, tol, HP[dtype])
    if with_dbias:
        # Column sums of D (before its output rounding on both sides): each element's error plus
        # the rounding of D itself (the GPU may sum the unrounded values), plus float32 summation.
        dc = d.c.double()
        col_tol = (tol + OUT_RTOL[HP[dtype]] * dc.abs()).sum(0) + 2 * (n + 2) * U * dc.abs().sum(0)
        check_close(dbias.g, dbias.c, col_tol, HP[dtype])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_bgradb(dtype, layout):
    """grad with bias and no pre_gelu_out: bias receives the row sums of op(B) ([n]). cuBLASLt's
    BGRADB epilogue exists only for a transposed B (the wgrad layout NT); other layouts fail
    clearly instead of computing something else."""
    transa, transb = layout[0] == "T", layout[1] == "T"
    n, m, k = 48, 64, 40
    g = gen(34)
    sa, sb = ab_shapes(n, m, k, transa, transb)
    a, b = Operand(sa, dtype, g), Operand(sb, dtype, g)
    dbias = nan_pair((n,), HP[dtype])
    d = nan_pair((n, m), HP[dtype])
    if not transb:
        expect_error(nvte.Status.NOT_SUPPORTED, r"epilogue BGRADB.*only for a transposed B",
                     lambda: nvte.gemm(a.tg.t, b.tg.t, d.tg.t, bias=dbias.tg.t, transa=transa, transb=transb,
                                       grad=True, workspace=workspace().t))
        return
    both_gemm(a, b, d, transa, transb, bias=dbias, grad=True)
    _, S = product_ref(a, b, transa, transb)
    check_close(d.g, d.c, acc_tol(S, k), HP[dtype])
    ob = op(b.val, transb)
    check_close(dbias.g, dbias.c, 4 * (k + 2) * U * ob.abs().sum(1), HP[dtype])


def test_gelu_needs_m_multiple_of_8():
    g = gen(35)
    a, b = Operand((12, 16), "bfloat16", g), Operand((8, 16), "bfloat16", g)
    pre = nan_pair((8, 12), torch.bfloat16)
    d = nan_pair((8, 12), torch.bfloat16)
    expect_error(nvte.Status.NOT_SUPPORTED, r"GELU epilogues need m .* multiple of 8, got m = 12",
                 lambda: nvte.gemm(a.tg.t, b.tg.t, d.tg.t, pre_gelu_out=pre.tg.t, transa=True,
                                   workspace=workspace().t))


@pytest.mark.parametrize("epi", ["bias", "gelu_bias", "fp8_out_bias"])
def test_fp8_epilogues(epi):
    """The FP8 forward epilogues Transformer Engine uses: bf16 bias, GELU with a bf16 aux."""
    g = gen(36)
    n, m, k = 64, 96, 128
    a, b = Operand((m, k), "e4m3", g), Operand((n, k), "e4m3", g)
    bias = rand_pair((m,), torch.bfloat16, g)
    _, S = product_ref(a, b, True, False)
    tol = acc_tol(S + 2.0, k, fp8=True)
    if epi == "fp8_out_bias":
        d, x = fp8_out_pair((n, m), "e4m3", 1.0, 0.0)
        both_gemm(a, b, d, True, False, bias=bias)
        check_fp8_within_one_step(d.g, d.c, "e4m3", tol)
        check_close(x["amax"].g, x["amax"].c, AMAX_RTOL * x["amax"].c.abs(), torch.float32)
        return
    d = nan_pair((n, m), torch.bfloat16)
    pre = nan_pair((n, m), torch.bfloat16) if epi == "gelu_bias" else None
    both_gemm(a, b, d, True, False, bias=bias, pre=pre)
    if pre is not None:
        check_close(pre.g, pre.c, tol, torch.bfloat16)
        tol = 1.2 * tol + act_tol(pre.c.double())
    check_close(d.g, d.c, tol, torch.bfloat16)


@pytest.mark.parametrize("epi", ["bias", "gelu", "gelu_bias"])
@pytest.mark.parametrize("accumulate", [False, True])
def test_fp8_epilogues_float32_model(epi, accumulate):
    """FP8 operands with a float32 D, bias and GELU aux (a float32 model under fp8_autocast): cuBLASLt
    has no such FP8 epilogue, so the library runs a plain GEMM and applies bias / GELU itself."""
    g = gen(37)
    n, m, k = 48, 80, 96
    a, b = Operand((m, k), "e4m3", g), Operand((n, k), "e4m3", g)
    bias = rand_pair((m,), torch.float32, g) if epi != "gelu" else None
    _, S = product_ref(a, b, True, False)
    tol = acc_tol(S + 2.0 + (2.0 if accumulate else 0.0), k, fp8=True)
    d = rand_pair((n, m), torch.float32, g) if accumulate else nan_pair((n, m), torch.float32)
    pre = nan_pair((n, m), torch.float32) if epi.startswith("gelu") else None
    both_gemm(a, b, d, True, False, bias=bias, pre=pre, accumulate=accumulate)
    if pre is not None:
        check_close(pre.g, pre.c, tol, torch.float32)
        tol = 1.2 * tol + act_tol(pre.c.double())
    check_close(d.g, d.c, tol, torch.float32)


# ------------------------------------------------------------------------------ v2
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("separate_c", [False, True])
def test_v2_alpha_beta(dtype, separate_c):
    g = gen(41)
    n, m, k = 56, 40, 72
    a, b = Operand((m, k), dtype, g), Operand((k, n), dtype, g)  # TT
    alpha, beta = 0.5, -1.5
    d = rand_pair((n, m), HP[dtype], g)
    c = rand_pair((n, m), HP[dtype], g) if separate_c else None
    ws = workspace()
    nvte.gemm_v2(True, True, alpha, a.tg.t, b.tg.t, beta, c.tg.t if c else None, d.tg.t, workspace=ws.t)
    nvte.gemm_v2(True, True, alpha, a.tc.t, b.tc.t, beta, c.tc.t if c else None, d.tc.t)
    sync()
    _, S = product_ref(a, b, True, True)
    check_close(d.g, d.c, acc_tol(alpha * S + abs(beta) * 2.0, k), HP[dtype])


def test_v2_config_epilogue():
    g = gen(42)
    n, m, k = 40, 64, 48
    a, b = Operand((m, k), "bfloat16", g), Operand((n, k), "bfloat16", g)
    bias = rand_pair((m,), torch.bfloat16, g)
    pre = nan_pair((n, m), torch.bfloat16)
    d = nan_pair((n, m), torch.bfloat16)
    for dev_t in ("tg", "tc"):
        kw = dict(workspace=workspace().t) if dev_t == "tg" else {}
        nvte.gemm_v2(True, False, 2.0, getattr(a, dev_t).t, getattr(b, dev_t).t, 0.0, None, getattr(d, dev_t).t,
                     bias=getattr(bias, dev_t).t, gelu=True, aux=getattr(pre, dev_t).t, sm_count=8, **kw)
    sync()
    _, S = product_ref(a, b, True, False)
    tol = acc_tol(2 * S + 2.0, k)
    check_close(pre.g, pre.c, tol, torch.bfloat16)
    check_close(d.g, d.c, 1.2 * tol + act_tol(pre.c.double()), torch.bfloat16)


# ---------------------------------------------------------------------- multi-tensor
def test_multi_tensor():
    g = gen(51)
    shapes = [(16, 32, 48), (33, 40, 24), (64, 8, 16)]
    As, Bs, Ds, biases = [], [], [], []
    for i, (n, m, k) in enumerate(shapes):
        As.append(Operand((m, k), "bfloat16", g))
        Bs.append(Operand((n, k), "bfloat16", g))
        Ds.append(nan_pair((n, m), torch.bfloat16))
        biases.append(rand_pair((m,), torch.bfloat16, g) if i != 1 else None)
    ws = workspace()
    nvte.multi_tensor_gemm([x.tg.t for x in As], [x.tg.t for x in Bs], [x.tg.t for x in Ds],
                           [x.tg.t if x else None for x in biases], [None] * 3, transa=True, transb=False,
                           workspace=[ws.t])
    nvte.multi_tensor_gemm([x.tc.t for x in As], [x.tc.t for x in Bs], [x.tc.t for x in Ds],
                           [x.tc.t if x else None for x in biases], [None] * 3, transa=True, transb=False)
    sync()
    for (n, m, k), a, b, d in zip(shapes, As, Bs, Ds):
        _, S = product_ref(a, b, True, False)
        check_close(d.g, d.c, acc_tol(S + 2.0, k), torch.bfloat16)


def test_empty_and_k0():
    g = gen(52)
    # n = 0: nothing to write.
    a, b = Operand((16, 8), "bfloat16", g), Operand((0, 8), "bfloat16", g)
    d = nan_pair((0, 16), torch.bfloat16)
    both_gemm(a, b, d, True, False)
    # k = 0: D = 0, and the bias gradient of op(B) is 0.
    a, b = Operand((16, 0), "bfloat16", g), Operand((8, 0), "bfloat16", g)
    d = nan_pair((8, 16), torch.bfloat16)
    dbias = nan_pair((8,), torch.bfloat16)
    both_gemm(a, b, d, True, False, bias=dbias, grad=True)
    assert_bits_equal(d.g, d.c)
    assert_bits_equal(dbias.g, dbias.c)


def test_workspace_size():
    assert WS_BYTES >= 32 << 20
    assert nvte.gemm_workspace_size(nvte.Backend.CPU) == 0


# ------------------------------------------------------------ scale alignment, autotune
def scalar_at(value, offset_floats):
    """A one-float tensor `offset_floats` elements into its allocation (4 * offset bytes past
    a 256-byte boundary): how one entry of a per-module scale array is passed."""
    buf = torch.full((64,), float("nan"), dtype=torch.float32, device=DEV)
    buf[offset_floats] = value
    return buf[offset_floats:offset_floats + 1]


@pytest.mark.parametrize("offset", [1, 2, 3])
def test_fp8_scale_inv_not_16_byte_aligned(offset):
    """cuBLASLt 13.1's FP8 matmul refuses A/B scale pointers that are 4- or 8-byte aligned (seen
    on the H100); the library hands it aligned copies, so the result is that of aligned ones."""
    g = gen(40, offset)
    n, m, k = 64, 96, 128
    a, b = Operand((m, k), "e4m3", g), Operand((n, k), "e5m2", g)
    d_ref = nan_pair((n, m), torch.bfloat16)
    both_gemm(a, b, d_ref, True, False)
    sa = scalar_at(a.tg.refs[int(nvte.Param.kRowwiseScaleInv)].item(), offset)
    sb = scalar_at(b.tg.refs[int(nvte.Param.kRowwiseScaleInv)].item(), offset + 4)
    assert sa.data_ptr() % 16 != 0 and sb.data_ptr() % 16 != 0
    ta = T(a.tg.refs[int(nvte.Param.kRowwiseData)], dtype=DT.kFloat8E4M3, scale_inv=sa)
    tb = T(b.tg.refs[int(nvte.Param.kRowwiseData)], dtype=DT.kFloat8E5M2, scale_inv=sb)
    d = torch.full((n, m), float("nan"), dtype=torch.bfloat16, device=DEV)
    nvte.gemm(ta.t, tb.t, T(d).t, transa=True, transb=False, workspace=workspace().t)
    sync()
    assert_bits_equal(d, d_ref.g)
    _, S = product_ref(a, b, True, False)
    check_close(d, d_ref.c, acc_tol(S, k, fp8=True), torch.bfloat16)
    expect_error(nvte.Status.INVALID_ARGUMENT, r"not 16-byte aligned.*needs the GEMM workspace",
                 lambda: nvte.gemm(ta.t, tb.t, T(d).t, transa=True, transb=False, workspace=None))


def test_fp8_output_scale_not_16_byte_aligned():
    """The same for D's scale (FP8 output): the stored bytes, amax and scale_inv are those of an
    aligned scale."""
    g = gen(41)
    n, m, k = 80, 64, 64
    a, b = Operand((m, k), "e4m3", g), Operand((n, k), "e4m3", g)
    d_ref, x_ref = fp8_out_pair((n, m), "e4m3", 2.0, 0.25)
    both_gemm(a, b, d_ref, True, False)
    data = torch.full((n, m), 0xAB, dtype=torch.uint8, device=DEV)
    scale, amax, scale_inv = scalar_at(2.0, 1), scalar_at(0.25, 6), scalar_at(-1.0, 11)
    d = T(data, dtype=DT.kFloat8E4M3, scale=scale, amax=amax, scale_inv=scale_inv)
    nvte.gemm(a.tg.t, b.tg.t, d.t, transa=True, transb=False, workspace=workspace().t)
    sync()
    assert_bits_equal(data, d_ref.g.view(torch.uint8))
    assert_bits_equal(amax, x_ref["amax"].g)
    assert_bits_equal(scale_inv, x_ref["scale_inv"].g)


def run_repeatedly(calls, fn):
    """fn() `calls` times, syncing every 8 calls so that the tuner's events complete."""
    for i in range(calls):
        fn()
        if i % 8 == 7:
            sync()
    sync()


@pytest.mark.parametrize("kind", ["bfloat16", "e4m3"])
def test_autotune_decides_and_keeps_the_result(kind, monkeypatch, capfd):
    """NVTE_GEMM_AUTOTUNE=1: a plan's first calls time cuBLASLt's candidates and the fastest is
    kept, logged with NVTE_GEMM_AUTOTUNE_LOG=1. At this shape (the benchmark's Linear M=8192
    N=4096 K=4096, 8 candidates on the H100) every call's output is bit-identical to the
    heuristic's first choice (the default, checked against the CPU above)."""
    g = torch.Generator(device=DEV)
    g.manual_seed(42)
    n, m, k = 8192, 4096, 4096
    if kind == "e4m3":
        a8 = (torch.randn(m, k, device=DEV, generator=g) * 2).to(torch.float8_e4m3fn).view(torch.uint8)
        b8 = (torch.randn(n, k, device=DEV, generator=g) * 2).to(torch.float8_e4m3fn).view(torch.uint8)
        si = torch.tensor([0.5], device=DEV)
        ta, tb = T(a8, dtype=DT.kFloat8E4M3, scale_inv=si), T(b8, dtype=DT.kFloat8E4M3, scale_inv=si)
    else:
        ta = T(torch.randn(m, k, device=DEV, generator=g, dtype=torch.bfloat16))
        tb = T(torch.randn(n, k, device=DEV, generator=g, dtype=torch.bfloat16))
    ws = workspace()
    ref = torch.empty(n, m, dtype=torch.bfloat16, device=DEV)
    monkeypatch.delenv("NVTE_GEMM_AUTOTUNE", raising=False)  # the default: the heuristic's choice
    nvte.gemm(ta.t, tb.t, T(ref).t, transa=True, transb=False, workspace=ws.t)
    sync()
    monkeypatch.setenv("NVTE_GEMM_AUTOTUNE", "1")
    monkeypatch.setenv("NVTE_GEMM_AUTOTUNE_LOG", "1")
    outs = [torch.full((n, m), float("nan"), dtype=torch.bfloat16, device=DEV) for _ in range(8)]
    it = iter(range(1 << 30))

    def call():
        i = next(it)
        nvte.gemm(ta.t, tb.t, T(outs[i % 8]).t, transa=True, transb=False, workspace=ws.t)
        if i % 8 == 7:  # every output of the batch (different candidates) is the reference
            sync()
            for o in outs:
                assert_bits_equal(o, ref)

    run_repeatedly(8 * 8, call)  # 8 candidates x 5 samples, plus the calls after the choice
    log = capfd.readouterr().err
    assert "[nvte gemm autotune]" in log and f"m={m} n={n} k={k}" in log, log
    assert_bits_equal(outs[-1], ref)


def test_autotune_under_graph_capture(monkeypatch):
    """NVTE_GEMM_AUTOTUNE=1, a plan first used inside a CUDA graph capture: the capture neither
    times nor fails and records the heuristic's first choice, so replays (before and after the
    later eager calls have tuned) give the default path's bits; the tuned eager calls agree with
    the CPU backend (their algorithm may round differently at this size)."""
    g = gen(43)
    n, m, k = 2048, 1536, 1024
    a = Operand((m, k), "bfloat16", g)
    b = Operand((n, k), "bfloat16", g)
    ws = workspace()
    ref = torch.full((n, m), float("nan"), dtype=torch.bfloat16, device=DEV)
    nvte.gemm(a.tg.t, b.tg.t, T(ref).t, transa=True, transb=False, workspace=ws.t)  # default: first choice
    cpu = torch.full((n, m), float("nan"), dtype=torch.bfloat16)
    nvte.gemm(a.tc.t, b.tc.t, T(cpu).t, transa=True, transb=False)
    monkeypatch.setenv("NVTE_GEMM_AUTOTUNE", "1")
    d = torch.full((n, m), float("nan"), dtype=torch.bfloat16, device=DEV)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        with torch.cuda.graph(graph, stream=side):
            nvte.gemm(a.tg.t, b.tg.t, T(d).t, transa=True, transb=False, workspace=ws.t,
                      stream=side.cuda_stream)
    torch.cuda.current_stream().wait_stream(side)
    graph.replay()
    sync()
    assert_bits_equal(d, ref)
    eager = torch.full((n, m), float("nan"), dtype=torch.bfloat16, device=DEV)
    run_repeatedly(48, lambda: nvte.gemm(a.tg.t, b.tg.t, T(eager).t, transa=True, transb=False, workspace=ws.t))
    _, S = product_ref(a, b, True, False)
    check_close(eager, cpu, acc_tol(S, k), torch.bfloat16)
    d.fill_(float("nan"))
    graph.replay()
    sync()
    assert_bits_equal(d, ref)


_CACHE_CHILD = r"""
import os, sys, torch
sys.path.insert(0, os.path.join({root!r}, "tests", "gpu"))
from gpu_util import DT, T
from transformer_engine import _nvte as nvte
g = torch.Generator(device="cuda"); g.manual_seed(44)
a = torch.randn(4096, 4096, device="cuda", generator=g, dtype=torch.bfloat16)
b = torch.randn(8192, 4096, device="cuda", generator=g, dtype=torch.bfloat16)
d = torch.empty(8192, 4096, dtype=torch.bfloat16, device="cuda")
ws = T(torch.empty(nvte.gemm_workspace_size(nvte.Backend.CUDA), dtype=torch.uint8, device="cuda"))
nvte.gemm(T(a).t, T(b).t, T(d).t, transa=True, transb=False, workspace=ws.t)
torch.cuda.synchronize()
"""


def test_autotune_cache_file(tmp_path, monkeypatch, capfd):
    """NVTE_GEMM_AUTOTUNE_CACHE: a tuning process appends its choice to the file; a later process
    with the file (and tuning off) runs that choice from its first call."""
    import subprocess
    import sys
    cache = tmp_path / "gemm_tune.txt"
    monkeypatch.setenv("NVTE_GEMM_AUTOTUNE", "1")
    monkeypatch.setenv("NVTE_GEMM_AUTOTUNE_CACHE", str(cache))
    monkeypatch.setenv("NVTE_GEMM_AUTOTUNE_LOG", "1")
    g = torch.Generator(device=DEV)
    g.manual_seed(44)
    a = torch.randn(4096, 4096, device=DEV, generator=g, dtype=torch.bfloat16)
    b = torch.randn(8192, 4096, device=DEV, generator=g, dtype=torch.bfloat16)
    d = torch.empty(8192, 4096, dtype=torch.bfloat16, device=DEV)
    ws = workspace()
    run_repeatedly(64, lambda: nvte.gemm(T(a).t, T(b).t, T(d).t, transa=True, transb=False, workspace=ws.t))
    assert "[nvte gemm autotune]" in capfd.readouterr().err
    lines = cache.read_text().splitlines()
    assert len(lines) == 1 and " -> " in lines[0], lines
    chosen = int(lines[0].split(" -> ")[1].split()[0])
    monkeypatch.delenv("NVTE_GEMM_AUTOTUNE")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    child = subprocess.run([sys.executable, "-c", _CACHE_CHILD.format(root=root)], capture_output=True, text=True,
                           timeout=300)
    assert child.returncode == 0, child.stderr
    assert f"from NVTE_GEMM_AUTOTUNE_CACHE -> #{chosen}" in child.stderr, child.stderr
    assert cache.read_text().splitlines() == lines  # reading does not write
