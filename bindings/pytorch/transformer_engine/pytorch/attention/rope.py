"""TE 2.x's import path transformer_engine.pytorch.attention.rope (the code: ../rope.py)."""
from ..rope import RotaryPositionEmbedding, apply_rotary_pos_emb  # noqa: F401

__all__ = ["RotaryPositionEmbedding", "apply_rotary_pos_emb"]
