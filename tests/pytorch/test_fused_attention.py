"""DotProductAttention's fused path (fused_attention.py -> nvte_fused_attn_fwd/bwd) against float64
references: masks, formats, GQA, windows, post-scale bias (with dBias), ALiBi, dropout, and the
backend choice (NVTE_FUSED_ATTN / NVTE_UNFUSED_ATTN).

On the CPU (default) the library's float32 reference runs and is held to rel_err < TOL (grads 1e-4).
With NVTE_TEST_DEVICE=cuda the inputs are bfloat16 (cuDNN takes bf16/fp16 only; float32 runs the
unfused path there) and each result is held to flash-attention's rule: its largest error against
the float64 reference is at most 2x that of a naive bfloat16 torch implementation of the same
attention on the same device (ref_fused in bfloat16)."""
import math

import pytest
import torch

from transformer_engine.pytorch import fused_attention as fa
from transformer_engine.pytorch.attention import DotProductAttention

from _util import DEVICE, dev, rel_err
from test_attention import dev_mask, make_qkv, padding_masks, ref_mask

TOL = 2e-5
ON_GPU = DEVICE.type == "cuda"
DT = torch.bfloat16 if ON_GPU else torch.float32  # Q, K, V dtype of the fused-path checks


def assert_close_fused(got, ref, naive, tol, what):
    """CPU: rel_err(got, ref) < tol. CUDA: max|got - ref| <= 2 max|naive - ref| (flash-attention's
    rule; ref is float64 on the CPU, naive the same-precision torch attention on the device)."""
    if naive is None:
        e = rel_err(got, ref)
        assert e < tol, (what, e)
        return
    ref = ref.detach().double().cpu()
    e = float((got.detach().double().cpu() - ref).abs().max())
    e_naive = float((naive.detach().double().cpu() - ref).abs().max())
    assert e <= 2.0 * e_naive, (what, e, e_naive)


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


def ref_fused(q, k, v, fmt, scale, mask, bias=None, q_valid=None, dtype=torch.float64):
    """Attention with -inf masking (fully masked rows and padded queries give 0), computed in
    `dtype` (float64: the reference; bfloat16: the naive same-precision implementation)."""
    perm = (1, 2, 0, 3) if fmt == "sbhd" else (0, 2, 1, 3)
    q, k, v = (t.to(dtype).permute(*perm) for t in (q, k, v))
    h, g = q.shape[1], k.shape[1]
    k, v = k.repeat_interleave(h // g, 1), v.repeat_interleave(h // g, 1)
    s = scale * (q @ k.transpose(-1, -2))
    if bias is not None:
        s = s + bias.to(dtype)
    if mask is not None:
        s = s.masked_fill(mask, float("-inf"))
    p = torch.nan_to_num(torch.softmax(s, -1), 0.0)
    o = p @ v
    if q_valid is not None:  # [b, sq] bool
        o = o * q_valid[:, None, :, None]
    o = o.permute(2, 0, 1, 3) if fmt == "sbhd" else o.permute(0, 2, 1, 3)
    return o.reshape(o.shape[0], o.shape[1], -1)


def check_out_and_backward(out, ref, naive):
    """assert_close_fused on the output, then one seeded output gradient (in DT) back through the
    result, the float64 reference and the naive implementation (None on the CPU); returns it."""
    assert_close_fused(out, ref, naive, TOL, "out")
    dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(11)).to(DT)
    out.backward(dev(dy))
    ref.backward(dy.double())
    if naive is not None:
        naive.backward(dev(dy))
    return dy


def run_check(spy, fmt, mask_type, b, sq, sk, h, g, d, attention_mask=None, window=None, bias=None,
              bias_type="no_bias", alibi=None, ref_bias=None, q_valid=None):
    dpa = DotProductAttention(h, d, num_gqa_groups=g, qkv_format=fmt, attn_mask_type=mask_type, window_size=window)
    q, k, v = make_qkv(fmt, b, sq, sk, h, g, d, seed=3, dtype=DT)
    out = dpa(dev(q), dev(k), dev(v), attention_mask=dev_mask(attention_mask), core_attention_bias_type=bias_type,
              core_attention_bias=dev(bias), alibi_slopes=dev(alibi))
    assert spy.fwd == 1, "the fused path was not taken"
    m = ref_mask(mask_type, b, sq, sk, attention_mask, window)
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    b64 = bias.detach().double().requires_grad_(True) if bias is not None else None
    rb = b64 if b64 is not None else ref_bias
    ref = ref_fused(q64, k64, v64, fmt, 1.0 / math.sqrt(d), m, rb, q_valid)
    naive = qn = kn = vn = bn = None
    if ON_GPU:  # the same attention in plain torch, bfloat16 on the device
        qn, kn, vn = (dev(t.detach()).requires_grad_(True) for t in (q, k, v))
        bn = dev(bias.detach()).to(DT).requires_grad_(True) if bias is not None else None
        naive = ref_fused(qn, kn, vn, fmt, 1.0 / math.sqrt(d), dev(m), bn if bn is not None else dev(ref_bias),
                          dev(q_valid), dtype=DT)
    check_out_and_backward(out, ref, naive)
    assert spy.bwd == 1
    for name, t, r, n in (("dq", q, q64, qn), ("dk", k, k64, kn), ("dv", v, v64, vn)):
        assert_close_fused(t.grad, r.grad, None if n is None else n.grad, 1e-4, name)
    if bias is not None and bias.requires_grad:
        assert_close_fused(bias.grad, b64.grad, None if bn is None else bn.grad, 1e-4, "dbias")


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


@pytest.mark.parametrize("mask_type,window", [("no_mask", (2, 1)), ("causal", (2, 0))])
def test_sliding_window(spy, mask_type, window):
    run_check(spy, "sbhd", mask_type, 2, 9, 9, 2, 2, 8, window=window)


def test_sliding_window_left_only(spy):
    """A left window without a causal mask: aligned to the bottom-right diagonal (the adapter's
    choice for non-causal masks), which with equal lengths is the top-left one the GPU takes."""
    run_check(spy, "bshd", "no_mask", 2, 9, 9, 2, 2, 8, window=(3, -1))


@pytest.mark.parametrize("window", [(3, -1), (3, 1)])
def test_bottom_right_window_with_cross_lengths(spy, window):
    """A left window on a non-causal mask is aligned to the bottom-right diagonal (the adapter's
    choice); with sq != skv the fused path runs it (on the GPU: cuDNN's diagonal band aligned
    bottom-right; it ran unfused before cuDNN's band took an alignment here)."""
    run_check(spy, "bshd", "no_mask", 2, 5, 9, 2, 2, 8, window=window)


@pytest.mark.parametrize("shape", [(1, 2, 6, 6), (1, 1, 1, 6), (1, 2, 1, 6), (2, 1, 1, 6)])
def test_post_scale_bias_with_dbias(spy, shape):
    """Bias shapes on the fused path, gradients included: [1, h, sq, skv] and those shared by all
    queries ([.., .., 1, skv], TE's "111s": broadcast, their gradient summed over the queries)."""
    bias = torch.randn(*shape, generator=torch.Generator().manual_seed(5)).requires_grad_(True)
    run_check(spy, "bshd", "causal", 2, 6, 6, 2, 2, 8, bias=bias, bias_type="post_scale_bias")


@pytest.mark.skipif(ON_GPU, reason="ALiBi with caller-given slopes runs fused on the CPU backend only (cuDNN "
                                    "rejects it; see test_alibi_custom_slopes_cuda_runs_unfused)")
def test_alibi_custom_slopes(spy):
    slopes = torch.tensor([0.5, 0.25])
    i = torch.arange(7).view(7, 1)
    j = torch.arange(7).view(1, 7)
    ref_bias = (-slopes.view(1, 2, 1, 1) * (i - j).abs().view(1, 1, 7, 7)).double()
    run_check(spy, "bshd", "causal", 2, 7, 7, 2, 2, 8, bias_type="alibi", alibi=slopes, ref_bias=ref_bias)


@pytest.mark.skipif(not ON_GPU, reason="CUDA backend limitation (NVTE_TEST_DEVICE=cuda only)")
def test_alibi_custom_slopes_cuda_runs_unfused(spy):
    """cuDNN takes only its default slopes: caller-given ones run the unfused path (attn_bias.py),
    held to the 2x-naive rule against float64."""
    slopes = torch.tensor([0.5, 0.25])
    dpa = DotProductAttention(2, 8, qkv_format="bshd", attn_mask_type="causal")
    q, k, v = make_qkv("bshd", 2, 7, 7, 2, 2, 8, dtype=DT)
    out = dpa(dev(q), dev(k), dev(v), core_attention_bias_type="alibi", alibi_slopes=dev(slopes))
    assert spy.fwd == 0
    i, j = torch.arange(7).view(7, 1), torch.arange(7).view(1, 7)
    rb = -slopes.view(1, 2, 1, 1).double() * (i - j).abs().view(1, 1, 7, 7)
    m = torch.ones(7, 7, dtype=torch.bool).triu(1).view(1, 1, 7, 7)
    ref = ref_fused(q.double(), k.double(), v.double(), "bshd", 1.0 / math.sqrt(8), m, rb)
    naive = ref_fused(dev(q), dev(k), dev(v), "bshd", 1.0 / math.sqrt(8), dev(m), dev(rb), dtype=DT)
    assert_close_fused(out, ref, naive, TOL, "out")


@pytest.mark.skipif(not ON_GPU, reason="the GPU backend's head-size rule (NVTE_TEST_DEVICE=cuda only; the CPU "
                                       "backend takes every head size)")
def test_head_size_cudnn_rejects_runs_unfused(spy):
    """A head size that is not a multiple of 8: the backend query says no, so the module runs the
    unfused path (it used to pick the fused one and fail inside cuDNN's graph validation)."""
    dpa = DotProductAttention(2, 12, qkv_format="bshd", attn_mask_type="causal")
    q, k, v = make_qkv("bshd", 2, 7, 7, 2, 2, 12, dtype=DT)
    out = dpa(dev(q), dev(k), dev(v))
    assert spy.fwd == 0
    ref = ref_fused(*(t.double() for t in (q, k, v)), "bshd", 1.0 / math.sqrt(12), ref_mask("causal", 2, 7, 7))
    assert rel_err(out.cpu(), ref) < 2e-2


def test_dropout_training_only(spy):
    dpa = DotProductAttention(2, 8, attention_dropout=0.5, qkv_format="bshd", attn_mask_type="no_mask")
    q0, k0, v0 = make_qkv("bshd", 2, 16, 16, 2, 2, 8, seed=1, dtype=DT)
    q, k, v = dev(q0), dev(k0), dev(v0)
    dpa.eval()
    ref = dpa(q, k, v)
    dpa.train()
    out = dpa(q, k, v)
    assert not torch.allclose(out, ref), "dropout in training changed nothing"
    assert spy.fwd == 2
    out.float().sum().backward()
    assert spy.bwd == 1
    assert all(torch.isfinite(t.grad).all() for t in (q0, k0, v0))


def test_left_padded_mask_falls_back_to_unfused(spy):
    b, s = 2, 6
    m = torch.zeros(b, 1, 1, s, dtype=torch.bool)
    m[1, ..., 0] = True  # a masked first token: not right-padded
    dpa = DotProductAttention(2, 8, qkv_format="bshd", attn_mask_type="padding")
    q, k, v = make_qkv("bshd", b, s, s, 2, 2, 8, dtype=DT)
    dpa(dev(q), dev(k), dev(v), attention_mask=dev(m))
    assert spy.fwd == 0


def test_padding_mask_conversion_is_remembered_per_mask(spy, monkeypatch):
    """One padding mask object passed to several layers is converted (and checked on the host: a
    device sync on the GPU) once, for query and key/value alike; an in-place change of that mask, or
    another mask object, is converted anew, and every call's output is that of its own mask (a
    right-padded mask runs fused, the changed left-padded one unfused)."""
    calls = []
    real = fa.padding_to_cu_seqlens
    monkeypatch.setattr(fa, "padding_to_cu_seqlens", lambda *a: calls.append(1) or real(*a))
    b, s, h, d = 3, 6, 2, 8
    dpa = DotProductAttention(h, d, qkv_format="bshd", attn_mask_type="padding")
    q, k, v = make_qkv("bshd", b, s, s, h, h, d, dtype=DT)
    mask = (torch.arange(s).view(1, s) >= torch.tensor([6, 4, 2]).view(b, 1)).view(b, 1, 1, s)
    dm = dev(mask)  # (the same object on the CPU)

    def check(m, fused_calls):
        out = dpa(dev(q), dev(k), dev(v), attention_mask=dm)
        valid = ~m.reshape(b, s)  # (padded queries' rows differ between the paths: 0 fused, TE's fill unfused)
        ref = ref_fused(*(t.double() for t in (q, k, v)), "bshd", 1.0 / math.sqrt(d),
                        ref_mask("padding", b, s, s, m), q_valid=valid)
        assert rel_err(out.cpu()[valid], ref[valid]) < (2e-2 if ON_GPU else TOL)
        assert spy.fwd == fused_calls

    for layer in range(3):
        check(mask, layer + 1)
    assert len(calls) == 1
    mask[1, ..., 0] = True  # sequence 1 is no longer right-padded: changed in place
    dm[1, ..., 0] = True
    check(mask, 3)
    assert len(calls) == 2
    check(mask, 3)
    assert len(calls) == 2
    dm = dev(padding_masks(b, s, s, seed=5)[0])  # a new mask object
    check(dm.cpu(), 4)
    assert len(calls) == 3


def test_padding_mask_made_in_inference_mode(spy):
    """A padding mask created under torch.inference_mode (no version counter) is converted on each
    call, not remembered, and the fused call's result is that mask's."""
    b, s, h, d = 2, 5, 2, 8
    dpa = DotProductAttention(h, d, qkv_format="bshd", attn_mask_type="padding")
    q, k, v = make_qkv("bshd", b, s, s, h, h, d, dtype=DT)
    with torch.inference_mode():
        m = torch.arange(s).view(1, 1, 1, s) >= torch.tensor([5, 3]).view(b, 1, 1, 1)
        out = dpa(dev(q), dev(k), dev(v), attention_mask=dev(m))
    valid = ~m.reshape(b, s)
    ref = ref_fused(*(t.double() for t in (q, k, v)), "bshd", 1.0 / math.sqrt(d), ref_mask("padding", b, s, s, m),
                    q_valid=valid)
    assert spy.fwd == 1 and rel_err(out.cpu()[valid], ref[valid]) < (2e-2 if ON_GPU else TOL)


def test_both_paths_disabled_with_bias_is_a_clear_error(monkeypatch):
    """NVTE_FUSED_ATTN=0 alone runs a biased call unfused (test_attn_bias.py); with the unfused path
    off too, nothing can run it."""
    monkeypatch.setenv("NVTE_FUSED_ATTN", "0")
    monkeypatch.setenv("NVTE_UNFUSED_ATTN", "0")
    dpa = DotProductAttention(2, 8, qkv_format="bshd", attn_mask_type="no_mask")
    q, k, v = make_qkv("bshd", 2, 4, 4, 2, 2, 8, dtype=DT)
    with pytest.raises(NotImplementedError, match="NVTE_FUSED_ATTN=0.*NVTE_UNFUSED_ATTN=0"):
        dpa(dev(q), dev(k), dev(v), core_attention_bias_type="post_scale_bias",
            core_attention_bias=dev(torch.zeros(1, 2, 4, 4)))


def test_default_cpu_choice_is_unfused(monkeypatch):
    """On the CPU without NVTE_FUSED_ATTN the unfused path (library GEMM-free batched matmul + fused
    softmax) runs; the fused CPU reference is slower and used when needed or asked for.
    CPU-only by nature: its tensors stay on the CPU in every NVTE_TEST_DEVICE mode."""
    monkeypatch.delenv("NVTE_FUSED_ATTN", raising=False)
    s = Spy(fa._nvte)
    monkeypatch.setattr(fa, "_nvte", s)
    dpa = DotProductAttention(2, 8, qkv_format="bshd", attn_mask_type="causal")
    q, k, v = make_qkv("bshd", 2, 4, 4, 2, 2, 8)
    dpa(q, k, v)
    assert s.fwd == 0


@pytest.mark.skipif(not ON_GPU, reason="the CUDA default backend choice (NVTE_TEST_DEVICE=cuda only)")
def test_default_cuda_choice(monkeypatch):
    """CUDA tensors without NVTE_FUSED_ATTN: bf16/fp16 take the fused (cuDNN) path, float32 runs
    unfused (cuDNN takes no float32) and still matches the float64 reference."""
    monkeypatch.delenv("NVTE_FUSED_ATTN", raising=False)
    s = Spy(fa._nvte)
    monkeypatch.setattr(fa, "_nvte", s)
    dpa = DotProductAttention(2, 8, qkv_format="bshd", attn_mask_type="causal")
    for dt in (torch.bfloat16, torch.float16):
        q, k, v = make_qkv("bshd", 2, 4, 4, 2, 2, 8, dtype=dt)
        dpa(dev(q), dev(k), dev(v))
    assert s.fwd == 2
    q, k, v = make_qkv("bshd", 2, 4, 4, 2, 2, 8)
    out = dpa(dev(q), dev(k), dev(v))
    assert s.fwd == 2
    ref = ref_fused(q, k, v, "bshd", 1.0 / math.sqrt(8), ref_mask("causal", 2, 4, 4))
    assert rel_err(out, ref) < TOL


@pytest.mark.parametrize("dropout", [0.0, 0.5])
def test_rng_state_copy_only_with_dropout(dropout):
    """The forward keeps a copy of rng_state for the backward only when there is dropout (without,
    the backward never reads it and the aux slot gets no buffer: no device copy); the backward runs
    either way and repeats the forward's dropout mask (dQ of a second identical call agrees)."""
    q, k, v = (dev(x).to(DT) for x in make_qkv("bshd", 2, 16, 16, 2, 2, 8, seed=3, dtype=torch.float32))
    rng = torch.tensor([1234, 0], dtype=torch.int64, device=DEVICE)
    args = (None, None, None, None, None, rng, 16, 16, True, 8 ** -0.5, dropout, fa.LAYOUTS["bshd"],
            fa.BIAS_INT["no_bias"], fa.MASK_INT["no_mask"], -1, -1, False)
    o, stats, rng_copy, bias_copy = fa.fused_attn_fwd(q, k, v, *args)
    if dropout > 0.0:
        assert torch.equal(rng_copy, rng)
    else:
        assert rng_copy.numel() == 0
    do = torch.ones_like(o)
    grads = [fa.fused_attn_bwd(q, k, v, o, do, stats, rng_copy, bias_copy, None, None, None, None, 16, 16,
                               8 ** -0.5, dropout, fa.LAYOUTS["bshd"], fa.BIAS_INT["no_bias"],
                               fa.MASK_INT["no_mask"], -1, -1, False, False)[0] for _ in range(2)]
    assert torch.isfinite(grads[0]).all() and torch.equal(grads[0], grads[1])


@pytest.mark.parametrize("env,want", [(None, False), ("1", False), ("0", True)])
def test_deterministic_flag_follows_the_env(monkeypatch, env, want):
    """NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 (TE's variable, default 1) asks the library for its
    deterministic backward (nvte_fused_attn_bwd's `deterministic`, 4th from last)."""
    seen = {"bwd": []}
    real = fa._nvte

    class Rec(Spy):
        def __getattr__(self, name):
            attr = getattr(real, name)
            if name == "fused_attn_bwd":
                return lambda *a: (seen["bwd"].append(a[-4]), attr(*a))[1]
            return attr

    monkeypatch.setattr(fa, "_nvte", Rec(real))
    monkeypatch.setenv("NVTE_FUSED_ATTN", "1")
    if env is None:
        monkeypatch.delenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", raising=False)
    else:
        monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", env)
    q, k, v = make_qkv("bshd", 2, 5, 5, 2, 2, 8, seed=7, dtype=DT)
    dpa = DotProductAttention(2, 8, qkv_format="bshd", attn_mask_type="causal")
    dpa(dev(q), dev(k), dev(v)).float().sum().backward()
    assert seen["bwd"] == [want]


@pytest.mark.parametrize("det", [True, False])
def test_deterministic_refusal_runs_the_unfused_path(monkeypatch, det):
    """NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 and a configuration whose deterministic backward the library
    refuses (NOT_SUPPORTED from the backward's workspace query with deterministic set, as cuDNN
    answers when it has no such graph; simulated here): the call runs the unfused path, forward
    and backward, with the reference's values, instead of failing at the backward. Without the
    variable the same call runs fused."""
    real = fa._nvte
    asked = []

    class Refuse(Spy):
        def __getattr__(self, name):
            if name != "fused_attn_bwd_workspace_size":
                return super().__getattr__(name)

            def query(*a):
                asked.append(a[-1])
                if a[-1]:
                    raise real.Error("no deterministic backward for this graph (simulated)",
                                     int(real.Status.NOT_SUPPORTED))
                return getattr(real, name)(*a)
            return query

    spy = Refuse(real)
    monkeypatch.setattr(fa, "_nvte", spy)
    monkeypatch.setattr(fa, "_WORKSPACE_ANSWERS", {})
    monkeypatch.setenv("NVTE_FUSED_ATTN", "1")
    monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0" if det else "1")
    b, s_, h, d = 2, 9, 2, 8
    q, k, v = make_qkv("bshd", b, s_, s_, h, h, d, seed=12, dtype=DT)
    dpa = DotProductAttention(h, d, qkv_format="bshd", attn_mask_type="causal")
    out = dpa(dev(q), dev(k), dev(v))
    assert (spy.fwd, asked) == ((0, [True]) if det else (1, []))
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    ref = ref_fused(q64, k64, v64, "bshd", d ** -0.5, ref_mask("causal", b, s_, s_, None, None))
    naive = qn = kn = vn = None
    if ON_GPU:
        qn, kn, vn = (dev(t.detach()).requires_grad_(True) for t in (q, k, v))
        naive = ref_fused(qn, kn, vn, "bshd", d ** -0.5, dev(ref_mask("causal", b, s_, s_, None, None)), dtype=DT)
    check_out_and_backward(out, ref, naive)
    assert spy.bwd == (0 if det else 1)
    for name, t, r, n in (("dq", q, q64, qn), ("dk", k, k64, kn), ("dv", v, v64, vn)):
        assert_close_fused(t.grad, r.grad, None if n is None else n.grad, 1e-4, name)


@pytest.mark.skipif(not ON_GPU, reason="cuDNN's deterministic backward (NVTE_TEST_DEVICE=cuda only; the CPU "
                    "backend has no atomics: the flag's plumbing is test_deterministic_flag_follows_the_env)")
def test_deterministic_backward_repeats_bitwise(monkeypatch):
    monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
    monkeypatch.setenv("NVTE_FUSED_ATTN", "1")
    q, k, v = make_qkv("bshd", 2, 512, 512, 8, 2, 64, seed=8, dtype=DT)  # GQA: dK/dV sum over heads
    dpa = DotProductAttention(8, 64, num_gqa_groups=2, qkv_format="bshd", attn_mask_type="no_mask")
    grads = []
    for _ in range(3):
        qd, kd, vd = (dev(t.detach()).requires_grad_() for t in (q, k, v))
        dpa(qd, kd, vd).float().square().sum().backward()
        grads.append(torch.cat([t.grad.flatten() for t in (qd, kd, vd)]))
    assert torch.equal(grads[0], grads[1]) and torch.equal(grads[0], grads[2])


@pytest.mark.parametrize("case", ["dropout", "post_scale_bias", "alibi", "window", "padding", "off-by-one",
                                  "thd"])
def test_deterministic_training_repeats_bitwise(monkeypatch, case, capsys):
    """NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 over the configurations beyond the plain one: every call
    runs (fused where the library builds a deterministic backward, unfused where it refuses one;
    the path taken is printed) and repeats its gradients bit for bit, dropout with the same seed."""
    monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
    monkeypatch.setattr(fa, "_WORKSPACE_ANSWERS", {})
    spy = Spy(fa._nvte)
    monkeypatch.setattr(fa, "_nvte", spy)
    b, s_, h, d = 2, 256, 4, 64
    fmt = "thd" if case == "thd" else "bshd"
    kw = dict(qkv_format=fmt, attn_mask_type="padding" if case in ("padding", "thd") else "causal",
              attention_dropout=0.1 if case == "dropout" else 0.0,
              softmax_type="off-by-one" if case == "off-by-one" else "vanilla",
              window_size=(64, 0) if case == "window" else None)
    dpa = DotProductAttention(h, d, **kw)
    q, k, v = make_qkv("bshd", b, s_, s_, h, h, d, seed=13, dtype=DT)
    call = {}
    if case == "post_scale_bias":
        bias = dev(torch.randn(1, h, s_, s_, generator=torch.Generator().manual_seed(2)).to(DT)).requires_grad_()
        call = dict(core_attention_bias_type="post_scale_bias", core_attention_bias=bias)
    elif case == "alibi":
        call = dict(core_attention_bias_type="alibi")
    elif case == "padding":
        qm, km = padding_masks(b, s_, s_)
        call = dict(attention_mask=(dev(qm), dev(km)))
    elif case == "thd":
        cu = dev(torch.tensor([0, 200, 200 + s_], dtype=torch.int32))
        q, k, v = (t.detach().reshape(b * s_, h, d).requires_grad_() for t in (q, k, v))
        call = dict(cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=s_, max_seqlen_kv=s_)
    grads = []
    for _ in range(2):
        torch.manual_seed(5)
        if ON_GPU:
            torch.cuda.manual_seed(5)
        xs = [dev(t.detach()).requires_grad_() for t in (q, k, v)]
        out = dpa(*xs, **call)
        out.float().square().sum().backward()
        gs = [x.grad for x in xs] + ([call["core_attention_bias"].grad.clone()] if case == "post_scale_bias" else [])
        if case == "post_scale_bias":
            call["core_attention_bias"].grad = None
        assert all(torch.isfinite(g).all() for g in gs), case
        grads.append(torch.cat([g.flatten().float() for g in gs]))
    with capsys.disabled():
        print(f"\n[deterministic {case}] fused calls fwd {spy.fwd} bwd {spy.bwd} (0: the unfused path ran)")
    assert torch.equal(grads[0], grads[1]), case


def test_nvte_debug_logs_the_attention_path(monkeypatch, caplog):
    """NVTE_DEBUG=1 with NVTE_DEBUG_LEVEL (TE's variables) logs which path runs and why; level 2 adds
    the call's description; nothing without NVTE_DEBUG."""
    import logging
    monkeypatch.setattr(fa, "_DEBUG_SEEN", set())
    q, k, v = make_qkv("bshd", 1, 4, 4, 2, 2, 8, seed=9, dtype=DT)
    dpa = DotProductAttention(2, 8, qkv_format="bshd", attn_mask_type="causal")
    with caplog.at_level(logging.INFO, logger="transformer_engine.pytorch.attention"):
        monkeypatch.setenv("NVTE_FUSED_ATTN", "0")
        dpa(dev(q), dev(k), dev(v))
        assert not caplog.records
        monkeypatch.setenv("NVTE_DEBUG", "1")
        monkeypatch.setenv("NVTE_DEBUG_LEVEL", "1")
        dpa(dev(q), dev(k), dev(v))
        dpa(dev(q), dev(k), dev(v))  # (once per distinct message)
        monkeypatch.setenv("NVTE_FUSED_ATTN", "1")
        monkeypatch.setenv("NVTE_DEBUG_LEVEL", "2")
        dpa(dev(q), dev(k), dev(v))
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 2, msgs
    assert msgs[0] == "DotProductAttention: unfused attention (NVTE_FUSED_ATTN=0)"
    assert msgs[1].startswith("DotProductAttention: fused attention (") and "bshd, mask causal" in msgs[1]
