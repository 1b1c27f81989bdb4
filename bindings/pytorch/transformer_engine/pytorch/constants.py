"""transformer_engine.pytorch.constants: TE's Python DType enum, under TE's name.

The newest TE releases keep a Float8Tensor's FP8 format as this IntEnum and so pickle it as
`transformer_engine.pytorch.constants.DType(int)`; this module lets such checkpoints load
(tensor/te_checkpoint.py). The values are this package's DType numbering
(include/transformer_engine/transformer_engine.h), which is TE's numbering with kInt16."""
import enum

__all__ = ["DType"]


class DType(enum.IntEnum):
    """TE's DType tags, by value (int(DType.kFloat8E4M3) == int(_ops.DType.kFloat8E4M3))."""

    kByte = 0
    kInt16 = 1
    kInt32 = 2
    kInt64 = 3
    kFloat32 = 4
    kFloat16 = 5
    kBFloat16 = 6
    kFloat8E4M3 = 7
    kFloat8E5M2 = 8
    kFloat8E8M0 = 9
    kFloat4E2M1 = 10
