"""GEMM on the CUDA backend (cuBLASLt) against PyTorch in the same process.

FP8: nvte_cublas_gemm, E4M3 x E4M3 -> bf16, TN (Linear fprop: A = W [N, K], B = X [M, K],
D = X W^T [M, N]) with scale_inv != 1, against torch._scaled_mm(X, W^T, scale_a, scale_b,
out_dtype=bf16). BF16: the same GEMM in bf16 against torch.matmul(X, W^T). Random data,
three input sets rotated, median time of many runs, ours and torch's timed alternately
(three rounds each: the ratios are a few percent from 1); TFLOP/s = 2 M N K / time.
Ours is the library's default: at these sizes each plan's first calls time cuBLASLt's
candidates (each checked bit for bit against the heuristic's first choice) and keep the fastest;
they run before timing and the choices are logged to stderr. `first_choice_ratio` is torch's
time over ours with NVTE_GEMM_AUTOTUNE=0 (cuBLASLt's first choice, the algorithm torch runs) in
the same rounds.
Run alone: python benchmarks/gpu_gemm.py (or through gpu_bench.py).
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_harness import Report, time_alternating_ms  # noqa: E402

from transformer_engine import _nvte as nvte  # noqa: E402

M = 8192
SHAPES = [(12288, 4096), (4096, 4096), (16384, 4096), (4096, 16384), (8192, 8192)]  # (N, K)
SETS = 3
DT = nvte.DType


def _tensor(x, dtype=None, scale_inv=None):
    t = nvte.Tensor()
    t.set_param(nvte.Param.kRowwiseData, x.data_ptr(), list(x.shape), dtype if dtype is not None else {
        torch.bfloat16: DT.kBFloat16, torch.uint8: DT.kByte}[x.dtype])
    if scale_inv is not None:
        t.set_param(nvte.Param.kRowwiseScaleInv, scale_inv.data_ptr(), [1], DT.kFloat32)
    return t


def _tflops(n, k, ms):
    return 2.0 * M * n * k / (ms * 1e-3) / 1e12


def first_choice(fn):
    """fn run with NVTE_GEMM_AUTOTUNE=0 (a separate cached plan: the flag is part of its key)."""
    def call(i):
        os.environ["NVTE_GEMM_AUTOTUNE"] = "0"
        try:
            fn(i)
        finally:
            os.environ.pop("NVTE_GEMM_AUTOTUNE")
    return call


def settle(fn, calls=64):
    """A tuned plan's first calls time the candidates; let it choose before timing (a sync
    every 8 calls lets the timing events complete)."""
    for i in range(calls):
        fn(i)
        if i % 8 == 7:
            torch.cuda.synchronize()


def run(report, iters=50, shapes=SHAPES):
    dev = "cuda"
    os.environ.pop("NVTE_GEMM_AUTOTUNE", None)
    os.environ.setdefault("NVTE_GEMM_AUTOTUNE_LOG", "1")
    ws_buf = torch.empty(nvte.gemm_workspace_size(nvte.Backend.CUDA), dtype=torch.uint8, device=dev)
    ws = _tensor(ws_buf)
    g = torch.Generator(device=dev)
    g.manual_seed(0)
    for n, k in shapes:
        # ------------------------------------------------------------------ FP8
        sets = []
        for _ in range(SETS):
            x = (torch.randn(M, k, device=dev, generator=g) * 2).to(torch.float8_e4m3fn)
            w = (torch.randn(n, k, device=dev, generator=g) * 2).to(torch.float8_e4m3fn)
            sx = torch.tensor([0.5], device=dev)  # scale_inv of X
            sw = torch.tensor([0.25], device=dev)
            d = torch.empty(M, n, dtype=torch.bfloat16, device=dev)
            d_ref = torch.empty(M, n, dtype=torch.bfloat16, device=dev)
            tw = _tensor(w.view(torch.uint8), DT.kFloat8E4M3, sw)
            tx = _tensor(x.view(torch.uint8), DT.kFloat8E4M3, sx)
            sets.append((x, w, sx, sw, d, d_ref, tw, tx, _tensor(d)))

        def ours(i):
            s = sets[i % SETS]
            nvte.gemm(s[6], s[7], s[8], transa=True, transb=False, workspace=ws, use_split_accumulator=False)

        def theirs(i):
            s = sets[i % SETS]
            return torch._scaled_mm(s[0], s[1].t(), scale_a=s[2].reshape(()), scale_b=s[3].reshape(()),
                                    out_dtype=torch.bfloat16, use_fast_accum=True)

        settle(ours)
        sets[0][5].copy_(theirs(0))
        torch.cuda.synchronize()
        err = (sets[0][4].float() - sets[0][5].float()).abs().max().item()
        scale = sets[0][5].float().abs().max().item()
        t_ours, t_theirs, t_first = time_alternating_ms([ours, theirs, first_choice(ours)], iters=iters)
        report.add("gemm fp8 (torch: _scaled_mm)", f"fp8 e4m3 TN M={M} N={n} K={k} -> bf16",
                   nvte_TFLOPs=_tflops(n, k, t_ours),
                   torch_TFLOPs=_tflops(n, k, t_theirs), ratio_vs_torch=t_theirs / t_ours,
                   first_choice_ratio=t_theirs / t_first, max_rel_diff=err / max(scale, 1e-30))
        del sets

        # ------------------------------------------------------------------ BF16
        sets = []
        for _ in range(SETS):
            x = torch.randn(M, k, device=dev, generator=g, dtype=torch.bfloat16)
            w = torch.randn(n, k, device=dev, generator=g, dtype=torch.bfloat16)
            d = torch.empty(M, n, dtype=torch.bfloat16, device=dev)
            d_ref = torch.empty(M, n, dtype=torch.bfloat16, device=dev)
            sets.append((x, w, d, d_ref, _tensor(w), _tensor(x), _tensor(d)))

        def ours_bf16(i):
            s = sets[i % SETS]
            nvte.gemm(s[4], s[5], s[6], transa=True, transb=False, workspace=ws)

        def theirs_bf16(i):
            s = sets[i % SETS]
            torch.matmul(s[0], s[1].t(), out=s[3])

        settle(ours_bf16)
        theirs_bf16(0)
        torch.cuda.synchronize()
        err = (sets[0][2].float() - sets[0][3].float()).abs().max().item()
        scale = sets[0][3].float().abs().max().item()
        t_ours, t_theirs, t_first = time_alternating_ms([ours_bf16, theirs_bf16, first_choice(ours_bf16)],
                                                        iters=iters)
        report.add("gemm bf16 (torch: matmul)", f"bf16 TN M={M} N={n} K={k}", nvte_TFLOPs=_tflops(n, k, t_ours),
                   torch_TFLOPs=_tflops(n, k, t_theirs), ratio_vs_torch=t_theirs / t_ours,
                   first_choice_ratio=t_theirs / t_first, max_rel_diff=err / max(scale, 1e-30))
        del sets
        torch.cuda.empty_cache()


if __name__ == "__main__":
    # python benchmarks/gpu_gemm.py [N K]: all shapes, or the one (N, K) (e.g. under
    # CUBLASLT_LOG_LEVEL=2, whose trace shows the algorithm each side's cublasLtMatmul ran)
    r = Report()
    run(r, shapes=[(int(sys.argv[1]), int(sys.argv[2]))] if len(sys.argv) == 3 else SHAPES)
    print(r.markdown())
