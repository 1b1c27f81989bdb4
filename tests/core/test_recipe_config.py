"""transformer_engine.common.recipe: TE's names, defaults and argument checks."""
import pytest

from transformer_engine.common import recipe


def test_delayed_scaling_defaults_match_te():
    r = recipe.DelayedScaling()
    assert (r.margin, r.fp8_format, r.amax_history_len, r.amax_compute_algo) == (0, recipe.Format.HYBRID, 1024, "max")
    assert r.scaling_factor_compute_algo is None and r.reduce_amax and not r.fp8_dpa and not r.fp8_mha
    assert r.delayed() and not r.float8_current_scaling() and r.float8_per_tensor_scaling()


def test_format_maxima():
    assert recipe.Format.E4M3.value.max_fwd == 448 and recipe.Format.E4M3.value.max_bwd == 448
    assert recipe.Format.E5M2.value.max_fwd == 57344
    assert recipe.Format.HYBRID.value == (448, 57344)


def test_seed_usage_constructs():
    r = recipe.DelayedScaling(margin=0, fp8_format=recipe.Format.E4M3)
    assert r.fp8_format is recipe.Format.E4M3
    r = recipe.DelayedScaling(fp8_format=recipe.Format.HYBRID, amax_history_len=16, amax_compute_algo="max")
    assert r.amax_history_len == 16


def test_current_scaling_defaults():
    r = recipe.Float8CurrentScaling()
    assert r.fp8_format is recipe.Format.HYBRID and r.float8_current_scaling()
    assert r.fp8_gemm_fprop.use_split_accumulator is False and r.fp8_gemm_wgrad.use_split_accumulator is True
    assert r.fp8_quant_fwd_inp == recipe.QParams(power_2_scale=False, amax_epsilon=0.0)


@pytest.mark.parametrize("kwargs,match", [
    ({"amax_compute_algo": "mean"}, "amax_compute_algo"),
    ({"amax_history_len": 0}, "amax_history_len"),
    ({"fp8_format": "E4M3"}, "recipe.Format"),
    ({"margin": -1}, "margin"),
])
def test_delayed_scaling_rejects_bad_arguments(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        recipe.DelayedScaling(**kwargs)


def test_callable_amax_algo_is_accepted():
    r = recipe.DelayedScaling(amax_compute_algo=lambda h: h.max(0))
    assert callable(r.amax_compute_algo)


def test_predicates_are_class_methods_as_in_te():
    """TE's recipe predicates are class methods: callable on the class and on instances."""
    assert recipe.DelayedScaling.delayed() and not recipe.DelayedScaling.float8_current_scaling()
    assert recipe.Float8CurrentScaling.float8_current_scaling() and recipe.Float8CurrentScaling.float8_per_tensor_scaling()
    assert recipe.MXFP8BlockScaling.mxfp8() and not recipe.MXFP8BlockScaling.float8_per_tensor_scaling()
    assert recipe.Float8BlockScaling.float8_block_scaling() and not recipe.Float8BlockScaling().nvfp4()
    assert recipe.DelayedScaling().delayed() and not recipe.DelayedScaling().mxfp8()
