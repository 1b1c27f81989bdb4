"""Rotary position embedding (fused_rope.h) on the CUDA backend vs the CPU backend (the oracle,
float64 math) on the same inputs: SBHD / BSHD / THD, float32 / float16 / bfloat16, full and
partial rotation, interleaved pairs, start positions, strided inputs (a head slice of a packed
QKV buffer), THD rows of no sequence (copied exactly), long rows (h * d = 4096), context-parallel
ranks (cp_size 2 and 3, every rank), poisoned outputs.

Tolerance: the GPU computes in float32 (sincosf, two products and a sum per element) where the
CPU uses float64, so the results differ by a few float32 ulps of |x| + |x_partner| before the
rounding to the output dtype, which may then land one output ulp apart:
|gpu - cpu| <= 8 * 2^-24 * (|x| + |x_p|) + ulp(out) * |cpu|. Positions past the last row of
freqs (reachable only through device-side start positions) come out NaN on the GPU."""
import zlib

import pytest
import torch

from transformer_engine import _nvte as nvte

from gpu_util import T, sync

F = nvte.NVTE_QKV_Format
FMT = {"sbhd": F.NVTE_SBHD, "bshd": F.NVTE_BSHD, "thd": F.NVTE_THD}
HP = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
ULP = {torch.float32: 2.0**-23, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}


def angles(rows, d2, gen, base=10000.0):
    inv = 1.0 / base ** (torch.arange(0, d2, 2, dtype=torch.float64) / d2)
    f = torch.outer(torch.arange(rows, dtype=torch.float64), inv)
    f = torch.cat([f, f], 1) + 0.01 * torch.randn(rows, d2, generator=gen, dtype=torch.float64)
    return f.float().reshape(rows, 1, 1, d2)


def call(base_flat, shape, strides, freqs, fmt, interleaved, cu, start, backward, b, s, cp=(1, 0)):
    h, d = shape[-2], shape[-1]
    y = torch.full(shape, float("nan"), dtype=base_flat.dtype, device=base_flat.device)
    fn = nvte.fused_rope_backward if backward else nvte.fused_rope_forward
    st = strides
    if fmt == "thd":
        args = (st[0], 0, st[1], st[2])
    elif fmt == "sbhd":
        args = tuple(st)
    else:
        args = (st[1], st[0], st[2], st[3])
    fn(T(base_flat).t, None if cu is None else T(cu).t, T(freqs).t, None if start is None else T(start).t, T(y).t,
       FMT[fmt], interleaved, *cp, s, b, h, d, freqs.shape[-1], *args)
    sync()
    return y


def both(x, view_slice, freqs, fmt, interleaved, cu=None, start=None, backward=False, cp=(1, 0)):
    """(cuda output, cpu output) of the view x[view_slice] (x: the packed CPU buffer)."""
    outs = []
    for device in ("cuda", "cpu"):
        base = x.to(device)
        v = base[view_slice]
        off = v.storage_offset()
        flat = base.reshape(-1)[off:]
        shape = tuple(v.shape)
        if fmt == "thd":
            b, s = cu.numel() - 1, shape[0]
        elif fmt == "sbhd":
            s, b = shape[0], shape[1]
        else:
            b, s = shape[0], shape[1]
        outs.append(call(flat, shape, v.stride(), freqs.to(device), fmt, interleaved,
                         None if cu is None else cu.to(device), None if start is None else start.to(device),
                         backward, b, s, cp))
    return outs


def partner_abs(x, d2, interleaved):
    """|x_p| for each element (0 beyond d2)."""
    k = torch.arange(x.shape[-1])
    half = d2 // 2
    q = torch.where(k < d2, (k ^ 1) if interleaved else torch.where(k < half, k + half, k - half), k)
    p = x[..., q].abs()
    p[..., d2:] = 0
    return p


def check(got, ref, x_dense, d2, interleaved):
    g, r = got.cpu().double(), ref.double()
    xa = x_dense.double().abs()
    tol = 8 * 2.0**-24 * (xa + partner_abs(x_dense.double(), d2, interleaved)) + ULP[got.dtype] * r.abs()
    bad = (g - r).abs() > tol
    assert not bad.any(), f"{int(bad.sum())} of {bad.numel()} differ; worst {float((g - r).abs().max())}"


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("fmt", ["sbhd", "bshd", "thd"])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("partial", [False, True])
@pytest.mark.parametrize("backward", [False, True])
def test_rope_cuda_matches_cpu(dtype, fmt, interleaved, partial, backward):
    gen = torch.Generator().manual_seed(zlib.crc32(repr((dtype, fmt, interleaved, partial, backward)).encode()))
    s, b, h, d = 37, 3, 5, 64
    d2 = 48 if partial else d
    if fmt == "thd":
        cu = torch.tensor([0, 10, 10, 33], dtype=torch.int32)  # an empty sequence; rows 33.. of none
        shape = (40, 3 * h, d)
        view = (slice(None), slice(h, 2 * h))
    else:
        cu = None
        shape = (s, b, 3 * h, d) if fmt == "sbhd" else (b, s, 3 * h, d)
        view = (slice(None), slice(None), slice(h, 2 * h))
    x = torch.randn(shape, generator=gen).to(HP[dtype])  # a packed QKV buffer; the middle heads are read
    start = torch.randint(0, 20, (b,), generator=gen, dtype=torch.int32)
    freqs = angles(64, d2, gen)
    got, ref = both(x, view, freqs, fmt, interleaved, cu, start, backward)
    check(got, ref, x[view].contiguous(), d2, interleaved)
    if fmt == "thd":
        assert torch.equal(got[33:].cpu(), x[view][33:])


def test_long_rows_and_positions():
    """h * d = 4096 per row, 2048 positions (angles up to ~2000 rad), bfloat16."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2048, 2, 32, 128, generator=gen).to(torch.bfloat16)
    freqs = angles(2048, 128, gen)
    got, ref = both(x, (slice(None),), freqs, "sbhd", False)
    check(got, ref, x, 128, False)


def test_positions_past_freqs_are_nan_on_the_gpu():
    """The host cannot check device-side start positions: those rows come out NaN (the CPU raises)."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(4, 2, 2, 8, generator=gen)
    freqs = angles(6, 8, gen).cuda()
    start = torch.tensor([0, 3], dtype=torch.int32, device="cuda")  # sequence 1 reaches position 6
    y = call(x.cuda().reshape(-1), (4, 2, 2, 8), x.stride(), freqs, "sbhd", False, None, start, False, 2, 4)
    assert torch.isnan(y[3, 1]).all() and not torch.isnan(y[:3]).any() and not torch.isnan(y[:, 0]).any()
    with pytest.raises(nvte.Error, match="freqs has 6 rows"):
        call(x.reshape(-1), (4, 2, 2, 8), x.stride(), freqs.cpu(), "sbhd", False, None, start.cpu(), False, 2, 4)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("case", ["misaligned", "channel_stride_2", "half_of_12"])
def test_narrow_access_paths(interleaved, case):
    """Inputs the wide kernels cannot take (a start one element off, channels 2 apart) run the
    one-element path, and halves of 12 channels (d = 24, not interleaved) the 4-wide one, with the
    same results."""
    gen = torch.Generator().manual_seed(3)
    s, b, h, d = 9, 2, 3, (24 if case == "half_of_12" else 16)
    freqs = angles(12, d, gen)
    if case in ("misaligned", "half_of_12"):
        skip = 1 if case == "misaligned" else 0
        flat = torch.randn(skip + s * b * h * d, generator=gen).to(torch.bfloat16)
        views = {dev: flat.to(dev)[skip:] for dev in ("cuda", "cpu")}
        strides = (b * h * d, h * d, d, 1)
    else:
        flat = torch.randn(s * b * h * 2 * d, generator=gen).to(torch.bfloat16)
        views = {dev: flat.to(dev) for dev in ("cuda", "cpu")}
        strides = (b * h * 2 * d, h * 2 * d, 2 * d, 2)
    got, ref = (call(views[dev], (s, b, h, d), strides, freqs.to(dev), "sbhd", interleaved, None, None, False, b, s)
                for dev in ("cuda", "cpu"))
    dense = torch.as_strided(views["cpu"], (s, b, h, d), strides)
    check(got, ref, dense.contiguous(), d, interleaved)


@pytest.mark.parametrize("fmt", ["sbhd", "bshd", "thd"])
@pytest.mark.parametrize("cp_size", [2, 3])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("backward", [False, True])
def test_context_parallel_cuda_matches_cpu(fmt, cp_size, interleaved, backward):
    """Every rank of a context-parallel split, bfloat16, head slice of a packed buffer."""
    gen = torch.Generator().manual_seed(zlib.crc32(repr((fmt, cp_size, interleaved, backward)).encode()))
    h, d, b = 4, 64, 3
    s = 10 * cp_size  # local rows (even)
    if fmt == "thd":
        lens = [8 * cp_size, 0, 2 * cp_size, 20 * cp_size]  # whole lengths, multiples of 2 cp_size
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
        rows = int(cu[-1]) // cp_size + 3  # + 3 local rows of no sequence
        shape, view = (rows, 3 * h, d), (slice(None), slice(h, 2 * h))
        npos = max(lens)
    else:
        cu = None
        shape = (s, b, 3 * h, d) if fmt == "sbhd" else (b, s, 3 * h, d)
        view = (slice(None), slice(None), slice(h, 2 * h))
        npos = s * cp_size
    x = torch.randn(shape, generator=gen).to(torch.bfloat16)
    freqs = angles(npos, d, gen)
    for rank in range(cp_size):
        got, ref = both(x, view, freqs, fmt, interleaved, cu, None, backward, cp=(cp_size, rank))
        check(got, ref, x[view].contiguous(), d, interleaved)
        if fmt == "thd":
            assert torch.equal(got[-3:].cpu(), x[view][-3:])


def test_context_parallel_bad_thd_split_is_nan_on_the_gpu():
    """A THD length that is not a multiple of 2 cp_size cannot be split: the CPU raises, the GPU
    (which cannot see device-side lengths) writes NaN for that sequence's rows only."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(9, 2, 8, generator=gen)
    freqs = angles(16, 8, gen)
    cu = torch.tensor([0, 8, 14], dtype=torch.int32)  # lengths 8 (rows 0..3) and 6 (not a multiple of 4)
    y = call(x.cuda().reshape(-1), (9, 2, 8), x.stride(), freqs.cuda(), "thd", False, cu.cuda(), None, False, 2, 9,
             cp=(2, 1))
    assert not torch.isnan(y[:4]).any() and torch.isnan(y[4:7]).all()
    assert torch.equal(y[7:].cpu(), x[7:])  # rows past cu[-1] / cp_size: copied
    with pytest.raises(nvte.Error, match="every length a multiple of 2 cp_size"):
        call(x.reshape(-1), (9, 2, 8), x.stride(), freqs, "thd", False, cu, None, False, 2, 9, cp=(2, 1))
