"""nvte_attn_merge / nvte_attn_merge_sink / nvte_attn_merge_sink_grad (fused_attn.h) on the CPU
backend against a float64
numpy reference (attn_merge_ref): BSHD / SBHD / THD, float32 / bfloat16 / float16 parts, parts
covering all rows or a range from row_offset (rows outside it keep their bits), odd sizes and
size 1, empty parts; -inf statistics on either side and on both (row unchanged), NaN (propagates),
statistics 2000 apart (no overflow). A structured check: attention split into key blocks and
merged block by block equals attention over all keys. The sink gradient against its float64
formula and against central differences of the fold. Bad shapes, dtypes and buffers raise."""
import numpy as np
import pytest

from util import BF16, DT, assert_close
from transformer_engine import _nvte as nvte

F = nvte.NVTE_QKV_Format
FMT = {"bshd": F.NVTE_BSHD, "sbhd": F.NVTE_SBHD, "thd": F.NVTE_THD}
PART = {"float32": (np.float32, DT.kFloat32), "bfloat16": (BF16, DT.kBFloat16), "float16": (np.float16, DT.kFloat16)}


def T(a, dt=None):
    if dt is None or dt == DT.kFloat32:
        return nvte.Tensor(a)
    return nvte.Tensor(a.view(np.uint16), dtype=dt)


def canon(o, fmt):
    """[b, s, h, d] view of an output in fmt (THD: b = 1)."""
    return o[None] if fmt == "thd" else (o if fmt == "bshd" else o.transpose(1, 0, 2, 3))


def uncanon(o, fmt):
    """canon's inverse."""
    return o[0] if fmt == "thd" else (o if fmt == "bshd" else o.transpose(1, 0, 2, 3))


def canon_lse(lse, fmt):
    """[b, h, s] view of statistics in fmt's layout ([b, h, s] or THD's [t, h])."""
    return lse.T[None] if fmt == "thd" else lse


def attn_merge_ref(out, lse, part, plse, off, fmt):
    """float64 (out, lse) after folding in the part at rows off .. off + s_p (part None: zero)."""
    o, l = canon(out.astype(np.float64), fmt).copy(), canon_lse(lse.astype(np.float64), fmt).copy()
    sp = canon_lse(plse, fmt).shape[2]
    p = np.zeros_like(o[:, off:off + sp]) if part is None else canon(part.astype(np.float64), fmt)
    a, b = l[:, :, off:off + sp], canon_lse(plse.astype(np.float64), fmt)
    with np.errstate(invalid="ignore"):
        new = np.logaddexp(a, b)
        wa, wb = np.exp(a - new), np.exp(b - new)
    keep = (a == -np.inf) & (b == -np.inf)  # no term on either side: the row stays
    wa, wb, new = np.where(keep, 1.0, wa), np.where(keep, 0.0, wb), np.where(keep, a, new)
    tr = lambda w: w.transpose(0, 2, 1)[..., None]  # [b, h, s] -> [b, s, h, 1]
    o[:, off:off + sp] = tr(wa) * o[:, off:off + sp] + tr(wb) * np.where(tr(keep), 0.0, p)
    l[:, :, off:off + sp] = new
    return uncanon(o, fmt), (l[0].T if fmt == "thd" else l)


def shapes(fmt, b, s, h, d):
    return {"bshd": (b, s, h, d), "sbhd": (s, b, h, d), "thd": (s, h, d)}[fmt]


def stats_shape(fmt, b, s, h):
    return (s, h) if fmt == "thd" else (b, h, s)


def rand_case(rng, fmt, b, s, sp, h, d, pdt):
    out = rng.standard_normal(shapes(fmt, b, s, h, d)).astype(np.float32)
    lse = (rng.standard_normal(stats_shape(fmt, b, s, h)) * 3).astype(np.float32)
    part = rng.standard_normal(shapes(fmt, b, sp, h, d)).astype(np.float32).astype(PART[pdt][0])
    plse = (rng.standard_normal(stats_shape(fmt, b, sp, h)) * 3).astype(np.float32)
    return out, lse, part, plse


def run_merge(out, lse, part, plse, off, fmt, pdt):
    nvte.attn_merge(T(out), T(lse), T(part, PART[pdt][1]), T(plse), off, FMT[fmt])


@pytest.mark.parametrize("fmt", ["bshd", "sbhd", "thd"])
@pytest.mark.parametrize("pdt", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("b,s,sp,off,h,d", [(2, 5, 5, 0, 3, 7), (1, 1, 1, 0, 1, 1), (3, 8, 4, 4, 2, 16),
                                           (2, 9, 3, 2, 5, 33), (1, 6, 0, 6, 2, 4), (2, 4, 1, 0, 1, 128)])
def test_merge_matches_float64(rng, fmt, pdt, b, s, sp, off, h, d):
    out, lse, part, plse = rand_case(rng, fmt, b, s, sp, h, d, pdt)
    o0, l0 = out.copy(), lse.copy()
    ro, rl = attn_merge_ref(out, lse, part, plse, off, fmt)
    run_merge(out, lse, part, plse, off, fmt, pdt)
    assert_close(out, ro, "float32")
    assert_close(lse, rl, "float32")
    # rows outside the part's range keep their bits
    co, cl, c0, cl0 = canon(out, fmt), canon_lse(lse, fmt), canon(o0, fmt), canon_lse(l0, fmt)
    rows = np.r_[0:off, off + sp:co.shape[1]]
    assert np.array_equal(co[:, rows].view(np.uint32), c0[:, rows].view(np.uint32))
    assert np.array_equal(cl[:, :, rows].view(np.uint32), cl0[:, :, rows].view(np.uint32))


@pytest.mark.parametrize("fmt", ["bshd", "sbhd", "thd"])
def test_merge_special_statistics(fmt):
    """Per head of one token: running -inf (out becomes the part), part -inf (out unchanged),
    both -inf (row unchanged, lse stays -inf), NaN on either side (NaN row), 2000 apart (the
    larger wins without overflow), equal (the mean)."""
    a = np.array([-np.inf, 1.5, -np.inf, np.nan, 0.5, 1000.0, -1000.0, 2.0], np.float32)
    b = np.array([0.25, -np.inf, -np.inf, 0.5, np.nan, -1000.0, 1000.0, 2.0], np.float32)
    h, d = a.size, 5
    rng = np.random.default_rng(0)
    out = rng.standard_normal(shapes(fmt, 1, 1, h, d)).astype(np.float32)
    part = rng.standard_normal(shapes(fmt, 1, 1, h, d)).astype(np.float32)
    lse = (a[:, None] if fmt != "thd" else a[None, :]).reshape(stats_shape(fmt, 1, 1, h)).copy()
    plse = (b[:, None] if fmt != "thd" else b[None, :]).reshape(stats_shape(fmt, 1, 1, h)).copy()
    o0 = out.copy()
    run_merge(out, lse, part, plse, 0, fmt, "float32")
    o, p, z = out.reshape(h, d), part.reshape(h, d), o0.reshape(h, d)
    got_l = lse.reshape(h)
    assert np.array_equal(o[0], p[0]) and got_l[0] == np.float32(0.25)
    assert np.array_equal(o[1], z[1]) and got_l[1] == np.float32(1.5)
    assert np.array_equal(o[2].view(np.uint32), z[2].view(np.uint32)) and got_l[2] == -np.inf
    assert np.isnan(o[3]).all() and np.isnan(got_l[3])
    assert np.isnan(o[4]).all() and np.isnan(got_l[4])
    assert np.array_equal(o[5], z[5]) and got_l[5] == np.float32(1000.0)
    assert np.array_equal(o[6], p[6]) and got_l[6] == np.float32(1000.0)
    assert_close(o[7], (z[7].astype(np.float64) + p[7]) / 2, "float32")
    assert_close(got_l[7], np.float64(2.0) + np.log(2.0), "float32")


@pytest.mark.parametrize("fmt", ["bshd", "sbhd", "thd"])
def test_blocks_merged_equal_whole_attention(fmt):
    """Attention over 3 key blocks (the first covering every query, the others a row range),
    merged block by block, equals float64 attention over the union of the keys per row."""
    rng = np.random.default_rng(1)
    b, s, h, d, sk = 2, 6, 3, 8, 5
    bb = 1 if fmt == "thd" else b
    q = rng.standard_normal((bb, s, h, d))
    ks = [rng.standard_normal((bb, sk, h, d)) for _ in range(3)]
    vs = [rng.standard_normal((bb, sk, h, d)) for _ in range(3)]
    ranges = [(0, s), (2, 4), (3, 3)]  # (row offset, rows) of each block's queries

    def attend(qr, k, v):  # [b, r, h, d] over k, v [b, sk, h, d] -> out [b, r, h, d], lse [b, h, r]
        logit = np.einsum("brhd,bkhd->bhrk", qr, k)
        lse = np.logaddexp.reduce(logit, axis=-1)
        return np.einsum("bhrk,bkhd->brhd", np.exp(logit - lse[..., None]), v), lse

    back = lambda x: uncanon(x, fmt)
    back_l = (lambda x: x[0].T) if fmt == "thd" else (lambda x: x)
    o0, l0 = attend(q, ks[0], vs[0])
    out, lse = np.ascontiguousarray(back(o0), np.float32), np.ascontiguousarray(back_l(l0), np.float32)
    for (off, r), k, v in list(zip(ranges, ks, vs))[1:]:
        oi, li = attend(q[:, off:off + r], k, v)
        run_merge(out, lse, np.ascontiguousarray(back(oi), np.float32),
                  np.ascontiguousarray(back_l(li), np.float32), off, fmt, "float32")
    for i in range(s):  # each row's keys: the blocks whose range covers it
        kk = np.concatenate([k for (off, r), k in zip(ranges, ks) if off <= i < off + r], axis=1)
        vv = np.concatenate([v for (off, r), v in zip(ranges, vs) if off <= i < off + r], axis=1)
        oi, li = attend(q[:, i:i + 1], kk, vv)
        got_o = canon(out, fmt)[:, i:i + 1]
        got_l = canon_lse(lse, fmt)[:, :, i:i + 1]
        assert_close(got_o, oi, "float32", atol=1e-5, rtol=1e-5)  # float32 inputs through several merges
        assert_close(got_l, li, "float32", atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fmt", ["bshd", "sbhd", "thd"])
def test_merge_sink_matches_float64(rng, fmt):
    b, s, h, d = 2, 7, 3, 9
    out = rng.standard_normal(shapes(fmt, b, s, h, d)).astype(np.float32)
    lse = (rng.standard_normal(stats_shape(fmt, b, s, h)) * 3).astype(np.float32)
    lse.reshape(-1)[1] = -np.inf  # a row without keys: the sink alone, out times 0
    sink = rng.standard_normal(h).astype(np.float32)
    plse = np.broadcast_to(sink[None, :] if fmt == "thd" else sink[None, :, None], lse.shape)
    ro, rl = attn_merge_ref(out, lse, None, plse, 0, fmt)
    nvte.attn_merge_sink(T(out), T(lse), T(sink), FMT[fmt])
    assert_close(out, ro, "float32")
    assert_close(lse, rl, "float32")


def test_merge_4d_statistics_accepted():
    """nvte_fused_attn_fwd's statistics [b, h, s, 1] are taken as they are."""
    rng = np.random.default_rng(2)
    out, lse, part, plse = rand_case(rng, "bshd", 2, 4, 4, 3, 8, "float32")
    ro, rl = attn_merge_ref(out, lse, part, plse, 0, "bshd")
    lse4, plse4 = lse[..., None].copy(), plse[..., None].copy()
    nvte.attn_merge(T(out), T(lse4), T(part), T(plse4), 0, FMT["bshd"])
    assert_close(out, ro, "float32")
    assert_close(lse4[..., 0], rl, "float32")


def _f32(*s):
    return np.zeros(s, np.float32)


@pytest.mark.parametrize("what,args,msg", [
    ("out bf16", lambda: (nvte.Tensor(np.zeros((2, 4, 3, 8), np.uint16), dtype=DT.kBFloat16), T(_f32(2, 3, 4)),
                          T(_f32(2, 4, 3, 8)), T(_f32(2, 3, 4)), 0), "must be float32"),
    ("lse shape", lambda: (T(_f32(2, 4, 3, 8)), T(_f32(2, 4, 3)), T(_f32(2, 4, 3, 8)), T(_f32(2, 3, 4)), 0),
     "lse must be"),
    ("part heads", lambda: (T(_f32(2, 4, 3, 8)), T(_f32(2, 3, 4)), T(_f32(2, 4, 2, 8)), T(_f32(2, 2, 4)), 0),
     "must match out"),
    ("part past end", lambda: (T(_f32(2, 4, 3, 8)), T(_f32(2, 3, 4)), T(_f32(2, 2, 3, 8)), T(_f32(2, 3, 2)), 3),
     "run past"),
    ("part lse rows", lambda: (T(_f32(2, 4, 3, 8)), T(_f32(2, 3, 4)), T(_f32(2, 2, 3, 8)), T(_f32(2, 3, 4)), 0),
     "lse_part must be"),
    ("stats 4-D not 1", lambda: (T(_f32(2, 4, 3, 8)), T(_f32(2, 3, 4, 2)), T(_f32(2, 4, 3, 8)), T(_f32(2, 3, 4)),
                                 0), "lse must be"),
    ("out without rowwise data", lambda: (nvte.Tensor(None, columnwise_data=_f32(2, 4, 3, 8)), T(_f32(2, 3, 4)),
                                          T(_f32(2, 4, 3, 8)), T(_f32(2, 3, 4)), 0), "out needs rowwise data"),
    ("part without rowwise data", lambda: (T(_f32(2, 4, 3, 8)), T(_f32(2, 3, 4)),
                                           nvte.Tensor(None, columnwise_data=_f32(2, 4, 3, 8)), T(_f32(2, 3, 4)), 0),
     "out_part needs rowwise data"),
    ("part fp8", lambda: (T(_f32(2, 4, 3, 8)), T(_f32(2, 3, 4)),
                          nvte.Tensor(np.zeros((2, 4, 3, 8), np.uint8), dtype=DT.kFloat8E4M3), T(_f32(2, 3, 4)), 0),
     "out_part must be float32"),
])
def test_merge_rejects_bad_arguments(what, args, msg):
    a = args()
    with pytest.raises(RuntimeError, match=msg):
        nvte.attn_merge(*a, FMT["bshd"])


def test_merge_rejects_overlapping_buffers():
    """The part is read while out / lse are written: shared memory is an error, not a race."""
    out, lse = _f32(2, 4, 3, 8), _f32(2, 3, 4)
    with pytest.raises(RuntimeError, match="out_part must not share memory"):
        nvte.attn_merge(T(out), T(lse), T(out), T(_f32(2, 3, 4)), 0, FMT["bshd"])
    with pytest.raises(RuntimeError, match="lse_part must not share memory"):
        nvte.attn_merge(T(out), T(lse), T(_f32(2, 2, 3, 8)), T(lse.reshape(-1)[:12].reshape(2, 3, 2)), 2, FMT["bshd"])
    with pytest.raises(RuntimeError, match="out and lse must not share memory"):
        nvte.attn_merge(T(out), T(out.reshape(-1)[:24].reshape(2, 3, 4)), T(_f32(2, 4, 3, 8)), T(_f32(2, 3, 4)), 0,
                        FMT["bshd"])
    with pytest.raises(RuntimeError, match="sink must not share memory"):
        nvte.attn_merge_sink(T(out), T(lse), T(lse.reshape(-1)[:3]), FMT["bshd"])


@pytest.mark.parametrize("fmt,out_shape,lse_shape,part_shape,plse_shape", [
    ("sbhd", (4, 2, 3, 8), (2, 3, 4), (2, 3, 3, 8), (2, 3, 2)),   # the part's batch differs
    ("thd", (6, 3, 8), (6, 3), (4, 3, 5), (4, 3)),                 # the part's head dim differs
])
def test_merge_rejects_parts_of_other_shapes(fmt, out_shape, lse_shape, part_shape, plse_shape):
    with pytest.raises(RuntimeError, match="must match out"):
        nvte.attn_merge(T(_f32(*out_shape)), T(_f32(*lse_shape)), T(_f32(*part_shape)), T(_f32(*plse_shape)), 0,
                        FMT[fmt])


def test_merge_rejects_bad_format_and_sink():
    out, lse = _f32(2, 4, 3, 8), _f32(2, 3, 4)
    with pytest.raises(RuntimeError, match="qkv_format"):
        nvte.attn_merge(T(out), T(lse), T(out), T(lse), 0, F.NVTE_BSHD_2SBHD)
    with pytest.raises(RuntimeError, match=r"sink has shape \[4\]; expected \[3\]"):
        nvte.attn_merge_sink(T(out), T(lse), T(_f32(4)), FMT["bshd"])
    with pytest.raises(RuntimeError, match="THD"):
        nvte.attn_merge(T(_f32(4, 3, 8)), T(_f32(3, 4)), T(_f32(4, 3, 8)), T(_f32(3, 4)), 0, FMT["thd"])


def sink_grad_ref(dout, out, lse, sink, fmt):
    """float64 dsink[h] = -sum over rows of exp(sink[h] - lse) (dO . O); rows with lse -inf: none."""
    o, d = canon(out.astype(np.float64), fmt), canon(dout.astype(np.float64), fmt)
    l = canon_lse(lse.astype(np.float64), fmt)  # [b, h, s]
    dot = np.einsum("bshd,bshd->bhs", o, d)
    with np.errstate(over="ignore"):
        p = np.where(l == -np.inf, 0.0, np.exp(sink.astype(np.float64)[None, :, None] - l))
    return -(p * dot).sum(axis=(0, 2))


@pytest.mark.parametrize("fmt", ["bshd", "sbhd", "thd"])
@pytest.mark.parametrize("odt", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("b,s,h,d", [(2, 5, 3, 7), (1, 1, 1, 1), (3, 9, 2, 16), (2, 17, 4, 128)])
def test_sink_grad_matches_float64(rng, fmt, odt, b, s, h, d):
    out = rng.standard_normal(shapes(fmt, b, s, h, d)).astype(np.float32).astype(PART[odt][0])
    dout = rng.standard_normal(shapes(fmt, b, s, h, d)).astype(np.float32).astype(PART[odt][0])
    lse = (rng.standard_normal(stats_shape(fmt, b, s, h)) * 2 + 1).astype(np.float32)
    if lse.size > 2:
        lse.reshape(-1)[2] = -np.inf
    sink = rng.standard_normal(h).astype(np.float32)
    dsink = np.full(h, np.nan, np.float32)
    nvte.attn_merge_sink_grad(T(dout, PART[odt][1]), T(out, PART[odt][1]), T(lse), T(sink), T(dsink), FMT[fmt])
    assert_close(dsink, sink_grad_ref(dout, out, lse, sink, fmt), "float32", atol=1e-5)


@pytest.mark.parametrize("fmt", ["bshd", "thd"])
def test_sink_grad_is_the_derivative_of_the_fold(fmt):
    """Central differences in float64 of loss(sink) = sum dO * fold(out0, lse0, sink) (the fold of
    nvte_attn_merge_sink) against the library's gradient at the folded output and statistics."""
    rng = np.random.default_rng(5)
    b, s, h, d = 2, 6, 3, 8
    out0 = rng.standard_normal(shapes(fmt, b, s, h, d))
    lse0 = rng.standard_normal(stats_shape(fmt, b, s, h))
    dout = rng.standard_normal(out0.shape)
    sink = rng.standard_normal(h)

    def fold(sk):
        o, l = attn_merge_ref(out0, lse0, None, np.broadcast_to(
            sk[None, :] if fmt == "thd" else sk[None, :, None], lse0.shape), 0, fmt)
        return o, l

    def loss(sk):
        return float((dout * fold(sk)[0]).sum())

    eps, fd = 1e-6, np.zeros(h)
    for i in range(h):
        e = np.zeros(h)
        e[i] = eps
        fd[i] = (loss(sink + e) - loss(sink - e)) / (2 * eps)
    o, l = fold(sink)
    dsink = np.zeros(h, np.float32)
    f32 = lambda x: np.ascontiguousarray(x, np.float32)
    nvte.attn_merge_sink_grad(T(f32(dout)), T(f32(o)), T(f32(l)),
                              T(f32(sink)), T(dsink), FMT[fmt])
    assert_close(dsink, fd, "float32", atol=1e-4, rtol=1e-4)  # float32 inputs; differences to ~1e-8


def test_sink_grad_rejects_bad_arguments():
    out, lse, sink = _f32(2, 4, 3, 8), _f32(2, 3, 4), _f32(3)
    with pytest.raises(RuntimeError, match=r"dout has shape \[2, 4, 3, 4\]; expected \[2, 4, 3, 8\]"):
        nvte.attn_merge_sink_grad(T(_f32(2, 4, 3, 4)), T(out), T(lse), T(sink), T(_f32(3)), FMT["bshd"])
    with pytest.raises(RuntimeError, match=r"dsink has shape \[4\]; expected \[3\]"):
        nvte.attn_merge_sink_grad(T(_f32(2, 4, 3, 8)), T(out), T(lse), T(sink), T(_f32(4)), FMT["bshd"])
    with pytest.raises(RuntimeError, match="dsink must not share memory"):
        nvte.attn_merge_sink_grad(T(_f32(2, 4, 3, 8)), T(out), T(lse), T(sink), T(sink), FMT["bshd"])
    with pytest.raises(RuntimeError, match="lse must be"):
        nvte.attn_merge_sink_grad(T(_f32(2, 4, 3, 8)), T(out), T(_f32(2, 4, 3)), T(sink), T(_f32(3)), FMT["bshd"])
