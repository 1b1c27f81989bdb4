"""TE 2.x's import path transformer_engine.pytorch.attention.dot_product_attention (the class is
defined in this package's __init__)."""
from . import DotProductAttention  # noqa: F401

__all__ = ["DotProductAttention"]
