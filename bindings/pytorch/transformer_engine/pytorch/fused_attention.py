"""Fused attention for DotProductAttention: nvte_fused_attn_fwd / _bwd (cuDNN on the GPU, the
float64 reference on the CPU) as two torch.library custom ops inside one autograd Function.

The library owns the math, the masks and the dropout stream; this file only shapes tensors:
Q, K, V in one of the separate layouts (sbhd_sbhd_sbhd / bshd_bshd_bshd / thd_thd_thd, made
contiguous), or, when they already are views in a packed layout's placement (attn_packing.py),
in that layout as they are, cu_seqlens (and for THD the padded offsets) given by the caller or derived from a
padding mask (True = masked out, valid tokens first), the aux tensors the
forward keeps for the backward (softmax statistics, the rng_state copy, the bias copy), and
the backend choice TE documents: NVTE_FUSED_ATTN=0 turns the fused path off,
NVTE_UNFUSED_ATTN=0 the unfused one (our GEMMs + fused softmax); NVTE_FLASH_ATTN is accepted
and has no effect (there is no flash-attn package path here). By default CUDA tensors use the
fused path whenever the library says it supports the configuration; CPU tensors use it when it
is the only path that can run the call (bias, ALiBi) or NVTE_FUSED_ATTN=1.
"""
from __future__ import annotations

import functools
import logging
import os
import weakref
from typing import List, NamedTuple, Optional, Tuple

import torch
from torch import Tensor
from torch.library import custom_op

from transformer_engine import _nvte

from . import _ops
from . import attn_packing as _pk
from .custom_ops import eager_or_op

L, M, BT, ST = _nvte.NVTE_QKV_Layout, _nvte.NVTE_Mask_Type, _nvte.NVTE_Bias_Type, _nvte.NVTE_Softmax_Type
_DT = {torch.float32: _nvte.DType.kFloat32, torch.float16: _nvte.DType.kFloat16,
       torch.bfloat16: _nvte.DType.kBFloat16, torch.int32: _nvte.DType.kInt32, torch.int64: _nvte.DType.kInt64,
       torch.uint8: _nvte.DType.kByte}
LAYOUTS = {"sbhd": int(L.NVTE_SBHD_SBHD_SBHD), "bshd": int(L.NVTE_BSHD_BSHD_BSHD), "thd": int(L.NVTE_THD_THD_THD)}
MASKS = {"no_mask": M.NVTE_NO_MASK, "padding": M.NVTE_PADDING_MASK, "causal": M.NVTE_CAUSAL_MASK,
         "padding_causal": M.NVTE_PADDING_CAUSAL_MASK, "causal_bottom_right": M.NVTE_CAUSAL_BOTTOM_RIGHT_MASK,
         "padding_causal_bottom_right": M.NVTE_PADDING_CAUSAL_BOTTOM_RIGHT_MASK}
BIASES = {"no_bias": BT.NVTE_NO_BIAS, "pre_scale_bias": BT.NVTE_PRE_SCALE_BIAS,
          "post_scale_bias": BT.NVTE_POST_SCALE_BIAS, "alibi": BT.NVTE_ALIBI}
# the same as plain ints: torch.compile traces int lookups, not conversions of the binding's enums
MASK_INT = {k: int(v) for k, v in MASKS.items()}
BIAS_INT = {k: int(v) for k, v in BIASES.items()}


def _handle(t: Optional[Tensor]):
    """The library handle of a (possibly absent) torch tensor (_ops' wrapping)."""
    return None if t is None else _ops._tensor(t)


def rng_copy_size(dropout: float) -> int:
    """Elements of the forward's rng_state copy: 2 with dropout; 0 without, since the backward
    then never reads it (one device copy and its launch less per training forward)."""
    return 2 if dropout > 0.0 else 0


def rng_slot(rng_copy: Tensor):
    """The aux-pack slot of the rng_state copy. An empty copy (no dropout) becomes a slot without
    data, which the forward points at the given rng_state (TE's rule for such a slot, no copy) and
    the backward does not read."""
    if rng_copy.numel():
        return _handle(rng_copy)
    return _ops._make(0, [2], _ops._TORCH_TO_NVTE[torch.int64])


_stream = _ops._stream
_workspace = _ops._workspace  # an _nvte.Tensor of nbytes, or None


class AttnCfg(NamedTuple):
    """The scalar configuration of one attention call (hashable: it keys the workspace sizes)."""
    max_sq: int
    max_skv: int
    scale: float
    dropout: float
    layout: int
    bias_type: int
    mask: int
    wl: int
    wr: int
    br: bool
    softmax: int = 0  # NVTE_Softmax_Type: vanilla, off-by-one, learnable


@functools.lru_cache(maxsize=None)
def _enums(layout: int, bias_type: int, mask: int, softmax: int = 0):
    """The binding's enums (layout, bias, mask, softmax) of the ops' plain-int arguments, made once."""
    return L(layout), BT(bias_type), M(mask), ST(softmax)


def _tail(c: AttnCfg):
    """The trailing scalars nvte_fused_attn_fwd and _bwd share: scale, dropout, layout, bias type,
    mask, softmax type, window, bottom-right diagonal."""
    return (c.scale, c.dropout, *_enums(c.layout, c.bias_type, c.mask, c.softmax), c.wl, c.wr, c.br)


SOFTMAX_INT = {"vanilla": int(ST.NVTE_VANILLA_SOFTMAX), "off-by-one": int(ST.NVTE_OFF_BY_ONE_SOFTMAX),
               "learnable": int(ST.NVTE_LEARNABLE_SOFTMAX)}


def offset_slot(h: int):
    """A data-less aux-pack slot for the softmax offset (float32 [1, h, 1, 1]): the forward points it
    at the SoftmaxOffset given (no copy); the backward of the off-by-one softmax reads nothing there."""
    return _ops._make(0, [1, h, 1, 1], _ops._TORCH_TO_NVTE[torch.float32])


def attn_workspace(bwd: bool, c: AttnCfg, qkv, H, bias: Optional[Tensor], is_training: bool):
    """The workspace of one forward / backward call (handles H of q, k, v; bias: the bias, or for the
    backward the bias gradient, or None). Its size is asked of the library once per configuration."""
    q, k, v = qkv
    det = bwd and deterministic()
    key = ("attn", bwd, q.device, q.dtype, q.shape, k.shape, v.shape,
           None if bias is None else (bias.shape, bias.dtype), is_training, c, det)

    def query():
        enums = _enums(c.layout, c.bias_type, c.mask, c.softmax)
        if bwd:
            return _nvte.fused_attn_bwd_workspace_size(*H, _handle(bias), c.max_sq, c.max_skv, c.dropout, *enums,
                                                       c.wl, c.wr, c.br, det)
        return _nvte.fused_attn_fwd_workspace_size(*H, _handle(bias), c.max_sq, c.max_skv, is_training, False,
                                                   c.dropout, *enums, c.wl, c.wr, c.br)
    return _workspace(_ops._workspace_bytes(key, query), q.device)


def call_fwd(c: AttnCfg, qkv, H, bias, s_h, o_h, aux, cu, rng_state: Tensor, is_training: bool,
             pages=(None, None), offset: Optional[Tensor] = None, handle=_handle) -> None:
    """nvte_fused_attn_fwd (positional arguments: cheaper to pass than keywords). H: handles of q, k, v;
    s_h: FP8 S metadata or None; cu: (cu_seqlens_q, _kv, _q_padded, _kv_padded) tensors or Nones;
    pages: the page tables (k, v) of a paged layout; offset: the learnable softmax's [1, h, 1, 1];
    handle: what makes the handles of cu, pages and rng_state (_ops._persistent for the K/V-cache
    path's long-lived buffers)."""
    ws = attn_workspace(False, c, qkv, H, bias, is_training)
    # the binding's order: Q, K, V, Bias, SoftmaxOffset, S, O, aux, cu_seqlens (q, kv, q_padded, kv_padded),
    # page tables (k, v), rng_state, max_seqlen (q, kv), is_training, return_max_logit, cuda_graph, the
    # _tail scalars, workspace, stream
    _nvte.fused_attn_fwd(*H, _handle(bias), _handle(offset), s_h, o_h, aux, *[handle(t) for t in cu], *map(handle, pages),
                         handle(rng_state), c.max_sq, c.max_skv, is_training, False, False, *_tail(c), ws,
                         _stream(qkv[0]))


def call_bwd(c: AttnCfg, qkv, H, o_h, do_h, s_h, dp_h, aux, grads, dbias, cu, bias=None,
             doffset: Optional[Tensor] = None) -> None:
    """nvte_fused_attn_bwd (positional). grads: handles of dq, dk, dv; dbias: tensor or None; s_h / dp_h:
    FP8 metadata or None; cu as in call_fwd; bias: the forward's bias (copy), which describes the bias
    shape to the workspace query when no bias gradient is asked for (a bias without gradient)."""
    ws = attn_workspace(True, c, qkv, H, dbias if dbias is not None else bias, True)
    # the binding's order: Q, K, V, O, dO, S, dP, aux, dQ, dK, dV, dBias, dSoftmaxOffset, cu_seqlens (4),
    # max_seqlen (q, kv), the _tail scalars, deterministic, cuda_graph, workspace, stream
    _nvte.fused_attn_bwd(*H, o_h, do_h, s_h, dp_h, aux, *grads, _handle(dbias), _handle(doffset),
                         *[_handle(t) for t in cu],
                         c.max_sq, c.max_skv, *_tail(c), deterministic(), False, ws, _stream(qkv[0]))


def stats_shape(q: Tensor, layout: int, max_sq: int, cu_q: Optional[Tensor]) -> List[int]:
    """[b, h_q, max_seqlen_q, 1] of the softmax statistics (THD: b from cu_seqlens_q)."""
    if layout == LAYOUTS["thd"]:
        b = cu_q.shape[0] - 1
    else:
        b = q.shape[0] if layout == LAYOUTS["bshd"] or layout in _pk.BSHD_LAYOUTS else q.shape[1]
    return [b, q.shape[-2], max_sq, 1]


# ------------------------------------------------------------------ custom ops
@custom_op("transformer_engine::fused_attn_fwd", mutates_args=())
def fused_attn_fwd(q: Tensor, k: Tensor, v: Tensor, bias: Optional[Tensor], cu_q: Optional[Tensor],
                   cu_kv: Optional[Tensor], cu_q_pad: Optional[Tensor], cu_kv_pad: Optional[Tensor], rng_state: Tensor, max_sq: int, max_skv: int, is_training: bool,
                   scale: float, dropout: float, layout: int, bias_type: int, mask: int, wl: int,
                   wr: int, br: bool, softmax: int = 0,
                   offset: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Returns (O, softmax statistics, rng_state copy, bias copy or an empty placeholder). softmax:
    SOFTMAX_INT; offset: the learnable softmax's float32 [1, h, 1, 1]."""
    c = AttnCfg(max_sq, max_skv, scale, dropout, layout, bias_type, mask, wl, wr, br, softmax)
    qkv = (q, k, v)
    o = torch.empty(q.shape[:-1] + (v.shape[-1],), dtype=q.dtype, device=q.device)
    stats = torch.empty(stats_shape(q, layout, max_sq, cu_q), dtype=torch.float32, device=q.device)
    rng_copy = torch.empty(rng_copy_size(dropout), dtype=torch.int64, device=q.device)
    bias_copy = torch.empty_like(bias) if bias is not None else torch.empty(0, dtype=q.dtype, device=q.device)
    aux = None
    if is_training:
        aux = [_handle(stats), rng_slot(rng_copy)] + ([_handle(bias_copy)] if bias is not None else [])
        if softmax:
            aux.append(offset_slot(q.shape[-2]))
    call_fwd(c, qkv, [_handle(x) for x in qkv], bias, None, _handle(o), aux, (cu_q, cu_kv, cu_q_pad, cu_kv_pad),
             rng_state, is_training, offset=offset)
    return o, stats, rng_copy, bias_copy


@fused_attn_fwd.register_fake
def _(q, k, v, bias, cu_q, cu_kv, cu_q_pad, cu_kv_pad, rng_state, max_sq, max_skv, is_training, scale, dropout,
      layout, bias_type, mask, wl, wr, br, softmax=0, offset=None):
    o = q.new_empty(q.shape[:-1] + (v.shape[-1],))
    stats = q.new_empty(stats_shape(q, layout, max_sq, cu_q), dtype=torch.float32)
    bias_copy = torch.empty_like(bias) if bias is not None else q.new_empty(0)
    return o, stats, q.new_empty(rng_copy_size(dropout), dtype=torch.int64), bias_copy


@custom_op("transformer_engine::fused_attn_bwd", mutates_args=())
def fused_attn_bwd(q: Tensor, k: Tensor, v: Tensor, o: Tensor, do: Tensor, stats: Tensor, rng_copy: Tensor,
                   bias_copy: Tensor, cu_q: Optional[Tensor], cu_kv: Optional[Tensor], cu_q_pad: Optional[Tensor],
                   cu_kv_pad: Optional[Tensor], max_sq: int, max_skv: int,
                   scale: float, dropout: float, layout: int, bias_type: int, mask: int, wl: int, wr: int,
                   br: bool, need_dbias: bool, softmax: int = 0, offset: Optional[Tensor] = None,
                   need_doffset: bool = False) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Returns (the gradients in attn_packing's three-output form (dQ, dK, dV unless the layout is
    packed), dBias or an empty placeholder, dSoftmaxOffset [1, h, 1, 1] or an empty placeholder)."""
    c = AttnCfg(max_sq, max_skv, scale, dropout, layout, bias_type, mask, wl, wr, br, softmax)
    qkv = (q, k, v)
    outs, (dq, dk, dv) = _pk.new_grads(layout, q, k, v, q.dtype)
    has_bias = bias_copy.numel() > 0
    dbias = torch.empty_like(bias_copy) if (has_bias and need_dbias) else q.new_empty(0)
    aux = [_handle(stats), rng_slot(rng_copy)] + ([_handle(bias_copy)] if has_bias else [])
    if softmax:
        aux.append(_handle(offset) if offset is not None else offset_slot(q.shape[-2]))
    doffset = torch.empty(1, q.shape[-2], 1, 1, dtype=torch.float32, device=q.device) if need_doffset else None
    do = do.contiguous()  # a local: the handle only borrows its memory
    call_bwd(c, qkv, [_handle(x) for x in qkv], _handle(o), _handle(do), None, None, aux,
             [_handle(x) for x in (dq, dk, dv)], dbias if dbias.numel() else None, (cu_q, cu_kv, cu_q_pad, cu_kv_pad),
             bias_copy if has_bias else None, doffset)
    return outs[0], outs[1], outs[2], dbias, (doffset if need_doffset else q.new_empty(0, dtype=torch.float32))


@fused_attn_bwd.register_fake
def _(q, k, v, o, do, stats, rng_copy, bias_copy, cu_q, cu_kv, cu_q_pad, cu_kv_pad, max_sq, max_skv, scale, dropout,
      layout, bias_type, mask, wl, wr, br, need_dbias, softmax=0, offset=None, need_doffset=False):
    has = bias_copy.numel() > 0 and need_dbias
    dbias = torch.empty_like(bias_copy) if has else q.new_empty(0)
    doffset = q.new_empty((1, q.shape[-2], 1, 1) if need_doffset else (0,), dtype=torch.float32)
    return _pk.fake_grads(layout, q, k, v, q.dtype) + (dbias, doffset)


# eager calls run the bodies directly (the dispatcher's custom-op path costs tens of microseconds)
fused_attn_fwd = eager_or_op(fused_attn_fwd)
fused_attn_bwd = eager_or_op(fused_attn_bwd)


class FusedAttnFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, bias, cu_q, cu_kv, cu_q_pad, cu_kv_pad, rng_state, offset, cfg):
        """cfg: (max_sq, max_skv, is_training, scale, dropout, layout, bias_type, mask, wl, wr, br[, softmax]);
        offset: the learnable softmax's float32 [1, h, 1, 1] (differentiable)."""
        (max_sq, max_skv, is_training, scale, dropout, layout, bias_type, mask, wl, wr, br) = cfg[:11]
        softmax = cfg[11] if len(cfg) > 11 else 0
        o, stats, rng_copy, bias_copy = fused_attn_fwd(q, k, v, bias, cu_q, cu_kv, cu_q_pad, cu_kv_pad, rng_state,
                                                       max_sq, max_skv, is_training, scale, dropout, layout,
                                                       bias_type, mask, wl, wr, br, softmax, offset)
        ctx.save_for_backward(q, k, v, o, stats, rng_copy, bias_copy, cu_q, cu_kv, cu_q_pad, cu_kv_pad, offset)
        ctx.cfg, ctx.softmax = cfg, softmax
        ctx.need_dbias = (bias is not None and bias.requires_grad and
                          bias_type in (int(BT.NVTE_PRE_SCALE_BIAS), int(BT.NVTE_POST_SCALE_BIAS)))
        ctx.need_doffset = offset is not None and offset.requires_grad
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, stats, rng_copy, bias_copy, cu_q, cu_kv, cu_q_pad, cu_kv_pad, offset = ctx.saved_tensors
        (max_sq, max_skv, _, scale, dropout, layout, bias_type, mask, wl, wr, br) = ctx.cfg[:11]
        dq, dk, dv, dbias, doffset = fused_attn_bwd(q, k, v, o, do, stats, rng_copy, bias_copy, cu_q, cu_kv,
                                                    cu_q_pad, cu_kv_pad, max_sq, max_skv, scale, dropout, layout,
                                                    bias_type, mask, wl, wr, br, ctx.need_dbias, ctx.softmax, offset,
                                                    ctx.need_doffset)
        dq, dk, dv = _pk.grads_from(layout, (dq, dk, dv), (q, k, v))
        return (dq, dk, dv, (dbias if ctx.need_dbias else None), None, None, None, None, None,
                doffset if ctx.need_doffset else None, None)


# ------------------------------------------------------------------ backend choice
def _env(name: str) -> Optional[str]:
    v = os.environ.get(name)
    return None if v is None or v == "" else v


_DEBUG_SEEN = set()
_DEBUG_LOG = logging.getLogger("transformer_engine.pytorch.attention")


def debugging() -> bool:
    """TE's NVTE_DEBUG=1 with NVTE_DEBUG_LEVEL >= 1: log which attention path runs (debug_log)."""
    return _env("NVTE_DEBUG") == "1" and int(_env("NVTE_DEBUG_LEVEL") or 0) >= 1


def debug_log(msg: str, q: Tensor, fmt: str, mask_type: str, bias_type: str) -> None:
    """The attention path a call takes and why (NVTE_DEBUG_LEVEL >= 2: with the call's dtype, shape,
    format, mask and bias type), on the logger "transformer_engine.pytorch.attention" (a stderr
    handler is added when it has none), each distinct message once per process."""
    if int(_env("NVTE_DEBUG_LEVEL") or 0) >= 2:
        msg = f"{msg}; {q.dtype} {list(q.shape)} {fmt}, mask {mask_type}, bias {bias_type}, device {q.device}"
    if msg in _DEBUG_SEEN:
        return
    _DEBUG_SEEN.add(msg)
    if not _DEBUG_LOG.handlers:
        _DEBUG_LOG.addHandler(logging.StreamHandler())
        _DEBUG_LOG.setLevel(logging.INFO)
    _DEBUG_LOG.info(msg)


def deterministic() -> bool:
    """NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 (TE's variable; default 1): the backward runs deterministic
    algorithms only (cuDNN's deterministic SDPA backward; the CPU backend always is)."""
    return _env("NVTE_ALLOW_NONDETERMINISTIC_ALGO") == "0"


def unfused_allowed() -> bool:
    return _env("NVTE_UNFUSED_ATTN") != "0"


def fused_backend_supports(q: Tensor, k: Tensor, v: Tensor, layout: int, bias_type: int, mask: int, dropout: float,
                           is_training: bool, max_sq: int, max_skv: int, wl: int, wr: int,
                           fp8: bool = False, br: bool = False, bias: Optional[Tensor] = None,
                           softmax: int = 0) -> Tuple[bool, str]:
    """(supported, reason) from nvte_get_fused_attn_backend for this configuration (fp8: Q, K, V
    will be passed as float8_e4m3). The query has no tensors and answers for the GPU when the
    library has one; host tensors run the CPU reference, which takes every configuration the
    adapter passes (the call itself reports anything else). TE's query has no alignment argument
    and no tensors: a left window on a non-causal mask aligned to the bottom-right diagonal (br)
    and a paged K/V cache (cuDNN takes power-of-two page sizes only) are asked of the forward
    workspace query, which sees them (and reports NOT_SUPPORTED as the call would)."""
    if q.dtype not in _DT or k.dtype not in _DT or v.dtype not in _DT:
        return False, f"dtype {q.dtype} is not supported by fused attention"
    # With NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 a training call also asks the backward's workspace query
    # with deterministic set: cuDNN decides when it builds that graph (which the backward then
    # reuses), and a refusal must send the call to the unfused path before its forward runs, as
    # TE's backend filter does. (The CPU reference is deterministic: its query accepts.)
    det = is_training and deterministic()
    if q.device.type == "cpu":
        if not det:
            return True, ""
        ok, why = True, ""
    else:
        qdt, kdt = (_nvte.DType.kFloat8E4M3,) * 2 if fp8 else (_DT[q.dtype], _DT[k.dtype])
        ok, why = _backend_answer(q.device.index, is_training, qdt, kdt, layout, bias_type, mask, dropout,
                                  q.shape[-2], k.shape[-2], max_sq, max_skv, q.shape[-1], v.shape[-1], wl, wr, softmax)
    # asked of the forward workspace query, which sees the tensors: a bottom-right window (TE's query
    # has no alignment argument) and a paged cache (its page size); and the deterministic backward's
    # (FP8: the deterministic question only, of the FP8 backward unless NVTE_FP8_DPA_BWD=0 makes it
    # the high-precision one; the support rules answered the rest)
    if ok and (det or (not fp8 and ((br and wl >= 0 and mask in _NON_CAUSAL) or layout in _PAGED))):
        fp8_graph = fp8 and _env("NVTE_FP8_DPA_BWD") != "0"
        b4 = None if bias is None else (bias.shape if bias.dim() == 4 else (1, *bias.shape[-3:]))
        key = (q.device.index, q.dtype, *((tuple(x.shape), x.stride()) for x in (q, k, v)), b4, layout,
               bias_type, mask, dropout, is_training, max_sq, max_skv, wl, wr, br, softmax, det, fp8_graph)
        answer = _WORKSPACE_ANSWERS.get(key)
        if answer is None:  # asked once per configuration (a forward asks every time)
            if len(_WORKSPACE_ANSWERS) >= _MAX_WORKSPACE_ANSWERS:  # (shapes that never repeat, e.g. THD steps)
                _WORKSPACE_ANSWERS.clear()
            answer = _WORKSPACE_ANSWERS[key] = _workspace_answer(q, k, v, bias, b4, layout, bias_type, mask, dropout,
                                                               is_training, max_sq, max_skv, wl, wr, br, softmax, det,
                                                               fp8_graph)
        return answer
    return ok, why


_NON_CAUSAL = (int(M.NVTE_NO_MASK), int(M.NVTE_PADDING_MASK))
_PAGED = frozenset(int(v) for n, v in L.__members__.items() if n.startswith("NVTE_Paged_KV_"))
_WORKSPACE_ANSWERS = {}
_MAX_WORKSPACE_ANSWERS = 1024


def _workspace_answer(q, k, v, bias, b4, layout, bias_type, mask, dropout, is_training, max_sq, max_skv,
                      wl, wr, br, softmax=0, det=False, fp8=False) -> Tuple[bool, str]:
    """The forward workspace query's answer for a call (the bias in the call's form: [b or 1, h, sq,
    skv] in q's dtype); det: and the deterministic backward's (the bias standing for its gradient,
    which has its shape). fp8: of the FP8 graphs (Q, K, V described as float8_e4m3 of the same
    shapes: the queries read no data; they size TE's HYBRID recipe's graphs)."""
    if bias is not None:
        bias = bias.reshape(b4).to(q.dtype)
    if fp8:
        e4m3 = _nvte.DType.kFloat8E4M3
        H = [_ops._make(x.data_ptr(), x.shape, e4m3) for x in (q, k, v)]
    else:
        H = [_handle(x) for x in (q, k, v)]
    enums = _enums(layout, bias_type, mask, softmax)
    try:
        _nvte.fused_attn_fwd_workspace_size(*H, _handle(bias), max_sq, max_skv, is_training, False, dropout, *enums,
                                            wl, wr, br)
        if det:
            _nvte.fused_attn_bwd_workspace_size(*H, _handle(bias), max_sq, max_skv, dropout, *enums, wl, wr, br, True)
    except _nvte.Error as e:  # (any other error: the call reports it)
        if len(e.args) > 1 and e.args[1] == int(_nvte.Status.NOT_SUPPORTED):
            return False, e.args[0]
    return True, ""


@functools.lru_cache(maxsize=1024)
def _backend_answer(device_index, is_training, qdt, kdt, layout, bias_type, mask, dropout, h, g, max_sq, max_skv,
                    d_qk, d_v, wl, wr, softmax=0) -> Tuple[bool, str]:
    """nvte_get_fused_attn_backend's answer, asked once per configuration and device (a forward asks
    every time, and the answer depends only on these)."""
    be = _nvte.get_fused_attn_backend(is_training, qdt, kdt, L(layout), BT(bias_type), M(mask),
                                      ST(softmax), dropout, h, g, max_sq, max_skv, d_qk, d_v, wl, wr)
    if be == _nvte.NVTE_Fused_Attn_Backend.NVTE_No_Backend:
        return False, _nvte.get_last_error()
    return True, ""


def want_fused(device: torch.device, needs_fused: bool) -> bool:
    """Whether to try the fused path (before asking the library whether it supports the call)."""
    env = _env("NVTE_FUSED_ATTN")
    if env == "0":
        return False
    if device.type == "cuda" or env == "1" or needs_fused or not unfused_allowed():
        return True
    return False


def padding_to_cu_seqlens(attention_mask: Tensor, b: int, s: int, what: str) -> Optional[Tensor]:
    """int32 cu_seqlens [b + 1] from a padding mask ([b, 1, 1, s] or [b, s], True = masked out) whose
    valid tokens come first in every sequence; None when the mask is not of that form."""
    m = attention_mask
    if m.dim() == 4:
        m = m.reshape(m.shape[0], m.shape[-1])
    if tuple(m.shape) != (b, s):
        raise ValueError(f"{what} padding mask has shape {tuple(attention_mask.shape)}; expected [{b}, 1, 1, {s}]")
    m = m.bool()
    lens = (~m).sum(-1)
    prefix = torch.arange(s, device=m.device)[None, :] >= lens[:, None]
    if not torch.equal(prefix, m):  # not right-padded: only the unfused path can apply it
        return None
    cu = torch.zeros(b + 1, dtype=torch.int32, device=m.device)
    cu[1:] = torch.cumsum(lens, 0).to(torch.int32)
    return cu


class TensorMemo:
    """Results derived from a tensor on the host (a device synchronization each on the GPU),
    remembered for the same unchanged tensor: a model passes one padding mask or one cu_seqlens to
    all its layers. Keyed on the tensor object itself (a weak reference: a freed tensor's entry never
    matches a new tensor at the same address), its version counter (in-place writes bump it; writes
    through .data do not, as for autograd) and the caller's key; the last `entries` are kept. Not
    while torch.compile traces (no host state there) nor for inference tensors (no version
    counter). A remembered result is shared between the calls that ask for it: never write it."""

    def __init__(self, entries: int):
        self.entries, self.rows = entries, []  # (weakrefs, versions, key, result), newest first

    def get(self, t, key, compute):
        """t: a tensor, or a tuple of tensors (None entries allowed) that must all be unchanged."""
        ts = tuple(x for x in (t if isinstance(t, tuple) else (t,)) if x is not None)
        if torch.compiler.is_compiling() or any(x.is_inference() for x in ts):
            return compute()
        ver = tuple(x._version for x in ts)
        for i, (refs, v, k, result) in enumerate(self.rows):
            if v == ver and k == key and len(refs) == len(ts) and all(r() is x for r, x in zip(refs, ts)):
                if i:
                    self.rows.insert(0, self.rows.pop(i))
                return result
        result = compute()
        self.rows.insert(0, (tuple(weakref.ref(x) for x in ts), ver, key, result))
        del self.rows[self.entries:]
        return result


_mask_cu = TensorMemo(8)


def padding_to_cu_seqlens_cached(attention_mask: Tensor, device, b: int, s: int, what: str) -> Optional[Tensor]:
    """padding_to_cu_seqlens(attention_mask.to(device), ...), remembered per unchanged mask (TensorMemo)."""
    return _mask_cu.get(attention_mask, (device, b, s),
                        lambda: padding_to_cu_seqlens(attention_mask.to(device), b, s, what))


def new_rng_state(device: torch.device) -> Tensor:
    """(seed, offset) for the library's dropout, drawn from torch's generator of the device."""
    seed = torch.randint(0, 2 ** 62, (1,), dtype=torch.int64, device=device)
    return torch.cat([seed, torch.zeros(1, dtype=torch.int64, device=device)])
