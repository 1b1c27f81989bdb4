"""LayerNorm on the CUDA backend: forward with FP8 E4M3 output (fused scale + cast + amax) and
backward (bf16), against PyTorch in the same process: layer_norm + scale + cast to float8 for
the forward, autograd's backward of layer_norm (dx, dgamma, dbeta) for the backward.

Bytes counted (the minimum traffic): the forward reads x (bf16) and writes z (FP8), mu and
rsigma; the backward reads dz, x (bf16), mu and rsigma and writes dx (bf16). gamma, beta,
dgamma, dbeta and the workspace partials (a few percent) are not counted."""
import torch
import torch.nn.functional as F

from gpu_harness import copy_bandwidth_gbs, host_us, time_ms
from transformer_engine import _nvte as nvte

DT = nvte.DType
P = nvte.Param
SHAPES = [(8192, 4096), (8192, 8192), (8192, 16384)]  # 8192: the backward's two-vector path
EPS = 1e-5
SETS = 3  # input sets rotated between runs


def tensor(data, dtype=None, **params):
    """nvte.Tensor over torch CUDA tensors (the caller keeps them alive): data plus scale/amax/scale_inv."""
    t = nvte.Tensor()
    nv = {torch.float32: DT.kFloat32, torch.bfloat16: DT.kBFloat16, torch.uint8: DT.kByte}
    t.set_param(P.kRowwiseData, data.data_ptr(), list(data.shape), dtype if dtype is not None else nv[data.dtype])
    for name, p in (("scale", P.kScale), ("amax", P.kAmax), ("scale_inv", P.kRowwiseScaleInv)):
        if name in params:
            t.set_param(p, params[name].data_ptr(), [1], DT.kFloat32)
    return t


def bench_fwd(report, n, h, bw):
    dev = "cuda"
    xs = [torch.randn(n, h, device=dev).to(torch.bfloat16) for _ in range(SETS)]
    g = (torch.randn(h, device=dev) * 0.1 + 1).to(torch.bfloat16)
    b = (torch.randn(h, device=dev) * 0.1).to(torch.bfloat16)
    scale = torch.tensor([4.0], device=dev)
    amax = torch.zeros(1, device=dev)
    sinv = torch.zeros(1, device=dev)
    zs = [torch.empty(n, h, dtype=torch.uint8, device=dev) for _ in range(SETS)]
    mu, rs = torch.empty(n, device=dev), torch.empty(n, device=dev)
    tx = [tensor(x) for x in xs]
    tz = [tensor(z, DT.kFloat8E4M3, scale=scale, amax=amax, scale_inv=sinv) for z in zs]
    tg, tb, tmu, trs = tensor(g), tensor(b), tensor(mu), tensor(rs)

    def ours(i):
        nvte.layernorm_fwd(tx[i % SETS], tg, tb, EPS, tz[i % SETS], tmu, trs)

    def theirs(i):
        y = F.layer_norm(xs[i % SETS], (h,), g, b, EPS)
        return (y * scale).to(torch.float8_e4m3fn)

    ms = time_ms(ours)
    tms = time_ms(theirs)
    gbs = (n * h * (2 + 1) + n * 8) / ms / 1e6
    report.add("norm", f"layernorm fwd bf16->fp8e4m3 {n}x{h}", ms=ms, GBps=gbs, frac_copy=gbs / bw,
               torch_ms=tms, speedup_vs_torch=tms / ms, host_us=host_us(ours))


def bench_fwd_both_layouts(report, n, h, bw):
    """Training's forward: z in FP8 rowwise and columnwise (the weight gradient reads the
    transpose). Ours: nvte_layernorm_fwd into both layouts (row kernel + tiled byte transpose);
    against ours unfused (bf16 LayerNorm, then nvte_cast_transpose: what the PyTorch adapter ran
    before) and PyTorch (layer_norm, scale, cast, transpose). Minimum bytes: x read, z and its
    transpose written (the transpose pass re-reads z: 5 of the 4 counted bytes per element)."""
    dev = "cuda"
    xs = [torch.randn(n, h, device=dev).to(torch.bfloat16) for _ in range(SETS)]
    g = (torch.randn(h, device=dev) * 0.1 + 1).to(torch.bfloat16)
    b = (torch.randn(h, device=dev) * 0.1).to(torch.bfloat16)
    scale = torch.tensor([4.0], device=dev)
    amax, sinv, csinv = torch.zeros(1, device=dev), torch.zeros(1, device=dev), torch.zeros(1, device=dev)
    z, zt = torch.empty(n, h, dtype=torch.uint8, device=dev), torch.empty(h, n, dtype=torch.uint8, device=dev)
    mu, rs = torch.empty(n, device=dev), torch.empty(n, device=dev)
    tx = [tensor(x) for x in xs]
    tz = tensor(z, DT.kFloat8E4M3, scale=scale, amax=amax, scale_inv=sinv)
    tz.set_param(P.kColumnwiseData, zt.data_ptr(), [h, n], DT.kFloat8E4M3)
    tz.set_param(P.kColumnwiseScaleInv, csinv.data_ptr(), [1], DT.kFloat32)
    tg, tb, tmu, trs = tensor(g), tensor(b), tensor(mu), tensor(rs)
    y16 = torch.empty(n, h, dtype=torch.bfloat16, device=dev)
    ty16 = tensor(y16)
    stream = torch.cuda.current_stream().cuda_stream

    def ours(i):
        nvte.layernorm_fwd(tx[i % SETS], tg, tb, EPS, tz, tmu, trs)

    def unfused(i):
        nvte.layernorm_fwd(tx[i % SETS], tg, tb, EPS, ty16, tmu, trs)
        nvte.cast_transpose(ty16, tz, stream)

    def theirs(i):
        y = ((F.layer_norm(xs[i % SETS], (h,), g, b, EPS) * scale).to(torch.float8_e4m3fn))
        return y, y.t().contiguous()

    ms, ums, tms = time_ms(ours), time_ms(unfused), time_ms(theirs)
    gbs = (n * h * (2 + 1 + 1) + n * 8) / ms / 1e6
    report.add("norm", f"layernorm fwd bf16->fp8e4m3 row+col {n}x{h}", ms=ms, GBps=gbs, frac_copy=gbs / bw,
               torch_ms=tms, speedup_vs_torch=tms / ms, unfused_ms=ums, speedup_vs_unfused=ums / ms,
               host_us=host_us(ours))


def bench_bwd(report, n, h, bw):
    dev = "cuda"
    xs = [torch.randn(n, h, device=dev).to(torch.bfloat16) for _ in range(SETS)]
    dzs = [torch.randn(n, h, device=dev).to(torch.bfloat16) for _ in range(SETS)]
    g = (torch.randn(h, device=dev) * 0.1 + 1).to(torch.bfloat16)
    b = (torch.randn(h, device=dev) * 0.1).to(torch.bfloat16)
    mus, rss = [], []
    for x in xs:
        xf = x.float()
        mus.append(xf.mean(1))
        rss.append(torch.rsqrt(xf.var(1, unbiased=False) + EPS))
    dx = torch.empty(n, h, dtype=torch.bfloat16, device=dev)
    dg, db = torch.empty(h, dtype=torch.bfloat16, device=dev), torch.empty(h, dtype=torch.bfloat16, device=dev)
    tx, tdz = [tensor(x) for x in xs], [tensor(d) for d in dzs]
    tmu, trs = [tensor(m) for m in mus], [tensor(r) for r in rss]
    tg, tdx, tdg, tdb = tensor(g), tensor(dx), tensor(dg), tensor(db)
    ws_bytes = nvte.normalization_workspace_size(tx[0], False)
    ws = torch.empty(max(ws_bytes, 1), dtype=torch.uint8, device=dev)
    tws = tensor(ws)

    def ours(i):
        k = i % SETS
        nvte.layernorm_bwd(tdz[k], tx[k], tmu[k], trs[k], tg, tdx, tdg, tdb, workspace=tws)

    xr = [x.detach().clone().requires_grad_(True) for x in xs]
    gr, br = g.clone().requires_grad_(True), b.clone().requires_grad_(True)
    ys = [F.layer_norm(x, (h,), gr, br, EPS) for x in xr]

    def theirs(i):
        k = i % SETS
        return torch.autograd.grad(ys[k], (xr[k], gr, br), dzs[k], retain_graph=True)

    ms = time_ms(ours)
    tms = time_ms(theirs)
    gbs = (n * h * 2 * 3 + n * 8) / ms / 1e6
    report.add("norm", f"layernorm bwd bf16 {n}x{h}", ms=ms, GBps=gbs, frac_copy=gbs / bw, torch_ms=tms,
               speedup_vs_torch=tms / ms, host_us=host_us(ours), workspace_MiB=ws_bytes / 2**20)


def run(report):
    bw = copy_bandwidth_gbs()
    for n, h in SHAPES:
        bench_fwd(report, n, h, bw)
        bench_fwd_both_layouts(report, n, h, bw)
        bench_bwd(report, n, h, bw)
        torch.cuda.empty_cache()
