"""CUDA quantize / quantize_noop / quantize_v2 / dequantize / quantize_dbias(+dact) against the
CPU backend on copies of the same inputs.

Bit-exact: every FP8 / high-precision output, amax and scale_inv of the casts and of dbias ops
whose g is exact in float32 (no activation, drelu). Not bit-exact, with the tolerance said at
each check: dbias (the GPU sums each column as a fixed tree, per-thread rows -> row groups ->
row tiles, while the CPU adds rows in order; both are float32, so the difference is bounded by
float32 rounding of the sum) and activations computed with float32 transcendentals (device
tanhf/expf differ from the host's by a few ulps, which can move a value to a neighbouring FP8
code). Empty tensors: no conversion runs, but scale_inv = 1 / scale is written as on the CPU."""
import numpy as np
import pytest
import torch

from transformer_engine import _nvte as nvte

from gpu_util import DT, HP_TORCH, T, assert_bits_equal, assert_close, cpu_copy, poisoned, sync

FMTS = ["e4m3", "e5m2"]
FP8_DT = {"e4m3": DT.kFloat8E4M3, "e5m2": DT.kFloat8E5M2}
HP = ["float32", "float16", "bfloat16"]
ACTS = ["dgelu", "drelu", "dsilu", "dqgelu", "dsrelu"]
SHAPES = [(1, 1), (3, 5), (37, 129), (256, 1000), (1023, 4097), (2, 3, 40), (640, 192)]


# ----------------------------------------------------------------------------- helpers
_KEEP = []


def tt(*args, **kw):
    """T(...).t for a call argument, with the T (and so its buffers) kept alive until both()
    finishes: a temporary T would free a host buffer before the op reads it."""
    t = T(*args, **kw)
    _KEEP.append(t)
    return t.t


def gen(seed):
    return torch.Generator().manual_seed(seed)


def rows_cols(shape):
    return int(np.prod(shape[:-1])) if len(shape) > 1 else 1, shape[-1]


def make_input(shape, name, seed, specials=False, scale=1.0):
    """Random values with magnitudes 2^-12 .. 2^10 (FP8 subnormals, normals, saturation)."""
    g = gen(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    x = x * torch.exp2(torch.empty(shape, dtype=torch.float64).uniform_(-12, 10, generator=g)) * scale
    x = x.to(HP_TORCH[name])
    if specials and x.numel() >= 4:
        f = x.view(-1)
        f[0], f[1], f[2], f[-1] = float("nan"), float("inf"), float("-inf"), -0.0
    return x


def offset(x, elems=1):
    """A contiguous copy of x whose data pointer is `elems` elements past an aligned address."""
    buf = torch.empty(x.numel() + elems, dtype=x.dtype, device=x.device)
    v = buf[elems:].view(x.shape)
    v.copy_(x)
    return v


def fp8_buffers(shape, fmt, dev, scale=1.0, amax=0.0, rowwise=True, columnwise=False, misalign=False):
    """FP8 output buffers (uint8 storage poisoned with 0xAB) and their T; misalign shifts the
    data pointers by one byte (scalar store paths)."""
    rows, cols = rows_cols(shape)
    pad = 1 if misalign else 0
    b = {
        "data": torch.full((rows * cols + pad,), 0xAB, dtype=torch.uint8, device=dev)[pad:].view(shape)
        if rowwise else None,
        "col": torch.full((rows * cols + pad,), 0xAB, dtype=torch.uint8, device=dev)[pad:].view(cols, rows)
        if columnwise else None,
        "scale": torch.tensor([scale], dtype=torch.float32, device=dev),
        "amax": torch.tensor([amax], dtype=torch.float32, device=dev),
        "scale_inv": torch.tensor([-1.0], dtype=torch.float32, device=dev),
        "col_scale_inv": torch.tensor([-2.0], dtype=torch.float32, device=dev) if columnwise else None,
    }
    b["T"] = T(b["data"], dtype=FP8_DT[fmt], scale=b["scale"], amax=b["amax"], scale_inv=b["scale_inv"],
               columnwise=b["col"], columnwise_scale_inv=b["col_scale_inv"])
    return b


def hp_buffers(shape, name, dev, rowwise=True, columnwise=False, amax=None):
    rows, cols = rows_cols(shape)
    b = {
        "data": poisoned(shape, HP_TORCH[name], dev) if rowwise else None,
        "col": poisoned((cols, rows), HP_TORCH[name], dev) if columnwise else None,
        "amax": torch.tensor([amax], dtype=torch.float32, device=dev) if amax is not None else None,
    }
    b["T"] = T(b["data"], amax=b["amax"], columnwise=b["col"])
    return b


def assert_same(gpu, cpu, keys=("data", "col", "amax", "scale_inv", "col_scale_inv")):
    for k in keys:
        if cpu.get(k) is not None:
            assert_bits_equal(gpu[k], cpu[k])


def dact_ref(act, x):
    """float64 derivative of each activation (the formulas of activation_math.h)."""
    sig = lambda v: 1.0 / (1.0 + torch.exp(-v))
    if act == "dgelu":
        k = (2.0 / np.pi) ** 0.5
        t = torch.tanh(k * (x + 0.044715 * x**3))
        return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * k * (1 + 3 * 0.044715 * x * x)
    if act == "drelu":
        return (x > 0).double()
    if act == "dsilu":
        s = sig(x)
        return s * (1 + x * (1 - s))
    if act == "dqgelu":
        s = sig(1.702 * x)
        return s * (1 + 1.702 * x * (1 - s))
    if act == "dsrelu":
        return torch.where(x > 0, 2 * x, torch.zeros_like(x))
    raise ValueError(act)


def fp8_ordinal(codes):
    c = codes.to(torch.int32)
    return torch.where(c & 0x80 != 0, -(c & 0x7F), c & 0x7F)


def assert_fp8_near(got, ref, max_frac=0.01):
    """float32 transcendentals differ between device and host by a few ulps: codes may move to
    a neighbouring FP8 code, rarely, and never further."""
    d = (fp8_ordinal(got.cpu()) - fp8_ordinal(ref.cpu())).abs()
    assert int(d.max()) <= 1, f"{int((d > 1).sum())} codes off by more than one"
    assert float((d != 0).double().mean()) <= max_frac, f"{int((d != 0).sum())} of {d.numel()} codes differ"


DBIAS_RTOL = {"float32": 0.0, "float16": 2.0**-10, "bfloat16": 2.0**-7}


def assert_dbias_close(got, ref, g64, name):
    """Two float32 summation orders over `rows` terms: each is within (rows) * 2^-24 * sum|g| of
    the exact sum, so they differ by at most (rows + 8) * 2^-23 * sum|g|; plus one rounding into
    a 16-bit dbias dtype (relative 2^-8 / 2^-11, doubled for the two sides)."""
    rows = g64.shape[0]
    atol = (rows + 8) * 2.0**-23 * g64.abs().sum(dim=0) + 1e-30
    g, r = got.detach().cpu().double(), ref.detach().cpu().double()
    bad = (g - r).abs() > atol + DBIAS_RTOL[name] * r.abs()
    assert not bool(bad.any()), f"{int(bad.sum())} dbias values differ: got {g[bad][:5]} ref {r[bad][:5]}"


def both(fn):
    """fn(dev) -> results; runs it for the CPU and the GPU and returns (cpu, gpu) results."""
    c = fn("cpu")
    g = fn("cuda")
    sync()
    _KEEP.clear()
    return c, g


# ----------------------------------------------------------------------------- quantize
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("in_name", HP)
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("layout", ["row", "col", "both"])
def test_quantize_matches_cpu(shape, in_name, fmt, layout):
    x = make_input(shape, in_name, 1 + len(shape) + shape[-1], specials=in_name == "float32")

    def run(dev):
        o = fp8_buffers(shape, fmt, dev, scale=3.7, amax=0.5, rowwise=layout != "col", columnwise=layout != "row")
        nvte.quantize(tt(x.to(dev)), o["T"].t)
        return o

    c, g = both(run)
    assert_same(g, c)


@pytest.mark.parametrize("in_name", HP)
@pytest.mark.parametrize("layout", ["row", "both"])
def test_quantize_misaligned_buffers_take_the_scalar_path(in_name, layout):
    shape = (67, 136)  # vector-friendly sizes, but every pointer is off by one element
    x = make_input(shape, in_name, 5)

    def run(dev):
        o = fp8_buffers(shape, "e4m3", dev, scale=2.5, rowwise=True, columnwise=layout == "both", misalign=True)
        nvte.quantize(tt(offset(x.to(dev))), o["T"].t)
        return o

    c, g = both(run)
    assert_same(g, c)


SPECIAL_BITS = {  # NaNs with payloads (quiet and signalling), infinities, -0, subnormals
    "float32": [0x7FC00001, 0xFFA00000, 0x7F800001, 0x7F800000, 0xFF800000, 0x80000000, 0x00000001, 0x807FFFFF],
    "float16": [0x7E01, 0xFD00, 0x7C00, 0xFC00, 0x8000, 0x0001, 0x83FF],
    "bfloat16": [0x7FC1, 0xFFA0, 0x7F81, 0x7F80, 0xFF80, 0x8000, 0x0001, 0x807F],
}


@pytest.mark.parametrize("shape", [(64, 272), (37, 129)])
@pytest.mark.parametrize("in_name", HP)
@pytest.mark.parametrize("fmt", FMTS)
def test_quantize_vectors_holding_specials_match_cpu(shape, in_name, fmt):
    """Specials scattered through whole vectors: the flat kernel converts finite vectors with
    hardware pair instructions and hands a vector holding a NaN to the exact per-element path."""
    x = make_input(shape, in_name, 3 + shape[0])
    bits = SPECIAL_BITS[in_name]
    itype = {"float32": torch.int32, "float16": torch.int16, "bfloat16": torch.int16}[in_name]
    flat = x.view(-1)
    pos = torch.randperm(flat.numel(), generator=gen(shape[0]))[: 3 * len(bits)]
    for j, p in enumerate(pos.tolist()):
        width = 32 if itype == torch.int32 else 16
        b = bits[j % len(bits)]
        flat[p : p + 1].view(itype)[0] = b - (1 << width) if b >= 1 << (width - 1) else b  # as signed

    def run(dev):
        o = fp8_buffers(shape, fmt, dev, scale=3.7, amax=0.5)
        nvte.quantize(tt(x.to(dev)), o["T"].t)
        return o

    c, g = both(run)
    assert_same(g, c)


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("out_name", HP)
@pytest.mark.parametrize("si", [1.0, 2.0 ** -10, 0.37, float("inf")])
def test_dequantize_every_code_matches_cpu(fmt, out_name, si):
    """All 256 codes (NaNs included) in every position of 16-code vectors, with a scale_inv of 1
    (no multiply on the CPU), a power of two, a plain value and infinity (0 * inf is NaN)."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    codes = torch.stack([codes.roll(k) for k in range(16)]).reshape(64, 64)

    def run(dev):
        inp = T(codes.to(dev), dtype=FP8_DT[fmt], scale_inv=torch.tensor([si], dtype=torch.float32, device=dev))
        o = hp_buffers((64, 64), out_name, dev, amax=0.0)
        nvte.dequantize(inp.t, o["T"].t)
        return o

    c, g = both(run)
    assert_same(g, c)


def test_quantize_large_tensor_uses_the_whole_grid():
    shape = (4096, 4096)
    x = make_input(shape, "bfloat16", 11)

    def run(dev):
        o = fp8_buffers(shape, "e4m3", dev, scale=0.75, columnwise=True)
        nvte.quantize(tt(x.to(dev)), o["T"].t)
        return o

    c, g = both(run)
    assert_same(g, c)


def test_amax_is_max_accumulated():
    x = make_input((37, 129), "float32", 3)
    for preset in (0.0, 1e9):
        def run(dev):
            o = fp8_buffers(x.shape, "e5m2", dev, amax=preset, columnwise=True)
            nvte.quantize(tt(x.to(dev)), o["T"].t)
            return o

        c, g = both(run)
        assert_same(g, c)
        assert g["amax"].item() == max(preset, x.abs().max().item())


@pytest.mark.parametrize("shape", [(1, 1), (37, 129), (256, 1000), (2, 3, 40)])
@pytest.mark.parametrize("in_name", HP)
@pytest.mark.parametrize("out_name", HP)
@pytest.mark.parametrize("layout", ["row", "col", "both"])
def test_quantize_to_high_precision_matches_cpu(shape, in_name, out_name, layout):
    x = make_input(shape, in_name, 7 + shape[-1], specials=True)

    def run(dev):
        o = hp_buffers(shape, out_name, dev, rowwise=layout != "col", columnwise=layout != "row", amax=0.0)
        nvte.quantize(tt(x.to(dev)), o["T"].t)
        return o

    c, g = both(run)
    assert_same(g, c)


@pytest.mark.parametrize("shape", [(0, 16), (7, 0), (2, 0, 5)])
@pytest.mark.parametrize("layout", ["row", "col", "both"])
def test_quantize_of_empty_tensor_writes_scale_inv(shape, layout):
    x = torch.zeros(shape, dtype=torch.bfloat16)

    def run(dev):
        o = fp8_buffers(shape, "e5m2", dev, scale=4.0, amax=0.75, rowwise=layout != "col",
                        columnwise=layout != "row")
        nvte.quantize(tt(x.to(dev)), o["T"].t)
        return o

    c, g = both(run)
    assert_same(g, c)
    assert g["scale_inv"].item() == 0.25 and g["amax"].item() == 0.75
    if layout != "row":
        assert g["col_scale_inv"].item() == 0.25


def test_noop_flag_skips_empty_tensors_too():
    o = fp8_buffers((0, 8), "e4m3", "cuda", scale=2.0)
    nvte.quantize_noop(tt(torch.zeros(0, 8, device="cuda")), o["T"].t,
                       T(torch.ones(1, device="cuda")).t)
    sync()
    assert o["scale_inv"].item() == -1.0


@pytest.mark.parametrize("api", ["noop", "v2"])
@pytest.mark.parametrize("layout", ["row", "both"])
def test_noop_flag_on_the_device(api, layout):
    x = make_input((37, 129), "bfloat16", 9)
    for flag in (1.0, 0.0):
        def run(dev):
            o = fp8_buffers(x.shape, "e4m3", dev, scale=2.0, amax=0.25, columnwise=layout == "both")
            noop = T(torch.tensor([flag], dtype=torch.float32, device=dev))
            if api == "noop":
                nvte.quantize_noop(tt(x.to(dev)), o["T"].t, noop.t)
            else:
                nvte.quantize_v2(tt(x.to(dev)), o["T"].t, noop=noop.t)
            return o

        c, g = both(run)
        assert_same(g, c)
        if flag == 1.0:
            assert bool((g["data"] == 0xAB).all()) and g["scale_inv"].item() == -1.0 and g["amax"].item() == 0.25


# ----------------------------------------------------------------------------- dequantize
@pytest.mark.parametrize("shape", [(1, 1), (3, 5), (37, 129), (256, 1000), (1023, 257)])
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("out_name", HP)
@pytest.mark.parametrize("layout", ["row_in", "col_in", "row_in_both_out", "col_in_both_out"])
def test_dequantize_matches_cpu(shape, fmt, out_name, layout):
    rows, cols = rows_cols(shape)
    codes = torch.randint(0, 256, (rows, cols), generator=gen(rows * 7 + cols), dtype=torch.int32).to(torch.uint8)
    col_in = layout.startswith("col_in")

    def run(dev):
        si = torch.tensor([0.37], dtype=torch.float32, device=dev)
        if col_in:
            inp = T(None, dtype=FP8_DT[fmt], columnwise=codes.t().contiguous().to(dev), columnwise_scale_inv=si)
        else:
            inp = T(codes.reshape(shape).to(dev), dtype=FP8_DT[fmt], scale_inv=si)
        o = hp_buffers(shape, out_name, dev, columnwise=layout.endswith("both_out"), amax=0.0)
        nvte.dequantize(inp.t, o["T"].t)
        return o

    c, g = both(run)
    assert_same(g, c)


def test_dequantize_misaligned():
    codes = torch.randint(0, 256, (33, 72), generator=gen(4), dtype=torch.int32).to(torch.uint8)

    def run(dev):
        inp = T(offset(codes.to(dev), 3), dtype=DT.kFloat8E4M3, scale_inv=torch.tensor([2.0], device=dev))
        out = offset(poisoned((33, 72), torch.float32, dev))
        nvte.dequantize(inp.t, tt(out))
        return {"data": out}

    c, g = both(run)
    assert_same(g, c)


# ----------------------------------------------------------------------------- quantize + dbias
def run_dbias_op(fn_name, x, act_x, shape, fmt, dev, layout, dbias_name, scale=1.5, misalign=False):
    """One dbias op on dev. On the GPU the workspace is queried first (TE's convention: a
    workspace without data gets its shape and dtype, nothing is computed)."""
    fn = getattr(nvte, fn_name)
    rows, cols = rows_cols(shape)
    o = fp8_buffers(shape, fmt, dev, scale=scale, rowwise=layout != "col", columnwise=layout != "row",
                    misalign=misalign)
    o["dbias"] = poisoned((cols,), HP_TORCH[dbias_name], dev)
    xd = x.to(dev)
    ad = act_x.to(dev) if act_x is not None else None
    if misalign:
        xd = offset(xd)
        ad = offset(ad) if ad is not None else None
    args = [T(xd)] + ([T(ad)] if ad is not None else []) + [o["T"], T(o["dbias"])]
    ws = None
    if dev == "cuda":
        q = T()
        fn(*[a.t for a in args], q.t)
        shape_ws = q.t.param_shape(nvte.Param.kRowwiseData)
        nbytes = int(np.prod(shape_ws)) if shape_ws else 0
        if rows * cols:
            assert q.t.param_dtype(nvte.Param.kRowwiseData) == DT.kByte
            assert nbytes == nvte.quantize_dbias_workspace_size(tt(xd)) > 0
            sync()
            assert bool(o["dbias"].isnan().all()), "a workspace query must not compute"
        ws = T(torch.empty(max(nbytes, 1), dtype=torch.uint8, device=dev))
    fn(*[a.t for a in args], ws.t if ws is not None else None)
    return o


def g_reference(x, act, act_x):
    r, c = rows_cols(tuple(x.shape))
    x64 = x.double().reshape(r, c)
    return x64 if act is None else x64 * dact_ref(act, act_x.double().reshape(r, c))


@pytest.mark.parametrize("shape", [(1, 1), (3, 5), (37, 129), (256, 1000), (1023, 4097), (2, 3, 40)])
@pytest.mark.parametrize("in_name", HP)
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("dbias_name", HP)
def test_quantize_dbias_matches_cpu(shape, in_name, fmt, dbias_name):
    x = make_input(shape, in_name, 21 + shape[0], scale=2.0**-4)
    c, g = both(lambda dev: run_dbias_op("quantize_dbias", x, None, shape, fmt, dev, "row", dbias_name))
    assert_same(g, c)  # g = x: the codes, amax and scale_inv are exact
    assert_dbias_close(g["dbias"], c["dbias"], g_reference(x, None, None), dbias_name)


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("shape", [(1, 1), (3, 5), (37, 129), (256, 1000)])
@pytest.mark.parametrize("in_name", HP)
@pytest.mark.parametrize("fmt", FMTS)
def test_quantize_dbias_dact_matches_cpu(act, shape, in_name, fmt):
    gg = gen(shape[0] * 31 + shape[1])
    x = (torch.randn(shape, generator=gg) * 4).to(HP_TORCH[in_name])
    act_x = (torch.randn(shape, generator=gg) * 3).to(HP_TORCH[in_name])
    c, g = both(lambda dev: run_dbias_op("quantize_dbias_" + act, x, act_x, shape, fmt, dev, "row", "float32", 2.0))
    if act == "drelu":  # g = x * {0, 1}: exact
        assert_same(g, c)
    else:
        assert_fp8_near(g["data"], c["data"])
        assert_close(g["amax"], c["amax"], atol=0, rtol=1e-5)
        assert_same(g, c, keys=("scale_inv",))
    assert_dbias_close(g["dbias"], c["dbias"], g_reference(x, act, act_x), "float32")


@pytest.mark.parametrize("act", ["dgelu", "dsilu"])
def test_dact_with_act_input_of_another_dtype(act):
    shape = (130, 72)
    gg = gen(3)
    x = (torch.randn(shape, generator=gg) * 4).to(torch.bfloat16)
    act_x = (torch.randn(shape, generator=gg) * 3).to(torch.float32)
    c, g = both(lambda dev: run_dbias_op("quantize_dbias_" + act, x, act_x, shape, "e4m3", dev, "both", "bfloat16"))
    assert_fp8_near(g["data"], c["data"])
    assert_fp8_near(g["col"], c["col"])
    assert_dbias_close(g["dbias"], c["dbias"], g_reference(x, act, act_x), "bfloat16")


@pytest.mark.parametrize("act", [None, "drelu"])
def test_dbias_misaligned_buffers(act):
    shape = (77, 136)
    gg = gen(8)
    x = (torch.randn(shape, generator=gg) * 4).to(torch.bfloat16)
    act_x = (torch.randn(shape, generator=gg)).to(torch.bfloat16) if act else None
    name = "quantize_dbias" if act is None else "quantize_dbias_" + act
    c, g = both(lambda dev: run_dbias_op(name, x, act_x, shape, "e4m3", dev, "both", "float32", misalign=True))
    assert_same(g, c, keys=("data", "col", "amax", "scale_inv"))
    assert_dbias_close(g["dbias"], c["dbias"], g_reference(x, act, act_x), "float32")


def test_dbias_of_empty_inputs():
    for shape in [(0, 8), (5, 0)]:
        x = torch.zeros(shape, dtype=torch.float32)
        c, g = both(lambda dev: run_dbias_op("quantize_dbias", x, None, shape, "e4m3", dev, "row", "float32"))
        assert_bits_equal(g["dbias"], c["dbias"])  # zeros for (0, 8)
        assert_same(g, c, keys=("amax", "scale_inv"))  # scale_inv written for empty outputs too


def test_dbias_is_deterministic():
    x = make_input((1000, 520), "float32", 2).cuda()
    res = []
    for _ in range(3):
        o = run_dbias_op("quantize_dbias", x.cpu(), None, tuple(x.shape), "e4m3", "cuda", "row", "float32")
        res.append(o["dbias"].clone())
    sync()
    assert all(bool(torch.equal(res[0].view(torch.int32), r.view(torch.int32))) for r in res)


def test_dbias_on_the_gpu_needs_a_workspace():
    x = torch.ones(4, 8, device="cuda")
    o = fp8_buffers((4, 8), "e4m3", "cuda")
    db = torch.empty(8, device="cuda")
    with pytest.raises(nvte.Error, match=r"nvte_quantize_dbias: .*needs a workspace of \d+ bytes"):
        nvte.quantize_dbias(tt(x), o["T"].t, tt(db), None)
    small = T(torch.empty(4, dtype=torch.uint8, device="cuda"))
    with pytest.raises(nvte.Error, match=r"workspace holds 4 bytes"):
        nvte.quantize_dbias(tt(x), o["T"].t, tt(db), small.t)


# ----------------------------------------------------------------------------- zero_tensor
def test_zero_tensor_on_the_device():
    dev = "cuda"
    data = torch.full((3, 4), 0xAB, dtype=torch.uint8, device=dev)
    col = torch.full((4, 3), 0xCD, dtype=torch.uint8, device=dev)
    scale, amax = torch.tensor([2.0], device=dev), torch.tensor([7.0], device=dev)
    sinv, csinv = torch.tensor([0.5], device=dev), torch.tensor([0.25], device=dev)
    t = T(data, dtype=DT.kFloat8E4M3, scale=scale, amax=amax, scale_inv=sinv, columnwise=col,
          columnwise_scale_inv=csinv)
    nvte.zero_tensor(t.t)
    x = poisoned((2, 3, 5), torch.float16, dev)
    nvte.zero_tensor(tt(x))
    only_amax = torch.tensor([3.0], device=dev)
    nvte.zero_tensor(tt(None, amax=only_amax))
    nvte.zero_tensor(tt(torch.zeros((0, 8), device=dev)))
    sync()
    assert not bool(data.any()) and not bool(col.any())
    assert amax.item() == 0.0 and sinv.item() == 0.0 and csinv.item() == 0.0 and scale.item() == 2.0
    assert bool((x.view(torch.int16) == 0).all()) and only_amax.item() == 0.0
