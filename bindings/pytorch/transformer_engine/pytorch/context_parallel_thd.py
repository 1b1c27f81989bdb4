"""Context parallelism over packed THD sequences: the ring (cp_comm_type "p2p"), the token order of
"a2a" and "all_gather", and all_gather's attention calls (context_parallel.py has the rest).

cu_seqlens_q are those of the whole sequences; every length must be a multiple of 2 cp_size, or
cu_seqlens_q_padded gives each sequence's padded place, whose lengths are (TE's and Megatron's
padded THD: sequence i holds its cu_seqlens length of real tokens, then padding). Rank r holds,
sequence after sequence, chunks r and 2 cp_size - 1 - r of each (padded) sequence (c_i tokens
each), so its local offsets are the whole ones / cp_size. With padding a chunk holds fewer real
tokens, or none; since padding ends a sequence, a rank's real tokens of a sequence are a prefix of
its two chunks, and a step's calls take those counts as cu_seqlens with the chunks' places as
padded offsets. Padding tokens come out as zeros, with zero gradients. Each ring step is one THD fused attention call
whose sequences are described in place by cu_seqlens and padded offsets, without copies: a
block's first chunks are sequences of length c_i at the block's sequence starts, our second chunks
sequences of length c_i starting c_i tokens in. Rows a call does not cover come back as zeros.
Outputs and log-sum-exps are merged per token: the library's THD statistics ([b, h, max_s, 1],
row j of sequence b at [b, :, j]) are gathered into [tokens, h] form, and scattered back into each
call's form for the backward.
"all_gather" gathers K/V into the whole packed sequences (TokenOrder); with a causal mask the
queries of each local chunk attend, in one THD call, to their sequences' keys up to the chunk's
end (bottom-right causal: the chunks' places as padded query offsets), otherwise all local queries
attend to the whole sequences in one call.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from . import dpa_fused as _df
from . import fused_attention as _fa
from .context_parallel import CPGroup
from .context_parallel_ring import BlockGrads, fold_sink, merge_into, ring_blocks, sink_grad, step_kind


class ThdSplit(NamedTuple):
    """The local sequences of this rank (int32 offsets for the library, int64 token maps)."""
    cu_local: torch.Tensor  # [b + 1] 2 c_i per sequence
    cu_half: torch.Tensor  # [b + 1] c_i per sequence
    second: torch.Tensor  # [b + 1] where each sequence's second chunk starts; last: the token count
    max_half: int
    tok_b: torch.Tensor  # [t] each local token's sequence
    tok_j: torch.Tensor  # [t] its position among its sequence's local tokens
    tok_c: torch.Tensor  # [t] its sequence's chunk length
    c: torch.Tensor  # [b] int64 chunk lengths
    lens: torch.Tensor  # [b] int64 real tokens of each whole sequence
    starts: torch.Tensor  # [b] int64 each whole sequence's place in the packed whole tensor
    padded: bool  # some sequence has padding
    max_whole: int  # the longest (padded) whole sequence
    steps: dict  # (rank, size, causal[, "all_gather"]) -> the ring's steps / all_gather's calls, made once


_SPLITS = _fa.TensorMemo(4)
_SPLIT_ENTRIES = 4


def split(cu_seqlens: torch.Tensor, tokens: int, size: int, cu_padded=None) -> ThdSplit:
    """The local description from the whole sequences' cu_seqlens (and padded offsets; one host
    synchronization: the lengths are checked, since other lengths would give wrong results without
    an error), remembered per unchanged cu_seqlens tensors (fused_attention.TensorMemo), which a
    model's layers share."""
    return _SPLITS.get((cu_seqlens, cu_padded), (tokens, size),
                       lambda: _split(cu_seqlens, tokens, size, cu_padded))


def _split(cu_seqlens: torch.Tensor, tokens: int, size: int, cu_padded=None) -> ThdSplit:
    cu = cu_seqlens.to(torch.int64)
    lens = cu[1:] - cu[:-1]
    place = cu if cu_padded is None else cu_padded.to(device=cu.device, dtype=torch.int64)
    plens = place[1:] - place[:-1]
    what = "length" if cu_padded is None else "padded length (cu_seqlens_q_padded)"
    host, phost = lens.cpu(), plens.cpu()
    if cu_padded is not None and (place.shape != cu.shape or int(place[0]) != 0 or bool((host > phost).any())):
        raise ValueError(f"DotProductAttention: context parallelism over THD takes cu_seqlens_q_padded of the "
                         f"whole sequences, from 0, each at least the cu_seqlens_q length; got lengths "
                         f"{host.tolist()}, padded offsets {place.cpu().tolist()}")
    if bool((phost % (2 * size) != 0).any()):
        raise ValueError(f"DotProductAttention: context parallelism over THD needs every sequence {what} to be a "
                         f"multiple of 2 cp_size = {2 * size}; got {phost.tolist()}")
    if int(phost.sum()) != tokens * size:
        raise ValueError(f"DotProductAttention: cu_seqlens_q{'' if cu_padded is None else '_padded'} describes "
                         f"{int(phost.sum())} tokens of the whole sequences; this rank holds {tokens} tokens, "
                         f"expected the whole / cp_size ({int(phost.sum()) // size}) (cu_seqlens are those of the "
                         f"whole sequences)")
    c = plens // (2 * size)
    host = phost
    zero = torch.zeros(1, dtype=torch.int64, device=cu.device)
    cu_local = torch.cat([zero, torch.cumsum(2 * c, 0)])
    cu_half = torch.cat([zero, torch.cumsum(c, 0)])
    second = torch.cat([cu_local[:-1] + c, cu_local[-1:]])
    tok = torch.arange(tokens, device=cu.device)
    tok_b = torch.searchsorted(cu_local[1:], tok, right=True)
    i32 = torch.int32
    return ThdSplit(cu_local.to(i32), cu_half.to(i32), second.to(i32), int((host // (2 * size)).max()) if
                    host.numel() else 0, tok_b, tok - cu_local[tok_b], c[tok_b], c, lens, place[:-1],
                    cu_padded is not None and bool((lens != plens).any()), int(phost.max()) if phost.numel() else 0,
                    {})


class TokenOrder:
    """Between rank order (rank 0's local tokens, rank 1's, ...) and a natural order of the tokens:
    context_parallel's order objects for "a2a" and "all_gather" over THD (natural: the packed whole
    sequences) and for "a2a+p2p" (natural: the p2p ring's local layout). to_ranks[p]: the natural
    position of the token at rank-order position p."""

    def __init__(self, to_ranks: torch.Tensor):
        self.to_ranks = to_ranks
        self.to_nat = torch.empty_like(to_ranks)
        self.to_nat[to_ranks] = torch.arange(to_ranks.numel(), device=to_ranks.device)

    def natural(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        return t.index_select(dim, self.to_nat)

    def ranks(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        return t.index_select(dim, self.to_ranks)


def _rank_order_tokens(sp: ThdSplit, n: int):
    """For the rank-order positions of n ranks' local tokens: (rank, sequence, is in the second
    chunk, position within its chunk, chunk length)."""
    t = sp.tok_b.numel()
    p = torch.arange(n * t, device=sp.tok_b.device)
    rank, local = p // t, p % t
    c, j = sp.tok_c[local], sp.tok_j[local]
    second = j >= c
    return rank, sp.tok_b[local], second, torch.where(second, j - c, j), c


def _whole_positions(sp: ThdSplit, size: int) -> torch.Tensor:
    rank, b, second, within, c = _rank_order_tokens(sp, size)
    chunk = torch.where(second, 2 * size - 1 - rank, rank)
    return sp.starts[b] + chunk * c + within


def _coarse_positions(sp: ThdSplit, coarse: ThdSplit, a_size: int) -> torch.Tensor:
    """"a2a+p2p": the a2a group's ranks a hold fine chunks p A + a and 2 S - 1 - p A - a of each
    sequence (S = A P); the ring's layout holds coarse chunks p and 2 P - 1 - p (A fine chunks each,
    in sequence order), where fine chunk p A + a sits at slot a of the first and fine chunk
    2 S - 1 - p A - a at slot A - 1 - a of the second."""
    a, b, second, within, c = _rank_order_tokens(sp, a_size)
    slot = torch.where(second, a_size - 1 - a, a)
    return coarse.cu_local.to(torch.int64)[b] + second * (a_size * c) + slot * c + within


_ORDERS = []  # [(key, TokenOrder)]: the splits are remembered (split), so are their orders


def token_order(sp: ThdSplit, size: int, coarse: ThdSplit = None) -> TokenOrder:
    """The TokenOrder of size ranks to the whole sequences, or with coarse (the p2p ring's split of
    "a2a+p2p", size then the a2a group's) to the ring's layout."""
    for key, order in _ORDERS:
        if key[0] is sp and key[1] == size and key[2] is coarse:
            return order
    order = TokenOrder(_whole_positions(sp, size) if coarse is None else _coarse_positions(sp, coarse, size))
    _ORDERS.insert(0, ((sp, size, coarse), order))
    del _ORDERS[_SPLIT_ENTRIES:]
    return order


class _Step(NamedTuple):
    cu: tuple  # (cu_q, cu_kv, cu_q_padded, cu_kv_padded)
    max_q: int
    max_kv: int
    mask: str
    covered: torch.Tensor  # [t] bool: query tokens this step computes (None: all)
    row: torch.Tensor  # [t] int64: each covered token's row in the call's statistics


def ring_steps(sp: ThdSplit, cp: CPGroup, causal: bool):
    """The ring's steps on this rank (made once per split)."""
    key = (cp.rank, cp.size, causal)
    if key not in sp.steps:
        sp.steps[key] = [_step(sp, step_kind(cp, i, causal), causal, cp.rank, (cp.rank - i) % cp.size, cp.size)
                         for i in range(cp.size)]
    return sp.steps[key]


def _real(sp: ThdSplit, chunk: int) -> torch.Tensor:
    """[b] the real (not padding) tokens of each sequence's chunk `chunk`."""
    return (sp.lens - chunk * sp.c).clamp(min=0).minimum(sp.c)


def _cum(n: torch.Tensor) -> torch.Tensor:
    return torch.cat([n.new_zeros(1), torch.cumsum(n, 0)]).to(torch.int32)


def _step(sp: ThdSplit, kind: str, causal: bool, rank: int, src: int, size: int) -> _Step:
    """Step `kind` of this rank with the block of rank src (module text)."""
    m2 = 2 * sp.max_half
    if sp.padded:
        return _padded_step(sp, kind, causal, rank, src, size)
    if kind == "kv_first":
        return _Step((sp.cu_local, sp.cu_half, sp.cu_local, sp.cu_local), m2, sp.max_half, "padding", None, sp.tok_j)
    if kind == "q_second":
        cov = sp.tok_j >= sp.tok_c
        return _Step((sp.cu_half, sp.cu_local, sp.second, sp.cu_local), sp.max_half, m2, "padding", cov,
                     torch.where(cov, sp.tok_j - sp.tok_c, 0))
    mask = "padding_causal" if kind == "own" and causal else "padding"
    return _Step((sp.cu_local, sp.cu_local, None, None), m2, m2, mask, None, sp.tok_j)


def _padded_step(sp: ThdSplit, kind: str, causal: bool, rank: int, src: int, size: int) -> _Step:
    """_step with padding: the real tokens of every part as cu_seqlens, the chunks' places as
    padded offsets. A sequence whose keys in the step are all padding takes no queries either
    (attention over no keys is undefined; those tokens are covered by other steps or are padding)."""
    m2 = 2 * sp.max_half
    ours, theirs = _real(sp, rank) + _real(sp, 2 * size - 1 - rank), _real(sp, src) + _real(sp, 2 * size - 1 - src)
    if kind == "kv_first":
        nq, nkv, q_at, q_max, kv_max = ours, _real(sp, src), sp.cu_local, m2, sp.max_half
    elif kind == "q_second":
        nq, nkv, q_at, q_max, kv_max = _real(sp, 2 * size - 1 - rank), theirs, sp.second, sp.max_half, m2
    else:
        nq, nkv, q_at, q_max, kv_max = ours, theirs, sp.cu_local, m2, m2
    nq = torch.where(nkv > 0, nq, 0)
    first = 0 if kind != "q_second" else 1  # the queries' first local chunk (0 or 1)
    j = sp.tok_j - first * sp.tok_c
    cov = (j >= 0) & (j < nq[sp.tok_b])
    mask = "padding_causal" if kind == "own" and causal else "padding"
    return _Step((_cum(nq), _cum(nkv), q_at, sp.cu_local), q_max, kv_max, mask, cov, torch.where(cov, j, 0))


def gathered_calls(sp: ThdSplit, rank: int, size: int, causal: bool, left: int = -1):
    """all_gather's THD calls on this rank (made once per split): (cu tuple, max_q, max_kv, mask) with
    the local queries in place (padded offsets) and the gathered whole sequences as keys. left >= 0:
    a causal sliding window of that many keys back, so each chunk's keys start at its sequences'
    chunk start - left (the bottom-right diagonal stays at each query's own key)."""
    key = (rank, size, causal, left, "all_gather")
    if key not in sp.steps:
        total = sp.starts.new_tensor([sp.tok_b.numel() * size])
        whole = torch.cat([sp.starts, total]).to(torch.int32)
        if not causal:
            nq = _real(sp, rank) + _real(sp, 2 * size - 1 - rank)
            calls = [((_cum(nq), _cum(sp.lens), sp.cu_local, whole), 2 * sp.max_half, sp.max_whole, "padding")]
        else:  # chunk `chunk` sees its sequence's keys [lo, (chunk + 1) c), or up to its last real one
            calls = []
            for chunk, at in ((rank, sp.cu_local), (2 * size - 1 - rank, sp.second)):
                lo = (chunk * sp.c - left).clamp(min=0) if left >= 0 else torch.zeros_like(sp.c)
                nkv = (sp.lens.minimum((chunk + 1) * sp.c) - lo).clamp(min=0)
                kv_at = torch.cat([sp.starts + lo, total]).to(torch.int32)
                calls.append(((_cum(_real(sp, chunk)), _cum(nkv), at, kv_at), sp.max_half, sp.max_whole,
                              "padding_causal_bottom_right"))
        sp.steps[key] = calls
    return sp.steps[key]


def attend_gathered(q, kf, vf, sp: ThdSplit, rank: int, size: int, causal: bool, scale: float,
                    dropout: float, left: int = -1) -> torch.Tensor:
    """"all_gather" over THD: this rank's queries [t, h, d] over the gathered whole sequences kf, vf
    -> [t, h, d_v] (the calls cover disjoint query rows and leave the others zero: summed); left:
    a causal window's left bound (-1: none)."""
    out = None
    for cu, max_q, max_kv, mask in gathered_calls(sp, rank, size, causal, left):
        rng = _fa.new_rng_state(q.device) if dropout > 0.0 else _df._zero_rng_state(q.device)
        cfg = (max_q, max_kv, True, scale, dropout, _fa.LAYOUTS["thd"], _fa.BIAS_INT["no_bias"], _fa.MASK_INT[mask],
               left, 0 if left >= 0 else -1, "causal" not in mask)
        o = _fa.FusedAttnFunc.apply(q, kf, vf, None, *cu, rng, None, cfg)
        out = o if out is None else out + o
    return out


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
    def forward(ctx, q, k, v, cp: CPGroup, sp: ThdSplit, causal: bool, scale: float, dropout: float, sink=None):
        layout = _fa.LAYOUTS["thd"]
        zero_rng = _df._zero_rng_state(q.device)
        steps = ring_steps(sp, cp, causal)
        rngs, out, lse = [], None, None
        for i, block in ring_blocks(cp, k, v):
            st = steps[i]
            rng = _fa.new_rng_state(q.device) if dropout > 0.0 else zero_rng
            o_i, stats, rng_i, _ = _fa.fused_attn_fwd(q, block[0], block[1], None, *st.cu, rng, st.max_q, st.max_kv,
                                                      True, scale, dropout, layout, _fa.BIAS_INT["no_bias"],
                                                      _fa.MASK_INT[st.mask], -1, -1, "causal" not in st.mask)
            rngs.append(rng_i)
            lse_i = _to_tokens(stats, sp, st)
            if i == 0:  # (every real token sees itself; padding tokens: O 0 and a finite lse, so they stay 0)
                out, lse = o_i.float(), lse_i if st.covered is None else lse_i.masked_fill(~st.covered[:, None], 0.0)
            else:  # O = sum_i exp(lse_i - lse) O_i; uncovered rows: weight 0 (their O_i rows are zeros)
                merge_into(out, lse, o_i, lse_i, 0, "thd")
        lse = fold_sink(ctx, out, lse, sink, "thd")  # (padding tokens: O stays 0)
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
        dsink = sink_grad(ctx, dout, out, lse, "thd")  # (padding tokens: O 0, no share)
        dk, dv = dkv.result()
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None, dsink
