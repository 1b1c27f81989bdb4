"""Attention sinks (softmax_type) on the GPU: te.DotProductAttention forward + backward (b=4, h=32,
d=128, bshd, BF16) with the vanilla, off-by-one and learnable softmax, timed alternately in one
process (module calls: the learnable offset's gradient kernel and the off-by-one zero sink
included), against PyTorch's SDPA (cuDNN backend, no sink: what the sink costs over plain
attention) and against the same attention with the sink in eager torch (scores, softmax over the
scores plus the sink column, matmuls: what a user without a fused sink runs).
--profile: also the device time of the learnable offset's gradient kernels (torch.profiler, one
learnable step per shape) against the whole step's.
  python benchmarks/gpu_attention_sink.py [--seq 2048 8192] [--profile]
"""
import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_harness import time_alternating_ms  # noqa: E402

import transformer_engine.pytorch as te  # noqa: E402

B, H, D = 4, 32, 128
TIMING = dict(rounds=3, iters=10, warmup=3)


def module_step(softmax_type, mask, qkv, dy):
    dpa = te.DotProductAttention(H, D, qkv_format="bshd", attn_mask_type=mask, softmax_type=softmax_type).cuda()
    if softmax_type == "learnable":
        with torch.no_grad():
            dpa.softmax_offset.normal_()

    def step():
        dpa(*qkv).backward(dy)
    return step


def torch_step(mask, qkv, dy, sink):
    q, k, v = (t.transpose(1, 2) for t in qkv)  # [b, h, s, d] views
    causal = mask == "causal"
    if sink is None:
        def step():
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
                o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            o.transpose(1, 2).reshape(dy.shape).backward(dy)
        return step
    s = q.shape[2]
    hidden = torch.ones(s, s, dtype=torch.bool, device="cuda").triu(1) if causal else None

    def eager():
        z = (q @ k.transpose(-1, -2)).float() * D ** -0.5
        if hidden is not None:
            z = z.masked_fill(hidden, float("-inf"))
        col = sink.view(1, H, 1, 1).expand(B, H, s, 1)
        p = torch.softmax(torch.cat([z, col], -1), -1)[..., :-1].to(q.dtype)
        (p @ v).transpose(1, 2).reshape(dy.shape).backward(dy)
    return eager


def profile_sink(step, s, mask):
    """Device time of the sink-gradient kernels (fused_attn_sink.cu) in one learnable step, and the step's."""
    step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    us = lambda e: getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0.0))
    ev = prof.key_averages()
    sink = sum(us(e) for e in ev if "sink_" in e.key) / 3
    total = sum(us(e) for e in ev) / 3
    gbs = 2 * B * s * H * D * 2 / (sink * 1e-6) / 1e9 if sink else 0.0
    print(f"[attention_sink] profile s={s} {mask} learnable: sink kernels {sink:.1f} us "
          f"({gbs:.0f} GB/s of O + dO), step device time {total:.1f} us", flush=True)


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--seq", type=int, nargs="*", default=[2048, 8192])
    p.add_argument("--profile", action="store_true")
    a = p.parse_args(argv)
    print(f"[device] {torch.cuda.get_device_name()}")
    for s in a.seq:
        for mask in ("no_mask", "causal"):
            qkv = [torch.randn(B, s, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
            dy = torch.randn(B, s, H * D, device="cuda", dtype=torch.bfloat16)
            names = ["vanilla", "off-by-one", "learnable", "torch_cudnn_no_sink"]
            fns = [module_step(st, mask, qkv, dy) for st in names[:3]] + [torch_step(mask, qkv, dy, None)]
            if s <= 2048:  # the eager sink materializes [b, h, s, s] scores
                names.append("torch_eager_sink")
                fns.append(torch_step(mask, qkv, dy, torch.randn(H, device="cuda", requires_grad=True)))
            ms = time_alternating_ms(fns, **TIMING)
            base = ms[0]
            row = "  ".join(f"{n}={m:.3f}ms ({m / base:.3f}x vanilla)" for n, m in zip(names, ms))
            print(f"[attention_sink] fwd+bwd s={s} {mask}: {row}", flush=True)
            if a.profile:
                profile_sink(fns[2], s, mask)


if __name__ == "__main__":
    main()
