"""Delayed-scaling state of te modules vs a float64 re-computation of the recipe math,
fp8_autocast semantics and the _extra_state round trip. The modules run on NVTE_TEST_DEVICE (default
the CPU backend); inputs are drawn on the CPU, the float64 model stays on the CPU."""
import io

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common import recipe
from _util import DEVICE, ON_CUDA, dev, gemm_dim, raises_e5m2_gemm, seeded


class RefDelayed:
    """float64 model of one meta set: history [len, n], scale [n]."""

    def __init__(self, length, n, fp8_max, margin, algo):
        self.h = torch.zeros(length, n, dtype=torch.float64)
        self.s = torch.ones(n, dtype=torch.float64)
        self.fp8_max, self.margin, self.algo = fp8_max, margin, algo

    def record(self, i, x):
        self.h[0, i] = max(float(self.h[0, i]), float(x.detach().abs().max()))

    def update(self):
        amax = self.h.max(0).values if self.algo == "max" else self.h[0].clone()
        self.h = torch.roll(self.h, -1, 0)
        self.h[0] = 0
        new = self.fp8_max / amax / 2.0 ** self.margin
        ok = (amax > 0) & torch.isfinite(amax)
        self.s = torch.where(ok, new, self.s)


@pytest.mark.parametrize("fmt,algo,margin", [("HYBRID", "max", 1), ("E4M3", "most_recent", 0),
                                             ("E5M2", "max", 2)])
def test_recipe_state_matches_float64(rng, fmt, algo, margin):
    g = seeded(rng)
    r = recipe.DelayedScaling(margin=margin, fp8_format=getattr(recipe.Format, fmt), amax_history_len=3,
                              amax_compute_algo=algo)
    fwd_max = 57344.0 if fmt == "E5M2" else 448.0
    bwd_max = 448.0 if fmt == "E4M3" else 57344.0
    # out features and tokens: 8 and 6 on the CPU, 16 on CUDA (FP8 GEMM dims 16-aligned)
    n_out, tokens = gemm_dim(8), gemm_dim(6)
    m = te.Linear(16, n_out, device=DEVICE)
    if ON_CUDA and fmt == "E5M2":  # both forward operands E5M2: cuBLASLt has no such GEMM
        with raises_e5m2_gemm(), te.fp8_autocast(fp8_recipe=r):
            m(dev(torch.randn(tokens, 16, generator=g)))
        return
    ref_f = RefDelayed(3, 3, fwd_max, margin, algo)
    ref_b = RefDelayed(3, 2, bwd_max, margin, algo)
    for step, mag in enumerate([1.0, 30.0, 0.01, 5.0, 2.0]):
        x = torch.randn(tokens, 16, generator=g) * mag
        dy = torch.randn(tokens, n_out, generator=g) * mag * 0.1
        with te.fp8_autocast(fp8_recipe=r):
            y = m(dev(x))
            if step == 3:  # a second forward in one region max-accumulates into the same slot
                x2 = torch.randn(tokens, 16, generator=g) * 50
                y = y + m(dev(x2))
                ref_f.record(0, x2)
        ref_f.record(0, x)
        ref_f.record(1, m.weight)
        ref_f.update()  # outermost exit
        y.backward(dev(dy))
        ref_b.update()  # start of backward
        ref_b.record(0, dy)
        meta = m.fp8_meta
        torch.testing.assert_close(meta.amax_history["fwd"].double().cpu(), ref_f.h, rtol=1e-6, atol=0)
        torch.testing.assert_close(meta.scale["fwd"].double().cpu(), ref_f.s, rtol=1e-6, atol=0)
        if step == 3:  # two backward calls: each updates first
            ref_b.update()
            ref_b.record(0, dy)
        torch.testing.assert_close(meta.amax_history["bwd"].double().cpu(), ref_b.h, rtol=1e-6, atol=0)
        torch.testing.assert_close(meta.scale["bwd"].double().cpu(), ref_b.s, rtol=1e-6, atol=0)


def test_nested_autocast_updates_only_at_outermost_exit(rng):
    d = gemm_dim(8)  # features and tokens: 8 and 4 on the CPU, 16 on CUDA (FP8 GEMM dims 16-aligned)
    m = te.Linear(d, d, device=DEVICE)
    r = recipe.DelayedScaling(amax_history_len=2)
    x = dev(torch.randn(gemm_dim(4), d, generator=seeded(rng)))
    with te.fp8_autocast(fp8_recipe=r):
        with te.fp8_autocast(fp8_recipe=r):
            m(x)
        assert torch.equal(m.fp8_meta.scale["fwd"].cpu(), torch.ones(3))
        assert float(m.fp8_meta.amax_history["fwd"][0, 0]) > 0
    assert float(m.fp8_meta.scale["fwd"][0]) != 1.0
    assert float(m.fp8_meta.amax_history["fwd"][0, 0]) == 0.0


def test_autocast_disabled_inside_enabled_runs_high_precision(rng):
    m = te.Linear(8, 8, device=DEVICE)
    x = dev(torch.randn(4, 8, generator=seeded(rng)))
    with te.fp8_autocast(), te.fp8_autocast(enabled=False):
        y = m(x)
    assert not m.fp8_meta.initialized
    torch.testing.assert_close(y, x @ m.weight.detach().t() + m.bias.detach())


def test_calibration_records_amax_without_fp8(rng):
    m = te.Linear(8, 8, device=DEVICE)
    x = dev(torch.randn(4, 8, generator=seeded(rng)) * 7)
    with te.fp8_autocast(enabled=False, calibrating=True, fp8_recipe=recipe.DelayedScaling(amax_history_len=2)):
        y = m(x)
    torch.testing.assert_close(y, x @ m.weight.detach().t() + m.bias.detach())  # all on DEVICE
    torch.testing.assert_close(m.fp8_meta.amax_history["fwd"][1, 0], x.abs().max())
    torch.testing.assert_close(m.fp8_meta.scale["fwd"][0], 448.0 / x.abs().max())


def test_default_recipe_and_availability():
    ok, reason = te.is_fp8_available(return_reason=True)
    assert ok
    if not torch.cuda.is_available():
        assert "CPU" in reason
    d = gemm_dim(8)  # features and tokens: 8 and 2 on the CPU, 16 on CUDA (FP8 GEMM dims 16-aligned)
    m = te.Linear(d, d, device=DEVICE)
    with te.autocast():
        m(dev(torch.randn(gemm_dim(2), d)))
    assert m.fp8_meta.amax_history["fwd"].shape == (1024, 3)
    assert m.fp8_meta.recipe.fp8_format == recipe.Format.HYBRID


def test_unsupported_features_raise():
    with pytest.raises(NotImplementedError, match="DelayedScaling"):  # FP8 parameters: same recipes
        with te.fp8_model_init(recipe=recipe.MXFP8BlockScaling()):
            pass
    with te.fp8_model_init(enabled=False):
        pass
    with pytest.raises(TypeError, match="Recipe"):
        with te.fp8_autocast(fp8_recipe="hybrid"):
            pass
    m = te.Linear(8, 8, device=DEVICE)
    with pytest.raises(NotImplementedError, match="DelayedScaling"):
        with te.fp8_autocast(fp8_recipe=recipe.MXFP8BlockScaling()):
            m(dev(torch.randn(2, 8)))


# out features 8 on the CPU, 16 on CUDA; tokens 5 / 16 (FP8 GEMM dims 16-aligned there)
@pytest.mark.parametrize("make", [lambda: te.Linear(16, gemm_dim(8), device=DEVICE),
                                  lambda: te.LayerNormLinear(16, gemm_dim(8), device=DEVICE),
                                  lambda: te.LayerNormMLP(16, 32, device=DEVICE)])
def test_extra_state_round_trip(rng, make):
    g = seeded(rng)
    torch.manual_seed(0)
    m = make()
    r = recipe.DelayedScaling(amax_history_len=4)
    for _ in range(3):
        with te.fp8_autocast(fp8_recipe=r):
            y = m(dev(torch.randn(gemm_dim(5), 16, generator=g) * 3))
        y.sum().backward()
    sd = m.state_dict()
    assert "_extra_state" in sd
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    torch.manual_seed(1)
    m2 = make()
    m2.load_state_dict(torch.load(buf, weights_only=False))
    for key in ("fwd", "bwd"):
        assert torch.equal(m2.fp8_meta.amax_history[key], m.fp8_meta.amax_history[key])
        assert torch.equal(m2.fp8_meta.scale[key], m.fp8_meta.scale[key])
    x = dev(torch.randn(gemm_dim(5), 16, generator=g))
    with torch.no_grad(), te.fp8_autocast(fp8_recipe=r):
        assert torch.equal(m(x), m2(x))
    # a module that never ran FP8 stores no meta, and loading that clears the meta
    fresh = make()
    m2.load_state_dict(fresh.state_dict())
    assert not m2.fp8_meta.initialized
    with pytest.raises(ValueError, match="extra state"):
        m2.set_extra_state({"bogus": 1})


def _te_serialized(state):
    """TE's `_extra_state` form: the pickled dict as a 1D uint8 tensor. It carries an object of a
    module this package lacks (TE's private helpers), which the loader must step over."""
    import pickle
    import sys
    import types
    mod = types.ModuleType("transformer_engine.pytorch._te_private_helpers")

    class Helper:
        pass
    Helper.__module__, Helper.__qualname__ = mod.__name__, "Helper"
    mod.Helper = Helper
    sys.modules[mod.__name__] = mod
    try:
        data = pickle.dumps(dict(state, extra_fp8_variables={"helper": Helper()}))
    finally:
        del sys.modules[mod.__name__]
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def test_te_checkpoint_extra_state_loads():
    """A TE 2.x state_dict: `_extra_state` is an empty uint8 tensor (no FP8 ran) or TE's pickled
    dict of amax histories and scales (with the recipe and TE's own objects beside them)."""
    m = te.Linear(16, gemm_dim(8), device=DEVICE)
    sd = {k: v for k, v in m.state_dict().items() if k != "_extra_state"}
    hist_f, hist_b = torch.rand(4, 3) * 10, torch.rand(4, 2) * 10
    scale_f, scale_b = torch.rand(3) + 1, torch.rand(2) + 1
    te_state = {"recipe": recipe.DelayedScaling(amax_history_len=4), "scale_fwd": scale_f, "amax_history_fwd": hist_f,
                "scale_bwd": scale_b, "amax_history_bwd": hist_b}
    m.load_state_dict(dict(sd, _extra_state=_te_serialized(te_state)))
    assert m.fp8_meta.initialized
    for key, h, sc in (("fwd", hist_f, scale_f), ("bwd", hist_b, scale_b)):
        assert torch.equal(m.fp8_meta.amax_history[key].cpu(), h) and torch.equal(m.fp8_meta.scale[key].cpu(), sc)
    m.load_state_dict(dict(sd, _extra_state=torch.empty(0, dtype=torch.uint8)))
    assert not m.fp8_meta.initialized
    m.load_state_dict(dict(sd, _extra_state=_te_serialized({"recipe": recipe.Float8CurrentScaling()})))
    assert not m.fp8_meta.initialized  # current scaling keeps no histories: nothing to restore
    with pytest.raises(ValueError, match="extra state"):
        m.set_extra_state(torch.zeros(2, 3))
    bad = dict(te_state, amax_history_fwd=torch.rand(4, 5))  # another module's slots
    with pytest.raises(ValueError, match="this module needs"):
        m.set_extra_state(_te_serialized(bad))


def test_old_te_bytesio_extra_state_loads():
    """Old TE checkpoints' `_extra_state`: an io.BytesIO holding torch.save(None) (no FP8 ran) or
    torch.save of the state dict (TE still reads this form); one a weights-only load cannot read
    is a clear error."""
    import io
    m = te.Linear(16, gemm_dim(8), device=DEVICE)
    sd = {k: v for k, v in m.state_dict().items() if k != "_extra_state"}

    def saved(obj):
        b = io.BytesIO()
        torch.save(obj, b)
        return b

    m.load_state_dict(dict(sd, _extra_state=saved(None)))
    assert not m.fp8_meta.initialized
    hist_f, hist_b = torch.rand(4, 3) * 10, torch.rand(4, 2) * 10
    scale_f, scale_b = torch.rand(3) + 1, torch.rand(2) + 1
    m.load_state_dict(dict(sd, _extra_state=saved({"scale_fwd": scale_f, "amax_history_fwd": hist_f,
                                                    "scale_bwd": scale_b, "amax_history_bwd": hist_b})))
    assert m.fp8_meta.initialized
    assert torch.equal(m.fp8_meta.amax_history["bwd"].cpu(), hist_b) and torch.equal(m.fp8_meta.scale["fwd"].cpu(), scale_f)
    m.load_state_dict(dict(sd, _extra_state=io.BytesIO()))
    assert not m.fp8_meta.initialized
    with pytest.raises(ValueError, match="weights-only"):
        m.set_extra_state(saved({"recipe": recipe.DelayedScaling(), "scale_fwd": scale_f}))


def test_history_length_change_keeps_recent_rows(rng):
    d = gemm_dim(8)  # features and tokens: 8 and 4 on the CPU, 16 on CUDA (FP8 GEMM dims 16-aligned)
    m = te.Linear(d, d, device=DEVICE)
    x = dev(torch.randn(gemm_dim(4), d, generator=seeded(rng)))
    with te.fp8_autocast(fp8_recipe=recipe.DelayedScaling(amax_history_len=4)):
        m(x)
    h = m.fp8_meta.amax_history["fwd"].clone()
    with te.fp8_autocast(fp8_recipe=recipe.DelayedScaling(amax_history_len=2)):
        pass
    with te.fp8_autocast(fp8_recipe=recipe.DelayedScaling(amax_history_len=2)), torch.no_grad():
        m(x)
    assert m.fp8_meta.amax_history["fwd"].shape == (2, 3)
    torch.testing.assert_close(m.fp8_meta.amax_history["fwd"][1], h[1])


_CALLED = []


def _record_call(*args):
    """A global a crafted checkpoint names; loading must not call it."""
    _CALLED.append(args)
    return torch.zeros(4, 3)


def test_te_extra_state_runs_no_code_from_the_checkpoint():
    """`_extra_state` is pickled bytes inside a uint8 tensor, which torch.load's weights-only mode
    lets through; loading it rebuilds tensors only: a global the pickle names (here a function of
    this module standing for os.system) is not called."""
    import pickle

    class Payload:
        def __reduce__(self):
            return (_record_call, ("from the checkpoint",))
    state = {"recipe": recipe.DelayedScaling(), "scale_fwd": torch.ones(3), "amax_history_fwd": Payload(),
             "scale_bwd": torch.ones(2), "amax_history_bwd": torch.zeros(4, 2)}
    blob = torch.frombuffer(bytearray(pickle.dumps(state)), dtype=torch.uint8)
    m = te.Linear(16, gemm_dim(8), device=DEVICE)
    with pytest.raises((ValueError, AttributeError, TypeError)):
        m.set_extra_state(blob)
    assert _CALLED == []
    dpa = te.DotProductAttention(2, 8)
    with pytest.raises((ValueError, AttributeError, TypeError)):
        dpa.set_extra_state(blob)
    assert _CALLED == []
