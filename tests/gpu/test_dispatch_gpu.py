"""Backend dispatch with real device memory: host/device mixes are errors naming both
tensors, and CUDA tensors run on the CUDA backend."""
import pytest
import torch

from transformer_engine import _nvte as nvte

from gpu_util import DT, T


def test_cuda_backend_reported_available():
    assert nvte.cuda_backend_available()


def test_mixed_host_and_device_tensors_are_rejected():
    x = torch.randn(4, 8, device="cuda")
    out = torch.empty(4, 8, dtype=torch.uint8)  # host
    scale = torch.ones(1, device="cuda")
    o = T(out, dtype=DT.kFloat8E4M3, scale=scale)
    with pytest.raises(nvte.Error, match=r"nvte_quantize: tensors live on different devices: input data is in "
                                         r"CUDA device memory but output data is in host memory"):
        nvte.quantize(T(x).t, o.t)
    # The process and the device are fine afterwards.
    o2 = T(torch.empty(4, 8, dtype=torch.uint8, device="cuda"), dtype=DT.kFloat8E4M3, scale=scale)
    nvte.quantize(T(x).t, o2.t)
    torch.cuda.synchronize()


two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")


@two_gpus
def test_tensors_of_another_device_run_there():
    """A call runs on its tensors' device, whatever device is current (TE's C API assumes the
    current one; PyTorch users pass tensors of any device): results as on the CPU, and the caller's
    current device is unchanged afterwards."""
    torch.cuda.set_device(0)
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(96, 64, generator=g), torch.randn(48, 64, generator=g)
    d = torch.empty(48, 96, device="cuda:1")
    nvte.gemm(T(a.to("cuda:1")).t, T(b.to("cuda:1")).t, T(d).t, transa=True)
    torch.cuda.synchronize(1)
    assert torch.cuda.current_device() == 0
    torch.testing.assert_close(d.cpu(), b @ a.t(), rtol=1e-5, atol=1e-4)
    x = torch.randn(64, 96, generator=g) * 30
    scale = torch.full((1,), 2.0)
    outs = {}
    for dev in ("cpu", "cuda:1"):
        o = T(torch.empty(64, 96, dtype=torch.uint8, device=dev), dtype=DT.kFloat8E4M3, scale=scale.to(dev),
              scale_inv=torch.empty(1, device=dev), amax=torch.zeros(1, device=dev))
        nvte.quantize(T(x.to(dev)).t, o.t)
        outs[dev] = o.refs
    torch.cuda.synchronize(1)
    assert torch.cuda.current_device() == 0
    for key in outs["cpu"]:
        assert torch.equal(outs["cpu"][key], outs["cuda:1"][key].cpu()), key


@two_gpus
def test_tensors_on_two_devices_are_rejected():
    x = torch.randn(4, 8, device="cuda:0")
    o = T(torch.empty(4, 8, dtype=torch.uint8, device="cuda:1"), dtype=DT.kFloat8E4M3,
          scale=torch.ones(1, device="cuda:1"))
    with pytest.raises(nvte.Error, match=r"tensors live on different CUDA devices: input data is on device 0 but "
                                         r"output data is on device 1"):
        nvte.quantize(T(x).t, o.t)
