"""K/V-cache inference: InferenceParams + DotProductAttention / TransformerLayer with
inference_params (inference.py, kv_cache_attention.py).

A scripted run of iterations (prompts, decode steps, a sequence finishing, one joining in the
middle of the batch, so the non-paged cache's slots go out of order) feeds each iteration's new
tokens in bshd / sbhd / thd, with a non-paged or a paged cache; every output row is checked
against float64 attention of that row over the sequence's whole history (bottom-right causal or
none, optionally a sliding window), and bshd/sbhd padding rows must be exactly zero. On the CPU
the library's reference backend runs float32 inputs (rel_err < 2e-5); with NVTE_TEST_DEVICE=cuda
cuDNN runs bfloat16 ones under flash-attention's rule (max error <= 2x that of a naive bfloat16
torch attention on the device), as in test_attention_thd.py, at head size 64."""
import copy
import math
from collections import OrderedDict

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.pytorch import fused_attention as fa, kv_cache_attention
from transformer_engine.pytorch.inference import InferenceParams, NonPagedKVCacheManager

from _util import DEVICE, ON_CUDA, rel_err

DT = torch.bfloat16 if ON_CUDA else torch.float32
H, G = 4, 2
D = 64 if ON_CUDA else 8
TOL = 2e-5
# iterations: {seq_id: new tokens}; seq 1 finishes after iteration 2, seq 3 joins in iteration 4
SCRIPT = [{0: 5, 1: 3, 2: 7}, {0: 1, 1: 1, 2: 1}, {0: 1, 2: 2}, {2: 1, 3: 4, 0: 1}, {2: 1, 3: 1, 0: 1}]
MAX_SEQLEN = 16


def history(seed, n=24):
    """Per sequence id: float64 Q [n, H, D], K, V [n, G, D], rounded to DT (what the call sees)."""
    g = torch.Generator().manual_seed(seed)
    mk = lambda heads: torch.randn(n, heads, D, generator=g, dtype=torch.float64).to(DT).double()  # noqa: E731
    return {s: (mk(H), mk(G), mk(G)) for s in range(4)}


def visible(pos, n, total, causal, window):
    """bool [n, total]: keys row r (absolute position pos + r) sees."""
    i = torch.arange(pos, pos + n)[:, None]
    j = torch.arange(total)[None, :]
    ok = torch.ones(n, total, dtype=torch.bool)
    if causal:
        ok &= j <= i
    if window is not None:
        if window[0] >= 0:
            ok &= j >= i - window[0]
        if window[1] >= 0:
            ok &= j <= i + window[1]
    return ok


def attention(q, k, v, ok, dtype=None, bias=None):
    """Rows of softmax(q k^T / sqrt(D)) v over visible keys (GQA: K/V heads repeated); in float64,
    or naively in dtype on the device (the yardstick of flash-attention's rule)."""
    if dtype is not None:
        q, k, v, ok = (t.to(DEVICE) for t in (q, k, v, ok))
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    k, v = k.repeat_interleave(H // G, 1), v.repeat_interleave(H // G, 1)
    s = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(D)
    if bias is not None:  # [H, n, total], float64 (ALiBi)
        s = s + (bias.to(s.device) if dtype is None else bias.to(s.device).float()).to(s.dtype)
    p = torch.softmax(s.masked_fill(~ok, -math.inf).float() if dtype is not None else
                      s.masked_fill(~ok, -math.inf), -1)
    p = torch.nan_to_num(p, 0.0).to(q.dtype)
    return torch.einsum("hqk,khd->qhd", p, v).double().cpu()


def pack(parts, fmt, s):
    """The iteration's new rows of every sequence (list of [n, heads, D]) in fmt; bshd/sbhd padded to s."""
    if fmt == "thd":
        return torch.cat(parts).to(DT).to(DEVICE)
    x = torch.zeros(len(parts), s, parts[0].shape[1], D, dtype=torch.float64)
    for i, p in enumerate(parts):
        x[i, :p.shape[0]] = p
    x = x if fmt == "bshd" else x.transpose(0, 1)
    return x.contiguous().to(DT).to(DEVICE)


def rows_of(out, fmt, step):
    """Per sequence: (its output rows [n, H, D], its padding rows or None)."""
    res, t = [], 0
    o = out.view(*out.shape[:-1], H, D)
    for i, n in enumerate(step.values()):
        if fmt == "thd":
            res.append((o[t:t + n], None))
            t += n
        else:
            x = o[i] if fmt == "bshd" else o[:, i]
            res.append((x[:n], x[n:]))
    return res


def make_params(paged, fmt, page_size=None):
    if paged:
        return InferenceParams(4, MAX_SEQLEN, G, D, DT, is_paged=True, page_size=page_size or 4,
                               total_num_pages=4 * MAX_SEQLEN // (page_size or 4), qkv_format=fmt)
    return InferenceParams(4, MAX_SEQLEN, G, D, DT, qkv_format=fmt)


def alibi_rows(slopes, p0, n, total):
    """float64 [H, n, total]: ALiBi of rows at absolute positions p0.. over keys 0..total-1."""
    i = torch.arange(p0, p0 + n, dtype=torch.float64).view(n, 1)
    j = torch.arange(total, dtype=torch.float64).view(1, total)
    return -slopes.double().view(H, 1, 1) * (i - j).abs()


def run_script(fmt, paged, mask, window=None, seed=0, params=None, alibi=None):
    """alibi: None, or float64 slopes [H] to check against (passed to the call unless alibi_default)."""
    hist = history(seed)
    dpa = te.DotProductAttention(H, D, num_gqa_groups=G, qkv_format=fmt, attn_mask_type=mask,
                                 window_size=window, layer_number=3)
    akw = {}
    if alibi is not None:
        akw = dict(core_attention_bias_type="alibi", alibi_slopes=None if alibi[1] else alibi[0].float().to(DEVICE))
    params = params if params is not None else make_params(paged, fmt)
    pos = {}
    for it, step in enumerate(SCRIPT):
        step = OrderedDict(step)
        for sid in list(pos):
            if sid not in step:
                del pos[sid]
        params.pre_step(step)
        s = max(step.values()) + (1 if fmt != "thd" and it == 0 else 0)  # a padding row in the first bshd/sbhd call
        new = {sid: [x[pos.get(sid, 0):pos.get(sid, 0) + n] for x in hist[sid]] for sid, n in step.items()}
        q, k, v = (pack([new[sid][c] for sid in step], fmt, s) for c in range(3))
        with torch.no_grad():
            out = dpa(q, k, v, inference_params=params, **akw)
        assert out.shape == q.shape[:-2] + (H * D,) and out.dtype == DT
        for (sid, n), (got, pad) in zip(step.items(), rows_of(out, fmt, step)):
            p0 = pos.get(sid, 0)
            total = p0 + n
            ok = visible(p0, n, total, "causal" in mask, window)
            qh, kh, vh = hist[sid]
            ab = alibi_rows(alibi[0], p0, n, total) if alibi is not None else None
            ref = attention(qh[p0:total], kh[:total], vh[:total], ok, bias=ab)
            what = f"iteration {it} sequence {sid}"
            if ON_CUDA:
                naive = attention(qh[p0:total], kh[:total], vh[:total], ok, DT, bias=ab)
                e, e_naive = float((got.double().cpu() - ref).abs().max()), float((naive - ref).abs().max())
                assert e <= 2.0 * e_naive, (what, e, e_naive)
            else:
                assert rel_err(got, ref) < TOL, (what, rel_err(got, ref))
            if pad is not None and pad.numel():
                assert torch.count_nonzero(pad) == 0, f"{what}: padding rows not zero"
            pos[sid] = total
    return params


@pytest.mark.parametrize("paged", [False, True], ids=["nonpaged", "paged"])
@pytest.mark.parametrize("fmt", ["bshd", "sbhd", "thd"])
@pytest.mark.parametrize("mask", ["padding_causal", "causal", "no_mask"])
def test_dpa_kv_cache_matches_full_history(fmt, paged, mask):
    params = run_script(fmt, paged, mask)
    assert list(params.sequences.items()) == [(2, 12), (3, 5), (0, 9)]
    assert params.cu_seqlens_q.tolist() == [0, 1, 2, 3] and params.cu_seqlens_kv.tolist() == [0, 12, 17, 26]
    assert params.get_seqlens_pre_step().tolist() == [11, 4, 8]


def test_dpa_kv_cache_sliding_window():
    """Windows are aligned to the bottom-right diagonal like the causal mask (on the GPU: cuDNN's
    band with the bottom-right causal mask, paged and THD caches)."""
    run_script("bshd", True, "padding_causal", window=(3, 0))
    run_script("thd", False, "causal", window=(2, 0), seed=1)


@pytest.mark.parametrize("fmt,paged,mask,window", [("bshd", False, "causal", None), ("sbhd", True, "no_mask", None),
                                                   ("thd", True, "causal", None), ("thd", False, "no_mask", (4, 1))])
def test_dpa_kv_cache_unfused_path(monkeypatch, fmt, paged, mask, window):
    """NVTE_FUSED_ATTN=0: the cache read back into dense K/V, matmuls and the library's masked softmax."""
    monkeypatch.setenv("NVTE_FUSED_ATTN", "0")
    calls = []
    real = kv_cache_attention._unfused
    monkeypatch.setattr(kv_cache_attention, "_unfused", lambda *a, **k: calls.append(1) or real(*a, **k))
    run_script(fmt, paged, mask, window=window, seed=2)
    assert len(calls) == len(SCRIPT)


def test_nonpaged_slots_reused_without_moving():
    """Seq 3 takes the slot seq 1 freed (slot 1) and the batch order is 2, 3, 0: the manager hands the
    whole cache with a [b, 1] table of slots, and earlier sequences' keys stay where they were."""
    params = make_params(False, "bshd")
    m = params.cache_manager
    assert isinstance(m, NonPagedKVCacheManager)
    run_script("bshd", False, "causal", params=params)
    assert [m.allocated_pages[s] for s in (2, 3, 0)] == [[2], [1], [0]]
    assert params.cache_manager.page_table[:3, 0].tolist() == [2, 1, 0]


def test_paged_pages_freed_and_reused():
    params = make_params(True, "thd", page_size=4)
    run_script("thd", True, "causal", params=params)
    m = params.cache_manager
    used = sorted(p for s in m.sequences for p in m.allocated_pages[s])
    assert len(used) == len(set(used)) == sum(-(-n // 4) for n in m.sequences.values())
    assert sorted(used + m.free_pages) == list(range(m.total_num_pages))


def test_sizes_from_the_first_keys():
    """num_heads_kv, head_dim_k and dtype left out: the first step() sizes the caches."""
    params = InferenceParams(4, MAX_SEQLEN)
    assert params.cache_manager is None
    run_script("sbhd", False, "causal", params=params)
    assert (params.num_heads_kv, params.head_dim_k, params.dtype) == (G, D, DT)
    with pytest.raises(ValueError, match="allocate_memory needs"):
        InferenceParams(2, 8).allocate_memory(1)
    lazy = InferenceParams(2, 8)
    lazy.pre_step(OrderedDict({0: 2}))
    with pytest.raises(RuntimeError, match="stored no keys"):
        lazy.pre_step(OrderedDict({0: 1}))


HID = 256 if ON_CUDA else 32  # TransformerLayer hidden size (4 heads: head size 64 on CUDA)


def transformer_layer(fmt, fuse_qkv=True):
    torch.manual_seed(7)
    layer = te.TransformerLayer(HID, 2 * HID, 4, num_gqa_groups=2, layer_number=1, hidden_dropout=0.0,
                                attention_dropout=0.0, self_attn_mask_type="causal", attn_input_format=fmt,
                                fuse_qkv_params=fuse_qkv, params_dtype=torch.float32, device="cpu")
    return layer.eval()


@pytest.mark.parametrize("fmt,fuse_qkv", [("bshd", True), ("sbhd", True), ("bshd", False)])
def test_transformer_layer_generation_matches_full_forward(fmt, fuse_qkv):
    """Prompt then 4 decode steps through a TransformerLayer with a cache give the rows of one
    causal forward over the whole sequences (2 sequences, prompts of 5 and 3 tokens, equal length
    padding-free runs per sequence). CPU float32: rel_err < 2e-5 per step. CUDA bfloat16: each
    step's error against the float32 CPU layer is at most 2x that of the full bfloat16 forward."""
    layer = transformer_layer(fmt, fuse_qkv)
    x = torch.randn(2, 9, HID, generator=torch.Generator().manual_seed(3))
    bf = lambda t: t if fmt == "bshd" else t.transpose(0, 1)  # noqa: E731  (bshd <-> the layer's format)
    with torch.no_grad():
        refs = [bf(layer(bf(x[i:i + 1])))[0].double() for i in range(2)]  # per sequence, float32 CPU
        dev_layer = layer.to(DEVICE).to(DT) if ON_CUDA else layer
        fulls = [bf(dev_layer(bf(x[i:i + 1].to(DEVICE, DT))))[0].double().cpu() for i in range(2)]
        params = InferenceParams(2, 16, 2, HID // 4, DT, qkv_format=fmt)
        prompt = [5, 3]
        steps = [OrderedDict({0: 5, 1: 3})] + [OrderedDict({0: 1, 1: 1})] * 4
        pos = [0, 0]
        for step in steps:
            params.pre_step(step)
            s = max(step.values())
            inp = torch.zeros(2, s, HID)
            for i, n in enumerate(step.values()):
                inp[i, :n] = x[i, pos[i]:pos[i] + n]
            out = bf(dev_layer(bf(inp.to(DEVICE, DT)), inference_params=params)).double().cpu()
            for i, n in enumerate(step.values()):
                got, ref, full = out[i, :n], refs[i][pos[i]:pos[i] + n], fulls[i][pos[i]:pos[i] + n]
                if ON_CUDA:
                    assert float((got - ref).abs().max()) <= 2.0 * float((full - ref).abs().max()), (i, pos[i])
                else:
                    assert rel_err(got, ref) < TOL, (i, pos[i], rel_err(got, ref))
                pos[i] += n
    assert pos == [p + 4 for p in prompt]


def test_generation_under_fp8_mha_recipe():
    """Under fp8_autocast with fp8_mha (and so fp8_dpa) the projections run FP8 and the cached
    attention stays in the inputs' precision: the same steps as without fp8_mha/fp8_dpa, bit for bit."""
    from transformer_engine.common.recipe import DelayedScaling, Format
    base = transformer_layer("bshd").to(DEVICE).to(DT)
    x = torch.randn(2, 4, HID, generator=torch.Generator().manual_seed(5)).to(DEVICE, DT)
    outs = []
    for flags in (dict(fp8_mha=True, fp8_dpa=True), {}):
        layer = copy.deepcopy(base)  # (each run starts from the same FP8 state)
        params = InferenceParams(2, 8, 2, HID // 4, DT)
        res = []
        with torch.no_grad(), te.fp8_autocast(enabled=True, fp8_recipe=DelayedScaling(fp8_format=Format.HYBRID,
                                                                                       **flags)):
            for step, rows in ((OrderedDict({0: 3, 1: 3}), slice(0, 3)), (OrderedDict({0: 1, 1: 1}), slice(3, 4))):
                params.pre_step(step)
                res.append(layer(x[:, rows], inference_params=params))
        outs.append(res)
    for a, b in zip(*outs):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_public_names():
    assert te.InferenceParams is InferenceParams and te.attention.InferenceParams is InferenceParams


def test_errors(monkeypatch):
    dpa = te.DotProductAttention(H, D, num_gqa_groups=G, qkv_format="bshd", layer_number=1)
    q = torch.zeros(2, 1, H, D, dtype=DT, device=DEVICE)
    k = torch.zeros(2, 1, G, D, dtype=DT, device=DEVICE)
    params = InferenceParams(2, 4, G, D, DT)
    with torch.no_grad():
        with pytest.raises(RuntimeError, match="call pre_step"):
            dpa(q, k, k, inference_params=params)
        with pytest.raises(ValueError, match="more than max_batch_size"):
            params.pre_step(OrderedDict({0: 1, 1: 1, 2: 1}))
        with pytest.raises(ValueError, match="integer >= 1"):
            params.pre_step(OrderedDict({0: 0}))
        with pytest.raises(ValueError, match="more than max_seqlen_kv=4"):
            params.pre_step(OrderedDict({0: 5}))
        params.pre_step(OrderedDict({0: 1, 1: 1}))
        with pytest.raises(ValueError, match="need batch 2"):
            dpa(q[:1], k[:1], k[:1], inference_params=params)
        with pytest.raises(NotImplementedError, match="bias tensor"):
            dpa(q, k, k, inference_params=params, core_attention_bias_type="post_scale_bias",
                core_attention_bias=torch.zeros(1, H, 1, 1, dtype=DT, device=DEVICE))
        with pytest.raises(ValueError, match="arbitrary"):
            dpa(q, k, k, inference_params=params, attn_mask_type="arbitrary")
        monkeypatch.setenv("NVTE_FUSED_ATTN", "0")
        monkeypatch.setenv("NVTE_UNFUSED_ATTN", "0")
        with pytest.raises(NotImplementedError, match="NVTE_FUSED_ATTN=0.*NVTE_UNFUSED_ATTN=0"):
            dpa(q, k, k, inference_params=params)
        monkeypatch.delenv("NVTE_FUSED_ATTN")
        monkeypatch.delenv("NVTE_UNFUSED_ATTN")
        with pytest.raises(ValueError, match="must match the cache"):
            dpa(q.float() if DT != torch.float32 else q.double(), k.float() if DT != torch.float32 else k.double(),
                k.float() if DT != torch.float32 else k.double(), inference_params=params)
    paged = InferenceParams(4, 8, G, D, DT, is_paged=True, page_size=4, total_num_pages=3)
    paged.pre_step(OrderedDict({0: 5}))  # 2 of the 3 pages
    with pytest.raises(RuntimeError, match="cache is full"):
        paged.pre_step(OrderedDict({0: 1, 1: 5}))  # seq 1 needs 2 more pages, 1 is free
    assert paged.cache_manager.sequences == OrderedDict({0: 5}) and paged.step_dict == OrderedDict({0: 5})
    assert paged.cu_seqlens_kv.tolist() == [0, 5]  # (the failed step changed nothing)
    paged.pre_step(OrderedDict({1: 5}))  # seq 0 finished: its pages serve seq 1
    with pytest.raises(ValueError, match="page_size"):
        InferenceParams(2, 8, G, D, DT, is_paged=True)
    with pytest.raises(ValueError, match="qkv_format"):
        InferenceParams(2, 8, G, D, DT, qkv_format="bhsd")


@pytest.mark.skipif(not ON_CUDA, reason="CUDA graphs need a CUDA device (NVTE_TEST_DEVICE=cuda)")
@pytest.mark.parametrize("paged", [False, True], ids=["nonpaged", "paged"])
def test_decode_step_replays_as_a_cuda_graph(paged):
    """A decode step captured once as a CUDA graph and replayed after each pre_step: the cache's
    index and length buffers are persistent, so each replay writes the new token where this step's
    pre_step put it and attends over the updated lengths (results as the float64 reference)."""
    hist = history(4)
    dpa = te.DotProductAttention(H, D, num_gqa_groups=G, qkv_format="bshd", attn_mask_type="padding_causal",
                                 layer_number=1)
    params = make_params(paged, "bshd")
    prompt = {0: 5, 1: 3, 2: 7}
    params.pre_step(OrderedDict(prompt))
    with torch.no_grad():
        dpa(*(pack([hist[sid][c][:n] for sid, n in prompt.items()], "bshd", 7) for c in range(3)),
            inference_params=params)
    pos = dict(prompt)
    static = [torch.zeros(3, 1, n, D, dtype=DT, device=DEVICE) for n in (H, G, G)]
    graph, out = torch.cuda.CUDAGraph(), None
    for step in range(4):
        params.pre_step(OrderedDict((sid, 1) for sid in prompt))
        for c in range(3):
            static[c].copy_(pack([hist[sid][c][pos[sid]:pos[sid] + 1] for sid in prompt], "bshd", 1))
        with torch.no_grad():
            if step == 0:  # warm up (builds the cuDNN graph), capture, then run the step by replaying
                dpa(*static, inference_params=params)
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side), torch.cuda.graph(graph, stream=side):
                    out = dpa(*static, inference_params=params)
                torch.cuda.current_stream().wait_stream(side)
            graph.replay()
        torch.cuda.synchronize()
        for i, sid in enumerate(prompt):
            total = pos[sid] + 1
            qh, kh, vh = hist[sid]
            ok = visible(pos[sid], 1, total, True, None)
            ref = attention(qh[pos[sid]:total], kh[:total], vh[:total], ok)
            naive = attention(qh[pos[sid]:total], kh[:total], vh[:total], ok, DT)
            got = out.view(3, 1, H, D)[i]
            e, e_naive = float((got.double().cpu() - ref).abs().max()), float((naive - ref).abs().max())
            assert e <= 2.0 * e_naive, (step, sid, e, e_naive)
            pos[sid] = total


@pytest.mark.parametrize("paged", [False, True], ids=["nonpaged", "paged"])
def test_convert_paged_to_nonpaged(paged):
    """TE's InferenceParams.convert_paged_to_nonpaged: each sequence's cached keys / values in order
    (bshd, sbhd, thd packed by cu_seqlens_kv), after the scripted run left sequences out of slot order."""
    params = run_script("bshd", paged, "padding_causal", params=make_params(paged, "bshd", page_size=3))
    hist = history(0)
    lens = dict(params.sequences)
    k, v = params.convert_paged_to_nonpaged(3)
    ks, vs = params.convert_paged_to_nonpaged(3, "sbhd")
    kt, vt = params.convert_paged_to_nonpaged(3, "thd")
    assert k.shape[0] == len(lens) and ks.shape[1] == len(lens) and kt.shape[0] == sum(lens.values())
    t = 0
    for i, (sid, n) in enumerate(lens.items()):
        for got, got_s, got_t, want in ((k, ks, kt, hist[sid][1]), (v, vs, vt, hist[sid][2])):
            w = want[:n].to(DT)
            assert torch.equal(got[i, :n].cpu(), w) and torch.equal(got_s[:n, i].cpu(), w)
            assert torch.equal(got_t[t:t + n].cpu(), w)
        t += n
    with pytest.raises(ValueError, match="no cache"):
        params.convert_paged_to_nonpaged(99)


def test_custom_cache_manager_keyword_and_two_value_step():
    """TE's keyword custom_cache_manager; a manager whose step() returns (k_cache, v_cache) serves
    them as non-paged caches."""
    class TwoValues(NonPagedKVCacheManager):
        def step(self, *args):
            k, v, table = super().step(*args)
            assert table is None  # (in slot order throughout this run)
            return k, v

    params = InferenceParams(4, MAX_SEQLEN, G, D, DT, qkv_format="bshd", custom_cache_manager=TwoValues)
    assert isinstance(params.cache_manager, TwoValues)
    dpa = te.DotProductAttention(H, D, num_gqa_groups=G, qkv_format="bshd", attn_mask_type="padding_causal",
                                 layer_number=1)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 5, n, D, generator=g).to(DT).to(DEVICE) for n in (H, G, G))
    params.pre_step(OrderedDict([(0, 5), (1, 5)]))
    with torch.no_grad():
        out = dpa(q, k, v, inference_params=params)
    ref = te.DotProductAttention(H, D, num_gqa_groups=G, qkv_format="bshd", attn_mask_type="causal")(q, k, v)
    assert rel_err(out, ref) < (2e-2 if ON_CUDA else TOL)
    with pytest.raises(ValueError, match="not both"):
        InferenceParams(4, MAX_SEQLEN, G, D, DT, cache_manager=TwoValues, custom_cache_manager=TwoValues)


@pytest.mark.parametrize("slopes", ["default", "given"])
@pytest.mark.parametrize("paged", [False, True], ids=["nonpaged", "paged"])
@pytest.mark.parametrize("fmt", ["bshd", "thd"])
@pytest.mark.parametrize("mask", ["padding_causal", "no_mask"])
def test_dpa_kv_cache_alibi(fmt, paged, mask, slopes):
    """ALiBi over a K/V cache (the unfused path): each new row's term is -slope * |its position in
    the sequence - the key's|, with TE's default slopes or given ones."""
    if slopes == "default":  # TE's default for 4 heads: 2^-2, 2^-4, 2^-6, 2^-8
        run_script(fmt, paged, mask, alibi=(2.0 ** (-8.0 / H * torch.arange(1, H + 1, dtype=torch.float64)), True))
    else:
        run_script(fmt, paged, mask, alibi=(torch.tensor([0.5, 0.3, 0.2, 0.05], dtype=torch.float64), False))


def test_paged_cache_page_size_not_a_power_of_two(monkeypatch):
    """cuDNN's paged attention takes power-of-two page sizes only: on the GPU a cache of 3-token pages
    runs the unfused path (the library's workspace query says why), on the CPU the fused reference;
    both give the scripted run's results."""
    calls = []
    real = kv_cache_attention._unfused
    monkeypatch.setattr(kv_cache_attention, "_unfused", lambda *a, **k: calls.append(1) or real(*a, **k))
    run_script("bshd", True, "padding_causal", params=make_params(True, "bshd", page_size=3))
    assert (len(calls) > 0) == ON_CUDA, len(calls)
    if ON_CUDA:
        q = torch.zeros(2, 1, H, D, dtype=DT, device=DEVICE)
        k_cache = torch.zeros(8, 3, G, D, dtype=DT, device=DEVICE)
        ok, why = fa.fused_backend_supports(q, k_cache, k_cache, kv_cache_attention.LAYOUTS["bshd", True],
                                            fa.BIAS_INT["no_bias"], fa.MASK_INT["padding_causal_bottom_right"],
                                            0.0, False, 1, 12, -1, -1, br=True)
        assert not ok and "powers of two" in why, why


def test_generation_with_autograd_on_runs_and_refuses_backward():
    """TE's own K/V-cache tests call eval() modules without no_grad: the steps give what they give
    under no_grad, and a backward through them raises."""
    torch.manual_seed(4)
    layer = te.TransformerLayer(HID, 2 * HID, 4, num_gqa_groups=2, hidden_dropout=0.0, attention_dropout=0.0,
                                layer_number=1, self_attn_mask_type="padding_causal", attn_input_format="bshd",
                                params_dtype=DT, device=DEVICE).eval()
    x = torch.randn(2, 4, HID, generator=torch.Generator().manual_seed(5)).to(DEVICE, DT)
    outs = []
    for grad in (False, True):
        params = InferenceParams(2, 16, 2, HID // 4, DT, qkv_format="bshd")
        with torch.set_grad_enabled(grad):
            params.pre_step(OrderedDict({0: 4, 1: 2}))
            outs.append(layer(x, inference_params=params))
            params.pre_step(OrderedDict({0: 1, 1: 1}))
            outs.append(layer(x[:, :1], inference_params=params))
    for a, b in zip(outs[:2], outs[2:]):
        assert not a.requires_grad and b.requires_grad
        assert torch.equal(a, b.detach())
    with pytest.raises(RuntimeError, match="forward only"):
        outs[-1].sum().backward()


@pytest.mark.parametrize("fused", [False, True])
def test_rope_table_of_the_cache_length_with_a_padded_step(fused, monkeypatch):
    """RoPE with a table of exactly max_sequence_length positions: a sequence decoding its last
    token beside a new 4-token prompt (bshd) pads its step with rows past the table's end. The real
    rows must equal each sequence's own causal forward with the same table."""
    monkeypatch.setenv("NVTE_FUSED_ATTN", "1" if fused else "0")
    torch.manual_seed(6)
    mha = te.MultiheadAttention(HID, 4, attention_dropout=0.0, attn_mask_type="causal", qkv_format="bshd",
                                layer_number=1, params_dtype=torch.float32, device=DEVICE).eval()
    freqs = te.attention.RotaryPositionEmbedding(HID // 4)(16).to(DEVICE)
    a, b = (torch.randn(1, n, HID, generator=torch.Generator().manual_seed(n)).to(DEVICE) for n in (16, 4))
    params = InferenceParams(2, 16, 4, HID // 4, torch.float32, qkv_format="bshd")
    with torch.no_grad():
        params.pre_step(OrderedDict({0: 15}))
        mha(a[:, :15], inference_params=params, rotary_pos_emb=freqs)
        params.pre_step(OrderedDict({0: 1, 1: 4}))
        step = torch.zeros(2, 4, HID, device=DEVICE)
        step[0, :1], step[1] = a[0, 15:], b[0]
        out = mha(step, inference_params=params, rotary_pos_emb=freqs)
        full_a, full_b = (mha(t, rotary_pos_emb=freqs) for t in (a, b))
    assert rel_err(out[0, :1], full_a[0, 15:]) < TOL and rel_err(out[1], full_b[0]) < TOL
    short = InferenceParams(1, 32, 4, HID // 4, torch.float32, qkv_format="bshd")  # a table too short for tokens
    short.pre_step(OrderedDict({0: 17}))
    with pytest.raises(ValueError, match="reach position 16"), torch.no_grad():
        mha(torch.zeros(1, 17, HID, device=DEVICE), inference_params=short, rotary_pos_emb=freqs)
