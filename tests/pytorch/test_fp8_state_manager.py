"""FP8GlobalStateManager, check_fp8_support and get_default_fp8_recipe imported from
transformer_engine.pytorch.fp8 (as Megatron-LM imports them): they report the fp8_autocast /
fp8_model_init state in force, and reduce_and_update_fp8_tensors does the exit's forward update."""
import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common import recipe
from transformer_engine.pytorch.fp8 import FP8GlobalStateManager as M, check_fp8_support, get_default_fp8_recipe

from _util import DEVICE, dev, gemm_dim


def test_state_follows_the_regions():
    assert check_fp8_support() == te.is_fp8_available(return_reason=True) == M.is_fp8_available()
    assert isinstance(get_default_fp8_recipe(), recipe.DelayedScaling)
    assert not M.is_fp8_enabled() and M.get_autocast_depth() == 0 and not M.with_fp8_parameters()
    r = recipe.DelayedScaling(margin=1)
    with te.fp8_autocast(fp8_recipe=r):
        assert M.is_fp8_enabled() and M.get_fp8_recipe() is r and M.get_autocast_depth() == 1
        saved = M.get_fp8_autocast_state()
        with te.fp8_autocast(enabled=False, calibrating=True):
            assert not M.is_fp8_enabled() and M.is_fp8_calibration() and M.get_autocast_depth() == 2
            M.set_fp8_autocast_state(saved)
            assert M.is_fp8_enabled() and M.get_fp8_recipe() is r
        assert M.is_fp8_enabled() and not M.is_fp8_calibration()
    assert not M.is_fp8_enabled() and not M.fp8_graph_capturing()
    with te.fp8_model_init(preserve_high_precision_init_val=True):
        assert M.with_fp8_parameters() and M.with_high_precision_init_val()
    assert not M.with_fp8_parameters()


def test_reduce_and_update_is_the_exit_update():
    """Called inside the region: the modules that ran an FP8 forward get their forward scales
    updated then, and the exit does not update them a second time."""
    d = gemm_dim(8)
    torch.manual_seed(0)
    a = te.Linear(d, d, device=DEVICE)
    b = te.Linear(d, d, device=DEVICE)
    b.load_state_dict(a.state_dict())
    x = dev(torch.randn(gemm_dim(4), d) * 50)
    r = recipe.DelayedScaling(amax_history_len=4)
    with te.fp8_autocast(fp8_recipe=r):
        a(x)
    with te.fp8_autocast(fp8_recipe=r):
        b(x)
        M.reduce_and_update_fp8_tensors(forward=True)
        assert torch.equal(b.fp8_meta.scale["fwd"], a.fp8_meta.scale["fwd"])
    assert torch.equal(b.fp8_meta.scale["fwd"], a.fp8_meta.scale["fwd"])
    assert torch.equal(b.fp8_meta.amax_history["fwd"], a.fp8_meta.amax_history["fwd"])
    assert float(a.fp8_meta.scale["fwd"][0]) != 1.0
