"""nvte_copy_to_kv_cache on the CUDA backend vs the CPU backend on the same inputs, bit for bit:
BSHD / SBHD / THD, paged and non-paged caches (slot table or none), float32 / float16 /
bfloat16 / FP8, row sizes that allow 16-, 4-, 2- and 1-byte units, a misaligned cache view, a
decode-sized call (b=16, 8 heads x 128, pages of 64) and a prefill-sized one (2048 tokens per
sequence). On the GPU, rows whose target lies outside the cache (a bad page id, a length past the
capacity) are skipped while every other row is written; the CPU raises for them instead."""
import zlib

import pytest
import torch

from transformer_engine import _nvte as nvte

from gpu_util import T, sync

F = nvte.NVTE_QKV_Format
FMT = {"bshd": F.NVTE_BSHD, "sbhd": F.NVTE_SBHD, "thd": F.NVTE_THD}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "e4m3": torch.float8_e4m3fn}


def case(gen, fmt, b, h, dk, dv, dtype, paged, page_size, pps, table=True, ctx=None, full_last=True):
    """CPU tensors of one call (as tests/core/test_copy_to_kv_cache.py builds them, in torch)."""
    cap = page_size * pps if paged else page_size
    before = torch.randint(0, cap // 2 + 1, (b,), generator=gen)
    new = torch.minimum(torch.randint(0, 5, (b,), generator=gen), cap - before)
    new[0] = max(int(new[0]), 1)
    if full_last:
        before[-1] = cap - new[-1]
    cached = before + new
    ctx = int(new.max()) + 1 if ctx is None else ctx
    slots = b * pps + 3 if paged else b + 2
    if paged:
        tab = torch.randperm(slots, generator=gen)[:b * pps].view(b, pps).int()
    else:
        tab = torch.randperm(slots, generator=gen)[:b].view(b, 1).int() if table else None
    rnd = lambda *s: torch.randn(*s, generator=gen).to(dtype)
    shape = {"thd": (int(new.sum()) + 2,), "bshd": (b, ctx), "sbhd": (ctx, b)}[fmt]
    cu = lambda x: torch.cat([torch.zeros(1, dtype=torch.int64), x.cumsum(0)]).int()
    return dict(kc=rnd(slots, page_size, h, dk), vc=rnd(slots, page_size, h, dv), nk=rnd(*shape, h, dk),
                nv=rnd(*shape, h, dv), table=tab, cu_new=cu(new), cu_cached=cu(cached), ctx=ctx, cap=cap)


def call(c, device, fmt, b, paged, pps, kc=None, vc=None):
    """Runs the copy on `device`; returns (k_cache, v_cache) on the CPU."""
    dv = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in c.items()}
    kc = dv["kc"].clone() if kc is None else kc
    vc = dv["vc"].clone() if vc is None else vc
    nvte.copy_to_kv_cache(T(dv["nk"]).t, T(dv["nv"]).t, T(kc).t, T(vc).t,
                          None if dv["table"] is None else T(dv["table"]).t, T(dv["cu_new"]).t,
                          T(dv["cu_cached"]).t, FMT[fmt], b, dv["ctx"], dv["cap"], pps if paged else 1,
                          0 if paged else 1, stream=torch.cuda.current_stream().cuda_stream if device == "cuda" else 0)
    sync()
    return kc.cpu(), vc.cpu()


def same_bits(a, b):
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("fmt", ["bshd", "sbhd", "thd"])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("paged", [True, False])
@pytest.mark.parametrize("h, dk, dv", [(3, 5, 7), (2, 8, 8), (8, 128, 128), (1, 1, 3)])
def test_cuda_matches_cpu(fmt, dtype, paged, h, dk, dv):
    gen = torch.Generator().manual_seed(zlib.crc32(repr((fmt, dtype, paged, h, dk, dv)).encode()))
    page_size, pps = (4, 5) if paged else (13, 1)
    c = case(gen, fmt, 5, h, dk, dv, DTYPES[dtype], paged, page_size, pps)
    gk, gv = call(c, "cuda", fmt, 5, paged, pps)
    ck, cv = call(c, "cpu", fmt, 5, paged, pps)
    assert same_bits(gk, ck) and same_bits(gv, cv)
    assert not same_bits(gk, c["kc"])


@pytest.mark.parametrize("fmt", ["bshd", "thd"])
def test_non_paged_without_table(fmt):
    gen = torch.Generator().manual_seed(7)
    c = case(gen, fmt, 4, 2, 16, 16, torch.bfloat16, False, 9, 1, table=False)
    assert all(same_bits(g, r) for g, r in zip(call(c, "cuda", fmt, 4, False, 1), call(c, "cpu", fmt, 4, False, 1)))


def test_misaligned_cache_view_uses_narrow_units():
    """Caches that start 2 bytes into their allocation (bf16): the kernel must not use 16-byte units."""
    gen = torch.Generator().manual_seed(3)
    c = case(gen, "bshd", 3, 2, 8, 8, torch.bfloat16, True, 4, 2)
    out = []
    for device in ("cuda", "cpu"):
        kbig = torch.cat([torch.zeros(1, dtype=torch.bfloat16), c["kc"].reshape(-1)]).to(device)
        vbig = torch.cat([torch.zeros(1, dtype=torch.bfloat16), c["vc"].reshape(-1)]).to(device)
        kc, vc = kbig[1:].view(c["kc"].shape), vbig[1:].view(c["vc"].shape)
        out.append(call(c, device, "bshd", 3, True, 2, kc=kc, vc=vc))
    assert same_bits(out[0][0], out[1][0]) and same_bits(out[0][1], out[1][1])


@pytest.mark.parametrize("fmt, paged, b, new_max, ctx_len", [("bshd", True, 16, 1, 2048), ("thd", False, 16, 1, 2048),
                                                              ("bshd", True, 2, 2048, 0), ("sbhd", False, 2, 2048, 0)])
def test_decode_and_prefill_sizes(fmt, paged, b, new_max, ctx_len):
    """A decode step over caches holding 2048 tokens, and a 2048-token prefill into empty caches."""
    gen = torch.Generator().manual_seed(11)
    h, d, page = 8, 128, 64
    cap = 2048 + 64
    pps = cap // page if paged else 1
    new = torch.full((b,), new_max)
    cached = new + ctx_len
    slots = b * pps if paged else b
    tab = torch.randperm(slots, generator=gen).view(b, pps).int() if paged else None
    shape = {"thd": (int(new.sum()),), "bshd": (b, new_max), "sbhd": (new_max, b)}[fmt]
    cu = lambda x: torch.cat([torch.zeros(1, dtype=torch.int64), x.cumsum(0)]).int()
    ps = page if paged else cap
    c = dict(kc=torch.randn(slots, ps, h, d, generator=gen).bfloat16(), vc=torch.randn(slots, ps, h, d).bfloat16(),
             nk=torch.randn(*shape, h, d, generator=gen).bfloat16(), nv=torch.randn(*shape, h, d).bfloat16(),
             table=tab, cu_new=cu(new), cu_cached=cu(cached), ctx=new_max, cap=cap)
    assert all(same_bits(g, r) for g, r in zip(call(c, "cuda", fmt, b, paged, pps), call(c, "cpu", fmt, b, paged, pps)))


def test_targets_outside_the_cache_are_skipped_on_the_gpu():
    gen = torch.Generator().manual_seed(5)
    c = case(gen, "bshd", 3, 2, 4, 4, torch.float32, True, 4, 2, ctx=2, full_last=False)
    c["cu_new"] = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    c["cu_cached"] = torch.tensor([0, 2, 8, 17], dtype=torch.int32)  # sequence 2: 9 tokens > capacity 8
    c["table"] = torch.tensor([[0, 1], [2, 99], [4, 5]], dtype=torch.int32)  # sequence 1 position 5: page 99
    with pytest.raises(nvte.Error, match="sequence 1 position 5"):
        call(c, "cpu", "bshd", 3, True, 2)
    gk, gv = call(c, "cuda", "bshd", 3, True, 2)
    want_k = c["kc"].clone().view(-1, 2, 4)
    want_v = c["vc"].clone().view(-1, 2, 4)
    want_k[0 * 4 + 1], want_v[0 * 4 + 1] = c["nk"][0, 0], c["nv"][0, 0]  # sequence 0 position 1: page 0 slot 1
    assert torch.equal(gk.view(-1, 2, 4), want_k) and torch.equal(gv.view(-1, 2, 4), want_v)
