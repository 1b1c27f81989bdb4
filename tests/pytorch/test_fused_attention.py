"""DotProductAttention's fused path (fused_attention.py -> nvte_fused_attn_fwd/bwd; the CPU backend
here) against float64 references: masks, formats, GQA, windows, post-scale bias (with dBias), ALiBi,
dropout, and the backend choice (NVTE_FUSED_ATTN / NVTE_UNFUSED_ATTN)."""
import math

import pytest
import torch

from transformer_engine.pytorch import fused_attention as fa
from transformer_engine.pytorch.attention import DotProductAttention

from _util import rel_err
from test_attention import make_qkv, padding_masks, ref_mask

TOL = 2e-5


class Spy:
    """Counts the library's fused attention calls (forward, backward)."""

    def __init__(self, real):
        self.real, self.fwd, self.bwd = real, 0, 0

    def __getattr__(self, name):
        attr = getattr(self.real, name)
        if name == "fused_attn_fwd":
            def f(*a, **k):
                self.fwd += 1
                return attr(*a, **k)
            return f
        if name == "fused_attn_bwd":
            def g(*a, **k):
                self.bwd += 1
                return attr(*a, **k)
            return g
        return attr


@pytest.fixture
def spy(monkeypatch):
    s = Spy(fa._nvte)
    monkeypatch.setattr(fa, "_nvte", s)
    monkeypatch.setenv("NVTE_FUSED_ATTN", "1")
    return s


def ref_fused(q, k, v, fmt, scale, mask, bias=None, q_valid=None):
    """float64 attention with -inf masking (fully masked rows and padded queries give 0)."""
    perm = (1, 2, 0, 3) if fmt == "sbhd" else (0, 2, 1, 3)
    q, k, v = (t.double().permute(*perm) for t in (q, k, v))
    h, g = q.shape[1], k.shape[1]
    k, v = k.repeat_interleave(h // g, 1), v.repeat_interleave(h // g, 1)
    s = scale * (q @ k.transpose(-1, -2))
    if bias is not None:
        s = s + bias.double()
    if mask is not None:
        s = s.masked_fill(mask, float("-inf"))
    p = torch.nan_to_num(torch.softmax(s, -1), 0.0)
    o = p @ v
    if q_valid is not None:  # [b, sq] bool
        o = o * q_valid[:, None, :, None]
    o = o.permute(2, 0, 1, 3) if fmt == "sbhd" else o.permute(0, 2, 1, 3)
    return o.reshape(o.shape[0], o.shape[1], -1)


def run_check(spy, fmt, mask_type, b, sq, sk, h, g, d, attention_mask=None, window=None, bias=None,
              bias_type="no_bias", alibi=None, ref_bias=None, q_valid=None):
    dpa = DotProductAttention(h, d, num_gqa_groups=g, qkv_format=fmt, attn_mask_type=mask_type, window_size=window)
    q, k, v = make_qkv(fmt, b, sq, sk, h, g, d, seed=3)
    out = dpa(q, k, v, attention_mask=attention_mask, core_attention_bias_type=bias_type,
              core_attention_bias=bias, alibi_slopes=alibi)
    assert spy.fwd == 1, "the fused path was not taken"
    m = ref_mask(mask_type, b, sq, sk, attention_mask, window)
    if mask_type == "padding_causal_bottom_right":
        # The bottom-right diagonal of each sequence sits at its own lengths (TE, cuDNN).
        qm, km = attention_mask
        lq, lk = (~qm.reshape(b, sq)).sum(1), (~km.reshape(b, sk)).sum(1)
        i, j = torch.arange(sq).view(1, sq, 1), torch.arange(sk).view(1, 1, sk)
        causal = j > i + (lk - lq).view(b, 1, 1)
        m = ref_mask("padding", b, sq, sk, attention_mask) | causal.view(b, 1, sq, sk)
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    b64 = bias.detach().double().requires_grad_(True) if bias is not None else None
    rb = b64 if b64 is not None else ref_bias
    ref = ref_fused(q64, k64, v64, fmt, 1.0 / math.sqrt(d), m, rb, q_valid)
    assert rel_err(out, ref) < TOL
    dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(11))
    out.backward(dy)
    ref.backward(dy.double())
    assert spy.bwd == 1
    for t, r in ((q, q64), (k, k64), (v, v64)):
        assert rel_err(t.grad, r.grad) < 1e-4
    if bias is not None and bias.requires_grad:
        assert rel_err(bias.grad, b64.grad) < 1e-4


@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
@pytest.mark.parametrize("mask_type,sq,sk", [("no_mask", 7, 7), ("causal", 8, 8), ("causal_bottom_right", 5, 9),
                                             ("no_mask", 5, 9)])
@pytest.mark.parametrize("h,g", [(4, 4), (4, 1)])
def test_masks_formats_gqa(spy, fmt, mask_type, sq, sk, h, g):
    run_check(spy, fmt, mask_type, 2, sq, sk, h, g, 8)


@pytest.mark.parametrize("mask_type", ["padding", "padding_causal", "padding_causal_bottom_right"])
def test_padding_right_padded(spy, mask_type):
    qm, km = padding_masks(3, 6, 9)
    run_check(spy, "bshd", mask_type, 3, 6, 9, 2, 2, 8, attention_mask=(qm, km),
              q_valid=~qm.reshape(3, 6))


def test_sliding_window(spy):
    run_check(spy, "sbhd", "no_mask", 2, 9, 9, 2, 2, 8, window=(2, 1))


def test_post_scale_bias_with_dbias(spy):
    bias = torch.randn(1, 2, 6, 6, generator=torch.Generator().manual_seed(5)).requires_grad_(True)
    run_check(spy, "bshd", "causal", 2, 6, 6, 2, 2, 8, bias=bias, bias_type="post_scale_bias")


def test_alibi_custom_slopes(spy):
    slopes = torch.tensor([0.5, 0.25])
    i = torch.arange(7).view(7, 1)
    j = torch.arange(7).view(1, 7)
    ref_bias = (-slopes.view(1, 2, 1, 1) * (i - j).abs().view(1, 1, 7, 7)).double()
    run_check(spy, "bshd", "causal", 2, 7, 7, 2, 2, 8, bias_type="alibi", alibi=slopes, ref_bias=ref_bias)


def test_dropout_training_only(spy):
    dpa = DotProductAttention(2, 8, attention_dropout=0.5, qkv_format="bshd", attn_mask_type="no_mask")
    q, k, v = make_qkv("bshd", 2, 16, 16, 2, 2, 8, seed=1)
    dpa.eval()
    ref = dpa(q, k, v)
    dpa.train()
    out = dpa(q, k, v)
    assert not torch.allclose(out, ref), "dropout in training changed nothing"
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_left_padded_mask_falls_back_to_unfused(spy):
    b, s = 2, 6
    m = torch.zeros(b, 1, 1, s, dtype=torch.bool)
    m[1, ..., 0] = True  # a masked first token: not right-padded
    dpa = DotProductAttention(2, 8, qkv_format="bshd", attn_mask_type="padding")
    q, k, v = make_qkv("bshd", b, s, s, 2, 2, 8)
    dpa(q, k, v, attention_mask=m)
    assert spy.fwd == 0


def test_disabled_fused_with_bias_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("NVTE_FUSED_ATTN", "0")
    dpa = DotProductAttention(2, 8, qkv_format="bshd", attn_mask_type="no_mask")
    q, k, v = make_qkv("bshd", 2, 4, 4, 2, 2, 8)
    with pytest.raises(NotImplementedError, match="NVTE_FUSED_ATTN=0"):
        dpa(q, k, v, core_attention_bias_type="post_scale_bias", core_attention_bias=torch.zeros(1, 2, 4, 4))


def test_default_cpu_choice_is_unfused(monkeypatch):
    """On the CPU without NVTE_FUSED_ATTN the unfused path (library GEMM-free batched matmul + fused
    softmax) runs; the fused CPU reference is slower and used when needed or asked for."""
    monkeypatch.delenv("NVTE_FUSED_ATTN", raising=False)
    s = Spy(fa._nvte)
    monkeypatch.setattr(fa, "_nvte", s)
    dpa = DotProductAttention(2, 8, qkv_format="bshd", attn_mask_type="causal")
    q, k, v = make_qkv("bshd", 2, 4, 4, 2, 2, 8)
    dpa(q, k, v)
    assert s.fwd == 0
