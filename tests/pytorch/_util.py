"""Helpers of the PyTorch adapter tests: float64 references and FP8 emulation in torch, and the
device the device-agnostic tests run their modules on.

NVTE_TEST_DEVICE=cuda (or pytest --nvte-device=cuda with tests/pytorch on the command line) runs
the modules of the converted tests on the GPU (the library's CUDA backend): inputs are drawn on the
CPU (seeded generators), moved with dev() (differentiable, so x.grad lands on the CPU leaf), and
the float64 references stay on the CPU (cpu64(), rel_err and fp8_emulate move their operands
there). Default: cpu."""
import os

import numpy as np
import pytest
import torch

DEVICE = torch.device(os.environ.get("NVTE_TEST_DEVICE", "cpu"))
ON_CUDA = DEVICE.type == "cuda"


def gemm_dim(n, multiple=16):
    """A GEMM dimension for the test device: n itself on the CPU (whose backend runs every shape,
    odd sizes included), n rounded up to a multiple of `multiple` on CUDA. cuBLASLt's FP8 GEMMs need
    the leading dimensions of A, B and D to be multiples of 16 bytes, so every dimension of an FP8
    GEMM (in/out features, tokens = batch*seq, ffn size, GroupedLinear m_splits) is a multiple of
    16 there, as in TE; its GELU epilogues need m to be a multiple of 8 (multiple=8)."""
    return n if not ON_CUDA else -(-n // multiple) * multiple


# Hopper's FP8 tensor cores accumulate a GEMM with fewer mantissa bits than float32: TE runs the
# forward FP8 GEMM with cuBLASLt's fast accumulation (CUBLASLT_MATMUL_DESC_FAST_ACCUM: the partial
# sums stay in the tensor cores' reduced-precision accumulator), and without it cuBLASLt promotes
# the partial sums to float32 only every few K blocks (for these tests' small K, hardly at all), so
# the dgrad/wgrad GEMMs are not float32-accurate either. The CPU backend accumulates in float32,
# which the float64 FP8 emulation tests' tolerances (1e-5, 1e-6) assume. On an H200 those tests
# (K <= 128) measured relative L2 errors of 1.4e-5 .. 7.8e-5 against the emulation; 2e-4 keeps
# ~2.5x margin over that and is still ~50x below the FP8 quantization error (~1e-2) that the
# emulation comparisons must be able to tell apart (a missing or wrong cast or scale shows up at
# that size).
FP8_GEMM_CUDA_TOL = 2e-4


def fp8_gemm_tol(cpu_tol):
    """rel_err tolerance for a result of FP8 GEMMs compared with its float64 emulation (the same
    quantized operands, exact accumulation): cpu_tol on the CPU (float32 accumulation, unchanged);
    max(cpu_tol, FP8_GEMM_CUDA_TOL) on CUDA, where the FP8 tensor cores accumulate with fewer
    mantissa bits (see FP8_GEMM_CUDA_TOL)."""
    return max(cpu_tol, FP8_GEMM_CUDA_TOL) if ON_CUDA else cpu_tol


def gelu_epilogue_tol():
    """rel_err tolerance of a GEMM's fused GELU output against gelu_tanh() of the float64 GEMM:
    1e-6 on the CPU (the library's own float32 GELU); 1e-5 on CUDA, where the epilogue is cuBLASLt's
    (CUBLASLT_EPILOGUE_GELU_AUX(_BIAS)), its own float32 tanh-approximation formula and evaluation
    order (1.31e-6 measured on an H200, for a float32 GEMM whose pre-activation is within 1e-6)."""
    return 1e-5 if ON_CUDA else 1e-6


def raises_e5m2_gemm():
    """pytest.raises for the library's clear error when an FP8 GEMM has both operands in
    float8_e5m2 (cuBLASLt has no such GEMM: an all-E5M2 recipe cannot run on the GPU)."""
    from transformer_engine import _nvte
    return pytest.raises(_nvte.Error, match="cuBLASLt has no FP8 GEMM with both operands in float8_e5m2")


def dev(t):
    """t on the test device (a differentiable copy; None stays None)."""
    return None if t is None else t.to(DEVICE)


def cpu64(t):
    """A float64 CPU copy of t (detached), for references."""
    return t.detach().double().cpu()

FP8 = {"e4m3": (torch.float8_e4m3fn, 448.0), "e5m2": (torch.float8_e5m2, 57344.0)}


def rel_err(got, ref):
    got = got.detach().double().cpu()
    ref = ref.detach().double().cpu()
    return float((got - ref).norm() / max(float(ref.norm()), 1e-30))


def fp8_emulate(x, scale, fmt):
    """Decoded value of fp8(float32(x) * scale) / scale (saturating), in float64."""
    dt, mx = FP8[fmt]
    s = torch.tensor(float(scale), dtype=torch.float32)
    y = (x.detach().float().cpu() * s).clamp(-mx, mx).to(dt)
    return y.double() / s.double()


def gelu_tanh(x):
    return 0.5 * x * (1.0 + torch.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3)))


def seeded(rng):
    return torch.Generator().manual_seed(int(rng.integers(0, 2**31)))


def load_example(name):
    """The module examples/<name>.py (the examples are scripts, not a package)."""
    import importlib.util
    path = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples",
                                         f"{name}.py"))
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
