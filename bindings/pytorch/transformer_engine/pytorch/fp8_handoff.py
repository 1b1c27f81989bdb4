"""The FP8 hand-off buffer: how an FP8 activation (or gradient) passes from one module's autograd
function to the next under the recipe's fp8_mha, without a high-precision copy.

fp8_mha (DelayedScaling) keeps the tensors around DotProductAttention in FP8: the QKV projection's
GEMM writes its output in FP8, attention reads those bytes as Q, K, V, its FP8 output O is the
output projection's GEMM input, and in backward the output projection's dgrad GEMM writes dO in
FP8, attention's dQ, dK, dV (FP8) are the QKV projection's output gradient. Each of these crosses
an autograd edge, so it must be one differentiable tensor whose gradient is again one tensor of
the same shape and dtype, and it must carry the FP8 bytes *and* their scale_inv (a plain uint8
tensor cannot be differentiable, and a separate scale_inv tensor has no way back with the
gradient). A tensor subclass would do it too, but torch.compile (fullgraph) does not trace the
adapter's Float8Tensor; plain tensors trace as they are.

So an FP8 tensor of logical shape [rows, cols] crosses as one float32 1-D tensor, the hand-off:

    words = ceil(rows * cols / 4) + 1
    bytes [0, rows * cols)     the FP8 data, row-major (uint8 view of the float32 storage)
    bytes up to 4 * (words-1)  padding (never read)
    element words - 1          scale_inv (float32: the value the data is multiplied by to decode)

The float32 dtype is only a container that autograd accepts: nothing computes with these values
(the modules' autograd functions pass them between the library calls, which see the uint8 view
and the scale_inv element through data_ptr). The FP8 format (E4M3 forward, the recipe's backward
format for gradients) is implied by the direction, as the recipe fixes it. The gradient of a
hand-off is a hand-off of the same shape (the same rows and cols, so the same words), holding the
gradient's FP8 bytes and scale_inv. A hand-off is used by exactly one consumer (the next module
inside MultiheadAttention), so autograd never adds two of them. Its float32 view has a NaN only
where an FP8 byte is NaN (the high byte of a word would have to be 0x7F or 0xFF), so anomaly mode
reports what it would report for the decoded values.
"""
from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor

__all__ = ["handoff_words", "new_handoff", "handoff_parts", "is_handoff"]


def handoff_words(rows: int, cols: int) -> int:
    """Number of float32 elements of the hand-off of an FP8 [rows, cols] tensor."""
    return (rows * cols + 3) // 4 + 1


def new_handoff(rows: int, cols: int, device) -> Tensor:
    """A hand-off for FP8 [rows, cols] whose data and scale_inv are still to be written (by the
    library, or by copies); the padding bytes, if any, are zero."""
    h = torch.empty(handoff_words(rows, cols), dtype=torch.float32, device=device)
    if (rows * cols) % 4:
        h[-2:-1].zero_()  # the last data word holds padding: zero, never a NaN pattern
    return h


def handoff_parts(h: Tensor, rows: int, cols: int) -> Tuple[Tensor, Tensor]:
    """(data uint8 [rows, cols], scale_inv float32 [1]): views into the hand-off h."""
    if h.dtype != torch.float32 or h.dim() != 1 or h.shape[0] != handoff_words(rows, cols):
        raise ValueError(f"not an FP8 hand-off of [{rows}, {cols}]: got {h.dtype} {tuple(h.shape)}, expected float32 "
                         f"[{handoff_words(rows, cols)}]")
    data = h[:-1].view(torch.uint8)[:rows * cols].view(rows, cols)
    return data, h[-1:]


def is_handoff(h: Tensor, rows: int, cols: int) -> bool:
    return h.dtype == torch.float32 and h.dim() == 1 and h.shape[0] == handoff_words(rows, cols)
