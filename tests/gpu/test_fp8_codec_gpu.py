"""FP8 casts on the GPU are bit-identical to the CPU backend's: every bfloat16 bit pattern,
a million random float32 values of mixed magnitude, exact ties and the specials, for E4M3 and
E5M2, with scale 1 and with awkward scales; and the decode of every FP8 code."""
import numpy as np
import pytest
import torch

from transformer_engine import _nvte as nvte

from gpu_util import DT, T, assert_bits_equal, fp8_out

FMTS = ["e4m3", "e5m2"]
FP8_DT = {"e4m3": DT.kFloat8E4M3, "e5m2": DT.kFloat8E5M2}


def quantize_both(x_cpu, fmt, scale):
    """Runs nvte_quantize on the CPU and on the GPU; returns (cpu bytes, gpu bytes, cpu amax, gpu amax)."""
    res = []
    for dev in ("cpu", "cuda"):
        x = x_cpu.to(dev)
        o = fp8_out(tuple(x.shape), fmt, dev, scale=scale)
        x_t = T(x)  # keep every wrapper alive until the op has run
        nvte.quantize(x_t.t, o["T"].t)
        res.append((o["data"].cpu(), o["amax"].cpu(), o["scale_inv"].cpu()))
    torch.cuda.synchronize()
    return res


def all_bf16():
    return torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).reshape(256, 256).contiguous()


def random_f32(n, seed):
    g = np.random.default_rng(seed)
    mag = np.exp2(g.uniform(-30, 20, n)).astype(np.float32)
    x = (mag * g.choice([-1, 1], n)).astype(np.float32)
    specials = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 448, 464, 480, -464, 57344, 61440, 2.0**-9,
                         2.0**-10, 3 * 2.0**-11, 2.0**-16, 2.0**-17, 3 * 2.0**-18, 1.0625, 1.1875], np.float32)
    return torch.from_numpy(np.concatenate([x, specials]))


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("scale", [1.0, 3.0, 2.0**-7])
def test_every_bf16_pattern(fmt, scale):
    (c, ca, cs), (g, ga, gs) = quantize_both(all_bf16(), fmt, scale)
    assert_bits_equal(g, c)
    assert_bits_equal(gs, cs)
    assert ga.item() == ca.item()


@pytest.mark.parametrize("fmt", FMTS)
def test_random_float32_and_specials(fmt):
    x = random_f32(1_000_000, 7)
    (c, ca, _), (g, ga, _) = quantize_both(x[: 7000 * 135].reshape(7000, 135).contiguous(), fmt, 1.0)
    assert_bits_equal(g, c)
    (c, ca, _), (g, ga, _) = quantize_both(x, fmt, 1.0)  # 1-D, odd length: the scalar tail path
    assert_bits_equal(g, c)
    assert ga.item() == ca.item()


@pytest.mark.parametrize("fmt", FMTS)
def test_decode_every_code(fmt):
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    outs = []
    for dev in ("cpu", "cuda"):
        out = torch.full((256,), float("nan"), dtype=torch.float32, device=dev)
        src = T(codes.to(dev), dtype=FP8_DT[fmt], scale_inv=torch.ones(1, device=dev))
        dst = T(out)
        nvte.dequantize(src.t, dst.t)
        torch.cuda.synchronize()
        outs.append(out.cpu())
    torch.cuda.synchronize()
    assert_bits_equal(outs[1], outs[0])
