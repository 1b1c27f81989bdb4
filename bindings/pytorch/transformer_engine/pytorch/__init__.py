"""transformer_engine.pytorch: TE modules and FP8 autocast for PyTorch, over the C library.

The adapter holds no numerics of its own: every cast, GEMM, norm and scale update is one call
into libtransformer_engine (through transformer_engine._nvte), on the CPU backend for CPU
tensors and on the CUDA backend for CUDA tensors."""
from .fp8 import (autocast, fp8_autocast, fp8_model_init, get_default_recipe, is_fp8_available, quantized_model_init)
from .availability import is_bf16_available, is_fp8_block_scaling_available, is_mxfp8_available, is_nvfp4_available
from .module import GroupedLinear, LayerNorm, LayerNormLinear, LayerNormMLP, Linear, RMSNorm, TransformerEngineBaseModule
from .attention import DotProductAttention, MultiheadAttention
from .inference import InferenceParams
from .rope import RotaryPositionEmbedding, apply_rotary_pos_emb
from . import transformer
from .transformer import TransformerLayer
from . import distributed
from .distributed import CudaRNGStatesTracker, checkpoint
from .graph import make_graphed_callables
from .tensor import Float8Tensor, QuantizedTensor

__all__ = ["Linear", "GroupedLinear", "LayerNorm", "RMSNorm", "LayerNormLinear", "LayerNormMLP", "TransformerEngineBaseModule",
           "TransformerLayer", "DotProductAttention", "MultiheadAttention", "InferenceParams",
           "RotaryPositionEmbedding", "apply_rotary_pos_emb",
           "fp8_autocast", "autocast", "is_fp8_available", "fp8_model_init", "quantized_model_init", "checkpoint",
           "get_default_recipe", "is_bf16_available", "is_mxfp8_available", "is_fp8_block_scaling_available",
           "is_nvfp4_available", "Float8Tensor", "QuantizedTensor",
           "CudaRNGStatesTracker",
           "distributed", "make_graphed_callables"]
