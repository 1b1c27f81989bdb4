"""te.TransformerLayer: one pre-norm transformer block built from TE modules.

    x  -> self_attention (its own input norm)  -> dropout -> drop_path -> + residual
       -> [decoder: inter_attention over encoder_output, the same step without drop_path, as in TE]
       -> layernorm_mlp (its own input norm)   -> dropout -> drop_path -> + residual
       -> [output_layernorm: layernorm]

The attention and MLP numerics live in MultiheadAttention and LayerNormMLP (library calls); the
residual additions, dropout and drop-path here are plain torch ops, so they follow torch.no_grad(),
module.train()/eval() and torch.autocast like any other PyTorch code.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from .module import LayerNorm, LayerNormMLP, RMSNorm
from .module.base import default_init_method, reset_fp8_meta_tensors, set_tensor_parallel_group
from .module.linear import check_kwargs, check_unsupported

try:  # written alongside this module; TransformerLayer needs it only when it is built
    from .attention import MultiheadAttention
except ModuleNotFoundError as _err:  # pragma: no cover - only while attention/ does not exist
    if _err.name != __name__.rsplit(".", 1)[0] + ".attention":
        raise
    MultiheadAttention = None

__all__ = ["TransformerLayer", "DropPath"]

_LAYER_TYPES = ("encoder", "decoder")
_INPUT_FORMATS = ("sbhd", "bshd", "thd")


class DropPath(torch.nn.Module):
    """Stochastic depth: in training, zeroes whole slices along `batch_dim` with probability
    `drop_prob` and rescales the kept ones by 1 / (1 - drop_prob). TE's DropPath draws along dim 0
    (the default; for its TransformerLayer that is the sequence of an sbhd input, which TE keeps)."""

    def __init__(self, drop_prob: float = 0.0, batch_dim: int = 0):
        super().__init__()
        if not 0.0 <= drop_prob < 1.0:
            raise ValueError(f"DropPath: drop_prob must be in [0, 1), got {drop_prob}")
        self.drop_prob, self.batch_dim = float(drop_prob), int(batch_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.drop_prob == 0.0 or not self.training:
            return x
        keep = 1.0 - self.drop_prob
        shape = [1] * x.dim()
        shape[self.batch_dim] = x.shape[self.batch_dim]
        mask = torch.empty(shape, dtype=x.dtype, device=x.device).bernoulli_(keep)
        return x * mask / keep


def _split_ln_output(res):
    """(output, layernorm output or None) from a module that may return a tuple."""
    if isinstance(res, (tuple, list)):
        return res[0], (res[-1] if len(res) > 1 else None)
    return res, None


# TE constructor arguments handed to both MultiheadAttentions as they are (MultiheadAttention raises
# for the QK norm, which it does not implement)
_MHA_ARGS = ("rotary_pos_interleaved", "qk_norm_type", "qk_norm_eps", "qk_norm_before_rope")
# TE constructor arguments that cannot change a result here: a kernel-fusion choice
_NOOP_ARGS = ("bias_dropout_fusion",)
# the other TE 2.x constructor arguments outside the signature below (accepted when unset; ub_* at
# tp_size 1, where TE's defaults of True change nothing)
_TE_KWARGS = frozenset(_MHA_ARGS + _NOOP_ARGS + (
    "bottom_right_diagonal", "enc_dec_bottom_right_diagonal", "activation_params", "ub_tp_comm_overlap",
    "ub_overlap_ag", "ub_overlap_rs", "ub_overlap_rs_dgrad", "ub_bulk_dgrad", "ub_bulk_wgrad"))
# TE 2.x forward arguments outside forward's signature (the attention ones go to self_attention, the
# shared ones to the cross attention too)
_TE_FORWARD_KWARGS = frozenset((
    "bottom_right_diagonal", "enc_dec_bottom_right_diagonal", "checkpoint_core_attention", "alibi_slopes",
    "cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded", "max_seqlen_q",
    "max_seqlen_kv", "fast_zero_fill", "pad_between_seqs"))


class TransformerLayer(torch.nn.Module):
    """A transformer encoder (or decoder) layer with TE's constructor and submodule names:
    `self_attention` (MultiheadAttention with its input norm, submodules layernorm_qkv / proj),
    `inter_attention` (layer_type="decoder": cross attention over encoder_output), `layernorm_mlp`
    (LayerNormMLP) and `layernorm` (output_layernorm=True).

    Inputs are [seq, batch, hidden] (attn_input_format="sbhd", the default), [batch, seq, hidden]
    ("bshd") or packed sequences [tokens, hidden] ("thd", with cu_seqlens_q / cu_seqlens_kv or
    inference_params, as MultiheadAttention takes them; TE's docstring lists only the first two,
    but TE hands the format to its attention unchecked and its KV-cache test builds "thd" layers).
    hidden_dropout applies to each block's output before the residual addition, attention_dropout
    to the attention probabilities. With output_layernorm=True the attention block gets no input
    norm and the layer's output is normalised instead (post-norm)."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int, num_attention_heads: int,
                 num_gqa_groups: Optional[int] = None, layernorm_epsilon: float = 1e-5, hidden_dropout: float = 0.1,
                 attention_dropout: float = 0.1, init_method: Optional[Callable] = None,
                 output_layer_init_method: Optional[Callable] = None, layer_number: Optional[int] = None,
                 kv_channels: Optional[int] = None, self_attn_mask_type: str = "causal", window_size=None,
                 enc_dec_attn_mask_type: str = "no_mask", enc_dec_window_size=None, tp_group=None, tp_size: int = 1,
                 params_dtype: Optional[torch.dtype] = None, get_rng_state_tracker: Optional[Callable] = None,
                 fuse_wgrad_accumulation: bool = False, seq_length: Optional[int] = None,
                 micro_batch_size: Optional[int] = None, sequence_parallel: bool = False,
                 apply_residual_connection_post_layernorm: bool = False, output_layernorm: bool = False,
                 layer_type: str = "encoder", drop_path_rate: float = 0.0, set_parallel_mode: bool = False,
                 fuse_qkv_params: bool = False, zero_centered_gamma: bool = False,
                 qkv_weight_interleaved: bool = True, bias: bool = True, activation: str = "gelu",
                 normalization: str = "LayerNorm", device=None, attn_input_format: str = "sbhd",
                 name: Optional[str] = None, softmax_type: str = "vanilla", parallel_attention_mlp: bool = False,
                 **kwargs):
        super().__init__()
        check_kwargs("TransformerLayer.__init__", _TE_KWARGS, kwargs)
        mha_extra = {k: kwargs.pop(k) for k in _MHA_ARGS if k in kwargs}
        # the defaults of forward's arguments of the same names (checked by DotProductAttention)
        self.bottom_right_diagonal = kwargs.pop("bottom_right_diagonal", None)
        self.enc_dec_bottom_right_diagonal = kwargs.pop("enc_dec_bottom_right_diagonal", None)
        for k in _NOOP_ARGS:
            kwargs.pop(k, None)
        # every other TE option (userbuffer overlaps aside: see check_unsupported) raises when set:
        # ignoring it would change the layer silently
        # sequence_parallel and set_parallel_mode act with tensor parallelism only (TE: sequence
        # parallelism is on when tp_size > 1 and it is set): with tp_size 1 they change nothing
        check_unsupported("TransformerLayer", tp_size, **kwargs)
        self.sequence_parallel, self.set_parallel_mode = bool(sequence_parallel), bool(set_parallel_mode)
        if parallel_attention_mlp and (layer_type == "decoder" or apply_residual_connection_post_layernorm):
            raise NotImplementedError("TransformerLayer: parallel_attention_mlp is implemented for encoder layers "
                                      "without apply_residual_connection_post_layernorm")
        if MultiheadAttention is None:
            raise NotImplementedError("TransformerLayer needs transformer_engine.pytorch.attention.MultiheadAttention, "
                                      "which this build does not provide")
        if layer_type not in _LAYER_TYPES:
            raise ValueError(f"TransformerLayer: layer_type must be one of {_LAYER_TYPES}, got {layer_type!r}")
        if attn_input_format not in _INPUT_FORMATS:
            raise ValueError(f"TransformerLayer: attn_input_format must be one of {_INPUT_FORMATS}, "
                             f"got {attn_input_format!r}")
        for n, p in (("hidden_dropout", hidden_dropout), ("attention_dropout", attention_dropout)):
            if not 0.0 <= p <= 1.0:
                raise ValueError(f"TransformerLayer: {n} must be in [0, 1], got {p}")
        self.hidden_size, self.ffn_hidden_size = int(hidden_size), int(ffn_hidden_size)
        self.num_attention_heads = int(num_attention_heads)
        self.kv_channels = int(kv_channels) if kv_channels is not None else hidden_size // num_attention_heads
        self.layer_type, self.layer_number = layer_type, layer_number
        self.self_attn_mask_type, self.window_size = self_attn_mask_type, window_size
        self.enc_dec_attn_mask_type, self.enc_dec_window_size = enc_dec_attn_mask_type, enc_dec_window_size
        self.hidden_dropout = float(hidden_dropout)
        self.apply_residual_connection_post_layernorm = bool(apply_residual_connection_post_layernorm)
        self.parallel_attention_mlp = bool(parallel_attention_mlp)
        self.output_layernorm = bool(output_layernorm)
        self.attn_input_format, self.name = attn_input_format, name
        init_method = init_method if init_method is not None else default_init_method()
        output_layer_init_method = output_layer_init_method if output_layer_init_method is not None \
            else default_init_method()

        attn_args = dict(kv_channels=self.kv_channels, attention_dropout=attention_dropout,
                         layernorm_epsilon=layernorm_epsilon, init_method=init_method,
                         output_layer_init_method=output_layer_init_method, layer_number=layer_number,
                         num_gqa_groups=num_gqa_groups,
                         return_layernorm_output=self.apply_residual_connection_post_layernorm,
                         input_layernorm=not self.output_layernorm, zero_centered_gamma=zero_centered_gamma,
                         qkv_weight_interleaved=qkv_weight_interleaved, bias=bias, normalization=normalization,
                         device=device, qkv_format=attn_input_format, params_dtype=params_dtype,
                         fuse_qkv_params=fuse_qkv_params, softmax_type=softmax_type,
                         get_rng_state_tracker=get_rng_state_tracker,
                         fuse_wgrad_accumulation=fuse_wgrad_accumulation, **mha_extra)
        self.self_attention = MultiheadAttention(hidden_size, num_attention_heads, attn_mask_type=self_attn_mask_type,
                                                 window_size=window_size, attention_type="self", **attn_args)
        if layer_type == "decoder":  # (its input norm stays with output_layernorm too, as in TE)
            attn_args["input_layernorm"] = True
            self.inter_attention = MultiheadAttention(hidden_size, num_attention_heads,
                                                      attn_mask_type=enc_dec_attn_mask_type,
                                                      window_size=enc_dec_window_size, attention_type="cross",
                                                      **attn_args)
        self.layernorm_mlp = LayerNormMLP(hidden_size, ffn_hidden_size, eps=layernorm_epsilon, init_method=init_method,
                                          bias=bias, normalization=normalization, activation=activation,
                                          output_layer_init_method=output_layer_init_method,
                                          params_dtype=params_dtype,
                                          return_layernorm_output=self.apply_residual_connection_post_layernorm,
                                          zero_centered_gamma=zero_centered_gamma, device=device,
                                          get_rng_state_tracker=get_rng_state_tracker,
                                          fuse_wgrad_accumulation=fuse_wgrad_accumulation)
        self.drop_path = DropPath(drop_path_rate) if drop_path_rate > 0.0 else None  # (dim 0, as TE)
        if self.output_layernorm:
            norm_cls = LayerNorm if normalization == "LayerNorm" else RMSNorm
            self.layernorm = norm_cls(hidden_size, eps=layernorm_epsilon, params_dtype=params_dtype,
                                      zero_centered_gamma=zero_centered_gamma, device=device)

    # ---------------------------------------------------------------- helpers
    def set_tensor_parallel_group(self, tp_group) -> None:
        """TE's: the tensor-parallel group of the submodules (one rank, or None, is implemented)."""
        set_tensor_parallel_group(self, tp_group)

    def reset_fp8_meta_tensors(self) -> None:
        """TE's: fresh FP8 state (zero amax histories, unit scales) in every submodule."""
        reset_fp8_meta_tensors(self)

    def set_context_parallel_group(self, cp_group, cp_global_ranks=None, cp_stream=None,
                                   cp_comm_type: str = "p2p") -> None:
        """Context parallelism of the layer's attention (DotProductAttention.set_context_parallel_group)."""
        for m in (self.self_attention, getattr(self, "inter_attention", None)):
            if m is not None:
                m.set_context_parallel_group(cp_group, cp_global_ranks, cp_stream, cp_comm_type)

    def _residual(self, out: torch.Tensor, residual: torch.Tensor, drop_path: bool = True) -> torch.Tensor:
        """residual + drop_path(dropout(out)), in plain torch ops (TE drops no cross-attention path)."""
        out = torch.nn.functional.dropout(out, p=self.hidden_dropout, training=self.training)
        if drop_path and self.drop_path is not None:
            out = self.drop_path(out)
        return residual + out

    _SHARED_ATTN_ARGS = ("alibi_slopes", "checkpoint_core_attention", "fast_zero_fill")

    @staticmethod
    def _attn_kwargs(**kw):
        """Optional attention arguments, passed on only when given."""
        return {k: v for k, v in kw.items() if v is not None}

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                self_attn_mask_type: Optional[str] = None, window_size=None,
                encoder_output: Optional[torch.Tensor] = None, enc_dec_attn_mask: Optional[torch.Tensor] = None,
                enc_dec_attn_mask_type: Optional[str] = None, enc_dec_window_size=None,
                is_first_microbatch: Optional[bool] = None, inference_params=None, rotary_pos_emb=None,
                core_attention_bias_type: str = "no_bias", core_attention_bias: Optional[torch.Tensor] = None,
                **kwargs) -> torch.Tensor:
        check_kwargs("TransformerLayer.forward", _TE_FORWARD_KWARGS, kwargs)
        brd = kwargs.pop("bottom_right_diagonal", None)
        brd = self.bottom_right_diagonal if brd is None else brd
        enc_dec_brd = kwargs.pop("enc_dec_bottom_right_diagonal", None)
        enc_dec_brd = self.enc_dec_bottom_right_diagonal if enc_dec_brd is None else enc_dec_brd
        if not isinstance(hidden_states, torch.Tensor):
            raise TypeError(f"TransformerLayer: hidden_states must be a torch.Tensor, "
                            f"got {type(hidden_states).__name__}")
        rank = 2 if self.attn_input_format == "thd" else 3
        if hidden_states.dim() != rank or hidden_states.shape[-1] != self.hidden_size:
            raise ValueError(f"TransformerLayer: hidden_states must be {rank}D with last dimension {self.hidden_size} "
                             f"({self.attn_input_format}), got shape {tuple(hidden_states.shape)}")
        if self.layer_type == "decoder" and encoder_output is None:
            raise ValueError("TransformerLayer: layer_type='decoder' needs encoder_output")
        if torch.is_autocast_enabled(hidden_states.device.type):  # (TE: the residual stream in autocast's dtype)
            dt = torch.get_autocast_dtype(hidden_states.device.type)
            if hidden_states.dtype != dt and hidden_states.is_floating_point():
                hidden_states = hidden_states.to(dt)
        mask_type = self_attn_mask_type if self_attn_mask_type is not None else self.self_attn_mask_type
        # the attention bias (and ALiBi, checkpointing, zero fill) goes to both attentions, as in TE
        shared = self._attn_kwargs(core_attention_bias_type=core_attention_bias_type,
                                   core_attention_bias=core_attention_bias, is_first_microbatch=is_first_microbatch,
                                   **{k: kwargs[k] for k in self._SHARED_ATTN_ARGS if k in kwargs})
        extra = self._attn_kwargs(window_size=window_size, inference_params=inference_params,
                                  rotary_pos_emb=rotary_pos_emb, bottom_right_diagonal=brd, **{**kwargs, **shared})

        res = self.self_attention(hidden_states, attention_mask=attention_mask, attn_mask_type=mask_type, **extra)
        attn_out, ln_out = _split_ln_output(res)
        if self.parallel_attention_mlp:  # attention and MLP on the same input, one dropout over their sum (TE)
            mlp_out, _ = _split_ln_output(self.layernorm_mlp(hidden_states, is_first_microbatch=is_first_microbatch))
            out = self._residual(attn_out + mlp_out, hidden_states)
            return self.layernorm(out) if self.output_layernorm else out
        residual = ln_out if self.apply_residual_connection_post_layernorm and ln_out is not None else hidden_states
        x = self._residual(attn_out, residual)

        if self.layer_type == "decoder":
            cross_type = enc_dec_attn_mask_type if enc_dec_attn_mask_type is not None else self.enc_dec_attn_mask_type
            extra_x = self._attn_kwargs(window_size=enc_dec_window_size, bottom_right_diagonal=enc_dec_brd, **shared)
            res = self.inter_attention(x, attention_mask=enc_dec_attn_mask, encoder_output=encoder_output,
                                       attn_mask_type=cross_type, **extra_x)
            cross_out, ln_out = _split_ln_output(res)
            residual = ln_out if self.apply_residual_connection_post_layernorm and ln_out is not None else x
            x = self._residual(cross_out, residual, drop_path=False)

        res = self.layernorm_mlp(x, is_first_microbatch=is_first_microbatch)
        mlp_out, ln_out = _split_ln_output(res)
        residual = ln_out if self.apply_residual_connection_post_layernorm and ln_out is not None else x
        out = self._residual(mlp_out, residual)

        if self.output_layernorm:
            out = self.layernorm(out)
        return out
