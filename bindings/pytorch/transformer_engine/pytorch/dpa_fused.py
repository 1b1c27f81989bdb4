"""DotProductAttention's fused path: the sequence description (cu_seqlens, THD), the FP8 attention
plan (fp8_dpa) and the choice between the fused path (fused_attention.py, fused_attention_fp8.py)
and the unfused one (attention/__init__.py).

Sequences follow TE's DotProductAttention.forward:
  * qkv_format "thd": Q [t_q, h, d], K/V [t_kv, h_kv, d]; cu_seqlens_q / cu_seqlens_kv (int32
    [b + 1], cumulative valid lengths) are required (cu_seqlens_kv defaults to cu_seqlens_q);
    cu_seqlens_q_padded / cu_seqlens_kv_padded give the token offset of each sequence when there
    are gaps between them (default: no gaps); max_seqlen_q / max_seqlen_kv default to the
    longest sequence. The mask type always includes padding ("causal" means "padding_causal",
    per sequence). Only the fused path runs THD; gap tokens of the output and of the gradients
    are zero. A THD call the backend rejects (on the GPU: FP8, attention bias / ALiBi) runs as
    zero-padded BSHD with the padding mask (_thd_as_padded_bshd).
  * "bshd" / "sbhd" with a padding mask type: cu_seqlens_q / cu_seqlens_kv, when given, describe
    the (right-padded) sequence lengths and take precedence over attention_mask; the padded
    offsets and max_seqlen arguments do not apply (the s dimension is the padded length).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from transformer_engine.common.recipe import DelayedScaling, Format

from . import attn_packing as _pk
from . import fused_attention as _fa
from . import fused_attention_fp8 as _fp8
from .fp8 import FP8GlobalState


class Seq(NamedTuple):
    cu_q: torch.Tensor
    cu_kv: torch.Tensor
    cu_q_pad: Optional[torch.Tensor]
    cu_kv_pad: Optional[torch.Tensor]
    max_sq: int
    max_skv: int


_THD_MASKS = {"no_mask": "padding", "padding": "padding", "causal": "padding_causal",
              "padding_causal": "padding_causal", "causal_bottom_right": "padding_causal_bottom_right",
              "padding_causal_bottom_right": "padding_causal_bottom_right"}


def thd_mask_type(mask_type: str) -> str:
    if mask_type not in _THD_MASKS:
        raise ValueError(f"DotProductAttention: attn_mask_type {mask_type!r} cannot be used with qkv_format 'thd' "
                         f"(the sequences come from cu_seqlens; use one of {sorted(set(_THD_MASKS))})")
    return _THD_MASKS[mask_type]


def check_qkv(q, k, v, fmt: str, h: int, g: int, dk: int, dv: int) -> None:
    """Shapes against the module's heads (h query, g key/value) and head sizes (kv_channels: dk for
    queries and keys, dv for values); one dtype for all three (as TE requires)."""
    rank = 3 if fmt == "thd" else 4
    for name, t in (("query_layer", q), ("key_layer", k), ("value_layer", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != rank:
            dims = "[t, h, d]" if fmt == "thd" else f"{fmt} ([{', '.join(fmt)}])"
            raise ValueError(f"DotProductAttention: {name} must be a {rank}D tensor in {dims} format, got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    if q.shape[-2] != h or k.shape[-2] != g or v.shape[-2] != g:
        raise ValueError(f"DotProductAttention: expected {h} query heads and {g} key/value heads, got shapes "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[-1] != dk or k.shape[-1] != dk or v.shape[-1] != dv:
        raise ValueError(f"DotProductAttention: kv_channels gives head sizes {dk} (query, key) and {dv} (value); "
                         f"got shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"DotProductAttention: query_layer, key_layer and value_layer must share one dtype, got "
                        f"{q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"DotProductAttention: key_layer {tuple(k.shape)} and value_layer {tuple(v.shape)} must "
                         f"agree in all but the head size")


def _cu(t, name: str, device, n: Optional[int]) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"DotProductAttention: {name} must be a 1D int32 tensor [batch_size + 1], got "
                         f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}"
                         f"{'' if not isinstance(t, torch.Tensor) else ' ' + str(t.dtype)}")
    if t.shape[0] < 1 or (n is not None and t.shape[0] != n):
        raise ValueError(f"DotProductAttention: {name} has {t.shape[0]} entries; expected "
                         f"{'batch_size + 1' if n is None else n}")
    return t.to(device=device, dtype=torch.int32).contiguous()


def _max_len(cu: torch.Tensor) -> int:
    lens = cu[1:] - cu[:-1]
    return int(lens.max()) if lens.numel() else 0


def sequences(fmt: str, mask_type: str, q, k, cu_q, cu_kv, cu_q_pad, cu_kv_pad, max_sq, max_skv) -> Optional[Seq]:
    """The sequence description from the cu_seqlens arguments, or None when they do not apply
    (bshd/sbhd without a padding mask type or without cu_seqlens)."""
    if fmt != "thd" and ("padding" not in mask_type or (cu_q is None and cu_kv is None)):
        return None
    if cu_q is None:
        raise ValueError(f"DotProductAttention: {'qkv_format thd' if fmt == 'thd' else 'cu_seqlens_kv'} needs "
                         f"cu_seqlens_q")
    if fmt == "thd":
        n = None
    else:
        n = (q.shape[0] if fmt == "bshd" else q.shape[1]) + 1
    cq = _cu(cu_q, "cu_seqlens_q", q.device, n)
    if cu_kv is None:  # self attention: the same sequences
        if fmt != "thd" and q.shape[:2] != k.shape[:2]:
            raise ValueError("DotProductAttention: cu_seqlens_kv is needed when query and key/value lengths differ")
        ckv = cq
        cu_kv_pad = cu_q_pad if cu_kv_pad is None else cu_kv_pad
    else:
        ckv = _cu(cu_kv, "cu_seqlens_kv", q.device, cq.shape[0])
    if fmt != "thd":
        s_q, s_kv = (q.shape[1], k.shape[1]) if fmt == "bshd" else (q.shape[0], k.shape[0])
        return Seq(cq, ckv, None, None, s_q, s_kv)
    pq = None if cu_q_pad is None else _cu(cu_q_pad, "cu_seqlens_q_padded", q.device, cq.shape[0])
    pkv = None if cu_kv_pad is None else _cu(cu_kv_pad, "cu_seqlens_kv_padded", q.device, cq.shape[0])
    mq = _max_len(cq) if max_sq is None else _given_max(max_sq, cq, "q")
    mkv = _max_len(ckv) if max_skv is None else _given_max(max_skv, ckv, "kv")
    return Seq(cq, ckv, pq, pkv, mq, mkv)


def _given_max(m, cu: torch.Tensor, name: str) -> int:
    """A caller's max_seqlen_{name}: an int >= 0. 0 is checked against cu_seqlens here (run_fused
    answers a call with a max_seqlen of 0 with zeros, before the library would see a longer
    sequence), on the host except while a CUDA graph is being captured; the library checks the
    others."""
    m = int(m)
    if m < 0:
        raise ValueError(f"DotProductAttention: max_seqlen_{name} must be >= 0, got {m}")
    if m == 0 and cu.numel() > 1 and not (cu.is_cuda and torch.cuda.is_current_stream_capturing()):
        longest = int((cu[1:] - cu[:-1]).max())
        if longest > 0:
            raise ValueError(f"DotProductAttention: cu_seqlens_{name} gives a sequence of length {longest}, more "
                             f"than max_seqlen_{name} 0")
    return m


# THD calls the backend rejects (the GPU's cuDNN path: FP8 THD, THD with attention bias / ALiBi)
# run as zero-padded BSHD with the padding mask (fused path); "always": every THD call does (tests).
THD_AS_PADDED = "auto"


def _thd_slots(cu: torch.Tensor, cu_pad: Optional[torch.Tensor], max_s: int, name: str):
    """(slot holds a token [b * max_s] bool, its THD row [b * max_s] int64; 0 where empty) for the
    slots (sequence i, position p) of the zero-padded [b, max_s] batch, and (start, length) of every
    sequence: device tensors, computed without synchronizing with the host. A sequence longer than
    max_s is an error, checked on the host except while a CUDA graph is being captured (where
    nothing may synchronize, and the capture's max_seqlen must hold for its replays)."""
    lens = (cu[1:] - cu[:-1]).to(torch.int64)
    if lens.numel() and not (cu.is_cuda and torch.cuda.is_current_stream_capturing()):
        longest = int(lens.max())
        if longest > max_s:
            raise ValueError(f"DotProductAttention: a sequence of cu_seqlens_{name} is longer than max_seqlen_{name} "
                             f"({longest} > {max_s})")
    starts = (cu if cu_pad is None else cu_pad)[:-1].to(torch.int64)
    pos = torch.arange(max_s, device=cu.device)
    valid = pos[None, :] < lens[:, None]
    rows = torch.where(valid, starts[:, None] + pos[None, :], 0)
    return valid.reshape(-1), rows.reshape(-1), starts, lens


def _pad_thd(t: torch.Tensor, valid: torch.Tensor, rows: torch.Tensor, b: int, s: int) -> torch.Tensor:
    """THD t [tokens, ...] -> [b, s, ...]: each slot's token, zeros in empty slots (differentiable)."""
    if t.shape[0] == 0:
        return t.new_zeros((b, s) + t.shape[1:])
    x = t.index_select(0, rows)
    x = torch.where(valid.view(-1, *([1] * (t.dim() - 1))), x, x.new_zeros(()))
    return x.view(b, s, *t.shape[1:])


class _NoKeysSeen(torch.autograd.Function):
    """THD attention where every query or every key sequence is empty: no query sees a key, so the
    output [t, h * d_v] and the gradients are zeros."""

    @staticmethod
    def forward(ctx, q, k, v):
        ctx.like = [(t.shape, t.dtype, t.device) for t in (q, k, v)]
        return q.new_zeros(q.shape[0], q.shape[-2] * v.shape[-1])

    @staticmethod
    def backward(ctx, g):
        return tuple(torch.zeros(shape, dtype=dt, device=dev) for shape, dt, dev in ctx.like)


def _unpad_thd(o: torch.Tensor, tokens: int, starts: torch.Tensor, lens: torch.Tensor, s: int) -> torch.Tensor:
    """[b * s, ...] -> THD [tokens, ...]: each THD row gathered from its slot; rows between or after
    the sequences are zeros. The sequences' starts are non-decreasing (cu_seqlens or their padded
    offsets are cumulative), so a row's sequence is the last one starting at or before it."""
    r = torch.arange(tokens, device=o.device)
    seq = torch.searchsorted(starts, r, right=True) - 1
    seq_c = seq.clamp(min=0)
    p = r - starts[seq_c]
    valid = (seq >= 0) & (p < lens[seq_c])
    slot = torch.where(valid, seq_c * s + p, 0)
    x = o.index_select(0, slot)
    return torch.where(valid.view(-1, *([1] * (o.dim() - 1))), x, x.new_zeros(()))


def _thd_as_padded_bshd(dpa, q, k, v, mask_type, window, bias_type, bias, alibi_slopes, seq: Seq, fp8, why,
                        top_left: bool = False):
    """run_fused of a THD call through its zero-padded [b, max_s, h, d] form (BSHD, padding mask from
    cu_seqlens): the tokens are scattered in and the output rows gathered back (differentiable
    index copies, so the gradients take the same way); gap tokens of the output stay zero. FP8:
    the padded lengths are multiples of 128 (cuDNN's FP8 backward needs them; the padding mask
    hides the extra rows)."""
    b = seq.cu_q.numel() - 1
    if fp8 is not None:
        seq = seq._replace(max_sq=-(-seq.max_sq // 128) * 128, max_skv=-(-seq.max_skv // 128) * 128)
    valid_q, rows_q, starts_q, lens_q = _thd_slots(seq.cu_q, seq.cu_q_pad, seq.max_sq, "q")
    valid_kv, rows_kv, _, _ = _thd_slots(seq.cu_kv, seq.cu_kv_pad, seq.max_skv, "kv")
    qp = _pad_thd(q, valid_q, rows_q, b, seq.max_sq)
    kp, vp = (_pad_thd(t, valid_kv, rows_kv, b, seq.max_skv) for t in (k, v))
    bshd = Seq(seq.cu_q, seq.cu_kv, None, None, seq.max_sq, seq.max_skv)
    head = (f"DotProductAttention: qkv_format 'thd' runs only on the fused attention path, which cannot run "
            f"this call{f' ({why})' if why else ''}, nor its padded bshd form")
    try:
        o = run_fused(dpa, qp, kp, vp, "bshd", mask_type, window, None, bias_type, bias, alibi_slopes, bshd, fp8,
                      force_fused=True, top_left=top_left)
    except NotImplementedError as e:
        raise NotImplementedError(f"{head}: {e}") from None
    return _unpad_thd(o.reshape(b * seq.max_sq, q.shape[-2] * v.shape[-1]), q.shape[0], starts_q, lens_q,
                      seq.max_sq)


def padding_masks(seq: Seq):
    """(q_mask [b, 1, 1, sq], kv_mask [b, 1, 1, skv]), True = padded, for the unfused path."""
    def one(cu, s):
        lens = (cu[1:] - cu[:-1]).to(torch.int64)
        if bool(((lens < 0) | (lens > s)).any()):  # (the fused path's library call checks the same)
            raise ValueError(f"DotProductAttention: cu_seqlens give sequence lengths {lens.tolist()}; each must be "
                             f"in [0, {s}] (the tensors' sequence dimension)")
        return (torch.arange(s, device=cu.device)[None, :] >= lens[:, None]).view(-1, 1, 1, s)
    return one(seq.cu_q, seq.max_sq), one(seq.cu_kv, seq.max_skv)


# ------------------------------------------------------------------ FP8
def _check_fp8_attention_recipe(r, who: str, flag: str) -> None:
    if not isinstance(r, DelayedScaling):
        raise NotImplementedError(f"{who}: {flag} is implemented for the DelayedScaling recipe only, "
                                  f"got {type(r).__name__}")
    if r.fp8_format == Format.E5M2:
        raise NotImplementedError(f"{who}: {flag} needs Q, K, V in float8_e4m3 (fused_attn.h); "
                                  "use Format.HYBRID or Format.E4M3, not Format.E5M2")


def fp8_mha_recipe() -> Optional[DelayedScaling]:
    """The recipe when MultiheadAttention runs with FP8 hand-offs (fp8_autocast with fp8_mha=True,
    which implies fp8_dpa as in TE), else None; raises for recipes it cannot run."""
    st = FP8GlobalState
    if not st.enabled or not getattr(st.recipe, "fp8_mha", False):
        return None
    _check_fp8_attention_recipe(st.recipe, "MultiheadAttention", "fp8_mha")
    return st.recipe


def fp8_attention_on() -> bool:
    """Whether fp8_autocast asks for FP8 attention (fp8_dpa or fp8_mha), without preparing anything."""
    r = FP8GlobalState.recipe
    return bool(FP8GlobalState.enabled and (getattr(r, "fp8_dpa", False) or getattr(r, "fp8_mha", False)))


def fp8_dpa_recipe(dpa, device: torch.device) -> Optional[DelayedScaling]:
    """The recipe when this forward runs FP8 attention (fp8_autocast with fp8_dpa=True, or fp8_mha=True,
    which implies it), else None; prepares the module's FP8 metadata and registers it for the forward
    recipe step. (DotProductAttention called on its own runs fp8_mha as fp8_dpa: its inputs and output
    are high-precision tensors; the FP8 hand-offs are MultiheadAttention's.)"""
    st = FP8GlobalState
    if not st.enabled:
        return None  # calibration runs attention in high precision and records nothing here
    r = st.recipe
    mha = getattr(r, "fp8_mha", False)
    if not (getattr(r, "fp8_dpa", False) or mha):
        return None
    _check_fp8_attention_recipe(r, "DotProductAttention", "fp8_mha" if mha else "fp8_dpa")
    dpa.fp8_meta.prepare(r, device)
    st.register_forward(dpa.fp8_meta)
    return r


def _fp8_fwd_meta(dpa):
    """(scale, amax history) of the forward casts: under activation recompute the forward's scales
    and a scratch history (the recipe state is touched once per step)."""
    meta, st = dpa.fp8_meta, FP8GlobalState
    if st.recompute_stash is not None:
        return st.recompute_stash.get(meta, meta.scale["fwd"]), torch.zeros_like(meta.amax_history["fwd"])
    return meta.scale["fwd"], meta.amax_history["fwd"]


# ------------------------------------------------------------------ the fused path
_ZERO_RNG = {}  # device -> int64 [2] zeros: the (unused) rng_state of calls without dropout


def _zero_rng_state(device: torch.device) -> torch.Tensor:
    """The rng_state of a call without dropout (read only, so one tensor per device serves every
    call, instead of an allocation and a fill kernel per forward)."""
    t = None if torch.compiler.is_compiling() else _ZERO_RNG.get(device)
    if t is None:
        t = torch.zeros(2, dtype=torch.int64, device=device)
        # kept unless made inside a traced graph or a CUDA graph capture (where it is filled only at replay)
        if not (torch.compiler.is_compiling() or (t.is_cuda and torch.cuda.is_current_stream_capturing())):
            _ZERO_RNG[device] = t
    return t


def needs_grad(dpa, q, k, v, bias, learnable: bool = True) -> bool:
    """Whether this call builds a graph: grad mode on and a gradient wanted of q, k, v, the bias (or
    whatever tensors are given in their places) or, with learnable, the learnable softmax offset."""
    if not torch.is_grad_enabled():
        return False
    if any(t is not None and t.requires_grad for t in (q, k, v, bias)):
        return True
    return learnable and dpa.softmax_type == "learnable" and dpa.softmax_offset.requires_grad


def run_fused(dpa, q, k, v, fmt, mask_type, window, attention_mask, bias_type, bias, alibi_slopes,
              seq: Optional[Seq], fp8: Optional[DelayedScaling], handoff=None, force_fused: bool = False,
              top_left: bool = False):
    """The fused attention output, or None when the unfused path should run; raises when neither
    path can run the call. handoff (fp8_mha): ((src_a, src_b), spec) of
    fused_attention_fp8.FusedAttnFP8MHAFunc, q, k, v being uint8 views of the FP8 bytes (for the
    shapes); the output is then O's FP8 hand-off. force_fused: as if only the fused path could run
    the call (the padded form of a THD call). top_left: windows and ALiBi of a non-causal mask
    aligned to the top-left corner (bottom_right_diagonal=False), the library's flag."""
    needs_fused = force_fused or fmt == "thd" or fp8 is not None  # (the unfused path takes biases: attn_bias.py)
    if bias_type in ("pre_scale_bias", "post_scale_bias") and bias is None:
        raise ValueError(f"core_attention_bias_type {bias_type!r} needs core_attention_bias")
    if fmt == "thd" and handoff is None and seq is not None and (seq.max_sq == 0 or seq.max_skv == 0):
        return _NoKeysSeen.apply(q, k, v)  # (the GPU's kernels take no empty problem)
    why = ""
    softmax = _fa.SOFTMAX_INT[dpa.softmax_type]
    if not _fa.want_fused(q.device, needs_fused or bias_type != "no_bias"):  # (biases: fused first on the CPU too)
        why = "NVTE_FUSED_ATTN=0"
    elif mask_type == "arbitrary":
        why = "arbitrary masks run unfused (as in TE)"
    elif not (q.dtype == k.dtype == v.dtype):
        why = "query/key/value dtypes differ"
    elif fp8 is not None and bias_type != "no_bias":
        why = "FP8 attention has no attention bias or ALiBi (as in TE)"
    elif fp8 is not None and softmax:
        why = f"FP8 attention takes the vanilla softmax only (softmax_type {dpa.softmax_type!r})"
    elif bias_type == "alibi" and alibi_slopes is not None and q.is_cuda:
        why = "ALiBi with caller-given slopes is not supported by the GPU backend (cuDNN uses its default slopes)"
    # q, k, v already in a packed placement (a fused QKV projection's split) go as they are
    packed = None if why or handoff is not None else _pk.packed_layout(q, k, v, fmt)
    layout = packed if packed is not None else _fa.LAYOUTS[fmt]
    wl, wr = window if window is not None else (-1, -1)
    dropout = dpa.attention_dropout if dpa.training else 0.0
    cu = (None, None, None, None)
    sq = sk = 0
    is_training = False
    if not why:
        if seq is not None:
            cu, sq, sk = tuple(seq[:4]), seq.max_sq, seq.max_skv
        else:
            b = q.shape[1] if fmt == "sbhd" else q.shape[0]
            sq, sk = (q.shape[0], k.shape[0]) if fmt == "sbhd" else (q.shape[1], k.shape[1])
            if "padding" in mask_type:
                if attention_mask is None:  # (as the unfused path, and TE: a padding mask needs one)
                    raise ValueError(f"DotProductAttention: attn_mask_type {mask_type!r} needs attention_mask "
                                     f"([b, 1, 1, s] bool, True = padded) or cu_seqlens_q / cu_seqlens_kv")
                else:
                    qm, km = attention_mask if isinstance(attention_mask, (tuple, list)) else (attention_mask,) * 2
                    cu = (_fa.padding_to_cu_seqlens_cached(qm, q.device, b, sq, "query"),
                          _fa.padding_to_cu_seqlens_cached(km, q.device, b, sk, "key/value"), None, None)
                    if cu[0] is None or cu[1] is None:
                        why = "the padding mask is not right-padded (valid tokens first)"
        grads = needs_grad(dpa, *((q, k, v, bias if bias_type != "alibi" else None) if handoff is None
                                  else (*handoff[0], None, None)), learnable=handoff is None)
        is_training = grads or dropout > 0.0
        if not why:
            ok, reason = _fa.fused_backend_supports(q, k, v, layout, _fa.BIAS_INT[bias_type],
                                                    _fa.MASK_INT[mask_type], dropout, is_training, sq, sk,
                                                    wl, wr, fp8=fp8 is not None,
                                                    br="causal" not in mask_type and not top_left,
                                                    bias=bias if bias_type in ("pre_scale_bias", "post_scale_bias")
                                                    else None, softmax=softmax)
            why = "" if ok else reason
            if fmt == "thd" and handoff is None and (not ok or THD_AS_PADDED == "always"):
                return _thd_as_padded_bshd(dpa, q, k, v, mask_type, window, bias_type, bias, alibi_slopes, seq,
                                           fp8, why, top_left)
    if why:
        if fp8 is not None:
            flag = "fp8_mha" if handoff is not None else "fp8_dpa"
            raise NotImplementedError(f"DotProductAttention: FP8 attention (recipe {flag}=True) cannot run this "
                                      f"call ({why}); it does not fall back to high-precision attention")
        if fmt == "thd":
            raise NotImplementedError(f"DotProductAttention: qkv_format 'thd' runs only on the fused attention "
                                      f"path, which cannot run this call ({why})")
        if needs_fused or not _fa.unfused_allowed():
            raise NotImplementedError(f"DotProductAttention: the fused attention path cannot run this call "
                                      f"({why}) and the unfused path "
                                      f"{'is disabled (NVTE_UNFUSED_ATTN=0)' if not needs_fused else 'runs no THD'}")
        if _fa.debugging():
            _fa.debug_log(f"DotProductAttention: unfused attention ({why})", q, fmt, mask_type, bias_type)
        return None
    if _fa.debugging():
        _fa.debug_log(f"DotProductAttention: fused attention ({'FP8, ' if fp8 is not None else ''}"
                      f"{'cuDNN' if q.is_cuda else 'the CPU reference backend'})", q, fmt, mask_type, bias_type)
    if dropout > 0.0:
        with dpa.dropout_rng():
            rng = _fa.new_rng_state(q.device)
    else:
        rng = _zero_rng_state(q.device)
    br = "causal" not in mask_type and not top_left
    mask = _fa.MASK_INT[mask_type]
    if handoff is not None or fp8 is not None:
        # NVTE_FP8_DPA_BWD=0 (TE's switch): FP8 forward, high-precision backward (fused_attention_fp8.py)
        f16_bwd = grads and _fa._env("NVTE_FP8_DPA_BWD") == "0"
        if f16_bwd and handoff is not None:
            raise NotImplementedError("MultiheadAttention: NVTE_FP8_DPA_BWD=0 (a high-precision attention backward) "
                                      "is implemented for fp8_dpa, not fp8_mha (whose backward hands FP8 gradients "
                                      "to the projections): use fp8_dpa=True, fp8_mha=False")
        meta = dpa.fp8_meta  # (the first run with gradients seeds the backward histories)
        cfg = (sq, sk, is_training, float(dpa.softmax_scale), float(dropout), layout, mask, int(wl), int(wr), br,
               meta.fp8_dtype("bwd"), fp8.amax_compute_algo, float(fp8.margin),
               grads and not f16_bwd and meta.take_bwd_seed(1), f16_bwd)
    if handoff is not None:
        return _fp8.FusedAttnFP8MHAFunc.apply(*handoff[0], *cu, rng, *_fp8_fwd_meta(dpa), meta.scale["bwd"],
                                              meta.amax_history["bwd"], cfg, handoff[1])
    if packed is None:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    if fp8 is not None:
        o = _fp8.FusedAttnFP8Func.apply(q, k, v, *cu, rng, *_fp8_fwd_meta(dpa), meta.scale["bwd"],
                                        meta.amax_history["bwd"], cfg)
    else:
        bias_t = None
        if bias_type in ("pre_scale_bias", "post_scale_bias"):
            bias_t = bias if bias.dim() == 4 else bias.view(1, *bias.shape[-3:])
            bias_t = bias_t.to(q.dtype).contiguous()
        elif bias_type == "alibi" and alibi_slopes is not None:
            bias_t = alibi_slopes.to(device=q.device, dtype=torch.float32).contiguous()
        cfg = (sq, sk, is_training, float(dpa.softmax_scale), float(dropout), layout, _fa.BIAS_INT[bias_type],
               mask, int(wl), int(wr), br, softmax)
        o = _fa.FusedAttnFunc.apply(q, k, v, bias_t, *cu, rng, dpa.fused_softmax_offset(), cfg)
    return o.reshape(*o.shape[:-2], o.shape[-2] * o.shape[-1])  # (explicit: o may be empty)
