"""CUDA FP8 scaling recipes against the CPU backend, bit for bit: the delayed-scaling update
(single, in place and out of place; bulk after an amax reduction, many histories in one call),
nvte_compute_amax and nvte_compute_scale_from_amax (with the device-side noop flag). Both
backends run the same float32 operations, so every output bit must agree."""
import numpy as np
import pytest
import torch

from transformer_engine import _nvte as nvte

from gpu_util import DT, T, assert_bits_equal, sync
from test_cast_gpu import HP, both, fp8_buffers, gen, make_input, offset, tt

FMTS = ["e4m3", "e5m2"]
FP8_DT = {"e4m3": DT.kFloat8E4M3, "e5m2": DT.kFloat8E5M2}
ALGOS = ["max", "most_recent"]


def history(shape, seed):
    """Amax histories with the awkward values: zero columns/rows, NaN, inf, huge and tiny."""
    g = gen(seed)
    h = torch.rand(shape, generator=g, dtype=torch.float32) * torch.exp2(
        torch.randint(-20, 20, shape, generator=g).float())
    h2 = h.view(shape[0], -1)
    n = h2.shape[1]
    if n >= 2:
        h2[:, 1] = 0.0  # never used: keeps its scale
    if n >= 3:
        h2[0, 2] = float("nan")
    if n >= 4:
        h2[-1, 3] = float("inf")
    if n >= 5:
        h2[:, 4] = 1e-44  # fp8_max / amax overflows -> FLT_MAX
    if n >= 6:
        h2[0, 5] = 0.0  # most_recent sees 0
    return h


def scales_for(n, seed):
    return torch.rand(n, generator=gen(seed), dtype=torch.float32) * 8 + 0.1


@pytest.mark.parametrize("shape", [(1,), (16,), (1, 1), (1024, 1), (7, 6), (1024, 3), (33, 70)])
@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("margin", [0.0, 1.0, 0.5])
@pytest.mark.parametrize("inplace", [False, True])
def test_amax_and_scale_update_matches_cpu(shape, algo, fmt, margin, inplace):
    h0 = history(shape, sum(shape))
    n = h0.view(shape[0], -1).shape[1]
    s0 = scales_for(n, n)

    def run(dev):
        h, s = h0.clone().to(dev), s0.clone().to(dev)
        if inplace:
            nh, ns = h, s
        else:
            nh, ns = torch.full_like(h, float("nan")), torch.full_like(s, float("nan"))
        nvte.delayed_scaling_recipe_amax_and_scale_update(tt(h), tt(s), tt(nh), tt(ns), algo, FP8_DT[fmt],
                                                          margin)
        return {"h": nh, "s": ns, "h_in": h}

    c, g = both(run)
    assert_bits_equal(g["h"], c["h"])
    assert_bits_equal(g["s"], c["s"])
    assert_bits_equal(g["h_in"], c["h_in"])


def make_group(specs, seed):
    hs = [history(s, seed + i) for i, s in enumerate(specs)]
    ss = [scales_for(h.view(h.shape[0], -1).shape[1], seed + 100 + i) for i, h in enumerate(hs)]
    return hs, ss


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("buffer_kind", ["values", "with_zeros", "empty", "none"])
@pytest.mark.parametrize("count", [1, 5, 300])
def test_after_reduction_matches_cpu(algo, buffer_kind, count):
    shapes = [(1024, 3), (16,), (1, 1), (7, 6), (64, 2), (1, 4)]
    specs = [shapes[i % len(shapes)] for i in range(count)]
    hs0, ss0 = make_group(specs, count)
    total = sum(h.view(h.shape[0], -1).shape[1] for h in hs0)
    buf0 = torch.rand(total, generator=gen(total), dtype=torch.float32) * 100
    if buffer_kind == "with_zeros":
        buf0[::3] = 0.0  # tensors not used this step
        buf0[1::7] = float("nan")

    def run(dev):
        hs = [h.clone().to(dev) for h in hs0]
        ss = [s.clone().to(dev) for s in ss0]
        if buffer_kind == "none":
            buf = None
        elif buffer_kind == "empty":
            buf = T(torch.zeros(0, dtype=torch.float32, device=dev))
        else:
            buf = T(buf0.clone().to(dev))
        nvte.delayed_scaling_recipe_amax_and_scale_update_after_reduction(
            buf.t if buf is not None else None, [tt(h) for h in hs], [tt(s) for s in ss], algo,
            FP8_DT["e4m3"], 0.0)
        return hs, ss

    (ch, cs), (gh, gs) = both(run)
    for a, b in zip(gh + gs, ch + cs):
        assert_bits_equal(a, b)


@pytest.mark.parametrize("margin", [0.0, 2.0, 0.25])
@pytest.mark.parametrize("fmt", FMTS)
def test_after_reduction_margins_and_formats(margin, fmt):
    hs0, ss0 = make_group([(32, 6), (8,), (128, 5)], 9)
    buf0 = torch.tensor([3.0, 0.0, 1e-40, float("inf"), 5.0, 6.0, 7.0, 0.5, 1e-44, 2.0, 0.0, 1e30],
                        dtype=torch.float32)

    def run(dev):
        hs = [h.clone().to(dev) for h in hs0]
        ss = [s.clone().to(dev) for s in ss0]
        nvte.delayed_scaling_recipe_amax_and_scale_update_after_reduction(
            tt(buf0.to(dev)), [tt(h) for h in hs], [tt(s) for s in ss], "max", FP8_DT[fmt], margin)
        return hs, ss

    (ch, cs), (gh, gs) = both(run)
    for a, b in zip(gh + gs, ch + cs):
        assert_bits_equal(a, b)


# ----------------------------------------------------------------------------- current scaling
@pytest.mark.parametrize("shape", [(1, 1), (3, 5), (37, 129), (1023, 4097), (2, 3, 40), (4096, 4096)])
@pytest.mark.parametrize("in_name", HP)
def test_compute_amax_overwrites(shape, in_name):
    x = make_input(shape, in_name, shape[0], specials=shape[0] > 3)

    def run(dev):
        o = fp8_buffers(shape, "e4m3", dev, amax=1e30)  # overwritten, not accumulated
        nvte.compute_amax(tt(x.to(dev)), o["T"].t)
        return o

    c, g = both(run)
    assert_bits_equal(g["amax"], c["amax"])
    assert bool((g["data"] == 0xAB).all())


@pytest.mark.parametrize("in_name", HP)
def test_compute_amax_misaligned_and_nan_only(in_name):
    x = make_input((77, 33), in_name, 4)
    nan = torch.full((5, 7), float("nan"), dtype=x.dtype)
    for inp in (x, nan):
        def run(dev):
            o = fp8_buffers(tuple(inp.shape), "e5m2", dev, amax=-3.0)
            nvte.compute_amax(tt(offset(inp.to(dev))), o["T"].t)
            return o

        c, g = both(run)
        assert_bits_equal(g["amax"], c["amax"])


AMAXES = [0.0, 1e-30, 1e-44, 3.5, 448.0, 1e6, float("inf"), float("nan"), -2.0]


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("eps", [0.0, 1e-3])
def test_compute_scale_from_amax_matches_cpu(fmt, pow2, eps):
    def run(dev):
        res = []
        for a in AMAXES:
            o = fp8_buffers((2, 2), fmt, dev, scale=-7.0, amax=a)
            nvte.compute_scale_from_amax(o["T"].t, force_pow2_scales=pow2, amax_epsilon=eps)
            res.append(o["scale"])
        return torch.cat(res)

    c, g = both(run)
    assert_bits_equal(g, c)


def test_compute_scale_from_amax_noop_on_the_device():
    for flag in (1.0, 0.0):
        def run(dev):
            o = fp8_buffers((2, 2), "e4m3", dev, scale=-7.0, amax=2.0)
            noop = T(torch.tensor([flag], dtype=torch.float32, device=dev))
            nvte.compute_scale_from_amax(o["T"].t, noop=noop.t)
            return o["scale"]

        c, g = both(run)
        assert_bits_equal(g, c)
        assert g.item() == (-7.0 if flag == 1.0 else 224.0)
