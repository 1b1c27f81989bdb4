"""Activation recomputation (te.checkpoint / te.distributed.checkpoint) aware of FP8 state.

A checkpointed forward runs without keeping activations; backward re-runs it. With delayed
scaling, the re-run must cast with the scales the original forward used (the forward scales
have been updated at the fp8_autocast exit since) and must not record amaxes into the history a
second time. The checkpointed forward therefore stashes a copy of each module's forward scales
(FP8GlobalState.checkpoint_stash); the recompute restores the fp8_autocast state of the forward,
casts with the stashed scales and records amaxes into scratch buffers
(FP8GlobalState.recompute_stash). RNG states (CPU, CUDA, and an optional RNG tracker) are
restored so dropout draws the same masks.

CudaRNGStatesTracker: TE's (Megatron's) tracker of named RNG streams, for get_rng_state_tracker.
"""
from __future__ import annotations

import contextlib
import functools
import warnings
from typing import Any, Callable, Dict, Optional

import torch

from .fp8 import FP8GlobalState

__all__ = ["checkpoint", "CudaRNGStatesTracker"]


class _RecomputeState:
    """What the recompute needs from the original forward."""

    def __init__(self, get_rng_state_tracker: Optional[Callable]):
        self.autocast = FP8GlobalState.autocast_state()
        self.stash = {}
        self.tracker = get_rng_state_tracker() if get_rng_state_tracker is not None else None
        self.tracker_states = self.tracker.get_states() if self.tracker is not None else None
        self.user_contexts = None  # checkpoint's context_fn (reentrant form)
        self.grad_enabled = torch.is_grad_enabled()  # (at the call: the reentrant forward runs without grad)

    @contextlib.contextmanager
    def forward(self):
        st = FP8GlobalState
        prev = st.checkpoint_stash, st.checkpoint_training
        st.checkpoint_stash, st.checkpoint_training = self.stash, self.grad_enabled
        try:
            yield
        finally:
            st.checkpoint_stash, st.checkpoint_training = prev

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


_AUTOCAST_DEVICES = ("cpu", "cuda")


def _autocast_state():
    """torch.autocast's state per device type ({device: (enabled, dtype, cache_enabled)}): the
    recompute runs after the forward's autocast region has been left, so it must re-enter it."""
    cache = torch.is_autocast_cache_enabled()
    return {d: (torch.is_autocast_enabled(d), torch.get_autocast_dtype(d), cache) for d in _AUTOCAST_DEVICES}


def _autocast_context(state) -> contextlib.ExitStack:
    stack = contextlib.ExitStack()
    for d, (enabled, dtype, cache) in state.items():
        if d == "cuda" and not enabled and not torch.cuda.is_available():
            continue  # (nothing to turn off; torch.autocast("cuda") warns without CUDA)
        stack.enter_context(torch.autocast(d, dtype=dtype, enabled=enabled, cache_enabled=cache))
    return stack


class _ReentrantCheckpoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run_function, state: _RecomputeState, *args):
        ctx.run_function, ctx.state = run_function, state
        ctx.devices = _cuda_devices()
        ctx.cpu_rng = torch.get_rng_state()
        ctx.cuda_rng = [torch.cuda.get_rng_state(d) for d in ctx.devices]
        ctx.autocast = _autocast_state()
        ctx.is_tensor = [isinstance(a, torch.Tensor) for a in args]
        ctx.others = [None if t else a for a, t in zip(args, ctx.is_tensor)]
        ctx.save_for_backward(*[a for a, t in zip(args, ctx.is_tensor) if t])
        fwd_ctx, ctx.recompute_ctx = (state.user_contexts() if state.user_contexts is not None else
                                      (contextlib.nullcontext(), contextlib.nullcontext()))
        with torch.no_grad(), state.forward(), fwd_ctx:
            return run_function(*args)

    @staticmethod
    def backward(ctx, *grads):
        # The recompute runs its own backward into the inputs' and parameters' .grad: under
        # torch.autograd.grad that would write .grad behind the caller's back (and return nothing
        # for the parameters), so it is refused, as torch's reentrant checkpoint does.
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError("te.checkpoint(use_reentrant=True) is not compatible with .grad() or the inputs "
                               "argument of .backward(); use .backward() without inputs, or use_reentrant=False")
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
            with torch.enable_grad(), _autocast_context(ctx.autocast), ctx.state.recompute(), ctx.recompute_ctx:
                outputs = ctx.run_function(*inputs)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grads) if isinstance(o, torch.Tensor) and o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None) + tuple(i.grad if isinstance(i, torch.Tensor) else None for i in inputs)


# torch.utils.checkpoint keywords TE's checkpoint accepts and drops (they are not the function's)
_IGNORED_KWARGS = ("determinism_check", "debug")


@contextlib.contextmanager
def _within(*contexts):
    """Inside every context of `contexts`, in order."""
    with contextlib.ExitStack() as stack:
        for c in contexts:
            stack.enter_context(c)
        yield


def _legacy_positional(args) -> bool:
    """TE's deprecated checkpoint(function, distribute_saved_activations, get_rng_state_tracker,
    tp_group, *args): TE's own test of it (a bool, a callable, a process group or None, then args)."""
    group = getattr(torch.distributed, "ProcessGroup", None) if torch.distributed.is_available() else None
    return (len(args) > 3 and isinstance(args[0], bool) and callable(args[1]) and
            (args[2] is None or (group is not None and isinstance(args[2], group))))


def _group_size(group) -> int:
    if group is None or not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return 1
    return torch.distributed.get_world_size(group)


def checkpoint(function: Callable, *args: Any, distribute_saved_activations: bool = False,
               get_rng_state_tracker: Optional[Callable] = None, tp_group=None, use_reentrant: bool = True,
               **kwargs: Any):
    """Run `function(*args, **kwargs)` without keeping its activations; recompute them in backward.

    Under fp8_autocast the recompute reuses the FP8 scales of the original forward and leaves the
    amax histories alone, so outputs, gradients and recipe state equal those of a run without
    checkpointing; torch.autocast's state of the forward is restored for the recompute too.
    get_rng_state_tracker: a callable returning an object with get_states() / set_states() (a
    CudaRNGStatesTracker, or Megatron's) whose states are restored for the recompute.
    distribute_saved_activations (sharding the saved inputs over tp_group, a memory saving only)
    has no effect with use_reentrant=False or without a tensor-parallel group of more than one
    rank; with one, it is not implemented (this adapter has no tensor parallelism). context_fn (torch's:
    a callable returning (forward context, recompute context)) wraps the forward and the recompute, as
    in TE; determinism_check and debug are accepted and ignored, as in TE. TE's older positional form
    checkpoint(function, distribute_saved_activations, get_rng_state_tracker, tp_group, *args) is
    accepted with a DeprecationWarning."""
    if _legacy_positional(args):
        # TE's deprecated positional form (Megatron-LM's call): the three options lead the arguments
        if distribute_saved_activations or get_rng_state_tracker is not None or tp_group is not None:
            raise TypeError("checkpoint: distribute_saved_activations, get_rng_state_tracker and tp_group given "
                            "both positionally (the deprecated form) and as keywords")
        warnings.warn("checkpoint(function, distribute_saved_activations, get_rng_state_tracker, tp_group, *args) "
                      "is deprecated: pass these three as keyword arguments", DeprecationWarning, stacklevel=2)
        distribute_saved_activations, get_rng_state_tracker, tp_group = args[:3]
        args = args[3:]
    for k in _IGNORED_KWARGS:
        kwargs.pop(k, None)
    user_contexts = kwargs.pop("context_fn", None)
    if distribute_saved_activations and use_reentrant and _group_size(tp_group) > 1:
        raise NotImplementedError("checkpoint: distribute_saved_activations over a tensor-parallel group of more "
                                  "than one rank is not implemented in this adapter")
    fn = functools.partial(function, **kwargs) if kwargs else function
    state = _RecomputeState(get_rng_state_tracker)
    if use_reentrant:
        state.user_contexts = user_contexts
        return _ReentrantCheckpoint.apply(fn, state, *args)
    if user_contexts is None:
        return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False,
                                                 context_fn=lambda: (state.forward(), state.recompute()))

    def contexts():
        fwd, rec = user_contexts()
        return _within(state.forward(), fwd), _within(state.recompute(), rec)
    return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, context_fn=contexts)


# ------------------------------------------------------------- RNG tracker
def _tracked_device() -> torch.device:
    """The generator a tracker stream stands for: the current CUDA device's (TE's), or the CPU's on
    a machine without CUDA (this adapter runs there too)."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _default_generator(dev: torch.device) -> torch.Generator:
    if dev.type == "cpu":
        return torch.default_generator
    return torch.cuda.default_generators[dev.index]


class CudaRNGStatesTracker:
    """Named RNG streams (TE's / Megatron's tracker, e.g. "model-parallel-rng"), for
    get_rng_state_tracker of the modules and of checkpoint.

    add(name, seed) starts a stream; fork(name) runs a block with the stream's state in the default
    generator of the current CUDA device (of the CPU on a machine without CUDA), then saves the
    advanced state back into the stream and restores the generator's previous state.
    get_states() / set_states() copy and replace all streams as {name: generator state tensor},
    TE's format (what Megatron-LM saves in its checkpoints, and what checkpoint() restores)."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        """Forget every stream and seed."""
        self.states_: Dict[str, torch.Tensor] = {}
        self.seeds_ = set()

    def get_states(self) -> Dict[str, torch.Tensor]:
        """A copy of the streams' states (name -> state): later draws do not change it."""
        return {name: st.clone() for name, st in self.states_.items()}

    def set_states(self, states: Dict[str, torch.Tensor]) -> None:
        """Replace the streams' states by `states` (as get_states() returns them)."""
        if not isinstance(states, dict) or not all(isinstance(t, torch.Tensor) for t in states.values()):
            raise TypeError("CudaRNGStatesTracker.set_states: expected a dict name -> generator state tensor "
                            "(as get_states() returns)")
        self.states_ = {name: st.clone() for name, st in states.items()}

    def add(self, name: str, seed: int) -> None:
        """Start the stream `name` from `seed`; a name or a seed may be added only once."""
        seed = int(seed)
        if seed in self.seeds_:
            raise ValueError(f"CudaRNGStatesTracker: seed {seed} already exists")
        if name in self.states_:
            raise ValueError(f"CudaRNGStatesTracker: RNG state {name!r} already exists")
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator(device=_tracked_device()).manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        """Draw in the stream `name` inside the block (see the class)."""
        if name not in self.states_:
            raise KeyError(f"CudaRNGStatesTracker: RNG state {name!r} has not been added (known: "
                           f"{sorted(self.states_)})")
        gen = _default_generator(_tracked_device())
        previous = gen.get_state()
        gen.set_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = gen.get_state()
            gen.set_state(previous)
