"""Timing helpers for the GPU benchmarks: CUDA events, warm-up, median of many runs,
rotation over several input sets (so repeated runs do not just measure the L2), and the
measured device-copy bandwidth used as the memory ceiling."""
import statistics
import time

import torch

from transformer_engine import _nvte as nvte  # noqa: F401  (fail early if the build is missing)


def time_ms(fn, iters=30, warmup=10, inner=8, sleep_cycles=2_000_000):
    """Median milliseconds per fn() call: `iters` samples, each a batch of `inner` back-to-back
    calls between two CUDA events (per call = batch time / inner). Before each batch the GPU is
    given ~1 ms of sleep, during which the host queues the whole batch: the kernels then run from
    a full queue, as in a training step, so the host-side cost of a call (Python, handle wrapping,
    dispatch; see host_us) is not counted even where it exceeds a short kernel's time (without
    the sleep a 30 us kernel whose call costs the host more than 30 us measures the host).
    fn may take the call index (to rotate among input sets). sleep_cycles: the sleep before each
    batch (the default ~1 ms); a host-bound fn needs one longer than its batch takes to queue,
    or the GPU idles between its calls and the time measures the host."""
    takes_index = fn.__code__.co_argcount >= 1
    for i in range(warmup):
        fn(i) if takes_index else fn()
    torch.cuda.synchronize()
    times = []
    for r in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(sleep_cycles)  # (2e6: ~1 ms at ~2 GHz)
        a.record()
        for j in range(inner):
            fn(r * inner + j) if takes_index else fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / inner)
    return statistics.median(times)


def time_alternating_ms(fns, rounds=3, **kw):
    """[median ms of each fn], the fns timed alternately `rounds` times each (a, b, ..., a, b,
    ...) and the median of the per-round medians taken: at a few percent apart, the card's clock
    and power state drifts between long back-to-back timings, which favours whichever runs in
    the better state; alternating spreads that over all of them."""
    samples = [[] for _ in fns]
    for _ in range(rounds):
        for fn, s in zip(fns, samples):
            s.append(time_ms(fn, **kw))
    return [statistics.median(s) for s in samples]


def host_us(fn, calls=64):
    """Host microseconds per fn() call (Python + binding + library dispatch + launch), measured
    while the GPU sleeps, so that nothing waits for the device. A CUDA graph replayed more times
    than the driver keeps launches of one graph pending blocks the host until the sleep ends
    (measured on an H100: 32 replays of one graph averaged 643 us, 16 averaged 10 us): time graph
    replays with few calls."""
    takes_index = fn.__code__.co_argcount >= 1
    fn(0) if takes_index else fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(40_000_000)  # ~20 ms, longer than the calls take to queue
    t0 = time.perf_counter()
    for j in range(calls):
        fn(j) if takes_index else fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / calls * 1e6


_COPY_BW = None


def copy_bandwidth_gbs():
    """Device-to-device copy bandwidth in GB/s, counting bytes read + written (measured once)."""
    global _COPY_BW
    if _COPY_BW is None:
        n = 1 << 30  # 1 GiB, far beyond the L2
        src = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
        dst = torch.empty_like(src)
        ms = time_ms(lambda: dst.copy_(src), iters=20, warmup=3)
        _COPY_BW = 2 * n / ms / 1e6
    return _COPY_BW


class Report:
    """Rows of (group, case, metric dict); printed as a table and saved as markdown."""

    def __init__(self):
        self.rows = []

    def add(self, group, case, **metrics):
        self.rows.append((group, case, metrics))
        vals = "  ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items())
        print(f"[{group}] {case}: {vals}", flush=True)

    def markdown(self):
        out = []
        groups = []
        for g, _, _ in self.rows:
            if g not in groups:
                groups.append(g)
        for g in groups:
            rows = [(c, m) for gg, c, m in self.rows if gg == g]
            keys = []  # the union, in first-seen order: rows of one group may carry different metrics
            for _, m in rows:
                keys += [k for k in m if k not in keys]
            cell = lambda m, k: "" if k not in m else (f"{m[k]:.3g}" if isinstance(m[k], float) else str(m[k]))
            out.append(f"\n### {g}\n\n| case | " + " | ".join(keys) + " |\n|---|" + "---|" * len(keys))
            for c, m in rows:
                out.append(f"| {c} | " + " | ".join(cell(m, k) for k in keys) + " |")
        return "\n".join(out) + "\n"
