"""FP8 recipes: which formats to use and how scaling factors are chosen.

These are plain configuration objects (framework-neutral). The scale arithmetic
itself lives in the C library (nvte_delayed_scaling_recipe_amax_and_scale_update,
nvte_compute_amax, nvte_compute_scale_from_amax), which every adapter calls.
Names, arguments and defaults follow Transformer Engine 2.x.
"""
from __future__ import annotations

import dataclasses
import os
from enum import Enum
from typing import Callable, NamedTuple, Optional, Union

__all__ = [
    "Format", "Recipe", "DelayedScaling", "Float8CurrentScaling", "MXFP8BlockScaling",
    "Float8BlockScaling", "MMParams", "QParams",
]


class _FormatHelper(NamedTuple):
    """Largest finite value of the forward and backward FP8 formats."""

    max_fwd: float
    max_bwd: float


class Format(Enum):
    """FP8 formats. HYBRID: E4M3 in the forward pass, E5M2 for gradients."""

    E4M3 = _FormatHelper(max_fwd=448.0, max_bwd=448.0)
    E5M2 = _FormatHelper(max_fwd=57344.0, max_bwd=57344.0)
    HYBRID = _FormatHelper(max_fwd=448.0, max_bwd=57344.0)


@dataclasses.dataclass(frozen=True)
class MMParams:
    """GEMM options for one of fprop/dgrad/wgrad."""

    use_split_accumulator: bool = True


@dataclasses.dataclass(frozen=True)
class QParams:
    """Quantization options for current scaling."""

    power_2_scale: bool = False
    amax_epsilon: float = 0.0


class Recipe:
    """Base class of recipes; the predicates tell adapters which one they hold (class methods, as
    in TE: `DelayedScaling.delayed()` works on the class too)."""

    @classmethod
    def delayed(cls) -> bool:
        return issubclass(cls, DelayedScaling)

    @classmethod
    def float8_current_scaling(cls) -> bool:
        return issubclass(cls, Float8CurrentScaling)

    @classmethod
    def mxfp8(cls) -> bool:
        return issubclass(cls, MXFP8BlockScaling)

    @classmethod
    def float8_block_scaling(cls) -> bool:
        return issubclass(cls, Float8BlockScaling)

    @classmethod
    def float8_per_tensor_scaling(cls) -> bool:
        return cls.delayed() or cls.float8_current_scaling()

    @classmethod
    def nvfp4(cls) -> bool:
        return False


def _check_format(fmt, allowed, name):
    if not isinstance(fmt, Format):
        raise TypeError(f"{name}: fp8_format must be a recipe.Format, got {fmt!r}")
    if fmt not in allowed:
        raise ValueError(f"{name}: fp8_format {fmt.name} is not supported; use one of "
                         f"{[f.name for f in allowed]}")


@dataclasses.dataclass
class DelayedScaling(Recipe):
    """Per-tensor scales derived from a history of amax values of earlier steps.

    scale = fp8_max / amax / 2**margin, amax = max of the last `amax_history_len` amaxes
    ("max") or the latest one ("most_recent"), or a callable on the history.
    """

    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: Union[str, Callable] = "max"
    scaling_factor_compute_algo: Optional[Callable] = None
    reduce_amax: bool = True
    fp8_dpa: bool = False
    fp8_mha: bool = False

    def __post_init__(self):
        _check_format(self.fp8_format, (Format.E4M3, Format.HYBRID, Format.E5M2), "DelayedScaling")
        if not isinstance(self.amax_history_len, int) or self.amax_history_len < 1:
            raise ValueError(f"DelayedScaling: amax_history_len must be a positive int, got {self.amax_history_len!r}")
        if isinstance(self.amax_compute_algo, str) and self.amax_compute_algo not in ("max", "most_recent"):
            raise ValueError(f"DelayedScaling: amax_compute_algo must be 'max', 'most_recent' or a callable, "
                             f"got {self.amax_compute_algo!r}")
        if self.margin < 0:
            raise ValueError(f"DelayedScaling: margin must be >= 0, got {self.margin}")

    def __repr__(self):
        return (f"recipe_type=DelayedScaling, margin={self.margin}, format={self.fp8_format.name}, "
                f"amax_history_len={self.amax_history_len}, amax_compute_algo={self.amax_compute_algo}, "
                f"reduce_amax={self.reduce_amax}, fp8_dpa={self.fp8_dpa}, fp8_mha={self.fp8_mha}")


# TE reads this once, at import
_POW2_DEFAULT = os.getenv("NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES", "0") == "1"


@dataclasses.dataclass
class Float8CurrentScaling(Recipe):
    """Per-tensor scales computed from the tensor being cast (amax of this very step).
    use_power_2_scales and the QParams' power_2_scale default to TE's environment variable
    NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES=1, read when this module is imported (as TE does); the
    casts follow the QParams."""

    use_power_2_scales: bool = _POW2_DEFAULT
    fp8_format: Format = Format.HYBRID
    fp8_quant_fwd_inp: QParams = QParams(power_2_scale=_POW2_DEFAULT)
    fp8_quant_fwd_weight: QParams = QParams(power_2_scale=_POW2_DEFAULT)
    fp8_quant_bwd_grad: QParams = QParams(power_2_scale=_POW2_DEFAULT)
    fp8_gemm_fprop: MMParams = MMParams(use_split_accumulator=False)
    fp8_gemm_dgrad: MMParams = MMParams(use_split_accumulator=True)
    fp8_gemm_wgrad: MMParams = MMParams(use_split_accumulator=True)
    fp8_dpa: bool = False
    fp8_mha: bool = False

    def __post_init__(self):
        _check_format(self.fp8_format, (Format.E4M3, Format.HYBRID), "Float8CurrentScaling")


@dataclasses.dataclass
class MXFP8BlockScaling(Recipe):
    """MXFP8 (32-element blocks, E8M0 scales). Configuration only: the kernels do not support it yet."""

    fp8_format: Format = Format.E4M3
    fp8_dpa: bool = False
    fp8_mha: bool = False


@dataclasses.dataclass
class Float8BlockScaling(Recipe):
    """128-element block scaling. Configuration only: the kernels do not support it yet."""

    fp8_format: Format = Format.E4M3
    fp8_dpa: bool = False
    fp8_mha: bool = False
