"""DotProductAttention's unfused path with an attention bias (attn_bias.py): pre_scale_bias,
post_scale_bias (with its gradient) and ALiBi (TE's default slopes, [h] and [b, h] slopes) under
every mask family, against float64 references written here, and against the fused path of the
same call on the CPU backend (both must give one answer). The unfused path is forced with
NVTE_FUSED_ATTN=0; float32 inputs, so on CUDA (NVTE_TEST_DEVICE=cuda) it is the path cuDNN's
rejection of float32 leads to anyway."""
import math

import pytest
import torch

from transformer_engine.pytorch import fused_attention as fa
from transformer_engine.pytorch.attention import DotProductAttention

from _util import DEVICE, dev, rel_err
from test_attention import dev_mask, make_qkv, padding_masks, ref_mask

TOL = 2e-5


def ref_alibi(slopes, b, h, sq, sk, mask_type, attention_mask, top_left=False):
    """float64 [b, h, sq, sk]: -slope * |i + diag - j|, diag = lk - lq per sequence when the mask
    aligns bottom-right (all but causal / padding_causal, unless top_left asks the top-left corner
    of a non-causal type: TE's bottom_right_diagonal=False), else 0."""
    s = torch.as_tensor(slopes, dtype=torch.float64).reshape(-1, h)
    diag = torch.zeros(b, dtype=torch.float64)
    if not top_left and ("causal" not in mask_type or mask_type.endswith("bottom_right")):
        if "padding" in mask_type:
            qm, km = attention_mask if isinstance(attention_mask, tuple) else (attention_mask,) * 2
            diag = ((~km.reshape(b, sk)).sum(1) - (~qm.reshape(b, sq)).sum(1)).double()
        else:
            diag += sk - sq
    i = torch.arange(sq, dtype=torch.float64).view(1, sq, 1)
    j = torch.arange(sk, dtype=torch.float64).view(1, 1, sk)
    dist = (i + diag.view(b, 1, 1) - j).abs()
    return -s.view(-1, h, 1, 1) * dist.view(b, 1, sq, sk)


def te_default_slopes(h):
    """TE's documented default: 2^(-8k/n), n the largest power of two <= h, then odd powers of 2^(-4/n)."""
    n = 2 ** int(math.floor(math.log2(h)))
    out = [2.0 ** (-8.0 * k / n) for k in range(1, n + 1)]
    out += [2.0 ** (-4.0 * m / n) for m in range(1, 2 * (h - n), 2)]
    return torch.tensor(out, dtype=torch.float64)


def ref_biased(q, k, v, fmt, scale, mask, bias_type, bias):
    """float64 attention with the bias folded as TE defines it; masked scores take TE's -10000 fill
    (the unfused path's softmax: a row without visible keys is zeros, TE's kernel rule)."""
    perm = (1, 2, 0, 3) if fmt == "sbhd" else (0, 2, 1, 3)
    q, k, v = (t.permute(*perm) for t in (q, k, v))
    h, g = q.shape[1], k.shape[1]
    k, v = k.repeat_interleave(h // g, 1), v.repeat_interleave(h // g, 1)
    qk = q @ k.transpose(-1, -2)
    s = scale * (qk + bias) if bias_type == "pre_scale_bias" else scale * qk + bias
    p = torch.softmax(s if mask is None else s.masked_fill(mask, -10000.0), -1)
    if mask is not None:
        p = torch.where(mask.expand_as(p).all(-1, keepdim=True), torch.zeros_like(p), p)
    o = p @ v
    o = o.permute(2, 0, 1, 3) if fmt == "sbhd" else o.permute(0, 2, 1, 3)
    return o.reshape(o.shape[0], o.shape[1], -1)


class Count:
    """Counts the library's fused attention forwards (to know which path ran)."""

    def __init__(self, real):
        self.real, self.fwd = real, 0

    def __getattr__(self, name):
        attr = getattr(self.real, name)
        if name != "fused_attn_fwd":
            return attr

        def f(*a, **k):
            self.fwd += 1
            return attr(*a, **k)
        return f


def run(monkeypatch, path, fmt, mask_type, b, sq, sk, h, g, d, bias_type, bias=None, slopes=None,
        attention_mask=None):
    """(output, dq, dk, dv, dbias or None) of one DotProductAttention call on `path` ("unfused" /
    "fused"), float32 on the test device, a seeded output gradient."""
    count = Count(fa._nvte)
    monkeypatch.setattr(fa, "_nvte", count)
    monkeypatch.setenv("NVTE_FUSED_ATTN", "0" if path == "unfused" else "1")
    dpa = DotProductAttention(h, d, num_gqa_groups=g, qkv_format=fmt, attn_mask_type=mask_type)
    q, k, v = (dev(t.detach()).requires_grad_(True) for t in make_qkv(fmt, b, sq, sk, h, g, d, seed=4))
    bd = dev(bias.detach()).requires_grad_(True) if bias is not None else None
    out = dpa(q, k, v, attention_mask=dev_mask(attention_mask), core_attention_bias_type=bias_type,
              core_attention_bias=bd, alibi_slopes=dev(slopes))
    assert count.fwd == (0 if path == "unfused" else 1), (path, count.fwd)
    dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(9))
    if attention_mask is not None:  # no gradient into padded query rows (their output is don't-care)
        dy = dy * query_keep(attention_mask, b, sq, fmt)
    out.backward(dev(dy))
    return out, q.grad, k.grad, v.grad, (bd.grad if bd is not None else None), dy


def query_keep(masks, b, sq, fmt):
    """float [b, sq, 1] (sbhd: [sq, b, 1]): 1 on the valid query rows of padding masks, 0 on padded ones."""
    keep = (~masks[0].reshape(b, sq)).float()
    return (keep.t() if fmt == "sbhd" else keep).unsqueeze(-1)


CASES = [  # (mask type, b, sq, sk, padding masks?)
    ("no_mask", 2, 7, 7, False), ("no_mask", 2, 5, 9, False), ("causal", 2, 8, 8, False),
    ("causal", 2, 6, 9, False), ("causal_bottom_right", 2, 5, 9, False), ("padding", 3, 6, 8, True),
    ("padding_causal", 3, 8, 8, True), ("padding_causal_bottom_right", 3, 5, 9, True),
]
BIASES = ["post_scale_bias", "pre_scale_bias", "alibi", "alibi_slopes_h", "alibi_slopes_bh"]


def make_bias(kind, b, h, sq, sk, shape="1hss"):
    gen = torch.Generator().manual_seed(21)
    if kind in ("post_scale_bias", "pre_scale_bias"):
        full = {"1hss": (1, h, sq, sk), "b1ss": (b, 1, sq, sk), "bhss": (b, h, sq, sk), "hss": (h, sq, sk),
                "111s": (1, 1, 1, sk), "1h1s": (1, h, 1, sk), "b11s": (b, 1, 1, sk)}[shape]
        return kind, torch.randn(*full, generator=gen), None
    if kind == "alibi":
        return "alibi", None, None
    n = (h,) if kind == "alibi_slopes_h" else (b, h)
    return "alibi", None, 0.05 + torch.rand(*n, generator=gen)


@pytest.mark.parametrize("kind", BIASES)
@pytest.mark.parametrize("mask_type,b,sq,sk,padded", CASES)
@pytest.mark.parametrize("fmt", ["bshd", "sbhd"])
def test_unfused_bias_against_float64(monkeypatch, fmt, mask_type, b, sq, sk, padded, kind):
    h, g, d = 4, 2, 8
    bias_type, bias, slopes = make_bias(kind, b, h, sq, sk)
    masks = padding_masks(b, sq, sk) if padded else None
    out, dq, dk, dv, dbias, dy = run(monkeypatch, "unfused", fmt, mask_type, b, sq, sk, h, g, d, bias_type, bias,
                                     slopes, masks)
    q, k, v = (t.detach().double().requires_grad_(True) for t in make_qkv(fmt, b, sq, sk, h, g, d, seed=4))
    if bias_type == "alibi":
        rb = ref_alibi(slopes if slopes is not None else te_default_slopes(h), b, h, sq, sk, mask_type, masks)
    else:
        rb = bias.double().requires_grad_(True)
    m = ref_mask(mask_type, b, sq, sk, masks)
    ref = ref_biased(q, k, v, fmt, 1.0 / math.sqrt(d), m, bias_type, rb)
    if padded:  # padded query rows: zero in the fused path, don't-care here (TE's unfused path too)
        keep = query_keep(masks, b, sq, fmt).double()
        out, ref = out * dev(keep), ref * keep
    assert rel_err(out, ref) < TOL, (kind, mask_type)
    ref.backward(dy.double())  # (dy is already zero on padded query rows)
    for name, got, r in (("dq", dq, q.grad), ("dk", dk, k.grad), ("dv", dv, v.grad)):
        assert rel_err(got, r) < 1e-4, (name, kind, mask_type)
    if bias_type != "alibi":
        assert rel_err(dbias, rb.grad) < 1e-4, (kind, mask_type)


@pytest.mark.skipif(DEVICE.type == "cuda", reason="the CPU backend's fused path is the comparison (cuDNN takes no "
                                                  "float32); test_unfused_bias_against_float64 runs on CUDA")
@pytest.mark.parametrize("kind", BIASES)
@pytest.mark.parametrize("mask_type,b,sq,sk,padded", CASES)
@pytest.mark.parametrize("h", [4, 6])  # (6: TE's default slopes past the largest power of two)
def test_unfused_matches_fused_path(monkeypatch, mask_type, b, sq, sk, padded, kind, h):
    """The same call on both paths gives one answer (outputs, input and bias gradients)."""
    g, d = h, 16
    bias_type, bias, slopes = make_bias(kind, b, h, sq, sk)
    masks = padding_masks(b, sq, sk, seed=5) if padded else None
    args = ("bshd", mask_type, b, sq, sk, h, g, d, bias_type, bias, slopes, masks)
    un = run(monkeypatch, "unfused", *args)
    fu = run(monkeypatch, "fused", *args)
    # rows that see a key (the fused path writes 0 where none is visible, the unfused one TE's uniform row)
    seen = ~ref_mask(mask_type, b, sq, sk, masks).all(-1).reshape(-1, sq) if mask_type != "no_mask" else None
    keep = dev(seen.expand(b, sq).float().unsqueeze(-1)) if seen is not None else 1.0
    assert rel_err(un[0] * keep, fu[0] * keep) < TOL
    for i, name in ((1, "dq"), (2, "dk"), (3, "dv"), (4, "dbias")):
        if fu[i] is not None:
            assert rel_err(un[i], fu[i]) < 1e-4, name


@pytest.mark.parametrize("path", ["unfused", pytest.param("fused", marks=pytest.mark.skipif(
    DEVICE.type == "cuda", reason="float32 runs unfused on CUDA (cuDNN takes no float32); the bf16 fused "
    "bias shapes are test_fused_attention's test_post_scale_bias_with_dbias"))])
@pytest.mark.parametrize("shape", ["1hss", "b1ss", "bhss", "hss", "111s", "1h1s", "b11s"])
def test_bias_shapes(monkeypatch, shape, path):
    """Every bias shape TE takes, on both paths: [1 or b, 1 or h, sq, skv], [h, sq, skv], and one shared
    by all queries ([.., .., 1, skv], TE's "111s"), whose gradient sums over the queries."""
    b, h, s, d = 2, 4, 6, 8
    _, bias, _ = make_bias("post_scale_bias", b, h, s, s, shape)
    out, dq, _, _, dbias, dy = run(monkeypatch, path, "bshd", "causal", b, s, s, h, h, d, "post_scale_bias", bias)
    q, k, v = (t.detach().double().requires_grad_(True) for t in make_qkv("bshd", b, s, s, h, h, d, seed=4))
    rb = bias.double().requires_grad_(True)
    ref = ref_biased(q, k, v, "bshd", 1.0 / math.sqrt(d), ref_mask("causal", b, s, s), "post_scale_bias",
                     rb if rb.dim() == 4 else rb.unsqueeze(0))
    assert rel_err(out, ref) < TOL
    ref.backward(dy.double())
    assert dbias.shape == bias.shape and rel_err(dbias, rb.grad) < 1e-4


def test_arbitrary_mask_with_bias_runs_unfused(monkeypatch):
    """An arbitrary mask never runs fused (as in TE), so its bias is the unfused path's."""
    b, h, s, d = 2, 4, 6, 8
    mask = torch.rand(b, 1, s, s, generator=torch.Generator().manual_seed(2)) < 0.3
    _, bias, _ = make_bias("post_scale_bias", b, h, s, s)
    monkeypatch.delenv("NVTE_FUSED_ATTN", raising=False)
    dpa = DotProductAttention(h, d, qkv_format="bshd", attn_mask_type="arbitrary")
    q, k, v = make_qkv("bshd", b, s, s, h, h, d, seed=4)
    out = dpa(dev(q), dev(k), dev(v), attention_mask=dev(mask), core_attention_bias_type="post_scale_bias",
              core_attention_bias=dev(bias))
    q64, k64, v64 = (t.detach().double() for t in (q, k, v))
    ref = ref_biased(q64, k64, v64, "bshd", 1.0 / math.sqrt(d), mask, "post_scale_bias", bias.double())
    assert rel_err(out, ref) < TOL


def test_bias_errors(monkeypatch):
    """Bad biases raise on every path (checked before the path is chosen)."""
    monkeypatch.setenv("NVTE_FUSED_ATTN", "0")
    dpa = DotProductAttention(4, 8, qkv_format="bshd", attn_mask_type="causal")
    q, k, v = (dev(t.detach()) for t in make_qkv("bshd", 2, 6, 6, 4, 4, 8))
    with pytest.raises(ValueError, match="needs core_attention_bias"):
        dpa(q, k, v, core_attention_bias_type="post_scale_bias")
    with pytest.raises(ValueError, match=r"\[1 or b, 1 or h, sq, skv\]"):
        dpa(q, k, v, core_attention_bias_type="post_scale_bias", core_attention_bias=dev(torch.zeros(1, 3, 6, 6)))
    with pytest.raises(ValueError, match="alibi_slopes must be"):
        dpa(q, k, v, core_attention_bias_type="alibi", alibi_slopes=dev(torch.ones(3)))
    with pytest.raises(ValueError, match="need 'alibi'"):
        dpa(q, k, v, alibi_slopes=dev(torch.ones(4)))
    with pytest.raises(ValueError, match="alibi_slopes must be"):  # ([1, h] is [b, h] only at b = 1)
        dpa(q, k, v, core_attention_bias_type="alibi", alibi_slopes=dev(torch.ones(1, 4)))
    for bias_type in ("alibi", "no_bias"):  # a bias tensor its type would ignore
        with pytest.raises(ValueError, match="needs 'pre_scale_bias' or 'post_scale_bias'"):
            dpa(q, k, v, core_attention_bias_type=bias_type, core_attention_bias=dev(torch.zeros(1, 4, 6, 6)))
    with pytest.raises(TypeError, match="floating-point"):
        dpa(q, k, v, core_attention_bias_type="post_scale_bias",
            core_attention_bias=dev(torch.zeros(1, 4, 6, 6, dtype=torch.bool)))
    pad = DotProductAttention(4, 8, qkv_format="bshd", attn_mask_type="padding")
    with pytest.raises(ValueError, match=r"padding masks must be \[b, 1, 1, s\]"):
        pad(q, k, v, attention_mask=dev(torch.zeros(2, 1, 1, 7, dtype=torch.bool)), core_attention_bias_type="alibi")
