"""Helpers for GPU tests: NVTE tensors over torch tensors (CUDA or CPU), poisoning and
bit/tolerance comparisons. The same helper builds the CPU twin of a CUDA call, so a test
runs one op on both backends and compares."""
import numpy as np
import torch

from transformer_engine import _nvte as nvte

DT = nvte.DType
TORCH_TO_NVTE = {
    torch.float32: DT.kFloat32, torch.float16: DT.kFloat16, torch.bfloat16: DT.kBFloat16,
    torch.uint8: DT.kByte, torch.int8: DT.kByte, torch.bool: DT.kByte, torch.int16: DT.kInt16,
    torch.int32: DT.kInt32, torch.int64: DT.kInt64,
    torch.float8_e4m3fn: DT.kFloat8E4M3, torch.float8_e5m2: DT.kFloat8E5M2,
}
FP8_TORCH = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
HP_TORCH = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class T:
    """An nvte.Tensor whose buffers are torch tensors (kept alive here).

    data/columnwise: any torch tensor (dtype overrides the element type, e.g. DT.kFloat8E4M3 for
    uint8 storage); scale/amax/scale_inv/columnwise_scale_inv: float32 tensors of one element."""

    def __init__(self, data=None, dtype=None, scale=None, amax=None, scale_inv=None, columnwise=None,
                 columnwise_scale_inv=None):
        self.t = nvte.Tensor()
        self.refs = {}
        for param, x, dt in [
            (nvte.Param.kRowwiseData, data, dtype), (nvte.Param.kColumnwiseData, columnwise, dtype),
            (nvte.Param.kScale, scale, None), (nvte.Param.kAmax, amax, None),
            (nvte.Param.kRowwiseScaleInv, scale_inv, None),
            (nvte.Param.kColumnwiseScaleInv, columnwise_scale_inv, None),
        ]:
            if x is None:
                continue
            assert x.is_contiguous(), "NVTE tensors need contiguous torch tensors"
            nv = dt if dt is not None else TORCH_TO_NVTE[x.dtype]
            self.t.set_param(param, x.data_ptr(), list(x.shape), nv)
            self.refs[int(param)] = x
        self.t._refs = self.refs  # `T(x).t` alone keeps the borrowed buffers alive


def fp8_out(shape, fmt, device, scale=1.0, amax=0.0, rowwise=True, columnwise=False):
    """Buffers of an FP8 output (uint8 storage, poisoned with 0xAB) as a dict, plus its T."""
    rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    cols = shape[-1] if len(shape) else 1
    b = {
        "data": torch.full(shape, 0xAB, dtype=torch.uint8, device=device) if rowwise else None,
        "col": torch.full((cols, rows), 0xAB, dtype=torch.uint8, device=device) if columnwise else None,
        "scale": torch.tensor([scale], dtype=torch.float32, device=device),
        "amax": torch.tensor([amax], dtype=torch.float32, device=device),
        "scale_inv": torch.tensor([-1.0], dtype=torch.float32, device=device),
    }
    dt = DT.kFloat8E4M3 if fmt == "e4m3" else DT.kFloat8E5M2
    b["T"] = T(b["data"], dtype=dt, scale=b["scale"], amax=b["amax"], scale_inv=b["scale_inv"], columnwise=b["col"])
    return b


def poisoned(shape, dtype, device):
    """An output filled with NaN (float dtypes) so unwritten elements show."""
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def cpu_copy(x):
    return None if x is None else x.detach().to("cpu").clone()


def _explain(got, ref, bad, n=5):
    idx = bad.nonzero()
    lines = [f"{idx.shape[0]} of {bad.numel()} elements differ"]
    for i in idx[:n].tolist():
        t = tuple(i)
        lines.append(f"  at {t}: got {got[t].item()!r} ref {ref[t].item()!r}")
    return "\n".join(lines)


def assert_bits_equal(got, ref):
    """Bit-for-bit equality (compares raw bytes of any dtype); got may live on the GPU."""
    g, r = got.detach().cpu(), ref.detach().cpu()
    assert g.shape == r.shape and g.dtype == r.dtype, f"{g.shape}/{g.dtype} vs {r.shape}/{r.dtype}"
    gi = g.contiguous().view(torch.uint8) if g.element_size() == 1 else g.contiguous().view(
        {2: torch.int16, 4: torch.int32, 8: torch.int64}[g.element_size()])
    ri = r.contiguous().view(gi.dtype)
    bad = gi != ri
    assert not bool(bad.any()), _explain(g.float() if g.is_floating_point() else g, r.float() if r.is_floating_point() else r, bad)


def assert_close(got, ref, atol, rtol):
    g, r = got.detach().cpu().double(), ref.detach().cpu().double()
    assert g.shape == r.shape, f"{g.shape} vs {r.shape}"
    bad = ~((g - r).abs() <= atol + rtol * r.abs()) & ~(g.isnan() & r.isnan())
    assert not bool(bad.any()), _explain(g, r, bad)


def sync():
    torch.cuda.synchronize()
