"""fuse_wgrad_accumulation on the GPU: a te.Linear step (forward + backward) whose weight gradient
goes into a float32 main_grad, three ways, timed alternately in one process (ms per step):

  fused     fuse_wgrad_accumulation=True: the wgrad GEMM accumulates into main_grad (C = D)
  unfused   the default module: the GEMM writes .grad (bf16), then main_grad += grad (Megatron's
            path without gradient-accumulation fusion), .grad dropped
  torch     torch.nn.Linear in bf16 with the same main_grad += grad

BF16 and FP8 (DelayedScaling) modules; layer shapes of the tutorial layer (hidden 4096, tokens
8192). Usage: python benchmarks/gpu_wgrad_accumulation.py [tokens]"""
import sys

import torch

import transformer_engine.pytorch as te
from transformer_engine.common import recipe

from gpu_harness import time_alternating_ms

SHAPES = [(4096, 4096), (4096, 16384), (16384, 4096)]  # (in, out): QKV/proj, fc1, fc2


def step_fn(m, x, dy, fp8, mode):
    r = recipe.DelayedScaling()
    w = m.weight

    def step():
        with te.fp8_autocast(enabled=fp8, fp8_recipe=r):
            y = m(x)
        y.backward(dy)
        if mode != "fused":
            w.main_grad.add_(w.grad)
            w.grad = None
    return step


def main():
    tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
    torch.manual_seed(0)
    print(f"device {torch.cuda.get_device_name()}, tokens {tokens}, bf16 params, float32 main_grad")
    print("| in | out | precision | fused | unfused | torch | unfused/fused | torch/fused |")
    print("|---|---|---|---|---|---|---|---|")
    for n_in, n_out in SHAPES:
        x = torch.randn(tokens, n_in, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(tokens, n_out, device="cuda", dtype=torch.bfloat16) * 1e-2
        mods = {}
        for mode in ("fused", "unfused"):
            m = te.Linear(n_in, n_out, bias=False, params_dtype=torch.bfloat16, fuse_wgrad_accumulation=mode == "fused")
            m.weight.main_grad = torch.zeros(n_out, n_in, device="cuda", dtype=torch.float32)
            mods[mode] = m
        ref = torch.nn.Linear(n_in, n_out, bias=False, device="cuda", dtype=torch.bfloat16)
        ref.weight.main_grad = torch.zeros(n_out, n_in, device="cuda", dtype=torch.float32)
        for fp8 in (False, True):
            fns = [step_fn(mods["fused"], x, dy, fp8, "fused"), step_fn(mods["unfused"], x, dy, fp8, "unfused")]
            if not fp8:
                fns.append(step_fn(ref, x, dy, False, "torch"))
            t = time_alternating_ms(fns, rounds=3, iters=15, warmup=5, inner=4)
            torch_ms = f"{t[2]:.3f}" if not fp8 else "-"
            torch_ratio = f"{t[2] / t[0]:.2f}" if not fp8 else "-"
            print(f"| {n_in} | {n_out} | {'FP8' if fp8 else 'BF16'} | {t[0]:.3f} | {t[1]:.3f} | {torch_ms} | "
                  f"{t[1] / t[0]:.2f} | {torch_ratio} |")
        del mods, ref, x, dy
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
