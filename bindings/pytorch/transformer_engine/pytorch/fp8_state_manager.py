"""FP8GlobalStateManager: TE's class-level view of the fp8_autocast state, which Megatron-LM and
other callers import from transformer_engine.pytorch.fp8 (TE's own state lives in that class; here
it reads fp8.FP8GlobalState and fp8.FP8ModelInitState, the state this adapter keeps). Also TE's
check_fp8_support() and get_default_fp8_recipe()."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from transformer_engine.common.recipe import DelayedScaling, Recipe

from . import fp8 as _fp8


def check_fp8_support() -> Tuple[bool, str]:
    """(FP8 runs here, the reason when it does not)."""
    return _fp8._fp8_support()


def get_default_fp8_recipe() -> DelayedScaling:
    return _fp8.get_default_recipe()


class FP8GlobalStateManager:
    """Read-mostly class methods over the fp8_autocast / fp8_model_init state in force."""

    @classmethod
    def is_fp8_available(cls) -> Tuple[bool, str]:
        return check_fp8_support()

    @classmethod
    def is_fp8_enabled(cls) -> bool:
        """Inside an fp8_autocast region that enables FP8."""
        return bool(_fp8.FP8GlobalState.enabled)

    @classmethod
    def is_fp8_calibration(cls) -> bool:
        return bool(_fp8.FP8GlobalState.calibrating)

    @classmethod
    def with_fp8_parameters(cls) -> bool:
        """Inside fp8_model_init / quantized_model_init (modules built now keep FP8 weights)."""
        return bool(_fp8.FP8ModelInitState.enabled)

    @classmethod
    def with_high_precision_init_val(cls) -> bool:
        return bool(_fp8.FP8ModelInitState.preserve_high_precision_init_val)

    @classmethod
    def get_fp8_recipe(cls) -> Recipe:
        """The recipe of the region in force (TE's default recipe outside one)."""
        r = _fp8.FP8GlobalState.recipe
        return r if r is not None else get_default_fp8_recipe()

    @classmethod
    def get_fp8_group(cls):
        return _fp8.FP8GlobalState.group

    @classmethod
    def get_autocast_depth(cls) -> int:
        return int(_fp8.FP8GlobalState.depth)

    @classmethod
    def fp8_graph_capturing(cls) -> bool:
        """A CUDA graph is being captured on the current stream."""
        return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()

    @classmethod
    def get_fp8_autocast_state(cls):
        """An opaque copy of the region's state, for set_fp8_autocast_state."""
        return _fp8.FP8GlobalState.autocast_state()

    @classmethod
    def set_fp8_autocast_state(cls, state) -> None:
        _fp8.FP8GlobalState.set_autocast_state(state)

    @classmethod
    def reset(cls) -> None:
        """Leaves every region (state as at import: FP8 off, nothing pending)."""
        _fp8.FP8GlobalState.reset()

    @classmethod
    def reduce_and_update_fp8_tensors(cls, forward: bool = True, fp8_weights: Optional[bool] = None) -> None:
        """What the outermost fp8_autocast exit does for the forward state here (amax reduction
        over the modules' groups, then the delayed-scaling update) for the modules that ran an FP8
        forward in the region in force; backward scales are updated in each module's backward,
        so forward=False has nothing to do."""
        if not forward:
            return
        st = _fp8.FP8GlobalState
        pending, st.pending = st.pending, {}
        _fp8.reduce_amaxes(pending)
        for meta in pending:
            meta.update("fwd")
