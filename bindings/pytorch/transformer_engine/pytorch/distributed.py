"""Activation recomputation (te.checkpoint / te.distributed.checkpoint) aware of FP8 state.

A checkpointed forward runs without keeping activations; backward re-runs it. With delayed
scaling, the re-run must cast with the scales the original forward used (the forward scales
have been updated at the fp8_autocast exit since) and must not record amaxes into the history a
second time. The checkpointed forward therefore stashes a copy of each module's forward scales
(FP8GlobalState.checkpoint_stash); the recompute restores the fp8_autocast state of the forward,
casts with the stashed scales and records amaxes into scratch buffers
(FP8GlobalState.recompute_stash). RNG states (CPU, CUDA, and an optional RNG tracker) are
restored so dropout draws the same masks.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Optional

import torch

from .fp8 import FP8GlobalState

__all__ = ["checkpoint"]


class _RecomputeState:
    """What the recompute needs from the original forward."""

    def __init__(self, get_rng_state_tracker: Optional[Callable]):
        self.autocast = FP8GlobalState.autocast_state()
        self.stash = {}
        self.tracker = get_rng_state_tracker() if get_rng_state_tracker is not None else None
        self.tracker_states = self.tracker.get_states() if self.tracker is not None else None

    @contextlib.contextmanager
    def forward(self):
        prev = FP8GlobalState.checkpoint_stash
        FP8GlobalState.checkpoint_stash = self.stash
        try:
            yield
        finally:
            FP8GlobalState.checkpoint_stash = prev

    @contextlib.contextmanager
    def recompute(self):
        st = FP8GlobalState
        saved = (st.autocast_state(), st.recompute_stash, st.checkpoint_stash)
        st.set_autocast_state(self.autocast)
        st.recompute_stash, st.checkpoint_stash = self.stash, None
        tracker_now = self.tracker.get_states() if self.tracker is not None else None
        if self.tracker is not None:
            self.tracker.set_states(self.tracker_states)
        try:
            yield
        finally:
            st.set_autocast_state(saved[0])
            st.recompute_stash, st.checkpoint_stash = saved[1], saved[2]
            if self.tracker is not None:
                self.tracker.set_states(tracker_now)


def _cuda_devices():
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return list(range(torch.cuda.device_count()))
    return []


class _ReentrantCheckpoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run_function, state: _RecomputeState, *args):
        ctx.run_function, ctx.state = run_function, state
        ctx.devices = _cuda_devices()
        ctx.cpu_rng = torch.get_rng_state()
        ctx.cuda_rng = [torch.cuda.get_rng_state(d) for d in ctx.devices]
        ctx.is_tensor = [isinstance(a, torch.Tensor) for a in args]
        ctx.others = [None if t else a for a, t in zip(args, ctx.is_tensor)]
        ctx.save_for_backward(*[a for a, t in zip(args, ctx.is_tensor) if t])
        with torch.no_grad(), state.forward():
            return run_function(*args)

    @staticmethod
    def backward(ctx, *grads):
        tensors = iter(ctx.saved_tensors)
        inputs = []
        for is_t, other in zip(ctx.is_tensor, ctx.others):
            if is_t:
                t = next(tensors)
                inputs.append(t.detach().requires_grad_(t.requires_grad))
            else:
                inputs.append(other)
        with torch.random.fork_rng(devices=ctx.devices):
            torch.set_rng_state(ctx.cpu_rng)
            for d, s in zip(ctx.devices, ctx.cuda_rng):
                torch.cuda.set_rng_state(s, d)
            with torch.enable_grad(), ctx.state.recompute():
                outputs = ctx.run_function(*inputs)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grads) if isinstance(o, torch.Tensor) and o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None) + tuple(i.grad if isinstance(i, torch.Tensor) else None for i in inputs)


def checkpoint(function: Callable, *args: Any, distribute_saved_activations: bool = False,
               get_rng_state_tracker: Optional[Callable] = None, tp_group=None, use_reentrant: bool = True,
               **kwargs: Any):
    """Run `function(*args, **kwargs)` without keeping its activations; recompute them in backward.

    Under fp8_autocast the recompute reuses the FP8 scales of the original forward and leaves the
    amax histories alone, so outputs, gradients and recipe state equal those of a run without
    checkpointing. get_rng_state_tracker: a callable returning an object with get_states() /
    set_states() (Megatron's RNG tracker) whose states are restored for the recompute too.
    distribute_saved_activations (tensor-parallel sharding of the saved inputs) is not
    implemented: this adapter has no tensor parallelism."""
    if distribute_saved_activations:
        raise NotImplementedError("checkpoint: distribute_saved_activations needs tensor parallelism, which this "
                                  "adapter does not implement")
    fn = functools.partial(function, **kwargs) if kwargs else function
    state = _RecomputeState(get_rng_state_tracker)
    if use_reentrant:
        return _ReentrantCheckpoint.apply(fn, state, *args)
    return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False,
                                             context_fn=lambda: (state.forward(), state.recompute()))
