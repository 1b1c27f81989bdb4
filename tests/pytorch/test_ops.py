"""The _ops layer: argument validation and one op each against torch. The ops run on
NVTE_TEST_DEVICE (default the CPU backend); references stay float64 on the CPU."""
import os
import tempfile

import pytest
import torch

from transformer_engine.pytorch import _ops
import transformer_engine.pytorch as te
from transformer_engine.common import recipe
from _util import DEVICE, cpu64, dev, fp8_emulate, gelu_epilogue_tol, gelu_tanh, gemm_dim, rel_err, seeded


def test_quantize_writes_amax_and_scale_inv(rng):
    x = torch.randn(6, 10, generator=seeded(rng)) * 5
    scale = dev(torch.tensor([4.0]))
    amax = dev(torch.tensor([100.0]))  # max-accumulated, so stays 100
    q = _ops.quantize(dev(x), scale, amax, _ops.DType.kFloat8E4M3, rowwise=True, columnwise=True)
    assert q.data.dtype == torch.uint8 and q.data.shape == (6, 10) and q.transpose.shape == (10, 6)
    assert float(q.scale_inv) == 0.25 and float(amax) == 100.0
    torch.testing.assert_close(cpu64(_ops.dequantize(q)), fp8_emulate(x, 4.0, "e4m3"), rtol=0, atol=0)
    assert torch.equal(q.transpose, q.data.t().contiguous())


def test_quantize_slot_addresses_the_module_buffers(rng):
    """slot i: scale[i] and amax history row 0, column i, as through one-element views."""
    x = dev(torch.randn(4, 6, generator=seeded(rng)) * 3)
    scale, hist = dev(torch.tensor([1.0, 8.0, 2.0])), dev(torch.zeros(2, 3))
    q = _ops.quantize(x, scale, hist, _ops.DType.kFloat8E4M3, rowwise=True, columnwise=True, slot=1)
    ref_amax = dev(torch.zeros(1))
    ref = _ops.quantize(x, scale[1:2], ref_amax, _ops.DType.kFloat8E4M3, rowwise=True, columnwise=True)
    assert torch.equal(q.data, ref.data) and torch.equal(q.transpose, ref.transpose)
    assert float(q.scale_inv) == 1 / 8 and float(hist[0, 1]) == float(ref_amax) == float(x.abs().max())
    assert float(hist.sum()) == float(ref_amax)  # no other slot or row touched
    with pytest.raises(ValueError, match="slot 3"):
        _ops.quantize(x, scale, hist, _ops.DType.kFloat8E4M3, slot=3)
    with pytest.raises(ValueError, match="amax history"):
        _ops.quantize(x, scale, hist[0], _ops.DType.kFloat8E4M3, slot=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_many_matches_separate_casts(rng, dtype):
    """quantize_many: the casts of several tensors (odd sizes, an empty one) one after the other in
    one buffer, byte for byte those of separate casts with the same scale, one scale_inv, and the
    largest amax of all accumulated into the one history slot (above a larger value already there,
    it stays)."""
    g = seeded(rng)
    xs = [(torch.randn(*shape, generator=g) * m).to(dtype) for shape, m in
          (((3, 5, 7), 3.0), ((0, 4), 1.0), ((11, 2), 40.0), ((1, 13), 0.01))]
    scale, hist = dev(torch.tensor([1.0, 4.0, 2.0])), dev(torch.zeros(2, 3))
    buf, si = _ops.quantize_many([dev(x) for x in xs], scale, hist, _ops.DType.kFloat8E4M3, slot=1)
    assert buf.dtype == torch.uint8 and buf.shape == (sum(x.numel() for x in xs),) and float(si) == 0.25
    at = 0
    for x in xs:
        ref = _ops.quantize(dev(x), scale[1:2], dev(torch.zeros(1)), _ops.DType.kFloat8E4M3)
        assert torch.equal(buf[at:at + x.numel()].view(x.shape), ref.data.view(x.shape))
        at += x.numel()
    assert float(hist[0, 1]) == max(float(x.float().abs().max()) for x in xs if x.numel())
    assert float(hist.sum()) == float(hist[0, 1])  # no other slot or row touched
    hist[0, 1] = 1000.0
    _ops.quantize_many([dev(x) for x in xs], scale, hist, _ops.DType.kFloat8E4M3, slot=1)
    assert float(hist[0, 1]) == 1000.0
    with pytest.raises(ValueError, match="at least one"):
        _ops.quantize_many([], scale, hist, _ops.DType.kFloat8E4M3, slot=1)
    with pytest.raises(TypeError, match="xs\\[1\\]: dtype torch.int32"):
        _ops.quantize_many([dev(xs[0]), dev(torch.zeros(3, dtype=torch.int32))], scale, hist,
                           _ops.DType.kFloat8E4M3, slot=1)


def test_linear_cfg_is_kept_per_configuration_and_follows_the_recipe():
    m = te.Linear(16, 16, device=DEVICE)  # FP8 GEMMs on cuBLASLt need 16-byte leading dimensions
    x = dev(torch.randn(16, 16))
    for margin in (0, 1):
        with te.fp8_autocast(fp8_recipe=recipe.DelayedScaling(margin=margin, amax_history_len=2)):
            m(x)
            cfg = m._linear_cfg("delayed")
            assert cfg.margin == margin and m._linear_cfg("delayed") is cfg
    assert m._linear_cfg("none", gelu=True).gelu and m._linear_cfg("none") is m._linear_cfg("none")


def test_gemm_layouts_and_gelu_epilogue(rng):
    g = seeded(rng)
    m = gemm_dim(5, 8)  # 5 on the CPU; 8 on CUDA, where cuBLASLt's GELU epilogue needs m % 8 == 0
    a, b, bias = torch.randn(m, 7, generator=g), torch.randn(3, 7, generator=g), torch.randn(m, generator=g)
    y, pre = _ops.gemm(dev(a), dev(b), torch.float32, transa=True, transb=False, bias=dev(bias), gelu=True)
    ref = b.double() @ a.double().t() + bias.double()
    assert rel_err(pre, ref) < 1e-6
    assert rel_err(y, gelu_tanh(ref)) < gelu_epilogue_tol()  # CUDA: cuBLASLt's own GELU formula
    dy = torch.randn(3, m, generator=g)
    assert rel_err(_ops.gemm(dev(a), dev(dy), torch.float32, False, False), dy.double() @ a.double()) < 1e-6
    assert rel_err(_ops.gemm(dev(b), dev(dy), torch.float32, False, True), dy.double().t() @ b.double()) < 1e-6
    assert rel_err(_ops.dgelu(dev(dy), pre), dy.double() * torch.func.grad(lambda t: gelu_tanh(t).sum())(cpu64(pre))) < 1e-5


def test_validation_messages():
    x = dev(torch.randn(4, 6))
    one = dev(torch.ones(1))
    with pytest.raises(ValueError, match="contiguous"):
        _ops.quantize(x.t(), one, None, _ops.DType.kFloat8E4M3)
    with pytest.raises(TypeError, match="dtype torch.float64"):
        _ops.quantize(x.double(), one, None, _ops.DType.kFloat8E4M3)
    with pytest.raises(ValueError, match="one element"):
        _ops.quantize(x, dev(torch.ones(2)), None, _ops.DType.kFloat8E4M3)
    with pytest.raises(ValueError, match="fp8_dtype"):
        _ops.quantize(x, one, None, _ops.DType.kFloat32)
    with pytest.raises(ValueError, match="inner dimensions"):
        _ops.gemm(dev(torch.randn(3, 5)), dev(torch.randn(2, 4)), torch.float32, True, False)
    with pytest.raises(ValueError, match="2D"):
        _ops.gemm(dev(torch.randn(3, 5, 1)), dev(torch.randn(2, 5)), torch.float32, True, False)
    with pytest.raises(ValueError, match="last dimension"):
        _ops.layernorm_fwd(x, dev(torch.ones(5)), dev(torch.zeros(5)), 1e-5)
    with pytest.raises(ValueError, match="meta"):
        _ops.gelu(torch.empty(3, device="meta"))
    with pytest.raises(RuntimeError, match="amax_compute_algo|algo"):
        _ops.delayed_scaling_update(dev(torch.zeros(2, 1)), one, "median", _ops.DType.kFloat8E4M3, 0)


def test_fp8_group_all_reduce_single_process(rng):
    """CPU-only (gloo, a one-process group): the amax reduction over fp8_group."""
    dist = torch.distributed
    if not dist.is_available() or dist.is_initialized():
        pytest.skip("torch.distributed unavailable or already initialised")
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(d, 'store')}", rank=0, world_size=1)
        try:
            m = te.Linear(8, 8, device="cpu")
            x = torch.randn(4, 8, generator=seeded(rng)) * 3
            with te.fp8_autocast(fp8_recipe=recipe.DelayedScaling(amax_history_len=2), fp8_group=dist.group.WORLD):
                m(x)
            torch.testing.assert_close(m.fp8_meta.scale["fwd"][0], 448.0 / x.abs().max())
        finally:
            dist.destroy_process_group()


def test_persistent_handles_are_kept_by_address_shape_dtype():
    """_ops._persistent (the K/V-cache path's handles of long-lived buffers): one handle per
    (address, shape, dtype); another view of the same memory gets its own."""
    from transformer_engine.pytorch import _ops
    x = torch.zeros(4, 6)
    h = _ops._persistent(x)
    assert _ops._persistent(x) is h and _ops._persistent(x.view(6, 4)) is not h
    assert _ops._persistent(x.view(torch.int32)) is not h and _ops._persistent(None) is None
    y = torch.ones(4, 6)
    assert _ops._persistent(y) is not h
