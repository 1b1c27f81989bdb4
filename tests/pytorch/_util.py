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
