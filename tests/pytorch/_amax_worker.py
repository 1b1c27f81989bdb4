"""One rank of test_fp8_amax_reduction.py (started by _ranks.run_ranks; gloo on the CPU, NCCL with
one GPU per rank under NVTE_TEST_DEVICE=cuda).

argv: rank, size, init file, output file, device type. Every rank builds the same modules (same
seed) and feeds them its own inputs and output gradients, scaled by (1 + rank) so that the
ranks' amaxes differ. Three runs of two FP8 training steps each: fp8_group given with
reduce_amax=True ("reduce"), with reduce_amax=False ("no_reduce"), and no fp8_group ("no_group").
Saved per run and step: every module's amax histories and scales, and how many all-reduces the
step's fp8_autocast exit made."""
import torch
import torch.distributed as dist

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling

from _ranks import init_rank

B, H = 2, 2  # batch, heads
S, D = 5, 8  # sequence, head size (on CUDA: 128 each, what cuDNN's FP8 attention backward takes)


def build(dev, dtype):
    torch.manual_seed(3)
    return torch.nn.ModuleDict({
        "qkv": te.Linear(16, 3 * H * D, device=dev, params_dtype=dtype),
        "attn": te.DotProductAttention(H, D, qkv_format="bshd", attn_mask_type="no_mask"),
        "mlp": te.LayerNormMLP(H * D, 32, device=dev, params_dtype=dtype),
    }).to(dev)


def step(mods, x, dy, recipe, group):
    with te.fp8_autocast(fp8_recipe=recipe, fp8_group=group):
        q, k, v = mods["qkv"](x).view(B, S, 3, H, D).unbind(2)
        y = mods["mlp"](mods["attn"](q.contiguous(), k.contiguous(), v.contiguous()))
    y.backward(dy)


def state(mods):
    out = {}
    for name, m in mods.items():
        for key in ("fwd", "bwd"):
            out[f"{name}.hist.{key}"] = m.fp8_meta.amax_history[key].detach().cpu().clone()
            out[f"{name}.scale.{key}"] = m.fp8_meta.scale[key].detach().cpu().clone()
    return out


def main():
    global S, D
    rank, size, out_file, dev, group, _ = init_rank()
    dtype = torch.float32
    if dev.type == "cuda":
        S, D, dtype = 128, 128, torch.bfloat16
    calls = [0]
    all_reduce = dist.all_reduce

    def counted(*args, **kwargs):
        calls[0] += 1
        return all_reduce(*args, **kwargs)
    dist.all_reduce = counted
    results = {}
    for run in ("reduce", "no_reduce", "no_group"):
        recipe = DelayedScaling(amax_history_len=4, fp8_dpa=True, reduce_amax=run != "no_reduce")
        mods = build(dev, dtype)
        for i in range(2):
            gen = torch.Generator().manual_seed(100 + i)
            x = torch.randn(B, S, 16, generator=gen) * (1 + rank)
            dy = torch.randn(B, S, H * D, generator=gen) * (1 + 2 * rank)
            calls[0] = 0
            step(mods, x.to(dev, dtype), dy.to(dev, dtype), recipe, None if run == "no_group" else group)
            results[run, i] = dict(state(mods), all_reduces=calls[0])
    torch.save(results, out_file)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
