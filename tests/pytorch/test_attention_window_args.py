"""DotProductAttention's sliding-window alignment with sq != skv on both paths, and its argument
checks (window_size, kv_channels against the head sizes, one dtype for Q, K, V, bool attention
masks).

TE aligns a window's diagonal to the top-left corner for causal / padding_causal and to the
bottom-right one for every other mask type, at each sequence's own lengths under padding
(DotProductAttention's bottom_right_diagonal default); the references here build that rule
themselves (test_attention.ref_mask)."""
import math

import pytest
import torch

from transformer_engine.pytorch.attention import DotProductAttention

from _util import dev, rel_err
from test_attention import TOL, make_qkv, padding_masks, ref_attention, ref_mask

MASKS = ["no_mask", "causal", "causal_bottom_right", "padding", "padding_causal", "padding_causal_bottom_right"]


@pytest.mark.parametrize("fused", ["0", "1"])
@pytest.mark.parametrize("window", [(1, 0), (2, 1)])
@pytest.mark.parametrize("mask_type", MASKS)
@pytest.mark.parametrize("sq,sk", [(5, 8), (8, 5)])
def test_window_alignment(mask_type, window, sq, sk, fused, monkeypatch):
    """Forward and gradients against float64 over the rows that see a key (a row that sees none, a
    padded query's or one the window leaves empty, is the paths' own business: zeros fused, a
    uniform average unfused, as in TE)."""
    monkeypatch.setenv("NVTE_FUSED_ATTN", fused)
    b, h, d = 2, 2, 8
    qm, km = padding_masks(b, sq, sk, seed=3)
    mask = (qm, km) if "padding" in mask_type else None
    dpa = DotProductAttention(h, d, attn_mask_type=mask_type, qkv_format="bshd")
    q, k, v = make_qkv("bshd", b, sq, sk, h, h, d, seed=5)
    out = dpa(dev(q), dev(k), dev(v), attention_mask=None if mask is None else tuple(dev(m) for m in mask),
              window_size=window)
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    hidden = ref_mask(mask_type, b, sq, sk, mask, window)
    ref = ref_attention(q64, k64, v64, "bshd", 1 / math.sqrt(d), hidden)
    rows = (~hidden).any(-1).expand(b, 1, sq).reshape(b, sq, 1)
    assert rows.any(), "every row hidden: nothing compared"
    assert rel_err(out.cpu() * rows, ref * rows) < TOL, (mask_type, window)
    dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(9)) * rows
    out.backward(dev(dy))
    ref.backward(dy.double())
    for t, r in ((q, q64), (k, k64), (v, v64)):
        assert rel_err(t.grad, r.grad) < 1e-4, (mask_type, window)


@pytest.mark.parametrize("window", [(-2, 0), (0, -5), (1,), (1, 0, 2), (1.5, 0), "1,0"])
def test_window_size_is_checked(window):
    with pytest.raises(ValueError, match="window_size must be a pair"):
        DotProductAttention(2, 8, window_size=window)
    dpa = DotProductAttention(2, 8, qkv_format="bshd")
    q, k, v = make_qkv("bshd", 1, 4, 4, 2, 2, 8)
    with pytest.raises(ValueError, match="window_size must be a pair"):
        dpa(dev(q), dev(k), dev(v), window_size=window)


def test_head_sizes_must_match_kv_channels():
    q, k, v = make_qkv("bshd", 1, 4, 4, 2, 2, 16)
    with pytest.raises(ValueError, match="kv_channels gives head sizes 8"):
        DotProductAttention(2, 8, qkv_format="bshd")(dev(q), dev(k), dev(v))
    with pytest.raises(ValueError, match=r"head sizes 16 \(query, key\) and 4 \(value\)"):
        DotProductAttention(2, (16, 4), qkv_format="bshd")(dev(q), dev(k), dev(v))
    out = DotProductAttention(2, (16, 16), qkv_format="bshd")(dev(q), dev(k), dev(v))
    assert out.shape == (1, 4, 32)


def test_qkv_must_share_a_dtype():
    q, k, v = make_qkv("bshd", 1, 4, 4, 2, 2, 8)
    with pytest.raises(TypeError, match="share one dtype"):
        DotProductAttention(2, 8, qkv_format="bshd")(dev(q), dev(k), dev(v.to(torch.bfloat16)))


@pytest.mark.parametrize("mask_type", ["padding", "arbitrary"])
def test_attention_mask_must_be_bool(mask_type):
    """An integer or float "keep" mask (1 = token) would be read inverted: TE takes bool masks only."""
    q, k, v = make_qkv("bshd", 2, 4, 4, 2, 2, 8)
    keep = torch.ones(2, 1, 1, 4, dtype=torch.int64) if mask_type == "padding" else torch.ones(2, 1, 4, 4)
    dpa = DotProductAttention(2, 8, qkv_format="bshd", attn_mask_type=mask_type)
    for m in (keep, keep.float(), (keep.bool(), keep)):
        with pytest.raises(TypeError, match="attention_mask must be a bool tensor"):
            dpa(dev(q), dev(k), dev(v), attention_mask=m if isinstance(m, tuple) else dev(m))
    out = dpa(dev(q), dev(k), dev(v), attention_mask=dev(~keep.bool()))
    assert out.shape == (2, 4, 16)


@pytest.mark.parametrize("fused", ["0", "1"])
@pytest.mark.parametrize("mask_type", ["no_mask", "padding"])
@pytest.mark.parametrize("sq,sk", [(5, 8), (8, 5)])
def test_bottom_right_diagonal_false_aligns_top_left(mask_type, sq, sk, fused, monkeypatch):
    """TE's bottom_right_diagonal=False on a non-causal mask type: a window's diagonal at the
    top-left corner (query i's diagonal key is i, whatever the lengths), on both paths, forward and
    gradients against float64; None / True keep the bottom-right corner. Given to forward or as
    the constructor's default."""
    monkeypatch.setenv("NVTE_FUSED_ATTN", fused)
    b, h, d = 2, 2, 8
    qm, km = padding_masks(b, sq, sk, seed=3)
    mask = (qm, km) if mask_type == "padding" else None
    q, k, v = make_qkv("bshd", b, sq, sk, h, h, d, seed=5)
    for window in ((1, 1), (2, 0), (0, 2)):
        for brd, where in ((False, "forward"), (False, "init"), (None, "forward"), (True, "forward")):
            qa, ka, va = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
            kw = dict(bottom_right_diagonal=brd) if where == "init" else {}
            dpa = DotProductAttention(h, d, attn_mask_type=mask_type, qkv_format="bshd", window_size=window, **kw)
            fkw = dict(bottom_right_diagonal=brd) if where == "forward" else {}
            out = dpa(dev(qa), dev(ka), dev(va),
                      attention_mask=None if mask is None else tuple(dev(m) for m in mask), **fkw)
            q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
            hidden = ref_mask(mask_type, b, sq, sk, mask, window, top_left=brd is False)
            ref = ref_attention(q64, k64, v64, "bshd", 1 / math.sqrt(d), hidden)
            rows = (~hidden).any(-1).expand(b, 1, sq).reshape(b, sq, 1)
            assert rows.any(), "every row hidden: nothing compared"
            case = (window, brd, where)
            assert rel_err(out.cpu() * rows, ref * rows) < TOL, case
            dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(9)) * rows
            out.backward(dev(dy))
            ref.backward(dy.double())
            for t, r in ((qa, q64), (ka, k64), (va, v64)):
                assert rel_err(t.grad.cpu(), r.grad) < 1e-4, case


@pytest.mark.parametrize("fused", ["0", "1"])
@pytest.mark.parametrize("mask_type", ["no_mask", "padding"])
def test_bottom_right_diagonal_false_aligns_alibi_top_left(mask_type, fused, monkeypatch):
    """ALiBi's distances |i + diag - j| with diag 0 under bottom_right_diagonal=False (sq != skv)."""
    from test_attn_bias import ref_alibi, ref_biased, te_default_slopes
    monkeypatch.setenv("NVTE_FUSED_ATTN", fused)
    b, sq, sk, h, d = 2, 5, 9, 2, 8
    qm, km = padding_masks(b, sq, sk, seed=4)
    mask = (qm, km) if mask_type == "padding" else None
    q, k, v = make_qkv("bshd", b, sq, sk, h, h, d, seed=7)
    dpa = DotProductAttention(h, d, attn_mask_type=mask_type, qkv_format="bshd")
    hidden = ref_mask(mask_type, b, sq, sk, mask)
    q64, k64, v64 = (t.detach().double() for t in (q, k, v))
    for brd in (False, None):
        out = dpa(dev(q), dev(k), dev(v), attention_mask=None if mask is None else tuple(dev(m) for m in mask),
                  core_attention_bias_type="alibi", bottom_right_diagonal=brd)
        bias = ref_alibi(te_default_slopes(h), b, h, sq, sk, mask_type, mask, top_left=brd is False)
        ref = ref_biased(q64, k64, v64, "bshd", 1 / math.sqrt(d), hidden, "post_scale_bias", bias)
        rows = torch.ones(b, sq, 1, dtype=torch.bool) if hidden is None else \
            (~hidden).any(-1).expand(b, 1, sq).reshape(b, sq, 1)
        assert rel_err(out.cpu() * rows, ref * rows) < TOL, brd


def test_bottom_right_diagonal_values():
    """The causal types force their own corner whatever bottom_right_diagonal says; False reaches
    DotProductAttention through MultiheadAttention and TransformerLayer (cross attention with a
    window: top-left); context parallelism and K/V-cache inference do not implement it and raise
    where it would change the result."""
    from transformer_engine.pytorch import MultiheadAttention, TransformerLayer
    b, sq, sk, h, d = 2, 5, 8, 2, 8
    q, k, v = (dev(t.detach()) for t in make_qkv("bshd", b, sq, sk, h, h, d, seed=6))
    q64, k64, v64 = (t.double().cpu() for t in (q, k, v))
    for mask_type, window in (("causal", (2, 0)), ("causal_bottom_right", (2, 0)), ("no_mask", None)):
        ref = ref_attention(q64, k64, v64, "bshd", 1 / math.sqrt(d), ref_mask(mask_type, b, sq, sk, None, window))
        for brd in (None, True, False):
            dpa = DotProductAttention(h, d, attn_mask_type=mask_type, qkv_format="bshd", window_size=window)
            assert rel_err(dpa(q, k, v, bottom_right_diagonal=brd).cpu(), ref) < TOL, (mask_type, window, brd)
    x = dev(torch.randn(sq, 1, 16))
    enc = dev(torch.randn(sk, 1, 16))  # (cross attention: sq != skv)
    mha = MultiheadAttention(16, 2, attn_mask_type="no_mask", attention_type="cross", device=x.device,
                             attention_dropout=0.0)
    top_left = mha(x, encoder_output=enc, window_size=(1, 1), bottom_right_diagonal=False)
    bottom_right = mha(x, encoder_output=enc, window_size=(1, 1), bottom_right_diagonal=True)
    assert not torch.allclose(top_left, bottom_right)
    mha.core_attention.bottom_right_diagonal = False  # (the default the constructor sets)
    assert torch.equal(mha(x, encoder_output=enc, window_size=(1, 1)), top_left)
    dec = TransformerLayer(16, 32, 2, layer_type="decoder", enc_dec_bottom_right_diagonal=False, device=x.device,
                           hidden_dropout=0.0, attention_dropout=0.0)
    y_tl = dec(x, encoder_output=enc, enc_dec_attn_mask_type="no_mask", enc_dec_window_size=(1, 1))
    y_br = dec(x, encoder_output=enc, enc_dec_attn_mask_type="no_mask", enc_dec_window_size=(1, 1),
               enc_dec_bottom_right_diagonal=True)
    assert not torch.allclose(y_tl, y_br)
    # K/V-cache inference: not implemented, raises where it matters
    from transformer_engine.pytorch import InferenceParams
    dpa = DotProductAttention(h, d, attn_mask_type="no_mask", qkv_format="bshd", window_size=(1, 1))
    ip = InferenceParams(b, 16, num_heads_kv=h, head_dim_k=d, dtype=q.dtype)
    ip.pre_step({i: sq for i in range(b)})
    with pytest.raises(NotImplementedError, match="bottom_right_diagonal=False"):
        dpa(q, q, q, inference_params=ip, bottom_right_diagonal=False)


@pytest.mark.parametrize("mask_type", ["no_mask", "padding"])
def test_bottom_right_diagonal_false_bf16_fused(mask_type):
    """The same top-left windows in bfloat16, which the GPU's fused path (cuDNN, its diagonal band
    aligned top-left) takes; against float64 at bfloat16 accuracy, forward and gradients."""
    b, sq, sk, h, d = 2, 24, 40, 2, 64
    qm, km = padding_masks(b, sq, sk, seed=8)
    mask = (qm, km) if mask_type == "padding" else None
    q, k, v = make_qkv("bshd", b, sq, sk, h, h, d, seed=11)
    for window in ((3, 2), (4, 0)):
        qa, ka, va = (dev(t.detach().to(torch.bfloat16)).requires_grad_(True) for t in (q, k, v))
        dpa = DotProductAttention(h, d, attn_mask_type=mask_type, qkv_format="bshd", window_size=window,
                                  bottom_right_diagonal=False)
        out = dpa(qa, ka, va, attention_mask=None if mask is None else tuple(dev(m) for m in mask))
        q64, k64, v64 = (t.detach().cpu().double().requires_grad_(True) for t in (qa, ka, va))
        hidden = ref_mask(mask_type, b, sq, sk, mask, window, top_left=True)
        ref = ref_attention(q64, k64, v64, "bshd", 1 / math.sqrt(d), hidden)
        rows = (~hidden).any(-1).expand(b, 1, sq).reshape(b, sq, 1)
        assert rel_err(out.float().cpu() * rows, ref * rows) < 2e-2, window
        dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)) * rows
        out.backward(dev(dy.to(torch.bfloat16)))
        ref.backward(dy.double())
        for t, r in ((qa, q64), (ka, k64), (va, v64)):
            assert rel_err(t.grad.float().cpu(), r.grad) < 3e-2, window
