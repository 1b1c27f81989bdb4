"""Activations on the CUDA backend vs the CPU backend (the oracle) on the same inputs: every
elementwise and gated entry point, forward and backward, float32/float16/bfloat16 in and out,
FP8 out (scale, amax, scale_inv, columnwise copy), odd shapes (scalar path), misaligned
buffers, in-place calls, poisoned outputs. (An nvte tensor does not own its buffers: every torch tensor passed in is
kept referenced until the call returns.)

Tolerances: both backends evaluate the same float32 formulas (activation_math.h), but the
device's tanhf/expf may differ from glibc's by an ulp and nvcc contracts a*b+c into FMAs, so
float32 results differ by a few ulps; near saturation (1 + tanh, 1 - sigmoid cancel) that is
an absolute error of ~1e-6 times the grad/gate multiplier. A 16-bit output may therefore land
one ulp away, and an FP8 output one FP8 step away on rare ties: we require >= 99% of the FP8
codes to be identical (at most one differing code in small tensors) and the rest within one
step."""
import math
import zlib

import pytest
import torch

from transformer_engine import _nvte as nvte

from gpu_util import DT, T, _explain, assert_bits_equal, cpu_copy, fp8_out, poisoned, sync

ELEMENTWISE = ["gelu", "relu", "silu", "qgelu", "srelu"]
GATED = ["glu", "geglu", "reglu", "swiglu", "qgeglu", "sreglu"]
HP = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Relative tolerance: one ulp of the output dtype (float32: a few ulps of the formula).
RTOL = {torch.float32: 1e-5, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}
ATOL = 1e-5  # times max(1, |grad/gate multiplier|)
SPECIALS = torch.tensor([0.0, 1.0, -1.0, 20.0, -20.0, 8.0, -8.0, 1e-3, -1e-3, 0.5, -0.5])
SHAPES = [(1, 1), (3, 5), (37, 129), (64, 1000), (2, 3, 16)]


def seeded(*key):
    """A CPU generator seeded from the test parameters (stable across processes)."""
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def make_input(shape, dtype, gen):
    """Normal(0, 3) with saturating (+-20), zero and near-zero values mixed in (CPU tensor)."""
    x = torch.randn(shape, generator=gen) * 3.0
    pick = torch.rand(shape, generator=gen) < 0.2
    idx = torch.randint(len(SPECIALS), shape, generator=gen)
    return torch.where(pick, SPECIALS[idx], x).to(dtype)


def gated_shape(shape, backward):
    """(input shape [.., 2H], grad shape [.., H], output shape) for a gated call with H = shape[-1]."""
    full = shape[:-1] + (2 * shape[-1],)
    return full, shape, (full if backward else shape)


def call(name, backward, x, g, out_t):
    if backward:
        getattr(nvte, "d" + name)(T(g).t, T(x).t, out_t)
    else:
        getattr(nvte, name)(T(x).t, out_t)


def multiplier(name, backward, x, g):
    """|grad/gate| factor that multiplies the formula's absolute error (float64, CPU)."""
    x = x.double()
    if name in ELEMENTWISE:
        return g.double().abs() if backward else torch.ones_like(x)
    h = x.shape[-1] // 2
    gate = x[..., h:]
    if not backward:
        return gate.abs()
    g = g.double()
    return torch.cat([(g * gate).abs(), g.abs()], dim=-1)


def assert_act_close(got, ref, mult):
    g, r = got.detach().cpu().double(), ref.detach().cpu().double()
    assert g.shape == r.shape
    tol = ATOL * torch.clamp(mult.reshape(r.shape), min=1.0) + RTOL[ref.dtype] * r.abs()
    bad = ~((g - r).abs() <= tol)
    assert not bool(bad.any()), _explain(g, r, bad)


def fp8_ordinal(c):
    c = c.to(torch.int32)
    return torch.where((c & 0x80) != 0, -(c & 0x7F), c & 0x7F)


def assert_fp8_codes_close(got, ref):
    got, ref = got.cpu(), ref.cpu()
    assert got.shape == ref.shape
    diff = (fp8_ordinal(got) - fp8_ordinal(ref)).abs()
    n = diff.numel()
    if n == 0:
        return
    assert int(diff.max()) <= 1, _explain(got, ref, diff > 1)
    mismatches = int((diff != 0).sum())
    assert mismatches <= max(1, math.floor(0.01 * n)), f"{mismatches} of {n} FP8 codes differ by one step"


def run_hp(name, backward, x, g, out_shape, out_dtype, xin=None, gin=None):
    """Runs on CUDA (inputs x, g, possibly custom device views xin/gin) and on CPU; returns both outputs."""
    xd = xin if xin is not None else x.cuda()
    gd = gin if gin is not None else (g.cuda() if g is not None else None)
    out_d = poisoned(out_shape, out_dtype, "cuda")
    call(name, backward, xd, gd, T(out_d).t)
    out_c = poisoned(out_shape, out_dtype, "cpu")
    call(name, backward, cpu_copy(x), cpu_copy(g), T(out_c).t)
    sync()
    return out_d, out_c


def inputs(name, backward, shape, in_dtype, gen, grad_dtype=None):
    if name in GATED:
        xs, gs, os_ = gated_shape(shape, backward)
    else:
        xs = gs = os_ = shape
    x = make_input(xs, in_dtype, gen)
    g = (torch.randn(gs, generator=gen)).to(grad_dtype or in_dtype) if backward else None
    return x, g, os_


@pytest.mark.parametrize("out_dtype", list(HP))
@pytest.mark.parametrize("in_dtype", list(HP))
@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "bwd"])
@pytest.mark.parametrize("name", ELEMENTWISE + GATED)
def test_float_outputs_match_cpu(name, backward, in_dtype, out_dtype):
    gen = seeded(name, backward, in_dtype, out_dtype)
    shapes = SHAPES + ([(5, 32), (64, 1024)] if name in GATED else [])  # H % 16 == 0: gated vector path
    for shape in shapes:
        x, g, os_ = inputs(name, backward, shape, HP[in_dtype], gen)
        got, ref = run_hp(name, backward, x, g, os_, HP[out_dtype])
        assert_act_close(got, ref, multiplier(name, backward, x, g))


@pytest.mark.parametrize("name", ["gelu", "srelu", "swiglu", "geglu"])
@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "bwd"])
def test_grad_dtype_differs_from_input(name, backward):
    """A bfloat16 grad with a float32 input (the run-time-typed kernel); forward for contrast."""
    gen = torch.Generator().manual_seed(11)
    for shape in [(3, 5), (33, 64)]:
        x, g, os_ = inputs(name, backward, shape, torch.float32, gen, grad_dtype=torch.bfloat16)
        for out_dtype in [torch.float16, torch.float32]:
            got, ref = run_hp(name, backward, x, g, os_, out_dtype)
            assert_act_close(got, ref, multiplier(name, backward, x, g))


@pytest.mark.parametrize("name", ["gelu", "qgelu", "swiglu", "sreglu"])
@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "bwd"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_misaligned_buffers(name, backward, dtype):
    """Buffers starting one element past a 16-byte boundary take the scalar path."""
    gen = torch.Generator().manual_seed(5)
    for shape in [(16, 64), (9, 33)]:
        x, g, os_ = inputs(name, backward, shape, dtype, gen)
        xb = torch.empty(x.numel() + 1, dtype=dtype, device="cuda")
        xin = xb[1:].view(x.shape)
        xin.copy_(x)
        gin = None
        if g is not None:
            gb = torch.empty(g.numel() + 1, dtype=dtype, device="cuda")
            gin = gb[1:].view(g.shape)
            gin.copy_(g)
        ob = torch.full((math.prod(os_) + 1,), float("nan"), dtype=dtype, device="cuda")
        out_d = ob[1:].view(os_)
        call(name, backward, xin, gin, T(out_d).t)
        out_c = poisoned(os_, dtype, "cpu")
        call(name, backward, x, g, T(out_c).t)
        sync()
        assert_act_close(out_d, out_c, multiplier(name, backward, x, g))
        assert torch.isnan(ob[0]).item(), "wrote before the output"


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("in_dtype", list(HP))
@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "bwd"])
@pytest.mark.parametrize("name", ELEMENTWISE + GATED)
def test_fp8_outputs_match_cpu(name, backward, in_dtype, fmt):
    gen = seeded(name, backward, in_dtype, fmt, "fp8")
    scale = 2.0  # srelu(20) * 2 = 800 saturates E4M3
    for shape in [(3, 5), (37, 129), (64, 512)]:
        x, g, os_ = inputs(name, backward, shape, HP[in_dtype], gen)
        d = fp8_out(list(os_), fmt, "cuda", scale=scale, amax=0.5)
        c = fp8_out(list(os_), fmt, "cpu", scale=scale, amax=0.5)
        call(name, backward, x.cuda(), g.cuda() if g is not None else None, d["T"].t)
        call(name, backward, x, g, c["T"].t)
        sync()
        assert_fp8_codes_close(d["data"], c["data"])
        torch.testing.assert_close(d["amax"].cpu(), c["amax"], rtol=1e-5, atol=1e-6)
        assert_bits_equal(d["scale_inv"], c["scale_inv"])
        assert d["scale_inv"].item() == 0.5


@pytest.mark.parametrize("name", ["gelu", "geglu"])
def test_fp8_columnwise_output(name):
    """An FP8 output with a columnwise buffer gets the transpose of its rowwise data."""
    gen = torch.Generator().manual_seed(3)
    for shape in [(7, 33), (64, 128)]:
        x, _, os_ = inputs(name, False, shape, torch.bfloat16, gen)
        d = fp8_out(list(os_), "e4m3", "cuda", scale=4.0, columnwise=True)
        c = fp8_out(list(os_), "e4m3", "cpu", scale=4.0, columnwise=True)
        call(name, False, x.cuda(), None, d["T"].t)
        call(name, False, x, None, c["T"].t)
        sync()
        assert_fp8_codes_close(d["data"], c["data"])
        assert_bits_equal(d["col"], d["data"].reshape(-1, os_[-1]).T.contiguous())
        torch.testing.assert_close(d["amax"].cpu(), c["amax"], rtol=1e-5, atol=1e-6)
        assert_bits_equal(d["scale_inv"], c["scale_inv"])


def test_fp8_amax_is_max_accumulated():
    x = torch.full((64, 64), 3.0, device="cuda")
    d = fp8_out([64, 64], "e4m3", "cuda", amax=100.0)
    nvte.relu(T(x).t, d["T"].t)
    sync()
    assert d["amax"].item() == 100.0
    d = fp8_out([64, 64], "e4m3", "cuda", amax=1.0)
    nvte.relu(T(x).t, d["T"].t)
    sync()
    assert d["amax"].item() == 3.0


def test_in_place():
    """gelu(x) into x, and the gated backward writing over its input [N, 2H]."""
    gen = torch.Generator().manual_seed(9)
    for shape in [(37, 129), (64, 256)]:
        x = make_input(shape, torch.bfloat16, gen)
        xd = x.cuda()
        nvte.gelu(T(xd).t, T(xd).t)
        ref = poisoned(shape, torch.bfloat16, "cpu")
        nvte.gelu(T(x).t, T(ref).t)
        sync()
        assert_act_close(xd, ref, torch.ones(shape, dtype=torch.float64))
        x, g, os_ = inputs("swiglu", True, shape, torch.float32, gen)
        xd, gd = x.cuda(), g.cuda()
        nvte.dswiglu(T(gd).t, T(xd).t, T(xd).t)
        ref = poisoned(os_, torch.float32, "cpu")
        nvte.dswiglu(T(g).t, T(x).t, T(ref).t)
        sync()
        assert_act_close(xd, ref, multiplier("swiglu", True, x, g))


def test_large_grid():
    """Larger than one pass of the grid: grid-stride loops, the elementwise tail, odd widths."""
    gen = torch.Generator().manual_seed(21)
    for name, shape in [("gelu", (1023, 4097)), ("silu", (4096, 4096)), ("swiglu", (1023, 2048))]:
        x, _, os_ = inputs(name, False, shape, torch.bfloat16, gen)
        got, ref = run_hp(name, False, x, None, os_, torch.bfloat16)
        assert_act_close(got, ref, multiplier(name, False, x, None))
        d = fp8_out(list(os_), "e4m3", "cuda", scale=8.0)
        c = fp8_out(list(os_), "e4m3", "cpu", scale=8.0)
        call(name, False, x.cuda(), None, d["T"].t)
        call(name, False, x, None, c["T"].t)
        sync()
        assert_fp8_codes_close(d["data"], c["data"])
        torch.testing.assert_close(d["amax"].cpu(), c["amax"], rtol=1e-5, atol=1e-6)


def test_empty_writes_only_scale_inv():
    """No element to convert: amax stays, scale_inv = 1 / scale as the CPU writes it."""
    for dev in ("cpu", "cuda"):
        d = fp8_out([0, 6], "e5m2", dev, scale=8.0, amax=5.0)
        x = torch.zeros(0, 12, device=dev)
        nvte.geglu(T(x).t, d["T"].t)
        e = fp8_out([3, 0], "e4m3", dev, scale=2.0, amax=1.0)
        nvte.gelu(T(torch.zeros(3, 0, device=dev)).t, e["T"].t)
        z = torch.zeros(4, 0, device=dev)
        nvte.dgelu(T(z).t, T(z).t, T(z).t)
        if dev == "cuda":
            sync()
        assert (d["amax"].item(), d["scale_inv"].item()) == (5.0, 0.125), dev
        assert (e["amax"].item(), e["scale_inv"].item()) == (1.0, 0.5), dev


def test_errors_on_device():
    x, y = torch.zeros(3, 5, device="cuda"), torch.zeros(3, 2, device="cuda")
    with pytest.raises(nvte.Error, match=r"nvte_geglu: input has shape \[3, 5\].*even last dim"):
        nvte.geglu(T(x).t, T(y).t)
    o = T(torch.zeros(3, 5, dtype=torch.uint8, device="cuda"), dtype=DT.kFloat8E4M3)  # T keeps its refs
    with pytest.raises(nvte.Error, match=r"nvte_silu: output is FP8 \(float8_e4m3\) but has no scale"):
        nvte.silu(T(x).t, o.t)
