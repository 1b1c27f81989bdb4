"""nvte_copy_to_kv_cache (fused_attn.h) on the CPU backend against a plain-Python placement of
every new token: BSHD / SBHD / THD inputs, paged caches (pages of a sequence scattered through
the cache), non-paged caches with a slot table and without, float32 / float16 / bfloat16 / FP8
(rows are bytes), odd heads and head dims with d_v != d_k, sequences without new tokens, padding
rows of BSHD/SBHD inputs (never read), and caches full to the last position. The result must be
bit-identical and rows the step does not own must keep their bytes. Bad lengths, page ids and
shapes raise and leave the caches untouched."""
import numpy as np
import pytest

from util import BF16, DT, E4M3
from transformer_engine import _nvte as nvte

F = nvte.NVTE_QKV_Format
FMT = {"bshd": F.NVTE_BSHD, "sbhd": F.NVTE_SBHD, "thd": F.NVTE_THD}
DTYPES = {"float32": (np.float32, DT.kFloat32), "float16": (np.float16, DT.kFloat16),
          "bfloat16": (BF16, DT.kBFloat16), "e4m3": (E4M3, DT.kFloat8E4M3)}


def T(a, dt=None):
    """nvte.Tensor over a's memory (16-bit and FP8 arrays as their bits)."""
    if dt is None or dt in (DT.kFloat32, DT.kInt32):
        return nvte.Tensor(a)
    return nvte.Tensor(a.view(np.uint16 if a.itemsize == 2 else np.uint8), dtype=dt)


def rand(rng, shape, dtype):
    return rng.standard_normal(shape).astype(np.float32).astype(dtype)


def layout(fmt, new, b, ctx):
    """new-token row of (sequence i, token j) in the flattened input."""
    cu = np.concatenate([[0], np.cumsum(new)])
    if fmt == "thd":
        return lambda i, j: cu[i] + j
    if fmt == "bshd":
        return lambda i, j: i * ctx + j
    return lambda i, j: j * b + i


def copy_ref(kc, vc, nk, nv, fmt, new, cached, b, ctx, table, page_size, paged):
    """The caches after the step, placed token by token (cache rows: [rows, h, d])."""
    kc, vc = kc.copy(), vc.copy()
    fk, fv = nk.reshape(-1, *nk.shape[-2:]), nv.reshape(-1, *nv.shape[-2:])
    ck, cv = kc.reshape(-1, *kc.shape[-2:]), vc.reshape(-1, *vc.shape[-2:])
    src = layout(fmt, new, b, ctx)
    for i in range(b):
        for j in range(new[i]):
            pos = cached[i] - new[i] + j
            if paged:
                row = table[i, pos // page_size] * page_size + pos % page_size
            else:
                row = (table[i, 0] if table is not None else i) * page_size + pos
            ck[row], cv[row] = fk[src(i, j)], fv[src(i, j)]
    return kc, vc


def make_case(rng, fmt, b, h, dk, dv, dtype, paged, page_size, pages_per_seq, with_table=True, ctx=None):
    """Random inputs: before-step lengths, new tokens (0 allowed), caches with random contents."""
    capacity = page_size * pages_per_seq if paged else page_size
    before = rng.integers(0, capacity // 2 + 1, size=b)
    new = np.minimum(rng.integers(0, 5, size=b), capacity - before)
    new[0] = max(new[0], 1)
    before[-1] = capacity - new[-1]  # one sequence fills its cache to the last position
    cached = before + new
    ctx = int(new.max()) + 1 if ctx is None else ctx  # BSHD/SBHD rows past a sequence's tokens: padding
    t = int(new.sum()) + 2  # THD: two unused rows at the end
    if paged:
        total_pages = b * pages_per_seq + 3
        table = rng.permutation(total_pages)[:b * pages_per_seq].reshape(b, pages_per_seq).astype(np.int32)
        slots = total_pages
    else:
        slots = b + 2
        table = rng.permutation(slots)[:b].reshape(b, 1).astype(np.int32) if with_table else None
    kc = rand(rng, (slots, page_size, h, dk), dtype)
    vc = rand(rng, (slots, page_size, h, dv), dtype)
    shape = {"thd": (t,), "bshd": (b, ctx), "sbhd": (ctx, b)}[fmt]
    nk, nv = rand(rng, shape + (h, dk), dtype), rand(rng, shape + (h, dv), dtype)
    cu_new = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
    cu_cached = np.concatenate([[0], np.cumsum(cached)]).astype(np.int32)
    return dict(kc=kc, vc=vc, nk=nk, nv=nv, new=new, cached=cached, ctx=ctx, table=table, cu_new=cu_new,
                cu_cached=cu_cached, capacity=capacity)


def run(c, fmt, b, dt, paged, page_size, pages_per_seq, max_seq_len=None):
    kc, vc = c["kc"].copy(), c["vc"].copy()
    nvte.copy_to_kv_cache(T(c["nk"], dt), T(c["nv"], dt), T(kc, dt), T(vc, dt),
                          None if c["table"] is None else T(c["table"]), T(c["cu_new"]), T(c["cu_cached"]),
                          FMT[fmt], b, c["ctx"], c["capacity"] if max_seq_len is None else max_seq_len,
                          pages_per_seq if paged else 1, 0 if paged else 1)
    return kc, vc


def bits(a):
    return a.view(np.uint8)


@pytest.mark.parametrize("fmt", ["bshd", "sbhd", "thd"])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("paged", [True, False])
def test_copy_matches_reference(rng, fmt, dtype, paged):
    npt, dt = DTYPES[dtype]
    b, h, dk, dv = 5, 3, 5, 7  # odd sizes, d_v != d_k
    page_size, pps = (4, 5) if paged else (13, 1)
    c = make_case(rng, fmt, b, h, dk, dv, npt, paged, page_size, pps)
    kc, vc = run(c, fmt, b, dt, paged, page_size, pps)
    rk, rv = copy_ref(c["kc"], c["vc"], c["nk"], c["nv"], fmt, c["new"], c["cached"], b, c["ctx"], c["table"],
                      page_size, paged)
    assert np.array_equal(bits(kc), bits(rk)) and np.array_equal(bits(vc), bits(rv))
    assert not np.array_equal(bits(kc), bits(c["kc"]))  # (the step wrote something)


@pytest.mark.parametrize("fmt", ["bshd", "sbhd", "thd"])
def test_non_paged_without_table_uses_slot_i(rng, fmt):
    b, h, d = 4, 2, 8
    c = make_case(rng, fmt, b, h, d, d, np.float32, False, 9, 1, with_table=False)
    kc, vc = run(c, fmt, b, DT.kFloat32, False, 9, 1)
    rk, rv = copy_ref(c["kc"], c["vc"], c["nk"], c["nv"], fmt, c["new"], c["cached"], b, c["ctx"], None, 9, False)
    assert np.array_equal(kc, rk) and np.array_equal(vc, rv)


def test_structured_values_land_at_their_positions():
    """arange keys: each cache row must hold exactly the token that belongs there (a pattern an
    off-by-one in the position or the page shows)."""
    b, h, d, page_size, pps = 2, 1, 4, 2, 3
    new, cached = np.array([3, 1]), np.array([4, 6])
    table = np.array([[5, 0, 2], [1, 4, 3]], np.int32)
    nk = np.arange(b * 3 * h * d, dtype=np.float32).reshape(b, 3, h, d)
    kc = np.full((6, page_size, h, d), -1.0, np.float32)
    vc = kc.copy()
    nvte.copy_to_kv_cache(T(nk), T(nk + 1000), T(kc), T(vc), T(table),
                          T(np.array([0, 3, 4], np.int32)), T(np.array([0, 4, 10], np.int32)), F.NVTE_BSHD, b, 3, 6,
                          pps, 0)
    flat = kc.reshape(-1, h, d)
    # sequence 0: positions 1, 2, 3 -> page 5 slot 1, page 0 slots 0 and 1; sequence 1: position 5 -> page 3 slot 1
    for (row, tok) in [(5 * 2 + 1, (0, 0)), (0, (0, 1)), (1, (0, 2)), (3 * 2 + 1, (1, 0))]:
        assert np.array_equal(flat[row], nk[tok]), (row, tok)
        assert np.array_equal(vc.reshape(-1, h, d)[row], nk[tok] + 1000)
    touched = {11, 0, 1, 7}
    assert all((flat[r] == -1).all() for r in range(flat.shape[0]) if r not in touched)


def test_empty_batch_and_no_new_tokens_write_nothing(rng):
    c = make_case(rng, "thd", 3, 2, 4, 4, np.float32, True, 4, 2)
    kc, vc = c["kc"].copy(), c["vc"].copy()
    nvte.copy_to_kv_cache(T(c["nk"]), T(c["nv"]), T(kc), T(vc), T(c["table"]), T(c["cu_new"]), T(c["cu_cached"]),
                          F.NVTE_THD, 0, 0, 8, 2, 0)
    assert np.array_equal(kc, c["kc"])
    zero = np.zeros(4, np.int32)
    nvte.copy_to_kv_cache(T(c["nk"][:0]), T(c["nv"][:0]), T(kc), T(vc), T(c["table"]), T(zero), T(zero),
                          F.NVTE_THD, 3, 0, 8, 2, 0)
    assert np.array_equal(kc, c["kc"]) and np.array_equal(vc, c["vc"])


def bad_call(c, fmt="bshd", b=3, **over):
    args = dict(nk=c["nk"], nv=c["nv"], kc=c["kc"].copy(), vc=c["vc"].copy(), table=c["table"], cu_new=c["cu_new"],
                cu_cached=c["cu_cached"], ctx=c["ctx"], max_seq_len=8, pps=2, non_paged=0)
    args.update(over)
    kc_before = args["kc"].copy()
    with pytest.raises(nvte.Error) as e:
        nvte.copy_to_kv_cache(T(args["nk"]), T(args["nv"]), T(args["kc"]), T(args["vc"]),
                              None if args["table"] is None else T(args["table"]), T(args["cu_new"]),
                              T(args["cu_cached"]), FMT[fmt], b, args["ctx"], args["max_seq_len"], args["pps"],
                              args["non_paged"])
    assert np.array_equal(args["kc"], kc_before)  # nothing written
    return str(e.value)


@pytest.mark.parametrize("case, expect", [
    (dict(cu_cached=np.array([0, 9, 10, 11], np.int32)), "would hold 9 tokens; the cache holds 8"),
    (dict(cu_cached=np.array([0, 0, 1, 2], np.int32)), "cached >= new"),
    (dict(table=np.array([[0, 1], [2, 99], [4, 5]], np.int32), cu_cached=np.array([0, 2, 8, 10], np.int32)),
     "sequence 1 position 5: its page id is outside [0, 9)"),
    (dict(table=None), "needs page_table"),
    (dict(table=np.zeros((3, 2), np.int64)), "page_table must be int32"),
    (dict(table=np.zeros((2, 2), np.int32)), "page_table must be int32 [>= b"),
    (dict(nv=np.zeros((3, 2, 2, 5), np.float32)), "new_v has shape"),
    (dict(nk=np.zeros((3, 2, 2, 4), np.float16)), "new_k has dtype"),
    (dict(cu_new=np.zeros(2, np.int32)), "cu_new_lens must be int32 [>= 4]"),
    (dict(max_seq_len=0), "max_seq_len >= 1"),
    (dict(pps=0), "max_pages_per_seq must be >= 1"),
])
def test_bad_input_raises_and_writes_nothing(rng, case, expect):
    c = make_case(rng, "bshd", 3, 2, 4, 4, np.float32, True, 4, 2, ctx=2)
    c["cu_new"] = np.array([0, 1, 2, 3], np.int32)
    c["cu_cached"] = np.array([0, 2, 4, 6], np.int32)
    c["table"] = np.array([[0, 1], [2, 3], [4, 5]], np.int32)
    assert expect in bad_call(c, **case)


def test_too_many_new_tokens_raises(rng):
    c = make_case(rng, "bshd", 3, 2, 4, 4, np.float32, True, 4, 2, ctx=2)
    c["cu_new"], c["cu_cached"] = np.array([0, 3, 3, 3], np.int32), np.array([0, 3, 3, 3], np.int32)
    c["table"] = np.array([[0, 1], [2, 3], [4, 5]], np.int32)
    assert "brings 3 new tokens; max_ctx_len is 2" in bad_call(c)


def test_non_paged_capacity_is_checked(rng):
    c = make_case(rng, "bshd", 3, 2, 4, 4, np.float32, False, 6, 1, ctx=2)
    assert "exceeds the non-paged caches' 6 rows" in bad_call(c, max_seq_len=7, non_paged=1, table=None)


def test_lengths_without_data_raise(rng):
    """A handle with a shape but no buffer (cu_cached_lens here) is rejected before anything is read."""
    c = make_case(rng, "bshd", 3, 2, 4, 4, np.float32, True, 4, 2, ctx=2)
    empty = nvte.Tensor()
    empty.set_param(nvte.Param.kRowwiseData, 0, [4], DT.kInt32)
    kc = c["kc"].copy()
    with pytest.raises(nvte.Error, match="cu_cached_lens rowwise data pointer is NULL"):
        nvte.copy_to_kv_cache(T(c["nk"]), T(c["nv"]), T(kc), T(c["vc"].copy()), T(c["table"]), T(c["cu_new"]), empty,
                              F.NVTE_BSHD, 3, c["ctx"], 8, 2, 0)
    assert np.array_equal(kc, c["kc"])


@pytest.mark.parametrize("which", ["new_k", "k_cache"])
def test_columnwise_only_handles_raise(rng, which):
    """A tensor given only as columnwise data (its logical shape right) is an error, not a null read
    (a segfault before)."""
    c = make_case(rng, "bshd", 3, 2, 4, 4, np.float32, True, 4, 2, ctx=2)
    args = {"new_k": c["nk"], "k_cache": c["kc"].copy()}
    args[which] = nvte.Tensor(None, columnwise_data=np.ascontiguousarray(np.moveaxis(args[which], -1, 0)))
    wrap = lambda a: a if isinstance(a, nvte.Tensor) else T(a)
    with pytest.raises(nvte.Error, match=f"{which} needs rowwise data"):
        nvte.copy_to_kv_cache(wrap(args["new_k"]), T(c["nv"]), wrap(args["k_cache"]), T(c["vc"].copy()), T(c["table"]),
                              T(c["cu_new"]), T(c["cu_cached"]), F.NVTE_BSHD, 3, c["ctx"], 8, 2, 0)



def test_caches_sharing_memory_are_refused(rng):
    """k_cache = v_cache (V rows overwrote K rows silently) and new tokens inside the cache written."""
    c = make_case(rng, "bshd", 3, 2, 4, 4, np.float32, True, 4, 2, ctx=2)
    c["cu_new"] = np.array([0, 1, 2, 3], np.int32)
    c["cu_cached"] = np.array([0, 2, 4, 6], np.int32)
    c["table"] = np.array([[0, 1], [2, 3], [4, 5]], np.int32)
    shared = c["kc"].copy()
    args = [T(c["nk"]), T(c["nv"]), T(shared), T(shared), T(c["table"]), T(c["cu_new"]), T(c["cu_cached"]),
            F.NVTE_BSHD, 3, 2, 8, 2, 0]
    before = shared.copy()
    with pytest.raises(nvte.Error, match="k_cache shares memory with v_cache"):
        nvte.copy_to_kv_cache(*args)
    assert np.array_equal(shared, before)
    kc = c["kc"].copy()
    nk_inside = kc.reshape(-1)[: c["nk"].size].reshape(c["nk"].shape)  # a view: new_k's rows in the cache
    args[0], args[2], args[3] = T(nk_inside), T(kc), T(c["vc"].copy())
    with pytest.raises(nvte.Error, match="k_cache shares memory with new_k"):
        nvte.copy_to_kv_cache(*args)
