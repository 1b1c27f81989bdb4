"""nvte_attn_merge / nvte_attn_merge_sink / nvte_attn_merge_sink_grad on the CUDA backend against
the CPU backend on the same inputs (float32 math on the GPU, float64 on the CPU; errors held to
twice those of the float32 torch formulas): BSHD / SBHD / THD, float32 / bfloat16 / float16 parts,
a part over a row range (rows outside it keep their bits),
head dims that take the 4-element vectors and odd ones that do not, a misaligned part (the scalar
path), special statistics (-inf on either or both sides, NaN), and a context-parallel-sized call
(b=2, 4096 rows, 32 heads, d=128); the sink gradient, deterministic, up to the ring's size
(b=2, 8192 rows)."""
import pytest
import torch

from transformer_engine import _nvte as nvte

from gpu_util import T, sync

F = nvte.NVTE_QKV_Format
FMT = {"bshd": F.NVTE_BSHD, "sbhd": F.NVTE_SBHD, "thd": F.NVTE_THD}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def shape(fmt, b, s, h, d):
    return {"bshd": (b, s, h, d), "sbhd": (s, b, h, d), "thd": (s, h, d)}[fmt]


def stats(fmt, b, s, h):
    return (s, h) if fmt == "thd" else (b, h, s, 1)


def both(fn, *xs):
    """fn on CUDA copies and on CPU copies of xs; the mutated tensors of each, on the CPU."""
    outs = []
    for dev in ("cuda", "cpu"):
        ys = [x.to(dev).clone() for x in xs]
        fn(*ys)
        sync()
        outs.append([y.cpu() for y in ys])
    return outs


def canon_l(l, fmt):
    """[b, h, s] view of statistics in fmt's layout ([b, h, s, 1] or THD's [t, h])."""
    return l.t()[None] if fmt == "thd" else l.reshape(l.shape[:3])


def canon(o, l, fmt):
    """[b, s, h, d] and [b, h, s] views of an output and its statistics in fmt."""
    return {"bshd": o, "sbhd": o.transpose(0, 1), "thd": o[None]}[fmt], canon_l(l, fmt)


def naive(out, lse, part, plse, off, fmt):
    """The merge as float32 torch ops (what the PyTorch adapter did before the library op):
    the same-precision naive implementation the GPU kernel's error is held against."""
    o, l = (x.clone() for x in canon(out, lse, fmt))
    p = None if part is None else canon(part.float(), plse, fmt)[0]
    pl = canon_l(plse, fmt)
    sp = pl.shape[2]
    a = l[:, :, off:off + sp]
    new = torch.logaddexp(a, pl)
    keep = (a == float("-inf")) & (pl == float("-inf"))
    tr = lambda w: w.transpose(1, 2)[..., None]
    merged = tr(torch.exp(a - new)) * o[:, off:off + sp] + (0 if p is None else tr(torch.exp(pl - new)) * p)
    o[:, off:off + sp] = torch.where(tr(keep), o[:, off:off + sp], merged)
    l[:, :, off:off + sp] = torch.where(keep, a, new)
    return o, l


def check(gpu, cpu, ref32, fmt):
    """GPU (float32 math) against the CPU backend (float64 math, rounded once): NaN where the CPU
    has NaN, and elsewhere at most twice the float32 naive implementation's largest error (the
    flash-attention rule), or 4 float32 ulps of the largest value where the naive one happens to
    be that exact (small cases: expf's 2-ulp bound, the division and the sum give the kernel a few
    ulps; a first run with half an ulp as the floor failed tiny cases at 1 ulp)."""
    for g, c, n in zip(canon(*gpu, fmt), canon(*cpu, fmt), ref32):
        assert torch.equal(g.isnan(), c.isnan()), "NaN positions differ"
        inf = c.isinf()
        assert torch.equal(g[inf], c[inf]), "infinite values differ"
        ok = ~c.isnan() & ~inf
        g, c, n = g[ok].double(), c[ok].double(), n[ok].double()
        if c.numel() == 0:
            continue
        err, err_naive = (g - c).abs().max().item(), (n - c).abs().max().item()
        bound = max(2 * err_naive, 2.0**-21 * c.abs().max().item())
        worst = int((g - c).abs().argmax())
        assert err <= bound, (f"GPU error {err:.3g} > bound {bound:.3g} (naive float32 error {err_naive:.3g}); "
                              f"worst: got {g[worst].item()!r} cpu {c[worst].item()!r}")


@pytest.mark.parametrize("fmt", ["bshd", "sbhd", "thd"])
@pytest.mark.parametrize("pdt", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("b,s,sp,off,h,d", [(2, 5, 5, 0, 3, 7), (1, 1, 1, 0, 1, 1), (3, 8, 4, 4, 2, 16),
                                           (2, 9, 3, 2, 5, 33), (2, 64, 32, 32, 4, 128), (1, 10, 7, 1, 2, 256)])
def test_merge_matches_cpu(fmt, pdt, b, s, sp, off, h, d):
    g = torch.Generator().manual_seed(b * 1000 + s * 10 + d)
    out = torch.randn(shape(fmt, b, s, h, d), generator=g)
    lse = torch.randn(stats(fmt, b, s, h), generator=g) * 3
    part = torch.randn(shape(fmt, b, sp, h, d), generator=g).to(DTYPES[pdt])
    plse = torch.randn(stats(fmt, b, sp, h), generator=g) * 3
    if out.numel() > 4:
        lse.view(-1)[1] = float("-inf")
        plse.view(-1)[0] = float("-inf")

    def call(o, l, p, pl):
        nvte.attn_merge(T(o).t, T(l).t, T(p).t, T(pl).t, off, FMT[fmt])

    (go, gl, _, _), (co, cl, _, _) = both(call, out, lse, part, plse)
    check((go, gl), (co, cl), naive(out, lse, part, plse, off, fmt), fmt)
    assert not torch.equal(co, out), "the merge changed nothing"


def test_merge_special_statistics_match_cpu():
    a = torch.tensor([float("-inf"), 1.5, float("-inf"), float("nan"), 0.5, 1000.0, -1000.0, 2.0])
    b = torch.tensor([0.25, float("-inf"), float("-inf"), 0.5, float("nan"), -1000.0, 1000.0, 2.0])
    h, d = a.numel(), 12
    out, part = torch.randn(1, 1, h, d), torch.randn(1, 1, h, d)

    def call(o, l, p, pl):
        nvte.attn_merge(T(o).t, T(l).t, T(p).t, T(pl).t, 0, FMT["bshd"])

    (go, gl, _, _), (co, cl, _, _) = both(call, out, a.view(1, h, 1), part, b.view(1, h, 1))
    check((go, gl), (co, cl), naive(out, a.view(1, h, 1), part, b.view(1, h, 1), 0, "bshd"), "bshd")
    assert torch.equal(go[0, 0, 2], out[0, 0, 2]), "a row with no term on either side changed"


def test_merge_misaligned_part_takes_the_scalar_path():
    """A part starting one element into its buffer (not 16-byte aligned) must still be read right."""
    b, s, h, d = 2, 6, 3, 8
    out, lse = torch.randn(b, s, h, d), torch.randn(b, h, s)
    buf = torch.randn(b * s * h * d + 1).to(torch.bfloat16)
    plse = torch.randn(b, h, s)

    def call(o, l, bf, pl):
        p = bf[1:]  # (a view at element 1: 2-byte aligned only)
        nvte.attn_merge(T(o).t, T(l).t, _view_tensor(p, (b, s, h, d)), T(pl).t, 0, FMT["bshd"])

    (go, gl, _, _), (co, cl, _, _) = both(call, out, lse, buf, plse)
    ref32 = naive(out, lse, buf[1:].view(b, s, h, d), plse, 0, "bshd")
    check((go, gl), (co, cl), ref32, "bshd")


def _view_tensor(p, shp):
    t = nvte.Tensor()
    t.set_param(nvte.Param.kRowwiseData, p.data_ptr(), list(shp), nvte.DType.kBFloat16)
    t._refs = p
    return t


@pytest.mark.parametrize("fmt", ["bshd", "sbhd", "thd"])
def test_merge_sink_matches_cpu(fmt):
    g = torch.Generator().manual_seed(7)
    b, s, h, d = 2, 33, 4, 64
    out = torch.randn(shape(fmt, b, s, h, d), generator=g)
    lse = torch.randn(stats(fmt, b, s, h), generator=g) * 3
    lse.view(-1)[3] = float("-inf")
    sink = torch.randn(h, generator=g)

    def call(o, l, sk):
        nvte.attn_merge_sink(T(o).t, T(l).t, T(sk).t, FMT[fmt])

    (go, gl, _), (co, cl, _) = both(call, out, lse, sink)
    pl = sink.view(1, h).expand(s, h) if fmt == "thd" else sink.view(1, h, 1, 1).expand(b, h, s, 1)
    check((go, gl), (co, cl), naive(out, lse, None, pl, 0, fmt), fmt)


def test_merge_context_parallel_size():
    """A ring step's merge at b=2, 4096 query rows (the second half from a 2048-row part), 32 heads,
    d=128, bf16 part: GPU against CPU."""
    g = torch.Generator().manual_seed(3)
    b, s, h, d = 2, 4096, 32, 128
    out, lse = torch.randn(b, s, h, d, generator=g), torch.randn(b, h, s, 1, generator=g) * 3
    part = torch.randn(b, s // 2, h, d, generator=g).to(torch.bfloat16)
    plse = torch.randn(b, h, s // 2, 1, generator=g) * 3

    def call(o, l, p, pl):
        nvte.attn_merge(T(o).t, T(l).t, T(p).t, T(pl).t, s // 2, FMT["bshd"])

    (go, gl, _, _), (co, cl, _, _) = both(call, out, lse, part, plse)
    check((go, gl), (co, cl), naive(out, lse, part, plse, s // 2, "bshd"), "bshd")
    assert torch.equal(go[:, :s // 2], out[:, :s // 2]), "rows before row_offset changed"


def sink_grad_naive(dout, out, lse, sink, fmt):
    """dsink as float32 torch ops (what the adapter computed before the library op)."""
    o, l = canon(out.float(), lse, fmt)
    d = canon(dout.float(), lse, fmt)[0]
    dot = (o * d).sum(-1).transpose(1, 2)  # [b, h, s]
    p = torch.where(l == float("-inf"), 0.0, torch.exp(sink.view(1, -1, 1) - l))
    return -(p * dot).sum((0, 2)), (p * dot).abs().sum((0, 2))


@pytest.mark.parametrize("fmt", ["bshd", "sbhd", "thd"])
@pytest.mark.parametrize("odt", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("b,s,h,d", [(2, 5, 3, 7), (1, 1, 1, 1), (3, 9, 2, 16), (2, 8192, 32, 128)])
def test_sink_grad_matches_cpu(fmt, odt, b, s, h, d):
    """GPU against the CPU backend (float64 sums): NaN never, twice the float32 torch formula's
    error or 2^-20 of the terms' absolute sum (the float32 sum's rounding), and the same bits on
    a second run (fixed-order sums)."""
    g = torch.Generator().manual_seed(b * 100 + s + d)
    out = torch.randn(shape(fmt, b, s, h, d), generator=g).to(DTYPES[odt])
    dout = torch.randn(shape(fmt, b, s, h, d), generator=g).to(DTYPES[odt])
    lse = torch.randn(stats(fmt, b, s, h), generator=g) * 2 + 1
    if lse.numel() > 2:
        lse.view(-1)[2] = float("-inf")
    sink = torch.randn(h, generator=g)
    res = {}
    for dev in ("cuda", "cpu", "cuda"):
        x = [t.to(dev) for t in (dout, out, lse, sink)]
        ds = torch.full((h,), float("nan"), device=dev)
        nvte.attn_merge_sink_grad(T(x[0]).t, T(x[1]).t, T(x[2]).t, T(x[3]).t, T(ds).t, FMT[fmt])
        sync()
        res.setdefault(dev, []).append(ds.cpu())
    gpu, cpu = res["cuda"][0], res["cpu"][0]
    assert torch.equal(gpu.view(torch.int32), res["cuda"][1].view(torch.int32)), "two GPU runs differ"
    naive, mag = sink_grad_naive(dout, out, lse.view(stats(fmt, b, s, h)), sink, fmt)
    assert not gpu.isnan().any()
    err, err_naive = (gpu.double() - cpu.double()).abs(), (naive.double() - cpu.double()).abs()
    bound = torch.maximum(2 * err_naive.max(), 2.0**-20 * mag.double())
    assert (err <= bound).all(), f"GPU {gpu.tolist()} CPU {cpu.tolist()} naive error {err_naive.tolist()}"
