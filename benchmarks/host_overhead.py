"""Host (Python + binding) microseconds per call of the TE modules, forward and forward+backward,
in high precision and under fp8_autocast(DelayedScaling).

On the CPU (default) the shapes are tiny (hidden 64, 16 tokens) so the kernels cost little and
the numbers are mostly the adapter's overhead, the same code that runs per call on a GPU.
With --device cuda the shapes are the quickstart's (hidden 1024, 32 x 256 tokens, bf16): the
host time is measured while the GPU sleeps (nothing waits for the device), as in
benchmarks/gpu_harness.host_us, and printed as host/wall, wall being the synchronized time per
call (GPU work included): host close to wall means the module is host-bound.

    python benchmarks/host_overhead.py                 # CPU, tiny shapes
    python benchmarks/host_overhead.py --device cuda   # GPU, hidden 1024
    python benchmarks/host_overhead.py --profile LayerNormMLP   # cProfile of one module (fwd+bwd, FP8)
    python benchmarks/host_overhead.py --stub-library  # the adapter alone: library compute calls are no-ops

On the CPU the library's kernels still cost something at tiny shapes (FP8 GEMMs are emulated);
--stub-library replaces every compute call of the binding (not handle building, workspace or
support queries) by a no-op, leaving the adapter's own host time (outputs are garbage).

An fp8_autocast region is entered once around each module's timed calls (as one region around a
model's layers; its own cost is printed apart), and forward+backward resets the gradients to None
after each call, as optimizer.zero_grad() does in a training step.

The fused attention path runs on the CPU only with NVTE_FUSED_ATTN=1 (set here for the
DotProductAttention rows); NVTE_CPU_THREADS defaults to 1 here (and torch uses one thread on the CPU)."""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import time

os.environ.setdefault("NVTE_FUSED_ATTN", "1")
os.environ.setdefault("NVTE_CPU_THREADS", "1")  # tiny CPU kernels: no thread-pool wake-ups in the numbers

import torch  # noqa: E402

import transformer_engine.pytorch as te  # noqa: E402
from transformer_engine.common.recipe import DelayedScaling, Format  # noqa: E402


def build(name: str, hidden: int, heads: int, dtype, device):
    """One benchmarked module (the MLP and attention sizes of a TransformerLayer of `hidden`)."""
    kw = dict(params_dtype=dtype, device=device)
    if name == "Linear":
        return te.Linear(hidden, hidden, **kw)
    if name == "LayerNormLinear":
        return te.LayerNormLinear(hidden, 3 * hidden, **kw)
    if name == "LayerNormMLP":
        return te.LayerNormMLP(hidden, 4 * hidden, **kw)
    if name == "LayerNorm":
        return te.LayerNorm(hidden, **kw)
    if name == "DotProductAttention":
        return te.DotProductAttention(heads, hidden // heads, attn_mask_type="causal", qkv_format="bshd").to(device)
    if name == "TransformerLayer":
        return te.TransformerLayer(hidden, 4 * hidden, heads, hidden_dropout=0.0, attention_dropout=0.0, **kw)
    raise ValueError(name)


def stub_library() -> None:
    """Make the binding's compute calls no-ops for the adapter modules that call them."""
    import types

    from transformer_engine import _nvte
    from transformer_engine.pytorch import _ops, fused_attention

    def noop(*args, **kwargs):
        return None

    stub = types.ModuleType("_nvte_stub")
    for name in dir(_nvte):
        attr = getattr(_nvte, name)
        compute = callable(attr) and not isinstance(attr, type) and not name.startswith("_") and not any(
            k in name for k in ("workspace_size", "backend", "get_", "dtype_size"))
        setattr(stub, name, noop if compute else attr)
    _ops._nvte = fused_attention._nvte = stub


MODULES = ("Linear", "LayerNormLinear", "LayerNormMLP", "LayerNorm", "DotProductAttention", "TransformerLayer")


def inputs(name: str, batch: int, seq: int, hidden: int, heads: int, dtype, device):
    if name == "DotProductAttention":
        return [torch.randn(batch, seq, heads, hidden // heads, dtype=dtype, device=device, requires_grad=True)
                for _ in range(3)]
    if name == "TransformerLayer":  # sbhd
        return [torch.randn(seq, batch, hidden, dtype=dtype, device=device, requires_grad=True)]
    return [torch.randn(batch * seq, hidden, dtype=dtype, device=device, requires_grad=True)]


def step_fn(module, args, backward: bool):
    """One call (forward, or forward + backward) of the module. The gradients are reset to None
    after each backward, as by optimizer.zero_grad() in a training step (so no accumulation adds)."""
    leaves = list(module.parameters()) + list(args)

    def fwd():
        return module(*args)

    def fwd_bwd():
        out = module(*args)
        out.backward(torch.ones_like(out))
        for t in leaves:
            t.grad = None
    return fwd_bwd if backward else fwd


SLEEP_CYCLES_PER_CALL = 20_000_000  # ~10 ms of GPU sleep queued per timed call: the queue never drains


def host_us(fn, calls: int, device) -> float:
    """Host microseconds per fn() call (min over 3 rounds; on CUDA the GPU sleeps meanwhile)."""
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(3):
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda._sleep(calls * SLEEP_CYCLES_PER_CALL)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
        if device.type == "cuda":
            torch.cuda.synchronize()
    return best


def wall_us(fn, calls: int) -> float:
    """Microseconds per fn() call including the GPU's work (synchronized, min over 3 rounds)."""
    best = float("inf")
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    return best


def fp8_context(fp8: bool):
    recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=16)
    return te.fp8_autocast(enabled=True, fp8_recipe=recipe) if fp8 else te.fp8_autocast(enabled=False)


def measure(name, args, device, dtype, calls):
    """{(fp8, backward): printed us per call} of one module (host, or host/wall on CUDA)."""
    module = build(name, args.hidden, args.heads, dtype, device)
    xs = inputs(name, args.batch, args.seq, args.hidden, args.heads, dtype, device)
    res = {}
    for fp8 in (False, True):
        for backward in (False, True):
            with fp8_context(fp8):
                fn = step_fn(module, xs, backward)
                host = f"{host_us(fn, calls, device):.1f}"
                res[(fp8, backward)] = host if device.type != "cuda" else f"{host}/{wall_us(fn, calls):.0f}"
    return res


def autocast_us(calls: int, device) -> float:
    def region():
        with fp8_context(True):
            pass
    return host_us(region, calls, device)


def profile(name, args, device, dtype):
    module = build(name, args.hidden, args.heads, dtype, device)
    xs = inputs(name, args.batch, args.seq, args.hidden, args.heads, dtype, device)
    fn = step_fn(module, xs, True)
    with fp8_context(not args.bf16):
        for _ in range(5):
            fn()
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(args.calls):
            fn()
        pr.disable()
    pstats.Stats(pr).sort_stats("tottime").print_stats(35)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--hidden", type=int, default=None, help="default: 64 on the CPU, 1024 on CUDA")
    p.add_argument("--heads", type=int, default=None, help="default: 4 on the CPU, 16 on CUDA")
    p.add_argument("--batch", type=int, default=None, help="default: 2 on the CPU, 32 on CUDA")
    p.add_argument("--seq", type=int, default=None, help="default: 8 on the CPU, 256 on CUDA")
    p.add_argument("--calls", type=int, default=None, help="calls per timed round (default: 200 on the CPU, 10 "
                                                            "on CUDA)")
    p.add_argument("--modules", nargs="*", default=list(MODULES), choices=MODULES)
    p.add_argument("--profile", choices=MODULES, help="cProfile one module's forward+backward instead")
    p.add_argument("--bf16", action="store_true", help="with --profile: profile high precision, not FP8")
    p.add_argument("--stub-library", action="store_true", help="library compute calls are no-ops (see above)")
    args = p.parse_args(argv)
    cuda = args.device == "cuda"
    args.hidden = args.hidden or (1024 if cuda else 64)
    args.heads = args.heads or (16 if cuda else 4)
    args.batch = args.batch or (32 if cuda else 2)
    args.seq = args.seq or (256 if cuda else 8)
    args.calls = args.calls or (10 if cuda else 200)
    device = torch.device(args.device)
    if not cuda:
        torch.set_num_threads(1)
    dtype = torch.bfloat16
    torch.manual_seed(0)
    if args.stub_library:
        stub_library()
    if args.profile:
        profile(args.profile, args, device, dtype)
        return
    what = "host/wall" if cuda else "host"
    print(f"{what} us per call ({args.device}, hidden {args.hidden}, {args.batch}x{args.seq} tokens, bf16; "
          f"min of 3 x {args.calls} calls{'; library calls stubbed' if args.stub_library else ''})")
    width = 16 if cuda else 10
    print(f"{'module':<22}" + "".join(f"{c:>{width}}" for c in ("bf16 fwd", "bf16 f+b", "fp8 fwd", "fp8 f+b")))
    for name in args.modules:
        r = measure(name, args, device, dtype, args.calls)
        print(f"{name:<22}" + "".join(f"{r[k]:>{width}}" for k in ((False, False), (False, True), (True, False),
                                                                   (True, True))))
    print(f"fp8_autocast region enter+exit (no module): {autocast_us(args.calls, device):.1f} us")


if __name__ == "__main__":
    main()
