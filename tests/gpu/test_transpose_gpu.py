"""CUDA nvte_transpose, nvte_cast_transpose, the cast_transpose_dbias(+dact) family and
nvte_multi_cast_transpose against the CPU backend on copies of the same inputs.

Transposes and casts are bit-exact (data, columnwise data, amax, scale_inv). dbias is compared
with the float32-summation-order tolerance of test_cast_gpu (the GPU's fixed tree order differs
from the CPU's row order; bit equality is not part of the contract), and activations other than
drelu allow neighbouring FP8 codes (device vs host float32 transcendentals)."""
import pytest
import torch

from transformer_engine import _nvte as nvte

from gpu_util import DT, HP_TORCH, T, assert_bits_equal, sync
from test_cast_gpu import (ACTS, FMTS, HP, assert_dbias_close, assert_fp8_near, assert_same, both, fp8_buffers,
                           g_reference, gen, make_input, offset, run_dbias_op, tt)

SHAPES = [(1, 1), (3, 5), (37, 129), (256, 1000), (1023, 4097), (2, 3, 40), (128, 64), (640, 192)]
RAW = {"uint8": (torch.uint8, DT.kByte), "e4m3": (torch.uint8, DT.kFloat8E4M3), "int16": (torch.int16, DT.kInt16),
       "bfloat16": (torch.bfloat16, DT.kBFloat16), "float16": (torch.float16, DT.kFloat16),
       "float32": (torch.float32, DT.kFloat32), "int32": (torch.int32, DT.kInt32), "int64": (torch.int64, DT.kInt64)}


def random_bits(shape, tdtype, seed):
    """Arbitrary bit patterns (NaN payloads included) of the given element type."""
    size = torch.empty((), dtype=tdtype).element_size()
    n = 1
    for s in shape:
        n *= s
    b = torch.randint(0, 256, (n * size,), generator=gen(seed), dtype=torch.int32).to(torch.uint8)
    return b.view(tdtype).reshape(shape)


# ----------------------------------------------------------------------------- transpose
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", list(RAW))
def test_transpose_matches_cpu_bit_for_bit(shape, name):
    tdtype, nv = RAW[name]
    x = random_bits(shape, tdtype, shape[0] * 13 + shape[-1])
    rows = x.numel() // shape[-1]

    def run(dev):
        out = random_bits((shape[-1], rows), tdtype, 999).to(dev)  # poison
        nvte.transpose(tt(x.to(dev), dtype=nv), tt(out, dtype=nv))
        return {"data": out}

    c, g = both(run)
    assert_same(g, c)
    assert_bits_equal(g["data"], x.reshape(rows, shape[-1]).t().contiguous())


@pytest.mark.parametrize("name", ["uint8", "bfloat16", "float32", "int64"])
def test_transpose_misaligned(name):
    tdtype, nv = RAW[name]
    x = random_bits((67, 136), tdtype, 5)

    def run(dev):
        out = offset(torch.zeros((136, 67), dtype=tdtype, device=dev))
        nvte.transpose(tt(offset(x.to(dev)), dtype=nv), tt(out, dtype=nv))
        return {"data": out}

    c, g = both(run)
    assert_same(g, c)


def test_transpose_large():
    x = random_bits((4096, 4100), torch.bfloat16, 1)
    out = torch.empty((4100, 4096), dtype=torch.bfloat16, device="cuda")
    nvte.transpose(tt(x.cuda()), tt(out))
    sync()
    assert_bits_equal(out, x.t().contiguous())


# ----------------------------------------------------------------------------- cast_transpose
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("in_name", HP)
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("layout", ["both", "col"])
def test_cast_transpose_matches_cpu(shape, in_name, fmt, layout):
    x = make_input(shape, in_name, shape[0] + 3 * shape[-1], specials=True)

    def run(dev):
        o = fp8_buffers(shape, fmt, dev, scale=1.75, amax=0.0, rowwise=layout == "both", columnwise=True)
        nvte.cast_transpose(tt(x.to(dev)), o["T"].t)
        return o

    c, g = both(run)
    assert_same(g, c)


def test_cast_transpose_large():
    shape = (4096, 4096)
    x = make_input(shape, "bfloat16", 17)

    def run(dev):
        o = fp8_buffers(shape, "e4m3", dev, scale=0.5, columnwise=True)
        nvte.cast_transpose(tt(x.to(dev)), o["T"].t)
        return o

    c, g = both(run)
    assert_same(g, c)


@pytest.mark.parametrize("in_name", HP)
def test_cast_transpose_misaligned(in_name):
    shape = (130, 72)
    x = make_input(shape, in_name, 6)

    def run(dev):
        o = fp8_buffers(shape, "e5m2", dev, scale=3.0, columnwise=True, misalign=True)
        nvte.cast_transpose(tt(offset(x.to(dev))), o["T"].t)
        return o

    c, g = both(run)
    assert_same(g, c)


# ----------------------------------------------------------------------------- dbias family
@pytest.mark.parametrize("shape", [(1, 1), (3, 5), (37, 129), (256, 1000), (1023, 4097)])
@pytest.mark.parametrize("in_name", HP)
@pytest.mark.parametrize("fmt", FMTS)
def test_cast_transpose_dbias_matches_cpu(shape, in_name, fmt):
    x = make_input(shape, in_name, 40 + shape[0], scale=2.0**-4)
    c, g = both(lambda dev: run_dbias_op("cast_transpose_dbias", x, None, shape, fmt, dev, "both", in_name))
    assert_same(g, c)
    assert_dbias_close(g["dbias"], c["dbias"], g_reference(x, None, None), in_name)


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("shape", [(3, 5), (37, 129), (256, 1000), (300, 4104)])
@pytest.mark.parametrize("in_name", HP)
def test_cast_transpose_dbias_dact_matches_cpu(act, shape, in_name):
    gg = gen(shape[0] + shape[1] * 3)
    x = (torch.randn(shape, generator=gg) * 4).to(HP_TORCH[in_name])
    act_x = (torch.randn(shape, generator=gg) * 3).to(HP_TORCH[in_name])
    fmt = "e5m2" if act in ("dgelu", "dsilu") else "e4m3"
    c, g = both(lambda dev: run_dbias_op("cast_transpose_dbias_" + act, x, act_x, shape, fmt, dev, "both",
                                         "float32", 1.25))
    if act == "drelu":
        assert_same(g, c)
    else:
        assert_fp8_near(g["data"], c["data"])
        assert_fp8_near(g["col"], c["col"])
        assert_bits_equal(g["col"], g["data"].t().contiguous())  # one value, two layouts
        assert_same(g, c, keys=("scale_inv", "col_scale_inv"))
    assert_dbias_close(g["dbias"], c["dbias"], g_reference(x, act, act_x), "float32")


def test_cast_transpose_dbias_dgelu_large():
    shape = (4096, 4096)
    gg = gen(77)
    x = (torch.randn(shape, generator=gg)).to(torch.bfloat16)
    act_x = (torch.randn(shape, generator=gg) * 2).to(torch.bfloat16)
    c, g = both(lambda dev: run_dbias_op("cast_transpose_dbias_dgelu", x, act_x, shape, "e5m2", dev, "both",
                                         "bfloat16", 1.0))
    assert_fp8_near(g["data"], c["data"], max_frac=1e-4)
    assert_bits_equal(g["col"], g["data"].t().contiguous())
    assert_dbias_close(g["dbias"], c["dbias"], g_reference(x, "dgelu", act_x), "bfloat16")


# ----------------------------------------------------------------------------- multi
def test_multi_cast_transpose_matches_cpu():
    specs = [((37, 129), "float32", "e4m3", True), ((256, 1000), "bfloat16", "e5m2", True),
             ((1, 1), "float16", "e4m3", False), ((640, 192), "bfloat16", "e4m3", True)]
    xs = [make_input(s, n, i + 50) for i, (s, n, _, _) in enumerate(specs)]

    def run(dev):
        outs = [fp8_buffers(s, f, dev, scale=1.0 + i, columnwise=colw) for i, (s, _, f, colw) in enumerate(specs)]
        ins = [T(x.to(dev)) for x in xs]
        nvte.multi_cast_transpose([t.t for t in ins], [o["T"].t for o in outs])
        return outs

    c, g = both(run)
    for gi, ci in zip(g, c):
        assert_same(gi, ci)


def test_multi_cast_transpose_many_tensors_in_few_launches():
    """More tensors of one kind than one launch carries (tiles::kMaxMulti = 24: 26 aligned bf16 ->
    E4M3 ones come first), then runs broken by dtype pair and alignment (odd widths and offset
    pointers take the scalar path), empty tensors (scale_inv only), rowwise-only outputs and odd
    sizes: every output bit-equal to the CPU's."""
    shapes = [(64 + 3 * i, 16 * (1 + i % 5)) for i in range(26)]
    shapes += [(33, 17), (70, 48), (9, 40), (130, 7), (2, 3, 40), (0, 32), (5, 0), (1, 1), (300, 24)]
    fmts = ["e4m3"] * 26 + ["e4m3", "e5m2", "e5m2", "e4m3", "e5m2", "e4m3", "e5m2", "e4m3", "e4m3"]
    misaligned = {28, 34}
    xs = [make_input(s, "bfloat16", 200 + i) for i, s in enumerate(shapes)]

    def run(dev):
        outs = [fp8_buffers(s, fmts[i], dev, scale=0.5 + i, amax=0.1 * i, columnwise=i % 6 != 1)
                for i, s in enumerate(shapes)]
        ins = [T(offset(x.to(dev)) if i in misaligned else x.to(dev)) for i, x in enumerate(xs)]
        nvte.multi_cast_transpose([t.t for t in ins], [o["T"].t for o in outs])
        return outs

    c, g = both(run)
    for i, (gi, ci) in enumerate(zip(g, c)):
        try:
            assert_same(gi, ci)
        except AssertionError as e:
            raise AssertionError(f"tensor {i} of shape {shapes[i]}: {e}") from None
