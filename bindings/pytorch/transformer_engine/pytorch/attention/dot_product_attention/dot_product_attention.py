"""TE 2.x's import path transformer_engine.pytorch.attention.dot_product_attention.dot_product_attention."""
from ... import attention as _attention

DotProductAttention = _attention.DotProductAttention

__all__ = ["DotProductAttention"]
