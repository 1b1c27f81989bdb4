"""FP8 scaling recipes (recipe.h): the delayed-scaling update (single and after an amax
reduction) and the current-scaling helpers, against a float64 numpy re-statement of the
header's math. Each float32 operation of the library is restated as the float64 operation
rounded to float32, which is the same correctly rounded result for one division, so the
comparisons are bit-exact."""
import numpy as np
import pytest

from test_cast import tensor
from util import DT, FP8_MAX, NVTE_DTYPE, FP8Out, assert_bits_equal, nvte, scalar, to_np

FLT_MAX = np.finfo(np.float32).max
FMTS = ["e4m3", "e5m2"]
ALGOS = ["max", "most_recent"]
MARGINS = [0.0, 1.0, 0.5]


def bits(a):
    return np.ascontiguousarray(a, np.float32).view(np.uint32)


def f32(v):
    with np.errstate(over="ignore"):
        return np.float32(v)


# ----------------------------------------------------------------------------- references
def delayed_scale_ref(amax, old_scale, fp8_max, margin):
    """fp8_max / amax / 2^margin in float32; old scale unless amax is finite and > 0 (TE's rule);
    inf -> FLT_MAX."""
    if not amax > 0 or not np.isfinite(amax):
        return np.float32(old_scale)
    s = f32(float(f32(float(fp8_max) / float(amax))) / float(f32(2.0**margin)))
    return FLT_MAX if np.isinf(s) else s


def history_amax_ref(col, algo):
    """"max": the fmax over the rows (NaN ignored) starting from 0; "most_recent": row 0."""
    if algo == "most_recent":
        return np.float32(col[0])
    return np.float32(np.fmax(0.0, np.fmax.reduce(np.asarray(col, np.float64))))


def update_ref(hist, scale, algo, fmt, margin):
    h = hist.reshape(hist.shape[0], -1).astype(np.float64)
    new_scale = np.array([delayed_scale_ref(history_amax_ref(h[:, j], algo), scale[j], FP8_MAX[fmt], margin)
                          for j in range(h.shape[1])], np.float32)
    new_hist = np.roll(h, -1, axis=0)
    new_hist[0] = 0.0
    return new_hist.astype(np.float32).reshape(hist.shape), new_scale


def after_reduction_ref(buffer, hists, scales, algo, fmt, margin):
    hists = [h.copy() for h in hists]
    scales = [s.copy() for s in scales]
    off = 0
    for h, s in zip(hists, scales):
        h2 = h.reshape(h.shape[0], -1)  # a view: edits land in h
        for j in range(h2.shape[1]):
            b = buffer[off + j] if buffer is not None and buffer.size else np.float32(0)
            last = b if b != 0 else h2[0, j]
            if last != 0:
                h2[0, j] = last
            amax = history_amax_ref(h2[:, j], "max") if algo == "max" else np.float32(last)
            if last != 0:  # (a column unused this step keeps its scale, as in TE)
                s[j] = delayed_scale_ref(amax, s[j], FP8_MAX[fmt], margin)
            if last != 0:
                col = np.roll(h2[:, j], -1)
                col[0] = 0.0
                h2[:, j] = col
        off += h2.shape[1]
    return hists, scales


def random_history(shape, rng, specials=True):
    """Log-uniform amaxes with zeros, inf and NaN sprinkled in, plus whole special columns."""
    h = np.exp2(rng.uniform(-20, 20, shape)).astype(np.float32)
    if specials and h.size:
        pick = rng.random(shape)
        h[pick < 0.15] = 0.0
        h[(pick >= 0.15) & (pick < 0.2)] = np.inf
        h[(pick >= 0.2) & (pick < 0.25)] = np.nan
        h2 = h.reshape(shape[0], -1)
        if h2.shape[1] >= 6:
            h2[:, 0] = 0.0           # never used: scale kept
            h2[:, 1] = np.nan        # all NaN: "max" gives 0, scale kept
            h2[:, 2] = 1e-40         # tiny amax: quotient overflows -> FLT_MAX
            h2[0, 3] = np.inf        # most_recent inf: scale kept
            h2[0, 4] = 0.0           # most_recent 0: scale kept
            h2[:, 5] = 448.0
        if h2.shape[1] >= 7:
            h2[0, 6] = -2.0          # most_recent negative (invalid): scale kept, as in TE
    return h


def run_update(hist, scale, new_hist, new_scale, algo, fmt, margin):
    nvte.delayed_scaling_recipe_amax_and_scale_update(
        nvte.Tensor(hist), nvte.Tensor(scale), nvte.Tensor(new_hist), nvte.Tensor(new_scale), algo,
        NVTE_DTYPE[fmt], margin)


# ----------------------------------------------------------------------------- single update
@pytest.mark.parametrize("shape", [(1, 1), (1, 7), (4, 1), (16, 9), (1024, 33), (5,), (1,), (3, 0)])
@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("margin", MARGINS)
def test_amax_and_scale_update(shape, algo, fmt, margin, rng):
    hist = random_history(shape, rng)
    n = shape[1] if len(shape) == 2 else 1
    scale = np.exp2(rng.uniform(-4, 4, n)).astype(np.float32)
    new_hist = np.full(shape, np.float32(-7.0))
    new_scale = np.full(n, np.float32(-7.0))
    hist_before, scale_before = hist.copy(), scale.copy()
    run_update(hist, scale, new_hist, new_scale, algo, fmt, margin)
    ref_hist, ref_scale = update_ref(hist, scale, algo, fmt, margin)
    assert_bits_equal(bits(new_hist), bits(ref_hist))
    assert_bits_equal(bits(new_scale), bits(ref_scale))
    assert_bits_equal(bits(hist), bits(hist_before))  # inputs untouched
    assert_bits_equal(bits(scale), bits(scale_before))


@pytest.mark.parametrize("algo", ALGOS)
def test_amax_and_scale_update_in_place(algo, rng):
    hist = random_history((8, 12), rng)
    scale = np.exp2(rng.uniform(-4, 4, 12)).astype(np.float32)
    ref_hist, ref_scale = update_ref(hist, scale, algo, "e4m3", 1.0)
    th, ts = nvte.Tensor(hist), nvte.Tensor(scale)
    nvte.delayed_scaling_recipe_amax_and_scale_update(th, ts, th, ts, algo, DT.kFloat8E4M3, 1.0)
    assert_bits_equal(bits(hist), bits(ref_hist))
    assert_bits_equal(bits(scale), bits(ref_scale))


def test_amax_and_scale_update_structured():
    # arange history: "max" sees the largest row, most_recent row 0; margin 1 halves the scale.
    hist = np.arange(1, 13, dtype=np.float32).reshape(4, 3)
    scale = np.ones(3, np.float32)
    new_hist, new_scale = np.zeros_like(hist), np.zeros_like(scale)
    run_update(hist, scale, new_hist, new_scale, "max", "e4m3", 1.0)
    np.testing.assert_array_equal(new_scale, np.float32(448.0) / np.array([10, 11, 12], np.float32) / 2)
    np.testing.assert_array_equal(new_hist, [[0, 0, 0], [7, 8, 9], [10, 11, 12], [1, 2, 3]])
    run_update(hist, scale, new_hist, new_scale, "most_recent", "e5m2", 0.0)
    np.testing.assert_array_equal(new_scale, np.float32(57344.0) / np.array([1, 2, 3], np.float32))


def test_amax_and_scale_update_errors():
    h, s = nvte.Tensor(np.ones((4, 3), np.float32)), nvte.Tensor(np.ones(3, np.float32))
    op = "nvte_delayed_scaling_recipe_amax_and_scale_update"
    cases = [
        (dict(algo="mean"), r'unknown amax_compute_algo "mean"; expected "max" or "most_recent"'),
        (dict(fmt=DT.kFloat32), r"fp8_dtype must be float8_e4m3 or float8_e5m2, got float32"),
        (dict(scale=nvte.Tensor(np.ones(2, np.float32))), r"scale has shape \[2\]; expected \[3\]"),
        (dict(new_hist=nvte.Tensor(np.ones((5, 3), np.float32))),
         r"updated_amax_history has shape \[5, 3\]; expected \[4, 3\]"),
        (dict(hist=nvte.Tensor(np.ones((2, 2, 3), np.float32))), r"amax_history has shape \[2, 2, 3\]; expected"),
        (dict(hist=nvte.Tensor(np.ones((4, 3), np.float16))), r"amax_history must be float32, got float16"),
        (dict(hist=nvte.Tensor(np.ones((0, 3), np.float32))),
         r"amax_history has shape \[0, 3\]; the history needs at least one row"),
    ]
    for kw, msg in cases:
        with pytest.raises(nvte.Error, match=op + ": " + msg) as e:
            nvte.delayed_scaling_recipe_amax_and_scale_update(
                kw.get("hist", h), kw.get("scale", s), kw.get("new_hist", h), s, kw.get("algo", "max"),
                kw.get("fmt", DT.kFloat8E4M3), 0.0)
        assert e.value.args[1] == int(nvte.Status.INVALID_ARGUMENT)


# ----------------------------------------------------------------------------- after reduction
def make_group(rng, shapes):
    hists = [random_history(s, rng) for s in shapes]
    scales = [np.exp2(rng.uniform(-4, 4, s[1] if len(s) == 2 else 1)).astype(np.float32) for s in shapes]
    return hists, scales


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("margin", MARGINS)
@pytest.mark.parametrize("buffer_kind", ["full", "none", "empty"])
def test_after_reduction(algo, fmt, margin, buffer_kind, rng):
    shapes = [(16, 9), (16, 1), (16,), (1, 4), (16, 0), (3, 7)]
    hists, scales = make_group(rng, shapes)
    total = sum(s[1] if len(s) == 2 else 1 for s in shapes)
    buffer = None
    if buffer_kind == "full":
        buffer = np.exp2(rng.uniform(-10, 10, total)).astype(np.float32)
        buffer[rng.random(total) < 0.3] = 0.0  # tensors unused this step
        buffer[rng.random(total) < 0.05] = np.inf
    elif buffer_kind == "empty":
        buffer = np.zeros(0, np.float32)
    ref_h, ref_s = after_reduction_ref(buffer, hists, scales, algo, fmt, margin)
    nvte.delayed_scaling_recipe_amax_and_scale_update_after_reduction(
        None if buffer is None else nvte.Tensor(buffer), [nvte.Tensor(h) for h in hists],
        [nvte.Tensor(s) for s in scales], algo, NVTE_DTYPE[fmt], margin)
    for i in range(len(shapes)):
        assert_bits_equal(bits(hists[i]), bits(ref_h[i]))
        assert_bits_equal(bits(scales[i]), bits(ref_s[i]))


def test_after_reduction_structured():
    # Column 0 got amax 5 this step; column 1 was not used (buffer 0, history[0] 0).
    hist = np.array([[0, 0], [1, 2], [3, 4]], np.float32)
    scale = np.array([1.0, 1.0], np.float32)
    nvte.delayed_scaling_recipe_amax_and_scale_update_after_reduction(
        nvte.Tensor(np.array([5.0, 0.0], np.float32)), [nvte.Tensor(hist)], [nvte.Tensor(scale)], "max",
        DT.kFloat8E4M3, 0.0)
    np.testing.assert_array_equal(hist, [[0, 0], [3, 2], [5, 4]])  # last lands in the final row
    np.testing.assert_array_equal(scale, [np.float32(448) / 5, 1.0])  # the unused column keeps its scale (TE)
    nvte.delayed_scaling_recipe_amax_and_scale_update_after_reduction(
        None, [], [], "most_recent", DT.kFloat8E5M2, 0.0)  # nothing to do


def test_after_reduction_errors():
    h, s = nvte.Tensor(np.ones((4, 3), np.float32)), nvte.Tensor(np.ones(3, np.float32))
    op = "nvte_delayed_scaling_recipe_amax_and_scale_update_after_reduction"
    with pytest.raises(nvte.Error, match=op + r": amax_reduction_buffer has shape \[4\] \(4 values\) but the 1 "
                                               r"histories have 3 columns in total"):
        nvte.delayed_scaling_recipe_amax_and_scale_update_after_reduction(
            nvte.Tensor(np.ones(4, np.float32)), [h], [s], "max", DT.kFloat8E4M3, 0.0)
    with pytest.raises(nvte.Error, match=op + r': unknown amax_compute_algo "Max"'):
        nvte.delayed_scaling_recipe_amax_and_scale_update_after_reduction(None, [h], [s], "Max", DT.kFloat8E4M3, 0)
    with pytest.raises(nvte.Error, match=op + r": scales\[1\] has shape \[3\]; expected \[2\]"):
        nvte.delayed_scaling_recipe_amax_and_scale_update_after_reduction(
            None, [h, nvte.Tensor(np.ones((4, 2), np.float32))], [s, s], "max", DT.kFloat8E4M3, 0.0)
    with pytest.raises(ValueError, match="differ in length"):
        nvte.delayed_scaling_recipe_amax_and_scale_update_after_reduction(None, [h], [], "max", DT.kFloat8E4M3, 0)


@pytest.mark.parametrize("margin", [float("nan"), float("inf"), -float("inf"), 200.0, -127.0])
def test_margin_must_be_finite_and_in_range(margin):
    """A NaN / infinite margin, or one whose 2^margin is no normal float32, is refused by both
    updates, with the history and scale untouched (it gave NaN, 0 or FLT_MAX scales with SUCCESS)."""
    hist = np.array([[0, 0], [1, 2], [3, 4]], np.float32)
    scale = np.array([2.0, 3.0], np.float32)
    h0, s0 = hist.copy(), scale.copy()
    with pytest.raises(nvte.Error, match="margin must be finite and within \\[-126, 126\\]") as e:
        nvte.delayed_scaling_recipe_amax_and_scale_update(nvte.Tensor(hist), nvte.Tensor(scale), nvte.Tensor(hist),
                                                           nvte.Tensor(scale), "max", DT.kFloat8E4M3, margin)
    assert e.value.args[1] == int(nvte.Status.INVALID_ARGUMENT)
    with pytest.raises(nvte.Error, match="margin must be finite"):
        nvte.delayed_scaling_recipe_amax_and_scale_update_after_reduction(
            None, [nvte.Tensor(hist)], [nvte.Tensor(scale)], "max", DT.kFloat8E4M3, margin)
    np.testing.assert_array_equal(hist, h0)
    np.testing.assert_array_equal(scale, s0)
    nvte.delayed_scaling_recipe_amax_and_scale_update(nvte.Tensor(hist), nvte.Tensor(scale), nvte.Tensor(hist),
                                                       nvte.Tensor(scale), "max", DT.kFloat8E4M3, 126.0)


# ----------------------------------------------------------------------------- current scaling
@pytest.mark.parametrize("shape", [(1, 1), (7, 33), (31, 129), (0, 8), (2, 3, 5)])
@pytest.mark.parametrize("name", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("preset", [0.0, 1e9])
def test_compute_amax_overwrites(shape, name, preset, rng):
    x = to_np(rng.standard_normal(shape) * 100, name)
    out = FP8Out(shape, "e4m3", amax=preset)
    nvte.compute_amax(tensor(x), out.tensor)
    ref = np.abs(x.astype(np.float32)).max() if x.size else np.float32(0.0)
    assert out.amax[0] == ref
    assert (out.data == 0xAB).all() and out.scale_inv[0] == -1.0  # only amax is written


def test_compute_amax_specials():
    amax = scalar(5.0)
    target = nvte.Tensor(None, amax=amax)  # an amax buffer alone is enough
    nvte.compute_amax(nvte.Tensor(np.array([1.0, np.nan, -3.0], np.float32)), target)
    assert amax[0] == 3.0  # NaN ignored like fmaxf
    nvte.compute_amax(nvte.Tensor(np.array([np.nan, -np.inf], np.float32)), target)
    assert amax[0] == np.inf
    with pytest.raises(nvte.Error, match=r"nvte_compute_amax: output has no amax buffer"):
        nvte.compute_amax(nvte.Tensor(np.ones(3, np.float32)), nvte.Tensor(np.ones(3, np.float32)))
    with pytest.raises(nvte.Error, match=r"nvte_compute_amax: input must be float32, float16 or bfloat16"):
        nvte.compute_amax(FP8Out((3,), "e4m3").tensor, target)


def scale_from_amax_ref(amax, fmt, pow2, eps):
    a = np.float32(amax)
    if a < np.float32(eps):
        a = np.float32(eps)
    if a == 0 or not np.isfinite(a):
        s = np.float32(1.0)
    else:
        s = f32(FP8_MAX[fmt] / float(a))
        s = FLT_MAX if np.isinf(s) else s
    if pow2:
        s = (np.array([s], np.float32).view(np.uint32) & np.uint32(0xFF800000)).view(np.float32)[0]
    return np.float32(s)


CURRENT_CASES = [
    # amax, epsilon: plain, zero, epsilon clamp, inf, NaN, tiny (-> FLT_MAX), huge, exact max
    (3.0, 0.0), (0.0, 0.0), (0.0, 1e-3), (2e-4, 1e-3), (np.inf, 0.0), (np.nan, 0.0), (np.nan, 1e-3),
    (1e-40, 0.0), (1e-44, 0.0), (3e38, 0.0), (448.0, 0.0), (57344.0, 0.0), (0.7, 0.0), (12345.678, 1.0),
]


@pytest.mark.parametrize("amax,eps", CURRENT_CASES)
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("pow2", [False, True])
def test_compute_scale_from_amax(amax, eps, fmt, pow2):
    out = FP8Out((2, 3), fmt, scale=-5.0, amax=amax)
    nvte.compute_scale_from_amax(out.tensor, force_pow2_scales=pow2, amax_epsilon=eps)
    ref = scale_from_amax_ref(amax, fmt, pow2, eps)
    assert bits(out.scale)[0] == bits(ref)[0], (out.scale[0], ref)
    # Only the scale is written.
    assert (out.data == 0xAB).all() and out.scale_inv[0] == -1.0
    assert bits(out.amax)[0] == bits(np.float32(amax))[0] or np.isnan(amax)


def test_compute_scale_from_amax_known_values(rng):
    out = FP8Out((4,), "e4m3", amax=1e-40)
    nvte.compute_scale_from_amax(out.tensor)
    assert out.scale[0] == FLT_MAX
    nvte.compute_scale_from_amax(out.tensor, force_pow2_scales=True)
    assert out.scale[0] == np.float32(2.0**127)
    out.amax[0] = 3.0
    nvte.compute_scale_from_amax(out.tensor, force_pow2_scales=True)
    assert out.scale[0] == 128.0  # 149.33 rounded down to a power of two
    for a in np.exp2(rng.uniform(-30, 30, 200)).astype(np.float32):
        out.amax[0] = a
        nvte.compute_scale_from_amax(out.tensor, force_pow2_scales=True)
        s = out.scale[0]
        assert s <= np.float32(448.0) / a and np.log2(s) == np.floor(np.log2(s))


def test_compute_scale_from_amax_noop_and_errors():
    out = FP8Out((2, 3), "e5m2", scale=-5.0, amax=2.0)
    flag = scalar(1.0)
    nvte.compute_scale_from_amax(out.tensor, noop=nvte.Tensor(flag))
    assert out.scale[0] == -5.0
    flag[0] = 0.0
    nvte.compute_scale_from_amax(out.tensor, noop=nvte.Tensor(flag))
    assert out.scale[0] == np.float32(57344.0 / 2.0)
    op = "nvte_compute_scale_from_amax"
    with pytest.raises(nvte.Error, match=op + r": output must be an FP8 tensor .*got float32"):
        nvte.compute_scale_from_amax(nvte.Tensor(np.ones(3, np.float32), amax=scalar(1.0), scale=scalar(1.0)))
    with pytest.raises(nvte.Error, match=op + r": output has no amax buffer"):
        nvte.compute_scale_from_amax(nvte.Tensor(np.zeros(3, np.uint8), dtype=DT.kFloat8E4M3, scale=scalar(1.0)))
    with pytest.raises(nvte.Error, match=op + r": output has no scale buffer"):
        nvte.compute_scale_from_amax(nvte.Tensor(np.zeros(3, np.uint8), dtype=DT.kFloat8E4M3, amax=scalar(1.0)))
