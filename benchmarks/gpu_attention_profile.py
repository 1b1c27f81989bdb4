"""Diagnostic (GPU): the CUDA kernels one fused-attention forward + backward launches, ours (BF16
and FP8, benchmarks/gpu_attention.py's calls) against torch SDPA's cuDNN backend, from
torch.profiler: per-call device time of each kernel. Written to see where our calls differ from
torch's beyond cuDNN's own kernels.
    PYTHONPATH=<staged package> python3 benchmarks/gpu_attention_profile.py [SEQ ...]"""
import os
import sys

import torch
from torch.nn.attention import SDPBackend
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_attention as ga  # noqa: E402


def kernel_table(name, fn, calls=10):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    rows = sorted(((e.device_time_total / calls, e.count / calls, e.key[:110]) for e in p.key_averages()
                   if e.device_time_total > 0), reverse=True)
    print(f"==== {name}: per call")
    for t, c, k in rows[:14]:
        print(f"  {t:9.1f} us  x{c:4.1f}  {k}")
    print(f"  total {sum(r[0] for r in rows):.1f} us")


def main(seqs):
    for s in seqs:
        for causal in (False, True):
            o = ga.Ours(s, causal)
            tag = f"s={s} {'causal' if causal else 'no_mask'}"
            kernel_table(f"ours bf16 {tag}", o.fwd_bwd)
            kernel_table(f"torch sdpa cudnn {tag}", ga.torch_fwd_bwd(o, causal, SDPBackend.CUDNN_ATTENTION))
            kernel_table(f"ours fp8 {tag}", ga.OursFp8(o).fwd_bwd)


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [2048, 8192])
