"""Context parallelism over packed THD sequences: the ring (cp_comm_type "p2p") and the token order
of "a2a" (context_parallel.py has the rest).

cu_seqlens_q are those of the whole sequences; every length must be a multiple of 2 cp_size. Rank
r holds, sequence after sequence, chunks r and 2 cp_size - 1 - r of each (c_i tokens each), so
its local cu_seqlens are the whole ones / cp_size. Each ring step is one THD fused attention call
whose sequences are described in place by cu_seqlens and padded offsets, without copies: a
block's first chunks are sequences of length c_i at the block's sequence starts, our second chunks
sequences of length c_i starting c_i tokens in. Rows a call does not cover come back as zeros.
Outputs and log-sum-exps are merged per token: the library's THD statistics ([b, h, max_s, 1],
row j of sequence b at [b, :, j]) are gathered into [tokens, h] form, and scattered back into each
call's form for the backward.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from . import dpa_fused as _df
from . import fused_attention as _fa
from .context_parallel import BlockGrads, CPGroup, ring_blocks, step_kind


class ThdSplit(NamedTuple):
    """The local sequences of this rank (int32 offsets for the library, int64 token maps)."""
    cu_local: torch.Tensor  # [b + 1] 2 c_i per sequence
    cu_half: torch.Tensor  # [b + 1] c_i per sequence
    second: torch.Tensor  # [b + 1] where each sequence's second chunk starts; last: the token count
    max_half: int
    tok_b: torch.Tensor  # [t] each local token's sequence
    tok_j: torch.Tensor  # [t] its position among its sequence's local tokens
    tok_c: torch.Tensor  # [t] its sequence's chunk length


_SPLITS = _fa.TensorMemo(4)
_SPLIT_ENTRIES = 4


def split(cu_seqlens: torch.Tensor, tokens: int, size: int) -> ThdSplit:
    """The local description from the whole sequences' cu_seqlens (one host synchronization: the
    lengths are checked, since other lengths would give wrong results without an error), remembered
    per unchanged cu_seqlens tensor (fused_attention.TensorMemo), which a model's layers share."""
    return _SPLITS.get(cu_seqlens, (tokens, size), lambda: _split(cu_seqlens, tokens, size))


def _split(cu_seqlens: torch.Tensor, tokens: int, size: int) -> ThdSplit:
    cu = cu_seqlens.to(torch.int64)
    lens = cu[1:] - cu[:-1]
    host = lens.cpu()
    if bool((host % (2 * size) != 0).any()):
        raise ValueError(f"DotProductAttention: context parallelism over THD needs every sequence length to be a "
                         f"multiple of 2 cp_size = {2 * size}; got lengths {host.tolist()}")
    if int(host.sum()) != tokens * size:
        raise ValueError(f"DotProductAttention: cu_seqlens_q describes {int(host.sum())} tokens of the whole "
                         f"sequences; this rank holds {tokens} tokens, expected the whole / cp_size "
                         f"({int(host.sum()) // size}) (cu_seqlens are those of the whole sequences)")
    c = lens // (2 * size)
    zero = torch.zeros(1, dtype=torch.int64, device=cu.device)
    cu_local = torch.cat([zero, torch.cumsum(2 * c, 0)])
    cu_half = torch.cat([zero, torch.cumsum(c, 0)])
    second = torch.cat([cu_local[:-1] + c, cu_local[-1:]])
    tok = torch.arange(tokens, device=cu.device)
    tok_b = torch.searchsorted(cu_local[1:], tok, right=True)
    i32 = torch.int32
    return ThdSplit(cu_local.to(i32), cu_half.to(i32), second.to(i32), int((host // (2 * size)).max()) if
                    host.numel() else 0, tok_b, tok - cu_local[tok_b], c[tok_b])


class TokenOrder:
    """Between rank order (rank 0's local tokens, rank 1's, ...) and the packed whole sequences
    (cu_seqlens' order): context_parallel's order objects for "a2a" over THD."""

    def __init__(self, sp: ThdSplit, cu_seqlens: torch.Tensor, size: int):
        t = sp.tok_b.numel()
        p = torch.arange(size * t, device=sp.tok_b.device)
        rank, local = p // t, p % t
        c, j = sp.tok_c[local], sp.tok_j[local]
        second = j >= c
        chunk = torch.where(second, 2 * size - 1 - rank, rank)
        # rank-order position p holds this token of the whole sequences
        self.to_ranks = cu_seqlens.to(torch.int64)[sp.tok_b[local]] + chunk * c + torch.where(second, j - c, j)
        self.to_nat = torch.empty_like(self.to_ranks)
        self.to_nat[self.to_ranks] = p

    def natural(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        return t.index_select(dim, self.to_nat)

    def ranks(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        return t.index_select(dim, self.to_ranks)


_ORDERS = []  # [(ThdSplit, size, TokenOrder)]: the splits are remembered (split), so are their orders


def token_order(sp: ThdSplit, cu_seqlens: torch.Tensor, size: int) -> TokenOrder:
    for s, n, order in _ORDERS:
        if s is sp and n == size:
            return order
    order = TokenOrder(sp, cu_seqlens, size)
    _ORDERS.insert(0, (sp, size, order))
    del _ORDERS[_SPLIT_ENTRIES:]
    return order


class _Step(NamedTuple):
    cu: tuple  # (cu_q, cu_kv, cu_q_padded, cu_kv_padded)
    max_q: int
    max_kv: int
    mask: str
    covered: torch.Tensor  # [t] bool: query tokens this step computes (None: all)
    row: torch.Tensor  # [t] int64: each covered token's row in the call's statistics


def _step(sp: ThdSplit, kind: str, causal: bool) -> _Step:
    m2 = 2 * sp.max_half
    if kind == "kv_first":
        return _Step((sp.cu_local, sp.cu_half, sp.cu_local, sp.cu_local), m2, sp.max_half, "padding", None, sp.tok_j)
    if kind == "q_second":
        cov = sp.tok_j >= sp.tok_c
        return _Step((sp.cu_half, sp.cu_local, sp.second, sp.cu_local), sp.max_half, m2, "padding", cov,
                     torch.where(cov, sp.tok_j - sp.tok_c, 0))
    mask = "padding_causal" if kind == "own" and causal else "padding"
    return _Step((sp.cu_local, sp.cu_local, None, None), m2, m2, mask, None, sp.tok_j)


def _to_tokens(stats: torch.Tensor, sp: ThdSplit, st: _Step) -> torch.Tensor:
    """Statistics [b, h, max_s, 1] -> [t, h] (-inf for tokens the step does not cover)."""
    lse = stats[..., 0].permute(0, 2, 1)[sp.tok_b, st.row]
    return lse if st.covered is None else lse.masked_fill(~st.covered[:, None], float("-inf"))


def _to_stats(lse: torch.Tensor, sp: ThdSplit, st: _Step) -> torch.Tensor:
    """[t, h] -> the call's statistics [b, h, max_q, 1] (rows of no covered token: 0, unread)."""
    out = lse.new_zeros(sp.cu_local.shape[0] - 1, lse.shape[1], st.max_q, 1)
    view = out[..., 0].permute(0, 2, 1)
    if st.covered is None:
        view[sp.tok_b, st.row] = lse
    else:
        view[sp.tok_b[st.covered], st.row[st.covered]] = lse[st.covered]
    return out


class RingAttentionTHD(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cp: CPGroup, sp: ThdSplit, causal: bool, scale: float, dropout: float):
        layout = _fa.LAYOUTS["thd"]
        zero_rng = _df._zero_rng_state(q.device)
        steps = [_step(sp, step_kind(cp, i, causal), causal) for i in range(cp.size)]
        rngs, out, lse = [], None, None
        for i, block in ring_blocks(cp, k, v):
            st = steps[i]
            rng = _fa.new_rng_state(q.device) if dropout > 0.0 else zero_rng
            o_i, stats, rng_i, _ = _fa.fused_attn_fwd(q, block[0], block[1], None, *st.cu, rng, st.max_q, st.max_kv,
                                                      True, scale, dropout, layout, _fa.BIAS_INT["no_bias"],
                                                      _fa.MASK_INT[st.mask], -1, -1, "causal" not in st.mask)
            rngs.append(rng_i)
            lse_i = _to_tokens(stats, sp, st)
            if i == 0:  # (every token sees itself)
                out, lse = o_i.float(), lse_i
            else:  # O = sum_i exp(lse_i - lse) O_i; uncovered rows: weight 0 (their O_i rows are zeros)
                new = torch.logaddexp(lse, lse_i)
                out.mul_(torch.exp(lse - new)[..., None]).add_(o_i * torch.exp(lse_i - new)[..., None])
                lse = new
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, *rngs)
        ctx.args = (cp, sp, steps, scale, dropout)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, *rngs = ctx.saved_tensors
        cp, sp, steps, scale, dropout = ctx.args
        layout = _fa.LAYOUTS["thd"]
        dout = dout.contiguous()
        dq, dkv = None, BlockGrads(cp, k.dtype)
        for i, block in ring_blocks(cp, k, v):
            st = steps[i]
            dq_i, dk_i, dv_i, _, _ = _fa.fused_attn_bwd(q, block[0], block[1], out, dout, _to_stats(lse, sp, st),
                                                        rngs[i], q.new_empty(0), *st.cu, st.max_q, st.max_kv, scale,
                                                        dropout, layout, _fa.BIAS_INT["no_bias"],
                                                        _fa.MASK_INT[st.mask], -1, -1, "causal" not in st.mask,
                                                        False)
            # (rows a step does not cover come back as zeros)
            dq = dq_i.float() if i == 0 else dq.add_(dq_i)
            dkv.add(dk_i, dv_i)
        dk, dv = dkv.result()
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None
