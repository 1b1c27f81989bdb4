"""End-to-end demo of the transformer_engine C API from Python, on the CPU backend.

An MLP block  y = GELU(LayerNorm(x) @ W1^T + b1) @ W2^T  runs twice per step:
in float32, and in FP8 (E4M3) with delayed scaling, where every cast is fused into the
op producing it (LayerNorm -> FP8, GEMM+bias+GELU -> FP8) and the scales come from the
library's delayed-scaling recipe update. Half-way, the LayerNorm gain jumps 30x (a fast
growing activation range): that step's FP8 output saturates with the stale scales, and the
following steps recover once the amax history has seen the new range (FC1's input needs one
more step). Both results are compared with float64.
"""
import argparse
import time

import numpy as np

from transformer_engine import _nvte as nvte

E4M3 = nvte.DType.kFloat8E4M3
F32 = np.float32


def one(v=0.0):
    return np.array([v], F32)


class FP8Meta:
    """Delayed-scaling state of n FP8 tensors: amax history [len, n] and scales [n]."""

    def __init__(self, n, history_len):
        self.history = np.zeros((history_len, n), F32)
        self.scale = np.ones(n, F32)
        self.scale_inv = np.ones(n, F32)

    def fp8(self, i, shape):
        """An FP8 output whose amax slot is row 0 of column i of the history."""
        data = np.zeros(shape, np.uint8)
        amax = self.history[0, i : i + 1]  # a view: the op writes straight into the history
        t = nvte.Tensor(data, dtype=E4M3, scale=self.scale[i : i + 1], amax=amax,
                        scale_inv=self.scale_inv[i : i + 1])
        return data, t

    def update(self):
        h, s = nvte.Tensor(self.history), nvte.Tensor(self.scale)
        nvte.delayed_scaling_recipe_amax_and_scale_update(h, s, h, s, "max", E4M3, 0.0)


def fp8_input(data, scale_inv):
    return nvte.Tensor(data, dtype=E4M3, scale_inv=scale_inv)


def mlp_fp8(x, ln_w, ln_b, w1, b1, w2, meta):
    tokens, hidden = x.shape
    ffn = w1.shape[0]
    # Weights: cast to FP8 with their own scales (slots 0, 1).
    w1_q, w1_t = meta.fp8(0, w1.shape)
    nvte.quantize(nvte.Tensor(w1), w1_t)
    w2_q, w2_t = meta.fp8(1, w2.shape)
    nvte.quantize(nvte.Tensor(w2), w2_t)
    # LayerNorm with fused FP8 output (slot 2).
    ln_q, ln_t = meta.fp8(2, x.shape)
    mu, rs = np.zeros(tokens, F32), np.zeros(tokens, F32)
    nvte.layernorm_fwd(nvte.Tensor(x), nvte.Tensor(ln_w), nvte.Tensor(ln_b), 1e-5, ln_t,
                       nvte.Tensor(mu), nvte.Tensor(rs))
    # FC1: FP8 x FP8 GEMM, bias + GELU epilogue, FP8 output (slot 3); pre-activation kept in float32.
    h_q, h_t = meta.fp8(3, (tokens, ffn))
    pre = np.zeros((tokens, ffn), F32)
    nvte.gemm(fp8_input(w1_q, meta.scale_inv[0:1]), fp8_input(ln_q, meta.scale_inv[2:3]), h_t,
              bias=nvte.Tensor(b1), pre_gelu_out=nvte.Tensor(pre), transa=True, transb=False)
    # FC2: FP8 x FP8 GEMM, float32 output.
    y = np.zeros((tokens, hidden), F32)
    nvte.gemm(fp8_input(w2_q, meta.scale_inv[1:2]), fp8_input(h_q, meta.scale_inv[3:4]), nvte.Tensor(y),
              transa=True, transb=False)
    return y


def mlp_f32(x, ln_w, ln_b, w1, b1, w2):
    tokens, hidden = x.shape
    ln = np.zeros_like(x)
    mu, rs = np.zeros(tokens, F32), np.zeros(tokens, F32)
    nvte.layernorm_fwd(nvte.Tensor(x), nvte.Tensor(ln_w), nvte.Tensor(ln_b), 1e-5, nvte.Tensor(ln),
                       nvte.Tensor(mu), nvte.Tensor(rs))
    h = np.zeros((tokens, w1.shape[0]), F32)
    pre = np.zeros_like(h)
    nvte.gemm(nvte.Tensor(w1), nvte.Tensor(ln), nvte.Tensor(h), bias=nvte.Tensor(b1),
              pre_gelu_out=nvte.Tensor(pre), transa=True)
    y = np.zeros_like(x)
    nvte.gemm(nvte.Tensor(w2), nvte.Tensor(h), nvte.Tensor(y), transa=True)
    return y


def mlp_ref(x, ln_w, ln_b, w1, b1, w2):
    x = x.astype(np.float64)
    mu = x.mean(-1, keepdims=True)
    ln = (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + 1e-5) * ln_w + ln_b
    pre = ln @ w1.T.astype(np.float64) + b1
    h = 0.5 * pre * (1 + np.tanh(np.sqrt(2 / np.pi) * (pre + 0.044715 * pre**3)))
    return h @ w2.T.astype(np.float64)


def rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--ffn", type=int, default=2048)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--history", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()

    rng = np.random.default_rng(a.seed)
    ln_w = (1 + 0.1 * rng.standard_normal(a.hidden)).astype(F32)
    ln_b = (0.1 * rng.standard_normal(a.hidden)).astype(F32)
    w1 = (rng.standard_normal((a.ffn, a.hidden)) / np.sqrt(a.hidden)).astype(F32)
    b1 = (0.1 * rng.standard_normal(a.ffn)).astype(F32)
    w2 = (rng.standard_normal((a.hidden, a.ffn)) / np.sqrt(a.ffn)).astype(F32)
    meta = FP8Meta(4, a.history)

    print(f"transformer_engine C API demo (CPU backend, version {nvte.get_version()}): MLP block "
          f"{a.tokens}x{a.hidden} -> {a.ffn} -> {a.hidden}, FP8 E4M3 with delayed scaling "
          f"(history {a.history}, 'max')")
    print(f"{'step':>4} {'ln gain':>8} {'fp32 err':>9} {'fp8 err':>9} {'amax(ln)':>9} {'scale(ln)':>10} "
          f"{'amax(fc1)':>10} {'scale(fc1)':>11} {'fp32 ms':>8} {'fp8 ms':>8}")
    errs = []
    for step in range(a.steps):
        mag = 1.0 if step < a.steps // 2 else 30.0  # the activation range jumps half-way
        gain = (mag * ln_w).astype(F32)
        x = rng.standard_normal((a.tokens, a.hidden)).astype(F32)
        ref = mlp_ref(x, gain, ln_b, w1, b1, w2)
        t0 = time.perf_counter()
        y32 = mlp_f32(x, gain, ln_b, w1, b1, w2)
        t1 = time.perf_counter()
        y8 = mlp_fp8(x, gain, ln_b, w1, b1, w2, meta)
        t2 = time.perf_counter()
        amax_ln, amax_fc1 = meta.history[0, 2], meta.history[0, 3]
        print(f"{step:>4} {mag:>8.1f} {rel(y32, ref):>9.2e} {rel(y8, ref):>9.2e} {amax_ln:>9.3f} "
              f"{meta.scale[2]:>10.3f} {amax_fc1:>10.3f} {meta.scale[3]:>11.3f} "
              f"{1e3 * (t1 - t0):>8.1f} {1e3 * (t2 - t1):>8.1f}")
        errs.append(rel(y8, ref))
        meta.update()  # after the step, as fp8_autocast does when it exits
    jump = a.steps // 2
    print(f"FP8 relative error: {errs[jump - 1]:.2e} before the jump, {errs[jump]:.2e} on the jump step "
          f"(stale scales saturate), {errs[-1]:.2e} at the end (E4M3 keeps 3 mantissa bits, so a few 1e-2 "
          f"is expected; float32 is ~1e-7)")
    if not (errs[-1] < 0.1 and errs[jump] > 2 * errs[-1]):
        raise SystemExit("FP8 errors do not show delayed scaling recovering as expected")


if __name__ == "__main__":
    main()
