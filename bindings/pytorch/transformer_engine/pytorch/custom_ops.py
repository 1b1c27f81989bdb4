"""The adapter's ops registered with torch.library.custom_op (namespace "transformer_engine").

Each op wraps one function of `_ops` (which makes the library call) behind a signature of plain
tensors, numbers, strings and dtypes, and has a `register_fake` implementation that only
produces outputs of the right shape and dtype. The modules' torch.autograd.Functions call these
ops, so torch.compile (dynamo + AOTAutograd) sees each library call as one opaque node and traces
forward and backward without graph breaks. Buffers a call writes in place (amax histories,
scales) are declared in `mutates_args`, so functionalization orders them correctly.

FP8 tensors cross the op boundary as three tensors: rowwise data (uint8 [rows, cols]),
transposed data (uint8 [cols, rows]) and scale_inv (float32 [1]), plus the FP8 dtype as an int
(a DType value; -1 marks a high-precision operand). A missing buffer is a 1-D empty uint8
placeholder, since a custom op cannot return None. An FP8 result that goes on to another module
(gemm_fp8_output, the recipe's fp8_mha) is returned as one FP8 hand-off tensor (fp8_handoff.py:
the bytes and scale_inv in one float32 buffer), since the outputs of a custom op may not alias
each other.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import Tensor
from torch.library import custom_op

from . import _ops, _ops_softmax
from .fp8_handoff import handoff_parts, handoff_words, new_handoff

__all__ = ["quantize", "dequantize", "gemm", "gemm_accumulate", "gemm_fp8_output", "transpose", "grouped_gemm", "layernorm_fwd",
           "layernorm_bwd", "norm_fwd_fp8", "rmsnorm_fwd", "rmsnorm_bwd", "activation",
           "dactivation", "softmax_forward", "softmax_backward", "attn_softmax_forward", "attn_softmax_backward",
           "delayed_scaling_update", "HIGH_PRECISION_OPERAND",
           "missing", "eager_or_op"]

HIGH_PRECISION_OPERAND = -1
_DTYPES = {int(v): v for v in _ops.DType.__members__.values()}


def _dtype(value: int):
    """The DType of an int argument: a lookup, cheaper than the binding enum's constructor."""
    d = _DTYPES.get(value)
    return _ops.DType(value) if d is None else d


def missing(device) -> Tensor:
    """The placeholder for an absent FP8 buffer (1-D, empty)."""
    return torch.empty(0, dtype=torch.uint8, device=device)


def _present(t: Optional[Tensor]) -> bool:
    return t is not None and t.dim() == 2


def _rows_cols(x: Tensor) -> Tuple[int, int]:
    if x.dim() == 0:
        return 1, 1
    cols = x.shape[-1]
    return (x.numel() // cols if cols else 0), cols


def _fp8_tensor(data: Tensor, transpose: Optional[Tensor], scale_inv: Tensor, fp8_dtype: int) -> _ops.FP8Tensor:
    transpose = transpose if _present(transpose) else None
    if _present(data):
        shape = data.shape
    else:
        data, shape = None, (transpose.shape[1], transpose.shape[0])
    return _ops.FP8Tensor(data, transpose, scale_inv, _dtype(fp8_dtype), shape)


def _operand(t: Tensor, t_transpose: Optional[Tensor], scale_inv: Optional[Tensor], fp8_dtype: int):
    if fp8_dtype == HIGH_PRECISION_OPERAND:
        return t
    return _fp8_tensor(t, t_transpose, scale_inv, fp8_dtype)


def _logical_shape(t: Tensor, t_transpose: Optional[Tensor], fp8_dtype: int) -> Tuple[int, int]:
    if fp8_dtype == HIGH_PRECISION_OPERAND or _present(t):
        return tuple(t.shape)
    return t_transpose.shape[1], t_transpose.shape[0]


# ------------------------------------------------------------------------------ quantization
@custom_op("transformer_engine::quantize", mutates_args=("amax_history",))
def quantize(x: Tensor, scale: Optional[Tensor], amax_history: Optional[Tensor], index: int, fp8_dtype: int,
             rowwise: bool, columnwise: bool, with_dbias: bool, force_pow2_scales: bool,
             amax_epsilon: float) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """FP8 cast of x viewed as [rows, cols] -> (data, transpose, scale_inv, dbias).

    Delayed scaling (scale given): uses scale[index] and max-accumulates |x| into
    amax_history[0, index]. Current scaling (scale None): the scale comes from x's own amax
    (force_pow2_scales / amax_epsilon apply), which is written to amax_history[0, index] when a
    history is given (seeding a delayed-scaling history). with_dbias also returns the column sums
    of x."""
    fdt = _dtype(fp8_dtype)
    if scale is None:
        res = _ops.quantize_current_scaling(x, fdt, rowwise, columnwise, force_pow2_scales, amax_epsilon,
                                            dbias=with_dbias, amax_history=amax_history,
                                            slot=index if amax_history is not None else None)
    elif with_dbias:
        res = _ops.quantize_dbias(x, scale, amax_history, fdt, rowwise, columnwise, slot=index)
    else:
        res = _ops.quantize(x, scale, amax_history, fdt, rowwise, columnwise, slot=index)
    q, db = res if with_dbias else (res, None)
    return (q.data if q.data is not None else missing(x.device),
            q.transpose if q.transpose is not None else missing(x.device),
            q.scale_inv, db if db is not None else torch.empty(0, dtype=x.dtype, device=x.device))


@quantize.register_fake
def _(x, scale, amax_history, index, fp8_dtype, rowwise, columnwise, with_dbias, force_pow2_scales, amax_epsilon):
    rows, cols = _rows_cols(x)
    u8 = torch.uint8
    return (x.new_empty((rows, cols), dtype=u8) if rowwise else x.new_empty((0,), dtype=u8),
            x.new_empty((cols, rows), dtype=u8) if columnwise else x.new_empty((0,), dtype=u8),
            x.new_empty((1,), dtype=torch.float32),
            x.new_empty((cols,) if with_dbias else (0,)))


@custom_op("transformer_engine::quantize_many", mutates_args=("amax_history",))
def quantize_many(xs: List[Tensor], scale: Tensor, amax_history: Tensor, index: int,
                  fp8_dtype: int) -> Tuple[Tensor, Tensor]:
    """Delayed-scaling FP8 casts of several tensors with scale[index], max-accumulating all their
    amaxes into amax_history[0, index], in one library call -> (uint8 [sum of numels]: the casts
    one after the other, scale_inv [1])."""
    return _ops.quantize_many([x.contiguous() for x in xs], scale, amax_history, _dtype(fp8_dtype), index)


@quantize_many.register_fake
def _(xs, scale, amax_history, index, fp8_dtype):
    return xs[0].new_empty((sum(x.numel() for x in xs),), dtype=torch.uint8), scale.new_empty((1,))


@custom_op("transformer_engine::dequantize", mutates_args=())
def dequantize(data: Tensor, scale_inv: Tensor, fp8_dtype: int, out_dtype: torch.dtype) -> Tensor:
    """High-precision value of FP8 data (uint8 [rows, cols]) with its scale_inv, in out_dtype."""
    return _ops.dequantize(_ops.FP8Tensor(data, None, scale_inv, _dtype(fp8_dtype), tuple(data.shape)), out_dtype)


@dequantize.register_fake
def _(data, scale_inv, fp8_dtype, out_dtype):
    return data.new_empty(tuple(data.shape), dtype=out_dtype)


@custom_op("transformer_engine::delayed_scaling_update", mutates_args=("amax_history", "scale"))
def delayed_scaling_update(amax_history: Tensor, scale: Tensor, amax_compute_algo: str, fp8_dtype: int,
                           margin: float) -> None:
    """In place: one delayed-scaling step (roll the history, recompute the scales) in the library."""
    _ops.delayed_scaling_update(amax_history, scale, amax_compute_algo, _dtype(fp8_dtype), margin)


@delayed_scaling_update.register_fake
def _(amax_history, scale, amax_compute_algo, fp8_dtype, margin):
    return None


# -------------------------------------------------------------------------------------- GEMM
@custom_op("transformer_engine::gemm", mutates_args=())
def gemm(A: Tensor, A_transpose: Optional[Tensor], A_scale_inv: Optional[Tensor], A_fp8_dtype: int,
         B: Tensor, B_transpose: Optional[Tensor], B_scale_inv: Optional[Tensor], B_fp8_dtype: int,
         out_dtype: torch.dtype, transa: bool, transb: bool, bias: Optional[Tensor], gelu: bool,
         dbias: bool) -> Tuple[Tensor, Tensor]:
    """D = op(B) @ op(A) (TE's convention, see _ops.gemm) -> (D, aux).

    gelu: forward GELU epilogue, aux = the pre-activation; dbias: backward epilogue, aux = the bias
    gradient (one value per row of D) in out_dtype (gelu is ignored then); else aux is empty (one
    output for both epilogues: an unused output is still an allocation per call)."""
    a = _operand(A, A_transpose, A_scale_inv, A_fp8_dtype)
    b = _operand(B, B_transpose, B_scale_inv, B_fp8_dtype)
    if dbias:  # one value per row of D (n = rows of op(B))
        n = _logical_shape(B, B_transpose, B_fp8_dtype)[1 if transb else 0]
        db = torch.empty(n, dtype=out_dtype, device=A.device)
        return _ops.gemm(a, b, out_dtype, transa, transb, bias=db, grad=True), db
    res = _ops.gemm(a, b, out_dtype, transa, transb, bias=bias, gelu=gelu)
    return res if gelu else (res, A.new_empty(0, dtype=out_dtype))


@gemm.register_fake
def _(A, A_transpose, A_scale_inv, A_fp8_dtype, B, B_transpose, B_scale_inv, B_fp8_dtype, out_dtype, transa, transb,
      bias, gelu, dbias):
    ashape = _logical_shape(A, A_transpose, A_fp8_dtype)
    bshape = _logical_shape(B, B_transpose, B_fp8_dtype)
    m = ashape[0] if transa else ashape[1]
    n = bshape[1] if transb else bshape[0]
    aux = (n,) if dbias else ((n, m) if gelu else (0,))
    return A.new_empty((n, m), dtype=out_dtype), A.new_empty(aux, dtype=out_dtype)


@custom_op("transformer_engine::gemm_accumulate", mutates_args=("out",))
def gemm_accumulate(A: Tensor, A_transpose: Optional[Tensor], A_scale_inv: Optional[Tensor], A_fp8_dtype: int,
                    B: Tensor, B_transpose: Optional[Tensor], B_scale_inv: Optional[Tensor], B_fp8_dtype: int,
                    out: Tensor, transa: bool, transb: bool, dbias: bool,
                    dbias_dtype: Optional[torch.dtype] = None, accumulate: bool = True) -> Tensor:
    """out += op(B) @ op(A) in one GEMM (C = D = out: fuse_wgrad_accumulation's main_grad; out =
    with accumulate=False) -> the
    bias gradient of op(B) with dbias (the backward epilogue; dtype dbias_dtype: out's, float32 or
    bfloat16 (gemm.h), default out's), else an empty tensor."""
    a = _operand(A, A_transpose, A_scale_inv, A_fp8_dtype)
    b = _operand(B, B_transpose, B_scale_inv, B_fp8_dtype)
    db = None
    if dbias:
        n = _logical_shape(B, B_transpose, B_fp8_dtype)[1 if transb else 0]
        db = torch.empty(n, dtype=dbias_dtype or out.dtype, device=out.device)
    _ops.gemm(a, b, out.dtype, transa, transb, bias=db, grad=dbias, out=out, accumulate=accumulate)
    return db if dbias else out.new_empty(0)


@gemm_accumulate.register_fake
def _(A, A_transpose, A_scale_inv, A_fp8_dtype, B, B_transpose, B_scale_inv, B_fp8_dtype, out, transa, transb,
      dbias, dbias_dtype=None, accumulate=True):
    bshape = _logical_shape(B, B_transpose, B_fp8_dtype)
    return out.new_empty((bshape[1] if transb else bshape[0]) if dbias else 0,
                         dtype=(dbias_dtype or out.dtype) if dbias else out.dtype)


@custom_op("transformer_engine::batched_gemm", mutates_args=())
def batched_gemm(A: Tensor, B: Tensor, transa: bool, transb: bool) -> Tensor:
    """D[i] = op(B[i]) @ op(A[i]) over [batch, rows, cols] stacks (_ops.batched_gemm)."""
    return _ops.batched_gemm(A, B, transa, transb)


@batched_gemm.register_fake
def _(A, B, transa, transb):
    m = A.shape[1] if transa else A.shape[2]
    n = B.shape[2] if transb else B.shape[1]
    return A.new_empty((A.shape[0], n, m))


@custom_op("transformer_engine::gemm_fp8_output", mutates_args=("scale", "amax_history"))
def gemm_fp8_output(A: Tensor, A_transpose: Optional[Tensor], A_scale_inv: Tensor, A_fp8_dtype: int, B: Tensor,
                    B_transpose: Optional[Tensor], B_scale_inv: Tensor, B_fp8_dtype: int, out_fp8_dtype: int,
                    scale: Tensor, amax_history: Tensor, index: int, transa: bool, transb: bool,
                    bias: Optional[Tensor], seed: bool) -> Tensor:
    """D = op(B) @ op(A) (+ bias) of FP8 operands, written in FP8 (format out_fp8_dtype, delayed
    scaling: scale[index], |D| max-accumulated into amax_history[0, index]) -> the FP8 hand-off
    (fp8_handoff.py) holding D's bytes [n, m] and scale_inv. seed (the slot's empty history: its
    initial scale would flush small gradients): a first run measures |D|'s amax, which sets
    scale[index] (current scaling), then D is written with it."""
    ashape = _logical_shape(A, A_transpose, A_fp8_dtype)
    bshape = _logical_shape(B, B_transpose, B_fp8_dtype)
    m = ashape[0] if transa else ashape[1]
    n = bshape[1] if transb else bshape[0]
    h = new_handoff(n, m, A_scale_inv.device)
    data, si = handoff_parts(h, n, m)
    a, b = _operand(A, A_transpose, A_scale_inv, A_fp8_dtype), _operand(B, B_transpose, B_scale_inv, B_fp8_dtype)
    for run in range(2 if seed else 1):
        if run:
            _ops.scale_from_history(data, _dtype(out_fp8_dtype), scale, amax_history, index)
        _ops.gemm_fp8_output(a, b, data, si, _dtype(out_fp8_dtype), scale, amax_history, index, transa, transb, bias)
    return h


@gemm_fp8_output.register_fake
def _(A, A_transpose, A_scale_inv, A_fp8_dtype, B, B_transpose, B_scale_inv, B_fp8_dtype, out_fp8_dtype, scale,
      amax_history, index, transa, transb, bias, seed):
    ashape = _logical_shape(A, A_transpose, A_fp8_dtype)
    bshape = _logical_shape(B, B_transpose, B_fp8_dtype)
    m = ashape[0] if transa else ashape[1]
    n = bshape[1] if transb else bshape[0]
    return A_scale_inv.new_empty((handoff_words(n, m),), dtype=torch.float32)


@custom_op("transformer_engine::transpose", mutates_args=())
def transpose(x: Tensor) -> Tensor:
    """The transpose [cols, rows] of x [rows, cols] (e.g. FP8 bytes), by the library."""
    return _ops.transpose(x)


@transpose.register_fake
def _(x):
    rows, cols = _rows_cols(x)
    return x.new_empty((cols, rows))


@custom_op("transformer_engine::grouped_gemm", mutates_args=())
def grouped_gemm(A: List[Tensor], A_transpose: List[Tensor], A_scale_inv: List[Tensor], A_fp8_dtype: int,
                 B: List[Tensor], B_transpose: List[Tensor], B_scale_inv: List[Tensor], B_fp8_dtype: int,
                 out_dtype: torch.dtype, transa: bool, transb: bool, bias: List[Tensor],
                 dbias: bool) -> Tuple[List[Tensor], List[Tensor]]:
    """Independent GEMMs D_i = op(B_i) @ op(A_i) (one nvte_multi_tensor_gemm call) -> (D list, dbias list).

    Operands as in gemm, one list entry per GEMM (placeholders where a buffer is absent); bias:
    forward biases (an empty entry = none); dbias: return the bias gradients instead."""
    a = [_operand(t, tt, si, A_fp8_dtype) for t, tt, si in zip(A, A_transpose, A_scale_inv)]
    b = [_operand(t, tt, si, B_fp8_dtype) for t, tt, si in zip(B, B_transpose, B_scale_inv)]
    if dbias:
        dbs = [torch.empty(_logical_shape(t, tt, B_fp8_dtype)[1 if transb else 0], dtype=out_dtype, device=t.device)
               for t, tt in zip(B, B_transpose)]
        return _ops.multi_gemm(a, b, out_dtype, transa, transb, dbs, grad=True), dbs
    biases = [t if t.numel() else None for t in bias] if bias else None
    return _ops.multi_gemm(a, b, out_dtype, transa, transb, biases), []


@grouped_gemm.register_fake
def _(A, A_transpose, A_scale_inv, A_fp8_dtype, B, B_transpose, B_scale_inv, B_fp8_dtype, out_dtype, transa, transb,
      bias, dbias):
    outs, dbs = [], []
    for a, at, b, bt in zip(A, A_transpose, B, B_transpose):
        ashape, bshape = _logical_shape(a, at, A_fp8_dtype), _logical_shape(b, bt, B_fp8_dtype)
        m, n = (ashape[0] if transa else ashape[1]), (bshape[1] if transb else bshape[0])
        outs.append(a.new_empty((n, m), dtype=out_dtype))
        if dbias:
            dbs.append(a.new_empty((n,), dtype=out_dtype))
    return outs, dbs


# ----------------------------------------------------------------------------- normalization
@custom_op("transformer_engine::layernorm_fwd", mutates_args=())
def layernorm_fwd(x: Tensor, gamma: Tensor, beta: Tensor, eps: float,
                  zero_centered_gamma: bool) -> Tuple[Tensor, Tensor, Tensor]:
    """LayerNorm over the last dim -> (z [rows, cols], mu [rows], rsigma [rows])."""
    return _ops.layernorm_fwd(x, gamma, beta, eps, zero_centered_gamma)


@layernorm_fwd.register_fake
def _(x, gamma, beta, eps, zero_centered_gamma):
    rows, cols = _rows_cols(x)
    return (x.new_empty((rows, cols)), x.new_empty((rows,), dtype=torch.float32),
            x.new_empty((rows,), dtype=torch.float32))


@custom_op("transformer_engine::layernorm_bwd", mutates_args=())
def layernorm_bwd(dz: Tensor, x: Tensor, mu: Tensor, rsigma: Tensor, gamma: Tensor,
                  zero_centered_gamma: bool) -> Tuple[Tensor, Tensor, Tensor]:
    """-> (dx [rows, cols], dgamma, dbeta)."""
    return _ops.layernorm_bwd(dz, x, mu, rsigma, gamma, zero_centered_gamma)


@layernorm_bwd.register_fake
def _(dz, x, mu, rsigma, gamma, zero_centered_gamma):
    return x.new_empty(_rows_cols(x)), torch.empty_like(gamma), torch.empty_like(gamma)


@custom_op("transformer_engine::norm_fwd_fp8", mutates_args=("amax_history",))
def norm_fwd_fp8(x: Tensor, gamma: Tensor, beta: Optional[Tensor], eps: float, zero_centered_gamma: bool,
                 scale: Tensor, amax_history: Tensor, index: int, fp8_dtype: int,
                 columnwise: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """LayerNorm (beta given) or RMSNorm (beta None) with its output cast to FP8 in the same kernel
    (delayed scaling: scale[index], |z| max-accumulated into amax_history[0, index]) -> (data,
    transpose (or the placeholder), scale_inv, mu (empty for RMSNorm), rsigma)."""
    fp8 = (scale, amax_history, _dtype(fp8_dtype), columnwise, index)
    if beta is None:
        q, rs = _ops.rmsnorm_fwd(x, gamma, eps, zero_centered_gamma, fp8=fp8)
        mu = torch.empty(0, dtype=torch.float32, device=x.device)
    else:
        q, mu, rs = _ops.layernorm_fwd(x, gamma, beta, eps, zero_centered_gamma, fp8=fp8)
    return (q.data, q.transpose if q.transpose is not None else missing(x.device), q.scale_inv, mu, rs)


@norm_fwd_fp8.register_fake
def _(x, gamma, beta, eps, zero_centered_gamma, scale, amax_history, index, fp8_dtype, columnwise):
    rows, cols = _rows_cols(x)
    u8, f32 = torch.uint8, torch.float32
    return (x.new_empty((rows, cols), dtype=u8),
            x.new_empty((cols, rows), dtype=u8) if columnwise else x.new_empty((0,), dtype=u8),
            x.new_empty((1,), dtype=f32), x.new_empty((0,) if beta is None else (rows,), dtype=f32),
            x.new_empty((rows,), dtype=f32))


@custom_op("transformer_engine::rmsnorm_fwd", mutates_args=())
def rmsnorm_fwd(x: Tensor, gamma: Tensor, eps: float, zero_centered_gamma: bool) -> Tuple[Tensor, Tensor]:
    """RMSNorm over the last dim -> (z [rows, cols], rsigma [rows])."""
    return _ops.rmsnorm_fwd(x, gamma, eps, zero_centered_gamma)


@rmsnorm_fwd.register_fake
def _(x, gamma, eps, zero_centered_gamma):
    rows, cols = _rows_cols(x)
    return x.new_empty((rows, cols)), x.new_empty((rows,), dtype=torch.float32)


@custom_op("transformer_engine::rmsnorm_bwd", mutates_args=())
def rmsnorm_bwd(dz: Tensor, x: Tensor, rsigma: Tensor, gamma: Tensor,
                zero_centered_gamma: bool) -> Tuple[Tensor, Tensor]:
    """-> (dx [rows, cols], dgamma)."""
    return _ops.rmsnorm_bwd(dz, x, rsigma, gamma, zero_centered_gamma)


@rmsnorm_bwd.register_fake
def _(dz, x, rsigma, gamma, zero_centered_gamma):
    return x.new_empty(_rows_cols(x)), torch.empty_like(gamma)


# ------------------------------------------------------------------------------- activations
@custom_op("transformer_engine::activation", mutates_args=())
def activation(x: Tensor, name: str) -> Tensor:
    """The library activation `name` (gated ones halve the last dimension)."""
    return _ops.activation(name, x)


@activation.register_fake
def _(x, name):
    cols = x.shape[-1] // 2 if name in _ops.GATED_ACTIVATIONS else x.shape[-1]
    return x.new_empty(tuple(x.shape[:-1]) + (cols,))


@custom_op("transformer_engine::dactivation", mutates_args=())
def dactivation(grad: Tensor, x: Tensor, name: str) -> Tensor:
    """Input gradient of activation(x, name)."""
    return _ops.dactivation(name, grad, x)


@dactivation.register_fake
def _(grad, x, name):
    return torch.empty_like(x)


# ----------------------------------------------------------------------------------- softmax
@custom_op("transformer_engine::softmax_forward", mutates_args=())
def softmax_forward(x: Tensor, kind: str, scale: float, mask: Optional[Tensor]) -> Tensor:
    """Fused scaled (masked) softmax over the last dim, see _ops_softmax.softmax_forward."""
    return _ops_softmax.softmax_forward(kind, x, scale, mask)


@softmax_forward.register_fake
def _(x, kind, scale, mask):
    return torch.empty_like(x)


@custom_op("transformer_engine::softmax_backward", mutates_args=())
def softmax_backward(dy: Tensor, y: Tensor, kind: str, scale: float) -> Tensor:
    return _ops_softmax.softmax_backward(kind, dy, y, scale)


@softmax_backward.register_fake
def _(dy, y, kind, scale):
    return torch.empty_like(y)


@custom_op("transformer_engine::attn_softmax_forward", mutates_args=())
def attn_softmax_forward(x: Tensor, scale: float, bias_type: str, bias: Optional[Tensor],
                         alibi_slopes: Optional[Tensor], alibi_diagonal: Optional[Tensor], mask: Optional[Tensor],
                         causal: str, offset: Optional[Tensor], out_dtype: torch.dtype) -> Tuple[Tensor, Tensor]:
    """(y, sink_probs) of _ops_softmax.attn_softmax_forward; sink_probs empty without offset."""
    y, sink = _ops_softmax.attn_softmax_forward(x, scale, bias_type, bias, alibi_slopes, alibi_diagonal, mask, causal,
                                        offset, out_dtype)
    return y, (sink if sink is not None else x.new_empty(0, dtype=torch.float32))


@attn_softmax_forward.register_fake
def _(x, scale, bias_type, bias, alibi_slopes, alibi_diagonal, mask, causal, offset, out_dtype):
    sink = x.new_empty(x.shape[:3] if offset is not None else (0,), dtype=torch.float32)
    return torch.empty_like(x, dtype=out_dtype), sink


@custom_op("transformer_engine::attn_softmax_backward", mutates_args=())
def attn_softmax_backward(dy: Tensor, y: Tensor, mask: Optional[Tensor], sink_probs: Optional[Tensor],
                          scale: float, logit_grads: bool, causal: str) -> Tuple[Tensor, Tensor, Tensor]:
    """(dx, logit grads, per-row sink grads) of _ops_softmax.attn_softmax_backward; the last two empty when not asked."""
    dx, lg, dsink = _ops_softmax.attn_softmax_backward(dy, y, mask, sink_probs, scale, logit_grads, causal)
    empty = dy.new_empty(0)
    return dx, (lg if lg is not None else empty), (dsink if dsink is not None else empty.float())


@attn_softmax_backward.register_fake
def _(dy, y, mask, sink_probs, scale, logit_grads, causal):
    lg = torch.empty_like(dy) if logit_grads else dy.new_empty(0)
    dsink = torch.empty_like(sink_probs) if sink_probs is not None else dy.new_empty(0, dtype=torch.float32)
    return torch.empty_like(dy), lg, dsink


# ------------------------------------------------------------------ eager fast path
# argument types that need no further look (the common case is decided by one set lookup)
_LEAF_TYPES = frozenset((Tensor, torch.nn.Parameter, int, float, bool, str, torch.dtype, type(None)))


def _plain(args) -> bool:
    """True when every tensor among args (lists included) is a plain torch.Tensor or Parameter:
    eager execution, not dynamo / AOTAutograd tracing (fake or functional tensors) or a subclass."""
    for a in args:
        t = type(a)
        if t in _LEAF_TYPES:
            continue
        if isinstance(a, (list, tuple)):
            if not _plain(a):
                return False
        elif isinstance(a, Tensor):
            return False
    return True


class _NoGradCtx:
    """The ctx a Function's forward gets from run_function when autograd records nothing: what the
    forward keeps for a backward is dropped with it."""

    def save_for_backward(self, *tensors):
        pass

    def mark_non_differentiable(self, *tensors):
        pass

    def set_materialize_grads(self, value):
        pass


def run_function(fn, *args):
    """fn.apply(*args) (fn: a torch.autograd.Function); with grad mode off, in eager mode and with
    plain tensors, fn.forward itself. Function.apply's bookkeeping (argument unwrapping, the graph
    node it would not record anyway) costs several microseconds of host time per call, and a decode
    step of a TransformerLayer under torch.no_grad() makes about ten such calls."""
    if torch.is_grad_enabled() or torch.compiler.is_compiling() or not _plain(args):
        return fn.apply(*args)
    return fn.forward(_NoGradCtx(), *args)


def eager_or_op(op):
    """The registered op while tracing (torch.compile, or any tensor subclass), its Python body in
    eager mode (every op of the adapter, the fused-attention ones included). The dispatcher's
    custom-op path (argument schema checks, autograd and dynamo wrappers, redispatch) costs tens of
    microseconds of host time per call; in an FP8 layer, which makes twice the calls of a
    high-precision one (casts, recipe updates), that host time is what made small FP8 layers slower
    than BF16 ones on the GPU. The body is the same function the op runs, so results are identical."""
    impl = op._init_fn

    def call(*args, **kwargs):
        if torch.compiler.is_compiling() or not _plain(args) or (kwargs and not _plain(kwargs.values())):
            return op(*args, **kwargs)
        return impl(*args, **kwargs)

    call.__name__, call.__qualname__, call.__doc__ = impl.__name__, impl.__qualname__, impl.__doc__
    call.op = op
    return call


for _name in ("quantize", "quantize_many", "dequantize", "delayed_scaling_update", "gemm", "gemm_accumulate", "batched_gemm", "gemm_fp8_output", "transpose",
              "grouped_gemm", "layernorm_fwd", "layernorm_bwd", "norm_fwd_fp8", "rmsnorm_fwd", "rmsnorm_bwd", "activation", "dactivation", "softmax_forward",
              "softmax_backward", "attn_softmax_forward", "attn_softmax_backward"):
    globals()[_name] = eager_or_op(globals()[_name])
del _name
