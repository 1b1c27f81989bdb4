"""Diagnostic (GPU): which quantization points does cuDNN's FP8 attention backward use?

Runs DotProductAttention (fp8_dpa, bshd, b=2 s=128 h=2 d=128, bf16) on CUDA for two steps, then
recomputes dQ/dK/dV in float64 from the same FP8 inputs and the same scales with variants of the
backward's dataflow, and prints how far cuDNN's gradients are from each (relative L2). The
library's CPU reference (cpu/fused_attn_fp8.cpp) is variant "ref"; the variant with the smallest
distance is the dataflow closest to cuDNN's.

Variants (dS = attn_scale * P * (dP - D), quantized with dP's scale; dV = P~^T dO):
  ref      as the CPU reference: float P in dS, P~ = Q8(P, s_S) in dV
  p8_ds    P~ (the E4M3 P) in dS as well
  no_pq    dV from float P (no P~)
  d_hp     D = rowsum(dO~ * O) with O before its FP8 rounding
  ds_unscaled  dS without attn_scale is what is quantized (attn_scale applied after)
  accN     every FP8 GEMM accumulates with N mantissa bits kept (truncated) after each k-chunk of
           32 (a model of Hopper's FP8 tensor-core accumulation, reported at ~14 bits)
It also prints the dP amax the backend recorded next to candidates computed in float64.
"""
import math
import sys

import torch

sys.path.insert(0, "tests/pytorch")
import transformer_engine.pytorch as te  # noqa: E402
from transformer_engine.common import recipe  # noqa: E402
from transformer_engine.pytorch.attention import DotProductAttention  # noqa: E402
from _attn_ref import qdq  # noqa: E402


DEV = "cuda" if torch.cuda.is_available() else "cpu"  # on the CPU, "ref" must agree to ~1e-7


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def _trunc(x, bits):
    m, e = torch.frexp(x)
    return torch.ldexp(torch.trunc(m * 2.0 ** bits) / 2.0 ** bits, e)


def _mm(a, b, bits, chunk=32):
    """a @ b; bits: an accumulator keeping `bits` mantissa bits (truncated) after each k-chunk
    is added (a model of Hopper's FP8 tensor-core accumulation), None: exact."""
    if bits is None:
        return a @ b
    acc = torch.zeros(*a.shape[:-1], b.shape[-1], dtype=torch.float64)
    for c in range(0, a.shape[-1], chunk):
        acc = _trunc(acc + a[..., c:c + chunk] @ b[..., c:c + chunk, :], bits)
    return acc


def variant_grads(q, k, v, do, sf, sb, mask, name, fb="e5m2"):
    """q, k, v, do: [b, s, h, d] float64 (the module's inputs); sf/sb: forward/backward scales."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    bits = int(name[3:]) if name.startswith("acc") else None
    Q, K, V = (qdq(t, sf[0], "e4m3").permute(0, 2, 1, 3) for t in (q, k, v))   # [b, h, s, d]
    dO = qdq(do, sb[0], fb).permute(0, 2, 1, 3)
    z = scale * _mm(Q, K.transpose(-1, -2), bits)
    if mask == "causal":
        z = z.masked_fill(torch.ones(z.shape[-2:], dtype=torch.bool).triu(1), -math.inf)
    lse = torch.logsumexp(z, -1, keepdim=True).float().double()
    m = z.amax(-1, keepdim=True)
    u = torch.exp(z - m)
    o = _mm(qdq(u, sf[1], "e4m3"), V, bits) / torch.exp(lse - m)
    ot = qdq(o, sf[2], "e4m3")
    p = torch.exp(z - lse)
    pt = qdq(p, sf[1], "e4m3")
    big_d = (dO * (o if name == "d_hp" else ot)).sum(-1, keepdim=True)
    dp = _mm(dO, V.transpose(-1, -2), bits)
    ds = scale * (pt if name == "p8_ds" else p) * (dp - big_d)
    dst = qdq(ds / scale, sb[1], fb) * scale if name == "ds_unscaled" else qdq(ds, sb[1], fb)
    if name == "ref":
        amax_candidates = {"max|dS|": ds.abs().max(), "max|dS|/attn_scale": ds.abs().max() / scale,
                           "max|dP|": dp.abs().max(), "max|dP-D|": (dp - big_d).abs().max()}
        print("   amax_dP candidates (float64): " + ", ".join(f"{k} {float(x):.4e}" for k, x in amax_candidates.items()))
    dq, dk = _mm(dst, K, bits), _mm(dst.transpose(-1, -2), Q, bits)
    dv = _mm((p if name == "no_pq" else pt).transpose(-1, -2), dO, bits)
    return [qdq(x, sb[2], fb).permute(0, 2, 1, 3) for x in (dq, dk, dv)]


def main():
    b, s, h, d = 2, 128, 2, 128
    for mask in ("no_mask", "causal"):
        gen = torch.Generator().manual_seed(11)
        dpa = DotProductAttention(h, d, qkv_format="bshd", attn_mask_type=mask)
        r = recipe.DelayedScaling(fp8_dpa=True, amax_history_len=4)
        for step in range(2):
            q, k, v = (torch.randn(b, s, h, d, generator=gen).bfloat16() for _ in range(3))
            do = (torch.randn(b, s, h * d, generator=gen) * 0.1).bfloat16()
            x = [t.to(DEV).requires_grad_(True) for t in (q, k, v)]
            sf = dpa.fp8_meta.scale["fwd"].tolist()
            with te.fp8_autocast(fp8_recipe=r):
                out = dpa(*x)
            out.backward(do.to(DEV))
            sb = dpa.fp8_meta.scale["bwd"].tolist()
            got = [t.grad.detach().double().cpu() for t in x]
            row = []
            print(f"   recorded amaxes (dO, dP, dQKV): {dpa.fp8_meta.amax_history['bwd'][0].tolist()}, scales used {sb}")
            for name in ("ref", "p8_ds", "no_pq", "d_hp", "ds_unscaled", "acc10", "acc12", "acc14", "acc16", "acc20"):
                want = variant_grads(*(t.double() for t in (q, k, v)), do.double().view(b, s, h, d), sf, sb,
                                     mask, name)
                row.append(f"{name}: " + " ".join(f"{n} {rel(g, w):.2e}" for n, g, w in zip(("dq", "dk", "dv"),
                                                                                              got, want)))
            print(f"{DEV} {mask} step {step}: " + " | ".join(row), flush=True)


if __name__ == "__main__":
    main()
