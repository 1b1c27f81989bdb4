"""Thin functions over torch tensors, each making one call into transformer_engine._nvte.

The adapter holds no math: every function here validates its torch arguments (device,
dtype, contiguity), wraps the buffers into _nvte.Tensor handles (borrowing the torch
memory through data_ptr(); the caller keeps the tensors alive for the call) and makes exactly
one _nvte call. Tensors may live on the CPU (the library's CPU backend) or on a CUDA device
(the CUDA backend; the call is queued on torch's current stream).

These functions run for every library call of every layer, so they keep the host work small:
one binding call per handle (_nvte.Tensor.make), workspace sizes asked once per shape, FP8
scale / amax slots addressed by pointer instead of through tensor views.

FP8 data is held as torch.uint8 storage in an `FP8Tensor` together with its float32
scale_inv (the reciprocal of the scale it was produced with) and the FP8 format.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

from transformer_engine import _nvte

DType = _nvte.DType
Param = _nvte.Param

_TORCH_TO_NVTE = {
    torch.float32: DType.kFloat32,
    torch.float16: DType.kFloat16,
    torch.bfloat16: DType.kBFloat16,
    torch.uint8: DType.kByte,
    torch.int32: DType.kInt32,
    torch.int64: DType.kInt64,
}
HIGH_PRECISION = (torch.float32, torch.float16, torch.bfloat16)
FP8_DTYPES = (DType.kFloat8E4M3, DType.kFloat8E5M2)


# ------------------------------------------------------------------ helpers
_make = _nvte.Tensor.make  # a handle with all its buffers in one binding call


def _stream(t: torch.Tensor) -> int:
    if t.is_cuda:  # the raw pointer: torch.cuda.current_stream() builds a Stream object per call
        return torch._C._cuda_getCurrentRawStream(t.device.index)
    return 0


def _check(t: torch.Tensor, name: str, dtypes=None, device=None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if not (t.is_cuda or t.is_cpu):  # (flag reads: cheaper than t.device.type)
        raise ValueError(f"{name}: tensors must live on the CPU or a CUDA device, got device {t.device}")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"{name}: dtype {t.dtype} is not supported; expected one of "
                        f"{[str(d) for d in dtypes]}")
    if not t.is_contiguous():
        raise ValueError(f"{name}: tensor must be contiguous (call .contiguous() first)")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: tensor is on {t.device} but the other operands are on {device}")


def _as2d_shape(t: torch.Tensor) -> Tuple[int, int]:
    if t.dim() == 0:
        return 1, 1
    cols = t.shape[-1]
    rows = t.numel() // cols if cols else 0
    return rows, cols


def _tensor(data: torch.Tensor, shape=None):
    """An _nvte.Tensor whose rowwise data is the torch tensor `data` (viewed as `shape`)."""
    return _make(data.data_ptr(), data.shape if shape is None else shape, _TORCH_TO_NVTE[data.dtype])


_PERSISTENT = {}
_MAX_PERSISTENT = 512


def _persistent(data: Optional[torch.Tensor]):
    """_tensor(data) for tensors that outlive many calls (K/V caches, the per-iteration index
    buffers, a constant rng_state): the handle is kept, keyed by what it holds (address, shape,
    dtype), so a decode step does not make it again per layer and step. For read / write-data use
    only: callers must not set parameters (scales, amax) on it. None stays None."""
    if data is None:
        return None
    key = (data.data_ptr(), data.shape, data.dtype)
    h = _PERSISTENT.get(key)
    if h is None:
        if len(_PERSISTENT) >= _MAX_PERSISTENT:
            _PERSISTENT.clear()
        h = _PERSISTENT[key] = _tensor(data)
    return h


def _workspace(nbytes: int, device: torch.device):
    """A handle of a fresh nbytes buffer (None for 0 bytes); the handle keeps the buffer alive."""
    if nbytes <= 0:
        return None
    buf = torch.empty(int(nbytes), dtype=torch.uint8, device=device)
    nt = _tensor(buf)
    nt._refs = buf
    return nt


_WORKSPACE_BYTES = {}
_MAX_WORKSPACE_KEYS = 4096  # (shapes that never repeat must not grow the cache without bound)


def _workspace_bytes(key, query) -> int:
    """query() (a library workspace-size query), asked once per key: the sizes depend only on the
    shapes, dtypes and device the key names, and the queries cost a library call each."""
    n = _WORKSPACE_BYTES.get(key)
    if n is None:
        if len(_WORKSPACE_BYTES) >= _MAX_WORKSPACE_KEYS:
            _WORKSPACE_BYTES.clear()
        n = _WORKSPACE_BYTES[key] = query()
    return n


class FP8Tensor:
    """FP8 data (uint8 storage) of a logically 2D [rows, cols] tensor.

    data: uint8 [rows, cols] or None; transpose: uint8 [cols, rows] or None;
    scale_inv: float32 [1]; fp8_dtype: DType.kFloat8E4M3 / kFloat8E5M2."""

    __slots__ = ("data", "transpose", "scale_inv", "fp8_dtype", "shape")

    def __init__(self, data, transpose, scale_inv, fp8_dtype, shape):
        self.data = data
        self.transpose = transpose
        self.scale_inv = scale_inv
        self.fp8_dtype = fp8_dtype
        self.shape = tuple(shape)

    @property
    def device(self):
        return self.scale_inv.device

    def nvte(self, rowwise: bool = True, columnwise: bool = True):
        """Handle with the requested buffers (those that exist)."""
        d = self.data if rowwise else None
        t = self.transpose if columnwise else None
        if d is None and t is None:
            return _nvte.Tensor()
        return _make(0 if d is None else d.data_ptr(), None if d is None else d.shape, self.fp8_dtype,
                     self.scale_inv.data_ptr(), 0 if t is None else t.data_ptr(), None if t is None else t.shape)

    def drop_rowwise(self) -> None:
        """Free the rowwise buffer (keep the transpose, e.g. for a backward GEMM)."""
        if self.transpose is not None:
            self.data = None


def _slot_ptr(t: torch.Tensor, slot: int) -> int:
    """Address of element `slot` of a contiguous float32 buffer (of row 0 for an amax history)."""
    return t.data_ptr() + 4 * slot


def _history_slot_ptr(hist: torch.Tensor, slot: int) -> int:
    """Address of amax history [len, n] element [0, slot] (float32 on the cast's device: checked by
    the caller), after checking that the slot exists."""
    if hist.dim() != 2 or not 0 <= slot < hist.shape[1]:
        raise ValueError(f"amax slot {slot} needs an amax history [len, > {slot}], got shape {tuple(hist.shape)}")
    return _slot_ptr(hist, slot)


def _meta_ptrs(scale: torch.Tensor, amax: Optional[torch.Tensor], device, slot: Optional[int] = None):
    """(scale pointer, amax pointer or 0) of a delayed-scaling cast. slot None: scale and amax are
    float32 [1]. slot i: scale is float32 [n] and amax an amax history float32 [len, n]; the cast
    uses scale[i] and max-accumulates into amax[0, i] (addressed directly, without making views)."""
    _check(scale, "scale", (torch.float32,), device)
    if amax is not None:
        _check(amax, "amax", (torch.float32,), device)
    if slot is None:
        if scale.numel() != 1:
            raise ValueError(f"scale must hold one element, got shape {tuple(scale.shape)}")
        if amax is not None and amax.numel() != 1:
            raise ValueError(f"amax must hold one element, got shape {tuple(amax.shape)}")
        return scale.data_ptr(), 0 if amax is None else amax.data_ptr()
    if not 0 <= slot < scale.numel():
        raise ValueError(f"scale slot {slot} is out of range for scales of shape {tuple(scale.shape)}")
    return _slot_ptr(scale, slot), 0 if amax is None else _history_slot_ptr(amax, slot)


def _fp8_output(rows, cols, fp8_dtype, scale_ptr: int, amax_ptr: int, rowwise, columnwise, device):
    """A new FP8Tensor [rows, cols] and the handle the library writes it through (with the scale and
    amax at the given pointers; amax_ptr 0: none)."""
    if fp8_dtype not in FP8_DTYPES:
        raise ValueError(f"fp8_dtype must be DType.kFloat8E4M3 or kFloat8E5M2, got {fp8_dtype}")
    if not (rowwise or columnwise):
        raise ValueError("an FP8 output needs rowwise and/or columnwise data")
    data = torch.empty(rows, cols, dtype=torch.uint8, device=device) if rowwise else None
    tr = torch.empty(cols, rows, dtype=torch.uint8, device=device) if columnwise else None
    scale_inv = torch.empty(1, dtype=torch.float32, device=device)
    nt = _make(data.data_ptr() if rowwise else 0, (rows, cols) if rowwise else None, fp8_dtype,
               scale_inv.data_ptr(), tr.data_ptr() if columnwise else 0, (cols, rows) if columnwise else None,
               scale_ptr, amax_ptr)
    return FP8Tensor(data, tr, scale_inv, fp8_dtype, (rows, cols)), nt


# --------------------------------------------------------------------- casts
def quantize(x: torch.Tensor, scale: torch.Tensor, amax: Optional[torch.Tensor], fp8_dtype,
             rowwise: bool = True, columnwise: bool = False, slot: Optional[int] = None) -> FP8Tensor:
    """FP8 cast of x (viewed 2D) with `scale`; amax (float32 [1], may be a view into an amax
    history) is max-accumulated by the library; columnwise adds the transposed data. slot: scale
    and amax are a module's scales [n] and amax history [len, n], of which slot `slot` is used."""
    _check(x, "input", HIGH_PRECISION)
    scale_ptr, amax_ptr = _meta_ptrs(scale, amax, x.device, slot)
    rows, cols = _as2d_shape(x)
    out, nt = _fp8_output(rows, cols, fp8_dtype, scale_ptr, amax_ptr, rowwise, columnwise, x.device)
    src = _tensor(x, (rows, cols))
    if rowwise and columnwise:
        _nvte.cast_transpose(src, nt, _stream(x))
    else:
        _nvte.quantize(src, nt, _stream(x))
    return out


def quantize_many(xs: Sequence[torch.Tensor], scale: torch.Tensor, amax: torch.Tensor, fp8_dtype,
                  slot: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """FP8 casts (rowwise) of several tensors with one scale and one amax, in one library call
    (nvte_multi_cast_transpose: one launch for up to 24 tensors): (uint8 buffer holding the casts
    one after the other, xs[i] at the sum of the earlier numels, the scale_inv float32 [1]).
    scale / amax: a module's scales [n] and amax history [len, n], slot `slot` (the amax of all
    the tensors is max-accumulated into one element). Every x is contiguous and on one device."""
    if not xs:
        raise ValueError("quantize_many needs at least one tensor")
    device = xs[0].device
    for i, x in enumerate(xs):
        _check(x, f"xs[{i}]", HIGH_PRECISION, device)
    scale_ptr, amax_ptr = _meta_ptrs(scale, amax, device, slot)
    if fp8_dtype not in FP8_DTYPES:
        raise ValueError(f"fp8_dtype must be DType.kFloat8E4M3 or kFloat8E5M2, got {fp8_dtype}")
    buf = torch.empty(sum(x.numel() for x in xs), dtype=torch.uint8, device=device)
    scale_inv = torch.empty(1, dtype=torch.float32, device=device)  # the same value from every cast
    srcs, outs, at = [], [], 0
    for x in xs:
        rows, cols = _as2d_shape(x)
        srcs.append(_tensor(x, (rows, cols)))
        outs.append(_make(buf.data_ptr() + at, (rows, cols), fp8_dtype, scale_inv.data_ptr(), 0, None, scale_ptr,
                          amax_ptr))
        at += x.numel()
    _nvte.multi_cast_transpose(srcs, outs, _stream(xs[0]))
    return buf, scale_inv


def _dbias_workspace(src, x: torch.Tensor, rows: int, cols: int):
    key = ("dbias", x.device, x.dtype, rows, cols)
    return _workspace(_workspace_bytes(key, lambda: _nvte.quantize_dbias_workspace_size(src)), x.device)


def quantize_dbias(grad: torch.Tensor, scale: torch.Tensor, amax: Optional[torch.Tensor], fp8_dtype,
                   rowwise: bool = True, columnwise: bool = True,
                   slot: Optional[int] = None) -> Tuple[FP8Tensor, torch.Tensor]:
    """FP8 cast of a gradient [rows, cols] plus its column sums (the bias gradient, grad's dtype);
    slot as in quantize."""
    _check(grad, "grad", HIGH_PRECISION)
    scale_ptr, amax_ptr = _meta_ptrs(scale, amax, grad.device, slot)
    rows, cols = _as2d_shape(grad)
    out, nt = _fp8_output(rows, cols, fp8_dtype, scale_ptr, amax_ptr, rowwise, columnwise, grad.device)
    dbias = torch.empty(cols, dtype=grad.dtype, device=grad.device)
    src = _tensor(grad, (rows, cols))
    db = _tensor(dbias)
    ws = _dbias_workspace(src, grad, rows, cols)
    if rowwise and columnwise:
        _nvte.cast_transpose_dbias(src, nt, db, ws, _stream(grad))
    else:
        _nvte.quantize_dbias(src, nt, db, ws, _stream(grad))
    return out, dbias


def quantize_current_scaling(x: torch.Tensor, fp8_dtype, rowwise: bool = True, columnwise: bool = False,
                             force_pow2_scales: bool = False, amax_epsilon: float = 0.0,
                             dbias: bool = False, amax_history: Optional[torch.Tensor] = None,
                             slot: Optional[int] = None):
    """Current scaling (Float8CurrentScaling): FP8 cast of x with a scale derived from x's own amax.

    Three library calls on one output handle: nvte_compute_amax (amax = max|x|),
    nvte_compute_scale_from_amax (scale = fp8_max / max(amax, eps), optionally a power of 2),
    then the cast (which writes scale_inv). With dbias, the cast also returns the column sums.
    amax_history / slot: the amax is written to amax_history[0, slot] instead of a scratch
    buffer (a delayed-scaling history seeded by a current-scaled cast). Returns the FP8Tensor
    (and the bias gradient when dbias)."""
    _check(x, "input", HIGH_PRECISION)
    rows, cols = _as2d_shape(x)
    scale = torch.empty(1, dtype=torch.float32, device=x.device)
    amax = None  # the scratch amax stays referenced until the casts below have been issued
    if amax_history is None:
        amax = torch.zeros(1, dtype=torch.float32, device=x.device)
        amax_ptr = amax.data_ptr()
    else:
        _check(amax_history, "amax_history", (torch.float32,), x.device)
        amax_ptr = _history_slot_ptr(amax_history, -1 if slot is None else slot)
    out, nt = _fp8_output(rows, cols, fp8_dtype, scale.data_ptr(), amax_ptr, rowwise, columnwise, x.device)
    src = _tensor(x, (rows, cols))
    stream = _stream(x)
    _nvte.compute_amax(src, nt, stream)
    _nvte.compute_scale_from_amax(nt, bool(force_pow2_scales), float(amax_epsilon), None, stream)
    if not dbias:
        if rowwise and columnwise:
            _nvte.cast_transpose(src, nt, stream)
        else:
            _nvte.quantize(src, nt, stream)
        return out
    db = torch.empty(cols, dtype=x.dtype, device=x.device)
    ws = _dbias_workspace(src, x, rows, cols)
    if rowwise and columnwise:
        _nvte.cast_transpose_dbias(src, nt, _tensor(db), ws, stream)
    else:
        _nvte.quantize_dbias(src, nt, _tensor(db), ws, stream)
    return out, db


def dequantize(x: FP8Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """High-precision copy of FP8 data (float(data) * scale_inv)."""
    if dtype not in HIGH_PRECISION:
        raise TypeError(f"dequantize: dtype {dtype} is not supported")
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    _nvte.dequantize(x.nvte(), _tensor(out), _stream(out))
    return out


# ---------------------------------------------------------------------- GEMM
_WORKSPACES = {}


def _gemm_workspace(device: torch.device):
    if device.type != "cuda":
        return None
    key = (device.type, device.index)
    if key not in _WORKSPACES:
        nbytes = _nvte.gemm_workspace_size(_nvte.Backend.CUDA)
        _WORKSPACES[key] = _workspace(nbytes, device)
    return _WORKSPACES[key]


def _operand(x, name, device):
    """(handle, logical 2D shape) of a GEMM operand: a torch tensor or an FP8Tensor."""
    if isinstance(x, FP8Tensor):
        if x.device != device:
            raise ValueError(f"{name}: FP8 operand is on {x.device} but the other operands are on {device}")
        return x.nvte(), x.shape
    _check(x, name, HIGH_PRECISION, device)
    if x.dim() != 2:
        raise ValueError(f"{name}: GEMM operands must be 2D, got shape {tuple(x.shape)}")
    return _tensor(x), x.shape


def _gemm_operands(A, B, transa: bool, transb: bool, device):
    """(a, b, m, n): the operand handles and D's [n, m] for op(B) @ op(A), inner dimensions checked."""
    a, ashape = _operand(A, "A", device)
    b, bshape = _operand(B, "B", device)
    m, ka = (ashape[0], ashape[1]) if transa else (ashape[1], ashape[0])
    n, kb = (bshape[1], bshape[0]) if transb else (bshape[0], bshape[1])
    if ka != kb:
        raise ValueError(f"GEMM inner dimensions differ: op(A) is [{ka}, {m}], op(B) is [{n}, {kb}] "
                         f"(A {tuple(ashape)}, B {tuple(bshape)}, transa={transa}, transb={transb})")
    return a, b, m, n


def gemm(A, B, out_dtype: torch.dtype, transa: bool, transb: bool, bias: Optional[torch.Tensor] = None,
         gelu: bool = False, grad: bool = False, pre_gelu: Optional[torch.Tensor] = None,
         out: Optional[torch.Tensor] = None, accumulate: bool = False):
    """D = op(B) @ op(A) in TE's convention (fprop TN, dgrad NN, wgrad NT; row-major operands).

    A, B: high-precision 2D torch tensors or FP8Tensors. Forward epilogues (grad=False): bias [m]
    added; gelu=True returns (D = gelu(pre), pre) with pre = result (+ bias). Backward epilogues
    (grad=True): `bias` is an output receiving the bias gradient (see gemm.h); with pre_gelu,
    D = result * dgelu(pre_gelu)."""
    device = A.device if isinstance(A, FP8Tensor) else getattr(A, "device", None)
    if not isinstance(A, (torch.Tensor, FP8Tensor)):
        raise TypeError(f"A: expected a torch.Tensor or FP8Tensor, got {type(A).__name__}")
    a, b, m, n = _gemm_operands(A, B, transa, transb, device)
    if out_dtype not in HIGH_PRECISION:
        raise TypeError(f"GEMM output dtype {out_dtype} is not supported")
    if out is None:
        out = torch.empty(n, m, dtype=out_dtype, device=device)
    else:
        _check(out, "out", (out_dtype,), device)
        if tuple(out.shape) != (n, m):
            raise ValueError(f"out has shape {tuple(out.shape)}; expected {(n, m)}")
    d = _tensor(out)
    bias_nt = None
    if bias is not None:
        _check(bias, "bias", HIGH_PRECISION, device)
        bias_nt = _tensor(bias)
    gelu_nt = None
    if gelu and not grad:
        pre_gelu = torch.empty(n, m, dtype=out_dtype, device=device)
    if pre_gelu is not None:
        _check(pre_gelu, "pre_gelu", HIGH_PRECISION, device)
        gelu_nt = _tensor(pre_gelu)
    _nvte.gemm(a, b, d, bias_nt, gelu_nt, transa, transb, grad, _gemm_workspace(device), accumulate,
               True, 0, _stream(out))
    if gelu and not grad:
        return out, pre_gelu
    return out


def batched_gemm(A: torch.Tensor, B: torch.Tensor, transa: bool, transb: bool) -> torch.Tensor:
    """D[i] = op(B[i]) @ op(A[i]) over [batch, rows, cols] stacks (nvte_batched_gemm, TE's
    convention per matrix), D in A's dtype."""
    device = A.device
    for t, name in ((A, "A"), (B, "B")):
        _check(t, name, HIGH_PRECISION, device)
        if t.dim() != 3:
            raise ValueError(f"{name}: expected a [batch, rows, cols] tensor, got shape {tuple(t.shape)}")
    if A.shape[0] != B.shape[0]:
        raise ValueError(f"A holds {A.shape[0]} matrices but B {B.shape[0]}")
    m, ka = (A.shape[1], A.shape[2]) if transa else (A.shape[2], A.shape[1])
    n, kb = (B.shape[2], B.shape[1]) if transb else (B.shape[1], B.shape[2])
    if ka != kb:
        raise ValueError(f"batched GEMM inner dimensions differ: op(A) is [{ka}, {m}], op(B) is [{n}, {kb}]")
    out = torch.empty(A.shape[0], n, m, dtype=A.dtype, device=device)
    _nvte.batched_gemm(_tensor(A), _tensor(B), _tensor(out), transa, transb, False, _gemm_workspace(device),
                       _stream(out))
    return out


def gemm_fp8_output(A, B, out: torch.Tensor, out_scale_inv: torch.Tensor, fp8_dtype, scale: torch.Tensor,
                    amax: Optional[torch.Tensor], slot: Optional[int], transa: bool, transb: bool,
                    bias: Optional[torch.Tensor] = None) -> None:
    """D = op(B) @ op(A) (+ bias) written in FP8 by the library (gemm.h: D quantized with D's scale,
    its amax max-accumulated, its scale_inv written): out uint8 [n, m] receives the bytes and
    out_scale_inv float32 [1] the scale_inv; scale / amax / slot as in quantize (the module's scales
    [k] and amax history [len, k], slot `slot`). A, B: FP8Tensors (the CUDA backend needs FP8
    operands for an FP8 D)."""
    device = A.device if isinstance(A, FP8Tensor) else getattr(A, "device", None)
    a, b, m, n = _gemm_operands(A, B, transa, transb, device)
    if fp8_dtype not in FP8_DTYPES:
        raise ValueError(f"fp8_dtype must be DType.kFloat8E4M3 or kFloat8E5M2, got {fp8_dtype}")
    _check(out, "out", (torch.uint8,), device)
    if tuple(out.shape) != (n, m):
        raise ValueError(f"out has shape {tuple(out.shape)}; expected {(n, m)}")
    _check(out_scale_inv, "out_scale_inv", (torch.float32,), device)
    scale_ptr, amax_ptr = _meta_ptrs(scale, amax, device, slot)
    d = _make(out.data_ptr(), (n, m), fp8_dtype, out_scale_inv.data_ptr(), 0, None, scale_ptr, amax_ptr)
    bias_nt = None
    if bias is not None:
        _check(bias, "bias", HIGH_PRECISION, device)
        bias_nt = _tensor(bias)
    _nvte.gemm(a, b, d, bias_nt, None, transa, transb, False, _gemm_workspace(device), False, True, 0,
               _stream(out))


def scale_from_history(data: torch.Tensor, fp8_dtype, scale: torch.Tensor, amax_history: torch.Tensor,
                       slot: int) -> None:
    """scale[slot] = fp8_max / amax_history[0, slot], the library's current-scaling rule
    (nvte_compute_scale_from_amax; 1 for a zero amax): a delayed-scaling slot seeded from the amax
    measured in this step. data: FP8 bytes of that tensor (the library picks the backend from them)."""
    scale_ptr, amax_ptr = _meta_ptrs(scale, amax_history, data.device, slot)
    nt = _make(data.data_ptr(), tuple(data.shape), fp8_dtype, 0, 0, None, scale_ptr, amax_ptr)
    _nvte.compute_scale_from_amax(nt, False, 0.0, None, _stream(data))


def transpose(x: torch.Tensor) -> torch.Tensor:
    """x [rows, cols] (any dtype the library takes, e.g. FP8 bytes as uint8) -> its transpose
    [cols, rows], contiguous (nvte_transpose)."""
    _check(x, "input")
    rows, cols = _as2d_shape(x)
    out = torch.empty(cols, rows, dtype=x.dtype, device=x.device)
    _nvte.transpose(_tensor(x, (rows, cols)), _tensor(out), _stream(x))
    return out


def multi_gemm(As: Sequence, Bs: Sequence, out_dtype: torch.dtype, transa: bool, transb: bool,
               biases: Optional[Sequence[Optional[torch.Tensor]]] = None, grad: bool = False):
    """Independent GEMMs D_i = op(B_i) @ op(A_i) in one nvte_multi_tensor_gemm call (same flags for
    all; operands as in gemm). biases: per GEMM, forward bias [m] (grad=False) or bias-gradient output
    [n] (grad=True), or None. Returns the list of D_i."""
    if len(As) != len(Bs):
        raise ValueError(f"multi_gemm: {len(As)} A operands but {len(Bs)} B operands")
    if out_dtype not in HIGH_PRECISION:
        raise TypeError(f"GEMM output dtype {out_dtype} is not supported")
    biases = [None] * len(As) if biases is None else list(biases)
    if not As:
        return []
    device = As[0].device
    a_nt, b_nt, d_nt, bias_nt, outs = [], [], [], [], []
    for i, (A, B, bias) in enumerate(zip(As, Bs, biases)):
        a, ashape = _operand(A, f"A[{i}]", device)
        b, bshape = _operand(B, f"B[{i}]", device)
        m, ka = (ashape[0], ashape[1]) if transa else (ashape[1], ashape[0])
        n, kb = (bshape[1], bshape[0]) if transb else (bshape[0], bshape[1])
        if ka != kb:
            raise ValueError(f"GEMM {i}: inner dimensions differ (A {tuple(ashape)}, B {tuple(bshape)}, "
                             f"transa={transa}, transb={transb})")
        out = torch.empty(n, m, dtype=out_dtype, device=device)
        outs.append(out)
        a_nt.append(a)
        b_nt.append(b)
        d_nt.append(_tensor(out))
        if bias is not None:
            _check(bias, f"bias[{i}]", HIGH_PRECISION, device)
        bias_nt.append(None if bias is None else _tensor(bias))
    ws = _gemm_workspace(device)
    _nvte.multi_tensor_gemm(a_nt, b_nt, d_nt, bias_nt, [None] * len(As), transa, transb, grad,
                            None if ws is None else [ws], False, True, 0, _stream(outs[0]))
    return outs


# ------------------------------------------------------------- normalization
def _norm_workspace(x_nt, x, rows, cols, forward):
    key = ("norm", x.device, x.dtype, rows, cols, forward)
    return _workspace(_workspace_bytes(key, lambda: _nvte.normalization_workspace_size(x_nt, forward)), x.device)


def _norm_out(x, rows, cols, fp8):
    """z as a high-precision tensor, or an FP8Tensor when fp8 = (scale, amax, fp8_dtype[, columnwise[,
    slot]]): rowwise data, plus the transposed data with columnwise; slot as in quantize."""
    if fp8 is None:
        z = torch.empty(rows, cols, dtype=x.dtype, device=x.device)
        return z, _tensor(z)
    scale, amax, fp8_dtype = fp8[:3]
    columnwise = len(fp8) > 3 and bool(fp8[3])
    scale_ptr, amax_ptr = _meta_ptrs(scale, amax, x.device, fp8[4] if len(fp8) > 4 else None)
    return _fp8_output(rows, cols, fp8_dtype, scale_ptr, amax_ptr, True, columnwise, x.device)


def _check_norm(x, gamma, beta=None):
    _check(x, "input", HIGH_PRECISION)
    rows, cols = _as2d_shape(x)
    for name, p in (("weight", gamma), ("bias", beta)):
        if p is None:
            continue
        _check(p, name, HIGH_PRECISION, x.device)
        if p.numel() != cols:
            raise ValueError(f"{name} has {p.numel()} elements but the input's last dimension is {cols}")
    return rows, cols


def layernorm_fwd(x, gamma, beta, eps: float, zero_centered_gamma: bool = False, fp8=None):
    """LayerNorm over the last dim of x. Returns (z [rows, cols] or FP8Tensor, mu, rsigma)."""
    rows, cols = _check_norm(x, gamma, beta)
    z, z_nt = _norm_out(x, rows, cols, fp8)
    mu = torch.empty(rows, dtype=torch.float32, device=x.device)
    rs = torch.empty(rows, dtype=torch.float32, device=x.device)
    x_nt = _tensor(x, (rows, cols))
    ws = _norm_workspace(x_nt, x, rows, cols, True)
    _nvte.layernorm_fwd(x_nt, _tensor(gamma), _tensor(beta), float(eps), z_nt, _tensor(mu), _tensor(rs), ws, 0,
                        zero_centered_gamma, _stream(x))
    return z, mu, rs


def layernorm_bwd(dz, x, mu, rsigma, gamma, zero_centered_gamma: bool = False):
    """Returns (dx [rows, cols], dgamma, dbeta)."""
    rows, cols = _check_norm(x, gamma)
    _check(dz, "grad_output", HIGH_PRECISION, x.device)
    _check(mu, "mu", (torch.float32,), x.device)
    _check(rsigma, "rsigma", (torch.float32,), x.device)
    dx = torch.empty(rows, cols, dtype=x.dtype, device=x.device)
    dg = torch.empty_like(gamma)
    db = torch.empty_like(gamma)
    x_nt = _tensor(x, (rows, cols))
    ws = _norm_workspace(x_nt, x, rows, cols, False)
    _nvte.layernorm_bwd(_tensor(dz, (rows, cols)), x_nt, _tensor(mu), _tensor(rsigma), _tensor(gamma),
                        _tensor(dx), _tensor(dg), _tensor(db), ws, 0, zero_centered_gamma, _stream(x))
    return dx, dg, db


def rmsnorm_fwd(x, gamma, eps: float, zero_centered_gamma: bool = False, fp8=None):
    """RMSNorm over the last dim of x. Returns (z [rows, cols] or FP8Tensor, rsigma)."""
    rows, cols = _check_norm(x, gamma)
    z, z_nt = _norm_out(x, rows, cols, fp8)
    rs = torch.empty(rows, dtype=torch.float32, device=x.device)
    x_nt = _tensor(x, (rows, cols))
    ws = _norm_workspace(x_nt, x, rows, cols, True)
    _nvte.rmsnorm_fwd(x_nt, _tensor(gamma), float(eps), z_nt, _tensor(rs), ws, 0, zero_centered_gamma,
                      _stream(x))
    return z, rs


def rmsnorm_bwd(dz, x, rsigma, gamma, zero_centered_gamma: bool = False):
    """Returns (dx [rows, cols], dgamma)."""
    rows, cols = _check_norm(x, gamma)
    _check(dz, "grad_output", HIGH_PRECISION, x.device)
    _check(rsigma, "rsigma", (torch.float32,), x.device)
    dx = torch.empty(rows, cols, dtype=x.dtype, device=x.device)
    dg = torch.empty_like(gamma)
    x_nt = _tensor(x, (rows, cols))
    ws = _norm_workspace(x_nt, x, rows, cols, False)
    _nvte.rmsnorm_bwd(_tensor(dz, (rows, cols)), x_nt, _tensor(rsigma), _tensor(gamma), _tensor(dx),
                      _tensor(dg), ws, 0, zero_centered_gamma, _stream(x))
    return dx, dg


# --------------------------------------------------------------- activations
def gelu(x: torch.Tensor) -> torch.Tensor:
    _check(x, "input", HIGH_PRECISION)
    out = torch.empty_like(x)
    _nvte.gelu(_tensor(x), _tensor(out), _stream(x))
    return out


def dgelu(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """grad * gelu'(x)."""
    _check(x, "input", HIGH_PRECISION)
    _check(grad, "grad", (x.dtype,), x.device)
    if grad.shape != x.shape:
        raise ValueError(f"grad shape {tuple(grad.shape)} differs from input shape {tuple(x.shape)}")
    out = torch.empty_like(x)
    _nvte.dgelu(_tensor(grad), _tensor(x), _tensor(out), _stream(x))
    return out


def activation(name: str, x: torch.Tensor) -> torch.Tensor:
    """y = act(x) for a library activation (activation.h); gated ones (geglu, swiglu, ...) halve
    the last dimension: act(first half) * second half."""
    _check(x, "input", HIGH_PRECISION)
    cols = x.shape[-1] // 2 if name in GATED_ACTIVATIONS else x.shape[-1]
    out = torch.empty(x.shape[:-1] + (cols,), dtype=x.dtype, device=x.device)
    getattr(_nvte, name)(_tensor(x), _tensor(out), _stream(x))
    return out


def dactivation(name: str, grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Input gradient of activation(name, x) for the output gradient `grad` (nvte_d<name>)."""
    _check(x, "input", HIGH_PRECISION)
    _check(grad, "grad", (x.dtype,), x.device)
    out = torch.empty_like(x)
    getattr(_nvte, "d" + name)(_tensor(grad), _tensor(x), _tensor(out), _stream(x))
    return out


ELEMENTWISE_ACTIVATIONS = ("gelu", "relu", "qgelu", "srelu", "silu")
GATED_ACTIVATIONS = ("geglu", "reglu", "swiglu", "qgeglu", "sreglu")

# -------------------------------------------------------------------- recipe
def delayed_scaling_update(amax_history: torch.Tensor, scale: torch.Tensor, algo: str, fp8_dtype,
                           margin: float) -> None:
    """In place: one delayed-scaling step, TE's per-step update
    (nvte_delayed_scaling_recipe_amax_and_scale_update_after_reduction, no reduction buffer): a
    column whose newest amax is 0 (its tensor was not cast this step, e.g. a cached FP8 weight
    under is_first_microbatch=False) keeps its history and scale; the others roll and rescale."""
    _check(amax_history, "amax_history", (torch.float32,))
    _check(scale, "scale", (torch.float32,), amax_history.device)
    _nvte.delayed_scaling_recipe_amax_and_scale_update_after_reduction(None, [_tensor(amax_history)], [_tensor(scale)],
                                                                       algo, fp8_dtype, float(margin), _stream(scale))
