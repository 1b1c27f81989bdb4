"""One rank of the context-parallel attention tests (test_context_parallel.py starts cp_size of these).

argv: rank, cp_size, init file, output file, device ("cpu": gloo; "cuda": NCCL, one GPU per rank),
and mode: "" (one CP group) or "hier" (cp_comm_type "a2a+p2p" over HIER's groups: only the
DotProductAttention, FP8 and TransformerLayer runs).
Every rank draws the same whole-sequence inputs (seeded), runs DotProductAttention (and one
TransformerLayer) with context parallelism on its two chunks, and saves its local outputs and
gradients; the test puts the chunks back in sequence order and compares with float64 attention
over the whole sequence."""

import contextlib

import torch
import torch.distributed as dist

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling

from _ranks import init_rank

B, C, D_QK, D_V = 2, 3, 16, 8  # batch, chunk length (odd), head sizes (multiples of 8: cuDNN's)
EPS = 1e-2  # the dropout test's step along its direction


def heads(size):
    return 2 * size, size  # a2a splits heads and key/value heads over the group


THD_WINDOW = (3, 0)  # all_gather over THD: a causal window reaching back over chunk boundaries
HIER = (2, 2)  # "hier" mode: a2a group size A, p2p group size P (cp_size A P)


def hier_groups(rank, a, p):
    """(a2a group, p2p group) of this rank: a2a groups of consecutive ranks, p2p groups every A-th
    rank (Megatron's hierarchical_context_parallel_sizes [A, P]); every rank makes every group."""
    a2a = [dist.new_group(list(range(i * a, (i + 1) * a))) for i in range(p)]
    p2p = [dist.new_group(list(range(j, a * p, a))) for j in range(a)]
    return [a2a[rank // a], p2p[rank % a]]


def cases(size, mode=""):
    if mode == "hier":
        return [("a2a+p2p", mask, fmt, None) for mask in ("no_mask", "causal") for fmt in ("bshd", "sbhd")]
    out = []
    for comm in ("p2p", "all_gather", "a2a"):
        for mask in ("no_mask", "causal"):
            for fmt in (("bshd", "sbhd") if size == 2 else ("bshd",)):
                out.append((comm, mask, fmt, None))
    out.append(("a2a", "causal", "bshd", (4, 0)))
    out.append(("a2a", "no_mask", "sbhd", (2, 3)))
    # all_gather's windows: each bound alone and both (the query chunks' key ranges clip at the ends)
    out += [("all_gather", "causal", "bshd", (4, 0)), ("all_gather", "no_mask", "sbhd", (2, 3)),
            ("all_gather", "no_mask", "bshd", (-1, 1)), ("all_gather", "no_mask", "bshd", (5, -1))]
    return out


def sink_comms(mode):
    """The comm types of the attention-sink runs (causal bshd, learnable and off-by-one)."""
    return ("a2a+p2p",) if mode == "hier" else ("p2p", "all_gather", "a2a")


def sink_logits(size):
    """The learnable sink's logits [heads] every rank sets (zeros, TE's start, would test less)."""
    return torch.linspace(-1.0, 1.5, heads(size)[0])


def fp8_cases(size, mode=""):
    """(comm, mask, fmt) of the FP8 attention runs (fp8_dpa): the FP8 ring and a2a."""
    if mode == "hier":
        return [("a2a+p2p", "causal", "bshd"), ("a2a+p2p", "no_mask", "sbhd")]
    out = [("p2p", mask, fmt) for mask in ("no_mask", "causal") for fmt in (("bshd", "sbhd") if size == 2 else ("bshd",))]
    return out + [("a2a", "causal", "bshd")]


def bias_cases(size):
    """(mask, fmt, bias batch, bias gradient asked, keys per query) of the ring's post_scale_bias
    runs; 2 keys per query: cross attention, keys twice the queries' length."""
    fmts = ("bshd", "sbhd") if size == 2 else ("bshd",)
    return ([(mask, fmt, 1, True, 1) for mask in ("no_mask", "causal") for fmt in fmts]
            + [("causal", "bshd", B, False, 1), ("no_mask", "bshd", 1, True, 2)])


def bias_case_name(case):
    mask, fmt, batch, _, kv = case
    return f"bias-{mask}-{fmt}-{batch}" + ("" if kv == 1 else f"-kv{kv}")


def bias_inputs(size, seed, dtype, kv):
    """whole_inputs with kv times as many keys (the extra ones drawn from seed + 1)."""
    q, k, v, do = whole_inputs(size, seed, dtype)
    if kv > 1:
        _, k2, v2, _ = whole_inputs(size, seed + 1, dtype)
        k, v = torch.cat([k, k2], 1), torch.cat([v, v2], 1)
    return q, k, v, do


def whole_bias(size, seed, dtype, batch, kv=1):
    """A post-scale bias [batch, h, s, kv s] over the whole sequence (s = 2 size C)."""
    s = 2 * size * C
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, heads(size)[0], s, kv * s, generator=gen).to(dtype)


def fp8_sizes(on_cuda):
    """(chunk length, head size) of the FP8 runs: cuDNN's FP8 backward takes head size 128 and
    lengths that are multiples of 128 (a causal ring step attends over one chunk); on the CPU,
    sizes big enough that the FP8 errors' spread between runs stays small (at chunk 8, head size
    16, the ratio of two FP8 runs' errors against float64 ranged 0.9-1.45; at 16, 32: 0.9-1.12)."""
    return (128, 128) if on_cuda else (16, 32)


def fp8_reduced(i):
    """Whether FP8 case i reduces its amaxes over the CP group."""
    return i % 2 == 0


def fp8_whole_inputs(size, seed, step, dtype, c, d):
    """whole_inputs for FP8 run `seed`, training step `step` (new values each step: the second
    step runs on the delayed scales of the first)."""
    h, g = heads(size)
    gen = torch.Generator().manual_seed(seed * 10 + step)
    q, k, v = (torch.randn(1, 2 * size * c, n, d, generator=gen) for n in (h, g, g))
    do = torch.randn(1, 2 * size * c, h, d, generator=gen) * 0.1
    return [t.to(dtype) for t in (q, k, v, do)]


def case_name(case):
    comm, mask, fmt, window = case
    return f"{comm}-{mask}-{fmt}" + ("" if window is None else f"-w{window[0]}_{window[1]}")


def whole_inputs(size, seed, dtype):
    """q [b, s, h, d_qk], k [b, s, g, d_qk], v [b, s, g, d_v], dO [b, s, h, d_v] (bshd), s = 2 size C."""
    h, g = heads(size)
    s = 2 * size * C
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, s, n, d, generator=gen) for n, d in ((h, D_QK), (g, D_QK), (g, D_V)))
    do = torch.randn(B, s, h, D_V, generator=gen)
    return [t.to(dtype) for t in (q, k, v, do)]


def whole_inputs_thd(size, seed, dtype, lens=None):
    """whole_inputs with the packed sequences (lens, default thd_lengths) as one batch row:
    [1, total, heads, d]."""
    h, g = heads(size)
    total = sum(lens or thd_lengths(size))
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(1, total, n, d, generator=gen).to(dtype)
            for n, d in ((h, D_QK), (g, D_QK), (g, D_V), (h, D_V))]


def local_chunks(x, rank, size, dim=1):
    """This rank's chunks (rank, 2 size - 1 - rank) of x along dim, concatenated."""
    parts = x.chunk(2 * size, dim=dim)
    return torch.cat([parts[rank], parts[2 * size - 1 - rank]], dim=dim)


def thd_lengths(size):
    return [2 * size * n for n in (1, 3, 2)]  # whole sequences, multiples of 2 cp_size


def thd_padded_lengths(size):
    """(real lengths, padded lengths) of padded THD sequences: one short by a token, one whose
    padding fills whole chunks, and one of a single real token (only rank 0 holds any of it: the
    others' steps see a sequence without queries, rank 0's no-mask steps one without keys)."""
    return [2 * size - 1, 2 * size + 1, 1], [2 * size, 6 * size, 4 * size]


def thd_local_index(lens, rank, size):
    """The whole-sequence token indices this rank holds, in its local order: per sequence, chunks
    rank and 2 size - 1 - rank."""
    idx, start = [], 0
    for n in lens:
        c = n // (2 * size)
        for chunk in (rank, 2 * size - 1 - rank):
            idx.extend(range(start + chunk * c, start + (chunk + 1) * c))
        start += n
    return torch.tensor(idx)


def one_rank_level_cases(size):
    """(case of cases(size), [A, P] of the "a2a+p2p" groups) whose a2a or p2p level has one rank:
    the other level runs alone, as that case's comm type."""
    by_comm = {c[0]: c for c in cases(size) if c[3] is None}
    return [(by_comm["p2p"], (1, size)), (by_comm["a2a"], (size, 1))]


def one_rank_level_runs(results, rank, size, dev, dtype):
    """cp_comm_type "a2a+p2p" with a level of one rank (Megatron's hierarchical sizes [1, N] / [N, 1])
    on the inputs of the matching plain case: results under "level1-" + that case's name."""
    for case, (a, p) in one_rank_level_cases(size):
        results["level1-" + case_name(case)] = attend_case(rank, size, cases(size).index(case), case,
                                                           hier_groups(rank, a, p), "a2a+p2p", dev, dtype)


def attend_case(rank, size, i, case, cp_group, comm, dev, dtype):
    """[O, dQ, dK, dV] (bshd, this rank's chunks) of case i of cases() on cp_group with comm."""
    h, g = heads(size)
    _, mask, fmt, window = case
    q, k, v, do = whole_inputs(size, 1000 + i, dtype)
    loc = [local_chunks(t, rank, size).to(dev) for t in (q, k, v, do)]
    if fmt == "sbhd":
        loc = [t.transpose(0, 1).contiguous() for t in loc]
    ql, kl, vl = (t.requires_grad_() for t in loc[:3])
    dpa = te.DotProductAttention(h, (D_QK, D_V), num_gqa_groups=g, attention_dropout=0.0, qkv_format=fmt,
                                 attn_mask_type=mask, window_size=window, cp_group=cp_group,
                                 cp_global_ranks=list(range(size)), cp_comm_type=comm)
    o = dpa(ql, kl, vl)
    o.backward(loc[3].reshape(o.shape))
    res = [o.view(*o.shape[:-1], h, D_V), ql.grad, kl.grad, vl.grad]
    if fmt == "sbhd":
        res = [t.transpose(0, 1) for t in res]
    return [t.detach().float().cpu() for t in res]


def main():
    rank, size, out_file, dev, group, rest = init_rank()
    mode = rest[0] if rest else ""
    on_cuda = dev.type == "cuda"
    cp_group = hier_groups(rank, *HIER) if mode == "hier" else group  # (amaxes are reduced over `group`)
    dtype = torch.bfloat16 if on_cuda else torch.float32
    h, g = heads(size)
    results = {}
    for i, case in enumerate(cases(size, mode)):
        results[case_name(case)] = attend_case(rank, size, i, case, cp_group, case[0], dev, dtype)

    sink_runs(results, rank, size, cp_group, mode, dev, dtype)
    if mode == "hier":
        thd_runs(results, rank, size, cp_group, ("a2a+p2p",), dev, dtype)
        fp8_runs(results, rank, size, group, cp_group, mode, on_cuda, dev, dtype)
        transformer_layer_run(results, rank, size, cp_group, "a2a+p2p", dev, dtype)
        finish(results, out_file)
        return

    thd_runs(results, rank, size, group, ("p2p", "all_gather", "a2a"), dev, dtype)
    bias_runs(results, rank, size, group, dev, dtype)
    one_rank_level_runs(results, rank, size, dev, dtype)

    # dropout (causal, bshd): L = <O, dO> at Q, K, V and at +-EPS along one direction, same seeds
    for comm in ("p2p", "all_gather", "a2a"):
        q, k, v, do = whole_inputs(size, 77, dtype)
        gen = torch.Generator().manual_seed(78)
        dirs = [torch.randn(t.shape, generator=gen).to(dtype) for t in (q, k, v)]
        loc = [local_chunks(t, rank, size).to(dev) for t in (q, k, v, do)]
        ldirs = [local_chunks(t, rank, size).to(dev) for t in dirs]
        dpa = te.DotProductAttention(h, (D_QK, D_V), num_gqa_groups=g, attention_dropout=0.3, qkv_format="bshd",
                                     attn_mask_type="causal", cp_group=group, cp_comm_type=comm)
        vals = []
        for sign in (0.0, 1.0, -1.0):
            torch.manual_seed(100 + rank)
            if on_cuda:
                torch.cuda.manual_seed(100 + rank)
            xs = [(t + sign * EPS * d).detach().requires_grad_() for t, d in zip(loc[:3], ldirs)]
            o = dpa(*xs)
            loss = (o.float() * loc[3].reshape(o.shape).float()).sum()
            vals.append(loss.detach().cpu())
            if sign == 0.0:
                loss.backward()
                slope = sum((x.grad.float() * d.float()).sum() for x, d in zip(xs, ldirs)).detach().cpu()
                o_drop = o.detach()
        dpa.eval()
        moved = ((dpa(*loc[:3]) - o_drop).float().norm() / o_drop.float().norm()).cpu()
        results[f"dropout-{comm}"] = vals + [slope, moved]

    tracker_runs(results, rank, size, group, dev, dtype)
    fp8_runs(results, rank, size, group, group, mode, on_cuda, dev, dtype)
    transformer_layer_run(results, rank, size, group, "p2p", dev, dtype)
    # a TransformerLayer under fp8_mha (p2p, causal, no RoPE: without CP its attention takes FP8 hand-offs);
    # rank 0 also runs the same layer over the whole sequence without CP, in FP8 and in high precision
    fc, fd = fp8_sizes(on_cuda)
    hidden = fd * h
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(B, 2 * size * fc, hidden, generator=gen).to(dtype)
    dy = torch.randn(B, 2 * size * fc, hidden, generator=gen).to(dtype)
    mha = DelayedScaling(fp8_dpa=True, fp8_mha=True)
    runs = [("cp", True)] + ([("one", True), ("one_hp", False)] if rank == 0 else [])
    for name, fp8 in runs:
        torch.manual_seed(8)
        layer = te.TransformerLayer(hidden, 2 * hidden, h, num_gqa_groups=g, hidden_dropout=0.0,
                                    attention_dropout=0.0, self_attn_mask_type="causal", attn_input_format="bshd",
                                    params_dtype=dtype, device=dev)
        xs, dys = x, dy
        if name == "cp":
            layer.set_context_parallel_group(group, list(range(size)), None, "p2p")
            xs, dys = local_chunks(x, rank, size), local_chunks(dy, rank, size)
        xl = xs.to(dev).clone().requires_grad_()
        with te.fp8_autocast(enabled=fp8, fp8_recipe=mha, fp8_group=group if name == "cp" else None):
            y = layer(xl)
        y.backward(dys.to(dev))
        results[f"fp8_mha_layer-{name}"] = [y.detach().float().cpu().clone(), xl.grad.detach().float().cpu().clone()]
    finish(results, out_file)


def thd_runs(results, rank, size, cp_group, comms, dev, dtype):
    # THD: packed sequences, cu_seqlens of the whole sequences; "pad": padded sequences (cu_seqlens
    # of the real tokens, cu_seqlens_padded of the places)
    h, g = heads(size)

    def cum(x):
        return torch.tensor([0] + list(torch.tensor(x).cumsum(0)), dtype=torch.int32, device=dev)
    real, padded = thd_padded_lengths(size)
    for pad in ("", "pad-"):
        lens = padded if pad else thd_lengths(size)
        cu, cu_pad = (cum(real), cum(padded)) if pad else (cum(lens), None)
        idx = thd_local_index(lens, rank, size)
        for comm in comms:
            for j, mask in enumerate(("padding_causal", "padding")):
                q, k, v, do = (t[0] for t in whole_inputs_thd(size, 2000 + j, dtype, lens))
                loc = [t[idx].to(dev) for t in (q, k, v, do)]
                ql, kl, vl = (t.requires_grad_() for t in loc[:3])
                dpa = te.DotProductAttention(h, (D_QK, D_V), num_gqa_groups=g, attention_dropout=0.0,
                                             qkv_format="thd", attn_mask_type=mask, cp_group=cp_group,
                                             cp_global_ranks=list(range(size)), cp_comm_type=comm)
                o = dpa(ql, kl, vl, cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_pad,
                        cu_seqlens_kv_padded=cu_pad)
                o.backward(loc[3].reshape(o.shape))
                results[f"thd-{pad}{comm}-{mask}"] = [t.detach().float().cpu()
                                                      for t in (o.view(-1, h, D_V), ql.grad, kl.grad, vl.grad)]
        if "all_gather" in comms:  # a causal sliding window (inputs of the padding_causal runs)
            q, k, v, do = (t[0] for t in whole_inputs_thd(size, 2000, dtype, lens))
            loc = [t[idx].to(dev) for t in (q, k, v, do)]
            ql, kl, vl = (t.requires_grad_() for t in loc[:3])
            dpa = te.DotProductAttention(h, (D_QK, D_V), num_gqa_groups=g, attention_dropout=0.0, qkv_format="thd",
                                         attn_mask_type="padding_causal", window_size=THD_WINDOW, cp_group=cp_group,
                                         cp_comm_type="all_gather")
            o = dpa(ql, kl, vl, cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_pad,
                    cu_seqlens_kv_padded=cu_pad)
            o.backward(loc[3].reshape(o.shape))
            results[f"thd-{pad}all_gather-window"] = [t.detach().float().cpu()
                                                     for t in (o.view(-1, h, D_V), ql.grad, kl.grad, vl.grad)]


def bias_runs(results, rank, size, cp_group, dev, dtype):
    """The p2p ring with a post-scale bias: each rank passes its query rows of the whole bias (every
    key column, in sequence order); outputs, input gradients and the bias gradient (its rows)."""
    h, g = heads(size)
    for i, case in enumerate(bias_cases(size)):
        mask, fmt, batch, grad, kv = case
        q, k, v, do = bias_inputs(size, 4000 + i, dtype, kv)
        loc = [local_chunks(t, rank, size).to(dev) for t in (q, k, v, do)]
        if fmt == "sbhd":
            loc = [t.transpose(0, 1).contiguous() for t in loc]
        ql, kl, vl = (t.requires_grad_() for t in loc[:3])
        bl = local_chunks(whole_bias(size, 4100 + i, dtype, batch, kv), rank, size, dim=2).to(dev)
        bl.requires_grad_(grad)
        dpa = te.DotProductAttention(h, (D_QK, D_V), num_gqa_groups=g, attention_dropout=0.0, qkv_format=fmt,
                                     attn_mask_type=mask, cp_group=cp_group, cp_global_ranks=list(range(size)),
                                     cp_comm_type="p2p")
        o = dpa(ql, kl, vl, core_attention_bias_type="post_scale_bias", core_attention_bias=bl)
        o.backward(loc[3].reshape(o.shape))
        res = [o.view(*o.shape[:-1], h, D_V), ql.grad, kl.grad, vl.grad]
        if fmt == "sbhd":
            res = [t.transpose(0, 1) for t in res]
        results[bias_case_name(case)] = ([t.detach().float().cpu() for t in res]
                                                 + [bl.grad.detach().float().cpu() if grad else None])


def sink_runs(results, rank, size, cp_group, mode, dev, dtype):
    """Attention sinks (softmax_type) with CP, causal bshd: outputs, input gradients and the
    learnable offsets' gradient (None for off-by-one)."""
    h, g = heads(size)
    q, k, v, do = whole_inputs(size, 90, dtype)
    loc = [local_chunks(t, rank, size).to(dev) for t in (q, k, v, do)]
    for comm in sink_comms(mode):
        for softmax_type in ("learnable", "off-by-one"):
            dpa = te.DotProductAttention(h, (D_QK, D_V), num_gqa_groups=g, attention_dropout=0.0, qkv_format="bshd",
                                         attn_mask_type="causal", softmax_type=softmax_type, cp_group=cp_group,
                                         cp_global_ranks=list(range(size)), cp_comm_type=comm).to(dev)
            if softmax_type == "learnable":
                with torch.no_grad():
                    dpa.softmax_offset.copy_(sink_logits(size))
            xs = [t.detach().clone().requires_grad_() for t in loc[:3]]
            o = dpa(*xs)
            o.backward(loc[3].reshape(o.shape))
            off = dpa.softmax_offset.grad if softmax_type == "learnable" else None
            results[f"sink-{comm}-{softmax_type}"] = (
                [t.detach().float().cpu() for t in (o.view(*o.shape[:-1], h, D_V), *(x.grad for x in xs))]
                + [None if off is None else off.detach().float().cpu()])
    # the THD ring with a learnable sink (padded sequences, padding_causal)
    comm = "a2a+p2p" if mode == "hier" else "p2p"
    real, padded = thd_padded_lengths(size)
    cu, cu_pad = (torch.tensor([0] + list(torch.tensor(x).cumsum(0)), dtype=torch.int32, device=dev)
                  for x in (real, padded))
    q, k, v, do = (t[0] for t in whole_inputs_thd(size, 2000, dtype, padded))
    loc = [t[thd_local_index(padded, rank, size)].to(dev) for t in (q, k, v, do)]
    xs = [t.detach().clone().requires_grad_() for t in loc[:3]]
    dpa = te.DotProductAttention(h, (D_QK, D_V), num_gqa_groups=g, attention_dropout=0.0, qkv_format="thd",
                                 attn_mask_type="padding_causal", softmax_type="learnable", cp_group=cp_group,
                                 cp_global_ranks=list(range(size)), cp_comm_type=comm).to(dev)
    with torch.no_grad():
        dpa.softmax_offset.copy_(sink_logits(size))
    o = dpa(*xs, cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_pad, cu_seqlens_kv_padded=cu_pad)
    o.backward(loc[3].reshape(o.shape))
    results[f"thd-pad-sink-{comm}"] = ([t.detach().float().cpu() for t in (o.view(-1, h, D_V), *(x.grad for x in xs))]
                                      + [dpa.softmax_offset.grad.detach().float().cpu()])


class Tracker:
    """A get_rng_state_tracker() stand-in (Megatron's): fork() draws in its own RNG state."""

    def __init__(self, seed, dev):
        self.dev = dev
        with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
            torch.manual_seed(seed)
            self.state = self._get()

    def _get(self):
        return torch.cuda.get_rng_state(self.dev) if self.dev.type == "cuda" else torch.get_rng_state()

    def _set(self, st):
        if self.dev.type == "cuda":
            torch.cuda.set_rng_state(st, self.dev)
        else:
            torch.set_rng_state(st)

    @contextlib.contextmanager
    def fork(self):
        orig = self._get()
        self._set(self.state)
        try:
            yield
        finally:
            self.state = self._get()
            self._set(orig)


def tracker_runs(results, rank, size, group, dev, dtype):
    # dropout drawn in the module's RNG tracker (TE's get_rng_state_tracker) with each comm type:
    # per comm type, [default RNG state untouched, output with tracker seed 1, seed 1 again, seed 2]
    h, g = heads(size)
    q, k, v, _ = whole_inputs(size, 79, dtype)
    loc = [local_chunks(t, rank, size).to(dev) for t in (q, k, v)]
    for comm in ("p2p", "all_gather", "a2a"):
        outs, untouched = [], True
        for seed in (1, 1, 2):
            tracker = Tracker(seed, dev)
            dpa = te.DotProductAttention(h, (D_QK, D_V), num_gqa_groups=g, attention_dropout=0.5, qkv_format="bshd",
                                         attn_mask_type="causal", cp_group=group, cp_comm_type=comm,
                                         get_rng_state_tracker=lambda t=tracker: t)
            before = Tracker._get(tracker)
            outs.append(dpa(*loc).detach().float().cpu())
            untouched = untouched and torch.equal(before, Tracker._get(tracker))
        results[f"tracker-{comm}"] = [untouched] + outs


def finish(results, out_file):
    torch.save(results, out_file)
    dist.barrier()
    dist.destroy_process_group()


def fp8_runs(results, rank, size, group, cp_group, mode, on_cuda, dev, dtype):
    # FP8 attention (fp8_dpa), two training steps: each rank its chunks with CP, rank 0 also the whole
    # sequence without CP on the same device. Every other case reduces the amaxes over the group
    # (fp8_group): the others' ranks hold different scales in their second step.
    h, g = heads(size)
    fc, fd = fp8_sizes(on_cuda)
    recipe = DelayedScaling(fp8_dpa=True)
    for i, (comm, mask, fmt) in enumerate(fp8_cases(size, mode)):
        mods = {"cp": te.DotProductAttention(h, fd, num_gqa_groups=g, qkv_format=fmt, attn_mask_type=mask,
                                             cp_group=cp_group, cp_global_ranks=list(range(size)),
                                             cp_comm_type=comm)}
        if rank == 0:
            mods["one"] = te.DotProductAttention(h, fd, num_gqa_groups=g, qkv_format=fmt, attn_mask_type=mask)
        for step in range(2):
            whole = fp8_whole_inputs(size, 3000 + i, step, dtype, fc, fd)
            for name, mod in mods.items():
                ts = [(local_chunks(t, rank, size) if name == "cp" else t).to(dev) for t in whole]
                if fmt == "sbhd":
                    ts = [t.transpose(0, 1).contiguous() for t in ts]
                ql, kl, vl = (t.requires_grad_() for t in ts[:3])
                with te.fp8_autocast(enabled=True, fp8_recipe=recipe,
                                     fp8_group=group if name == "cp" and fp8_reduced(i) else None):
                    o = mod(ql, kl, vl)
                o.backward(ts[3].reshape(o.shape))
                res = [o.view(*o.shape[:-1], h, fd), ql.grad, kl.grad, vl.grad]
                if fmt == "sbhd":
                    res = [t.transpose(0, 1) for t in res]
                meta = mod.fp8_meta
                results[f"fp8-{name}-{comm}-{mask}-{fmt}-{step}"] = (
                    [t.detach().float().cpu() for t in res]
                    + [meta.amax_history["fwd"].cpu().clone(), meta.scale["fwd"].cpu().clone()])


def transformer_layer_run(results, rank, size, cp_group, comm, dev, dtype):
    # a TransformerLayer (causal self attention with RoPE): same weights on every rank
    h, g = heads(size)
    hidden = 8 * h  # head size 8 (cuDNN's multiple)
    torch.manual_seed(7)
    layer = te.TransformerLayer(hidden, 2 * hidden, h, num_gqa_groups=g, hidden_dropout=0.0, attention_dropout=0.0,
                                self_attn_mask_type="causal", attn_input_format="bshd", params_dtype=dtype,
                                device=dev)
    layer.set_context_parallel_group(cp_group, list(range(size)), None, comm)
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(B, 2 * size * C, hidden, generator=gen).to(dtype)
    dy = torch.randn(B, 2 * size * C, hidden, generator=gen).to(dtype)
    xl = local_chunks(x, rank, size).to(dev).requires_grad_()
    rope = te.attention.RotaryPositionEmbedding(hidden // h)(2 * size * C).to(dev)  # the whole sequence's angles
    y = layer(xl, rotary_pos_emb=rope)
    y.backward(local_chunks(dy, rank, size).to(dev))
    wgrads = {n: p.grad.detach().float().cpu() for n, p in layer.named_parameters() if p.grad is not None}
    results["transformer_layer"] = [y.detach().float().cpu(), xl.grad.detach().float().cpu(), wgrads]


if __name__ == "__main__":
    main()
