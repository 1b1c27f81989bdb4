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
