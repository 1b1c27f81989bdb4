"""TE 2.x's import path transformer_engine.pytorch.attention.multi_head_attention (the class is
defined in this package's __init__)."""
from . import MultiheadAttention  # noqa: F401

__all__ = ["MultiheadAttention"]
