"""The p2p ring of context parallelism (context_parallel.py describes the comm types): K/V blocks
go round the ring while the current block is attended to, each step's output is merged into the
running result through its softmax statistics (log-sum-exp; the library's nvte_attn_merge), an
attention sink is folded in after the steps (nvte_attn_merge_sink), and in the backward the dK / dV
sums travel with their blocks back to their owners.
Shared by the BF16 ring here, the FP8 ring (context_parallel_fp8.py) and the THD ring
(context_parallel_thd.py).
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence

import torch
import torch.distributed as dist

from transformer_engine import _nvte

from . import _ops
from . import dpa_fused as _df
from . import fused_attention as _fa


_FORMAT = {"bshd": _nvte.NVTE_QKV_Format.NVTE_BSHD, "sbhd": _nvte.NVTE_QKV_Format.NVTE_SBHD,
           "thd": _nvte.NVTE_QKV_Format.NVTE_THD}
_BIAS = {False: _fa.BIAS_INT["no_bias"], True: _fa.BIAS_INT["post_scale_bias"]}  # (a bias given)


def _sdim(fmt: str) -> int:
    """The sequence (token) dimension."""
    return 1 if fmt == "bshd" else 0


class Exchange:
    """Sends tensors to the next rank of the ring and receives the previous rank's, asynchronously."""

    def __init__(self, cp: CPGroup, tensors: Sequence[torch.Tensor], tag: int):
        nxt, prev = cp.ranks[(cp.rank + 1) % cp.size], cp.ranks[(cp.rank - 1) % cp.size]
        self.received = [torch.empty_like(t) for t in tensors]
        ops = []
        for i, (t, r) in enumerate(zip(tensors, self.received)):
            ops.append(dist.P2POp(dist.isend, t, nxt, cp.group, tag + i))
            ops.append(dist.P2POp(dist.irecv, r, prev, cp.group, tag + i))
        self.reqs = dist.batch_isend_irecv(ops)

    def wait(self) -> List[torch.Tensor]:
        for r in self.reqs:
            r.wait()
        return self.received


def ring_blocks(cp: CPGroup, *tensors: torch.Tensor):
    """Yields (step, the tensors of rank - step) for the ring's steps (K, V and, in FP8, their
    scale_inv); the next block travels while the caller works on the current one."""
    block = list(tensors)
    for step in range(cp.size):
        xchg = Exchange(cp, block, 0) if step + 1 < cp.size else None
        yield step, block
        if xchg is not None:
            block = xchg.wait()


class BlockGrads:
    """The dK / dV sums of the block this rank holds in the backward ring: after each step they go
    on to the block's next holder (received while that one's attention runs); the last pass brings
    them to their owner. They travel in float32; NVTE_CP_DKV_FP32=0: in `dtype` (the inputs'),
    half the backward's bytes for one rounding per hop."""

    def __init__(self, cp: CPGroup, dtype: torch.dtype):
        self.cp, self.pending = cp, None
        self.dtype = torch.float32 if _fa._env("NVTE_CP_DKV_FP32") != "0" else dtype

    def add(self, dk: torch.Tensor, dv: torch.Tensor, rows: Callable = lambda t: t) -> None:
        """This step's gradients of the block (rows(t): the part of the block they cover)."""
        if self.pending is None:  # (the first step covers the whole block)
            sums = [dk.to(self.dtype), dv.to(self.dtype)]
        else:
            sums = self.pending.wait()
            rows(sums[0]).add_(dk)
            rows(sums[1]).add_(dv)
        self.pending = Exchange(self.cp, sums, 2)

    def result(self) -> List[torch.Tensor]:
        return self.pending.wait()


def step_kind(cp: CPGroup, step: int, causal: bool) -> str:
    """What step `step` of the ring computes on this rank. The block of step i comes from rank
    (rank - i). "own": our queries over our own block (causal when the mask is); "all": every query
    over the whole block; with a causal mask, an earlier rank's first chunk is wholly before both
    our chunks and its second wholly after them ("kv_first": every query over the block's first
    chunk), and a later rank's block is wholly before our second chunk and after our first
    ("q_second": our second chunk over the whole block)."""
    if step == 0:
        return "own"
    if not causal:
        return "all"
    return "kv_first" if (cp.rank - step) % cp.size < cp.rank else "q_second"


def _step_parts(cp: CPGroup, step: int, causal: bool, c: int):
    """(query rows, key rows of the block, mask) of a bshd/sbhd step, rows as (start, length) over
    the local query and the received block (None = all rows)."""
    kind = step_kind(cp, step, causal)
    if kind == "kv_first":
        return None, (0, c), "no_mask"
    if kind == "q_second":
        return (c, c), None, "no_mask"
    return None, None, ("causal" if kind == "own" and causal else "no_mask")


def _rows(t: torch.Tensor, dim: int, part):
    return t if part is None else t.narrow(dim, part[0], part[1])


def _check_running(out: torch.Tensor, lse: torch.Tensor) -> None:
    """The running pair is updated in place through raw pointers: it must be dense float32 (a
    copy would leave the caller's tensors unchanged)."""
    if not (out.dtype == lse.dtype == torch.float32 and out.is_contiguous() and lse.is_contiguous()):
        raise ValueError(f"the ring's running output / statistics must be contiguous float32, got {out.dtype} / "
                         f"{lse.dtype} (contiguous: {out.is_contiguous()} / {lse.is_contiguous()})")


def merge_into(out: torch.Tensor, lse: torch.Tensor, o_i: torch.Tensor, lse_i: torch.Tensor, row_offset: int,
               fmt: str) -> None:
    """nvte_attn_merge: folds a step's output o_i (rows row_offset .. of out) and its statistics
    lse_i into the running float32 out and lse, in place (fmt "bshd" / "sbhd": statistics
    [b, h, s, 1]; "thd": [t, h])."""
    _check_running(out, lse)
    part, part_lse = o_i.contiguous(), lse_i.contiguous()  # (held: the handles borrow their memory)
    _nvte.attn_merge(_ops._tensor(out), _ops._tensor(lse), _ops._tensor(part), _ops._tensor(part_lse), row_offset,
                     _FORMAT[fmt], _ops._stream(out))


def merge_step(out, lse, o_i: torch.Tensor, lse_i: torch.Tensor, qp, fmt: str):
    """The running float32 output and log-sum-exp after folding in a step's (o_i over the query
    rows qp, its statistics lse_i); out None: the first step, which covers every row."""
    if out is None:
        return o_i.float(), lse_i
    merge_into(out, lse, o_i, lse_i, 0 if qp is None else qp[0], fmt)
    return out, lse


def add_rows(acc: Optional[torch.Tensor], x: torch.Tensor, dim: int, part) -> torch.Tensor:
    """acc (float32) with x added into its rows `part`; acc None: the first step (every row)."""
    if acc is None:
        return x.float()
    _rows(acc, dim, part).add_(x)
    return acc


def bias_block(bias: torch.Tensor, cp: CPGroup, step: int, ck: int, qp, kp) -> torch.Tensor:
    """A ring step's slice of the attention bias [b | 1, h | 1, 2 c, 2 cp ck] (this rank's query rows,
    the keys of the whole sequence in sequence order, TE's layout; ck: a key chunk's length, the
    query chunk's unless cross attention): query rows qp, and the columns of the step's block,
    chunks j and 2 cp - 1 - j of rank j = rank - step (kp: the first alone)."""
    j = (cp.rank - step) % cp.size
    rows = _rows(bias, 2, qp)
    first = rows.narrow(3, j * ck, ck)
    if kp is not None:
        return first.contiguous()
    return torch.cat([first, rows.narrow(3, (2 * cp.size - 1 - j) * ck, ck)], 3)


def put_bias_block(dbias: torch.Tensor, db: torch.Tensor, cp: CPGroup, step: int, ck: int, qp, kp) -> None:
    """Writes a step's bias gradient db into dbias where bias_block took the step's bias from (the
    steps' blocks are disjoint; blocks no step computes stay zero: the causal mask hides them)."""
    j = (cp.rank - step) % cp.size
    rows = _rows(dbias, 2, qp)
    rows.narrow(3, j * ck, ck).copy_(db.narrow(3, 0, ck))
    if kp is None:
        rows.narrow(3, (2 * cp.size - 1 - j) * ck, ck).copy_(db.narrow(3, ck, ck))


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cp: CPGroup, fmt: str, causal: bool, scale: float, dropout: float, sink=None,
                bias=None):
        sdim, layout = _sdim(fmt), _fa.LAYOUTS[fmt]
        c = q.shape[sdim] // 2
        zero_rng = _df._zero_rng_state(q.device)
        rngs = []  # each step's rng_state copy (dropout masks differ between steps; the backward reuses them)
        out = lse = None  # float32 running output and log-sum-exp (step 0 covers every row)
        for step, block in ring_blocks(cp, k, v):
            qp, kp, mask = _step_parts(cp, step, causal, c)
            qs = _rows(q, sdim, qp).contiguous()
            ks, vs = (_rows(t, sdim, kp).contiguous() for t in block)
            rng = _fa.new_rng_state(q.device) if dropout > 0.0 else zero_rng
            bs = None if bias is None else bias_block(bias, cp, step, k.shape[sdim] // 2, qp, kp)
            o_i, lse_i, rng_i, _ = _fa.fused_attn_fwd(qs, ks, vs, bs, None, None, None, None, rng,
                                                      qs.shape[sdim], ks.shape[sdim], True, scale, dropout, layout,
                                                      _BIAS[bias is not None], _fa.MASK_INT[mask], -1, -1,
                                                      mask == "no_mask")
            rngs.append(rng_i)
            out, lse = merge_step(out, lse, o_i, lse_i, qp, fmt)
        lse = fold_sink(ctx, out, lse, sink, fmt)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, bias, *rngs)
        ctx.args = (cp, fmt, causal, scale, dropout, bias is not None and bias.requires_grad)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, bias, *rngs = ctx.saved_tensors
        cp, fmt, causal, scale, dropout, need_dbias = ctx.args
        sdim, layout = _sdim(fmt), _fa.LAYOUTS[fmt]
        c = q.shape[sdim] // 2
        dout = dout.contiguous()
        dq, dkv = None, BlockGrads(cp, k.dtype)  # sums (step 0 covers every row and the whole block)
        dbias = torch.zeros_like(bias) if need_dbias else None
        for step, block in ring_blocks(cp, k, v):
            qp, kp, mask = _step_parts(cp, step, causal, c)
            qs, os_, dos = (_rows(t, sdim, qp).contiguous() for t in (q, out, dout))
            ls = _rows(lse, 2, qp).contiguous()
            ks, vs = (_rows(t, sdim, kp).contiguous() for t in block)
            bs = q.new_empty(0) if bias is None else bias_block(bias, cp, step, k.shape[sdim] // 2, qp, kp)
            dq_i, dk_i, dv_i, db_i, _ = _fa.fused_attn_bwd(qs, ks, vs, os_, dos, ls, rngs[step], bs, None,
                                                           None, None, None, qs.shape[sdim], ks.shape[sdim], scale,
                                                           dropout, layout, _BIAS[bias is not None],
                                                           _fa.MASK_INT[mask], -1, -1, mask == "no_mask", need_dbias)
            dq = add_rows(dq, dq_i, sdim, qp)
            dkv.add(dk_i, dv_i, lambda t: _rows(t, sdim, kp))
            if dbias is not None:
                put_bias_block(dbias, db_i, cp, step, k.shape[sdim] // 2, qp, kp)
        dsink = sink_grad(ctx, dout, out, lse, fmt)
        dk, dv = dkv.result()
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None, dsink, dbias


def fold_sink(ctx, out: torch.Tensor, lse: torch.Tensor, sink, fmt: str) -> torch.Tensor:
    """The attention sink (logits [heads] or None) as one more softmax term after a ring's steps
    (nvte_attn_merge_sink: out rescaled and lse updated in place; lse returned). Records on ctx
    what sink_grad needs."""
    ctx.sink = None if sink is None else sink.detach()
    ctx.sink_grad = sink is not None and sink.requires_grad
    if sink is None:
        return lse
    _check_running(out, lse)
    logits = ctx.sink.float().contiguous()
    _nvte.attn_merge_sink(_ops._tensor(out), _ops._tensor(lse), _ops._tensor(logits), _FORMAT[fmt],
                          _ops._stream(out))
    return lse


def sink_grad(ctx, dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, fmt: str):
    """d loss / d sink [heads] (None when not asked for): nvte_attn_merge_sink_grad, -sum over rows
    of p_sink * D with p_sink = exp(sink - lse) the sink's probability and D = dO . O per row (the
    sink's value is zero)."""
    if not ctx.sink_grad:
        return None
    o, d = out.contiguous(), dout.to(out.dtype).contiguous()
    stats, logits = lse.contiguous(), ctx.sink.float().contiguous()
    dsink = torch.empty_like(logits)
    _nvte.attn_merge_sink_grad(_ops._tensor(d), _ops._tensor(o), _ops._tensor(stats), _ops._tensor(logits),
                               _ops._tensor(dsink), _FORMAT[fmt], _ops._stream(o))
    return dsink
