"""CPU GEMM throughput: nvte_cublas_gemm (through the _nvte binding) against numpy's matmul.

Usage: PYTHONPATH=<staged package> python benchmarks/cpu_gemm.py [--repeats N] [--sizes 1024,1024,1024 ...]

Each case reports the best of `repeats` timed calls (after a warm-up): the machine may be
shared, and the best run is the one least disturbed by other work. numpy runs the same
float32 product (operands decoded to float32 beforehand for bf16 / FP8 cases, which favours
numpy: our timing includes the decoding).
"""
import argparse
import time

import ml_dtypes
import numpy as np

from transformer_engine import _nvte as nvte

DT = nvte.DType


def best_time(fn, repeats):
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def operand(rng, shape, kind):
    """(nvte.Tensor, float32 numpy equivalent) for kind float32 / bfloat16 / e4m3 / e5m2."""
    x = rng.uniform(-1, 1, shape).astype(np.float32)
    if kind == "float32":
        return nvte.Tensor(x), x
    if kind == "bfloat16":
        b = x.astype(ml_dtypes.bfloat16)
        return nvte.Tensor(b), b.astype(np.float32)
    np_t = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}[kind]
    q = x.astype(np_t)
    si = np.array([0.5], np.float32)
    t = nvte.Tensor(q.view(np.uint8), dtype={"e4m3": DT.kFloat8E4M3, "e5m2": DT.kFloat8E5M2}[kind], scale_inv=si)
    return t, q.astype(np.float32) * si[0]


def run_case(rng, n, m, k, kind, layout, repeats):
    """fprop-style TN: A = W [m, k], B = X [n, k], D = X W^T [n, m] (float32)."""
    transa, transb = layout[0] == "T", layout[1] == "T"
    ta, a = operand(rng, (m, k) if transa else (k, m), kind)
    tb, b = operand(rng, (k, n) if transb else (n, k), kind)
    d = np.empty((n, m), np.float32)
    td = nvte.Tensor(d)
    opa = np.ascontiguousarray(a.T) if transa else a
    opb = np.ascontiguousarray(b.T) if transb else b
    t_ours = best_time(lambda: nvte.gemm(ta, tb, td, transa=transa, transb=transb), repeats)
    t_np = best_time(lambda: opb @ opa, repeats)
    err = np.abs(d - opb.astype(np.float64) @ opa.astype(np.float64)).max()
    flop = 2.0 * n * m * k
    g_ours, g_np = flop / t_ours / 1e9, flop / t_np / 1e9
    print(f"{n:5d} x {m:5d} x {k:5d}  {kind:8s} {layout}  ours {g_ours:7.1f} GFLOP/s  numpy {g_np:7.1f} GFLOP/s  "
          f"ratio {g_ours / g_np:5.2f}  max|err| {err:.2e}")
    return g_ours, g_np


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--sizes", nargs="*", default=None, help="n,m,k triples (float32 TN)")
    args = p.parse_args()
    rng = np.random.default_rng(0)
    cases = [(1024, 1024, 1024, "float32", "TN"), (1024, 1024, 1024, "float32", "NN"),
             (1024, 1024, 1024, "float32", "NT"), (2048, 1024, 512, "float32", "TN"),
             (300, 257, 511, "float32", "TN"), (1024, 1024, 1024, "bfloat16", "TN"),
             (1024, 1024, 1024, "e4m3", "TN"), (1024, 1024, 1024, "e5m2", "NT")]
    if args.sizes:
        cases = [tuple(int(v) for v in s.split(",")) + ("float32", "TN") for s in args.sizes]
    print(f"threads: NVTE_CPU_THREADS or all cores; best of {args.repeats}")
    for n, m, k, kind, layout in cases:
        run_case(rng, n, m, k, kind, layout, args.repeats)


if __name__ == "__main__":
    main()
