"""The context-parallel ring's merge of one step into the running output (nvte_attn_merge through
context_parallel_ring.merge_into) against the float32 torch ops the adapter ran before (logaddexp,
two exps, broadcast multiply-adds, the statistic's copy), in the same process; the attention
sink's fold (nvte_attn_merge_sink) and its gradient (nvte_attn_merge_sink_grad) against their
torch ops. Shape of a 2-rank ring over 16384 tokens:
the running output float32 [b=2, 8192, 32, 128], a "q_second" step's bf16 part over the second
4096 rows (and a whole-rows step). GB/s counts bytes read + written (out rows read and written,
the part read; statistics small). GPU ms from gpu_harness (host cost not counted) and host us per
call. Run alone: python benchmarks/gpu_attn_merge.py (or through gpu_bench.py)."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_harness import Report, host_us, time_alternating_ms  # noqa: E402

from transformer_engine.pytorch import context_parallel_ring as ring  # noqa: E402

B, S, H, D = 2, 8192, 32, 128


def torch_merge(out, lse, o_i, lse_i, off):
    """The adapter's merge before the library op (bshd, statistics [b, h, s, 1])."""
    acc_l = lse.narrow(2, off, o_i.shape[1])
    new_l = torch.logaddexp(acc_l, lse_i)
    acc_o = out.narrow(1, off, o_i.shape[1])
    acc_o.mul_(torch.exp(acc_l - new_l).permute(0, 2, 1, 3))
    acc_o.add_(o_i * torch.exp(lse_i - new_l).permute(0, 2, 1, 3))
    acc_l.copy_(new_l)


def torch_sink(out, lse, sink):
    new = torch.logaddexp(lse, sink.view(1, -1, 1, 1))
    out.mul_(torch.exp(lse - new).permute(0, 2, 1, 3))
    lse.copy_(new)


def torch_sink_grad(dout, out, lse, sink):
    """The adapter's sink gradient before the library op (bshd)."""
    d = (dout.float() * out.float()).sum(-1)
    p = torch.exp(sink.view(1, -1, 1, 1) - lse).permute(0, 2, 1, 3)[..., 0]
    return -(p * d).sum([0, 1])


def run(report: Report):
    g = torch.Generator(device="cuda").manual_seed(0)
    rnd = lambda *s: torch.randn(*s, generator=g, device="cuda")
    outs = [rnd(B, S, H, D) for _ in range(2)]  # ours, torch (each updated in place every call)
    lses = [rnd(B, H, S, 1) * 3 for _ in range(2)]
    for rows, off in ((S // 2, S // 2), (S, 0)):
        part, plse = rnd(B, rows, H, D).to(torch.bfloat16), rnd(B, H, rows, 1) * 3
        lses[1].copy_(lses[0])  # (the timed calls below let the two drift apart by rounding)
        outs[1].copy_(outs[0])
        ring.merge_into(outs[0], lses[0], part, plse, off, "bshd")  # one call each, then compare
        torch_merge(outs[1], lses[1], part, plse, off)
        torch.cuda.synchronize()
        err = max(float((outs[0] - outs[1]).abs().max()), float((lses[0] - lses[1]).abs().max()))
        assert err < 1e-5, f"the library merge disagrees with the torch ops by {err}"
        fns = [lambda: ring.merge_into(outs[0], lses[0], part, plse, off, "bshd"),
               lambda: torch_merge(outs[1], lses[1], part, plse, off)]
        t = time_alternating_ms(fns)
        nbytes = B * rows * H * D * (4 + 4 + 2)
        hu = [host_us(f, calls=32) for f in fns]
        report.add("attn merge", f"ring step merge bshd b={B} s={S} h={H} d={D}, bf16 part of {rows} rows",
                   ours_ms=t[0], GBps=nbytes / t[0] / 1e6, torch_ops_ms=t[1], speed_vs_torch=t[1] / t[0],
                   ours_host_us=hu[0], torch_host_us=hu[1])
    sink = rnd(H)

    class Ctx:
        pass

    fns = [lambda: ring.fold_sink(Ctx(), outs[0], lses[0], sink, "bshd"), lambda: torch_sink(outs[1], lses[1], sink)]
    t = time_alternating_ms(fns)
    nbytes = B * S * H * D * 8
    report.add("attn merge", f"sink fold bshd b={B} s={S} h={H} d={D}", ours_ms=t[0], GBps=nbytes / t[0] / 1e6,
               torch_ops_ms=t[1], speed_vs_torch=t[1] / t[0])
    # the sink's gradient from the merged bf16 output and its gradient
    o, do = rnd(B, S, H, D).to(torch.bfloat16), rnd(B, S, H, D).to(torch.bfloat16)
    lse = rnd(B, H, S, 1) * 2 + 1
    ctx = Ctx()
    ctx.sink, ctx.sink_grad = sink, True
    ours, ref = ring.sink_grad(ctx, do, o, lse, "bshd"), torch_sink_grad(do, o, lse, sink)
    err = float(((ours - ref).abs() / ref.abs().clamp_min(1.0)).max())
    assert err < 1e-3, f"the library sink gradient disagrees with the torch ops by {err} (relative)"
    fns = [lambda: ring.sink_grad(ctx, do, o, lse, "bshd"), lambda: torch_sink_grad(do, o, lse, sink)]
    t = time_alternating_ms(fns)
    nbytes = B * S * H * D * 4
    report.add("attn merge", f"sink gradient bshd b={B} s={S} h={H} d={D}, bf16 O / dO", ours_ms=t[0],
               GBps=nbytes / t[0] / 1e6, torch_ops_ms=t[1], speed_vs_torch=t[1] / t[0])


if __name__ == "__main__":
    rep = Report()
    run(rep)
    print(rep.markdown())
