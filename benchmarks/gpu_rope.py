"""Rotary position embedding (nvte_fused_rope_forward / _backward through the PyTorch adapter's
apply_rotary_pos_emb) against PyTorch in the same process: the usual rotate-half formula on
precomputed cos / sin in eager mode and under torch.compile. BF16 q as MultiheadAttention gives
it: the query heads of a packed [s, b, 3 h, d] QKV buffer (a strided view), s=8192 b=2 h=32
d=128, full rotation; forward, and backward (the gradient of q) through autograd with the graph
kept, so each timed call is one backward. GB/s counts bytes read + written (q in, the rotated q
out; freqs are small). Timed alternately (gpu_harness), three
input sets rotated so the L2 does not hold them.
Run alone: python benchmarks/gpu_rope.py (or through gpu_bench.py)."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_harness import Report, time_alternating_ms  # noqa: E402

from transformer_engine.pytorch import RotaryPositionEmbedding, apply_rotary_pos_emb  # noqa: E402

S, B, H, D, SETS = 8192, 2, 32, 128, 3


def torch_rope(t, cos, sin):
    x1, x2 = t.chunk(2, dim=-1)
    return t * cos + torch.cat([-x2, x1], dim=-1) * sin


def run(report: Report):
    g = torch.Generator(device="cuda").manual_seed(0)
    emb = RotaryPositionEmbedding(D)(S).cuda()
    cos, sin = emb.cos().to(torch.bfloat16), emb.sin().to(torch.bfloat16)
    packed = [torch.randn(S, B, 3 * H, D, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(SETS)]
    qs = [p[:, :, :H] for p in packed]
    grads = [torch.randn(S, B, H, D, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(SETS)]
    compiled = torch.compile(torch_rope)
    ours = apply_rotary_pos_emb(qs[0], emb, "sbhd")
    ref = torch_rope(qs[0].float(), emb.cos(), emb.sin())
    err = float((ours.float() - ref).abs().max())
    assert err < 0.05, f"RoPE disagrees with the torch formula: {err}"
    compiled(qs[0], cos, sin)
    torch.cuda.synchronize()
    nbytes = 2 * S * B * H * D * 2
    fwd = [lambda i: apply_rotary_pos_emb(qs[i % SETS], emb, "sbhd"),
           lambda i: torch_rope(qs[i % SETS], cos, sin),
           lambda i: compiled(qs[i % SETS], cos, sin)]
    t = time_alternating_ms(fwd)
    case = f"rope fwd sbhd s={S} b={B} h={H} d={D} bf16 (strided q)"
    report.add("rope", case, ours_ms=t[0], GBps=nbytes / t[0] / 1e6, torch_eager_ms=t[1], torch_compile_ms=t[2],
               speed_vs_eager=t[1] / t[0], speed_vs_compile=t[2] / t[0])
    # backward alone, through autograd on each side (the graph kept: each call is one backward)
    xs = [q.detach().clone().requires_grad_(True) for q in qs]
    graphs = [[fn(x) for x in xs] for fn in (lambda x: apply_rotary_pos_emb(x, emb, "sbhd"),
                                            lambda x: torch_rope(x, cos, sin), lambda x: compiled(x, cos, sin))]

    def bwd(which):
        return lambda i: torch.autograd.grad(graphs[which][i % SETS], xs[i % SETS], grads[i % SETS],
                                             retain_graph=True)

    t = time_alternating_ms([bwd(0), bwd(1), bwd(2)])
    case = f"rope bwd sbhd s={S} b={B} h={H} d={D} bf16"
    report.add("rope", case, ours_ms=t[0], GBps=nbytes / t[0] / 1e6, torch_eager_ms=t[1], torch_compile_ms=t[2],
               speed_vs_eager=t[1] / t[0], speed_vs_compile=t[2] / t[0])

if __name__ == "__main__":
    rep = Report()
    run(rep)
    print(rep.markdown())
