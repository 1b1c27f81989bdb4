"""The unfused attention path's score softmax with a bias, ALiBi or a sink (nvte_attn_softmax_*,
through transformer_engine.pytorch.attn_softmax) on the GPU: forward + backward over scores
[b, h, s, s], timed alternately in one process against the same math in eager PyTorch (float32
logits, masked_fill, softmax, cast back; autograd) and, with --compile, that eager code under
torch.compile. Prints ms, the ratio (torch / ours) and our achieved bandwidth over the bytes the
op must move (scores + bias read, y written; dy + y read, dx (+ logit grads) written).
Then each library kernel alone (forward, backward) with its bandwidth, next to the plain scaled
softmax kernels (nvte_scaled_softmax_*) on the same scores: what the extra terms cost.
  python benchmarks/gpu_attn_softmax.py [--seq 1024 4096] [--compile]
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_harness import time_alternating_ms  # noqa: E402

from transformer_engine.pytorch import _ops_softmax as _ops  # noqa: E402  (the softmax calls)
from transformer_engine.pytorch.attn_softmax import attn_softmax  # noqa: E402

B, H = 2, 16
DT = torch.bfloat16
SCALE = 0.125
TIMING = dict(rounds=3, iters=10, warmup=3)


def default_slopes(h):
    n = 1 << (h.bit_length() - 1)
    s = [2.0 ** (-8.0 * k / n) for k in range(1, n + 1)] + [2.0 ** (-4.0 * m / n) for m in range(1, 2 * (h - n), 2)]
    return torch.tensor(s, device="cuda")


def torch_ref(x, case, bias, slopes, offset, s):
    """The eager math a user without the fused op runs (float32 logits, as ours computes)."""
    z = x.float() * SCALE
    if case == "post_scale_bias":
        z = z + bias.float()
    hidden = None
    if case in ("alibi_causal", "sink_causal"):
        hidden = torch.ones(s, s, dtype=torch.bool, device="cuda").triu(1)
    if case == "alibi_causal":
        i = torch.arange(s, device="cuda").view(s, 1)
        j = torch.arange(s, device="cuda").view(1, s)
        z = z - slopes.view(1, H, 1, 1) * (i - j).abs().float()
    if hidden is not None:
        z = z.masked_fill(hidden, float("-inf"))
    if case == "sink_causal":
        col = offset.view(1, H, 1, 1).expand(B, H, s, 1)
        return torch.softmax(torch.cat([z, col], -1), -1)[..., :-1].to(x.dtype)
    return torch.softmax(z, -1).to(x.dtype)


def ours(x, case, bias, slopes, offset, s):
    if case == "post_scale_bias":
        return attn_softmax(x, SCALE, "post_scale_bias", bias)
    if case == "alibi_causal":
        return attn_softmax(x, SCALE, "alibi", alibi_slopes=slopes,
                            alibi_diagonal=torch.zeros(1, dtype=torch.int64, device="cuda"), causal="causal")
    return attn_softmax(x, SCALE, causal="causal", offset=offset)


def case_bytes(case, s, bias_needs_grad):
    n = B * H * s * s * 2  # one bf16 [b, h, s, s] tensor
    nb = H * s * s * 2 if case == "post_scale_bias" else 0  # bias [1, h, s, s] read
    fwd = 2 * n + nb
    bwd = 3 * n + (n if bias_needs_grad else 0)  # dy, y read; dx (+ logit grads) written
    return fwd + bwd


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--compile", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    print(f"device: {torch.cuda.get_device_name()}; scores [{B}, {H}, s, s] {DT}, forward + backward")
    print(f"{'case':18s} {'s':>5s} {'ours ms':>8s} {'torch ms':>9s} {'ratio':>6s}"
          + (f" {'compiled ms':>11s} {'ratio':>6s}" if args.compile else "") + f" {'ours GB/s':>9s}")
    for s in args.seq:
        x = torch.randn(B, H, s, s, device="cuda", dtype=DT).mul_(4).requires_grad_(True)
        dy = torch.randn_like(x)
        bias = torch.randn(1, H, s, s, device="cuda", dtype=DT).requires_grad_(True)
        slopes = default_slopes(H)
        offset = torch.randn(H, device="cuda").requires_grad_(True)
        compiled = torch.compile(torch_ref) if args.compile else None
        for case in ("post_scale_bias", "alibi_causal", "sink_causal"):
            wrt = [x] + ([bias] if case == "post_scale_bias" else []) + ([offset] if case == "sink_causal" else [])

            def step(f):
                def run():  # (autograd.grad: no .grad accumulation traffic in the timing)
                    torch.autograd.grad(f(x, case, bias, slopes, offset, s), wrt, dy)
                return run
            # same probabilities first (bf16 outputs: one rounding apart at most, plus the -inf vs 0 rule)
            with torch.no_grad():
                got = ours(x, case, bias, slopes, offset, s).float()
                ref = torch_ref(x, case, bias, slopes, offset, s).float()
            err = (got - ref).abs().max().item()
            assert err <= 2 ** -7 * ref.abs().max().item() + 1e-3, (case, s, err)
            fns = [step(ours), step(torch_ref)] + ([step(compiled)] if compiled else [])
            times = time_alternating_ms(fns, **TIMING)
            gbs = case_bytes(case, s, case == "post_scale_bias") / times[0] / 1e6
            line = f"{case:18s} {s:5d} {times[0]:8.3f} {times[1]:9.3f} {times[1] / times[0]:6.2f}"
            if compiled:
                line += f" {times[2]:11.3f} {times[2] / times[0]:6.2f}"
            print(line + f" {gbs:9.0f}", flush=True)
        kernels(x.detach(), dy, bias.detach(), slopes, offset.detach(), s)


def kernels(x, dy, bias, slopes, offset, s):
    """Each library call alone: ms and GB/s (bytes it must move)."""
    n = x.numel() * 2
    zero = torch.zeros(1, dtype=torch.int64, device="cuda")
    y, _ = _ops.attn_softmax_forward(x, SCALE, "no_bias", None, None, None, None, "no_mask", None)
    ys, sink = _ops.attn_softmax_forward(x, SCALE, "no_bias", None, None, None, None, "causal", offset)
    rows = [
        ("plain softmax fwd", lambda: _ops.softmax_forward("scaled", x, SCALE), 2 * n),
        ("plain softmax bwd", lambda: _ops.softmax_backward("scaled", dy, y, SCALE), 3 * n),
        ("post bias fwd", lambda: _ops.attn_softmax_forward(x, SCALE, "post_scale_bias", bias, None, None, None,
                                                            "no_mask", None), 2 * n + bias.numel() * 2),
        ("alibi causal fwd", lambda: _ops.attn_softmax_forward(x, SCALE, "alibi", None, slopes, zero, None, "causal",
                                                               None), n + n // 2),
        ("sink causal fwd", lambda: _ops.attn_softmax_forward(x, SCALE, "no_bias", None, None, None, None, "causal",
                                                              offset), n + n // 2),
        ("bwd", lambda: _ops.attn_softmax_backward(dy, y, None, None, SCALE, False), 3 * n),
        ("bwd + logit grads", lambda: _ops.attn_softmax_backward(dy, y, None, None, SCALE, True), 4 * n),
        ("bwd sink causal", lambda: _ops.attn_softmax_backward(dy, ys, None, sink, SCALE, False, "causal"), 2 * n),
    ]
    times = time_alternating_ms([f for _, f, _ in rows], **TIMING)
    for (name, _, nbytes), t in zip(rows, times):
        print(f"  kernel {name:20s} s={s:5d} {t:8.3f} ms {nbytes / t / 1e6:6.0f} GB/s", flush=True)


if __name__ == "__main__":
    main()
