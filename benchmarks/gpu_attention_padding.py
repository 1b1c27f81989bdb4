"""Fused attention with padding masks (per-sequence lengths from cu_seqlens), BF16 and FP8, forward
and forward + backward: b=4, 32 heads, head dim 128, max length 2048, BSHD; the same sequences
packed as THD and in SBHD (BF16). What it measures is how the library runs padded batches (which
graph it gives cuDNN, and the zeroing of rows outside the lengths); the same calls without
padding (no_mask at the full length) are timed alongside as the floor. PyTorch's SDPA has no
per-sequence lengths in its flash / cuDNN backends, so there is no torch row; two builds of the
library are compared by tests/gpu/run_on_device.sh's ab step (--json FILE).

  python benchmarks/gpu_attention_padding.py [--json out.json]"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_attention import B, D, H, Ours, OursFp8  # noqa: E402
from gpu_harness import Report, time_alternating_ms  # noqa: E402

from transformer_engine import _nvte as nvte  # noqa: E402

M = nvte.NVTE_Mask_Type
S = 2048  # (b, h, d: gpu_attention's B, H, D)
TIMING = dict(rounds=3, iters=15, warmup=3, inner=4)


def check_padded_rows_zero(p, lens):
    """The rows past each length must be zero in O and in the gradients (what the timed work is for)."""
    p.fwd_bwd()
    torch.cuda.synchronize()
    if p.q.dim() == 3:  # THD: packed, no rows to check
        return
    sbhd = p.sc["qkv_layout"] == nvte.NVTE_QKV_Layout.NVTE_SBHD_SBHD_SBHD
    for name, x in (("o", p.o), ("dq", p.dq), ("dk", p.dk), ("dv", p.dv)):
        for b, n in enumerate(lens):
            tail = x[n:, b] if sbhd else x[b, n:]
            assert tail.numel() == 0 or not tail.view(torch.uint8).any(), f"{name}: rows past length {n} not zero"


def bench_case(report, out, name, mask, lens, fmt="bshd"):
    p = Ours(S, False, mask, lens, fmt)
    if lens is not None:
        check_padded_rows_zero(p, lens)
    fwd, fb = time_alternating_ms([lambda: p.fwd(), lambda: p.fwd_bwd()], **TIMING)
    report.add("attention_padding", f"bf16 b={B} h={H} d={D} s={S} {name}", fwd_ms=fwd, fwd_bwd_ms=fb)
    out["bf16 " + name] = dict(fwd_ms=fwd, fwd_bwd_ms=fb)
    if mask == M.NVTE_PADDING_CAUSAL_MASK and fmt == "bshd":  # (FP8 THD: not on the GPU, cuDNN's FP8 backward)
        f = OursFp8(p)
        f.fwd_bwd()
        torch.cuda.synchronize()
        fwd8, fb8 = time_alternating_ms([lambda: f.fwd(), lambda: f.fwd_bwd()], **TIMING)
        report.add("attention_padding", f"fp8 b={B} h={H} d={D} s={S} {name}", fwd_ms=fwd8, fwd_bwd_ms=fb8)
        out["fp8 " + name] = dict(fwd_ms=fwd8, fwd_bwd_ms=fb8)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", help="write {case: {metric: value}} here")
    args = ap.parse_args()
    report = Report()
    ragged = [2048, 1536, 1024, 512]
    cases = [("no_mask (full lengths, floor)", M.NVTE_NO_MASK, None),
             ("padding, lengths all 2048", M.NVTE_PADDING_MASK, [S] * B),
             ("padding, lengths 2048/1536/1024/512", M.NVTE_PADDING_MASK, ragged),
             ("padding_causal, lengths 2048/1536/1024/512", M.NVTE_PADDING_CAUSAL_MASK, ragged)]
    out = {}
    for name, mask, lens in cases:
        bench_case(report, out, name, mask, lens)
        torch.cuda.empty_cache()
    for name, mask in (("thd, padding", M.NVTE_PADDING_MASK), ("thd, padding_causal", M.NVTE_PADDING_CAUSAL_MASK)):
        bench_case(report, out, f"{name}, lengths 2048/1536/1024/512 packed", mask, ragged, "thd")
        torch.cuda.empty_cache()
    bench_case(report, out, "sbhd, padding_causal, lengths 2048/1536/1024/512", M.NVTE_PADDING_CAUSAL_MASK, ragged,
               "sbhd")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
