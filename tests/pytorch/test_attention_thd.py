"""DotProductAttention with packed sequences (qkv_format "thd", cu_seqlens / cu_seqlens_*_padded /
max_seqlen arguments) and bshd/sbhd with cu_seqlens as the padding description, against the
float64 reference of _attn_ref.py.

THD runs only on the fused path: on the CPU the library's reference backend (float32 inputs, held
to rel_err < 2e-5, grads 1e-4). With NVTE_TEST_DEVICE=cuda the CUDA backend (cuDNN, ragged
offsets) runs them on bfloat16 inputs (cuDNN takes bfloat16/float16 only) and each result is held
to flash-attention's rule, as in test_fused_attention.py: its largest error against the float64
reference is at most 2x that of a naive bfloat16 torch implementation on the device. That rule
compares two maxima, so it needs enough elements: on CUDA the head size is 64 (V's 128 where it
differs) and the cross-length sequences are 8x longer. At the CPU's sizes (head size 8, sequences
of 0-7 tokens) a top-left causal mask with more queries than keys leaves many rows that see one
key; their true dS is 0, and cuDNN's, computed from the bfloat16 O (D = dO . O, as every
flash-style backward does), is a rounding residue that the naive float32 softmax backward lacks.
On an H100 that made 8-16 of 40 seeds exceed 2x for dQ/dK whatever V's head size; at the CUDA
sizes 0 of 40 did, for all three padding masks (session 15).
THD calls the GPU refuses (FP8 THD, THD with a bias) run as zero-padded bshd: checked against the
CPU's native THD (test_thd_as_padded_bshd_matches_native) and, on the GPU, against the test's own
padding; the bshd-with-cu_seqlens checks run on either device."""
import math

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.pytorch import dpa_fused, fused_attention as fa
from transformer_engine.pytorch.attention import DotProductAttention, MultiheadAttention

from _attn_ref import _mask, dpa_thd_ref, seqs_from_cu
from _util import DEVICE, ON_CUDA, dev, rel_err
from test_fused_attention import assert_close_fused

TOL = 2e-5
DT = torch.bfloat16 if ON_CUDA else torch.float32  # Q, K, V dtype of the THD checks
D = 64 if ON_CUDA else 8  # head size of the run_thd checks (see the docstring for CUDA's)
DV_OTHER = 64 if ON_CUDA else 6  # cross-length case's V head size (cuDNN: multiples of 8)
DV_LARGER = 128 if ON_CUDA else 16  # V's head size above Q/K's
LEN = 8 if ON_CUDA else 1  # cross-length sequences' length factor


def lens(*ns):
    return [n * LEN for n in ns]


def cu_of(lens):
    return torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)


def padded_cu(lens, gaps):
    """Offsets with gaps[i] unused tokens before sequence i (and the total token count)."""
    offs, t = [], 0
    for n, gp in zip(lens, gaps):
        t += gp
        offs.append(t)
        t += n
    return torch.tensor(offs + [t], dtype=torch.int32), t + 1  # one trailing unused token too


def draw(t, n, d, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(t, n, d, generator=g).to(dtype).requires_grad_(True)


def naive_thd(q, k, v, seqs, mask_type, scale, dy):
    """The same attention in plain torch in the inputs' dtype on the device (the yardstick of
    flash-attention's rule): O [t_q, h, d_v] and (dQ, dK, dV); rows outside every sequence 0."""
    qn, kn, vn = (dev(t.detach()).requires_grad_(True) for t in (q, k, v))
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=q.dtype, device=DEVICE)
    dyn = dev(dy).to(q.dtype)
    rep = q.shape[1] // k.shape[1]
    for oq, lq, okv, lkv in seqs:
        if lq == 0:
            continue
        Q = qn[oq:oq + lq].transpose(0, 1)
        K = kn[okv:okv + lkv].repeat_interleave(rep, 1).transpose(0, 1)
        V = vn[okv:okv + lkv].repeat_interleave(rep, 1).transpose(0, 1)
        s = (scale * (Q @ K.transpose(1, 2))).masked_fill(dev(_mask(lq, lkv, mask_type)), -math.inf)
        p = torch.nan_to_num(torch.softmax(s.float(), -1), 0.0).to(q.dtype)
        o = (p @ V).transpose(0, 1)
        o.backward(dyn[oq:oq + lq])
        out[oq:oq + lq] = o.detach()
    return out, [t.grad if t.grad is not None else torch.zeros_like(t) for t in (qn, kn, vn)]


def run_thd(lens_q, lens_kv, h, g, d, mask_type, gaps_q=None, gaps_kv=None, dv=None, max_seqlen=None, seed=0):
    dv = d if dv is None else dv
    cu_q, cu_kv = cu_of(lens_q), cu_of(lens_kv)
    pad_q = pad_kv = None
    tq, tkv = sum(lens_q), sum(lens_kv)
    if gaps_q is not None:
        pad_q, tq = padded_cu(lens_q, gaps_q)
        pad_kv, tkv = padded_cu(lens_kv, gaps_kv)
    q, k, v = draw(tq, h, d, seed, DT), draw(tkv, g, d, seed + 1, DT), draw(tkv, g, dv, seed + 2, DT)
    dpa = DotProductAttention(h, (d, dv), num_gqa_groups=g, qkv_format="thd", attn_mask_type=mask_type)
    kw = {} if max_seqlen is None else dict(max_seqlen_q=max_seqlen[0], max_seqlen_kv=max_seqlen[1])
    out = dpa(dev(q), dev(k), dev(v), cu_seqlens_q=dev(cu_q), cu_seqlens_kv=dev(cu_kv),
              cu_seqlens_q_padded=dev(pad_q), cu_seqlens_kv_padded=dev(pad_kv), **kw)
    assert out.shape == (tq, h * dv) and out.dtype == DT
    dy = torch.randn(tq, h, dv, generator=torch.Generator().manual_seed(seed + 3)).to(DT)
    seqs = seqs_from_cu(cu_q, cu_kv, pad_q, pad_kv)
    # the reference's mask names: THD always has lengths (no_mask acts as padding)
    ref, grads, _ = dpa_thd_ref(q, k, v, seqs, mask_type, 1.0 / math.sqrt(d), dy)
    naive = naive_thd(q, k, v, seqs, mask_type, 1.0 / math.sqrt(d), dy) if ON_CUDA else (None, [None] * 3)
    assert_close_fused(out, ref.reshape(tq, -1), None if naive[0] is None else naive[0].reshape(tq, -1), TOL, "out")
    out.backward(dev(dy.reshape(tq, -1)))
    for name, t, r, n in zip(("dq", "dk", "dv"), (q, k, v), grads, naive[1]):
        assert_close_fused(t.grad, r, n, 1e-4, name)
    return out, (q, k, v), seqs


@pytest.mark.parametrize("mask_type", ["padding", "padding_causal", "padding_causal_bottom_right",
                                       "no_mask", "causal", "causal_bottom_right"])
@pytest.mark.parametrize("h,g", [(2, 2), (4, 2), (4, 1)])
def test_thd_self_attention(mask_type, h, g):
    run_thd([3, 7, 1, 5], [3, 7, 1, 5], h, g, D, mask_type)


@pytest.mark.parametrize("mask_type", ["padding", "padding_causal", "padding_causal_bottom_right"])
def test_thd_cross_lengths_differ(mask_type):
    # q and kv lengths differ per sequence, including an empty kv and an empty q sequence
    run_thd(lens(2, 5, 3, 0), lens(6, 1, 0, 4), 4, 2, D, mask_type, dv=DV_OTHER)


@pytest.mark.parametrize("mask_type", ["padding", "padding_causal", "padding_causal_bottom_right"])
def test_thd_cross_lengths_head_dim_v_larger(mask_type):
    """As test_thd_cross_lengths_differ with V's head size twice Q/K's."""
    run_thd(lens(2, 5, 3, 0), lens(6, 1, 0, 4), 4, 2, D, mask_type, dv=DV_LARGER)


@pytest.mark.parametrize("mask_type", ["padding", "padding_causal"])
def test_thd_padded_offsets(mask_type):
    """Gaps between sequences (cu_seqlens_*_padded): gap rows of O and of dQ/dK/dV are zero."""
    out, (q, k, v), seqs = run_thd([3, 4, 2], [3, 4, 2], 4, 2, D, mask_type, gaps_q=[0, 2, 1], gaps_kv=[0, 2, 1])
    used = torch.zeros(out.shape[0], dtype=torch.bool)
    for oq, lq, _, _ in seqs:
        used[oq:oq + lq] = True
    assert used.sum() == 9 and out.shape[0] == 13
    assert torch.all(out.detach().cpu()[~used] == 0)
    for t in (q, k, v):
        assert torch.all(t.grad[~used] == 0) and torch.all(torch.isfinite(t.grad))


def test_thd_padded_offsets_cross_and_explicit_max_seqlen():
    run_thd([2, 5], [4, 3], 2, 1, D, "padding_causal_bottom_right", gaps_q=[1, 0], gaps_kv=[0, 3],
            max_seqlen=(9, 11))


def test_thd_structured_inputs_and_inference():
    """ones / arange inputs (indexing bugs show as patterns) under no_grad (no aux kept)."""
    lens = [4, 1, 3]
    cu = cu_of(lens)
    d = 8 if ON_CUDA else 4  # cuDNN takes head sizes that are multiples of 8
    q = (torch.arange(8 * 2 * d, dtype=torch.float32).view(8, 2, d) / (16 * d)).to(DT)  # exact in bfloat16
    k = torch.ones(8, 2, d, dtype=DT)
    v = torch.arange(8, dtype=torch.float32).view(8, 1, 1).expand(8, 2, d).contiguous().to(DT)
    dpa = DotProductAttention(2, d, qkv_format="thd", attn_mask_type="padding_causal")
    with torch.no_grad():
        out = dpa(dev(q), dev(k), dev(v), cu_seqlens_q=dev(cu), cu_seqlens_kv=dev(cu))
    ref, _, _ = dpa_thd_ref(q, k, v, seqs_from_cu(cu, cu), "padding_causal", 1.0 / math.sqrt(d))
    # CUDA: P rounded to bfloat16 before P V and O rounded to bfloat16 (2^-9 relative each)
    assert rel_err(out, ref.reshape(8, -1)) < (1e-2 if ON_CUDA else TOL)
    # equal keys: each query averages the values it sees, i.e. the mean of its sequence's prefix
    assert torch.allclose(out.float().cpu()[:4, 0], torch.tensor([0.0, 0.5, 1.0, 1.5]), atol=1e-2 if ON_CUDA else 1e-8)


@pytest.mark.parametrize("fmt", ["bshd", "sbhd"])
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("mask_type", ["padding", "padding_causal", "padding_causal_bottom_right"])
def test_bshd_cu_seqlens_as_padding(monkeypatch, fmt, fused, mask_type):
    """cu_seqlens describe the padding of bshd/sbhd inputs (and win over attention_mask): the same
    result as the equivalent right-padded attention_mask, on the fused and the unfused path."""
    if fused:
        monkeypatch.setenv("NVTE_FUSED_ATTN", "1")
    elif ON_CUDA:
        monkeypatch.setenv("NVTE_FUSED_ATTN", "0")
    b, sq, sk, h, g, d = 3, 5, 7, 4, 2, 8
    lq, lk = torch.tensor([5, 2, 4]), torch.tensor([7, 3, 1])
    dt = torch.bfloat16 if (ON_CUDA and fused) else torch.float32
    gen = torch.Generator().manual_seed(4)
    shape = lambda s, n: (b, s, n, d) if fmt == "bshd" else (s, b, n, d)
    q, k, v = (torch.randn(*shape(s, n), generator=gen).to(dt) for s, n in ((sq, h), (sk, g), (sk, g)))
    qm = (torch.arange(sq)[None] >= lq[:, None]).view(b, 1, 1, sq)
    km = (torch.arange(sk)[None] >= lk[:, None]).view(b, 1, 1, sk)
    dpa = DotProductAttention(h, d, num_gqa_groups=g, qkv_format=fmt, attn_mask_type=mask_type)
    want = dpa(dev(q), dev(k), dev(v), attention_mask=(dev(qm), dev(km)))
    bogus = (dev(torch.ones_like(qm)), dev(torch.ones_like(km)))  # ignored: cu_seqlens win
    got = dpa(dev(q), dev(k), dev(v), attention_mask=bogus, cu_seqlens_q=dev(cu_of(lq.tolist())),
              cu_seqlens_kv=dev(cu_of(lk.tolist())))
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_errors():
    q, k, v = (dev(draw(6, 2, 4, 0)) for _ in range(3))
    dpa = DotProductAttention(2, 4, qkv_format="thd", attn_mask_type="padding")
    cu = dev(cu_of([2, 4]))
    with pytest.raises(ValueError, match="needs cu_seqlens_q"):
        dpa(q, k, v)
    with pytest.raises(ValueError, match="int32"):
        dpa(q, k, v, cu_seqlens_q=dev(torch.tensor([[0, 6]], dtype=torch.int32)))
    with pytest.raises(ValueError, match="entries"):
        dpa(q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=dev(cu_of([6])))
    with pytest.raises(ValueError, match="arbitrary"):
        dpa(q, k, v, cu_seqlens_q=cu, attn_mask_type="arbitrary")
    b4 = dev(torch.randn(2, 3, 2, 4))
    with pytest.raises(ValueError, match=r"batch_size \+ 1|3"):
        DotProductAttention(2, 4, qkv_format="bshd", attn_mask_type="padding")(b4, b4, b4, cu_seqlens_q=cu[:2])


def test_thd_needs_the_fused_path(monkeypatch):
    q, k, v = (dev(draw(6, 2, 4, 0)) for _ in range(3))
    cu = dev(cu_of([2, 4]))
    dpa = DotProductAttention(2, 4, qkv_format="thd")
    monkeypatch.setenv("NVTE_FUSED_ATTN", "0")
    with pytest.raises(NotImplementedError, match="'thd' runs only on the fused attention path.*NVTE_FUSED_ATTN=0"):
        dpa(q, k, v, cu_seqlens_q=cu)
    # a backend that rejects the configuration (the CUDA backend's NOT_SUPPORTED for THD) is a clear
    # error, not a fallback
    monkeypatch.delenv("NVTE_FUSED_ATTN")
    monkeypatch.setattr(fa, "fused_backend_supports", lambda *a, **kw: (False, "layout NVTE_THD_THD_THD (THD)"))
    with pytest.raises(NotImplementedError, match="'thd' runs only on the fused.*THD_THD_THD"):
        dpa(q, k, v, cu_seqlens_q=cu)


def _thd_twice(monkeypatch, make_dpa, inputs, dy, fp8=False, **call):
    """(output, (dQ, dK, dV)) of one THD call run natively by the backend and of the same call
    forced through its padded bshd form (dpa_fused.THD_AS_PADDED = "always"), fresh modules each."""
    from transformer_engine.common import recipe
    res = []
    for mode in ("auto", "always"):
        monkeypatch.setattr(dpa_fused, "THD_AS_PADDED", mode)
        q, k, v = (dev(t.detach()).requires_grad_(True) for t in inputs)
        ctx = te.fp8_autocast(fp8_recipe=recipe.DelayedScaling(fp8_dpa=True, amax_history_len=4)) if fp8 else None
        if ctx is not None:
            with ctx:
                out = make_dpa()(q, k, v, **call)
        else:
            out = make_dpa()(q, k, v, **call)
        out.backward(dev(dy))
        res.append((out.detach(), [t.grad for t in (q, k, v)]))
    return res


@pytest.mark.skipif(ON_CUDA, reason="compares with the CPU backend's native THD (the GPU rejects these THD calls)")
@pytest.mark.parametrize("case", ["plain", "gaps_cross_gqa", "empty_sequence", "post_scale_bias", "alibi", "fp8"])
def test_thd_as_padded_bshd_matches_native(monkeypatch, case):
    """The padded-bshd route of THD calls equals the backend's own THD on the CPU (which runs every
    THD call): same output and gradients, gap tokens zero, for gaps between sequences (and before
    the first, after the last), an empty sequence, cross lengths and GQA, attention bias, ALiBi and
    FP8 attention."""
    lens_q, lens_kv, h, g, d = [3, 5, 1], [3, 5, 1], 2, 2, 8
    pad_q = pad_kv = None
    kw = {}
    if case == "empty_sequence":
        lens_q, lens_kv = [3, 0, 4], [2, 0, 5]
        pad_q, tq = padded_cu(lens_q, [0, 2, 1])
        pad_kv, tkv = padded_cu(lens_kv, [1, 1, 0])
        kw = dict(cu_seqlens_q_padded=dev(pad_q), cu_seqlens_kv_padded=dev(pad_kv))
    elif case == "gaps_cross_gqa":
        lens_kv, h, g = [4, 2, 6], 4, 2
        pad_q, tq = padded_cu(lens_q, [1, 0, 2])
        pad_kv, tkv = padded_cu(lens_kv, [0, 3, 1])
        kw = dict(cu_seqlens_q_padded=dev(pad_q), cu_seqlens_kv_padded=dev(pad_kv))
    else:
        tq, tkv = sum(lens_q), sum(lens_kv)
    mq, mkv = max(lens_q), max(lens_kv)
    if case == "post_scale_bias":
        bias = torch.randn(1, h, mq, mkv, generator=torch.Generator().manual_seed(7))
        kw.update(core_attention_bias_type="post_scale_bias", core_attention_bias=dev(bias))
    elif case == "alibi":
        kw.update(core_attention_bias_type="alibi")
    inputs = (draw(tq, h, d, 1), draw(tkv, g, d, 2), draw(tkv, g, d, 3))
    dy = torch.randn(tq, h * d, generator=torch.Generator().manual_seed(4))
    (o_native, g_native), (o_padded, g_padded) = _thd_twice(
        monkeypatch, lambda: DotProductAttention(h, d, num_gqa_groups=g, qkv_format="thd",
                                                 attn_mask_type="padding_causal"),
        inputs, dy, fp8=case == "fp8", cu_seqlens_q=dev(cu_of(lens_q)), cu_seqlens_kv=dev(cu_of(lens_kv)), **kw)
    assert float(o_native.abs().max()) > 0.0
    torch.testing.assert_close(o_padded, o_native, rtol=1e-6, atol=1e-6)
    for name, a, b in zip(("dq", "dk", "dv"), g_padded, g_native):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=lambda m: f"{name}: {m}")
    if pad_q is not None:  # gap tokens: zero output and gradients
        valid = torch.zeros(tq, dtype=torch.bool)
        for off, n in zip(pad_q[:-1].tolist(), lens_q):
            valid[off:off + n] = True
        assert not o_padded[~valid].any() and not g_padded[0][~valid].any()


@pytest.mark.skipif(not ON_CUDA, reason="the GPU backend's THD rejections (NVTE_TEST_DEVICE=cuda only)")
def test_thd_cuda_rejections_run_as_padded_bshd():
    """On the GPU, FP8 THD and THD with a bias or ALiBi are NOT_SUPPORTED by cuDNN's ragged path and
    run as zero-padded bshd: equal to the test's own padding of the same call (bshd, padding mask from
    cu_seqlens; FP8 padded to 128 rows, as cuDNN's FP8 backward needs), output and gradients."""
    from transformer_engine.common import recipe
    lens = [2, 4, 3]
    cu = cu_of(lens)
    t, mx, h, d = sum(lens), max(lens), 2, 128  # cuDNN's FP8 backward takes head size 128
    bias = dev(torch.randn(1, h, mx, mx, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16))
    for kind in ("fp8", "post_scale_bias", "alibi"):
        inputs = [draw(t, h, d, i, torch.bfloat16) for i in range(3)]
        dy = torch.randn(t, h * d, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
        kw = {"fp8": {}, "alibi": dict(core_attention_bias_type="alibi"),
              "post_scale_bias": dict(core_attention_bias_type="post_scale_bias", core_attention_bias=bias)}[kind]
        outs = []
        s_pad = 128 if kind == "fp8" else mx
        for fmt in ("thd", "bshd"):
            x = [dev(a.detach()).requires_grad_(True) for a in inputs]
            if fmt == "bshd":
                x_in = []
                for a in x:
                    pieces = [torch.nn.functional.pad(a[int(cu[i]):int(cu[i + 1])], (0, 0, 0, 0, 0, s_pad - lens[i]))
                              for i in range(len(lens))]
                    x_in.append(torch.stack(pieces))
            else:
                x_in = x
            dpa = DotProductAttention(h, d, qkv_format=fmt, attn_mask_type="padding_causal")
            rec = recipe.DelayedScaling(fp8_dpa=True, amax_history_len=4)
            with te.fp8_autocast(enabled=kind == "fp8", fp8_recipe=rec):
                o = dpa(*x_in, cu_seqlens_q=dev(cu), cu_seqlens_kv=dev(cu), **kw)
            if fmt == "bshd":
                o = torch.cat([o[i, :lens[i]] for i in range(len(lens))])
            o.backward(dev(dy))
            outs.append((o.detach(), [a.grad for a in x]))
        (o_thd, g_thd), (o_ref, g_ref) = outs
        assert float(o_ref.float().abs().max()) > 0.0
        torch.testing.assert_close(o_thd, o_ref, rtol=0, atol=0, msg=lambda m: f"{kind} output: {m}")
        for name, a, b in zip(("dq", "dk", "dv"), g_thd, g_ref):
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m: f"{kind} {name}: {m}")


def test_mha_thd_matches_per_sequence_bshd():
    """MultiheadAttention over packed [t, hidden] tokens equals running each sequence alone.
    CUDA: bfloat16 (cuDNN's THD); the two runs differ by bfloat16 roundings (projection GEMMs of
    different shapes, attention kernels of different batch shapes), a few 2^-9 relative steps,
    so 2e-2 there, while a misplaced sequence or row would be off by O(1)."""
    torch.manual_seed(0)
    kw = dict(attention_dropout=0.0, attn_mask_type="causal", device=DEVICE, params_dtype=DT)
    m = MultiheadAttention(32, 4, qkv_format="thd", **kw)
    m_b = MultiheadAttention(32, 4, qkv_format="bshd", **kw)
    m_b.load_state_dict(m.state_dict())
    lens = [3, 6, 2]
    x = torch.randn(sum(lens), 32, generator=torch.Generator().manual_seed(2)).to(DT)
    cu = cu_of(lens)
    out = m(dev(x), cu_seqlens_q=dev(cu), cu_seqlens_kv=dev(cu))
    assert out.shape == (sum(lens), 32)
    parts = [m_b(dev(x[int(cu[i]):int(cu[i + 1])]).unsqueeze(0))[0] for i in range(len(lens))]
    assert rel_err(out, torch.cat(parts)) < (2e-2 if ON_CUDA else 1e-5)
    assert te.DotProductAttention is DotProductAttention and dpa_fused.thd_mask_type("causal") == "padding_causal"


@pytest.mark.parametrize("rope", [False, True])
def test_mha_thd_padded_offsets_match_per_sequence_bshd(rope):
    """MultiheadAttention passes cu_seqlens_q/kv_padded (and pad_between_seqs) on to attention and
    rotates each sequence from its padded offset: with gaps between the packed sequences, every
    sequence's rows equal running it alone (they were dropped before: the gaps broke the result)."""
    torch.manual_seed(0)
    kw = dict(attention_dropout=0.0, attn_mask_type="causal", device=DEVICE, params_dtype=DT)
    m = MultiheadAttention(32, 4, qkv_format="thd", **kw)
    m_b = MultiheadAttention(32, 4, qkv_format="bshd", **kw)
    m_b.load_state_dict(m.state_dict())
    lens, gaps = [3, 6, 2], [0, 2, 1]
    pad, t = padded_cu(lens, gaps)
    x = torch.randn(t, 32, generator=torch.Generator().manual_seed(2)).to(DT)
    emb = dev(te.RotaryPositionEmbedding(8)(16)) if rope else None  # (rows for the gap tokens too)
    out = m(dev(x), cu_seqlens_q=dev(cu_of(lens)), cu_seqlens_kv=dev(cu_of(lens)), cu_seqlens_q_padded=dev(pad),
            cu_seqlens_kv_padded=dev(pad), pad_between_seqs=True, rotary_pos_emb=emb)
    for i, n in enumerate(lens):
        rows = slice(int(pad[i]), int(pad[i]) + n)
        alone = m_b(dev(x[rows]).unsqueeze(0), rotary_pos_emb=emb)[0]
        assert rel_err(out[rows], alone) < (2e-2 if ON_CUDA else 1e-5), i
    # self attention: the query side's offsets alone serve the keys too (one packed buffer)
    same = m(dev(x), cu_seqlens_q=dev(cu_of(lens)), cu_seqlens_q_padded=dev(pad), rotary_pos_emb=emb)
    assert torch.equal(same, out)
    with pytest.raises(ValueError, match="together"):
        m(dev(x), cu_seqlens_q=dev(cu_of(lens)), cu_seqlens_kv=dev(cu_of(lens)), cu_seqlens_q_padded=dev(pad))


def test_thd_as_padded_bshd_checks_max_seqlen(monkeypatch):
    """A sequence longer than the max_seqlen given is an error on the padded route too (its slots
    would drop the extra tokens)."""
    monkeypatch.setattr(dpa_fused, "THD_AS_PADDED", "always")
    q, k, v = (dev(draw(8, 2, 8, i)) for i in range(3))
    dpa = DotProductAttention(2, 8, qkv_format="thd", attn_mask_type="padding_causal")
    with pytest.raises(ValueError, match=r"longer than max_seqlen_q \(5 > 4\)"):
        dpa(q, k, v, cu_seqlens_q=dev(cu_of([3, 5])), max_seqlen_q=4, max_seqlen_kv=5)


@pytest.mark.parametrize("mode", ["auto", "always"])
def test_every_query_sequence_empty(monkeypatch, mode):
    """cu_seqlens_q all zero with THD tokens present (they lie after every sequence): zeros, through
    the native THD route and its padded bshd form alike, and zero gradients."""
    monkeypatch.setattr(dpa_fused, "THD_AS_PADDED", mode)
    h, d = 2, D
    g = torch.Generator().manual_seed(11)
    q = torch.randn(2, h, d, generator=g).to(DT).requires_grad_()
    kv = torch.randn(3, h, d, generator=g).to(DT).requires_grad_()
    cu_q, cu_kv = torch.tensor([0, 0], dtype=torch.int32), torch.tensor([0, 3], dtype=torch.int32)
    dpa = DotProductAttention(h, d, qkv_format="thd", attn_mask_type="padding")
    o = dpa(dev(q), dev(kv), dev(kv), cu_seqlens_q=dev(cu_q), cu_seqlens_kv=dev(cu_kv))
    assert tuple(o.shape) == (2, h * d) and not o.detach().cpu().any()
    o.float().sum().backward()
    assert q.grad is None or not q.grad.any()


def test_given_max_seqlen_is_checked():
    """A max_seqlen of 0 with a non-empty sequence raises (it returned zeros and zero gradients,
    since a call with max_seqlen 0 is answered without the library, which checks the other
    values); a negative one raises; 0 with every sequence empty still gives zeros."""
    h, d = 2, D
    x = dev(torch.randn(8, h, d).to(DT))
    cu = dev(torch.tensor([0, 5, 8], dtype=torch.int32))
    dpa = DotProductAttention(h, d, qkv_format="thd", attn_mask_type="padding")
    for mq, mkv, match in ((0, 5, "cu_seqlens_q gives a sequence of length 5, more than max_seqlen_q 0"),
                           (5, 0, "cu_seqlens_kv gives a sequence of length 5, more than max_seqlen_kv 0"),
                           (-1, 5, "max_seqlen_q must be >= 0, got -1")):
        with pytest.raises(ValueError, match=match):
            dpa(x, x, x, cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=mq, max_seqlen_kv=mkv)
    empty = dev(torch.zeros(3, dtype=torch.int32))
    o = dpa(x, x, x, cu_seqlens_q=empty, cu_seqlens_kv=cu, max_seqlen_q=0, max_seqlen_kv=5)
    assert not o.cpu().any()


@pytest.mark.parametrize("fmt", ["bshd", "sbhd"])
@pytest.mark.parametrize("fused", ["0", "1"])
def test_padding_mask_needs_a_description(monkeypatch, fmt, fused):
    """A padding mask type with neither attention_mask nor cu_seqlens raises on both paths (TE
    asserts); before, the fused path ran it as full-length sequences."""
    monkeypatch.setenv("NVTE_FUSED_ATTN", fused)
    x = dev(torch.randn(2, 4, 2, D).to(DT))
    dpa = DotProductAttention(2, D, qkv_format=fmt, attn_mask_type="padding")
    with pytest.raises(ValueError, match="needs attention_mask|need attention_mask"):
        dpa(x, x, x)


@pytest.mark.parametrize("fused", ["0", "1"])
def test_bshd_cu_seqlens_longer_than_the_tensor_raise(monkeypatch, fused):
    monkeypatch.setenv("NVTE_FUSED_ATTN", fused)
    x = dev(torch.randn(2, 4, 2, D).to(DT))
    cu = dev(torch.tensor([0, 5, 7], dtype=torch.int32))
    dpa = DotProductAttention(2, D, qkv_format="bshd", attn_mask_type="padding")
    with pytest.raises(Exception, match=r"each must be in \[0, 4\]|more than max_seqlen 4"):
        dpa(x, x, x, cu_seqlens_q=cu, cu_seqlens_kv=cu)


def test_mha_cross_thd_gaps_in_the_queries_only():
    """MultiheadAttention cross attention, THD: cu_seqlens_q_padded without cu_seqlens_kv_padded
    (the key/value buffer has no gaps) is accepted, as in TE (it raised), and equals the call that
    gives the key/value offsets as their own padded offsets."""
    torch.manual_seed(3)
    hid, lq, lk, pq = 32, [3, 1, 4], [5, 2, 3], [4, 3, 4]
    cu = lambda lens: dev(torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32))  # noqa: E731
    mha = MultiheadAttention(hid, 4, num_gqa_groups=2, attention_dropout=0.0, attn_mask_type="padding",
                             attention_type="cross", qkv_format="thd", params_dtype=DT, device=DEVICE)
    x = dev(torch.randn(sum(pq), hid).to(DT))
    enc = dev(torch.randn(sum(lk), hid).to(DT))
    kw = dict(encoder_output=enc, cu_seqlens_q=cu(lq), cu_seqlens_kv=cu(lk), cu_seqlens_q_padded=cu(pq))
    one_sided = mha(x, **kw)
    both = mha(x, cu_seqlens_kv_padded=cu(lk), **kw)
    assert torch.equal(one_sided, both)
    self_mha = MultiheadAttention(hid, 4, attention_dropout=0.0, attn_mask_type="padding", qkv_format="thd",
                                  params_dtype=DT, device=DEVICE)
    with pytest.raises(ValueError, match="together"):
        self_mha(x, cu_seqlens_q=cu(lq), cu_seqlens_kv=cu(lq), cu_seqlens_q_padded=cu(pq))


def test_thd_bias_shared_by_all_queries_is_broadcast():
    """A post-scale bias [1, 1 or h, 1, skv] (TE's "111s") under THD: broadcast over max_seqlen_q,
    as BSHD does (it was a library shape error); equal to the explicitly expanded bias, and its
    gradient is that one's summed over the queries."""
    h, d, lens = 2, D, [3, 4]
    cu = dev(torch.tensor([0, 3, 7], dtype=torch.int32))
    g = torch.Generator().manual_seed(21)
    x = torch.randn(7, h, d, generator=g).to(DT)
    dpa = DotProductAttention(h, d, qkv_format="thd", attn_mask_type="padding")
    kw = dict(cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=4, max_seqlen_kv=4,
              core_attention_bias_type="post_scale_bias")
    for heads in (1, h):
        b1 = dev(torch.randn(1, heads, 1, 4, generator=g).to(DT)).requires_grad_()
        bf = b1.detach().expand(1, heads, 4, 4).contiguous().requires_grad_()
        o1 = dpa(dev(x), dev(x), dev(x), core_attention_bias=b1, **kw)
        of = dpa(dev(x), dev(x), dev(x), core_attention_bias=bf, **kw)
        assert torch.equal(o1, of), heads
        dy = dev(torch.randn(o1.shape, generator=g).to(DT))
        o1.backward(dy)
        of.backward(dy)
        torch.testing.assert_close(b1.grad, bf.grad.sum(2, keepdim=True), rtol=1e-2 if DT != torch.float32 else 1e-5,
                                   atol=1e-3 if DT != torch.float32 else 1e-6)
