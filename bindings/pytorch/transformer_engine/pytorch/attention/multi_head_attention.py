"""te.MultiheadAttention (TE 2.x's module transformer_engine.pytorch.attention.multi_head_attention):
the QKV projection (optionally with the input norm fused in), the core DotProductAttention (this
package's __init__) and the output projection. The QKV submodules take TE's parameter names
through parameters_split."""
from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch

from .. import custom_ops
from .. import attn_packing as _pk
from .. import dpa_fused as _df
from .. import fused_attention_fp8 as _fa8
from ..fp8_handoff import handoff_parts
from ..module.base import reset_fp8_meta_tensors, set_tensor_parallel_group
from ..module.layernorm_linear import LayerNormLinear
from ..module.linear import Linear, check_kwargs
from ..rope import apply_rotary_pos_emb
from .qk_norm import apply_qk_norm, make_qk_norms
from . import DotProductAttention, _check_forward_kwargs

__all__ = ["MultiheadAttention"]


# constructor arguments of TE's that cannot change a result: Megatron's JIT warm-up sizes
_MHA_INIT_NOOPS = ("seq_length", "micro_batch_size")
# TE 2.x constructor / forward arguments outside the signatures below (accepted when unset; ub_* at
# tp_size 1)
_TE_KWARGS = frozenset(_MHA_INIT_NOOPS + (
    "qk_norm_type", "qk_norm_eps", "qk_norm_before_rope", "ub_overlap_ag", "ub_overlap_rs", "ub_overlap_rs_dgrad",
    "ub_bulk_dgrad", "ub_bulk_wgrad"))
_TE_FORWARD_KWARGS = frozenset(("bottom_right_diagonal", "fp8_output"))


# ------------------------------------------------------------- MultiheadAttention
def _cover_padding_rows(freqs, params, fmt: str, x: torch.Tensor):
    """The RoPE table of a padded BSHD/SBHD K/V-cache step x: it must hold every cached token's
    position; the padding rows (of the step's shorter sequences, of the rows past its longest
    one, of a batch's empty rows) reach positions past what a table of the cache's length holds,
    and rotate by angle 0 there (zeros appended: their outputs are never read)."""
    tokens, rows = params.rope_rows(x.shape[1 if fmt == "bshd" else 0])
    if not isinstance(freqs, torch.Tensor) or freqs.dim() != 4:
        return freqs  # (apply_rotary_pos_emb reports it)
    if freqs.shape[0] < tokens:
        raise ValueError(f"MultiheadAttention: rotary_pos_emb has {freqs.shape[0]} positions; the K/V cache's "
                         f"sequences reach position {tokens - 1}")
    if freqs.shape[0] >= rows:
        return freqs
    return torch.cat([freqs, freqs.new_zeros((rows - freqs.shape[0], *freqs.shape[1:]))])


class MultiheadAttention(torch.nn.Module):
    """Multi-head attention: QKV projection (optionally with the input norm fused in), the core
    DotProductAttention, and the output projection `proj`.

    Submodules: self attention -> `layernorm_qkv` (input_layernorm=True, a LayerNormLinear) or `qkv`
    (a Linear); cross attention -> `layernorm_query` / `query_layer` plus `key_value`; then
    `core_attention` and `proj`. With fuse_qkv_params=False (default) the QKV submodule holds
    query_weight/key_weight/value_weight (+ _bias); with True one `weight`/`bias` whose rows are
    interleaved per GQA group [q heads of the group | k | v] when qkv_weight_interleaved, else
    blocked [all q | all k | all v].

    Under fp8_autocast with a DelayedScaling recipe whose fp8_mha is True (which implies fp8_dpa),
    the tensors between the projections and attention stay in FP8 (fp8_handoff.py): the QKV GEMM
    writes Q, K, V in FP8, attention reads them without a cast, O goes to the output projection's
    GEMM in FP8, and the gradients between them flow back in FP8. The module's outputs are the
    same high-precision tensors as without fp8_mha."""

    def __init__(self, hidden_size: int, num_attention_heads: int, kv_channels: Optional[int] = None,
                 attention_dropout: float = 0.1, layernorm_epsilon: float = 1e-5,
                 init_method: Optional[Callable] = None, output_layer_init_method: Optional[Callable] = None,
                 layer_number: Optional[int] = None, attn_mask_type: str = "causal",
                 window_size: Optional[Tuple[int, int]] = None, tp_group=None, tp_size: int = 1,
                 num_gqa_groups: Optional[int] = None, fuse_wgrad_accumulation: bool = False,
                 get_rng_state_tracker: Optional[Callable] = None, sequence_parallel: bool = False,
                 params_dtype: Optional[torch.dtype] = None, return_bias: bool = False,
                 return_layernorm_output: bool = False, input_layernorm: bool = False, attention_type: str = "self",
                 set_parallel_mode: bool = False, fuse_qkv_params: bool = False, zero_centered_gamma: bool = False,
                 qkv_weight_interleaved: bool = True, bias: bool = True, normalization: str = "LayerNorm",
                 device=None, qkv_format: str = "sbhd", name: Optional[str] = None,
                 softmax_scale: Optional[float] = None, rotary_pos_interleaved: bool = False,
                 softmax_type: str = "vanilla", **kwargs):
        super().__init__()
        check_kwargs("MultiheadAttention.__init__", _TE_KWARGS, kwargs)
        if tp_size != 1:
            raise NotImplementedError(f"MultiheadAttention: tensor parallelism (tp_size={tp_size}) is not implemented")
        warmup = {k: kwargs.pop(k, None) for k in _MHA_INIT_NOOPS}
        qk_norm_type = kwargs.pop("qk_norm_type", None)
        qk_norm_eps = float(kwargs.pop("qk_norm_eps", 1e-6))
        self.qk_norm_before_rope = bool(kwargs.pop("qk_norm_before_rope", False))
        on = [k for k, v in kwargs.items() if v and not k.startswith("ub_")]
        if on:
            raise NotImplementedError(f"MultiheadAttention: options not implemented in this adapter: {on}")
        if attention_type not in ("self", "cross"):
            raise ValueError(f"attention_type must be 'self' or 'cross', got {attention_type!r}")
        self.hidden_size = int(hidden_size)
        self.num_attention_heads = int(num_attention_heads)
        self.hidden_size_per_attention_head = (self.hidden_size // self.num_attention_heads if kv_channels is None
                                               else int(kv_channels))
        self.num_gqa_groups = self.num_attention_heads if num_gqa_groups is None else int(num_gqa_groups)
        if self.num_gqa_groups <= 0 or self.num_attention_heads % self.num_gqa_groups:
            raise ValueError(f"MultiheadAttention: num_attention_heads ({self.num_attention_heads}) must be a "
                             f"multiple of num_gqa_groups ({self.num_gqa_groups})")
        self.attention_type = attention_type
        self.attn_mask_type = DotProductAttention._check_mask_type(attn_mask_type)
        self.window_size = window_size
        self.layer_number = layer_number
        self.input_layernorm = bool(input_layernorm)
        self.return_layernorm_output = bool(return_layernorm_output)
        self.return_bias = bool(return_bias)
        self.fuse_qkv_params = bool(fuse_qkv_params)
        self.qkv_weight_interleaved = bool(qkv_weight_interleaved) and self.fuse_qkv_params
        self.qkv_format = DotProductAttention._check_format(qkv_format)
        self.rotary_pos_interleaved = bool(rotary_pos_interleaved)
        self.name = name

        kv = self.hidden_size_per_attention_head
        # TE's QK norm (qk_norm.py): after RoPE, or before it with qk_norm_before_rope
        self.q_norm, self.k_norm = make_qk_norms(qk_norm_type, kv, qk_norm_eps, device, *warmup.values())
        q_out = self.num_attention_heads * kv
        kv_out = self.num_gqa_groups * kv
        common = dict(init_method=init_method, bias=bias, params_dtype=params_dtype, device=device,
                      sequence_parallel=sequence_parallel, get_rng_state_tracker=get_rng_state_tracker,
                      fuse_wgrad_accumulation=fuse_wgrad_accumulation)
        ln_args = dict(eps=layernorm_epsilon, normalization=normalization, zero_centered_gamma=zero_centered_gamma,
                       return_layernorm_output=return_layernorm_output)

        def make(linear_cls, in_f, splits, **extra):
            out_f = sum(n for _, n in splits)
            split = None if self.fuse_qkv_params else dict(splits)
            return linear_cls(in_f, out_f, parameters_split=split, **common, **extra)

        if attention_type == "self":
            splits = [("query", q_out), ("key", kv_out), ("value", kv_out)]
            if self.input_layernorm:
                self.layernorm_qkv = make(LayerNormLinear, self.hidden_size, splits, **ln_args)
            else:
                self.qkv = make(Linear, self.hidden_size, splits)
        else:
            if self.input_layernorm:
                self.layernorm_query = make(LayerNormLinear, self.hidden_size, [("query", q_out)], **ln_args)
            else:
                # (TE's query_layer keeps one `weight`: no parameters_split there)
                self.query_layer = Linear(self.hidden_size, q_out, **common)
            self.key_value = make(Linear, self.hidden_size, [("key", kv_out), ("value", kv_out)])

        self.core_attention = DotProductAttention(
            self.num_attention_heads, kv, num_gqa_groups=self.num_gqa_groups, attention_dropout=attention_dropout,
            qkv_format=self.qkv_format, attn_mask_type=self.attn_mask_type, window_size=window_size,
            layer_number=layer_number, attention_type=attention_type, softmax_scale=softmax_scale,
            sequence_parallel=sequence_parallel, get_rng_state_tracker=get_rng_state_tracker, tp_group=tp_group,
            softmax_type=softmax_type)
        self.proj = Linear(q_out, self.hidden_size, init_method=output_layer_init_method, bias=bias,
                           return_bias=self.return_bias, params_dtype=params_dtype, device=device,
                           sequence_parallel=sequence_parallel, get_rng_state_tracker=get_rng_state_tracker,
                           fuse_wgrad_accumulation=fuse_wgrad_accumulation)

    def set_context_parallel_group(self, cp_group, cp_global_ranks=None, cp_stream=None,
                                   cp_comm_type: str = "p2p") -> None:
        """Context parallelism of the core attention (DotProductAttention.set_context_parallel_group)."""
        self.core_attention.set_context_parallel_group(cp_group, cp_global_ranks, cp_stream, cp_comm_type)

    def set_tensor_parallel_group(self, tp_group) -> None:
        """TE's: the tensor-parallel group of the submodules (one rank, or None, is implemented)."""
        set_tensor_parallel_group(self, tp_group)

    def reset_fp8_meta_tensors(self) -> None:
        """TE's: fresh FP8 state (zero amax histories, unit scales) in every submodule."""
        reset_fp8_meta_tensors(self)

    # -------------------------------------------------------------- helpers
    # (SplitPacked: a packed gradient from fused attention becomes mixed's gradient without a copy;
    # traced graphs take the plain views, as packed_layout does not look at traced tensors)
    def _split_qkv(self, mixed: torch.Tensor):
        h, g, d, inter = (self.num_attention_heads, self.num_gqa_groups, self.hidden_size_per_attention_head,
                          self.qkv_weight_interleaved)
        if torch.compiler.is_compiling():
            return _fa8.split_qkv(mixed, h, g, d, inter)
        return custom_ops.run_function(_pk.SplitPacked, mixed, lambda t: _fa8.split_qkv(t, h, g, d, inter),
                                       lambda t: _fa8.split_qkv(t, h, g, d, inter, grouped_q=True))

    def _split_kv(self, mixed: torch.Tensor):
        g, d, inter = self.num_gqa_groups, self.hidden_size_per_attention_head, self.qkv_weight_interleaved
        if torch.compiler.is_compiling():
            return _fa8.split_kv(mixed, g, d, inter)
        split = lambda t: _fa8.split_kv(t, g, d, inter)  # noqa: E731
        return custom_ops.run_function(_pk.SplitPacked, mixed, split, split)

    def _rotate(self, q, k, rotary_pos_emb, inference_params, cu_seqlens_q, cu_seqlens_kv):
        """q, k with RoPE (rope.py): rotary_pos_emb is one angle table for both or a (q, k) pair. With
        a K/V cache the new tokens start at each sequence's cached length, and THD inputs are packed
        as the cache's step (its cu_seqlens_q). With context parallelism the local chunks rotate at
        their positions in the whole sequence (as TE passes the CP rank to apply_rotary_pos_emb)."""
        q_emb, k_emb = (tuple(rotary_pos_emb) if isinstance(rotary_pos_emb, (tuple, list))
                        else (rotary_pos_emb, rotary_pos_emb))
        start = None
        if inference_params is not None and self.attention_type == "self":
            start = inference_params.get_seqlens_pre_step()
            if start is None:
                raise RuntimeError("MultiheadAttention: inference_params needs pre_step(step_dict) before the forward")
            cu_seqlens_q = cu_seqlens_kv = inference_params.cu_seqlens_q
            if self.qkv_format != "thd":  # (a batch padded past the live sequences: empty rows start at 0)
                start = inference_params.get_seqlens_pre_step(q.shape[0 if self.qkv_format == "bshd" else 1])
                q_emb, k_emb = (_cover_padding_rows(e, inference_params, self.qkv_format, q) for e in (q_emb, k_emb))
        elif self.attention_type == "self" and cu_seqlens_kv is None:
            cu_seqlens_kv = cu_seqlens_q
        fmt, inter = self.qkv_format, self.rotary_pos_interleaved
        cp = self.core_attention.cp
        cp_args = dict(cp_size=cp.size, cp_rank=cp.rank) if cp is not None else {}
        q = apply_rotary_pos_emb(q, q_emb, fmt, start_positions=start, interleaved=inter, cu_seqlens=cu_seqlens_q,
                                 **cp_args)
        k = apply_rotary_pos_emb(k, k_emb, fmt, start_positions=start, interleaved=inter, cu_seqlens=cu_seqlens_kv,
                                 **cp_args)
        return q, k

    def _project_in(self, module, x, is_first_microbatch):
        """(output, layernorm output or None) of a QKV / query projection."""
        res = module(x, is_first_microbatch=is_first_microbatch)
        if self.input_layernorm and self.return_layernorm_output:
            return res[0], res[1]
        return res, None

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, encoder_output: Optional[torch.Tensor] = None,
                attn_mask_type: Optional[str] = None, window_size: Optional[Tuple[int, int]] = None,
                is_first_microbatch: Optional[bool] = None, checkpoint_core_attention: bool = False,
                inference_params=None, rotary_pos_emb=None, core_attention_bias_type: str = "no_bias",
                core_attention_bias=None, alibi_slopes=None, cu_seqlens_q=None, cu_seqlens_kv=None,
                max_seqlen_q=None, max_seqlen_kv=None, fast_zero_fill: bool = True, cu_seqlens_q_padded=None,
                cu_seqlens_kv_padded=None, pad_between_seqs=None, **kwargs):
        check_kwargs("MultiheadAttention.forward", _TE_FORWARD_KWARGS, kwargs)
        _check_forward_kwargs("MultiheadAttention", kwargs)
        if self.attention_type == "self" and cu_seqlens_kv is None and cu_seqlens_kv_padded is None:
            cu_seqlens_kv_padded = cu_seqlens_q_padded  # (one packed buffer: the keys' offsets are the queries')
        # (cross attention: the two sides are separate buffers, and a side without padded offsets
        # has no gaps, as in TE)
        if self.attention_type == "self" and (cu_seqlens_q_padded is None) != (cu_seqlens_kv_padded is None):
            raise ValueError("MultiheadAttention: give cu_seqlens_q_padded and cu_seqlens_kv_padded together")
        attn_args = dict(attention_mask=attention_mask, attn_mask_type=attn_mask_type, window_size=window_size,
                         core_attention_bias_type=core_attention_bias_type, core_attention_bias=core_attention_bias,
                         alibi_slopes=alibi_slopes, cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_kv,
                         cu_seqlens_q_padded=cu_seqlens_q_padded, cu_seqlens_kv_padded=cu_seqlens_kv_padded,
                         max_seqlen_q=max_seqlen_q, max_seqlen_kv=max_seqlen_kv, pad_between_seqs=pad_between_seqs,
                         **kwargs)
        if inference_params is not None and self.attention_type == "self":
            attn_args["inference_params"] = inference_params  # (cross attention reads encoder_output each call)
        elif (_df.fp8_mha_recipe() is not None and rotary_pos_emb is None and self.core_attention.cp is None
              and self.q_norm is None):
            # FP8 hand-offs between the projections and attention (not with a K/V cache; with RoPE,
            # which rotates high-precision q / k, or context parallelism, which trades high-precision
            # tensors, attention still runs in FP8, as under fp8_dpa)
            return self._forward_fp8_mha(hidden_states, encoder_output, is_first_microbatch, attn_args)
        ln_out = None
        if self.attention_type == "self":
            mod = self.layernorm_qkv if self.input_layernorm else self.qkv
            mixed, ln_out = self._project_in(mod, hidden_states, is_first_microbatch)
            q, k, v = self._split_qkv(mixed)
        else:
            if encoder_output is None:
                raise ValueError("MultiheadAttention: cross attention needs encoder_output")
            mod = self.layernorm_query if self.input_layernorm else self.query_layer
            qo, ln_out = self._project_in(mod, hidden_states, is_first_microbatch)
            q = qo.view(*qo.shape[:-1], self.num_attention_heads, self.hidden_size_per_attention_head)
            k, v = self._split_kv(self.key_value(encoder_output, is_first_microbatch=is_first_microbatch))
        if self.q_norm is not None and self.qk_norm_before_rope:
            q, k = apply_qk_norm(self.q_norm, q), apply_qk_norm(self.k_norm, k)
        if rotary_pos_emb is not None:  # (THD with gaps: the padded offsets place each sequence's tokens)
            q, k = self._rotate(q, k, rotary_pos_emb, inference_params,
                                cu_seqlens_q_padded if cu_seqlens_q_padded is not None else cu_seqlens_q,
                                cu_seqlens_kv_padded if cu_seqlens_kv_padded is not None else cu_seqlens_kv)
        if self.q_norm is not None and not self.qk_norm_before_rope:
            q, k = apply_qk_norm(self.q_norm, q), apply_qk_norm(self.k_norm, k)
        ctx = self.core_attention(q, k, v, checkpoint_core_attention=checkpoint_core_attention, **attn_args)
        res = self.proj(ctx, is_first_microbatch=is_first_microbatch)
        return self._outputs(res, ln_out)

    def _outputs(self, res, ln_out):
        out = list(res) if self.return_bias else [res]
        if self.input_layernorm and self.return_layernorm_output:
            out.append(ln_out)
        return out[0] if len(out) == 1 else tuple(out)

    def _forward_fp8_mha(self, hidden_states, encoder_output, is_first_microbatch, attn_args):
        """The forward under the recipe's fp8_mha (see fp8_handoff.py): the QKV (query, key/value)
        projection GEMMs write FP8 hand-offs, attention reads their bytes and writes O as an FP8
        hand-off, which the output projection's GEMM reads; in backward the gradients between
        these three are FP8 hand-offs too. What the caller gets (output, layernorm output, bias)
        is as without fp8_mha, in high precision."""
        h, g, d = self.num_attention_heads, self.num_gqa_groups, self.hidden_size_per_attention_head
        inter = self.qkv_weight_interleaved
        lead_q = tuple(hidden_states.shape[:-1])
        rows_q = _fa8._rows(lead_q)
        if self.attention_type == "self":
            mod = self.layernorm_qkv if self.input_layernorm else self.qkv
            src_a, ln_out = mod._fp8_handoff_out(hidden_states, is_first_microbatch)
            src_b, lead_kv = None, lead_q
            mixed = handoff_parts(src_a.detach(), rows_q, (h + 2 * g) * d)[0].view(*lead_q, -1)
            q, k, v = _fa8.split_qkv(mixed, h, g, d, inter)  # (byte views: their shapes plan the call)
        else:
            if encoder_output is None:
                raise ValueError("MultiheadAttention: cross attention needs encoder_output")
            mod = self.layernorm_query if self.input_layernorm else self.query_layer
            src_a, ln_out = mod._fp8_handoff_out(hidden_states, is_first_microbatch)
            src_b, _ = self.key_value._fp8_handoff_out(encoder_output, is_first_microbatch)
            lead_kv = tuple(encoder_output.shape[:-1])
            q = handoff_parts(src_a.detach(), rows_q, h * d)[0].view(*lead_q, h, d)
            kv = handoff_parts(src_b.detach(), _fa8._rows(lead_kv), 2 * g * d)[0].view(*lead_kv, -1)
            k, v = _fa8.split_kv(kv, g, d, inter)
        spec = (h, g, d, inter, lead_q, lead_kv)
        o_h = self.core_attention(q, k, v, _fp8_handoff=((src_a, src_b), spec), **attn_args)
        res = self.proj._fp8_handoff_in(o_h, lead_q, is_first_microbatch)
        return self._outputs(res, ln_out)
