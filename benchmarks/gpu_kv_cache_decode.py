"""Generation through the PyTorch adapter: one decode step of DotProductAttention with
inference_params (TE's InferenceParams K/V cache: pre_step, the new keys/values written into the
cache, fused attention over it), BF16, b=16, 32 query heads over 8 K/V heads, head dim 128,
sequences holding 4096 tokens (a prefill through the same module first). Against PyTorch in the
same process: its own cache of the same shape (k_cache[:, pos] = k_new, then
scaled_dot_product_attention over k_cache[:, :pos + 1] with enable_gqa, flash and cuDNN
backends; all sequences of equal length, which torch's fused backends need).

Columns: GPU ms per step (gpu_harness.time_ms: the host queues each batch while the GPU sleeps,
so host cost is not counted) timed alternately, and host us per step (gpu_harness.host_us: the
Python + dispatch cost, which bounds a decode loop that the GPU outruns). Each timed call appends
one token, so the sequences grow by a few hundred tokens during the run, the same number of
steps on every row. Rows: ours non-paged BSHD, ours paged (page 64), ours THD queries, the two
BSHD rows with a learnable attention sink (softmax_type; cuDNN's decode takes no sink token, so the
library rescales a vanilla forward), and the BSHD rows with the attention call captured as a CUDA
graph and replayed after each pre_step.
--diagnose: first, per row, the synchronizing calls of a step, its GPU kernels (torch.profiler)
and its host time by function (cProfile)."""
import math
import os
import sys
from collections import OrderedDict

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_harness import Report, host_us, time_alternating_ms  # noqa: E402

import transformer_engine.pytorch as te  # noqa: E402

B, HQ, HKV, D, CTX, ROOM, PAGE = 16, 32, 8, 128, 4096, 640, 64
# the sleep before each batch of 4 steps: ~10 ms, longer than a host-bound step batch takes to queue
# (at ~0.45 ms of host time per step the default ~1 ms let the GPU idle: 0.29 ms "GPU" time per step)
TIMING = dict(rounds=3, iters=15, warmup=3, inner=4, sleep_cycles=20_000_000)
# host_us calls per row: the graph rows replay one graph; more pending launches of it than the
# driver keeps (fewer than 32 on the H100) block the host until the queued sleep ends
HOST_CALLS = 12


class Ours:
    """A DotProductAttention and its InferenceParams, prefilled with CTX tokens per sequence."""

    def __init__(self, fmt, paged, k, v, softmax_type="vanilla"):
        cap = CTX + ROOM
        kw = dict(is_paged=True, page_size=PAGE, total_num_pages=B * cap // PAGE) if paged else {}
        self.params = te.InferenceParams(B, cap, HKV, D, torch.bfloat16, qkv_format=fmt, **kw)
        self.dpa = te.DotProductAttention(HQ, D, num_gqa_groups=HKV, qkv_format=fmt, attn_mask_type="padding_causal",
                                          layer_number=1, softmax_type=softmax_type).cuda()
        self.fmt = fmt
        q = torch.randn(B, CTX, HQ, D, device="cuda", dtype=torch.bfloat16)
        self.params.pre_step(OrderedDict((i, CTX) for i in range(B)))
        with torch.no_grad():
            self.dpa(*self.shape(q, k, v), inference_params=self.params)
        self.step_dict = OrderedDict((i, 1) for i in range(B))

    def shape(self, *xs):
        """[b, s, h, d] tensors in this row's format."""
        if self.fmt == "thd":
            return [x.reshape(-1, *x.shape[2:]) for x in xs]
        return list(xs)

    def step(self, q, k, v):
        self.params.pre_step(self.step_dict)
        with torch.no_grad():
            return self.dpa(*self.shape(q, k, v), inference_params=self.params)


class OursGraph(Ours):
    """Ours with the attention call captured once as a CUDA graph and replayed after each pre_step
    (the cache's index and length buffers are persistent): the host keeps pre_step and the copy of
    the new token into the graph's inputs."""

    def step(self, q, k, v):
        self.params.pre_step(self.step_dict)
        if not hasattr(self, "graph"):
            self.static = [x.clone() for x in self.shape(q, k, v)]
            with torch.no_grad():
                self.dpa(*self.static, inference_params=self.params)  # (warm-up: cuDNN graph, workspace)
                self.graph = torch.cuda.CUDAGraph()
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side), torch.cuda.graph(self.graph, stream=side):
                    self.out = self.dpa(*self.static, inference_params=self.params)
                torch.cuda.current_stream().wait_stream(side)
        for dst, src in zip(self.static, self.shape(q, k, v)):
            dst.copy_(src)
        self.graph.replay()
        return self.out


class Torch:
    """PyTorch's own decode step over a contiguous cache [b, h_kv, cap, d] (heads first: sdpa's layout)."""

    def __init__(self, k, v, backend):
        cap = CTX + ROOM
        self.kc = torch.zeros(B, HKV, cap, D, device="cuda", dtype=torch.bfloat16)
        self.vc = torch.zeros_like(self.kc)
        self.kc[:, :, :CTX] = k.transpose(1, 2)
        self.vc[:, :, :CTX] = v.transpose(1, 2)
        self.pos, self.backend = CTX, backend

    def step(self, q, k, v):
        self.kc[:, :, self.pos] = k[:, 0]
        self.vc[:, :, self.pos] = v[:, 0]
        self.pos += 1
        with torch.nn.attention.sdpa_kernel(self.backend):
            o = F.scaled_dot_product_attention(q.transpose(1, 2), self.kc[:, :, :self.pos], self.vc[:, :, :self.pos],
                                               enable_gqa=True)
        return o.transpose(1, 2).reshape(B, 1, -1)


def diagnose(rows, q1, k1, v1):
    """--diagnose: for each row, the synchronizing CUDA calls one step makes (torch's sync debug
    mode, with the Python line that made them), a torch.profiler table of 8 steps and a cProfile of
    20; before them, whether a small non_blocking H2D copy from pageable / pinned memory waits for
    queued GPU work (inference.py's index uploads rely on the pageable one not waiting)."""
    import time
    import warnings
    dev = torch.empty(64, dtype=torch.int32, device="cuda")
    for kind in ("pageable", "pinned"):  # does a small non_blocking H2D copy wait for queued work?
        src = torch.arange(64, dtype=torch.int32, pin_memory=kind == "pinned")
        torch.cuda.synchronize()
        torch.cuda._sleep(40_000_000)  # ~20 ms of GPU work queued ahead of the copy
        t0 = time.perf_counter()
        dev.copy_(src, non_blocking=True)
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        print(f"[diagnose] {kind} non_blocking H2D copy of 256 B behind 20 ms of queued work: "
              f"host {1e6 * (t1 - t0):.0f} us")
    for name, r in rows:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode(1)
            try:
                r.step(q1, k1, v1)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        print(f"[diagnose] {name}: {len(caught)} synchronizing calls")
        for w in caught[:6]:
            print(f"    {str(w.message)[:100]} at {w.filename}:{w.lineno}")
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(8):
                r.step(q1, k1, v1)
            torch.cuda.synchronize()
        print(f"[diagnose] {name}: GPU time of 8 steps")
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=8, max_name_column_width=60))
        import cProfile
        import pstats
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(20):
            r.step(q1, k1, v1)
        pr.disable()
        torch.cuda.synchronize()
        print(f"[diagnose] {name}: host time of 20 steps (cProfile)")
        pstats.Stats(pr).sort_stats("tottime").print_stats(14)
        pstats.Stats(pr).sort_stats("cumtime").print_stats(24)
        if isinstance(r, Ours):  # the two halves of a step (the attention call repeats the step's token)
            args = r.shape(q1, k1, v1)
            with torch.no_grad():
                pre = host_us(lambda: r.params.pre_step(r.step_dict), calls=16)
                att = host_us(lambda: r.dpa(*args, inference_params=r.params), calls=16)
            print(f"[diagnose] {name}: host us pre_step {pre:.1f}, DotProductAttention call {att:.1f}")
        if isinstance(r, OursGraph):  # which part of a graph step waits behind queued GPU work
            args = r.shape(q1, k1, v1)
            pre = lambda: r.params.pre_step(r.step_dict)
            cp = lambda: [dst.copy_(src) for dst, src in zip(r.static, args)]
            rep = lambda: r.graph.replay()  # (host_us passes an index to bound methods)
            parts = {"input copies": cp, "replay": rep, "pre_step + replay": lambda: (pre(), rep()),
                     "input copies + replay": lambda: (cp(), rep()), "pre_step + input copies": lambda: (pre(), cp()),
                     "whole step": lambda: (pre(), cp(), rep())}
            print(f"[diagnose] {name}: host us, each behind ~20 ms of queued GPU work: " +
                  ", ".join(f"{k} {host_us(f, calls=HOST_CALLS):.1f}" for k, f in parts.items()))
    # control: a captured graph of one small kernel, replayed the same way
    x = torch.zeros(1024, device="cuda")
    g = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.cuda.graph(g, stream=side):
        x.add_(1.0)
    torch.cuda.current_stream().wait_stream(side)
    print(f"[diagnose] control: replay of a one-kernel graph, host us {host_us(lambda: g.replay(), calls=16):.1f}; "
          f"eager add_ {host_us(lambda: x.add_(1.0), calls=16):.1f}")
    dst = torch.empty(64, dtype=torch.int32, device="cuda")
    for kind in ("pageable", "pinned"):  # a small H2D copy followed by a graph replay / an eager kernel
        src = torch.arange(64, dtype=torch.int32, pin_memory=kind == "pinned")
        with_graph = host_us(lambda: (dst.copy_(src, non_blocking=True), g.replay()), calls=HOST_CALLS)
        with_kernel = host_us(lambda: (dst.copy_(src, non_blocking=True), x.add_(1.0)), calls=HOST_CALLS)
        print(f"[diagnose] control: {kind} H2D copy + graph replay, host us {with_graph:.1f}; "
              f"{kind} H2D copy + eager kernel {with_kernel:.1f}")


def main():
    rep = Report()
    group = f"decode step, DotProductAttention + InferenceParams (BF16, b={B}, {HQ}/{HKV} heads, d={D}, ~{CTX} cached)"
    g = torch.Generator(device="cuda").manual_seed(0)
    k = torch.randn(B, CTX, HKV, D, generator=g, device="cuda").to(torch.bfloat16)
    v = torch.randn(B, CTX, HKV, D, generator=g, device="cuda").to(torch.bfloat16)
    rows = [("ours non-paged bshd", Ours("bshd", False, k, v)), ("ours paged bshd (page 64)", Ours("bshd", True, k, v)),
            ("ours non-paged thd", Ours("thd", False, k, v)),
            # (the learnable offsets start at zero: next to ~4096 keys the sink moves O by ~1e-4)
            ("ours non-paged bshd, learnable sink", Ours("bshd", False, k, v, "learnable")),
            ("ours paged bshd, learnable sink", Ours("bshd", True, k, v, "learnable")),
            ("ours non-paged bshd, CUDA graph", OursGraph("bshd", False, k, v)),
            ("ours paged bshd, CUDA graph", OursGraph("bshd", True, k, v))]
    for name, be in (("torch flash", torch.nn.attention.SDPBackend.FLASH_ATTENTION),
                     ("torch cuDNN", torch.nn.attention.SDPBackend.CUDNN_ATTENTION)):
        rows.append((name, Torch(k, v, be)))
    q1 = torch.randn(B, 1, HQ, D, generator=g, device="cuda").to(torch.bfloat16)
    k1 = torch.randn(B, 1, HKV, D, generator=g, device="cuda").to(torch.bfloat16)
    v1 = torch.randn(B, 1, HKV, D, generator=g, device="cuda").to(torch.bfloat16)
    outs = []
    for name, r in list(rows):  # one step each on the same new token: the outputs agree to bfloat16
        try:
            outs.append(r.step(q1, k1, v1).reshape(B, -1).float())
        except RuntimeError as e:
            print(f"{name} unavailable: {str(e).splitlines()[0][:120]}")
            rows.remove((name, r))
    for (name, _), o in zip(rows[1:], outs[1:]):
        err = float((o - outs[0]).abs().max())
        print(f"[kv decode] {name} vs {rows[0][0]}: max |diff| {err:.3g}")
        assert err < 5e-2, (name, err)
    if "--diagnose" in sys.argv:
        diagnose(rows, q1, k1, v1)
    if "--graph-pending" in sys.argv:  # host us per replay of one captured step against the replays queued
        r = next(r for _, r in rows if isinstance(r, OursGraph))
        print("[graph pending] " + ", ".join(f"{n} replays: {host_us(lambda: r.graph.replay(), calls=n):.1f} us"
                                             for n in (4, 8, 12, 16, 20, 24, 32, 48)))
    fns = [(lambda r: lambda: r.step(q1, k1, v1))(r) for _, r in rows]
    ms = time_alternating_ms(fns, **TIMING)
    hus = [host_us(f, calls=HOST_CALLS) for f in fns]
    base = {name: t for (name, _), t in zip(rows, ms)}
    for (name, _), t, h in zip(rows, ms, hus):
        rep.add(group, name, gpu_ms=t, host_us=h, gpu_speed_vs_torch_cudnn=base.get("torch cuDNN", float("nan")) / t,
                gpu_speed_vs_torch_flash=base.get("torch flash", float("nan")) / t)
    print(rep.markdown())


if __name__ == "__main__":
    main()
