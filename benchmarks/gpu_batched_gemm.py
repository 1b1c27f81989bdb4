"""nvte_batched_gemm (one strided-batched cuBLASLt call; the unfused attention paths' products)
against torch.bmm in the same process, bf16: attention score and context products of b=4, 16 heads
(64 matrices), s=2048, d=128 (q @ k^T: [64, 2048, 128] x [64, 2048, 128]^T; p @ v: [64, 2048, 2048]
x [64, 2048, 128]). TFLOP/s and the ratio to torch.bmm, timed alternately (gpu_harness).
Run alone: python benchmarks/gpu_batched_gemm.py (or through gpu_bench.py)."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_harness import Report, time_alternating_ms  # noqa: E402

from transformer_engine.pytorch import _ops  # noqa: E402

BATCH, S, D = 64, 2048, 128


def run(report: Report):
    g = torch.Generator(device="cuda").manual_seed(0)
    rnd = lambda *s: torch.randn(*s, generator=g, device="cuda").to(torch.bfloat16)
    q, k, v = rnd(BATCH, S, D), rnd(BATCH, S, D), rnd(BATCH, S, D)
    p = torch.softmax(rnd(BATCH, S, S).float(), -1).to(torch.bfloat16)
    cases = [("scores q @ k^T", lambda: _ops.batched_gemm(k, q, True, False), lambda: torch.bmm(q, k.transpose(1, 2)),
              2.0 * BATCH * S * S * D),
             ("context p @ v", lambda: _ops.batched_gemm(v, p, False, False), lambda: torch.bmm(p, v),
              2.0 * BATCH * S * S * D)]
    for name, ours, ref, flops in cases:
        err = float((ours().float() - ref().float()).abs().max())
        assert err < 0.1, f"{name}: the library and torch.bmm disagree by {err}"
        t = time_alternating_ms([ours, ref])
        report.add("batched gemm", f"{name} bf16 batch={BATCH} s={S} d={D}", ours_ms=t[0],
                   TFLOPs=flops / t[0] / 1e9, torch_bmm_ms=t[1], speed_vs_torch=t[1] / t[0])


if __name__ == "__main__":
    rep = Report()
    run(rep)
    print(rep.markdown())
