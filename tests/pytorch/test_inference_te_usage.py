"""K/V-cache inference used the way TE's own code and tests use it (inference.py,
kv_cache_attention.py, MultiheadAttention's RoPE under a cache, TransformerLayer):

- BSHD/SBHD inputs padded to max_batch_size (TE's CUDA-graphed KV-cache test feeds
  [max_batch_size, max_ctx_len, ...] tensors whose rows past the live sequences are empty
  sequences): live rows equal the unpadded call's, empty rows give zeros and never touch the cache;
- a step padded past its longest sequence (and past the RoPE table) under RoPE;
- NumPy integer token counts in pre_step's step_dict;
- PagedKVCacheManager's bookkeeping helpers, InferenceParams.sequences_pre_step / output_qkv_format;
- TransformerLayer(attn_input_format="thd") generating with a cache.

Every generated row is compared with the model's full causal forward without a cache (or float64
attention over the sequence's history). On the CPU float32 inputs (rel_err < 2e-5); with
NVTE_TEST_DEVICE=cuda bfloat16 ones (rel_err < 2e-2)."""
import logging
import math
from collections import OrderedDict

import numpy as np
import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.pytorch.inference import InferenceParams

from _util import DEVICE, ON_CUDA, rel_err

DT = torch.bfloat16 if ON_CUDA else torch.float32
TOL = 2e-2 if ON_CUDA else 2e-5
H, G = 4, 2
D = 64 if ON_CUDA else 8
MAXB, MAXS, CTX = 4, 16, 6
# iterations {seq_id: new tokens}: prompts, decode steps, seq 1 finishing, seq 3 joining
SCRIPT = [{0: 5, 1: 3}, {0: 1, 1: 1}, {0: 1}, {0: 1, 3: 2}, {3: 1, 0: 1}]


def _history(seed, n=MAXS):
    """Per sequence id: float64 Q [n, H, D], K, V [n, G, D], rounded to DT."""
    g = torch.Generator().manual_seed(seed)
    mk = lambda heads: torch.randn(n, heads, D, generator=g, dtype=torch.float64).to(DT).double()  # noqa: E731
    return {s: (mk(H), mk(G), mk(G)) for s in range(4)}


def _reference(hist, seq, p0, n):
    """float64 causal attention of sequence seq's rows p0 .. p0 + n - 1 over its history."""
    q, k, v = hist[seq][0][p0:p0 + n], hist[seq][1][:p0 + n], hist[seq][2][:p0 + n]
    k, v = k.repeat_interleave(H // G, 1), v.repeat_interleave(H // G, 1)
    s = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(D)
    i, j = torch.arange(p0, p0 + n)[:, None], torch.arange(p0 + n)[None]
    return torch.einsum("hqk,khd->qhd", torch.softmax(s.masked_fill(j > i, -math.inf), -1), v)


def _padded(parts, fmt, batch, s, fill):
    """parts (list of [n, heads, D]) as a [batch, s] BSHD (or SBHD) tensor: rows past each part and
    rows past the parts hold `fill` (what the cache and the output must never see); batch None:
    the parts' rows only."""
    x = torch.full((len(parts) if batch is None else batch, s, *parts[0].shape[1:]), fill, dtype=torch.float64)
    for i, p in enumerate(parts):
        x[i, :p.shape[0]] = p
    x = x if fmt == "bshd" else x.transpose(0, 1)
    return x.contiguous().to(DT).to(DEVICE)


def _run_dpa(fmt, paged, batch, fill, hist):
    """SCRIPT through a DotProductAttention with a cache, inputs padded to [batch, CTX]: per
    iteration the output [rows, s, H, D] as BSHD and the caches after the step."""
    dpa = te.DotProductAttention(H, D, num_gqa_groups=G, qkv_format=fmt, attn_mask_type="padding_causal",
                                 layer_number=1)
    kw = dict(is_paged=True, page_size=4, total_num_pages=MAXB * MAXS // 4) if paged else {}
    params = InferenceParams(MAXB, MAXS, G, D, DT, qkv_format=fmt, **kw)
    pos, outs = {}, []
    for step in SCRIPT:
        pos = {s: pos.get(s, 0) for s in step}
        params.pre_step(OrderedDict(step))
        qkv = [_padded([hist[s][c][pos[s]:pos[s] + n] for s, n in step.items()], fmt, batch, CTX, fill)
               for c in range(3)]
        with torch.no_grad():
            o = dpa(*qkv, inference_params=params).view(*qkv[0].shape[:2], H, D)
        o = o if fmt == "bshd" else o.transpose(0, 1)
        caches = [c.clone() for c in params.cache_manager.cache[1]]
        outs.append((dict(step), dict(pos), o.double().cpu(), caches))
        pos = {s: pos[s] + n for s, n in step.items()}
    return outs


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("fmt", ["bshd", "sbhd"])
def test_batch_padded_to_max_batch_size(fmt, paged):
    """Inputs of max_batch_size rows, the rows past the live sequences empty (garbage-filled): the
    live rows match float64 attention and the unpadded run's outputs, every padding row and empty
    row is zero, and the caches hold exactly what the unpadded run stores."""
    hist = _history(1)
    padded = _run_dpa(fmt, paged, MAXB, 7.0, hist)
    for (step, pos, o, caches), live in zip(padded, _run_dpa(fmt, paged, None, 0.0, hist)):
        b = len(step)
        for i, (s, n) in enumerate(step.items()):
            assert rel_err(o[i, :n], _reference(hist, s, pos[s], n)) < TOL
            assert torch.all(o[i, n:] == 0)
        assert torch.equal(o[:b], live[2]), "padding the batch changed the live rows"
        assert torch.all(o[b:] == 0), "the empty rows of a padded batch must give zeros"
        for c, c_live in zip(caches, live[3]):
            assert torch.equal(c, c_live), "the empty rows of a padded batch wrote to the cache"


def test_padded_batch_errors():
    """A batch smaller than pre_step's sequences or larger than max_batch_size is refused, naming
    both; get_seqlens_pre_step(batch_size) pads with zeros within the same bounds."""
    dpa = te.DotProductAttention(H, D, num_gqa_groups=G, qkv_format="bshd", layer_number=1)
    params = InferenceParams(2, 8, G, D, DT)
    params.pre_step(OrderedDict({0: 3, 1: 1}))
    for rows in (1, 3):
        q = torch.zeros(rows, 3, H, D, dtype=DT, device=DEVICE)
        k = torch.zeros(rows, 3, G, D, dtype=DT, device=DEVICE)
        with torch.no_grad(), pytest.raises(ValueError, match="need batch 2 .*max_batch_size=2"):
            dpa(q, k, k, inference_params=params)
    params = InferenceParams(4, 8, G, D, DT)
    params.pre_step(OrderedDict({0: 3, 1: 1}))
    assert params.get_seqlens_pre_step().tolist() == [0, 0]
    assert params.get_seqlens_pre_step(4).tolist() == [0, 0, 0, 0]
    params.pre_step(OrderedDict({0: 1, 1: 1}))
    assert params.get_seqlens_pre_step(3).tolist() == [3, 1, 0]
    assert params.cu_seqlens_q.tolist() == [0, 1, 2] and params.cu_seqlens_kv.tolist() == [0, 4, 6]
    with pytest.raises(ValueError, match="max_batch_size=4; got 5"):
        params.get_seqlens_pre_step(5)
    with pytest.raises(ValueError, match="2 sequences of pre_step"):
        params.get_seqlens_pre_step(1)


# ---------------------------------------------------------------- models with RoPE

HID = 256 if ON_CUDA else 32
NL = 2


def _layers(fmt, kind, seed=0, src=None):
    """NL TransformerLayers (or MultiheadAttentions with their input norm) in fmt, float32 weights
    (src's if given), query/key weights sharpened so that a wrong position or mask shows."""
    torch.manual_seed(seed)
    out = []
    for i in range(NL):
        if kind == "layer":
            m = te.TransformerLayer(HID, 2 * HID, H, num_gqa_groups=G, hidden_dropout=0.0, attention_dropout=0.0,
                                    layer_number=i + 1, self_attn_mask_type="causal", attn_input_format=fmt,
                                    params_dtype=torch.float32, device=DEVICE)
        else:
            m = te.MultiheadAttention(HID, H, num_gqa_groups=G, attention_dropout=0.0, layer_number=i + 1,
                                      attn_mask_type="causal", qkv_format=fmt, input_layernorm=True,
                                      params_dtype=torch.float32, device=DEVICE)
        m = m.to(DT).eval()
        if src is not None:
            m.load_state_dict(src[i].state_dict())
        else:
            with torch.no_grad():
                for n, p in m.named_parameters():
                    if ("query" in n or "key" in n or "qkv" in n) and n.endswith("weight") and "norm" not in n:
                        p.mul_(4.0)
        out.append(m)
    return out


def _forward(layers, x, **kw):
    for m in layers:
        y = m(x, **kw)
        x = y if isinstance(m, te.TransformerLayer) else y + x
    return x


def _full(layers_bshd, xs, freqs):
    """Per sequence: the full causal forward without a cache, [n, HID] (float64 on the CPU)."""
    with torch.no_grad():
        return {s: _forward(layers_bshd, x[None].to(DEVICE), rotary_pos_emb=freqs)[0].double().cpu()
                for s, x in xs.items()}


def _generate(layers, fmt, xs, freqs, batch=None, s_extra=0, thd=False, fill=3.0):
    """SCRIPT through the models with a cache: BSHD/SBHD inputs padded to `batch` rows (None: the
    live ones) and max step + s_extra positions, padding filled with `fill`; THD packed. Yields
    (seq, first position, rows [n, HID])."""
    params = InferenceParams(MAXB, MAXS, G, HID // H, DT, qkv_format=fmt, max_ctx_len=MAXS)
    pos = {}
    with torch.no_grad():
        for step in SCRIPT:
            pos = {s: pos.get(s, 0) for s in step}
            params.pre_step(OrderedDict(step))
            parts = [xs[s][pos[s]:pos[s] + n] for s, n in step.items()]
            if fmt == "thd":
                x = torch.cat(parts)
            else:
                rows = batch or len(parts)
                x = torch.full((rows, max(step.values()) + s_extra, HID), fill, dtype=torch.float64)
                for i, p in enumerate(parts):
                    x[i, :p.shape[0]] = p
                x = x if fmt == "bshd" else x.transpose(0, 1)
            y = _forward(layers, x.contiguous().to(DT).to(DEVICE), inference_params=params,
                         rotary_pos_emb=freqs).double().cpu()
            t = 0
            for i, (s, n) in enumerate(step.items()):
                got = y[t:t + n] if fmt == "thd" else (y[i, :n] if fmt == "bshd" else y[:n, i])
                t += n
                yield s, pos[s], got
            pos = {s: pos[s] + n for s, n in step.items()}


def _check_generation(layers, fmt, freqs, **kw):
    xs = {s: torch.randn(MAXS, HID, generator=torch.Generator().manual_seed(10 + s), dtype=torch.float64).to(DT)
          for s in range(4)}
    ref = _full(_layers("bshd", "layer" if isinstance(layers[0], te.TransformerLayer) else "mha", src=layers),
                xs, freqs)
    n_rows = 0
    for s, p0, got in _generate(layers, fmt, xs, freqs, **kw):
        assert rel_err(got, ref[s][p0:p0 + got.shape[0]]) < TOL, (s, p0)
        n_rows += got.shape[0]
    assert n_rows == sum(sum(step.values()) for step in SCRIPT)


@pytest.mark.parametrize("kind", ["layer", "mha"])
@pytest.mark.parametrize("fmt", ["bshd", "sbhd"])
def test_rope_step_padded_past_its_longest_sequence(fmt, kind):
    """A step padded 10 rows past its longest sequence: with a RoPE table of the cache's length
    the padding rows' positions run past the table (TE's padded CUDA-graph inputs do this); the
    generated rows still equal the full forward's."""
    freqs = te.attention.RotaryPositionEmbedding(HID // H)(MAXS).to(DEVICE)
    _check_generation(_layers(fmt, kind), fmt, freqs, s_extra=10)


@pytest.mark.parametrize("fmt", ["bshd", "sbhd"])
def test_transformer_layer_rope_batch_padded_to_max_batch_size(fmt):
    """TransformerLayers with RoPE fed [max_batch_size, max_ctx_len] inputs (TE's CUDA-graphed
    KV-cache test's shapes): the live rows equal the full forward's."""
    freqs = te.attention.RotaryPositionEmbedding(HID // H)(MAXS).to(DEVICE)
    _check_generation(_layers(fmt, "layer"), fmt, freqs, batch=MAXB, s_extra=CTX - 5)


# ---------------------------------------------------------------- TransformerLayer THD

def test_transformer_layer_thd_generation():
    """TransformerLayer(attn_input_format="thd") (TE's KV-cache test builds it so) with packed
    [tokens, hidden] inputs and a cache generates the full forward's rows, with and without RoPE."""
    layers = _layers("thd", "layer")
    _check_generation(layers, "thd", None)
    _check_generation(layers, "thd", te.attention.RotaryPositionEmbedding(HID // H)(MAXS).to(DEVICE))


def test_transformer_layer_thd_without_cache_and_shape_error():
    """THD without a cache (cu_seqlens_q): each packed sequence equals its own BSHD forward; a 3D
    input is refused."""
    layers = _layers("thd", "layer", seed=3)
    ref_layers = _layers("bshd", "layer", src=layers)
    xs = [torch.randn(n, HID, generator=torch.Generator().manual_seed(n)).to(DT) for n in (5, 3)]
    cu = torch.tensor([0, 5, 8], dtype=torch.int32, device=DEVICE)
    with torch.no_grad():
        y = _forward(layers, torch.cat(xs).to(DEVICE), self_attn_mask_type="padding_causal", cu_seqlens_q=cu,
                     cu_seqlens_kv=cu, max_seqlen_q=5, max_seqlen_kv=5).double().cpu()
        for x, (a, b) in zip(xs, ((0, 5), (5, 8))):
            assert rel_err(y[a:b], _forward(ref_layers, x[None].to(DEVICE))[0].double().cpu()) < TOL
        with pytest.raises(ValueError, match="2D .*thd"):
            layers[0](torch.zeros(1, 5, HID, dtype=DT, device=DEVICE))


# ---------------------------------------------------------------- pre_step's token counts

def test_token_counts_any_integer_type():
    """TE's workflow builds step_dict = OrderedDict(zip(seq_ids, step_lens)); NumPy (or 0-d torch)
    integer counts work and are kept as ints; bools, floats and counts < 1 are refused."""
    params = InferenceParams(4, 16, G, D, DT)
    params.pre_step(OrderedDict(zip([0, 1, 2], np.array([10, 1, 1]))))
    params.pre_step(OrderedDict([(0, np.int32(1)), (1, torch.tensor(2)), (2, 3)]))
    assert params.sequences == OrderedDict({0: 11, 1: 3, 2: 4})
    assert all(type(n) is int for n in params.step_dict.values())
    for bad in (True, np.bool_(True), 1.0, np.float32(1), "1", 0, np.int64(-1)):
        with pytest.raises(ValueError, match="integer >= 1"):
            params.pre_step(OrderedDict({0: bad}))
    assert params.sequences == OrderedDict({0: 11, 1: 3, 2: 4})  # (refused steps change nothing)


# ---------------------------------------------------------------- TE's bookkeeping names

def test_sequences_pre_step_and_output_qkv_format():
    params = InferenceParams(4, 16, G, D, DT, qkv_format="sbhd")
    assert params.output_qkv_format == "sbhd_2bshd"
    params.pre_step(OrderedDict({0: 5, 1: 3}))
    assert params.sequences_pre_step == OrderedDict({0: 0, 1: 0})
    params.pre_step(OrderedDict({1: 1, 2: 4, 0: 2}))
    assert params.sequences_pre_step == OrderedDict({1: 3, 2: 0, 0: 5})
    assert InferenceParams(4, 16, G, D, DT).output_qkv_format == "bshd"
    assert InferenceParams(4, 16, G, D, DT, qkv_format="thd", max_ctx_len=4).output_qkv_format == "thd_2bshd"


def test_paged_manager_helpers(caplog):
    """TE's PagedKVCacheManager helpers: counts, lengths, page lists and tables, pages allocated and
    freed by hand (lowest id first, all or none), and print_cache's DEBUG log."""
    params = InferenceParams(3, 16, G, D, DT, is_paged=True, page_size=4, total_num_pages=6)
    m = params.cache_manager
    params.pre_step(OrderedDict({0: 5, 1: 2}))
    assert m.get_sequence_count() == 2 and m.get_sequence_lengths() == [5, 2]
    assert m.get_page_list(0) == [0, 1] and m.get_page_list(1) == [2] and m.get_page_count(0) == 2
    assert m.get_page_count(7) == 0 and m.get_page_list(7) == [] and m.has_free_page()
    table = m.get_page_table([1, 0])
    assert table.dtype == torch.int32 and table.tolist() == [[2, 0, 0, 0], [0, 1, 0, 0]]
    m.allocate_sequence(5, 9)  # 3 pages
    assert m.get_page_list(5) == [3, 4, 5] and not m.has_free_page()
    with pytest.raises(RuntimeError, match="full"):
        m.allocate_page(0)
    m.deallocate_sequence(5)
    assert m.free_pages == [3, 4, 5]
    m.allocate_page(1)
    with pytest.raises(RuntimeError, match="9 tokens need 3 pages, 2 are free"):
        m.allocate_sequence(6, 9)
    assert m.get_page_list(1) == [2, 3] and m.get_page_list(6) == []  # (all or none)
    with pytest.raises(ValueError, match="holds no pages"):
        m.deallocate_sequence(6)
    with pytest.raises(ValueError, match="max_pages_per_seq=4"):
        m.allocate_sequence(1, 9)
    with pytest.raises(ValueError, match="integer >= 1"):
        m.allocate_sequence(6, 0)
    caplog.set_level(logging.DEBUG, logger="PagedKVCacheManager")
    m.print_cache()
    assert "2 sequences" in caplog.text and "sequence 1, 2 tokens, pages [2, 3]" in caplog.text


def test_hand_allocated_page_used_by_the_next_steps():
    """A page given to a sequence by hand (allocate_page) is where its next tokens go: the next
    pre_step's page table lists it, and generation stays exact."""
    hist = _history(2)
    dpa = te.DotProductAttention(H, D, num_gqa_groups=G, qkv_format="bshd", layer_number=1)
    params = InferenceParams(2, 16, G, D, DT, is_paged=True, page_size=4, total_num_pages=8)
    m, p0 = params.cache_manager, 0
    for i, n in enumerate([4, 1, 1]):
        if i == 1:
            m.allocate_page(0)  # (seq 0 holds 4 tokens: its next one goes to this page)
        params.pre_step(OrderedDict({0: n}))
        assert m.page_table[0, :m.get_page_count(0)].tolist() == m.get_page_list(0)
        q, k, v = (_padded([hist[0][c][p0:p0 + n]], "bshd", 1, n, 0.0) for c in range(3))
        with torch.no_grad():
            o = dpa(q, k, v, inference_params=params, attn_mask_type="padding_causal").view(1, n, H, D)
        assert rel_err(o[0].double().cpu(), _reference(hist, 0, p0, n)) < TOL
        p0 += n
    assert m.get_page_count(0) == 2  # (the hand-allocated page, not a new one)


def test_pages_held_ahead_do_not_count_for_other_sequences():
    """Pages a sequence holds beyond its tokens (allocated by hand) are not free for the others:
    a step that needs more pages than are free is refused as 'full', changing nothing."""
    params = InferenceParams(2, 16, G, D, DT, is_paged=True, page_size=4, total_num_pages=4)
    m = params.cache_manager
    params.pre_step(OrderedDict({0: 4}))
    m.allocate_sequence(0, 8)  # seq 0: pages [0, 1, 2] for 4 tokens; page 3 free
    with pytest.raises(RuntimeError, match="cache is full"):
        params.pre_step(OrderedDict({0: 1, 1: 8}))  # seq 1 needs 2 pages, 1 is free
    assert m.free_pages == [3] and m.get_page_list(0) == [0, 1, 2] and m.get_page_list(1) == []
    params.pre_step(OrderedDict({0: 1, 1: 4}))
    assert m.get_page_list(0) == [0, 1, 2] and m.get_page_list(1) == [3]
