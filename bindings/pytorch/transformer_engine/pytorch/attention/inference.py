"""TE 2.x's import path transformer_engine.pytorch.attention.inference (the code: ../inference.py)."""
from ..inference import (InferenceParams, KVCacheManager, NonPagedKVCacheManager,  # noqa: F401
                         PagedKVCacheManager)

__all__ = ["InferenceParams", "KVCacheManager", "NonPagedKVCacheManager", "PagedKVCacheManager"]
