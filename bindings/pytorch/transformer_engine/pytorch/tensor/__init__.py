"""Tensor types of the PyTorch adapter (FP8 parameters of quantized_model_init).

QuantizedTensor: TE's base class of its quantized tensors. Float8Tensor is this adapter's only
one, so the name refers to it: `isinstance(p, QuantizedTensor)` (as Megatron-LM tests FP8
parameters) holds exactly for FP8 parameters."""
from .float8_tensor import Float8Tensor, WeightQuantizer

QuantizedTensor = Float8Tensor

__all__ = ["Float8Tensor", "QuantizedTensor", "WeightQuantizer"]
