"""transformer_engine.pytorch.batched_matmul.matmul (the unfused attention paths' products through
nvte_batched_gemm) against float64 torch: x @ y and x @ y^T over leading dimensions, forward and
both gradients, float32 / bfloat16, odd sizes; torch.compile traces it (registered op); errors
for mismatched leading dimensions. NVTE_TEST_DEVICE=cuda runs it on the GPU."""
import pytest
import torch

from transformer_engine.pytorch import batched_matmul as bm

from _util import DEVICE

# float32 products over k terms: 4 (k + 2) 2^-24 relative to |x| @ |y| (test_gemm.py's bound,
# doubled for the reference's own float32 inputs); bf16 outputs add one rounding (2^-8 relative).
REL = {torch.float32: lambda k: 4 * (k + 2) * 2.0**-24, torch.bfloat16: lambda k: 4 * (k + 2) * 2.0**-24 + 2.0**-8}


def _ref(x, y, yt):
    return x @ (y.transpose(-1, -2) if yt else y)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("yt", [False, True])
@pytest.mark.parametrize("lead,n,k,m", [((2, 3), 5, 7, 11), ((1,), 1, 1, 1), ((4,), 33, 16, 9)])
def test_matmul_and_grads_match_float64(dtype, yt, lead, n, k, m):
    g = torch.Generator().manual_seed(n * 100 + k * 10 + m)
    x = torch.randn(*lead, n, k, generator=g, dtype=torch.float64).to(dtype)
    y = torch.randn(*lead, *((m, k) if yt else (k, m)), generator=g, dtype=torch.float64).to(dtype)
    dd = torch.randn(*lead, n, m, generator=g, dtype=torch.float64).to(dtype)
    xd, yd = x.to(DEVICE).requires_grad_(), y.to(DEVICE).requires_grad_()
    out = bm.matmul(xd, yd, yt)
    out.backward(dd.to(DEVICE))
    xr, yr = x.detach().double().requires_grad_(), y.detach().double().requires_grad_()
    ref = _ref(xr, yr, yt)
    ref.backward(dd.double())
    assert out.dtype == dtype and out.shape == ref.shape
    for got, want, terms, mag in [
        (out, ref, k, _ref(xr.abs(), yr.abs(), yt)),
        (xd.grad, xr.grad, m, dd.double().abs() @ (yr.abs() if yt else yr.abs().transpose(-1, -2))),
        (yd.grad, yr.grad, n, (dd.double().abs().transpose(-1, -2) @ xr.abs()) if yt
         else (xr.abs().transpose(-1, -2) @ dd.double().abs())),
    ]:
        err = (got.detach().cpu().double() - want.detach()).abs()
        bound = REL[dtype](terms) * mag.detach()
        assert (err <= bound + 1e-30).all(), f"max error {err.max().item()} (bound there {bound.flatten()[err.argmax()]})"


def test_matmul_under_torch_compile():
    x = torch.randn(2, 4, 8, device=DEVICE)
    y = torch.randn(2, 8, 3, device=DEVICE)
    f = torch.compile(lambda a, b: bm.matmul(a, b) * 2.0, fullgraph=True)
    torch.testing.assert_close(f(x, y), 2.0 * (x @ y), rtol=1e-5, atol=1e-5)


def test_matmul_leading_dimensions_must_match():
    with pytest.raises(ValueError, match="leading dimensions differ"):
        bm.matmul(torch.randn(2, 3, 4, 5, device=DEVICE), torch.randn(3, 2, 5, 6, device=DEVICE))
