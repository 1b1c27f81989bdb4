"""TE 2.x's import paths transformer_engine.pytorch.attention.dot_product_attention and its
.dot_product_attention module (the class is defined in the attention package's __init__)."""
from .. import DotProductAttention  # noqa: F401

__all__ = ["DotProductAttention"]
