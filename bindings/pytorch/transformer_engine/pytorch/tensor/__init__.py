"""Tensor types of the PyTorch adapter (FP8 parameters of quantized_model_init)."""
from .float8_tensor import Float8Tensor, WeightQuantizer

__all__ = ["Float8Tensor", "WeightQuantizer"]
