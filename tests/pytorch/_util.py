"""Helpers of the PyTorch adapter tests: float64 references and FP8 emulation in torch, and the
device the device-agnostic tests run their modules on.

NVTE_TEST_DEVICE=cuda (or pytest --nvte-device=cuda with tests/pytorch on the command line) runs
the modules of the converted tests on the GPU (the library's CUDA backend): inputs are drawn on the
CPU (seeded generators), moved with dev() (differentiable, so x.grad lands on the CPU leaf), and
the float64 references stay on the CPU (cpu64(), rel_err and fp8_emulate move their operands
there). Default: cpu."""
import os

import numpy as np
import torch

DEVICE = torch.device(os.environ.get("NVTE_TEST_DEVICE", "cpu"))


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
