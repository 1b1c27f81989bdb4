"""Helpers of the PyTorch adapter tests: float64 references and FP8 emulation in torch."""
import numpy as np
import torch

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
