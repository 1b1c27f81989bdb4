"""Rotary position embedding through the PyTorch adapter (rope.py): apply_rotary_pos_emb forward
and backward against a float64 torch reference (rotate-half / interleaved pairs, partial
rotation, start positions, THD, strided inputs, context-parallel ranks' chunks),
RotaryPositionEmbedding's table, and
MultiheadAttention / TransformerLayer with rotary_pos_emb: shifting every position leaves causal
self-attention unchanged (RoPE sees relative positions only), and generation with a K/V cache
(the table of all positions, the cache's start positions) gives the rows of one full forward.
CPU: float32 inputs, rel_err < 2e-5 (float64 reference). NVTE_TEST_DEVICE=cuda: bfloat16 inputs
held to the flash-attention rule of test_inference_kv_cache.py where attention is involved, and
to 2 bfloat16 ulps (relative) for the rotation alone."""
from collections import OrderedDict

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.pytorch import InferenceParams, RotaryPositionEmbedding, apply_rotary_pos_emb

from _util import DEVICE, ON_CUDA, rel_err

DT = torch.bfloat16 if ON_CUDA else torch.float32
TOL = 2e-5


def rope_ref(t, freqs, fmt, start=None, interleaved=False, cu=None):
    """float64 torch RoPE of t (differentiable): positions as fused_rope.h defines them."""
    t = t.double()
    d2 = freqs.shape[-1]
    f = freqs.reshape(-1, d2).double().cpu()
    if fmt == "thd":
        pos = torch.full((t.shape[0],), -1, dtype=torch.long)
        for i in range(cu.numel() - 1):
            a, b = int(cu[i]), int(cu[i + 1])
            pos[a:b] = torch.arange(b - a) + (0 if start is None else int(start[i]))
        ang = torch.where(pos[:, None] >= 0, f[pos.clamp(min=0)], torch.zeros(1, dtype=torch.float64))
        ang = ang[:, None, :]  # [t, 1, d2]
    else:
        s, b = (t.shape[0], t.shape[1]) if fmt == "sbhd" else (t.shape[1], t.shape[0])
        st = torch.zeros(b, dtype=torch.long) if start is None else start.long().cpu()
        pos = torch.arange(s)[:, None] + st[None, :]  # [s, b]
        ang = f[pos][:, :, None, :]  # [s, b, 1, d2]
        if fmt == "bshd":
            ang = ang.transpose(0, 1)
    x, rest = t[..., :d2], t[..., d2:]
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        rot = torch.stack([-x2, x1], dim=-1).flatten(-2)
    else:
        x1, x2 = x.chunk(2, dim=-1)
        rot = torch.cat([-x2, x1], dim=-1)
    return torch.cat([x * ang.cos() + rot * ang.sin(), rest], dim=-1)


def close(got, ref, what):
    if ON_CUDA:  # bfloat16 output of float32 math: within 2 bfloat16 ulps of the float64 value
        err = ((got.double().cpu() - ref.double().cpu()).abs() / ref.double().cpu().abs().clamp(min=1e-3)).max()
        assert float(err) <= 2 * 2.0**-8, (what, float(err))
    else:
        assert rel_err(got, ref) < TOL, (what, rel_err(got, ref))


@pytest.mark.parametrize("fmt", ["sbhd", "bshd", "thd"])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("partial", [False, True])
@pytest.mark.parametrize("with_start", [False, True])
def test_apply_rotary_pos_emb_forward_backward(fmt, interleaved, partial, with_start):
    gen = torch.Generator().manual_seed(3)
    s, b, h, d = 9, 3, 4, 16
    emb = RotaryPositionEmbedding(8 if partial else d, interleaved=interleaved)(32)
    cu = torch.tensor([0, 4, 4, 11], dtype=torch.int32) if fmt == "thd" else None
    shape = (13, 3 * h, d) if fmt == "thd" else ((s, b, 3 * h, d) if fmt == "sbhd" else (b, s, 3 * h, d))
    packed = torch.randn(shape, generator=gen).to(DT).to(DEVICE).requires_grad_(True)
    t = packed[..., h:2 * h, :]  # a strided head slice, as the QKV split gives q
    start = torch.randint(0, 9, (b,), generator=gen, dtype=torch.int32) if with_start else None
    out = apply_rotary_pos_emb(t, emb, fmt, start_positions=None if start is None else start.to(DEVICE),
                               interleaved=interleaved, cu_seqlens=None if cu is None else cu.to(DEVICE))
    assert out.shape == t.shape and out.dtype == DT and out.is_contiguous()
    tr = t.detach().cpu().double().requires_grad_(True)
    ref = rope_ref(tr, emb.cpu(), fmt, start, interleaved, cu)
    close(out, ref, "out")
    g = torch.randn(out.shape, generator=gen).to(DT)
    out.backward(g.to(DEVICE))
    ref.backward(g.double())
    close(packed.grad[..., h:2 * h, :], tr.grad, "grad")
    assert torch.count_nonzero(packed.grad[..., :h, :]) == 0 and torch.count_nonzero(packed.grad[..., 2 * h:, :]) == 0


def cp_rows(n, cp_size, rank):
    """The rows of a sequence of n tokens that context-parallel rank `rank` holds (TE's split)."""
    c = n // (2 * cp_size)
    return torch.cat([torch.arange(rank * c, (rank + 1) * c),
                      torch.arange((2 * cp_size - 1 - rank) * c, (2 * cp_size - rank) * c)])


@pytest.mark.parametrize("fmt", ["sbhd", "bshd", "thd"])
@pytest.mark.parametrize("interleaved", [False, True])
def test_context_parallel_ranks_rotate_their_chunks_of_the_whole_sequence(fmt, interleaved):
    """cp_size 2: each rank's output and input gradient are its chunks of the float64 RoPE of the
    whole sequences (THD: cu_seqlens of the whole, padded sequences)."""
    gen = torch.Generator().manual_seed(5)
    cp_size, h, d, b = 2, 2, 16, 2
    emb = RotaryPositionEmbedding(d, interleaved=interleaved)(24)
    if fmt == "thd":
        lens = [8, 4, 12]
        cu = torch.tensor([0, 8, 12, 24], dtype=torch.int32)
        full = torch.randn(24, h, d, generator=gen, dtype=torch.float64)
    else:
        n = 12
        full = torch.randn((n, b, h, d) if fmt == "sbhd" else (b, n, h, d), generator=gen, dtype=torch.float64)
    full = full.to(DT).double().requires_grad_(True)  # (values the ranks' DT inputs hold exactly)
    ref = rope_ref(full, emb, fmt, interleaved=interleaved, cu=cu if fmt == "thd" else None)
    g_full = torch.randn(ref.shape, generator=gen, dtype=torch.float64).to(DT).double()  # (held exactly in DT)
    ref.backward(g_full)
    for rank in range(cp_size):
        if fmt == "thd":
            idx = torch.cat([int(cu[i]) + cp_rows(lens[i], cp_size, rank) for i in range(3)])
            pick = lambda a: a[idx]
        else:
            idx = cp_rows(n, cp_size, rank)
            pick = lambda a: a.index_select(0 if fmt == "sbhd" else 1, idx)
        t = pick(full.detach()).to(DT).to(DEVICE).requires_grad_(True)
        out = apply_rotary_pos_emb(t, emb.to(DEVICE), fmt, interleaved=interleaved,
                                   cu_seqlens=cu.to(DEVICE) if fmt == "thd" else None, cp_size=cp_size, cp_rank=rank)
        close(out, pick(ref.detach()), f"out rank {rank}")
        out.backward(pick(g_full).to(DT).to(DEVICE))
        close(t.grad, pick(full.grad), f"grad rank {rank}")


def test_rotary_position_embedding_table():
    emb = RotaryPositionEmbedding(8, rotary_base=100.0)(5, offset=2)
    assert emb.shape == (5, 1, 1, 8) and emb.dtype == torch.float32
    inv = 1.0 / 100.0 ** (torch.arange(0, 8, 2, dtype=torch.float64) / 8)
    want = torch.outer(torch.arange(5, dtype=torch.float64) + 2, inv)
    torch.testing.assert_close(emb.reshape(5, 8).double().cpu(), torch.cat([want, want], 1), rtol=1e-6, atol=1e-6)
    inter = RotaryPositionEmbedding(8, rotary_base=100.0, interleaved=True)(5, offset=2).reshape(5, 8).cpu()
    torch.testing.assert_close(inter.double(), want.repeat_interleave(2, 1), rtol=1e-6, atol=1e-6)
    half = RotaryPositionEmbedding(16, rotary_percent=0.5, seq_len_interpolation_factor=2,
                                   pretrained_max_position_embeddings=8)(4)
    assert half.shape == (4, 1, 1, 8)
    torch.testing.assert_close(half.reshape(4, 8)[:, 0].double().cpu(), torch.arange(4, dtype=torch.float64) / 2)


@pytest.mark.parametrize("factor,pretrained,n,divisor", [
    (2, 8, 4, 2.0),        # fixed linear interpolation: within pretrained * factor
    (2, 8, 20, 20 / 8),    # dynamic: a longer table divides by max_seq_len / pretrained
    (2, None, 4, 1.0),     # TE interpolates only with both set: positions unscaled
    (None, 8, 20, 1.0),
])
def test_rotary_position_interpolation_follows_te(factor, pretrained, n, divisor):
    emb = RotaryPositionEmbedding(8, seq_len_interpolation_factor=factor, pretrained_max_position_embeddings=pretrained)(n)
    torch.testing.assert_close(emb.reshape(n, 8)[:, 0].double().cpu(), torch.arange(n, dtype=torch.float64) / divisor,
                               rtol=1e-6, atol=1e-6)


def mha(fmt="bshd", **kw):
    torch.manual_seed(11)
    hid = 256 if ON_CUDA else 32
    m = te.MultiheadAttention(hid, 4, num_gqa_groups=2, attention_dropout=0.0, layer_number=1, qkv_format=fmt,
                              attn_mask_type="causal", params_dtype=torch.float32, device="cpu", **kw)
    return m.eval().to(DEVICE).to(DT), hid


@pytest.mark.parametrize("fmt", ["bshd", "sbhd"])
def test_mha_rope_sees_relative_positions_only(fmt):
    """Causal self-attention with RoPE: the same output when every position shifts by 7, a different
    one without RoPE; gradients flow to the QKV weights."""
    m, hid = mha(fmt)
    d = hid // 4
    rope = RotaryPositionEmbedding(d)
    x = 8 * torch.randn(2, 6, hid, generator=torch.Generator().manual_seed(4))  # (sharp attention: RoPE matters)
    x = (x if fmt == "bshd" else x.transpose(0, 1).contiguous()).to(DT).to(DEVICE)
    a = m(x, rotary_pos_emb=rope(6).to(DEVICE))
    b = m(x, rotary_pos_emb=rope(6, offset=7).to(DEVICE))
    plain = m(x)
    if ON_CUDA:
        assert float((a - b).abs().max()) <= 4 * 2.0**-8 * float(a.abs().max())
    else:
        assert rel_err(b, a) < TOL
    assert rel_err(plain, a) > 5e-2
    m.zero_grad()
    a.float().sum().backward()
    w = [p for n, p in m.named_parameters() if "query" in n or "qkv" in n]
    assert w and all(p.grad is not None and torch.isfinite(p.grad).all() for p in w)


def test_generation_with_rope_matches_full_forward():
    """Prompt + 3 decode steps with a K/V cache and RoPE (the table of all positions; MultiheadAttention
    starts each sequence's new tokens at its cached length) give the rows of one full causal forward."""
    m, hid = mha("bshd")
    d = hid // 4
    table = RotaryPositionEmbedding(d)(16).to(DEVICE)
    x = torch.randn(2, 8, hid, generator=torch.Generator().manual_seed(5)).to(DT).to(DEVICE)
    with torch.no_grad():
        full = [m(x[i:i + 1], rotary_pos_emb=table[:8])[0] for i in range(2)]
        params = InferenceParams(2, 16, 2, d, DT)
        steps, pos = [OrderedDict({0: 5, 1: 3})] + [OrderedDict({0: 1, 1: 1})] * 3, [0, 0]
        for step in steps:
            params.pre_step(step)
            inp = torch.zeros(2, max(step.values()), hid, dtype=DT, device=DEVICE)
            for i, n in enumerate(step.values()):
                inp[i, :n] = x[i, pos[i]:pos[i] + n]
            out = m(inp, rotary_pos_emb=table, inference_params=params)
            for i, n in enumerate(step.values()):
                got, want = out[i, :n], full[i][pos[i]:pos[i] + n]
                if ON_CUDA:
                    assert float((got - want).abs().max()) <= 4 * 2.0**-8 * float(want.abs().max()) + 1e-2, (i, pos)
                else:
                    assert rel_err(got, want) < TOL, (i, pos[i], rel_err(got, want))
                pos[i] += n


def test_mha_rope_under_fp8_mha_runs_as_fp8_dpa():
    """With rotary_pos_emb, the recipe's fp8_mha runs attention as fp8_dpa does (FP8 attention on
    rotated high-precision q / k, no FP8 hand-offs): the same outputs and gradients, bit for bit."""
    import copy
    from transformer_engine.common.recipe import DelayedScaling, Format
    # (cuDNN's FP8 attention trains head size 128 and sequence lengths that are multiples of 128)
    hid, s = (512, 128) if ON_CUDA else (32, 8)
    torch.manual_seed(12)
    base = te.MultiheadAttention(hid, 4, attention_dropout=0.0, layer_number=1, qkv_format="bshd",
                                 attn_mask_type="causal", params_dtype=torch.float32, device="cpu").to(DEVICE).to(DT)
    emb = RotaryPositionEmbedding(hid // 4)(s).to(DEVICE)
    x = torch.randn(2, s, hid, generator=torch.Generator().manual_seed(6)).to(DT).to(DEVICE)
    res = []
    for flags in (dict(fp8_dpa=True, fp8_mha=True), dict(fp8_dpa=True)):
        m = copy.deepcopy(base)
        xi = x.clone().requires_grad_(True)
        with te.fp8_autocast(enabled=True, fp8_recipe=DelayedScaling(fp8_format=Format.HYBRID, **flags)):
            y = m(xi, rotary_pos_emb=emb)
        y.float().sum().backward()
        res.append((y.detach(), xi.grad))
    torch.testing.assert_close(res[0][0], res[1][0], rtol=0, atol=0)
    torch.testing.assert_close(res[0][1], res[1][1], rtol=0, atol=0)


def test_transformer_layer_takes_rotary_pos_emb(monkeypatch):
    """TransformerLayer hands rotary_pos_emb to its self attention, which rotates q and k."""
    from transformer_engine.pytorch.attention import multi_head_attention as mha_module
    calls = []
    real = mha_module.apply_rotary_pos_emb
    monkeypatch.setattr(mha_module, "apply_rotary_pos_emb",
                        lambda t, f, *a, **k: calls.append(f) or real(t, f, *a, **k))
    torch.manual_seed(2)
    hid = 256 if ON_CUDA else 32
    layer = te.TransformerLayer(hid, 2 * hid, 4, hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float32,
                                device="cpu", attn_input_format="bshd").to(DEVICE).to(DT)
    x = torch.randn(2, 5, hid, dtype=DT, device=DEVICE)
    q_emb, k_emb = RotaryPositionEmbedding(hid // 4)(5).to(DEVICE), RotaryPositionEmbedding(hid // 4)(5, 1).to(DEVICE)
    out = layer(x, rotary_pos_emb=(q_emb, k_emb))
    assert out.shape == x.shape and len(calls) == 2 and calls[0] is q_emb and calls[1] is k_emb


@pytest.mark.parametrize("fmt", ["sbhd", "thd"])
def test_empty_inputs(fmt):
    emb = RotaryPositionEmbedding(8)(4).to(DEVICE)
    t = torch.zeros((0, 2, 8) if fmt == "thd" else (0, 2, 2, 8), dtype=DT, device=DEVICE, requires_grad=True)
    cu = torch.zeros(1, dtype=torch.int32, device=DEVICE) if fmt == "thd" else None
    out = apply_rotary_pos_emb(t, emb, fmt, cu_seqlens=cu)
    assert out.shape == t.shape
    out.sum().backward()
    assert t.grad.shape == t.shape


def test_errors():
    t = torch.zeros(4, 2, 2, 8, dtype=DT, device=DEVICE)
    emb = RotaryPositionEmbedding(8)(4).to(DEVICE)
    with pytest.raises(ValueError, match="tensor_format"):
        apply_rotary_pos_emb(t, emb, "bhsd")
    with pytest.raises(ValueError, match="needs cu_seqlens"):
        apply_rotary_pos_emb(t[0], emb, "thd")
    with pytest.raises(ValueError, match="fewer than the sequence length"):
        apply_rotary_pos_emb(t, emb[:3], "sbhd")
    with pytest.raises(ValueError, match="must not exceed the head size"):
        apply_rotary_pos_emb(t, RotaryPositionEmbedding(16)(4), "sbhd")
    with pytest.raises(ValueError, match="cp_rank < cp_size"):
        apply_rotary_pos_emb(t, emb, "sbhd", cp_size=2, cp_rank=2)
    with pytest.raises(ValueError, match="start_positions .* cp_size > 1"):
        apply_rotary_pos_emb(t, RotaryPositionEmbedding(8)(8).to(DEVICE), "sbhd",
                             start_positions=torch.zeros(2, dtype=torch.int32, device=DEVICE), cp_size=2)
    with pytest.raises(ValueError, match="fewer than the sequence length 8 .* 2 context-parallel ranks"):
        apply_rotary_pos_emb(t, emb, "sbhd", cp_size=2)  # 4 local rows of 8 positions
    with pytest.raises(ValueError, match="even"):
        RotaryPositionEmbedding(7)
    for fused in (False, True):  # a table per batch entry, or one without its singleton dims, is not TE's form
        for bad in (emb.expand(4, 2, 1, 8), emb.view(4, 8), emb.view(4, 1, 8)):
            with pytest.raises(ValueError, match=r"freqs must be \[s2, 1, 1, d2\]"):
                apply_rotary_pos_emb(t, bad, "sbhd", fused=fused)
        with pytest.raises(TypeError, match="float32, float16 or bfloat16, got torch.float64"):
            apply_rotary_pos_emb(t.double(), emb, "sbhd", fused=fused)
