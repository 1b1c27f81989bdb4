"""DotProductAttention with packed sequences (qkv_format "thd", cu_seqlens / cu_seqlens_*_padded /
max_seqlen arguments) and bshd/sbhd with cu_seqlens as the padding description, against the
float64 reference of _attn_ref.py.

THD runs only on the fused path: on the CPU the library's reference backend (float32 inputs, held
to rel_err < 2e-5, grads 1e-4). The CUDA backend has no THD yet (NOT_SUPPORTED), so with
NVTE_TEST_DEVICE=cuda the THD numerics are skipped and test_thd_cuda_is_a_clear_error checks
the error; the bshd-with-cu_seqlens checks run on either device."""
import math

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.pytorch import dpa_fused, fused_attention as fa
from transformer_engine.pytorch.attention import DotProductAttention, MultiheadAttention

from _attn_ref import dpa_thd_ref, seqs_from_cu
from _util import DEVICE, ON_CUDA, dev, rel_err

TOL = 2e-5
needs_cpu_thd = pytest.mark.skipif(ON_CUDA, reason="the CUDA backend has no THD layouts yet (NOT_SUPPORTED; "
                                                   "see test_thd_cuda_is_a_clear_error)")


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
    return torch.randn(t, n, d, generator=g, dtype=dtype).requires_grad_(True)


def run_thd(lens_q, lens_kv, h, g, d, mask_type, gaps_q=None, gaps_kv=None, dv=None, max_seqlen=None, seed=0):
    dv = d if dv is None else dv
    cu_q, cu_kv = cu_of(lens_q), cu_of(lens_kv)
    pad_q = pad_kv = None
    tq, tkv = sum(lens_q), sum(lens_kv)
    if gaps_q is not None:
        pad_q, tq = padded_cu(lens_q, gaps_q)
        pad_kv, tkv = padded_cu(lens_kv, gaps_kv)
    q, k, v = draw(tq, h, d, seed), draw(tkv, g, d, seed + 1), draw(tkv, g, dv, seed + 2)
    dpa = DotProductAttention(h, (d, dv), num_gqa_groups=g, qkv_format="thd", attn_mask_type=mask_type)
    kw = {} if max_seqlen is None else dict(max_seqlen_q=max_seqlen[0], max_seqlen_kv=max_seqlen[1])
    out = dpa(dev(q), dev(k), dev(v), cu_seqlens_q=dev(cu_q), cu_seqlens_kv=dev(cu_kv),
              cu_seqlens_q_padded=dev(pad_q), cu_seqlens_kv_padded=dev(pad_kv), **kw)
    assert out.shape == (tq, h * dv) and out.dtype == torch.float32
    dy = torch.randn(tq, h, dv, generator=torch.Generator().manual_seed(seed + 3))
    seqs = seqs_from_cu(cu_q, cu_kv, pad_q, pad_kv)
    ref, grads, _ = dpa_thd_ref(q, k, v, seqs, mask_type, 1.0 / math.sqrt(d), dy)
    e = rel_err(out, ref.reshape(tq, -1))
    assert e < TOL, ("out", e)
    out.backward(dev(dy.reshape(tq, -1)))
    for name, t, r in (("dq", q, grads[0]), ("dk", k, grads[1]), ("dv", v, grads[2])):
        e = rel_err(t.grad, r)
        assert e < 1e-4, (name, e)
    return out, (q, k, v), seqs


@needs_cpu_thd
@pytest.mark.parametrize("mask_type", ["padding", "padding_causal", "padding_causal_bottom_right",
                                       "no_mask", "causal", "causal_bottom_right"])
@pytest.mark.parametrize("h,g", [(2, 2), (4, 2), (4, 1)])
def test_thd_self_attention(mask_type, h, g):
    run_thd([3, 7, 1, 5], [3, 7, 1, 5], h, g, 8, mask_type)


@needs_cpu_thd
@pytest.mark.parametrize("mask_type", ["padding", "padding_causal", "padding_causal_bottom_right"])
def test_thd_cross_lengths_differ(mask_type):
    # q and kv lengths differ per sequence, including an empty kv and an empty q sequence
    run_thd([2, 5, 3, 0], [6, 1, 0, 4], 4, 2, 8, mask_type, dv=6)


@needs_cpu_thd
@pytest.mark.parametrize("mask_type", ["padding", "padding_causal"])
def test_thd_padded_offsets(mask_type):
    """Gaps between sequences (cu_seqlens_*_padded): gap rows of O and of dQ/dK/dV are zero."""
    out, (q, k, v), seqs = run_thd([3, 4, 2], [3, 4, 2], 4, 2, 8, mask_type, gaps_q=[0, 2, 1], gaps_kv=[0, 2, 1])
    used = torch.zeros(out.shape[0], dtype=torch.bool)
    for oq, lq, _, _ in seqs:
        used[oq:oq + lq] = True
    assert used.sum() == 9 and out.shape[0] == 13
    assert torch.all(out.detach().cpu()[~used] == 0)
    for t in (q, k, v):
        assert torch.all(t.grad[~used] == 0) and torch.all(torch.isfinite(t.grad))


@needs_cpu_thd
def test_thd_padded_offsets_cross_and_explicit_max_seqlen():
    run_thd([2, 5], [4, 3], 2, 1, 8, "padding_causal_bottom_right", gaps_q=[1, 0], gaps_kv=[0, 3],
            max_seqlen=(9, 11))


@needs_cpu_thd
def test_thd_structured_inputs_and_inference():
    """ones / arange inputs (indexing bugs show as patterns) under no_grad (no aux kept)."""
    lens = [4, 1, 3]
    cu = cu_of(lens)
    q = torch.arange(8 * 2 * 4, dtype=torch.float32).view(8, 2, 4) / 64
    k = torch.ones(8, 2, 4)
    v = torch.arange(8, dtype=torch.float32).view(8, 1, 1).expand(8, 2, 4).contiguous()
    dpa = DotProductAttention(2, 4, qkv_format="thd", attn_mask_type="padding_causal")
    with torch.no_grad():
        out = dpa(dev(q), dev(k), dev(v), cu_seqlens_q=dev(cu), cu_seqlens_kv=dev(cu))
    ref, _, _ = dpa_thd_ref(q, k, v, seqs_from_cu(cu, cu), "padding_causal", 0.5)
    assert rel_err(out, ref.reshape(8, -1)) < TOL
    # equal keys: each query averages the values it sees, i.e. the mean of its sequence's prefix
    assert torch.allclose(out.cpu()[:4, 0], torch.tensor([0.0, 0.5, 1.0, 1.5]))


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


@pytest.mark.skipif(not ON_CUDA, reason="the CUDA backend's THD rejection (NVTE_TEST_DEVICE=cuda only)")
def test_thd_cuda_is_a_clear_error():
    q, k, v = (dev(draw(6, 2, 8, 0, torch.bfloat16)) for _ in range(3))
    dpa = DotProductAttention(2, 8, qkv_format="thd", attn_mask_type="padding_causal")
    with pytest.raises(NotImplementedError, match="THD"):
        dpa(q, k, v, cu_seqlens_q=dev(cu_of([2, 4])), cu_seqlens_kv=dev(cu_of([2, 4])))


@needs_cpu_thd
def test_mha_thd_matches_per_sequence_bshd():
    """MultiheadAttention over packed [t, hidden] tokens equals running each sequence alone."""
    torch.manual_seed(0)
    m = MultiheadAttention(32, 4, attention_dropout=0.0, attn_mask_type="causal", qkv_format="thd", device=DEVICE)
    m_b = MultiheadAttention(32, 4, attention_dropout=0.0, attn_mask_type="causal", qkv_format="bshd", device=DEVICE)
    m_b.load_state_dict(m.state_dict())
    lens = [3, 6, 2]
    x = torch.randn(sum(lens), 32, generator=torch.Generator().manual_seed(2))
    cu = cu_of(lens)
    out = m(dev(x), cu_seqlens_q=dev(cu), cu_seqlens_kv=dev(cu))
    assert out.shape == (sum(lens), 32)
    parts = [m_b(dev(x[int(cu[i]):int(cu[i + 1])]).unsqueeze(0))[0] for i in range(len(lens))]
    assert rel_err(out, torch.cat(parts)) < 1e-5
    assert te.DotProductAttention is DotProductAttention and dpa_fused.thd_mask_type("causal") == "padding_causal"
