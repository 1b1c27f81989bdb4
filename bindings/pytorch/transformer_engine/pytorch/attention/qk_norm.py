"""MultiheadAttention's query / key normalization (TE's qk_norm_type): each head's vector of
queries and keys normalized over the head dimension before attention.

  "RMSNorm" / "LayerNorm": te.RMSNorm / te.LayerNorm over the head size, one module for the
      queries and one for the keys (parameters `q_norm.weight`, `k_norm.weight`, and `.bias` for
      LayerNorm, as TE names them; in the default dtype, as TE builds them);
  "L2Normalization": y = x / sqrt(sum(x^2) + eps), parameter-free (one instance for both).
The normalized tensors keep the input's dtype (the norms compute in their parameters' dtype)."""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from ..module.layernorm import LayerNorm, RMSNorm, rmsnorm_fn

__all__ = ["L2Normalization", "make_qk_norms", "QK_NORM_TYPES"]

QK_NORM_TYPES = ("L2Normalization", "RMSNorm", "LayerNorm")


class L2Normalization(torch.nn.Module):
    """y = x / sqrt(sum(x^2) + eps) over the last dimension, through the library's RMSNorm: the
    same value as x / sqrt(mean(x^2) + eps / d) * d^-1/2, i.e. RMSNorm with eps / d and a constant
    gain of d^-1/2 (float32, so no rounding of the gain; no gradient flows to it)."""

    def __init__(self, eps: float = 1e-6, seq_length: Optional[int] = None, micro_batch_size: Optional[int] = None):
        super().__init__()  # (seq_length / micro_batch_size: TE's JIT warm-up sizes, unused here)
        self.eps = float(eps)
        self._gain = {}  # (d, device) -> float32 [d] of d^-1/2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1]
        key = (d, x.device)
        gain = self._gain.get(key)
        if gain is None:
            gain = self._gain[key] = torch.full((d,), 1.0 / math.sqrt(d), dtype=torch.float32, device=x.device)
        rows = x.reshape(-1, d).to(torch.float32).contiguous()
        return rmsnorm_fn(rows, gain, self.eps / d, False).to(x.dtype).view(x.shape)


def make_qk_norms(qk_norm_type: Optional[str], head_dim: int, eps: float, device,
                  seq_length=None, micro_batch_size=None) -> Tuple[Optional[torch.nn.Module], Optional[torch.nn.Module]]:
    """(q_norm, k_norm) modules of TE's qk_norm_type (None: none)."""
    if qk_norm_type is None:
        return None, None
    if qk_norm_type == "L2Normalization":
        norm = L2Normalization(eps, seq_length, micro_batch_size)
        return norm, norm
    if qk_norm_type in ("RMSNorm", "LayerNorm"):
        cls = RMSNorm if qk_norm_type == "RMSNorm" else LayerNorm
        return cls(head_dim, eps=eps, device=device), cls(head_dim, eps=eps, device=device)
    raise ValueError(f"MultiheadAttention: qk_norm_type must be None or one of {list(QK_NORM_TYPES)}, "
                     f"got {qk_norm_type!r}")


def apply_qk_norm(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """norm(x) in x's dtype."""
    y = norm(x)
    return y if y.dtype == x.dtype else y.to(x.dtype)
