"""Rotary position embedding (fused_rope.h), forward and backward, on the CPU backend against a
float64 numpy reference: SBHD / BSHD / THD, float32 / float16 / bfloat16, full and partial
rotation (d2 < d), interleaved pairs, start positions, strided inputs (a head slice of a packed
QKV buffer), THD rows outside every sequence, empty inputs; the backward is also checked to be
the transpose of the forward (<R x, g> = <x, R^T g>, in float64 on float32 data)."""
import numpy as np
import pytest

from util import BF16, DT, assert_close, poisoned, to_np
from transformer_engine import _nvte as nvte

F = nvte.NVTE_QKV_Format
FMT = {"sbhd": F.NVTE_SBHD, "bshd": F.NVTE_BSHD, "thd": F.NVTE_THD}


def T(a, dtype=None):
    """nvte.Tensor of an array (bfloat16 as its uint16 bits)."""
    if a.dtype == BF16:
        return nvte.Tensor(a.view(np.uint16), dtype=DT.kBFloat16)
    return nvte.Tensor(a) if dtype is None else nvte.Tensor(a, dtype=dtype)


def angles(rows, d2, rng, base=10000.0):
    """freqs [rows, 1, 1, d2] float32: TE's RotaryPositionEmbedding angles (pos * inv_freq), halves repeated."""
    inv = 1.0 / base ** (np.arange(0, d2, 2) / d2)
    f = np.outer(np.arange(rows), inv)
    f = np.concatenate([f, f], axis=1) + 0.01 * rng.standard_normal((rows, d2))  # (not symmetric on purpose)
    return f.astype(np.float32).reshape(rows, 1, 1, d2)


def positions(fmt, s, b, start, cu=None, t=0):
    """Per dense output row: its position (s_i + start[b_i]; THD: row in its sequence + start), or
    -1 for THD rows of no sequence."""
    st = np.zeros(b, np.int64) if start is None else np.asarray(start, np.int64)
    if fmt == "thd":
        pos = np.full(t, -1, np.int64)
        for i in range(b):
            pos[cu[i]:cu[i + 1]] = np.arange(cu[i + 1] - cu[i]) + st[i]
        return pos
    if fmt == "sbhd":  # rows (s_i, b_i)
        return (np.arange(s)[:, None] + st[None, :]).reshape(-1)
    return (st[:, None] + np.arange(s)[None, :]).reshape(-1)  # bshd: rows (b_i, s_i)


def rope_ref(x, freqs, pos, d2, interleaved, backward=False):
    """x [rows, h, d] float64; freqs [R, d2]; pos [rows] (-1: copy)."""
    out = x.copy()
    k = np.arange(d2)
    if interleaved:
        q, sign = k ^ 1, np.where(k % 2 == 1, 1.0, -1.0)
    else:
        half = d2 // 2
        q, sign = np.where(k < half, k + half, k - half), np.where(k < half, -1.0, 1.0)
    for r in range(x.shape[0]):
        if pos[r] < 0:
            continue
        a = freqs[pos[r]].astype(np.float64)
        xr = x[r, :, :d2]
        if backward:
            out[r, :, :d2] = xr * np.cos(a) - sign * xr[:, q] * np.sin(a[q])
        else:
            out[r, :, :d2] = xr * np.cos(a) + sign * xr[:, q] * np.sin(a)
    return out


def run(x_view, freqs, fmt, interleaved, cu=None, start=None, backward=False, base=None, out_dtype=None, cp=(1, 0)):
    """Calls the library on x_view (a view into base, or its own array); returns the dense output."""
    base = x_view if base is None else base
    item = x_view.itemsize
    off = (x_view.__array_interface__["data"][0] - base.__array_interface__["data"][0]) // item
    flat = base.reshape(-1)[off:]
    strides = [st // item for st in x_view.strides]
    if fmt == "thd":
        t, h, d = x_view.shape
        s, b = t, len(cu) - 1
        st_t, st_b, st_h, st_d = strides[0], 0, strides[1], strides[2]
        shape = (t, h, d)
    else:
        if fmt == "sbhd":
            s, b, h, d = x_view.shape
            st_t, st_b, st_h, st_d = strides
        else:
            b, s, h, d = x_view.shape
            st_b, st_t, st_h, st_d = strides
        shape = x_view.shape
    d2 = freqs.shape[-1]
    name = {np.float32: "float32", np.float16: "float16", BF16: "bfloat16"}[x_view.dtype.type]
    y = poisoned(shape, name)
    fn = nvte.fused_rope_backward if backward else nvte.fused_rope_forward
    fn(T(flat), None if cu is None else T(np.asarray(cu, np.int32)), T(freqs),
       None if start is None else T(np.asarray(start, np.int32)), T(y), FMT[fmt], interleaved, *cp, s, b, h, d, d2,
       st_t, st_b, st_h, st_d)
    return y


def dense_rows(x, fmt):
    """[rows, h, d] in the dense row order of the format (rows of the output)."""
    return x.reshape(-1, x.shape[-2], x.shape[-1])


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("fmt", ["sbhd", "bshd", "thd"])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("partial", [False, True])
@pytest.mark.parametrize("backward", [False, True])
def test_rope_matches_float64(rng, dtype, fmt, interleaved, partial, backward):
    s, b, h, d = 7, 3, 3, 12
    d2 = 8 if partial else d
    start = rng.integers(0, 5, b)
    cu = [0, 3, 3, 9] if fmt == "thd" else None  # (an empty sequence; row 9..10 belong to none)
    shape = (11, h, d) if fmt == "thd" else ((s, b, h, d) if fmt == "sbhd" else (b, s, h, d))
    x = to_np(rng.standard_normal(shape), dtype)
    freqs = angles(16, d2, rng)
    got = run(x, freqs, fmt, interleaved, cu=cu, start=start, backward=backward)
    pos = positions(fmt, s, b, start, cu, shape[0])
    ref = rope_ref(dense_rows(x.astype(np.float64), fmt), freqs.reshape(-1, d2), pos, d2, interleaved, backward)
    assert_close(dense_rows(got.astype(np.float64), fmt), ref, dtype)
    if fmt == "thd":  # rows of no sequence are copied exactly
        assert np.array_equal(got[9:].astype(np.float64), x[9:].astype(np.float64))


@pytest.mark.parametrize("interleaved", [False, True])
def test_backward_is_the_transpose(rng, interleaved):
    s, b, h, d, d2 = 6, 2, 2, 10, 6
    x = rng.standard_normal((s, b, h, d)).astype(np.float32)
    g = rng.standard_normal((s, b, h, d)).astype(np.float32)
    freqs = angles(8, d2, rng)
    rx = run(x, freqs, "sbhd", interleaved).astype(np.float64)
    rtg = run(g, freqs, "sbhd", interleaved, backward=True).astype(np.float64)
    lhs, rhs = float((rx * g).sum()), float((x.astype(np.float64) * rtg).sum())
    assert abs(lhs - rhs) <= 1e-5 * (abs(lhs) + 1.0), (lhs, rhs)


@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
def test_strided_head_slice_of_packed_qkv(rng, fmt):
    """q as TE's QKV split gives it: a slice of the heads of [.., 3 h, d] (strides of the big buffer)."""
    s, b, h, d = 5, 2, 4, 8
    packed = rng.standard_normal((s, b, 3 * h, d) if fmt == "sbhd" else (b, s, 3 * h, d)).astype(np.float32)
    q = packed[:, :, h:2 * h]  # the middle third
    freqs = angles(s, d, rng)
    got = run(q, freqs, fmt, False, base=packed)
    want = run(np.ascontiguousarray(q), freqs, fmt, False)
    np.testing.assert_array_equal(got, want)


def test_structured_positions_and_empty(rng):
    """ones through angle 0 stay ones at position 0; empty inputs run."""
    x = np.ones((1, 2, 1, 4), np.float32)
    freqs = np.zeros((1, 1, 1, 4), np.float32)
    np.testing.assert_array_equal(run(x, freqs, "sbhd", False), x)
    assert run(np.zeros((0, 2, 1, 4), np.float32), freqs, "sbhd", False).shape == (0, 2, 1, 4)
    # a quarter turn: (x0, x2) = (1, 0) -> (cos, sin) = (0, 1) for non-interleaved d2 = 4
    x = np.array([1.0, 0.0, 0.0, 0.0], np.float32).reshape(1, 1, 1, 4)
    f = np.full((1, 1, 1, 4), np.pi / 2, np.float32)
    assert_close(run(x, f, "sbhd", False).reshape(-1), np.array([0.0, 0.0, 1.0, 0.0]))


def test_errors(rng):
    x = rng.standard_normal((4, 2, 2, 8)).astype(np.float32)
    y = np.zeros_like(x)
    f = angles(4, 8, rng)

    def call(**kw):
        a = dict(x=x, cu=None, f=f, start=None, y=y, fmt=F.NVTE_SBHD, cp=1, s=4, b=2, h=2, d=8, d2=8,
                 strides=(16, 8, 4, 1))
        a.update(kw)
        nvte.fused_rope_forward(T(a["x"]), a["cu"], T(a["f"]), a["start"], T(a["y"]), a["fmt"], False, a["cp"], 0,
                                a["s"], a["b"], a["h"], a["d"], a["d2"], *a["strides"])

    call()
    with pytest.raises(nvte.Error, match="d2 .* must be even"):
        call(d2=7, f=rng.standard_normal((4, 1, 1, 7)).astype(np.float32))
    with pytest.raises(nvte.Error, match="start_positions .* with context parallelism") as e:
        call(cp=2, start=T(np.array([0, 0], np.int32)))
    assert e.value.args[1] == int(nvte.Status.NOT_SUPPORTED)
    with pytest.raises(nvte.Error, match="cp_rank < cp_size"):
        call(cp=0)
    with pytest.raises(nvte.Error, match="s must be even"):
        call(cp=2, s=3, x=x[:3], y=y[:3])
    with pytest.raises(nvte.Error, match="freqs has 3 rows"):
        call(f=angles(3, 8, rng))
    with pytest.raises(nvte.Error, match="start_positions must be int32"):
        call(start=T(np.zeros(3, np.int32)))
    with pytest.raises(nvte.Error, match="freqs has 4 rows"):
        call(start=T(np.array([0, 1], np.int32)))  # sequence 1 reaches position 4
    with pytest.raises(nvte.Error, match="expected \\[4, 2, 2, 8\\]"):
        call(y=np.zeros((2, 4, 2, 8), np.float32))
    with pytest.raises(nvte.Error, match="strides reach element"):
        call(strides=(64, 8, 4, 1))
    with pytest.raises(nvte.Error, match="freqs must be float32"):
        call(f=f.astype(np.float16))
    with pytest.raises(nvte.Error, match="cu_seqlens is a NULL"):
        call(fmt=F.NVTE_THD, x=x.reshape(8, 2, 8), y=np.zeros((8, 2, 8), np.float32), strides=(16, 0, 8, 1))
    with pytest.raises(nvte.Error, match="cu_seqlens must be int32"):
        call(fmt=F.NVTE_THD, x=x.reshape(8, 2, 8), y=np.zeros((8, 2, 8), np.float32), strides=(16, 0, 8, 1),
             cu=T(np.array([0, 5], np.int32)))  # b = 2 needs 3 entries
    with pytest.raises(nvte.Error, match="non-decreasing"):
        call(fmt=F.NVTE_THD, x=x.reshape(8, 2, 8), y=np.zeros((8, 2, 8), np.float32), strides=(16, 0, 8, 1),
             cu=T(np.array([0, 5, 3], np.int32)))


def test_thd_stride_bound_does_not_wrap(rng):
    """A THD output of 2^34 + 1 rows with row stride 2^30 over a 16-element input: rows x stride is
    2^64, which wrapped to 0 in 64-bit arithmetic, passed the bound and read far past the input
    (SIGSEGV). The handles only describe the output (its buffer is never touched: the call is
    refused first)."""
    x = np.zeros((8, 1, 2), np.float16)
    backing = np.zeros(4, np.float16)
    y = nvte.Tensor.make(backing.ctypes.data, [2 ** 34 + 1, 1, 2], nvte.DType.kFloat16)
    cu = T(np.array([0, 1], np.int32))
    with pytest.raises(nvte.Error, match="strides reach element 2\\^64 or beyond"):
        nvte.fused_rope_forward(T(x), cu, T(angles(2, 2, rng)), None, y, F.NVTE_THD, False, 1, 0, 0, 1, 1, 2, 2,
                                2 ** 30, 0, 2, 1)


def test_freqs_without_rowwise_data_raise(rng):
    """freqs given only as columnwise data (its logical shape right): an error, not a null read (a
    segfault before)."""
    x = rng.standard_normal((4, 2, 2, 8)).astype(np.float32)
    f = angles(4, 8, rng)
    col = nvte.Tensor(None, columnwise_data=np.ascontiguousarray(np.moveaxis(f, -1, 0)))
    with pytest.raises(nvte.Error, match="freqs needs rowwise data"):
        nvte.fused_rope_forward(T(x), None, col, None, T(np.zeros_like(x)), F.NVTE_SBHD, False, 1, 0, 4, 2, 2, 8, 8,
                                16, 8, 4, 1)


def cp_chunks(n, cp_size, rank):
    """Indices of a sequence of n tokens that context-parallel rank `rank` holds (TE's split: chunks
    rank and 2 cp_size - 1 - rank of 2 cp_size)."""
    c = n // (2 * cp_size)
    return np.concatenate([np.arange(rank * c, (rank + 1) * c),
                           np.arange((2 * cp_size - 1 - rank) * c, (2 * cp_size - rank) * c)])


@pytest.mark.parametrize("fmt", ["sbhd", "bshd", "thd"])
@pytest.mark.parametrize("cp_size", [2, 3])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("backward", [False, True])
def test_context_parallel_is_rope_of_the_whole_sequence(rng, fmt, cp_size, interleaved, backward):
    """Each rank's output equals its chunks of RoPE applied to the whole sequences (float64
    reference at positions 0..n-1, then split as TE splits): the rank's positions are the global ones."""
    h, d, d2, b = 3, 12, 8, 2
    if fmt == "thd":
        lens = [4 * cp_size, 0, 2 * cp_size, 6 * cp_size]  # multiples of 2 cp_size, one empty
        cu = np.concatenate([[0], np.cumsum(lens)])
        full = rng.standard_normal((cu[-1], h, d))
        freqs = angles(max(lens), d2, rng)
        pos_full = np.concatenate([np.arange(n) for n in lens])
        ref_full = rope_ref(full, freqs.reshape(-1, d2), pos_full, d2, interleaved, backward)
    else:
        n = 6 * cp_size
        full = rng.standard_normal((n, b, h, d) if fmt == "sbhd" else (b, n, h, d))
        freqs = angles(n, d2, rng)
        rows = dense_rows(full, fmt)
        ref_full = rope_ref(rows, freqs.reshape(-1, d2), positions(fmt, n, b, None), d2, interleaved,
                            backward).reshape(full.shape)
    for rank in range(cp_size):
        if fmt == "thd":
            idx = np.concatenate([cu[i] + cp_chunks(lens[i], cp_size, rank) for i in range(len(lens))])
            x, want = full[idx].astype(np.float32), ref_full[idx]
            got = run(x, freqs, fmt, interleaved, cu=cu, backward=backward, cp=(cp_size, rank))
        else:
            idx = cp_chunks(n, cp_size, rank)
            axis = 0 if fmt == "sbhd" else 1
            x = np.take(full, idx, axis=axis).astype(np.float32)
            want = np.take(ref_full, idx, axis=axis)
            got = run(x, freqs, fmt, interleaved, backward=backward, cp=(cp_size, rank))
        assert_close(got.astype(np.float64), want, "float32")


def test_context_parallel_errors(rng):
    h, d = 2, 8
    freqs = angles(16, d, rng)

    def thd(cu, t, cp=(2, 0)):
        return run(rng.standard_normal((t, h, d)).astype(np.float32), freqs, "thd", False, cu=cu, cp=cp)

    thd([0, 8, 12], 6)  # lengths 8 and 4: multiples of 2 cp_size
    with pytest.raises(nvte.Error, match="every length a multiple of 2 cp_size .* sequence 1 spans \\[8, 14\\)"):
        thd([0, 8, 14], 7)
    with pytest.raises(nvte.Error, match="t \\* cp_size = 10"):
        thd([0, 8, 12], 5)  # 5 local rows hold at most 10 tokens of the whole sequences
    x = rng.standard_normal((10, 1, h, d)).astype(np.float32)
    run(x, freqs, "sbhd", False, cp=(2, 1))  # rank 1 holds positions 5..14
    with pytest.raises(nvte.Error, match="freqs has 16 rows"):  # rank 0 holds 0..4 and 15..19
        run(x, freqs, "sbhd", False, cp=(2, 0))
