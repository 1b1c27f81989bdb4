"""LayerNorm / RMSNorm on the CUDA backend against the CPU backend on the same inputs.

Tolerances. Both backends do the elementwise math with the same float32 operations in the
same order; they differ only in the row sums: the CPU adds in double (statistics correct to
float32 rounding), the GPU in float32 (per-thread running sums, then a fixed reduction tree).
A float32 sum of terms t_i is within K * 2^-24 * sum|t_i| of the exact sum with K the depth
of its longest addition chain (at most 24 sequential terms per thread plus log2(1024) tree
levels here); K = 64 covers it. So
  mu:      |d mu| <= K eps mean|x|,  rsigma: relative K eps,
  z:       |g| rsigma (|d mu| + |x - mu| K eps) + 8 eps (|z| + |beta|)   (+ one output ulp),
  dx:      (K + 8) eps rsigma (|dy| + mean|dy| + |xhat| mean|dy xhat|)  (+ |add| 8 eps, + one ulp),
  dgamma/dbeta: sums over rows: K_rows eps sum|term| with K_rows = 64 + rows per partial block.
FP8 z: decoded values within one FP8 step of the CPU's (the float32 values differ by the bound
above, so they can straddle a rounding boundary), nearly all codes equal; scale_inv exact.
"""
import math

import pytest
import torch

from transformer_engine import _nvte as nvte

from gpu_util import DT, T, assert_bits_equal, cpu_copy, fp8_out, poisoned

EPS = 1e-5
F32 = 2.0 ** -24
K = 64
HP = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
ROUND = {"float32": 0.0, "float16": 2.0 ** -10, "bfloat16": 2.0 ** -7}  # one output ulp, relative
# (70, 3000): rows of 2049..4096 elements where not every thread of the row block owns a vector
SHAPES = [(1, 1), (3, 5), (37, 129), (256, 1000), (1023, 4096), (64, 8192), (17, 12288), (4, 6, 40),
          (33, 4097), (5, 20000), (70, 3000)]
SMALL = [(1, 1), (3, 5), (37, 129), (256, 1000), (4, 6, 40)]


def rows_cols(shape):
    return int(math.prod(shape[:-1])), shape[-1]


def make(shape, dt, gen, mean=0.0, std=1.0, misalign=False):
    n = int(math.prod(shape))
    base = (torch.randn(n + 1, generator=gen, dtype=torch.float32) * std + mean).to(HP[dt]).cuda()
    return (base[1:] if misalign else base[:n]).view(shape)


def inputs(shape, xdt, gdt, zc, seed, misalign=False):
    gen = torch.Generator().manual_seed(seed)
    h = shape[-1]
    x = make(shape, xdt, gen, 0.5, 2.0, misalign)
    gamma = make((h,), gdt, gen, 0.0 if zc else 1.0, 0.5)
    beta = make((h,), gdt, gen, 0.0, 0.5)
    return x, gamma, beta


def fwd(ln, x, gamma, beta, z, mu, rs, zc):
    """Runs the forward with z either a torch tensor or a T."""
    zt = z if isinstance(z, T) else T(z)
    if ln:
        nvte.layernorm_fwd(T(x).t, T(gamma).t, T(beta).t, EPS, zt.t, T(mu).t, T(rs).t, zero_centered_gamma=zc)
    else:
        nvte.rmsnorm_fwd(T(x).t, T(gamma).t, EPS, zt.t, T(rs).t, zero_centered_gamma=zc)


def fwd_both(ln, x, gamma, beta, zdt, zc):
    n, _ = rows_cols(x.shape)
    out = {}
    for dev, args in (("cuda", (x, gamma, beta)), ("cpu", tuple(cpu_copy(a) for a in (x, gamma, beta)))):
        z = poisoned(x.shape, HP[zdt], dev)
        mu, rs = poisoned((n,), torch.float32, dev), poisoned((n,), torch.float32, dev)
        fwd(ln, *args, z, mu, rs, zc)
        out[dev] = (z, mu, rs)
    return out


def fwd_tolerance(ln, x, gamma, beta, mu_c, rs_c, zc):
    """(mu atol per row, z atol per element) from the CPU statistics."""
    n, h = rows_cols(x.shape)
    x64 = cpu_copy(x).double().reshape(n, h)
    g = cpu_copy(gamma).double() + (1.0 if zc else 0.0)
    b = cpu_copy(beta).double() if ln else torch.zeros(h, dtype=torch.float64)
    mu = mu_c.double() if ln else torch.zeros(n, dtype=torch.float64)
    rs = rs_c.double()
    mu_tol = K * F32 * x64.abs().mean(1) if ln else torch.zeros(n, dtype=torch.float64)
    xm = (x64 - mu[:, None]).abs()
    zabs = xm * rs[:, None] * g.abs()
    z_tol = g.abs() * rs[:, None] * (mu_tol[:, None] + xm * K * F32) + 8 * F32 * (zabs + b.abs())
    return mu_tol, z_tol


def check_close(got, ref, atol, rtol, what):
    g, r = got.detach().cpu().double().reshape(ref.shape), ref.detach().cpu().double()
    bad = ~((g - r).abs() <= atol + rtol * r.abs() + 2.0 ** -24)
    assert not bool(bad.any()), (f"{what}: {int(bad.sum())} of {bad.numel()} differ; first at "
                                 f"{tuple(bad.nonzero()[0].tolist())}: got {g[bad][0].item()!r} ref {r[bad][0].item()!r}")


# --------------------------------------------------------------------------- forward
def _fwd_case(norm, shape, xdt, gdt, zc, misalign=False, seed=0):
    ln = norm == "layernorm"
    x, gamma, beta = inputs(shape, xdt, gdt, zc, seed, misalign)
    zdt = xdt
    o = fwd_both(ln, x, gamma, beta, zdt, zc)
    (zg, mug, rsg), (zc_, muc, rsc) = o["cuda"], o["cpu"]
    n, h = rows_cols(shape)
    mu_tol, z_tol = fwd_tolerance(ln, x, gamma, beta, muc, rsc, zc)
    if ln:
        check_close(mug, muc, mu_tol, 0.0, "mu")
    check_close(rsg, rsc, 0.0, K * F32, "rsigma")
    check_close(zg.reshape(n, h), zc_.reshape(n, h), z_tol, ROUND[zdt] * 1.01, "z")


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("xdt", list(HP))
def test_fwd_shapes(norm, shape, xdt):
    _fwd_case(norm, shape, xdt, xdt, False)


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("gdt", list(HP))
@pytest.mark.parametrize("xdt", list(HP))
@pytest.mark.parametrize("shape", [(37, 129), (256, 1000), (64, 8192)])
def test_fwd_mixed_dtypes_zero_centered(norm, shape, xdt, gdt):
    _fwd_case(norm, shape, xdt, gdt, True, seed=1)


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("shape", [(37, 128), (9, 4096)])
def test_fwd_misaligned_rows_take_the_scalar_path(norm, shape):
    _fwd_case(norm, shape, "bfloat16", "float32", False, misalign=True, seed=2)


def test_fwd_zero_width_rows_write_statistics():
    stats = {}
    for dev in ("cuda", "cpu"):
        x = torch.empty((4, 0), device=dev)
        g = torch.empty((0,), device=dev)
        mu, rs = poisoned((4,), torch.float32, dev), poisoned((4,), torch.float32, dev)
        nvte.layernorm_fwd(T(x).t, T(g).t, T(g).t, EPS, T(torch.empty((4, 0), device=dev)).t, T(mu).t, T(rs).t)
        stats[dev] = (mu, rs)
    assert torch.all(stats["cuda"][0].cpu() == 0)
    assert_bits_equal(stats["cuda"][1], stats["cpu"][1])  # 1 / sqrt(epsilon)


def fp8_step(v, fmt):
    """Spacing of FP8 values at |v| (the larger of two neighbours' magnitudes)."""
    mbits, emin = (3, -6) if fmt == "e4m3" else (2, -14)
    e = torch.floor(torch.log2(v.abs().clamp_min(2.0 ** emin))).clamp_min(emin)
    return torch.pow(2.0, e - mbits)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("scale", [1.0, 16.0, 200.0])  # 200 saturates E4M3 for |z| > 2.24
@pytest.mark.parametrize("shape,columnwise", [((37, 129), True), ((256, 1000), False), ((64, 8192), True),
                                              ((17, 12288), False), ((300, 4096), True)])
@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
def test_fp8_output(norm, shape, columnwise, scale, fmt):
    ln = norm == "layernorm"
    x, gamma, beta = inputs(shape, "bfloat16", "bfloat16", False, 3)
    n, h = rows_cols(shape)
    res = {}
    for dev, args in (("cuda", (x, gamma, beta)), ("cpu", tuple(cpu_copy(a) for a in (x, gamma, beta)))):
        out = fp8_out(shape, fmt, dev, scale=scale, amax=0.0, columnwise=columnwise)
        mu, rs = poisoned((n,), torch.float32, dev), poisoned((n,), torch.float32, dev)
        fwd(ln, *args, out["T"], mu, rs, False)
        res[dev] = out
    g, c = res["cuda"], res["cpu"]
    tdt = torch.float8_e4m3fn if fmt == "e4m3" else torch.float8_e5m2
    vg = g["data"].cpu().view(tdt).double()
    vc = c["data"].view(tdt).double()
    step = fp8_step(torch.maximum(vg.abs(), vc.abs()), fmt)
    bad = (vg - vc).abs() > step
    assert not bool(bad.any()), f"{int(bad.sum())} FP8 values more than one step from the CPU's"
    assert (g["data"].cpu() == c["data"]).double().mean() > 0.98
    if columnwise:
        assert_bits_equal(g["col"], g["data"].reshape(n, h).t().contiguous())
    assert_bits_equal(g["scale_inv"], c["scale_inv"])
    check_close(g["amax"], c["amax"], 0.0, 2e-5, "amax")


@pytest.mark.parametrize("xdt", list(HP))
@pytest.mark.parametrize("shape", [(1023, 4096), (130, 1024), (33, 4097), (5, 20000), (2, 3, 40)])
@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
def test_fp8_columnwise_is_the_transpose_of_the_rowwise_run(norm, shape, xdt):
    """Both layouts (training: the weight gradient reads the transpose) against a rowwise-only run
    on the GPU: the same codes bit for bit, and their transpose; the same amax and scale_inv, the
    columnwise scale_inv too. Covers the row kernels (16-bit x), the vector kernel (float32 x),
    the scalar path (H % 8 != 0, H > 16384) and odd row counts. The columnwise layout alone runs
    another kernel (its statistics can differ in the last float32 bits): within one FP8 step."""
    ln = norm == "layernorm"
    x, gamma, beta = inputs(shape, xdt, xdt, False, 6)
    n, h = rows_cols(shape)
    runs = {}
    for layout in ("row", "both", "col"):
        out = fp8_out(shape, "e4m3", "cuda", scale=24.0, amax=0.0, rowwise=layout != "col",
                      columnwise=layout != "row")
        csi = torch.tensor([-2.0], device="cuda")
        out["T"].t.set_param(nvte.Param.kColumnwiseScaleInv, csi.data_ptr(), [1], DT.kFloat32)
        out["csi"] = csi
        mu, rs = poisoned((n,), torch.float32, "cuda"), poisoned((n,), torch.float32, "cuda")
        fwd(ln, x, gamma, beta, out["T"], mu, rs, False)
        runs[layout] = out
    r, b, c = runs["row"], runs["both"], runs["col"]
    assert_bits_equal(b["data"], r["data"])
    expect_t = r["data"].reshape(n, h).t().contiguous()
    assert_bits_equal(b["col"], expect_t)
    assert_bits_equal(b["amax"], r["amax"])
    assert_bits_equal(b["scale_inv"], r["scale_inv"])
    assert_bits_equal(b["csi"], r["scale_inv"])
    vr = expect_t.cpu().view(torch.float8_e4m3fn).double()
    vc = c["col"].cpu().view(torch.float8_e4m3fn).double()
    assert not bool(((vr - vc).abs() > fp8_step(torch.maximum(vr.abs(), vc.abs()), "e4m3")).any())
    assert (vr == vc).double().mean() > 0.98
    assert_bits_equal(c["csi"], r["scale_inv"])
    check_close(c["amax"], r["amax"], 0.0, 2e-5, "amax")


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
def test_fp8_output_of_no_rows_writes_scale_inv(norm):
    for dev in ("cpu", "cuda"):
        x = torch.empty((0, 64), device=dev)
        g = torch.ones(64, device=dev)
        out = fp8_out((0, 64), "e4m3", dev, scale=8.0, amax=3.0, columnwise=True)
        e = torch.empty(0, device=dev)
        fwd(norm == "layernorm", x, g, torch.zeros(64, device=dev), out["T"], e, e, False)
        assert (out["scale_inv"].item(), out["amax"].item()) == (0.125, 3.0), dev


def test_fp8_amax_accumulates():
    x, gamma, beta = inputs((4, 64), "float32", "float32", False, 4)
    out = fp8_out((4, 64), "e4m3", "cuda", scale=2.0, amax=1e6)
    fwd(True, x, gamma, beta, out["T"], poisoned((4,), torch.float32, "cuda"), poisoned((4,), torch.float32, "cuda"),
        False)
    assert out["amax"].item() == 1e6


# -------------------------------------------------------------------------- backward
def bwd_inputs(shape, xdt, gdt, zc, seed, ln, misalign=False):
    x, gamma, _ = inputs(shape, xdt, gdt, zc, seed, misalign)
    gen = torch.Generator().manual_seed(seed + 100)
    dz = make(shape, xdt, gen, misalign=misalign)
    add = make(shape, "float32", gen)
    # Statistics from the CPU forward (float32), handed to both backends.
    n, _ = rows_cols(shape)
    xc, gc = cpu_copy(x), cpu_copy(gamma)
    z = torch.empty(shape, dtype=torch.float32)
    mu, rs = torch.empty(n), torch.empty(n)
    if ln:
        nvte.layernorm_fwd(T(xc).t, T(gc).t, T(torch.zeros_like(gc)).t, EPS, T(z).t, T(mu).t, T(rs).t,
                           zero_centered_gamma=zc)
    else:
        nvte.rmsnorm_fwd(T(xc).t, T(gc).t, EPS, T(z).t, T(rs).t, zero_centered_gamma=zc)
    return x, gamma, dz, add, mu.cuda(), rs.cuda()


def ws_bytes(n, h, sm):
    """The backward's workspace, restated from its plan (normalization_bwd.cu's bwd_plan): one
    float32 dgamma and dbeta row per part. Parts: as many as resident row blocks (1024 / threads
    per row, per SM) for rows of H % 8 == 0 up to 8 elements per thread, one per SM for longer rows
    and for 2049..4096 elements; rows per part above 8 are rounded up to a multiple of 8."""
    if n == 0 or h == 0:
        return 0
    per_sm = 1
    if h % 8 == 0 and h <= 16384:
        threads = 32
        while threads < 512 and threads < h // 8:
            threads *= 2
        per_sm = 1024 // threads if h <= 8 * threads else 1
        if 2048 < h <= 4096:
            per_sm = 1
    g = min(n, sm * per_sm)
    rpp = -(-n // g)
    if rpp > 8:
        rpp = -(-rpp // 8) * 8
    return -(-n // rpp) * h * 8


def bwd(ln, dz, x, mu, rs, gamma, dx, dgamma, dbeta, zc, add=None, workspace=None, sm_count=0):
    ws = workspace
    if ln:
        nvte.layernorm_bwd(T(dz).t, T(x).t, T(mu).t, T(rs).t, T(gamma).t, T(dx).t, T(dgamma).t, T(dbeta).t,
                           workspace=ws, sm_count=sm_count, zero_centered_gamma=zc)
    elif add is None:
        nvte.rmsnorm_bwd(T(dz).t, T(x).t, T(rs).t, T(gamma).t, T(dx).t, T(dgamma).t, workspace=ws,
                         sm_count=sm_count, zero_centered_gamma=zc)
    else:
        nvte.rmsnorm_bwd_add(T(dz).t, T(x).t, T(add).t, T(rs).t, T(gamma).t, T(dx).t, T(dgamma).t, workspace=ws,
                             sm_count=sm_count, zero_centered_gamma=zc)


def cuda_ws(n, h, sm_count=0):
    sm = sm_count if sm_count > 0 else torch.cuda.get_device_properties(0).multi_processor_count
    b = ws_bytes(n, h, sm)
    buf = torch.empty(max(b, 1), dtype=torch.uint8, device="cuda")
    return T(buf, dtype=DT.kByte), buf


def bwd_run(dev, ln, x, gamma, dz, add, mu, rs, zc, with_add, sm_count=0):
    n, h = rows_cols(x.shape)
    if dev == "cpu":
        x, gamma, dz, add, mu, rs = (cpu_copy(a) for a in (x, gamma, dz, add, mu, rs))
        ws = None
    else:
        wst, buf = cuda_ws(n, h, sm_count)
        ws = wst.t
    dx = poisoned(x.shape, x.dtype, dev)
    dgamma, dbeta = poisoned((h,), gamma.dtype, dev), poisoned((h,), gamma.dtype, dev)
    bwd(ln, dz, x, mu, rs, gamma, dx, dgamma, dbeta, zc, add if with_add else None, ws, sm_count)
    return dx, dgamma, dbeta


def _bwd_case(norm, shape, xdt, gdt, zc, with_add=False, misalign=False, seed=10, sm_count=0):
    ln = norm == "layernorm"
    x, gamma, dz, add, mu, rs = bwd_inputs(shape, xdt, gdt, zc, seed, ln, misalign)
    dxg, dgg, dbg = bwd_run("cuda", ln, x, gamma, dz, add, mu, rs, zc, with_add, sm_count)
    dxc, dgc, dbc = bwd_run("cpu", ln, x, gamma, dz, add, mu, rs, zc, with_add)
    n, h = rows_cols(shape)
    x64, dz64 = cpu_copy(x).double().reshape(n, h), cpu_copy(dz).double().reshape(n, h)
    g64 = cpu_copy(gamma).double() + (1.0 if zc else 0.0)
    m64 = cpu_copy(mu).double() if ln else torch.zeros(n, dtype=torch.float64)
    r64 = cpu_copy(rs).double()
    xhat = (x64 - m64[:, None]) * r64[:, None]
    dy = dz64 * g64
    mag = r64[:, None] * (dy.abs() + (dy.abs().mean(1, keepdim=True) if ln else 0.0)
                          + xhat.abs() * (dy * xhat).abs().mean(1, keepdim=True))
    dx_tol = (K + 8) * F32 * mag
    if with_add:
        dx_tol = dx_tol + 8 * F32 * cpu_copy(add).double().reshape(n, h).abs()
    check_close(dxg.reshape(n, h), dxc.reshape(n, h), dx_tol, ROUND[xdt] * 1.01, "dx")
    sm = sm_count or torch.cuda.get_device_properties(0).multi_processor_count
    k_rows = K + -(-n // sm)
    check_close(dgg, dgc, k_rows * F32 * (dz64 * xhat).abs().sum(0), ROUND[gdt] * 1.01, "dgamma")
    if ln:
        check_close(dbg, dbc, k_rows * F32 * dz64.abs().sum(0), ROUND[gdt] * 1.01, "dbeta")
    return dxg, dgg, dbg


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("xdt", list(HP))
def test_bwd_shapes(norm, shape, xdt):
    _bwd_case(norm, shape, xdt, xdt, False)


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("gdt", list(HP))
@pytest.mark.parametrize("xdt", list(HP))
@pytest.mark.parametrize("shape", [(37, 129), (256, 1000), (64, 8192)])
def test_bwd_mixed_dtypes_zero_centered(norm, shape, xdt, gdt):
    _bwd_case(norm, shape, xdt, gdt, True, seed=11)


@pytest.mark.parametrize("shape", [(3, 5), (37, 129), (256, 1000), (1023, 4096), (17, 12288)])
@pytest.mark.parametrize("zc", [False, True])
def test_rmsnorm_bwd_add(shape, zc):
    _bwd_case("rmsnorm", shape, "bfloat16", "float32", zc, with_add=True, seed=12)


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
def test_bwd_misaligned_rows_take_the_scalar_path(norm):
    _bwd_case(norm, (37, 128), "float16", "float16", False, misalign=True, seed=13)


@pytest.mark.parametrize("sm_count", [1, 7])
def test_bwd_with_multiprocessor_hint(sm_count):
    _bwd_case("layernorm", (300, 1000), "bfloat16", "bfloat16", False, seed=14, sm_count=sm_count)


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("shape,sm_count", [((300, 4096), 7), ((301, 2056), 5), ((7, 4096), 0), ((1, 3000), 0)])
def test_bwd_rows_of_2049_to_4096_per_block(norm, shape, sm_count):
    """The 2049..4096-element row kernel finishes each row one iteration late (pipelined): blocks
    of many rows (odd and even counts, a short last block) and of a single row."""
    _bwd_case(norm, shape, "bfloat16", "bfloat16", False, seed=15, sm_count=sm_count)


def test_bwd_no_rows_gives_zero_dgamma_dbeta():
    x = torch.empty((0, 16), device="cuda")
    st = torch.empty((0,), device="cuda")
    g = torch.ones(16, device="cuda")
    dgamma, dbeta = poisoned((16,), torch.float32, "cuda"), poisoned((16,), torch.float32, "cuda")
    nvte.layernorm_bwd(T(x).t, T(x).t, T(st).t, T(st).t, T(g).t, T(torch.empty((0, 16), device="cuda")).t,
                       T(dgamma).t, T(dbeta).t)
    assert torch.all(dgamma.cpu() == 0) and torch.all(dbeta.cpu() == 0)


# ------------------------------------------------------------------------ determinism
@pytest.mark.parametrize("shape", [(37, 129), (1023, 4096), (64, 8192), (5, 20000)])
def test_two_runs_are_bit_identical(shape):
    x, gamma, dz, add, mu, rs = bwd_inputs(shape, "bfloat16", "bfloat16", False, 20, True)
    _, beta, _ = inputs(shape, "bfloat16", "bfloat16", False, 21)
    runs = []
    for _ in range(2):
        n, h = rows_cols(shape)
        z, m, r = poisoned(shape, torch.bfloat16, "cuda"), poisoned((n,), torch.float32, "cuda"), \
            poisoned((n,), torch.float32, "cuda")
        fwd(True, x, gamma, beta, z, m, r, False)
        runs.append((z, m, r) + bwd_run("cuda", True, x, gamma, dz, add, mu, rs, False, False))
    for a, b in zip(*runs):
        assert_bits_equal(a, b)


# -------------------------------------------------------------------------- workspace
def test_workspace_query_convention():
    n, h = 300, 1000
    x, gamma, dz, add, mu, rs = bwd_inputs((n, h), "float32", "float32", False, 30, True)
    sm = torch.cuda.get_device_properties(0).multi_processor_count
    want = ws_bytes(n, h, sm)
    assert want > 0
    assert nvte.normalization_workspace_size(T(x).t, True) == 0
    assert nvte.normalization_workspace_size(T(x).t, False) == want
    # Query: a NULL-data workspace gets shape [bytes] and dtype byte; nothing is computed.
    dx, dg, db = poisoned((n, h), torch.float32, "cuda"), poisoned((h,), torch.float32, "cuda"), \
        poisoned((h,), torch.float32, "cuda")
    ws = nvte.Tensor()
    bwd(True, dz, x, mu, rs, gamma, dx, dg, db, False, workspace=ws)
    assert ws.param_shape(nvte.Param.kRowwiseData) == [want]
    assert ws.param_dtype(nvte.Param.kRowwiseData) == DT.kByte
    torch.cuda.synchronize()
    assert torch.isnan(dx).all() and torch.isnan(dg).all() and torch.isnan(db).all()
    # The multiprocessor hint changes the plan, and the query says so.
    ws7 = nvte.Tensor()
    bwd(False, dz, x, mu, rs, gamma, dx, dg, db, False, workspace=ws7, sm_count=7)
    assert ws7.param_shape(nvte.Param.kRowwiseData) == [ws_bytes(n, h, 7)]
    # Without a workspace, or with too small a one, the call fails and says how much it needs.
    with pytest.raises(nvte.Error, match=f"workspace.*{want}"):
        bwd(True, dz, x, mu, rs, gamma, dx, dg, db, False)
    small = torch.empty(want - 4, dtype=torch.uint8, device="cuda")
    with pytest.raises(nvte.Error, match="workspace"):
        bwd(True, dz, x, mu, rs, gamma, dx, dg, db, False, workspace=T(small, dtype=DT.kByte).t)
    # With the queried size it computes.
    buf = torch.empty(want, dtype=torch.uint8, device="cuda")
    bwd(True, dz, x, mu, rs, gamma, dx, dg, db, False, workspace=T(buf, dtype=DT.kByte).t)
    torch.cuda.synchronize()
    assert not torch.isnan(dx).any() and not torch.isnan(dg).any() and not torch.isnan(db).any()


def test_forward_needs_no_workspace_and_query_computes():
    x, gamma, beta = inputs((8, 64), "float32", "float32", False, 31)
    z, mu, rs = poisoned((8, 64), torch.float32, "cuda"), poisoned((8,), torch.float32, "cuda"), \
        poisoned((8,), torch.float32, "cuda")
    ws = nvte.Tensor()
    nvte.layernorm_fwd(T(x).t, T(gamma).t, T(beta).t, EPS, T(z).t, T(mu).t, T(rs).t, workspace=ws)
    assert ws.param_shape(nvte.Param.kRowwiseData) == [0]
    torch.cuda.synchronize()
    assert not torch.isnan(z).any()
