"""Activations and softmax on the CUDA backend against PyTorch in the same process.

gelu -> FP8: nvte_gelu from bf16 into an FP8 E4M3 output (scale from device memory, amax and
scale_inv updated in the kernel) against the PyTorch sequence that computes the same thing:
gelu(approximate='tanh'), amax, scale, clamp to +-448, cast to float8_e4m3fn. GB/s counts
bytes read + written (2 + 1 per element) and is compared with the device copy bandwidth
(target >= 85%). geglu (bf16 [M, 2H] -> FP8 [M, H]) likewise.
softmax: nvte_scaled_softmax_forward / _backward on [4, 32, 2048, 2048] bf16 against
torch.softmax (one kernel; scale left out of the PyTorch side, which favours it) and
torch's softmax backward.
Three input sets are rotated so runs do not just hit the L2; median time of many runs.
Run alone: python benchmarks/gpu_activation.py (or through gpu_bench.py).
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_harness import Report, copy_bandwidth_gbs, host_us, time_ms  # noqa: E402

from transformer_engine import _nvte as nvte  # noqa: E402

DT = nvte.DType
SETS = 3
FP8_MAX = 448.0


def _tensor(x, dtype=None, scale=None, amax=None, scale_inv=None):
    t = nvte.Tensor()
    t.set_param(nvte.Param.kRowwiseData, x.data_ptr(), list(x.shape), dtype if dtype is not None else {
        torch.bfloat16: DT.kBFloat16, torch.float32: DT.kFloat32, torch.uint8: DT.kByte}[x.dtype])
    for p, v in [(nvte.Param.kScale, scale), (nvte.Param.kAmax, amax), (nvte.Param.kRowwiseScaleInv, scale_inv)]:
        if v is not None:
            t.set_param(p, v.data_ptr(), [1], DT.kFloat32)
    return t


def _act_fp8(report, name, m, n_in, iters):
    """name: 'gelu' ([m, n_in] -> [m, n_in]) or 'geglu' ([m, n_in] -> [m, n_in / 2])."""
    dev = "cuda"
    n_out = n_in // 2 if name == "geglu" else n_in
    g = torch.Generator(device=dev)
    g.manual_seed(0)
    sets = []
    for _ in range(SETS):
        x = torch.randn(m, n_in, device=dev, generator=g, dtype=torch.bfloat16) * 2
        out = torch.empty(m, n_out, dtype=torch.uint8, device=dev)
        scale = torch.tensor([4.0], device=dev)
        amax = torch.zeros(1, device=dev)
        scale_inv = torch.zeros(1, device=dev)
        ref_out = torch.empty(m, n_out, dtype=torch.float8_e4m3fn, device=dev)
        ref_amax = torch.zeros(1, device=dev)
        sets.append((x, out, scale, amax, scale_inv, _tensor(x), _tensor(out, DT.kFloat8E4M3, scale, amax, scale_inv),
                     ref_out, ref_amax))
    fn = getattr(nvte, name)

    def ours(i):
        s = sets[i % SETS]
        fn(s[5], s[6])

    def theirs(i):
        s = sets[i % SETS]
        x = s[0]
        if name == "geglu":
            y = torch.nn.functional.gelu(x[:, :n_out], approximate="tanh") * x[:, n_out:]
        else:
            y = torch.nn.functional.gelu(x, approximate="tanh")
        s[8].copy_(y.abs().amax())
        s[7].copy_((y.float() * s[2]).clamp_(-FP8_MAX, FP8_MAX))

    ours(0)
    theirs(0)
    torch.cuda.synchronize()
    s = sets[0]
    ours_val = s[1].view(torch.float8_e4m3fn).float()
    diff_codes = (s[1] != s[7].view(torch.uint8)).float().mean().item()
    assert (ours_val - s[7].float()).abs().max().item() <= 32.0, "FP8 results disagree with PyTorch"
    t_ours, t_theirs = time_ms(ours, iters=iters), time_ms(theirs, iters=iters)
    nbytes = m * n_in * 2 + m * n_out
    gbs = nbytes / (t_ours * 1e-3) / 1e9
    report.add("activation", f"{name} bf16 [{m}, {n_in}] -> fp8 e4m3", ms=t_ours, GBps=gbs,
               frac_copy_bw=gbs / copy_bandwidth_gbs(), torch_ms=t_theirs, ratio_vs_torch=t_theirs / t_ours,
               codes_differing=diff_codes, host_us=host_us(ours))
    del sets


def _softmax(report, shape, iters):
    dev = "cuda"
    scale = 0.125
    g = torch.Generator(device=dev)
    g.manual_seed(1)
    sets = []
    for _ in range(SETS):
        x = torch.randn(shape, device=dev, generator=g, dtype=torch.bfloat16) * 3
        y = torch.empty_like(x)
        sets.append((x, y, _tensor(x), _tensor(y)))

    def ours(i):
        s = sets[i % SETS]
        nvte.scaled_softmax_forward(s[2], s[3], scale)

    def theirs(i):
        torch.softmax(sets[i % SETS][0], -1)

    ours(0)
    torch.cuda.synchronize()
    ref = torch.softmax(sets[0][0].float() * scale, -1)
    err = (sets[0][1].float() - ref).abs().max().item()
    t_ours, t_theirs = time_ms(ours, iters=iters), time_ms(theirs, iters=iters)
    nbytes = 2 * sets[0][0].numel() * 2
    gbs = nbytes / (t_ours * 1e-3) / 1e9
    report.add("softmax", f"scaled forward bf16 {list(shape)}", ms=t_ours, GBps=gbs,
               frac_copy_bw=gbs / copy_bandwidth_gbs(), torch_ms=t_theirs,
               ratio_vs_torch=t_theirs / t_ours)
    print(f"[softmax] forward max abs error vs float32 torch: {err:.3g}")

    # Backward: dy = x of the set, y = the forward's output; in place into dy's twin.
    dxs = [torch.empty_like(s[0]) for s in sets]
    tdx = [_tensor(d) for d in dxs]

    def ours_b(i):
        s = sets[i % SETS]
        nvte.scaled_softmax_backward(s[2], s[3], tdx[i % SETS], scale)

    def theirs_b(i):
        s = sets[i % SETS]
        torch.ops.aten._softmax_backward_data(s[0], s[1], -1, torch.bfloat16)

    t_ours, t_theirs = time_ms(ours_b, iters=iters), time_ms(theirs_b, iters=iters)
    nbytes = 3 * sets[0][0].numel() * 2
    gbs = nbytes / (t_ours * 1e-3) / 1e9
    report.add("softmax", f"scaled backward bf16 {list(shape)}", ms=t_ours, GBps=gbs,
               frac_copy_bw=gbs / copy_bandwidth_gbs(), torch_ms=t_theirs, ratio_vs_torch=t_theirs / t_ours)
    del sets, dxs, tdx


def run(report, iters=50):
    for m, n in [(8192, 4096), (8192, 16384)]:
        _act_fp8(report, "gelu", m, n, iters)
    _act_fp8(report, "geglu", 8192, 2 * 8192, iters)
    _softmax(report, (4, 32, 2048, 2048), iters=20)


if __name__ == "__main__":
    r = Report()
    run(r)
    print(r.markdown())
