"""TE's K/V-cache inference layouts on the CUDA backend, forward only, against the CPU backend and
float64 with the rule of test_fused_attn_gpu.py: paged K/V caches (NVTE_Paged_KV_*, cuDNN's paged
attention; BSHD, SBHD or THD queries) and THD queries over plain BSHD/SBHD K/V (thd_bshd_bshd,
thd_sbhd_sbhd).

Paged: K and V are caches of pages in a random order, read through separate page tables whose
unused entries are -1 (the CUDA backend clamps table entries into the cache). Cache slots and
K/V positions no sequence uses hold large finite values: cuDNN reads whole pages and tiles, so
its masking must keep them out (NaN there would also poison P V with 0 x NaN, which real caches
with stale data never hold). THD queries are packed without gaps."""
import pytest
import torch

from transformer_engine import _nvte as nvte

from attn_gpu_util import DTYPES, Case, compare_rows, handle, inputs, lengths, nv_dtype, reference, \
    scalars, zero_padding
from gpu_util import T

PAGED = ["NVTE_Paged_KV_BSHD_BSHD_BSHD", "NVTE_Paged_KV_BSHD_SBHD_SBHD", "NVTE_Paged_KV_SBHD_BSHD_BSHD",
         "NVTE_Paged_KV_SBHD_SBHD_SBHD"]
THD_Q = ["NVTE_THD_BSHD_BSHD", "NVTE_THD_SBHD_SBHD", "NVTE_Paged_KV_THD_BSHD_BSHD", "NVTE_Paged_KV_THD_SBHD_SBHD"]


def formats(layout):
    """(Q's format, K/V's format, paged) of a layout name."""
    paged = layout.startswith("NVTE_Paged_KV_")
    parts = layout[len("NVTE_Paged_KV_" if paged else "NVTE_"):].lower().split("_")
    return parts[0], parts[1], paged


def kv_inputs(c, k, v, page_size, spare, seed):
    """Paged layouts: paged_caches; otherwise K, V [b, skv, h, d] in the K/V format with large
    values past each sequence's length, and no tables."""
    _, kvf, paged = formats(c.layout)
    if paged:
        return paged_caches(c, k, v, page_size, spare, seed)
    g = torch.Generator().manual_seed(seed)
    _, _, lkv, _, _ = lengths(c)
    out = []
    for x in (k, v):
        y = x.clone()
        for bi in range(c.b):
            y[bi, lkv[bi]:] = 100.0 * torch.randn(y[bi, lkv[bi]:].shape, generator=g, dtype=torch.float64)
        out.append((y if kvf == "bshd" else y.transpose(0, 1).contiguous(), None))
    return out


def paged_caches(c, k, v, page_size, spare, seed):
    """K and V caches (the layout's K/V format) holding each sequence's keys at the pages its
    table names, and the int32 [b, pages] tables (entries no key uses: -1)."""
    g = torch.Generator().manual_seed(seed)
    _, kvf, _ = formats(c.layout)
    _, _, lkv, _, _ = lengths(c)
    per = -(-c.skv // page_size)
    n = c.b * per + spare
    out = []
    for x in (k, v):
        table = torch.randperm(n, generator=g)[:c.b * per].view(c.b, per).to(torch.int32)
        cache = 100.0 * torch.randn(n, page_size, x.shape[2], x.shape[3], generator=g, dtype=torch.float64)
        for bi in range(c.b):
            for j in range(lkv[bi]):
                cache[table[bi, j // page_size], j % page_size] = x[bi, j]
            table[bi, -(-lkv[bi] // page_size):] = -1
        out.append((cache if kvf == "bshd" else cache.transpose(0, 1).contiguous(), table))
    return out


def thd_offsets(c, gaps):
    """First token row of each THD query sequence (and the row count last): packed, or with
    gaps[b] unused rows after sequence b (cu_seqlens_q_padded)."""
    _, lq, _, _, _ = lengths(c)
    off = [0]
    for bi in range(c.b):
        off.append(off[-1] + lq[bi] + (gaps[bi] if gaps else 0))
    return off


def q_rows(c, q, qf, gaps=None):
    """Q in its format: [b, s, h, d], [s, b, h, d], or THD [t, h, d] (sequences packed, or at
    thd_offsets with large values in the gap rows)."""
    _, lq, _, _, _ = lengths(c)
    if qf == "thd":
        off = thd_offsets(c, gaps)
        rows = 100.0 * torch.randn(off[-1], c.hq, c.d, generator=torch.Generator().manual_seed(7), dtype=q.dtype)
        for bi in range(c.b):
            rows[off[bi]:off[bi] + lq[bi]] = q[bi, :lq[bi]]
        return rows
    return q if qf == "bshd" else q.transpose(0, 1)


def canon_o(c, o, qf, gaps=None):
    """O in its format -> canonical float64 [b, sq, h, dv] (THD: zeros past each length), and the
    THD gap rows (None without gaps)."""
    if qf != "thd":
        return (o if qf == "bshd" else o.transpose(0, 1)).double().cpu(), None
    _, lq, _, _, _ = lengths(c)
    off = thd_offsets(c, gaps)
    out = torch.zeros(c.b, c.sq, c.hq, c.dv, dtype=torch.float64)
    used = torch.zeros(o.shape[0], dtype=torch.bool)
    for bi in range(c.b):
        out[bi, :lq[bi]] = o[off[bi]:off[bi] + lq[bi]].double().cpu()
        used[off[bi]:off[bi] + lq[bi]] = True
    return out, (o.double().cpu()[~used] if gaps else None)


def run_paged(c, dev, q, kv_caches, training, gaps=None):
    """One forward on dev: canonical float64 O [b, sq, h, dv], (training) the statistics and
    (THD queries with gaps) O's gap rows."""
    nd, dt = nv_dtype(c), DTYPES[c.dtype]
    qf, _, _ = formats(c.layout)
    tq = q_rows(c, q, qf, gaps).to(dt).to(dev).contiguous()
    (kc, tk), (vc, tv) = kv_caches
    kk, vv = kc.to(dt).to(dev), vc.to(dt).to(dev)
    _, _, _, cuq, cukv = lengths(c)
    o = torch.full(tq.shape[:-1] + (c.dv,), float("nan"), dtype=dt, device=dev)
    H = [handle(x, nd) for x in (tq, kk, vv)]
    sc = scalars(c)
    ws = nvte.fused_attn_fwd_workspace_size(*H, None, c.sq, c.skv, training, False, 0.0, sc["qkv_layout"],
                                            sc["bias_type"], sc["attn_mask_type"], sc["softmax_type"])
    wsf = torch.empty(max(ws, 1), dtype=torch.uint8, device=dev)
    off = getattr(c, "offset", None) if c.softmax == "learnable" else None  # (attn_gpu_util.inputs draws it)
    off = T(off.float().view(1, c.hq, 1, 1).to(dev).contiguous()).t if off is not None else None
    kw = dict(Bias=None, SoftmaxOffset=off, S=None, cu_seqlens_q=T(cuq.to(dev)).t,
              cu_seqlens_kv=T(cukv.to(dev)).t,
              cu_seqlens_q_padded=T(torch.tensor(thd_offsets(c, gaps), dtype=torch.int32, device=dev)).t if gaps
              else None, cu_seqlens_kv_padded=None,
              page_table_k=T(tk.to(dev)).t if tk is not None else None,
              page_table_v=T(tv.to(dev)).t if tv is not None else None,
              rng_state=T(torch.tensor([1, 0], dtype=torch.int64, device=dev)).t, is_training=training,
              return_max_logit=False, cuda_graph=False, workspace=T(wsf).t, **sc)
    ot = handle(o, nd)
    stats = None
    if training:
        described = nvte.fused_attn_fwd(*H, O=ot, aux=[], **kw)
        bufs = [torch.full(shape, float("nan"), dtype=torch.float32, device=dev) if dtype == nvte.DType.kFloat32
                else torch.zeros(shape, dtype=torch.int64, device=dev) for shape, dtype in described]
        nvte.fused_attn_fwd(*H, O=ot, aux=[handle(b, dtype) for b, (_, dtype) in zip(bufs, described)], **kw)
        stats = bufs[0].cpu()
    else:
        nvte.fused_attn_fwd(*H, O=ot, aux=None, **kw)
    if dev == "cuda":
        torch.cuda.synchronize()
    o_canon, gap_rows = canon_o(c, o, qf, gaps)
    return o_canon, stats, gap_rows


def check_paged(c, page_size=16, spare=5, training=False, gaps=None):
    q, k, v, do, _ = inputs(c)
    caches = kv_inputs(c, k, v, page_size, spare, c.seed + 1)
    got, got_stats, got_gaps = run_paged(c, "cuda", q, caches, training, gaps)
    cpu, cpu_stats, cpu_gaps = run_paged(c, "cpu", q, caches, training, gaps)
    if gaps:
        assert (got_gaps == 0).all() and (cpu_gaps == 0).all(), "O rows between THD sequences are not zero"
    off = getattr(c, "offset", None)
    ref = zero_padding(c, reference(c, q, k, v, do, None, offset=off))["o"]
    naive = zero_padding(c, reference(c, q, k, v, do, None, DTYPES[c.dtype], "cuda", offset=off))["o"]
    assert not torch.isnan(got).any(), "NaN in the CUDA result (unwritten element, or a cache slot leaked in)"
    _, lq, _, _, _ = lengths(c)
    for bi in range(c.b):
        assert (got[bi, lq[bi]:] == 0).all(), f"padded query rows of sequence {bi} are not zero"
    err = (got - ref).abs().max().item()
    err_naive = (naive - ref).abs().max().item()
    err_cpu = (cpu - ref).abs().max().item()
    bound = 2.0 * err_naive + 1e-3 * ref.abs().max().item() + 1e-6
    assert err <= bound, f"CUDA error {err:.3g} > 2 x naive {err_naive:.3g} (+floor); CPU {err_cpu:.3g}"
    assert (got - cpu).abs().max().item() <= bound + err_cpu, "CUDA vs CPU backend beyond the bound"
    if training:
        compare_rows("statistics", got_stats, cpu_stats)


@pytest.mark.parametrize("layout", PAGED)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_paged_layouts(layout, dtype):
    check_paged(Case(layout=layout, dtype=dtype, b=3, sq=64, skv=200, hq=8, hkv=2, d=128,
                     mask="padding_causal_bottom_right", lens_q=[64, 17, 40], lens_kv=[200, 90, 41]), page_size=16)


@pytest.mark.parametrize("mask", ["padding", "padding_causal", "padding_causal_bottom_right"])
@pytest.mark.parametrize("page_size", [8, 64])
def test_paged_masks_and_page_sizes(mask, page_size):
    check_paged(Case(layout="NVTE_Paged_KV_BSHD_BSHD_BSHD", b=2, sq=48, skv=130, hq=4, hkv=4, d=64, mask=mask,
                     lens_q=[48, 20], lens_kv=[130, 77]), page_size=page_size)


def test_paged_decode_step():
    """One new token per sequence against caches of different lengths (the decode step)."""
    check_paged(Case(layout="NVTE_Paged_KV_BSHD_BSHD_BSHD", b=4, sq=1, skv=512, hq=8, hkv=1, d=128,
                     mask="padding_causal_bottom_right", lens_q=[1, 1, 1, 1], lens_kv=[512, 3, 129, 64]),
                page_size=32)


@pytest.mark.parametrize("layout", ["NVTE_THD_BSHD_BSHD", "NVTE_Paged_KV_THD_BSHD_BSHD", "NVTE_Paged_KV_BSHD_BSHD_BSHD"])
def test_decode_step_with_empty_sequences(layout):
    """max_seqlen_q 1 with sequences without queries (and one without keys): their O rows stay zero
    and no other sequence's row is touched (THD graphs take max_seqlen_q >= 2 for this)."""
    check_paged(Case(layout=layout, b=5, sq=1, skv=64, hq=4, hkv=2, d=64, mask="padding_causal_bottom_right",
                     lens_q=[1, 0, 1, 0, 1], lens_kv=[64, 7, 0, 0, 33]), page_size=16)


def test_paged_training_forward_statistics():
    check_paged(Case(layout="NVTE_Paged_KV_SBHD_BSHD_BSHD", b=2, sq=64, skv=128, hq=4, hkv=2, d=64,
                     mask="padding_causal", lens_q=[64, 30], lens_kv=[128, 50]), page_size=16, training=True)


@pytest.mark.parametrize("layout", THD_Q)
@pytest.mark.parametrize("mask", ["padding", "padding_causal_bottom_right"])
def test_thd_queries_over_kv_cache(layout, mask):
    """Chunked prefill: a few new tokens per sequence (one sequence without any) against caches of
    other lengths."""
    check_paged(Case(layout=layout, b=4, sq=32, skv=160, hq=8, hkv=2, d=128, mask=mask, lens_q=[32, 5, 0, 17],
                     lens_kv=[160, 5, 33, 100]), page_size=16)


@pytest.mark.parametrize("layout", ["NVTE_THD_BSHD_BSHD", "NVTE_Paged_KV_THD_BSHD_BSHD"])
def test_thd_queries_decode_many_runs(layout):
    """One long prefill and many one-token sequences: the THD graph's batch is 2 here (tokens /
    rounded max_seqlen_q), so the call runs the graph over the sequences in 5 runs."""
    lens_q = [64] + [1] * 9
    check_paged(Case(layout=layout, b=10, sq=64, skv=96, hq=4, hkv=4, d=64, mask="padding_causal_bottom_right",
                     lens_q=lens_q, lens_kv=[64] + [3 + 9 * i for i in range(9)]), page_size=8)


@pytest.mark.parametrize("layout", THD_Q)
def test_thd_decode_with_gaps_and_statistics(layout):
    """The decode step of THD queries (max_seqlen_q 1; the CUDA backend runs it as BSHD queries
    [n, 1], fused_attn_thd_decode.cpp): cu_seqlens_q_padded leaves gap rows, which must come out
    zero; sequences without a query or without keys; with paged caches also the training
    forward's statistics (THD queries over plain K/V are inference-only on the GPU)."""
    c = Case(layout=layout, b=6, sq=1, skv=96, hq=8, hkv=2, d=128, mask="padding_causal_bottom_right",
             lens_q=[1, 0, 1, 1, 0, 1], lens_kv=[96, 5, 0, 40, 0, 1])
    check_paged(c, page_size=16, training=layout.startswith("NVTE_Paged"), gaps=[2, 0, 1, 0, 3, 1])


def test_paged_thd_decode_runs_in_chunks():
    """Paged THD decode with more sequences than query rows: the graph's batch is 4 here (3 query
    rows rounded up to a power of two) and the call runs it over the 9 sequences in 3 runs, each
    with its own cu_seqlens and page-table rows; statistics included."""
    c = Case(layout="NVTE_Paged_KV_THD_BSHD_BSHD", b=9, sq=1, skv=64, hq=4, hkv=2, d=64,
             mask="padding_causal_bottom_right", lens_q=[1, 0, 0, 1, 0, 0, 0, 1, 0],
             lens_kv=[64, 3, 0, 17, 64, 1, 9, 40, 2])
    check_paged(c, page_size=8, training=True)


def test_paged_thd_training_forward_statistics():
    check_paged(Case(layout="NVTE_Paged_KV_THD_SBHD_SBHD", b=3, sq=32, skv=64, hq=4, hkv=2, d=64,
                     mask="padding_causal_bottom_right", lens_q=[32, 1, 9], lens_kv=[64, 20, 9]), page_size=16,
                training=True)


def test_paged_out_of_range_entry_is_clamped():
    """An entry naming no page reads a page of the cache (clamped), never memory outside it; the
    CPU backend reports it instead (tests/core/test_fused_attn.py)."""
    c = Case(layout="NVTE_Paged_KV_BSHD_BSHD_BSHD", b=2, sq=16, skv=64, hq=2, hkv=2, d=64, mask="padding",
             lens_q=[16, 16], lens_kv=[64, 64])
    q, k, v, _, _ = inputs(c)
    (kc, tk), vcache = paged_caches(c, k, v, 16, 0, 3)
    tk[1, 2] = 1 << 30
    tk[0, 1] = -5
    o, _, _ = run_paged(c, "cuda", q, [(kc, tk), vcache], False)
    assert torch.isfinite(o).all()


def test_paged_backend_query():
    args = dict(is_training=False, q_dtype=nvte.DType.kBFloat16, kv_dtype=nvte.DType.kBFloat16,
                bias_type=nvte.NVTE_Bias_Type.NVTE_NO_BIAS, softmax_type=nvte.NVTE_Softmax_Type.NVTE_VANILLA_SOFTMAX,
                attn_mask_type=nvte.NVTE_Mask_Type.NVTE_PADDING_CAUSAL_BOTTOM_RIGHT_MASK, dropout=0.0,
                num_attn_heads=8, num_gqa_groups=2, max_seqlen_q=1, max_seqlen_kv=512, head_dim_qk=128, head_dim_v=128)
    B = nvte.NVTE_Fused_Attn_Backend
    L = nvte.NVTE_QKV_Layout
    assert nvte.get_fused_attn_backend(qkv_layout=L.NVTE_Paged_KV_BSHD_BSHD_BSHD, **args) == B.NVTE_F16_arbitrary_seqlen
    assert nvte.get_fused_attn_backend(qkv_layout=L.NVTE_Paged_KV_THD_BSHD_BSHD, **args) == B.NVTE_F16_arbitrary_seqlen
    assert nvte.get_fused_attn_backend(qkv_layout=L.NVTE_THD_SBHD_SBHD, **args) == B.NVTE_F16_arbitrary_seqlen
    # THD queries over plain K/V: inference only on the GPU (their backward is not supported there)
    assert nvte.get_fused_attn_backend(qkv_layout=L.NVTE_THD_BSHD_BSHD, **dict(args, is_training=True)) == \
        B.NVTE_No_Backend
    assert "for inference only" in nvte.get_last_error()


@pytest.mark.parametrize("softmax", ["off-by-one", "learnable"])
@pytest.mark.parametrize("sq,lens_q", [(1, [1, 1, 0, 1]), (40, [40, 9, 0, 23])])
def test_paged_with_sink(softmax, sq, lens_q):
    """Off-by-one / learnable softmax over a paged cache (a decode step and a prefill): cuDNN's paged
    graphs take no sink token, so the vanilla graph's output is rescaled by each row's sink share
    (sink_rescale); a sequence without keys keeps zero rows."""
    check_paged(Case(layout="NVTE_Paged_KV_BSHD_BSHD_BSHD", b=4, sq=sq, skv=160, hq=8, hkv=2, d=128,
                     mask="padding_causal_bottom_right", lens_q=lens_q, lens_kv=[160, 33, 0, 97], softmax=softmax),
                page_size=16)


@pytest.mark.parametrize("layout", ["NVTE_Paged_KV_BSHD_BSHD_BSHD", "NVTE_THD_BSHD_BSHD", "NVTE_Paged_KV_THD_BSHD_BSHD"])
def test_kv_cache_window_needs_a_causal_mask(layout):
    """K/V-cache layouts (paged, THD queries over BSHD K/V) take a window on the GPU with a causal
    mask only (cuDNN's band was checked there with causal windows): the backend query says so, and
    the PyTorch adapter's K/V-cache path runs the others unfused."""
    A = nvte
    BK = A.NVTE_Fused_Attn_Backend
    bf16 = A.DType.kBFloat16
    args = dict(is_training=False, q_dtype=bf16, kv_dtype=bf16, qkv_layout=getattr(A.NVTE_QKV_Layout, layout),
                bias_type=A.NVTE_Bias_Type.NVTE_NO_BIAS, softmax_type=A.NVTE_Softmax_Type.NVTE_VANILLA_SOFTMAX,
                dropout=0.0, num_attn_heads=4, num_gqa_groups=4, max_seqlen_q=8, max_seqlen_kv=64, head_dim_qk=64,
                head_dim_v=64, window_size_left=4)
    M = A.NVTE_Mask_Type
    assert A.get_fused_attn_backend(attn_mask_type=M.NVTE_PADDING_CAUSAL_BOTTOM_RIGHT_MASK, window_size_right=0,
                                    **args) == BK.NVTE_F16_arbitrary_seqlen
    assert A.get_fused_attn_backend(attn_mask_type=M.NVTE_PADDING_MASK, window_size_right=-1,
                                    **args) == BK.NVTE_No_Backend
    assert "causal mask only" in A.get_last_error()
