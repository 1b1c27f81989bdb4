"""One call of each memory-bound kernel at 8192 x 4096 bf16, for Nsight Compute (ncu):
cast+transpose -> E4M3, dgelu+cast+transpose+dbias -> E5M2, LayerNorm forward -> E4M3 (rowwise,
then both layouts: row kernel + byte transpose) and backward, gelu -> E4M3. tests/gpu/run_on_device.sh's `profile` step runs it under ncu; the
benchmarks (gpu_bench.py) time the same calls."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_cast import fp8_output, nt  # noqa: E402

from transformer_engine import _nvte as nvte  # noqa: E402

DT = nvte.DType


def main(m=8192, n=4096):
    torch.manual_seed(0)
    s = torch.cuda.current_stream().cuda_stream
    x = torch.randn(m, n, device="cuda").to(torch.bfloat16)
    a = (torch.randn(m, n, device="cuda") * 2).to(torch.bfloat16)
    o = fp8_output(m, n, DT.kFloat8E4M3)
    nvte.cast_transpose(nt(x), o["T"], s)

    o5 = fp8_output(m, n, DT.kFloat8E5M2)
    db = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    ws = torch.empty(max(nvte.quantize_dbias_workspace_size(nt(x)), 1), dtype=torch.uint8, device="cuda")
    nvte.cast_transpose_dbias_dgelu(nt(x), nt(a), o5["T"], nt(db), nt(ws), s)

    g = torch.ones(n, dtype=torch.bfloat16, device="cuda")
    b = torch.zeros(n, dtype=torch.bfloat16, device="cuda")
    z = fp8_output(m, n, DT.kFloat8E4M3)
    zt = nt(z["data"], DT.kFloat8E4M3, scale=z["scale"], amax=z["amax"], scale_inv=z["scale_inv"])
    mu, rs = torch.empty(m, device="cuda"), torch.empty(m, device="cuda")
    nvte.layernorm_fwd(nt(x), nt(g), nt(b), 1e-5, zt, nt(mu), nt(rs))

    # the training forward: z in both layouts (row kernel, then the tiled byte transpose)
    zc = torch.empty(n, m, dtype=torch.uint8, device="cuda")
    zb = nt(z["data"], DT.kFloat8E4M3, columnwise=zc, scale=z["scale"], amax=z["amax"], scale_inv=z["scale_inv"])
    nvte.layernorm_fwd(nt(x), nt(g), nt(b), 1e-5, zb, nt(mu), nt(rs))

    dx = torch.empty_like(x)
    dg, dbeta = torch.empty_like(g), torch.empty_like(b)
    wsn = torch.empty(max(nvte.normalization_workspace_size(nt(x), False), 1), dtype=torch.uint8, device="cuda")
    nvte.layernorm_bwd(nt(a), nt(x), nt(mu), nt(rs), nt(g), nt(dx), nt(dg), nt(dbeta), workspace=nt(wsn))

    y = fp8_output(m, n, DT.kFloat8E4M3)
    nvte.gelu(nt(x), nt(y["data"], DT.kFloat8E4M3, scale=y["scale"], amax=y["amax"], scale_inv=y["scale_inv"]))
    torch.cuda.synchronize()
    print("profiled calls done")


if __name__ == "__main__":
    main(n=int(sys.argv[1]) if len(sys.argv) > 1 else 4096)  # optional: the column count
