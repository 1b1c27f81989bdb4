"""TE 2.x's "is X available here" queries (te.is_*_available(return_reason=False): a bool, or
(available, reason)). FP8 per-tensor scaling lives in fp8.py; the block-scaled recipes (MXFP8,
Float8BlockScaling, NVFP4) are not implemented by this library, so they are reported unavailable
with that reason, whatever the GPU."""
from __future__ import annotations

from typing import Tuple, Union

import torch

__all__ = ["is_bf16_available", "is_mxfp8_available", "is_fp8_block_scaling_available", "is_nvfp4_available"]

_NOT_IMPLEMENTED = "{what} is not implemented in this library (DelayedScaling and Float8CurrentScaling are)"


def _answer(ok: bool, reason: str, return_reason: bool) -> Union[bool, Tuple[bool, str]]:
    return (ok, reason) if return_reason else ok


def is_bf16_available(return_reason: bool = False) -> Union[bool, Tuple[bool, str]]:
    """BF16 compute: a CUDA device of compute capability 8.0 or newer, or the CPU backend (no CUDA)."""
    if not torch.cuda.is_available():
        return _answer(True, "no CUDA device: BF16 runs on the CPU backend", return_reason)
    major, minor = torch.cuda.get_device_capability()
    ok = major >= 8
    return _answer(ok, "" if ok else f"BF16 needs compute capability 8.0 or newer (found {major}.{minor})",
                   return_reason)


def is_mxfp8_available(return_reason: bool = False) -> Union[bool, Tuple[bool, str]]:
    return _answer(False, _NOT_IMPLEMENTED.format(what="MXFP8BlockScaling"), return_reason)


def is_fp8_block_scaling_available(return_reason: bool = False) -> Union[bool, Tuple[bool, str]]:
    return _answer(False, _NOT_IMPLEMENTED.format(what="Float8BlockScaling"), return_reason)


def is_nvfp4_available(return_reason: bool = False) -> Union[bool, Tuple[bool, str]]:
    return _answer(False, _NOT_IMPLEMENTED.format(what="NVFP4BlockScaling"), return_reason)
