"""Q, K, V that already lie in one of the library's packed placements, and their gradients.

MultiheadAttention cuts Q, K, V out of its QKV projection's output (and K, V out of a key/value
projection's) as views. When those views have exactly a packed layout's placement (fused_attn.h:
sbh3d / sb3hd / bsh3d / bs3hd for Q, K, V; sbhd_sbh2d / sbhd_sb2hd / bshd_bsh2d / bshd_bs2hd for
K, V beside a plain Q), fused attention takes them as they are instead of contiguous copies, and
writes dQ, dK, dV as views of one packed gradient buffer of the same placement. SplitPacked is
the split whose backward takes such a buffer as the projection output's gradient without a copy;
cat_rows is the concatenation of parameters that already lie back to back (the split QKV
projection's query/key/value weights) without a copy.

Bwd ops return three tensors: the packed Q, K, V gradient buffer and two empty ones (Q, K, V
packed), dQ and the packed K, V gradient buffer and an empty one (K, V packed), or dQ, dK, dV;
grads_from() turns either form into dQ, dK, dV.
"""
from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch
from torch import Tensor

from transformer_engine import _nvte

L = _nvte.NVTE_QKV_Layout
# (format, placement) -> layout; "h3d" = [.., h, 3, d], "3hd" = [.., 3, h, d] (likewise with 2 for K, V)
QKV = {("sbhd", "h3d"): int(L.NVTE_SBH3D), ("sbhd", "3hd"): int(L.NVTE_SB3HD),
       ("bshd", "h3d"): int(L.NVTE_BSH3D), ("bshd", "3hd"): int(L.NVTE_BS3HD)}
KV = {("sbhd", "h2d"): int(L.NVTE_SBHD_SBH2D), ("sbhd", "2hd"): int(L.NVTE_SBHD_SB2HD),
      ("bshd", "h2d"): int(L.NVTE_BSHD_BSH2D), ("bshd", "2hd"): int(L.NVTE_BSHD_BS2HD)}
QKV_LAYOUTS = frozenset(QKV.values())
KV_LAYOUTS = frozenset(KV.values())
BSHD_LAYOUTS = frozenset(v for (f, _), v in list(QKV.items()) + list(KV.items()) if f == "bshd")


def group(layout: int) -> int:
    """How many of Q, K, V share one buffer in this layout: 3, 2 (K and V) or 0."""
    return 3 if layout in QKV_LAYOUTS else 2 if layout in KV_LAYOUTS else 0


def _placement(xs, fmt: str, table) -> Optional[int]:
    """The layout of `table` whose placement the views xs (equal shapes [s, b, h, d] / [b, s, h, d])
    have: one buffer with token rows of n h d elements, n = len(xs), xs[i] at i steps."""
    x0 = xs[0]
    n, h, d, es = len(xs), x0.shape[2], x0.shape[3], x0.element_size()
    width = n * h * d
    for placement, head_stride, step in ((f"h{n}d", n * d, d), (f"{n}hd", d, h * d)):
        if any(x.data_ptr() - x0.data_ptr() != i * step * es for i, x in enumerate(xs)):
            continue
        want = (x0.shape[1] * width, width, head_stride, 1)
        if all(x.shape[i] == 1 or x.stride(i) == want[i] for x in xs for i in range(4)):
            st = x0.untyped_storage().data_ptr()
            if all(x.untyped_storage().data_ptr() == st for x in xs[1:]):
                return table[(fmt, placement)]
    return None


def packed_layout(q: Tensor, k: Tensor, v: Tensor, fmt: str) -> Optional[int]:
    """The packed layout q, k, v already have as views (Q, K, V in one buffer, or K, V in one buffer
    beside a contiguous Q), or None. (None while torch.compile traces: its tensors have no addresses.)"""
    if torch.compiler.is_compiling():
        return None
    if fmt not in ("sbhd", "bshd") or q.dim() != 4 or k.dim() != 4 or k.shape != v.shape or q.numel() == 0:
        return None
    if not (q.dtype == k.dtype == v.dtype) or not (q.device == k.device == v.device) or k.numel() == 0:
        return None
    if q.shape == k.shape:
        found = _placement((q, k, v), fmt, QKV)
        if found is not None:
            return found
    return _placement((k, v), fmt, KV) if q.is_contiguous() else None


def rows(x: Tensor, n: int) -> Tuple[int, int]:
    """(token rows, n h d): the buffer of n packed tensors that starts at x, as a matrix."""
    return x.shape[0] * x.shape[1], n * x.shape[2] * x.shape[3]


def region(x: Tensor, n: int) -> Tensor:
    """The buffer x and the n - 1 tensors packed after it are views of, as a [rows, n h d] view."""
    r, width = rows(x, n)
    return x.as_strided((r, width), (width, 1))


def views(buf: Tensor, like) -> tuple:
    """Views of buf (a packed buffer: the gradients', the FP8 copy's) with the shapes, strides and
    offsets from the first that the tensors `like` have in theirs."""
    base = like[0].storage_offset()
    return tuple(buf.as_strided(x.shape, x.stride(), buf.storage_offset() + x.storage_offset() - base)
                 for x in like)


def new_grads(layout: int, q: Tensor, k: Tensor, v: Tensor, dtype: torch.dtype):
    """(the bwd op's three outputs, (dq, dk, dv) to write): fresh buffers in q, k, v's placement."""
    g = group(layout)
    if g == 3:
        buf = torch.empty(rows(q, 3), dtype=dtype, device=q.device)
        return (buf, buf.new_empty(0), buf.new_empty(0)), views(buf, (q, k, v))
    dq = torch.empty(q.shape, dtype=dtype, device=q.device)
    if g == 2:
        buf = torch.empty(rows(k, 2), dtype=dtype, device=k.device)
        return (dq, buf, buf.new_empty(0)), (dq,) + views(buf, (k, v))
    dk, dv = (torch.empty(x.shape, dtype=dtype, device=x.device) for x in (k, v))
    return (dq, dk, dv), (dq, dk, dv)


def fake_grads(layout: int, q: Tensor, k: Tensor, v: Tensor, dtype: torch.dtype):
    """The bwd op's three outputs as new_grads makes them (shapes and dtype; for register_fake)."""
    g = group(layout)
    if g == 3:
        return q.new_empty(rows(q, 3), dtype=dtype), q.new_empty(0, dtype=dtype), q.new_empty(0, dtype=dtype)
    dq = q.new_empty(q.shape, dtype=dtype)
    if g == 2:
        return dq, k.new_empty(rows(k, 2), dtype=dtype), k.new_empty(0, dtype=dtype)
    return dq, k.new_empty(k.shape, dtype=dtype), v.new_empty(v.shape, dtype=dtype)


def grads_from(layout: int, outs, like) -> tuple:
    """(dq, dk, dv) from a bwd op's three outputs (or their decoded copies), as views shaped like
    the tensors `like` (q, k, v as the op saw them)."""
    g = group(layout)
    if g == 3:
        return views(outs[0], like)
    if g == 2:
        return (outs[0],) + views(outs[1], like[1:])
    return tuple(outs)


class SplitPacked(torch.autograd.Function):
    """views = split(mixed) of a projection output, with a backward that takes gradients already
    lying where the views were cut from (views of one contiguous buffer shaped like `mixed`: the
    packed gradient fused attention writes for a packed layout) as `mixed`'s gradient without a
    copy; other gradients are copied into a new buffer through write(buffer) (views to write)."""

    @staticmethod
    def forward(ctx, mixed: Tensor, split: Callable, write: Callable):
        outs = split(mixed)
        base = mixed.storage_offset()
        ctx.geo = tuple((x.stride(), x.storage_offset() - base) for x in outs)
        ctx.shape, ctx.write = tuple(mixed.shape), write
        # (a split that copies, as GQA's interleaved q does, has no place to share)
        ctx.views = mixed.is_contiguous() and all(x._base is not None for x in outs)
        return outs

    @staticmethod
    def backward(ctx, *grads):
        shape = ctx.shape
        if ctx.views and all(x is not None for x in grads) and _in_place(grads, ctx.geo, shape):
            strides, n = [], 1
            for size in reversed(shape):  # contiguous strides of `shape`
                strides.insert(0, n)
                n *= size
            return grads[0].as_strided(shape, strides, grads[0].storage_offset()), None, None
        ref = next(x for x in grads if x is not None)
        dm = ref.new_empty(shape)
        for dst, src in zip(ctx.write(dm), grads):
            if src is None:
                dst.zero_()
            else:
                dst.copy_(src.reshape(dst.shape))
        return dm, None, None


def _in_place(grads, geo, shape) -> bool:
    """Whether the gradients are views of one buffer (from the first one's element on, large enough
    for `shape`), each at the stride and offset its forward view had in `mixed`."""
    g0 = grads[0]
    st, base = g0.untyped_storage(), g0.storage_offset()
    n = 1
    for x in shape:
        n *= x
    if (base + n) * g0.element_size() > st.nbytes():
        return False
    return all(x.untyped_storage().data_ptr() == st.data_ptr() and x.dtype == g0.dtype and x.stride() == stride
               and x.storage_offset() - base == off for x, (stride, off) in zip(grads, geo))


class _CatInPlace(torch.autograd.Function):
    """torch.cat(ts, 0) of tensors lying back to back in one buffer: a view of that buffer; the
    backward hands each tensor its rows of the gradient (views); no gradient (a weight gradient
    that went to main_grad instead) stays none."""

    @staticmethod
    def forward(ctx, *ts):
        ctx.sizes = [t.shape[0] for t in ts]
        ctx.set_materialize_grads(False)
        return ts[0].as_strided((sum(ctx.sizes),) + tuple(ts[0].shape[1:]), ts[0].stride())

    @staticmethod
    def backward(ctx, g):
        if g is None:
            return (None,) * len(ctx.sizes)
        return tuple(g.split(ctx.sizes, 0))


def cat_rows(ts) -> Tensor:
    """torch.cat(ts, 0); without a copy when the tensors (plain, contiguous, same dtype and device)
    already lie back to back in one storage, as MultiheadAttention's split QKV parameters are made."""
    if len(ts) == 1:
        return ts[0]
    t0 = ts[0]
    if not torch.compiler.is_compiling() and all(type(t) in (torch.Tensor, torch.nn.Parameter) for t in ts):
        es, st, at = t0.element_size(), t0.untyped_storage().data_ptr(), t0.data_ptr()
        ok = True
        for t in ts:
            ok = ok and t.is_contiguous() and t.dtype == t0.dtype and t.device == t0.device and \
                t.shape[1:] == t0.shape[1:] and t.untyped_storage().data_ptr() == st and t.data_ptr() == at
            at += t.numel() * es
        if ok:
            return _CatInPlace.apply(*ts)
    return torch.cat(ts, 0)
