"""te.CudaRNGStatesTracker (te.distributed.CudaRNGStatesTracker): named RNG streams for
get_rng_state_tracker. add / get_states / set_states / reset / fork semantics, its use as the
attention-dropout stream of DotProductAttention, and the recompute of te.checkpoint and of
checkpoint_core_attention, which must restore the tracker's streams so that dropout draws the same
masks. The modules run on NVTE_TEST_DEVICE (default the CPU backend)."""
import pytest
import torch

import transformer_engine.pytorch as te
from _util import DEVICE, dev
from test_attention import _saved_bytes

NAME = "model-parallel-rng"


def _tracker(seed=1234, name=NAME):
    tr = te.CudaRNGStatesTracker()
    tr.add(name, seed)
    return tr


def _default_states():
    return (torch.get_rng_state(), torch.cuda.get_rng_state() if torch.cuda.is_available() else None)


def _same_states(a, b):
    return torch.equal(a[0], b[0]) and (a[1] is None or torch.equal(a[1], b[1]))


def test_exported_in_both_namespaces():
    assert te.CudaRNGStatesTracker is te.distributed.CudaRNGStatesTracker
    assert "CudaRNGStatesTracker" in te.__all__


def test_add_rejects_duplicate_names_and_seeds():
    tr = _tracker(1)
    with pytest.raises(ValueError, match="already exists"):
        tr.add(NAME, 2)  # the name again
    with pytest.raises(ValueError, match="seed 1 already exists"):
        tr.add("other", 1)  # the seed again
    tr.add("other", 2)
    assert sorted(tr.get_states()) == ["model-parallel-rng", "other"]
    tr.reset()  # forgets names and seeds
    assert tr.get_states() == {}
    with pytest.raises(KeyError, match="has not been added"):
        with tr.fork():
            pass
    tr.add(NAME, 1)


def test_fork_unknown_name_and_bad_states():
    tr = _tracker()
    with pytest.raises(KeyError, match="'nope' has not been added"):
        with tr.fork("nope"):
            pass
    with pytest.raises(TypeError):
        tr.set_states([1, 2])
    with pytest.raises(TypeError, match="name -> generator state tensor"):
        tr.set_states({NAME: {"cpu": torch.get_rng_state()}})


def test_states_in_te_format():
    """get_states() / set_states() take TE's {name: generator state tensor} (what Megatron-LM keeps
    in its checkpoints): a state taken from the device's default generator is accepted and used."""
    tr = _tracker(7)
    assert all(isinstance(t, torch.Tensor) for t in tr.get_states().values())
    gen = torch.cuda.default_generators[torch.cuda.current_device()] if torch.cuda.is_available() \
        else torch.default_generator
    gen.manual_seed(1234)
    state = gen.get_state()
    want = torch.rand(6, device="cuda" if torch.cuda.is_available() else "cpu")
    tr.set_states({NAME: state})
    with tr.fork():
        got = torch.rand(6, device=want.device)
    assert torch.equal(got, want)


def test_fork_reproducible_and_leaves_default_generator_alone():
    torch.manual_seed(0)
    ref_default = torch.rand(4, device=DEVICE)
    draws = []
    for global_seed in (0, 1):
        tr = _tracker(42)
        torch.manual_seed(0)
        with tr.fork():
            a = torch.rand(3, device=DEVICE)
        torch.manual_seed(global_seed)  # the stream does not depend on the default generator
        with tr.fork(NAME):
            b = torch.rand(3, device=DEVICE)
        draws.append(torch.cat([a, b]))
    # same seed -> same numbers; the second fork continues the stream (its state was saved back)
    assert torch.equal(draws[0], draws[1])
    # (the same draw sizes: CUDA's Philox generator rounds each call's offset, so rand(3) twice is
    # not rand(6))
    for seed, same in ((42, True), (43, False)):
        with _tracker(seed).fork():
            one = torch.cat([torch.rand(3, device=DEVICE), torch.rand(3, device=DEVICE)])
        assert torch.equal(one, draws[0]) == same
    # the default generator is where it was before the fork, also when the block raises
    tr = _tracker(42)
    torch.manual_seed(0)
    with tr.fork():
        torch.rand(100, device=DEVICE)
    assert torch.equal(torch.rand(4, device=DEVICE), ref_default)
    torch.manual_seed(0)
    before = _default_states()
    with pytest.raises(RuntimeError, match="boom"):
        with tr.fork():
            torch.rand(100, device=DEVICE)
            raise RuntimeError("boom")
    assert _same_states(before, _default_states())


def test_get_set_states_round_trip():
    tr = _tracker(5)
    tr.add("other", 6)
    saved = tr.get_states()
    with tr.fork():
        a = torch.rand(8, device=DEVICE)
    with tr.fork("other"):
        a2 = torch.rand(8, device=DEVICE)
    # get_states() is a copy: the draws above did not change it
    again = tr.get_states()
    assert not torch.equal(saved[NAME], again[NAME])
    tr.set_states(saved)
    with tr.fork():
        b = torch.rand(8, device=DEVICE)
    with tr.fork("other"):
        b2 = torch.rand(8, device=DEVICE)
    assert torch.equal(a, b) and torch.equal(a2, b2) and not torch.equal(a, a2)
    # replaced, not merged
    tr.set_states({"only": saved[NAME]})
    assert list(tr.get_states()) == ["only"]
    with pytest.raises(KeyError):
        with tr.fork():
            pass


def test_module_init_draws_in_the_tracker_stream():
    ws = []
    for global_seed in (0, 1):
        tr = _tracker(9)
        torch.manual_seed(global_seed)
        ws.append(te.Linear(8, 8, get_rng_state_tracker=lambda: tr, device=DEVICE).weight.detach().clone())
    assert torch.equal(ws[0], ws[1])


def _qkv(seed=3, b=2, s=16, h=4, d=8):
    g = torch.Generator().manual_seed(seed)
    return [dev(torch.randn(b, s, h, d, generator=g)).requires_grad_(True) for _ in range(3)]


def _dpa(tr, p=0.3):
    return te.DotProductAttention(4, 8, attention_dropout=p, qkv_format="bshd", attn_mask_type="causal",
                                  get_rng_state_tracker=(lambda: tr) if tr is not None else None)


@pytest.mark.parametrize("fused", ["0", "1"])
def test_dot_product_attention_dropout_follows_the_tracker(monkeypatch, fused):
    monkeypatch.setenv("NVTE_FUSED_ATTN", fused)
    q, k, v = _qkv()

    def run(tracker_seed, global_seed):
        tr = _tracker(tracker_seed)
        dpa = _dpa(tr)
        torch.manual_seed(global_seed)
        before = _default_states()
        out = dpa(q, k, v).detach()
        return out, _same_states(before, _default_states())
    a, untouched = run(7, 0)
    b, _ = run(7, 1)
    c, _ = run(8, 0)
    assert untouched  # dropout drew from the tracker's stream only
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert not torch.equal(a, _dpa(None, 0.0)(q, k, v).detach())  # (dropout did apply)


def _grads(out, q, k, v, seed=11):
    out.backward(dev(torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))))
    res = [out.detach()] + [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    return res


@pytest.mark.parametrize("use_reentrant", [True, False])
@pytest.mark.parametrize("fused", ["0", "1"])
def test_checkpoint_restores_the_tracker_for_the_recompute(monkeypatch, fused, use_reentrant):
    """te.checkpoint(get_rng_state_tracker=...) recomputes with the tracker's forward-time states:
    the recomputed dropout mask, hence the gradients, equal those of the plain run, and the tracker
    ends where the plain run leaves it."""
    monkeypatch.setenv("NVTE_FUSED_ATTN", fused)
    q, k, v = _qkv()
    res = {}
    for ckpt in (False, True):
        tr = _tracker(77)
        dpa = _dpa(tr)
        torch.manual_seed(0)
        if ckpt:
            out = te.checkpoint(dpa, q, k, v, get_rng_state_tracker=lambda: tr, use_reentrant=use_reentrant)
        else:
            out = dpa(q, k, v)
        with tr.fork():  # the stream moves on between forward and backward (another layer's draws)
            torch.rand(10, device=DEVICE)
        res[ckpt] = _grads(out, q, k, v) + [tr.get_states()[NAME]]
    for a, b, what in zip(res[False][:4], res[True][:4], ("out", "dq", "dk", "dv")):
        assert torch.equal(a, b), what
    for d in res[False][4]:
        assert torch.equal(res[False][4][d], res[True][4][d]), d


@pytest.mark.parametrize("fused", ["0", "1"])
def test_checkpoint_core_attention_with_tracker_and_dropout(monkeypatch, fused):
    """checkpoint_core_attention=True with a tracker and dropout recomputes (keeps fewer bytes) and
    replays the tracker's stream: output and gradients are bit-identical to the plain call's."""
    monkeypatch.setenv("NVTE_FUSED_ATTN", fused)
    q, k, v = _qkv(s=32)
    res = {}
    for ckpt in (False, True):
        tr = _tracker(21)
        dpa = _dpa(tr, 0.2)
        torch.manual_seed(0)
        out, saved = _saved_bytes(lambda: dpa(q, k, v, checkpoint_core_attention=ckpt))
        with tr.fork():  # the stream moves on before the backward
            torch.rand(10, device=DEVICE)
        res[ckpt] = _grads(out, q, k, v) + [saved]
    for a, b, what in zip(res[False][:4], res[True][:4], ("out", "dq", "dk", "dv")):
        assert torch.equal(a, b), what
    assert res[True][4] < res[False][4], (res[True][4], res[False][4])
    if fused == "0":  # the unfused path's [b, h, s, s] probabilities (and dropout mask) are not kept
        assert res[False][4] - res[True][4] >= 2 * 4 * 32 * 32 * 4


@pytest.mark.parametrize("p", [-0.5, 1.5, float("nan")])
def test_attention_dropout_out_of_range(p):
    with pytest.raises(ValueError, match="attention_dropout"):
        te.DotProductAttention(2, 8, attention_dropout=p)
    with pytest.raises(ValueError, match="attention_dropout"):
        te.MultiheadAttention(16, 2, attention_dropout=p, device=DEVICE)
    for ok in (0.0, 1.0):
        te.DotProductAttention(2, 8, attention_dropout=ok)
