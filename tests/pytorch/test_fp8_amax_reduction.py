"""Delayed scaling's amax reduction over fp8_group (fp8.reduce_amaxes): two ranks (processes,
_amax_worker.py) train a Linear, an FP8 DotProductAttention and a LayerNormMLP with different
inputs. With the reduction every rank must hold the same histories and scales, built from the
ranks' largest amaxes, forward and backward, through one all-reduce per step; without it
(reduce_amax=False, or no fp8_group) each rank keeps its own."""
import pytest
import torch

from _util import DEVICE, ON_CUDA
from _ranks import run_ranks

SIZE = 2
MODULES = ("qkv", "attn", "mlp")


@pytest.fixture(scope="module")
def ranks():
    if ON_CUDA and torch.cuda.device_count() < SIZE:
        pytest.skip(f"needs {SIZE} GPUs (one NCCL rank per GPU), found {torch.cuda.device_count()}")
    return run_ranks("_amax_worker.py", SIZE, DEVICE.type, timeout=300)


def keys(kind):
    return [f"{m}.{kind}.{k}" for m in MODULES for k in ("fwd", "bwd")]


@pytest.mark.parametrize("step", [0, 1])
def test_reduced_state_is_the_same_on_every_rank(ranks, step):
    # Except the backward histories' row 0: the amaxes of the backward pass just run, which the
    # next step's autocast exit reduces. And step 0's backward scales: the first backward casts
    # gradients with current scaling from each rank's own amaxes (the seeding, fp8.take_bwd_seed).
    for key in keys("hist") + keys("scale"):
        if step == 0 and key.endswith("scale.bwd"):
            continue
        a, b = (r["reduce", step][key] for r in ranks)
        if key.endswith("hist.bwd"):
            a, b = a[1:], b[1:]
        assert torch.equal(a, b), f"{key} after step {step} differs between ranks:\n{a}\n{b}"


@pytest.mark.parametrize("run", ["no_reduce", "no_group"])
def test_without_reduction_ranks_keep_their_own_scales(ranks, run):
    # the inputs differ between ranks, so an unreduced state must too (the test above can fail)
    for key in keys("scale"):
        a, b = (r[run, 1][key] for r in ranks)
        assert not torch.equal(a, b), f"{key} is the same on both ranks without a reduction"


def test_forward_amaxes_are_the_ranks_maximum(ranks):
    # step 0 runs the same forward in every run (initial scales): the reduced forward history is
    # the elementwise maximum of the ranks' own histories, bit for bit
    for key in keys("hist")[0::2]:
        want = torch.maximum(*(r["no_reduce", 0][key] for r in ranks))
        got = ranks[0]["reduce", 0][key]
        assert got.abs().max() > 0, key
        assert torch.equal(got, want), f"{key}: reduced\n{got}\nranks' maximum\n{want}"


def test_backward_amaxes_are_the_ranks_maximum(ranks):
    # step 0's backward amaxes (each rank's own, in row 0 after step 0) are reduced at step 1's
    # autocast exit and rolled by step 1's backward into the history's last row
    for key in keys("hist")[1::2]:
        want = torch.maximum(*(r["reduce", 0][key][0] for r in ranks))
        got = ranks[0]["reduce", 1][key][-1]
        assert got.abs().max() > 0, key
        assert torch.equal(got, want), f"{key}: reduced {got}, ranks' maximum {want}"
        own = ranks[0]["reduce", 0][key][0]
        assert not torch.equal(got, own), f"{key}: rank 0's own backward amaxes were not replaced"


def test_one_all_reduce_per_step(ranks):
    for r in ranks:
        assert [r["reduce", i]["all_reduces"] for i in range(2)] == [1, 1]
        assert [r[run, i]["all_reduces"] for run in ("no_reduce", "no_group") for i in range(2)] == [0] * 4
