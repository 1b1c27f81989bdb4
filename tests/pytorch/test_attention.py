"""DotProductAttention (unfused path, library fused softmax) against float64
references written in plain torch. The modules run on NVTE_TEST_DEVICE (default the CPU backend);
inputs are drawn on the CPU and moved with dev(), references stay float64 on the CPU. float32 runs
the unfused path on CUDA as well (cuDNN takes bf16/fp16 only; test_fused_attention.py covers it).
MultiheadAttention: test_mha.py."""
import math

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.pytorch.attention import DotProductAttention, MultiheadAttention

from _util import DEVICE, dev, rel_err

TOL = 2e-5


def dev_mask(m):
    """An attention mask (a tensor, a (query, key/value) pair or None) on the test device."""
    return tuple(dev(t) for t in m) if isinstance(m, (tuple, list)) else dev(m)


def _c64(t):
    """float64 CPU copy of t that keeps autograd (references stay on the CPU)."""
    return t.double().cpu()


# ------------------------------------------------------------------ references
def ref_mask(mask_type, b, sq, sk, attention_mask=None, window=None, top_left=False):
    """[b or 1, h or 1, sq, sk] bool (True = masked) or None. top_left: a window aligned to the
    top-left corner on a non-causal mask type (TE's bottom_right_diagonal=False)."""
    m = None
    if "padding" in mask_type:
        if isinstance(attention_mask, tuple):
            qm, km = attention_mask
        else:
            qm = km = attention_mask
        m = qm.reshape(b, 1, sq, 1) | km.reshape(b, 1, 1, sk)
    elif mask_type == "arbitrary":
        m = attention_mask
    if mask_type == "padding_causal_bottom_right":
        # TE aligns the diagonal at each sequence's own lengths: key j is masked after i + lk - lq.
        lq, lk = (~qm.reshape(b, sq)).sum(1), (~km.reshape(b, sk)).sum(1)
        i, j = torch.arange(sq).view(1, sq, 1), torch.arange(sk).view(1, 1, sk)
        m = m | (j > i + (lk - lq).view(b, 1, 1)).view(b, 1, sq, sk)
    elif "causal" in mask_type:
        off = sk - sq if mask_type.endswith("bottom_right") else 0
        c = torch.ones(sq, sk, dtype=torch.bool).triu(1 + off).view(1, 1, sq, sk)
        m = c if m is None else m | c
    if window is not None:
        # TE aligns a window's diagonal top-left for causal / padding_causal, bottom-right for the
        # other mask types (at each sequence's own lengths under padding)
        if top_left or mask_type in ("causal", "padding_causal"):
            off = torch.zeros(1, 1, 1, 1, dtype=torch.long)
        elif "padding" in mask_type:
            off = ((~km.reshape(b, sk)).sum(1) - (~qm.reshape(b, sq)).sum(1)).view(b, 1, 1, 1)
        else:
            off = torch.full((1, 1, 1, 1), sk - sq)
        i = torch.arange(sq).view(1, 1, sq, 1) + off
        j = torch.arange(sk).view(1, 1, 1, sk)
        w = torch.zeros(1, 1, sq, sk, dtype=torch.bool)
        if window[0] >= 0:
            w = w | (j < i - window[0])
        if window[1] >= 0:
            w = w | (j > i + window[1])
        m = w if m is None else m | w
    return m


def ref_attention(q, k, v, fmt, scale, mask):
    """float64 softmax(scale q k^T, masked with TE's -10000 fill) v; a wholly masked row has no keys
    (zeros, TE's kernel rule); inputs in `fmt`, GQA by repetition."""
    perm = (1, 2, 0, 3) if fmt == "sbhd" else (0, 2, 1, 3)
    q, k, v = (_c64(t).permute(*perm) for t in (q, k, v))
    h, g = q.shape[1], k.shape[1]
    k, v = k.repeat_interleave(h // g, 1), v.repeat_interleave(h // g, 1)
    s = scale * (q @ k.transpose(-1, -2))
    p = torch.softmax(s if mask is None else s.masked_fill(mask.cpu(), -10000.0), -1)
    if mask is not None:
        p = torch.where(mask.cpu().expand_as(p).all(-1, keepdim=True), torch.zeros_like(p), p)
    o = p @ v
    o = o.permute(2, 0, 1, 3) if fmt == "sbhd" else o.permute(0, 2, 1, 3)
    return o.reshape(o.shape[0], o.shape[1], -1)


def make_qkv(fmt, b, sq, sk, h, g, d, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    def mk(s, n):
        shape = (s, b, n, d) if fmt == "sbhd" else (b, s, n, d)
        return torch.randn(*shape, generator=gen, dtype=dtype).requires_grad_(True)
    return mk(sq, h), mk(sk, g), mk(sk, g)


def padding_masks(b, sq, sk, seed=1):
    gen = torch.Generator().manual_seed(seed)
    lq = torch.randint(1, sq + 1, (b,), generator=gen)
    lk = torch.randint(1, sk + 1, (b,), generator=gen)
    lq[0], lk[0] = sq, sk
    qm = (torch.arange(sq).view(1, sq) >= lq.view(b, 1)).view(b, 1, 1, sq)
    km = (torch.arange(sk).view(1, sk) >= lk.view(b, 1)).view(b, 1, 1, sk)
    return qm, km


def check_dpa(fmt, mask_type, b, sq, sk, h, g, d, attention_mask=None, softmax_scale=None, window=None,
              ref_m=None, seed=0):
    dpa = DotProductAttention(h, d, num_gqa_groups=g, attention_dropout=0.0, qkv_format=fmt,
                              attn_mask_type=mask_type, window_size=window, softmax_scale=softmax_scale)
    q, k, v = make_qkv(fmt, b, sq, sk, h, g, d, seed)
    out = dpa(dev(q), dev(k), dev(v), attention_mask=dev_mask(attention_mask))
    lead = (sq, b) if fmt == "sbhd" else (b, sq)
    assert out.shape == (*lead, h * d) and out.dtype == torch.float32
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    if ref_m is None:
        ref_m = ref_mask(mask_type, b, sq, sk, attention_mask, window)
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    ref = ref_attention(q64, k64, v64, fmt, scale, ref_m)
    assert rel_err(out, ref) < TOL
    dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 7))
    out.backward(dev(dy))
    ref.backward(dy.double())
    for t, r in ((q, q64), (k, k64), (v, v64)):
        assert rel_err(t.grad, r.grad) < 1e-4, (mask_type, fmt)


# ------------------------------------------------------------------ DotProductAttention
@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
@pytest.mark.parametrize("mask_type,sq,sk", [
    ("no_mask", 7, 7), ("no_mask", 5, 9),
    ("causal", 8, 8), ("causal", 6, 9),
    ("causal_bottom_right", 8, 8), ("causal_bottom_right", 5, 9),
])
@pytest.mark.parametrize("h,g", [(4, 4), (4, 2), (4, 1)])
def test_dpa_masks_without_tensor(fmt, mask_type, sq, sk, h, g):
    check_dpa(fmt, mask_type, 2, sq, sk, h, g, 8)


@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
@pytest.mark.parametrize("mask_type", ["padding", "padding_causal", "padding_causal_bottom_right"])
@pytest.mark.parametrize("h,g", [(4, 4), (4, 2)])
def test_dpa_padding_self(fmt, mask_type, h, g):
    qm, _ = padding_masks(3, 8, 8)
    check_dpa(fmt, mask_type, 3, 8, 8, h, g, 8, attention_mask=qm)


@pytest.mark.parametrize("mask_type", ["padding", "padding_causal", "padding_causal_bottom_right"])
def test_dpa_padding_pair(mask_type):
    masks = padding_masks(3, 5, 9)
    check_dpa("bshd", mask_type, 3, 5, 9, 4, 2, 8, attention_mask=masks)


@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
@pytest.mark.parametrize("mshape", [(1, 1), (2, 1), (2, 4), (1, 4)])
def test_dpa_arbitrary(fmt, mshape):
    b, h, sq, sk = 2, 4, 6, 7
    gen = torch.Generator().manual_seed(3)
    mask = torch.rand(*mshape, sq, sk, generator=gen) < 0.3
    check_dpa(fmt, "arbitrary", b, sq, sk, h, 2, 8, attention_mask=mask)


def test_dpa_arbitrary_2d_mask():
    mask = torch.rand(6, 6, generator=torch.Generator().manual_seed(4)) < 0.4
    check_dpa("sbhd", "arbitrary", 2, 6, 6, 2, 2, 4, attention_mask=mask, ref_m=mask.view(1, 1, 6, 6))


@pytest.mark.parametrize("scale", [0.05, 1.0])
@pytest.mark.parametrize("mask_type", ["no_mask", "causal", "causal_bottom_right", "padding"])
def test_dpa_softmax_scale(scale, mask_type):
    qm, _ = padding_masks(2, 6, 6)
    check_dpa("sbhd", mask_type, 2, 6, 6, 2, 2, 8, attention_mask=qm, softmax_scale=scale)


@pytest.mark.parametrize("mask_type,window", [("no_mask", (2, 1)), ("causal", (3, 0)),
                                              ("causal_bottom_right", (2, 0)), ("no_mask", (0, 0))])
def test_dpa_sliding_window(mask_type, window):
    check_dpa("bshd", mask_type, 2, 7, 9, 2, 1, 8, window=window)


@pytest.mark.parametrize("mask_type", ["no_mask", "padding", "arbitrary"])
def test_dpa_causal_window_on_a_non_causal_mask_is_no_window(mask_type):
    """window_size (-1, 0) is TE's "causal": with a non-causal mask type TE replaces it by (-1, -1)
    with a warning (check_set_window_size), so the result is the mask type's alone, not a causal one."""
    qm, km = padding_masks(2, 7, 9)
    mask = {"no_mask": None, "padding": (qm, km),
            "arbitrary": torch.rand(2, 1, 7, 9, generator=torch.Generator().manual_seed(5)) < 0.3}[mask_type]
    with pytest.warns(UserWarning, match=r"\(-1, 0\)"):
        m = ref_mask(mask_type, 2, 7, 9, mask, None)
        check_dpa("bshd", mask_type, 2, 7, 9, 2, 1, 8, attention_mask=mask, window=(-1, 0),
                  ref_m=m if m is not None else torch.zeros(1, 1, 7, 9, dtype=torch.bool))


def test_dpa_mask_type_override_and_kv_channels_tuple():
    q, k, v = make_qkv("sbhd", 2, 6, 6, 2, 2, 8)
    dpa = DotProductAttention(2, (8, 8), attn_mask_type="causal")
    out = dpa(dev(q), dev(k), dev(v), attn_mask_type="no_mask")
    ref = ref_attention(q, k, v, "sbhd", 1 / math.sqrt(8), None)
    assert rel_err(out, ref) < TOL


def test_dpa_softmax_uses_library_kernels(monkeypatch):
    from transformer_engine import _nvte
    calls = []

    class Spy:
        def __getattr__(self, name):
            fn = getattr(_nvte, name)
            def wrapped(*a, **kw):
                calls.append(name)
                return fn(*a, **kw)
            return wrapped
    from transformer_engine.pytorch import _ops_softmax
    monkeypatch.setattr(_ops_softmax, "_nvte", Spy())  # the adapter's softmax calls all go through _ops_softmax
    expected = {"no_mask": "scaled_softmax", "causal": "scaled_upper_triang_masked_softmax",
                "causal_bottom_right": "scaled_aligned_causal_masked_softmax", "arbitrary": "scaled_masked_softmax"}
    for mt, fam in expected.items():
        calls.clear()
        q, k, v = make_qkv("sbhd", 1, 4, 4, 2, 2, 4)
        mask = torch.zeros(1, 1, 4, 4, dtype=torch.bool)
        DotProductAttention(2, 4, attn_mask_type=mt)(dev(q), dev(k), dev(v),
                                                     attention_mask=dev(mask)).sum().backward()
        assert [c for c in calls if "softmax" in c] == [fam + "_forward", fam + "_backward"], (mt, calls)


def test_dpa_dropout():
    q0, k0, v0 = make_qkv("sbhd", 2, 8, 8, 2, 2, 8)
    q, k, v = dev(q0), dev(k0), dev(v0)
    dpa = DotProductAttention(2, 8, attention_dropout=0.0, attn_mask_type="no_mask")
    dpa.train()
    a, b2 = dpa(q, k, v), dpa(q, k, v)
    assert torch.equal(a, b2)  # dropout 0: deterministic in training mode
    dpa = DotProductAttention(2, 8, attention_dropout=0.5, attn_mask_type="no_mask")
    dpa.eval()
    e1, e2 = dpa(q, k, v), dpa(q, k, v)
    assert torch.equal(e1, e2) and torch.equal(e1, a)  # eval: no dropout
    dpa.train()
    torch.manual_seed(5)
    t1 = dpa(q, k, v)
    torch.manual_seed(5)
    t2 = dpa(q, k, v)
    assert torch.equal(t1, t2) and not torch.allclose(t1, a)
    t1.sum().backward()
    assert q0.grad is not None and torch.isfinite(q0.grad).all()


def test_dpa_errors():
    q, k, v = (dev(t) for t in make_qkv("sbhd", 1, 4, 4, 2, 2, 4))
    with pytest.raises(ValueError):
        DotProductAttention(2, 4, attn_mask_type="bogus")
    with pytest.raises(ValueError):
        DotProductAttention(3, 4, num_gqa_groups=2)
    with pytest.raises(ValueError, match="qkv_format"):
        DotProductAttention(2, 4, qkv_format="tbhd")
    with pytest.raises(ValueError, match="3D"):  # thd takes [t, h, d]
        DotProductAttention(2, 4, qkv_format="thd")(q, k, v)
    with pytest.raises(ValueError):
        DotProductAttention(2, 4, attn_mask_type="padding")(q, k, v)
    with pytest.raises(ValueError):
        DotProductAttention(2, 4, attn_mask_type="arbitrary")(q, k, v)
    with pytest.raises(TypeError):
        DotProductAttention(2, 4)(*(t.detach().double() for t in (q, k, v)))
    with pytest.raises(ValueError):
        DotProductAttention(4, 4)(q, k, v)


def test_unimplemented_arguments_raise_instead_of_being_ignored():
    """TE arguments this adapter does not implement raise when set (ignoring them would change the
    result silently); left at None / False they are accepted, as are those that change no result."""
    q, k, v = (dev(t) for t in make_qkv("sbhd", 1, 4, 4, 2, 2, 4))
    dpa = DotProductAttention(2, 4, name="core")
    assert dpa.name == "core"
    ref = dpa(q, k, v)
    for kw in (dict(fp8_output=True), dict(score_mod=lambda s: s)):
        with pytest.raises(NotImplementedError, match=f"not implemented in this adapter: \\['{next(iter(kw))}'\\]"):
            dpa(q, k, v, **kw)
    with pytest.raises(TypeError, match="unexpected keyword argument 'cu_seqlen_q'"):  # (a misspelt name)
        dpa(q, k, v, cu_seqlen_q=dev(torch.tensor([0, 4], dtype=torch.int32)))
    out = dpa(q, k, v, fp8_output=False, score_mod=None, num_splits=2)
    assert torch.equal(out, ref)
    x = dev(torch.randn(4, 1, 8))
    mha = MultiheadAttention(8, 2, seq_length=4, micro_batch_size=1, qk_norm_eps=1e-6, device=DEVICE)
    with pytest.raises(NotImplementedError, match="fp8_output"):
        mha(x, fp8_output=True)
    assert MultiheadAttention(8, 2, qk_norm_type="RMSNorm", device=DEVICE).q_norm is not None  # (test_qk_norm.py)


def test_exports():
    assert te.DotProductAttention is DotProductAttention and te.MultiheadAttention is MultiheadAttention


def test_te2_submodule_import_paths():
    """TE 2.x's module paths under transformer_engine.pytorch.attention name the same objects."""
    from transformer_engine.pytorch.attention.dot_product_attention import DotProductAttention as D
    from transformer_engine.pytorch.attention.dot_product_attention.dot_product_attention import (
        DotProductAttention as D2)
    assert D2 is D
    from transformer_engine.pytorch.attention.multi_head_attention import MultiheadAttention as M
    from transformer_engine.pytorch.attention.inference import InferenceParams, PagedKVCacheManager
    from transformer_engine.pytorch.attention.rope import RotaryPositionEmbedding, apply_rotary_pos_emb
    assert D is te.DotProductAttention and M is te.MultiheadAttention and InferenceParams is te.InferenceParams
    assert RotaryPositionEmbedding is te.RotaryPositionEmbedding and apply_rotary_pos_emb is te.apply_rotary_pos_emb
    assert PagedKVCacheManager is te.inference.PagedKVCacheManager


@pytest.mark.parametrize("alias", ["padding,causal", "causal,padding"])
def test_mask_type_aliases(alias):
    """TE's older spellings of padding_causal, in the constructor and per call."""
    qm, _ = padding_masks(3, 8, 8)
    q, k, v = (dev(t.detach()) for t in make_qkv("bshd", 3, 8, 8, 4, 2, 8))
    want = DotProductAttention(4, 8, num_gqa_groups=2, qkv_format="bshd", attn_mask_type="padding_causal")(
        q, k, v, attention_mask=dev(qm))
    dpa = DotProductAttention(4, 8, num_gqa_groups=2, qkv_format="bshd", attn_mask_type=alias)
    assert dpa.attn_mask_type == "padding_causal"
    assert torch.equal(dpa(q, k, v, attention_mask=dev(qm)), want)
    other = DotProductAttention(4, 8, num_gqa_groups=2, qkv_format="bshd", attn_mask_type="no_mask")
    assert torch.equal(other(q, k, v, attention_mask=dev(qm), attn_mask_type=alias), want)


def _saved_bytes(fn):
    """(result of fn(), bytes of the tensors autograd saved for backward while it ran)."""
    total = [0]

    def pack(t):
        total[0] += t.numel() * t.element_size()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, total[0]


@pytest.mark.parametrize("dropout", [0.0, 0.2])
@pytest.mark.parametrize("fused", ["0", "1"])
def test_checkpoint_core_attention(monkeypatch, fused, dropout):
    """checkpoint_core_attention=True (TE's recompute in backward): the same output and gradients,
    dropout included (torch's RNG state is replayed), while autograd keeps fewer bytes (the unfused
    path's probabilities are not kept)."""
    monkeypatch.setenv("NVTE_FUSED_ATTN", fused)
    b, s, h, d = 2, 32, 4, 8
    bias = dev(torch.randn(1, h, s, s)).requires_grad_(True)
    res = {}
    for ckpt in (False, True):
        dpa = DotProductAttention(h, d, attention_dropout=dropout, qkv_format="bshd", attn_mask_type="causal")
        q, k, v = (dev(t.detach()).requires_grad_(True) for t in make_qkv("bshd", b, s, s, h, h, d, seed=5))
        bias.grad = None
        torch.manual_seed(123)
        if torch.cuda.is_available():
            torch.cuda.manual_seed(123)
        out, saved = _saved_bytes(lambda: dpa(q, k, v, checkpoint_core_attention=ckpt,
                                              core_attention_bias_type="post_scale_bias", core_attention_bias=bias))
        out.backward(dev(torch.randn(out.shape, generator=torch.Generator().manual_seed(1))))
        res[ckpt] = (out.detach(), q.grad, k.grad, v.grad, bias.grad.clone(), saved)
    for a, b_, name in zip(res[False][:5], res[True][:5], ("out", "dq", "dk", "dv", "dbias")):
        assert torch.equal(a, b_), name
    assert res[True][5] < res[False][5], (res[True][5], res[False][5])
    if fused == "0":  # the probabilities ([b, h, s, s] floats) were the bulk of what the plain call kept
        assert res[False][5] - res[True][5] >= b * h * s * s * 4


@pytest.mark.parametrize("fused", ["0", "1"])
def test_checkpoint_core_attention_learnable_sink(monkeypatch, fused):
    """The learnable softmax offset's gradient is the same with the recompute."""
    monkeypatch.setenv("NVTE_FUSED_ATTN", fused)
    grads = []
    for ckpt in (False, True):
        torch.manual_seed(0)
        dpa = DotProductAttention(4, 8, qkv_format="bshd", attn_mask_type="causal", softmax_type="learnable")
        with torch.no_grad():
            dpa.softmax_offset.copy_(torch.tensor([0.5, -1.0, 0.0, 2.0]))
        q, k, v = (dev(t.detach()).requires_grad_(True) for t in make_qkv("bshd", 2, 12, 12, 4, 4, 8, seed=3))
        dpa(q, k, v, checkpoint_core_attention=ckpt).square().sum().backward()
        grads.append((dpa.softmax_offset.grad.clone(), q.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


def test_checkpoint_core_attention_recomputes_outside_fp8(monkeypatch):
    """A checkpointed call made outside FP8 attention recomputes outside it, even when its backward
    runs inside an fp8_autocast with fp8_dpa (the forward's path, not the backward's)."""
    from transformer_engine.common.recipe import DelayedScaling
    monkeypatch.setenv("NVTE_FUSED_ATTN", "1")
    dpa = DotProductAttention(4, 8, qkv_format="bshd", attn_mask_type="causal")
    res = []
    for inside in (False, True):
        q, k, v = (dev(t.detach()).requires_grad_(True) for t in make_qkv("bshd", 2, 12, 12, 4, 4, 8, seed=3))
        out = dpa(q, k, v, checkpoint_core_attention=True)
        if inside:
            with te.fp8_autocast(enabled=True, fp8_recipe=DelayedScaling(fp8_dpa=True)):
                out.square().sum().backward()
        else:
            out.square().sum().backward()
        res.append(q.grad)
    assert torch.equal(res[0], res[1])


def test_mha_passes_checkpoint_core_attention(monkeypatch):
    monkeypatch.setenv("NVTE_FUSED_ATTN", "0")
    torch.manual_seed(0)
    m = MultiheadAttention(32, 4, attention_dropout=0.0, attn_mask_type="causal", device=DEVICE)
    x = dev(torch.randn(24, 2, 32)).requires_grad_(True)
    (y0, s0), (y1, s1) = (_saved_bytes(lambda: m(x, checkpoint_core_attention=c)) for c in (False, True))
    assert torch.equal(y0, y1) and s1 < s0 - 2 * 4 * 24 * 24 * 4 // 2


class _Tracker:
    """A stand-in for Megatron's RNG tracker (TE's get_rng_state_tracker): fork() runs its body on
    this tracker's own generator states and restores the default ones after."""

    def __init__(self, seed):
        saved = self._get()
        torch.manual_seed(seed)
        self.state = self._get()
        self._set(saved)

    @staticmethod
    def _get():
        return (torch.random.get_rng_state(), torch.cuda.get_rng_state() if torch.cuda.is_available() else None)

    @staticmethod
    def _set(s):
        torch.random.set_rng_state(s[0])
        if s[1] is not None:
            torch.cuda.set_rng_state(s[1])

    def fork(self):
        import contextlib

        @contextlib.contextmanager
        def ctx():
            saved = self._get()
            self._set(self.state)
            try:
                yield
            finally:
                self.state = self._get()
                self._set(saved)
        return ctx()


@pytest.mark.parametrize("fused", ["0", "1"])
def test_dropout_draws_from_the_rng_state_tracker(monkeypatch, fused):
    """With get_rng_state_tracker (TE's / Megatron's), attention dropout draws from the tracker's
    stream on both paths: the mask follows the tracker's seed, and the default generator is left
    as it was."""
    monkeypatch.setenv("NVTE_FUSED_ATTN", fused)
    q, k, v = (dev(t.detach()) for t in make_qkv("bshd", 2, 16, 16, 4, 4, 8, seed=3))

    def run(tracker_seed, global_seed):
        tracker = _Tracker(tracker_seed)
        dpa = DotProductAttention(4, 8, attention_dropout=0.3, qkv_format="bshd", attn_mask_type="causal",
                                  get_rng_state_tracker=lambda: tracker)
        torch.manual_seed(global_seed)
        before = _Tracker._get()
        out = dpa(q, k, v)
        after = _Tracker._get()
        same = torch.equal(before[0], after[0]) and (before[1] is None or torch.equal(before[1], after[1]))
        return out, same
    a, untouched = run(7, 0)
    b, _ = run(7, 1)
    c, _ = run(8, 0)
    assert untouched, "attention dropout drew from the default generator"
    assert torch.equal(a, b) and not torch.equal(a, c)
    plain = DotProductAttention(4, 8, attention_dropout=0.3, qkv_format="bshd", attn_mask_type="causal")
    torch.manual_seed(0)
    before = torch.random.get_rng_state()
    plain(q, k, v)
    if DEVICE.type == "cpu":  # (without a tracker the default generator is drawn from)
        assert not torch.equal(before, torch.random.get_rng_state())
