"""Context parallelism of DotProductAttention / TransformerLayer (context_parallel.py).

cp_size ranks (processes: gloo on the CPU, NCCL with one GPU each under NVTE_TEST_DEVICE=cuda) run
_cp_worker.py; their chunks, put back in sequence order, must be the attention (output and
gradients) of the whole sequence: float64 attention for DotProductAttention, the same layer run on
one rank over the whole sequence for TransformerLayer (whose weight gradients are the sum of the
ranks' gradients). The rank-2 run uses the CPU's default (unfused) local attention, the rank-3
run the fused one (NVTE_FUSED_ATTN=1); the ring (p2p) runs fused attention in both."""
import math
import os

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.pytorch import context_parallel as _cp
from transformer_engine.pytorch import context_parallel_ring as _ring

from _util import DEVICE, ON_CUDA, rel_err
import _cp_worker as W
from _ranks import run_ranks

SIZES = (2, 3)
RUNS = [(2, ""), (3, ""), (4, "hier")]  # (cp_size, worker mode); "hier": a2a+p2p over _cp_worker.HIER's groups


def _run_ranks(size, mode=""):
    """The ranks' saved results (_cp_worker.py; the CPU's rank-3 run takes fused local attention)."""
    env = dict(os.environ)
    if size == 3 and not ON_CUDA:
        env["NVTE_FUSED_ATTN"] = "1"
    return run_ranks("_cp_worker.py", size, DEVICE.type, [mode], env=env)


@pytest.fixture(scope="module")
def results():
    """results(size): the ranks' saved outputs, one run per size for the whole module; dropped at the
    module's end (other files' tests scan the process for float tensors of given shapes)."""
    runs = {}

    def get(size, mode=""):
        if ON_CUDA and torch.cuda.device_count() < size:
            pytest.skip(f"needs {size} GPUs (one NCCL rank per GPU), found {torch.cuda.device_count()}")
        if (size, mode) not in runs:
            try:
                runs[size, mode] = _run_ranks(size, mode)
            except AssertionError as e:  # kept: every test of this run reports it without running it again
                runs[size, mode] = e
        if isinstance(runs[size, mode], AssertionError):
            raise runs[size, mode]
        return runs[size, mode]
    yield get
    runs.clear()


def whole(parts, size, dim=1):
    """The rank-local tensors (chunks r, 2 size - 1 - r each) in sequence order along dim."""
    chunks = [None] * (2 * size)
    for r, t in enumerate(parts):
        a, b = t.chunk(2, dim=dim)
        chunks[r], chunks[2 * size - 1 - r] = a, b
    return torch.cat(chunks, dim=dim)


def attention_ref(q, k, v, do, mask, window, dtype=torch.float64, sink=None, bias=None):
    """(O, dQ, dK, dV) of attention over the whole bshd sequence, computed in dtype; sink [h]: an
    attention sink's logits (one more softmax term per row), whose gradient is appended; bias
    [b | 1, h, s, s]: a post-scale bias, whose gradient is appended."""
    q, k, v, do = (t.detach().to(dtype).requires_grad_() for t in (q, k, v, do))
    rep = q.shape[2] // k.shape[2]
    qh = q.transpose(1, 2)
    kh, vh = (t.repeat_interleave(rep, 2).transpose(1, 2) for t in (k, v))
    z = (qh @ kh.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if bias is not None:
        bias = bias.detach().to(dtype).requires_grad_()
        z = z + bias
    s, sk = q.shape[1], k.shape[1]  # (sk != s: cross attention, no_mask only)
    i, j = torch.arange(s).view(s, 1), torch.arange(sk).view(1, sk)
    hide = torch.zeros(s, sk, dtype=torch.bool)
    if mask == "causal":
        hide |= j > i
    if window is not None:
        wl, wr = window
        if wl >= 0:
            hide |= j < i - wl
        if wr >= 0:
            hide |= j > i + wr
    z = z.masked_fill(hide, float("-inf"))
    if sink is not None:
        sink = sink.detach().to(dtype).requires_grad_()
        z = torch.cat([z, sink.view(1, -1, 1, 1).expand(z.shape[0], -1, s, 1)], -1)
    o = torch.softmax(z, -1)[..., :sk] @ vh
    o = o.transpose(1, 2)
    o.backward(do.detach())
    return ([o.detach(), q.grad, k.grad, v.grad] + ([sink.grad] if sink is not None else [])
            + ([bias.grad] if bias is not None else []))


@pytest.mark.parametrize("size", SIZES)
def test_a2a_p2p_with_a_one_rank_level_runs_the_other_alone(results, size):
    """cp_comm_type "a2a+p2p" whose a2a (or p2p) group has one rank runs the other level alone, as
    TE does (it had raised): the same results, bit for bit, as that comm type's own run."""
    for r in results(size):
        for case, _ in W.one_rank_level_cases(size):
            got, want = r["level1-" + W.case_name(case)], r[W.case_name(case)]
            assert all(torch.equal(a, b) for a, b in zip(got, want)), W.case_name(case)


@pytest.mark.parametrize("size, case", [(s, c) for s in SIZES for c in W.bias_cases(s)],
                         ids=[f"{s}-{W.bias_case_name(c)}" for s in SIZES for c in W.bias_cases(s)])
def test_ring_post_scale_bias_matches_whole_sequence(results, size, case):
    """The p2p ring with core_attention_bias_type "post_scale_bias" (each rank its query rows of the
    bias, every key column): output, input gradients and the bias gradient (the ranks' rows put
    back in sequence order) against float64 attention with the whole bias; also cross attention
    (twice as many keys as queries: the bias's key chunks are the keys', not the queries')."""
    mask, fmt, batch, grad, kv = case
    i = W.bias_cases(size).index(case)
    got = [r[W.bias_case_name(case)] for r in results(size)]
    parts = [whole([g[n] for g in got], size) for n in range(4)]
    if grad:
        parts.append(whole([g[4] for g in got], size, dim=2))
    dtype = torch.bfloat16 if ON_CUDA else torch.float32
    q, k, v, do = W.bias_inputs(size, 4000 + i, dtype, kv)
    bias = W.whole_bias(size, 4100 + i, dtype, batch, kv)
    ref = attention_ref(q, k, v, do, mask, None, bias=bias)
    naive = attention_ref(q, k, v, do, mask, None, dtype, bias=bias)
    for name, g, r, n in zip(("out", "dq", "dk", "dv", "dbias"), parts, ref, naive):
        e, e_naive = rel_err(g, r), rel_err(n, r)
        assert e <= (2e-6 + 4 * e_naive if not ON_CUDA else 2 * e_naive + 1e-3), (mask, fmt, name, e, e_naive)
    assert all(g[4] is None for g in got) != grad


@pytest.mark.parametrize("size, mode, case", [(s, m, c) for s, m in RUNS for c in W.cases(s, m)],
                         ids=[f"{s}-{W.case_name(c)}" for s, m in RUNS for c in W.cases(s, m)])
def test_dot_product_attention_matches_whole_sequence(results, size, mode, case):
    comm, mask, fmt, window = case
    res = results(size, mode)
    got = [whole([r[W.case_name(case)][i] for r in res], size) for i in range(4)]
    dtype = torch.bfloat16 if ON_CUDA else torch.float32
    idx = W.cases(size, mode).index(case)
    q, k, v, do = W.whole_inputs(size, 1000 + idx, dtype)
    ref = attention_ref(q, k, v, do, mask, window)
    naive = attention_ref(q, k, v, do, mask, window, dtype)  # the same attention in the test's precision
    for name, g, r, n in zip(("out", "dq", "dk", "dv"), got, ref, naive):
        e, e_naive = rel_err(g, r), rel_err(n, r)
        # float32 (CPU): float32-level agreement; bfloat16 (GPU): GUIDE's 2x-naive rule
        bound = 2e-6 + 4 * e_naive if not ON_CUDA else 2 * e_naive + 1e-3
        assert e <= bound, (comm, mask, fmt, window, name, e, e_naive)


THD_RUNS = [(s, "", c) for s in SIZES for c in ("p2p", "all_gather", "a2a")] + [(4, "hier", "a2a+p2p")]


@pytest.mark.parametrize("size, mode, comm", THD_RUNS, ids=[f"{s}-{c}" for s, _, c in THD_RUNS])
@pytest.mark.parametrize("mask", ["padding_causal", "padding"])
@pytest.mark.parametrize("pad", [False, True], ids=["exact", "padded"])
def test_thd_matches_whole_sequences(results, size, mode, comm, mask, pad):
    """qkv_format "thd" with every cp_comm_type: packed sequences of different lengths
    (cu_seqlens of the whole sequences), each split in 2 cp_size chunks; every sequence's attention
    against float64 attention of that sequence alone. pad: padded sequences (cu_seqlens of the real
    tokens and cu_seqlens_padded, one sequence's padding filling whole chunks): the padding tokens'
    outputs and gradients must be zeros."""
    _check_thd(results(size, mode), size, f"thd-{'pad-' if pad else ''}{comm}-{mask}", mask, pad,
               2000 + ["padding_causal", "padding"].index(mask), None)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("pad", [False, True], ids=["exact", "padded"])
def test_thd_all_gather_causal_window(results, size, pad):
    """all_gather over THD with a causal sliding window (_cp_worker.THD_WINDOW): each chunk's keys
    start where the window reaches back to, in every sequence."""
    _check_thd(results(size), size, f"thd-{'pad-' if pad else ''}all_gather-window", "padding_causal", pad, 2000,
               W.THD_WINDOW)


@pytest.mark.parametrize("size, mode, comm", [(2, "", "p2p"), (3, "", "p2p"), (4, "hier", "a2a+p2p")],
                         ids=["2-p2p", "3-p2p", "4-a2a+p2p"])
def test_thd_ring_attention_sink(results, size, mode, comm):
    """The THD ring with a learnable attention sink (padded sequences): outputs and gradients per
    sequence against float64 attention with the sink, the offsets' gradient (summed over the ranks)
    against the reference's summed over the sequences."""
    _check_thd(results(size, mode), size, f"thd-pad-sink-{comm}", "padding_causal", True, 2000, None,
               W.sink_logits(size))


def _check_thd(res, size, key, mask, pad, seed, window, sink=None):
    real, lens = W.thd_padded_lengths(size) if pad else (W.thd_lengths(size),) * 2
    dtype = torch.bfloat16 if ON_CUDA else torch.float32
    q, k, v, do = W.whole_inputs_thd(size, seed, dtype, lens)
    got = []
    for i in range(4):
        t = torch.full((sum(lens),) + tuple(res[0][key][i].shape[1:]), float("nan"))
        for r in range(size):
            t[W.thd_local_index(lens, r, size)] = res[r][key][i]
        got.append(t)
    causal = "causal" if "causal" in mask else "no_mask"
    ref, naive, real_rows = [[], [], [], [], []], [[], [], [], [], []], []
    start = 0
    for n, n_real in zip(lens, real):
        part = [t[:, start:start + n_real] for t in (q, k, v, do)]
        for acc, dt in ((ref, torch.float64), (naive, dtype)):
            for a, x in zip(acc, attention_ref(*part, causal, window, dt, sink)):
                a.append(x if x.dim() == 1 else x[0])  # (the sink's gradient is [h])
        real_rows.append(torch.arange(start, start + n_real))
        start += n
    real_rows = torch.cat(real_rows)
    is_pad = torch.ones(sum(lens), dtype=torch.bool)
    is_pad[real_rows] = False
    for name, g, r, n in zip(("out", "dq", "dk", "dv"), got, ref, naive):
        r, n = torch.cat(r), torch.cat(n)
        e, e_naive = rel_err(g[real_rows], r), rel_err(n, r)
        bound = 2e-6 + 4 * e_naive if not ON_CUDA else 2 * e_naive + 1e-3
        assert e <= bound, (key, name, e, e_naive)
        assert bool((g[is_pad] == 0).all()), (key, name, "padding tokens must come out as zeros")
    if sink is not None:
        g, r, n = sum(x[key][4] for x in res), sum(ref[4]), sum(naive[4])
        e, e_naive = rel_err(g, r), rel_err(n, r)
        assert e <= (2e-6 + 4 * e_naive if not ON_CUDA else 2 * e_naive + 1e-3), (key, "dsink", e, e_naive)


@pytest.mark.parametrize("size, mode", RUNS)
def test_transformer_layer_matches_whole_sequence(results, size, mode):
    """TransformerLayer.set_context_parallel_group, with RoPE (each rank's chunks rotated at their
    whole-sequence positions): outputs, input gradients and (summed over the ranks) weight gradients
    of the whole-sequence layer. p2p, and a2a+p2p (whose CP rank comes from its two groups)."""
    res = results(size, mode)
    h, g = W.heads(size)
    hidden = 8 * h
    dtype = torch.bfloat16 if ON_CUDA else torch.float32
    torch.manual_seed(7)
    layer = te.TransformerLayer(hidden, 2 * hidden, h, num_gqa_groups=g, hidden_dropout=0.0, attention_dropout=0.0,
                                self_attn_mask_type="causal", attn_input_format="bshd", params_dtype=dtype,
                                device=DEVICE)
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(W.B, 2 * size * W.C, hidden, generator=gen).to(dtype)
    dy = torch.randn(W.B, 2 * size * W.C, hidden, generator=gen).to(dtype)
    xd = x.to(DEVICE).requires_grad_()
    y = layer(xd, rotary_pos_emb=te.attention.RotaryPositionEmbedding(hidden // h)(x.shape[1]).to(DEVICE))
    y.backward(dy.to(DEVICE))
    tol = 1e-5 if not ON_CUDA else 2e-2
    assert rel_err(whole([r["transformer_layer"][0] for r in res], size), y) < tol
    assert rel_err(whole([r["transformer_layer"][1] for r in res], size), xd.grad) < tol
    # (a gradient that is zero in exact arithmetic, such as the key bias's, is compared with the
    # size of all weight gradients: its rounding noise has no scale of its own)
    grads = {n: p.grad for n, p in layer.named_parameters() if p.grad is not None}
    scale = max(float(g.detach().double().norm()) for g in grads.values())
    for n, ref in grads.items():
        got = sum(r["transformer_layer"][2][n] for r in res).double()
        ref = ref.detach().double().cpu()
        assert float((got - ref).norm()) <= tol * max(float(ref.norm()), 1e-3 * scale), n


SINK_RUNS = [(s, "", c) for s in SIZES for c in W.sink_comms("")] + [(4, "hier", "a2a+p2p")]


@pytest.mark.parametrize("size, mode, comm", SINK_RUNS, ids=[f"{s}-{c}" for s, _, c in SINK_RUNS])
@pytest.mark.parametrize("softmax_type", ["learnable", "off-by-one"])
def test_attention_sink_matches_whole_sequence(results, size, mode, comm, softmax_type):
    """softmax_type with CP (causal bshd): the ring folds the sink in after its steps and computes
    the learnable offset's gradient from its statistics; a2a's local attention takes its heads'
    offsets. Against float64 attention with the sink over the whole sequence; the offset gradients
    summed over the ranks (as data parallelism over the CP group sums them) against the reference's."""
    res = results(size, mode)
    key = f"sink-{comm}-{softmax_type}"
    got = [whole([r[key][i] for r in res], size) for i in range(4)]
    dtype = torch.bfloat16 if ON_CUDA else torch.float32
    q, k, v, do = W.whole_inputs(size, 90, dtype)
    sink = W.sink_logits(size) if softmax_type == "learnable" else torch.zeros(W.heads(size)[0])
    ref = attention_ref(q, k, v, do, "causal", None, sink=sink)
    naive = attention_ref(q, k, v, do, "causal", None, dtype, sink=sink)
    for name, g, r, n in zip(("out", "dq", "dk", "dv"), got, ref, naive):
        e, e_naive = rel_err(g, r), rel_err(n, r)
        bound = 2e-6 + 4 * e_naive if not ON_CUDA else 2 * e_naive + 1e-3
        assert e <= bound, (comm, softmax_type, name, e, e_naive)
    if softmax_type == "learnable":
        g = sum(r[key][4] for r in res)
        e, e_naive = rel_err(g, ref[4]), rel_err(naive[4], ref[4])
        assert e <= (2e-6 + 4 * e_naive if not ON_CUDA else 2 * e_naive + 1e-3), (comm, "dsink", e, e_naive)
    else:
        assert all(r[key][4] is None for r in res)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("comm", ["p2p", "all_gather", "a2a"])
def test_dropout_backward_matches_forward(results, size, comm):
    """Attention dropout under CP: it changes the output, and the gradients are those of the forward
    that ran. With the same seeds the masks repeat, so L = <O, dO> is a smooth function of Q, K, V:
    its central difference along a random direction of the whole sequence (summed over the ranks)
    must equal <grad, direction>. A backward with other masks than the forward's fails this.
    On CUDA (bfloat16 inputs, whose rounding swamps a finite-difference step) only the first part
    and finite results are checked; the ring's per-step rng_state handling is the same Python
    code on both backends, and cuDNN's forward/backward mask agreement is tests/gpu's."""
    res = [r[f"dropout-{comm}"] for r in results(size)]
    base, plus, minus, slope = (sum(float(r[i]) for r in res) for i in range(4))
    moved = max(float(r[4]) for r in res)
    assert moved > 1e-2, "dropout changed nothing"
    assert all(math.isfinite(x) for x in (base, plus, minus, slope))
    if not ON_CUDA:
        fd = (plus - minus) / (2 * W.EPS)
        assert abs(fd - slope) <= 2e-3 * max(abs(slope), 1.0), (comm, fd, slope, base)


@pytest.mark.parametrize("comm", ["p2p", "all_gather", "a2a"])
def test_dropout_draws_in_the_rng_tracker(results, comm):
    """With get_rng_state_tracker, every comm type's dropout draws in the tracker's stream (as TE runs
    its CP attention inside the tracker's fork): torch's default generator stays where it was, the
    same tracker seed gives the same output and another seed another."""
    for r in results(2):
        untouched, one, again, two = r[f"tracker-{comm}"]
        assert untouched, f"{comm}: the default RNG moved"
        assert torch.equal(one, again), f"{comm}: the same tracker seed gave different masks"
        assert not torch.equal(one, two), f"{comm}: another tracker seed gave the same masks"


@pytest.mark.parametrize("size, mode, i", [(s, m, i) for s, m in RUNS for i in range(len(W.fp8_cases(s, m)))],
                         ids=[f"{s}-{'-'.join(c)}" for s, m in RUNS for c in W.fp8_cases(s, m)])
def test_fp8_attention_as_accurate_as_without_cp(results, size, mode, i):
    """FP8 attention (fp8_dpa) with CP, two training steps (the second on delayed scales), against
    float64 attention of the whole sequence: at most 1.25x as far as the same module's FP8 attention
    without CP on the same device (the ring adds one E4M3 rounding of each step's output and one
    E5M2 rounding of each step's gradients before the float32 sums; measured 0.9-1.12x on the CPU).
    With fp8_group the ranks' forward amax histories are equal, and the Q/K/V amaxes are exactly
    those of the whole sequence; without it the second step runs on different scales per rank
    (each K/V block is read with its owner's scale)."""
    comm, mask, fmt = W.fp8_cases(size, mode)[i]
    res = results(size, mode)
    c, d = W.fp8_sizes(ON_CUDA)
    dtype = torch.bfloat16 if ON_CUDA else torch.float32
    for step in range(2):
        key = f"{comm}-{mask}-{fmt}-{step}"
        got = [whole([r["fp8-cp-" + key][j] for r in res], size) for j in range(4)]
        one = res[0]["fp8-one-" + key]
        ref = attention_ref(*W.fp8_whole_inputs(size, 3000 + i, step, dtype, c, d), mask, None)
        for name, g, o, r in zip(("out", "dq", "dk", "dv"), got, one, ref):
            e, e_one = rel_err(g, r), rel_err(o, r)
            print(f"{key} {name}: vs float64 with CP {e:.3e}, without {e_one:.3e}")
            assert e <= 1.25 * e_one, (key, name, e, e_one)
        hists = [r["fp8-cp-" + key][4] for r in res]
        if W.fp8_reduced(i):
            assert all(torch.equal(h, hists[0]) for h in hists), key
            assert torch.equal(hists[0][:, 0], one[4][:, 0]), key  # Q, K, V: the whole sequence's amax
        elif step == 1:
            assert any(not torch.equal(h[:, 0], hists[0][:, 0]) for h in hists), key


@pytest.mark.parametrize("size", SIZES)
def test_fp8_mha_transformer_layer_with_cp(results, size):
    """A TransformerLayer under fp8_mha with the p2p ring (its attention runs the FP8 ring on
    high-precision tensors instead of FP8 hand-offs): output and input gradient are at most 1.5x as
    far from the same layer in high precision (one rank, whole sequence) as its FP8 run without CP."""
    res = results(size)
    one, hp = res[0]["fp8_mha_layer-one"], res[0]["fp8_mha_layer-one_hp"]
    for i, name in enumerate(("out", "dx")):
        got = whole([r["fp8_mha_layer-cp"][i] for r in res], size)
        e, e_one = rel_err(got, hp[i]), rel_err(one[i], hp[i])
        print(f"{name}: vs high precision, FP8 with CP {e:.3e}, without {e_one:.3e}")
        assert e_one > 0 and e <= 1.5 * e_one, (name, e, e_one)


# ------------------------------------------------------------------ what CP does not take
def _group(comm="p2p", size=2):
    return _cp.CPGroup(None, list(range(size)), size, 0, comm)


@pytest.mark.parametrize("kw, err, match", [
    (dict(fmt="thd", comm="all_gather", q=torch.zeros(12, 4, 8), k=torch.zeros(12, 2, 8), window=(4, 2),
          mask_type="padding_causal"), NotImplementedError, "over THD: causal windows"),
    (dict(fmt="thd", comm="all_gather", q=torch.zeros(12, 4, 8), k=torch.zeros(12, 2, 8), window=(4, 4),
          mask_type="padding"), NotImplementedError, "over THD: causal windows"),
    (dict(fmt="thd", q=torch.zeros(12, 4, 8), k=torch.zeros(10, 2, 8)), ValueError, "self attention"),
    (dict(fmt="thd", q=torch.zeros(12, 4, 8), k=torch.zeros(12, 2, 8), mask_type="arbitrary"), NotImplementedError,
     "'padding_causal'"),
    (dict(mask_type="padding_causal"), NotImplementedError, "'no_mask' or 'causal'"),
    (dict(window=(4, 0)), NotImplementedError, "'a2a' or 'all_gather'"),
    (dict(bias_type="alibi"), NotImplementedError, "bias only as 'post_scale_bias' .*no ALiBi"),
    (dict(bias_type="post_scale_bias", comm="all_gather", bias=torch.zeros(1, 4, 6, 12)), NotImplementedError,
     "bias only as 'post_scale_bias' with cp_comm_type 'p2p'"),
    (dict(bias_type="post_scale_bias", fp8=True, bias=torch.zeros(1, 4, 6, 12)), NotImplementedError,
     "without FP8 attention .*FP8"),
    (dict(bias_type="post_scale_bias"), ValueError, "needs core_attention_bias"),
    (dict(bias_type="post_scale_bias", bias=torch.zeros(1, 4, 6, 6)), ValueError,
     r"must be \[2 or 1, 4 or 1, 6, 12\] .*got \[1, 4, 6, 6\]"),
    (dict(bias_type="post_scale_bias", bias=torch.zeros(3, 4, 6, 12)), ValueError, "must be"),
    (dict(bias_type="post_scale_bias", mask_type="no_mask", q=torch.zeros(2, 5, 4, 8), k=torch.zeros(2, 5, 2, 8),
          bias=torch.zeros(1, 4, 5, 10)), ValueError, "bias needs an even local sequence length"),
    (dict(softmax_type="learnable", fp8=True), NotImplementedError, "sink .* without FP8 attention"),
    (dict(softmax_type="off-by-one", fmt="thd", comm="all_gather", q=torch.zeros(12, 4, 8), k=torch.zeros(12, 2, 8),
          mask_type="padding_causal"), NotImplementedError, "sink .* with bshd / sbhd"),
    (dict(fp8=True, comm="all_gather"), NotImplementedError, "FP8 attention .* 'all_gather'. is not implemented"),
    (dict(fmt="thd", fp8=True, q=torch.zeros(12, 4, 8), k=torch.zeros(12, 2, 8)), NotImplementedError,
     "FP8 attention .* 'bshd' or 'sbhd'"),
    (dict(attention_mask=torch.zeros(1, dtype=torch.bool)), NotImplementedError, "no attention_mask"),
    (dict(q=torch.zeros(2, 5, 4, 8)), ValueError, "equal local query and key/value lengths"),
    (dict(q=torch.zeros(2, 5, 4, 8), k=torch.zeros(2, 5, 2, 8)), ValueError, "even local sequence length"),
    (dict(comm="a2a", g=3), ValueError, "multiples of its a2a group's size"),
])
def test_unsupported_calls_raise(kw, err, match):
    args = dict(q=torch.zeros(2, 6, 4, 8), k=torch.zeros(2, 6, 2, 8), fmt="bshd", mask_type="causal", window=None,
                bias_type="no_bias", softmax_type="vanilla", fp8=False, attention_mask=None, h=4, g=2)
    comm = kw.pop("comm", "p2p")
    args.update(kw)
    q, k = args.pop("q"), args.pop("k")
    with pytest.raises(err, match=match):
        _cp.check_call(_group(comm), q, k, k, **args)


def test_fp8_ring_without_fp8_backward_raises(monkeypatch):
    monkeypatch.setenv("NVTE_FP8_DPA_BWD", "0")
    q, k = torch.zeros(2, 6, 4, 8), torch.zeros(2, 6, 2, 8)
    with pytest.raises(NotImplementedError, match="NVTE_FP8_DPA_BWD=0"):
        _cp.check_call(_group("p2p"), q, k, k, "bshd", "causal", None, "no_bias", "vanilla", True, None, 4, 2)
    _cp.check_call(_group("a2a"), q, k, k, "bshd", "causal", None, "no_bias", "vanilla", True, None, 4, 2)


def test_dkv_travel_dtype_switch(monkeypatch):
    """The ring's travelling dK / dV sums: float32, or the inputs' dtype under NVTE_CP_DKV_FP32=0
    (its accuracy on bf16 is GPU-tested: tests/gpu/run_on_device.sh's cp step runs this file a
    second time with it set; on the CPU the inputs are float32 and nothing changes)."""
    assert _ring.BlockGrads(_group(), torch.bfloat16).dtype == torch.float32
    monkeypatch.setenv("NVTE_CP_DKV_FP32", "0")
    assert _ring.BlockGrads(_group(), torch.bfloat16).dtype == torch.bfloat16


def test_comm_type_and_group_errors():
    with pytest.raises(ValueError, match="takes cp_group as a list"):
        _cp.make_group(object(), None, "a2a+p2p")
    with pytest.raises(ValueError, match="only it takes a list"):
        _cp.make_group([object(), object()], None, "p2p")
    with pytest.raises(ValueError, match="cp_comm_type must be one of"):
        _cp.make_group(object(), None, "ring")
    assert _cp.make_group(None, None, "p2p") is None
    dpa = te.DotProductAttention(4, 8, qkv_format="bshd")
    assert dpa.cp is None


def test_chunk_orders_are_inverse():
    """Rank order (r, 2 size - 1 - r per rank) and sequence order, both ways, for sizes 1..4."""
    for size in range(1, 5):
        x = torch.arange(2 * size * 3).view(1, -1, 1, 1)
        ranked = torch.cat([W.local_chunks(x, r, size) for r in range(size)], dim=1)
        nat = _cp._permute_chunks(ranked, 1, _cp._order(size, True, True))
        assert torch.equal(nat, x)
        assert torch.equal(_cp._permute_chunks(nat, 1, _cp._order(size, True, False)), ranked)


@pytest.mark.skipif(not ON_CUDA, reason="the GPU backend's head-size rule (NVTE_TEST_DEVICE=cuda only; the CPU "
                                        "backend takes every head size)")
def test_p2p_says_when_the_gpu_backend_cannot_run_the_ring():
    q = torch.zeros(2, 6, 4, 6, device=DEVICE, dtype=torch.bfloat16)
    k = torch.zeros(2, 6, 2, 6, device=DEVICE, dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match="'p2p' runs fused attention only"):
        _cp.check_call(_group("p2p"), q, k, k, "bshd", "causal", None, "no_bias", "vanilla", False, None, 4, 2)


def test_same_values_checks_each_pair_once(monkeypatch):
    """THD CP compares cu_seqlens_kv with cu_seqlens_q when they are different tensors: one host
    synchronization per unchanged pair (the layers of a model share them), again after a change."""
    calls = []
    real = torch.equal
    monkeypatch.setattr(torch, "equal", lambda x, y: calls.append(1) or real(x, y))
    a, b = torch.tensor([0, 4, 12], dtype=torch.int32), torch.tensor([0, 4, 12], dtype=torch.int32)
    assert _cp.same_values(a, b) and _cp.same_values(a, b) and len(calls) == 1
    b[1] = 5  # an in-place change is seen
    assert not _cp.same_values(a, b) and len(calls) == 2
    assert not _cp.same_values(a, torch.tensor([0, 4], dtype=torch.int32))


def test_thd_padded_split_checks():
    """Padded offsets (cu_seqlens_q_padded): their lengths must be multiples of 2 cp_size, cover
    the real lengths, start at 0 and hold all tokens."""
    from transformer_engine.pytorch import context_parallel_thd as T
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    sp = T.split(cu, 6, 2, torch.tensor([0, 4, 12], dtype=torch.int32))
    assert sp.padded and sp.lens.tolist() == [3, 5] and sp.starts.tolist() == [0, 4]
    assert not T.split(cu.new_tensor([0, 4, 12]), 6, 2, cu.new_tensor([0, 4, 12])).padded
    with pytest.raises(ValueError, match="padded length .* multiple of 2 cp_size"):
        T.split(cu, 5, 2, torch.tensor([0, 4, 10], dtype=torch.int32))
    with pytest.raises(ValueError, match="at least the cu_seqlens_q length"):
        T.split(cu.new_tensor([0, 5, 8]), 6, 2, cu.new_tensor([0, 4, 12]))
    with pytest.raises(ValueError, match="from 0"):
        T.split(cu, 6, 2, cu.new_tensor([4, 8, 16]))


def test_thd_split_offsets_and_checks():
    """The local THD description from whole-sequence cu_seqlens (lengths 4 and 8, cp_size 2: chunks of
    1 and 2 tokens), and the length checks (other lengths would split wrongly without an error)."""
    from transformer_engine.pytorch import context_parallel_thd as T
    sp = T.split(torch.tensor([0, 4, 12], dtype=torch.int32), 6, 2)
    assert sp.cu_local.tolist() == [0, 2, 6] and sp.cu_half.tolist() == [0, 1, 3]
    assert sp.second.tolist() == [1, 4, 6] and sp.max_half == 2
    assert sp.tok_b.tolist() == [0, 0, 1, 1, 1, 1] and sp.tok_j.tolist() == [0, 1, 0, 1, 2, 3]
    assert sp.tok_c.tolist() == [1, 1, 2, 2, 2, 2]
    cu = torch.tensor([0, 4, 12], dtype=torch.int32)
    assert T.split(cu, 6, 2) is T.split(cu, 6, 2)  # one host synchronization for a model's layers
    first = T.split(cu, 6, 2)
    cu[2] = 8  # an in-place change is seen
    assert T.split(cu, 4, 2) is not first and T.split(cu, 4, 2).cu_local.tolist() == [0, 2, 4]
    with pytest.raises(ValueError, match="multiple of 2 cp_size = 4"):
        T.split(torch.tensor([0, 4, 10], dtype=torch.int32), 5, 2)
    with pytest.raises(ValueError, match="whole / cp_size"):
        T.split(torch.tensor([0, 4, 12], dtype=torch.int32), 12, 2)


def test_module_level_cp_argument_errors():
    """What DotProductAttention checks before any communication (a CP description without a process
    group: nothing is sent)."""
    dpa = te.DotProductAttention(4, 8, num_gqa_groups=2, qkv_format="thd", attn_mask_type="padding_causal")
    dpa.cp = _group("p2p")
    q, k = torch.zeros(12, 4, 8), torch.zeros(12, 2, 8)
    cu = torch.tensor([0, 8, 24], dtype=torch.int32)
    with pytest.raises(ValueError, match="needs cu_seqlens_q"):
        dpa(q, k, k)
    with pytest.raises(NotImplementedError, match="cu_seqlens_kv_padded must equal cu_seqlens_q_padded"):
        dpa(q, k, k, cu_seqlens_q=cu, cu_seqlens_kv_padded=cu)
    with pytest.raises(NotImplementedError, match="cu_seqlens_kv must equal cu_seqlens_q"):
        dpa(q, k, k, cu_seqlens_q=cu, cu_seqlens_kv=torch.tensor([0, 12, 24], dtype=torch.int32))
    dpa = te.DotProductAttention(4, 8, num_gqa_groups=2, qkv_format="bshd", attn_mask_type="causal")
    dpa.cp = _group("p2p")
    q, k = torch.zeros(2, 6, 4, 8), torch.zeros(2, 6, 2, 8)
    with pytest.raises(NotImplementedError, match="takes no cu_seqlens"):
        dpa(q, k, k, cu_seqlens_q=torch.tensor([0, 6, 12], dtype=torch.int32))
    with pytest.raises(NotImplementedError, match="inference_params"):
        dpa(q, k, k, inference_params=object())
