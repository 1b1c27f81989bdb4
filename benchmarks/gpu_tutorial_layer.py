"""The TE tutorial layer, forward + backward, timed seven ways in one process:

  (a) plain PyTorch eager: a pre-LN transformer layer of torch.nn modules with
      F.scaled_dot_product_attention (causal), bf16 parameters
  (b) the same model under torch.compile
  (c) torchao float8 (torchao.float8.convert_to_float8_training) + torch.compile
  (d) te.TransformerLayer, BF16
  (e) te.TransformerLayer under fp8_autocast(DelayedScaling(HYBRID))
  (f) the same with the recipe's fp8_dpa=True (attention in FP8 too: cuDNN's FP8 graphs)
  (g) (f) with NVTE_FP8_DPA_BWD=0 (FP8 attention forward, BF16 attention backward)

Default shape: hidden 4096, ffn 16384, 32 heads, seq 2048, batch 4 ([s, b, h] input), dropout off
in every variant. All models hold the same weights (the reference is built from the TE layer's
parameters), and each variant's output is compared to (a) once before timing. Times are CUDA-event
medians of back-to-back calls after warm-up (gpu_harness.time_ms); on the CPU (--device cpu, for
checking this script) a perf_counter median. Prints ms per iteration with the ratios t(a)/t and
t(c)/t (> 1: faster than that baseline) and writes a markdown table to <out>/tutorial_layer.md.

  python benchmarks/gpu_tutorial_layer.py --out DIR                 # on the GPU
  python benchmarks/gpu_tutorial_layer.py --tiny --device cpu --no-compile --out /tmp   # logic check
"""
from __future__ import annotations

import argparse
import copy
import datetime
import math
import os
import statistics
import sys
import time
import traceback

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

VARIANTS = {
    "a": "torch eager (SDPA)",
    "b": "torch.compile",
    "c": "torchao float8 + torch.compile",
    "d": "te.TransformerLayer BF16",
    "e": "te.TransformerLayer FP8 DelayedScaling",
    "f": "te.TransformerLayer FP8 DelayedScaling + fp8_dpa",
    "g": "te.TransformerLayer FP8 + fp8_dpa, NVTE_FP8_DPA_BWD=0",
}
FULL = dict(hidden=4096, ffn=16384, heads=32, seq=2048, batch=4)
TINY = dict(hidden=64, ffn=256, heads=4, seq=32, batch=2)


class RefLayer(torch.nn.Module):
    """Pre-LN layer: x + proj(attn(qkv(LN(x)))), then + fc2(gelu_tanh(fc1(LN(.)))); x is [s, b, h]."""

    def __init__(self, hidden, ffn, heads, eps=1e-5):
        super().__init__()
        self.heads = heads
        self.ln1 = torch.nn.LayerNorm(hidden, eps=eps)
        self.qkv = torch.nn.Linear(hidden, 3 * hidden)
        self.proj = torch.nn.Linear(hidden, hidden)
        self.ln2 = torch.nn.LayerNorm(hidden, eps=eps)
        self.fc1 = torch.nn.Linear(hidden, ffn)
        self.fc2 = torch.nn.Linear(ffn, hidden)

    def forward(self, x):
        s, b, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(h, dim=-1)
        q, k, v = (t.reshape(s, b, self.heads, h // self.heads).permute(1, 2, 0, 3) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [b, heads, s, d]
        x = x + self.proj(a.permute(2, 0, 1, 3).reshape(s, b, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))


def ref_from_te(te_layer, cfg, dtype, device):
    """A RefLayer holding te_layer's weights (split QKV weights concatenated)."""
    ref = RefLayer(cfg["hidden"], cfg["ffn"], cfg["heads"]).to(device=device, dtype=dtype)
    qkv = te_layer.self_attention.layernorm_qkv
    mlp = te_layer.layernorm_mlp
    with torch.no_grad():
        ref.ln1.weight.copy_(qkv.layer_norm_weight)
        ref.ln1.bias.copy_(qkv.layer_norm_bias)
        if hasattr(qkv, "query_weight"):
            ref.qkv.weight.copy_(torch.cat([qkv.query_weight, qkv.key_weight, qkv.value_weight]))
            ref.qkv.bias.copy_(torch.cat([qkv.query_bias, qkv.key_bias, qkv.value_bias]))
        else:  # fuse_qkv_params: rows interleaved per head [q_h | k_h | v_h] -> [all q | all k | all v]
            heads, h = cfg["heads"], cfg["hidden"]
            w = qkv.weight.view(heads, 3, h // heads, h).transpose(0, 1).reshape(3 * h, h)
            ref.qkv.weight.copy_(w)
            ref.qkv.bias.copy_(qkv.bias.view(heads, 3, h // heads).transpose(0, 1).reshape(3 * h))
        ref.proj.weight.copy_(te_layer.self_attention.proj.weight)
        ref.proj.bias.copy_(te_layer.self_attention.proj.bias)
        ref.ln2.weight.copy_(mlp.layer_norm_weight)
        ref.ln2.bias.copy_(mlp.layer_norm_bias)
        ref.fc1.weight.copy_(mlp.fc1_weight)
        ref.fc1.bias.copy_(mlp.fc1_bias)
        ref.fc2.weight.copy_(mlp.fc2_weight)
        ref.fc2.bias.copy_(mlp.fc2_bias)
    return ref


def time_cpu_ms(fn, iters, warmup, inner):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - t0) * 1e3 / inner)
    return statistics.median(times)


def rel_err(got, ref):
    got, ref = got.detach().double(), ref.detach().double()
    return float((got - ref).norm() / max(float(ref.norm()), 1e-30))


def build(variant, te_layer, ref, te, recipe):
    """(callable x -> output, note) of one variant, or (None, reason) when it cannot run."""
    if variant == "a":
        return ref, ""
    if variant == "b":
        return torch.compile(ref), ""
    if variant == "c":
        try:
            from torchao.float8 import convert_to_float8_training
        except ImportError as e:
            return None, f"torchao missing ({e})"
        m = convert_to_float8_training(copy.deepcopy(ref))
        return torch.compile(m), ""
    if variant == "d":
        return te_layer, ""
    if variant in "efg":
        ok, reason = te.is_fp8_available(return_reason=True)
        if not ok:
            return None, f"FP8 unavailable: {reason}"
        r = recipe.DelayedScaling(fp8_format=recipe.Format.HYBRID, amax_history_len=16, amax_compute_algo="max",
                                  fp8_dpa=variant != "e")
        fp8_dpa_bwd = "0" if variant == "g" else "1"  # read by each forward (it picks the backward)

        def run(x):
            old = os.environ.get("NVTE_FP8_DPA_BWD")
            os.environ["NVTE_FP8_DPA_BWD"] = fp8_dpa_bwd
            try:
                with te.fp8_autocast(enabled=True, fp8_recipe=r):
                    return te_layer(x)
            finally:
                if old is None:
                    del os.environ["NVTE_FP8_DPA_BWD"]
                else:
                    os.environ["NVTE_FP8_DPA_BWD"] = old
        return run, ""
    raise ValueError(variant)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=".")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--tiny", action="store_true", help=f"tiny shapes {TINY} (to check the script)")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile variants (b, c)")
    p.add_argument("--fuse-qkv", action="store_true", help="te.TransformerLayer(fuse_qkv_params=True)")
    p.add_argument("--only", default="abcdefg", help="variants to run, e.g. 'ade'")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--inner", type=int, default=8)
    a = p.parse_args(argv)

    import transformer_engine.pytorch as te
    from transformer_engine.common import recipe

    device = torch.device(a.device)
    dtype = getattr(torch, a.dtype)
    cfg = TINY if a.tiny else FULL
    on_cuda = device.type == "cuda"
    if on_cuda:
        from gpu_harness import time_ms

        def timer(fn):
            return time_ms(fn, iters=a.iters, warmup=a.warmup, inner=a.inner)
        dev_name = torch.cuda.get_device_name(device)
    else:
        def timer(fn):
            return time_cpu_ms(fn, a.iters, a.warmup, a.inner)
        dev_name = "cpu"

    torch.manual_seed(1234)
    te_layer = te.TransformerLayer(cfg["hidden"], cfg["ffn"], cfg["heads"], hidden_dropout=0.0, attention_dropout=0.0,
                                   params_dtype=dtype, device=device, fuse_qkv_params=a.fuse_qkv)
    ref = ref_from_te(te_layer, cfg, dtype, device)
    g = torch.Generator(device=device).manual_seed(0)
    shape = (cfg["seq"], cfg["batch"], cfg["hidden"])
    x = torch.randn(shape, generator=g, device=device, dtype=dtype)
    dy = torch.randn(shape, generator=g, device=device, dtype=dtype) * 1e-2
    with torch.no_grad():
        y_ref = ref(x).float()

    # FLOPs of one forward + backward (GEMMs 3x forward; attention: QK^T and PV, causal half)
    s, b, h, f = cfg["seq"], cfg["batch"], cfg["hidden"], cfg["ffn"]
    gemm_fwd = 2 * s * b * (3 * h * h + h * h + 2 * h * f)
    attn_fwd = 2 * 2 * b * s * s * h / 2
    flops = 3 * (gemm_fwd + attn_fwd)

    print(f"device {dev_name}, torch {torch.__version__}, dtype {a.dtype}, shape {cfg}", flush=True)
    results = {}
    for v in a.only:
        if v not in VARIANTS:
            raise SystemExit(f"unknown variant {v!r}; expected some of {''.join(VARIANTS)}")
        if a.no_compile and v in "bc":
            results[v] = (None, "skipped (--no-compile)", None)
            continue
        try:
            fn, note = build(v, te_layer, ref, te, recipe)
            if fn is None:
                results[v] = (None, note, None)
                print(f"({v}) {VARIANTS[v]}: {note}", flush=True)
                continue
            with torch.no_grad():
                err = rel_err(fn(x).float(), y_ref)

            def step():
                fn(x).backward(dy)
            ms = timer(step)
            results[v] = (ms, note, err)
            print(f"({v}) {VARIANTS[v]}: {ms:.3f} ms/iter, {flops / ms / 1e9:.1f} TFLOP/s, "
                  f"output rel. err vs (a) {err:.2e}", flush=True)
        except Exception as e:  # one variant failing must not lose the others
            traceback.print_exc()
            results[v] = (None, f"failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", None)
        finally:
            for mod in (ref, te_layer):
                mod.zero_grad(set_to_none=True)
            if on_cuda:
                torch.cuda.empty_cache()

    base_a = results.get("a", (None,))[0]
    base_c = results.get("c", (None,))[0]
    lines = [f"## {datetime.date.today()} — tutorial layer fwd+bwd on {dev_name}", "",
             f"torch {torch.__version__}, {a.dtype}, hidden {h}, ffn {f}, heads {cfg['heads']}, seq {s}, batch {b}; "
             f"CUDA-event median of {a.iters} x {a.inner} back-to-back iterations after {a.warmup} warm-up"
             if on_cuda else f"torch {torch.__version__}, {a.dtype}, {cfg}, CPU perf_counter median", "",
             "| variant | ms/iter | TFLOP/s | t(a)/t | t(c)/t | out rel. err vs (a) | note |",
             "|---|---|---|---|---|---|---|"]
    for v, (ms, note, err) in results.items():
        def ratio(base):
            return f"{base / ms:.2f}" if (base and ms) else "-"
        lines.append(f"| ({v}) {VARIANTS[v]} | {f'{ms:.3f}' if ms else '-'} | "
                     f"{f'{flops / ms / 1e9:.1f}' if ms else '-'} | {ratio(base_a)} | {ratio(base_c)} | "
                     f"{f'{err:.1e}' if err is not None else '-'} | {note} |")
    md = "\n".join(lines) + "\n"
    print(md)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "tutorial_layer.md"), "w") as fh:
        fh.write(md)
    failed = [v for v, (ms, note, _) in results.items() if note.startswith("failed")]
    if failed:
        raise SystemExit(f"variants failed: {failed}")
    return results


if __name__ == "__main__":
    main()
