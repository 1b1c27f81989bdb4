"""Sliding-window attention on the GPU: te.DotProductAttention forward + backward (b=4, h=32,
d=128, bshd, causal or --mask no_mask, BF16 inputs) in BF16 and in FP8 (the recipe's fp8_dpa; also with
NVTE_FP8_DPA_BWD=0), with window_size (w, 0) for several w: whether cuDNN's kernels skip the key
tiles a window masks (the work of a window w is about s * w instead of s^2 / 2).

Module calls (casts, recipe steps and all), CUDA-event medians (gpu_harness.time_ms).
  python benchmarks/gpu_attention_window.py [--seq 8192] [--windows -1 4095 1023 255]
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_harness import time_ms  # noqa: E402

import transformer_engine.pytorch as te  # noqa: E402
from transformer_engine.common import recipe  # noqa: E402

B, H, D = 4, 32, 128


def step_fn(dpa, qkv, dy, fp8, fp8_dpa_bwd):
    r = recipe.DelayedScaling(fp8_dpa=True, amax_history_len=16, amax_compute_algo="max")

    def step():
        os.environ["NVTE_FP8_DPA_BWD"] = fp8_dpa_bwd  # read by each forward
        with te.fp8_autocast(enabled=fp8, fp8_recipe=r):
            out = dpa(*qkv)
        out.backward(dy)
    return step


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--windows", type=int, nargs="*", default=[-1, 4095, 1023, 255])
    p.add_argument("--mask", default="causal", choices=["causal", "no_mask"],
                   help="no_mask: windows (w, -1), a left bound only")
    a = p.parse_args(argv)
    s = a.seq
    g = torch.Generator(device="cuda").manual_seed(0)
    qkv = [torch.randn(B, s, H, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(True)
           for _ in range(3)]
    dy = torch.randn(B, s, H * D, device="cuda", dtype=torch.bfloat16, generator=g)
    print(f"{torch.cuda.get_device_name()}: DotProductAttention fwd+bwd b={B} h={H} d={D} s={s} {a.mask}, ms")
    print("| window | BF16 | FP8 | FP8 vs BF16 | FP8 fwd + BF16 bwd | vs BF16 | BF16 vs no window |")
    print("|---|---|---|---|---|---|---|")
    base = None
    for w in a.windows:
        dpa = te.DotProductAttention(H, D, qkv_format="bshd", attn_mask_type=a.mask,
                                     window_size=(w, 0 if a.mask == "causal" else -1), attention_dropout=0.0)
        t = {}
        for name, fp8, bwd in (("bf16", False, "1"), ("fp8", True, "1"), ("mixed", True, "0")):
            try:
                t[name] = time_ms(step_fn(dpa, qkv, dy, fp8, bwd), iters=10, warmup=3, inner=2)
            except Exception as e:  # a configuration the backend refuses: say so, keep the others
                print(f"window {w} {name}: {type(e).__name__}: {str(e).splitlines()[0]}")
                t[name] = float("nan")
            for x in qkv:
                x.grad = None
        base = t["bf16"] if base is None else base
        print(f"| {w} | {t['bf16']:.3f} | {t['fp8']:.3f} | {t['bf16'] / t['fp8']:.2f} | {t['mixed']:.3f} | "
              f"{t['bf16'] / t['mixed']:.2f} | {t['bf16'] / base:.2f} |", flush=True)
    os.environ.pop("NVTE_FP8_DPA_BWD", None)


if __name__ == "__main__":
    main()
