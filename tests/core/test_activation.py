"""Activations (activation.h): elementwise and gated, forward and backward, against float64
numpy references (themselves checked against torch.autograd), all float dtypes, FP8 outputs."""
import numpy as np
import pytest
import torch

from util import (BF16, DT, FP8Out, SHAPES_2D, TOLERANCE, assert_bits_equal, assert_close,
                  fp8_encode_ref, poisoned, scalar, to_np)
from transformer_engine import _nvte as nvte

K = np.sqrt(2.0 / np.pi)


def sigmoid_ref(x):
    return 0.5 * (1.0 + np.tanh(0.5 * x))  # overflow-free form of 1 / (1 + exp(-x))


def gelu_ref(x):
    return 0.5 * x * (1.0 + np.tanh(K * (x + 0.044715 * x**3)))


def dgelu_ref(x):
    t = np.tanh(K * (x + 0.044715 * x**3))
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * K * (1.0 + 3 * 0.044715 * x * x)


def relu_ref(x):
    return np.maximum(x, 0.0)


def drelu_ref(x):
    return (x > 0).astype(np.float64)


def silu_ref(x):
    return x * sigmoid_ref(x)


def dsilu_ref(x):
    s = sigmoid_ref(x)
    return s * (1.0 + x * (1.0 - s))


def qgelu_ref(x):
    return x * sigmoid_ref(1.702 * x)


def dqgelu_ref(x):
    s = sigmoid_ref(1.702 * x)
    return s * (1.0 + 1.702 * x * (1.0 - s))


def srelu_ref(x):
    return np.maximum(x, 0.0) ** 2


def dsrelu_ref(x):
    return 2.0 * np.maximum(x, 0.0)


def dsigmoid_ref(x):
    s = sigmoid_ref(x)
    return s * (1.0 - s)


# name -> (act, d act) float64 references, and the torch float64 function used to check them.
ELEMENTWISE = {
    "gelu": (gelu_ref, dgelu_ref, lambda t: torch.nn.functional.gelu(t, approximate="tanh")),
    "relu": (relu_ref, drelu_ref, torch.relu),
    "silu": (silu_ref, dsilu_ref, torch.nn.functional.silu),
    "qgelu": (qgelu_ref, dqgelu_ref, lambda t: t * torch.sigmoid(1.702 * t)),
    "srelu": (srelu_ref, dsrelu_ref, lambda t: torch.relu(t) ** 2),
}
SIGMOID = (sigmoid_ref, dsigmoid_ref, torch.sigmoid)
# gated name -> the activation applied to the first half.
GATED = {"glu": SIGMOID, "geglu": ELEMENTWISE["gelu"], "reglu": ELEMENTWISE["relu"],
         "swiglu": ELEMENTWISE["silu"], "qgeglu": ELEMENTWISE["qgelu"], "sreglu": ELEMENTWISE["srelu"]}

DTYPES = ["float32", "float16", "bfloat16"]
SHAPES = SHAPES_2D + [(2, 3, 10), (4, 1, 6)]
SPECIALS = np.array([0.0, 1.0, -1.0, 20.0, -20.0, 8.0, -8.0, 1e-3, -1e-3, 0.5, -0.5])


def gated_ref(act, x):
    h = x.shape[-1] // 2
    return act(x[..., :h]) * x[..., h:]


def dgated_ref(act, dact, g, x):
    h = x.shape[-1] // 2
    a, gate = x[..., :h], x[..., h:]
    return np.concatenate([g * gate * dact(a), g * act(a)], axis=-1)


def make_input(rng, shape, dtype):
    """Normal(0, 3) values with saturating (+-20), zero and near-zero values mixed in; returns the
    stored array and its exact float64 value."""
    x = rng.normal(0.0, 3.0, shape)
    if x.size:
        pick = rng.random(shape) < 0.2
        x[pick] = rng.choice(SPECIALS, size=int(pick.sum()))
    a = to_np(x, dtype)
    return a, a.astype(np.float64)


def assert_close_scaled(got, ref, dtype, mult):
    """ref = mult * f(x). The float32 evaluation of f has an absolute error of a few float32 ulps
    of 1 near saturation (1 + tanh, 1 - sigmoid cancel in the shared formulas; measured <= 1.3e-6
    over [-25, 25]); multiplying by the grad / gate scales that absolute error by |mult|, so the
    table's atol is scaled by it too (rtol is unchanged)."""
    atol = TOLERANCE[dtype][0] * np.maximum(1.0, np.abs(mult))
    assert_close(got, ref, dtype, atol=atol)


def T(a):
    """nvte.Tensor of a numpy array; bfloat16 (ml_dtypes) arrays do not export the buffer
    protocol, so they are passed as their uint16 bits with the dtype given explicitly."""
    if a.dtype == BF16:
        return nvte.Tensor(a.view(np.uint16), dtype=DT.kBFloat16)
    return nvte.Tensor(a)


def run_fwd(name, x, out):
    getattr(nvte, name)(T(x), T(out))


def run_bwd(name, g, x, out):
    getattr(nvte, "d" + name)(T(g), T(x), T(out))


# ------------------------------------------------------------ the references themselves


# atol 1e-11: 1 + tanh cancels in float64 too (torch and numpy order the operations differently).
@pytest.mark.parametrize("name", list(ELEMENTWISE) + ["sigmoid"])
def test_references_match_torch_autograd(name, rng):
    act, dact, tfn = SIGMOID if name == "sigmoid" else ELEMENTWISE[name]
    x = np.concatenate([rng.normal(0, 4, 500), SPECIALS, np.linspace(-25, 25, 101)])
    t = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    y = tfn(t)
    y.sum().backward()
    np.testing.assert_allclose(act(x), y.detach().numpy(), rtol=1e-12, atol=1e-11)
    np.testing.assert_allclose(dact(x), t.grad.numpy(), rtol=1e-12, atol=1e-11)


@pytest.mark.parametrize("name", list(GATED))
def test_gated_backward_reference_matches_torch_autograd(name, rng):
    act, dact, tfn = GATED[name]
    x = rng.normal(0, 4, (6, 10))
    g = rng.normal(0, 1, (6, 5))
    t = torch.tensor(x, requires_grad=True)
    y = tfn(t[:, :5]) * t[:, 5:]
    y.backward(torch.tensor(g))
    np.testing.assert_allclose(gated_ref(act, x), y.detach().numpy(), rtol=1e-12, atol=1e-11)
    np.testing.assert_allclose(dgated_ref(act, dact, g, x), t.grad.numpy(), rtol=1e-12, atol=1e-11)


# ------------------------------------------------------------ elementwise


@pytest.mark.parametrize("out_dtype", DTYPES)
@pytest.mark.parametrize("in_dtype", DTYPES)
@pytest.mark.parametrize("name", list(ELEMENTWISE))
def test_elementwise_forward(name, in_dtype, out_dtype, rng):
    act = ELEMENTWISE[name][0]
    for shape in SHAPES:
        x, x64 = make_input(rng, shape, in_dtype)
        out = poisoned(shape, out_dtype)
        run_fwd(name, x, out)
        assert_close(out, act(x64), out_dtype)


@pytest.mark.parametrize("out_dtype", DTYPES)
@pytest.mark.parametrize("in_dtype", DTYPES)
@pytest.mark.parametrize("name", list(ELEMENTWISE))
def test_elementwise_backward(name, in_dtype, out_dtype, rng):
    dact = ELEMENTWISE[name][1]
    for shape in SHAPES:
        x, x64 = make_input(rng, shape, in_dtype)
        g = to_np(rng.normal(0, 1, shape), in_dtype)
        out = poisoned(shape, out_dtype)
        run_bwd(name, g, x, out)
        assert_close_scaled(out, g.astype(np.float64) * dact(x64), out_dtype, g.astype(np.float64))


@pytest.mark.parametrize("name", list(ELEMENTWISE))
def test_elementwise_structured(name):
    act, dact, _ = ELEMENTWISE[name]
    x = np.linspace(-20, 20, 161, dtype=np.float32).reshape(7, 23)  # includes exact 0
    out = poisoned(x.shape, "float32")
    run_fwd(name, x, out)
    assert_close(out, act(x.astype(np.float64)))
    got = poisoned(x.shape, "float32")
    run_bwd(name, np.ones_like(x), x, got)
    assert_close(got, dact(x.astype(np.float64)))


def test_elementwise_in_place():
    x = np.linspace(-5, 5, 40, dtype=np.float32).reshape(4, 10)
    ref = gelu_ref(x.astype(np.float64))
    t = nvte.Tensor(x)
    nvte.gelu(t, t)
    assert_close(x, ref)


# ------------------------------------------------------------ gated


@pytest.mark.parametrize("out_dtype", DTYPES)
@pytest.mark.parametrize("in_dtype", DTYPES)
@pytest.mark.parametrize("name", list(GATED))
def test_gated_forward(name, in_dtype, out_dtype, rng):
    act = GATED[name][0]
    for shape in SHAPES:
        in_shape = shape[:-1] + (2 * shape[-1],)
        x, x64 = make_input(rng, in_shape, in_dtype)
        out = poisoned(shape, out_dtype)
        run_fwd(name, x, out)
        assert_close_scaled(out, gated_ref(act, x64), out_dtype, x64[..., shape[-1]:])


@pytest.mark.parametrize("out_dtype", DTYPES)
@pytest.mark.parametrize("in_dtype", DTYPES)
@pytest.mark.parametrize("name", list(GATED))
def test_gated_backward(name, in_dtype, out_dtype, rng):
    act, dact, _ = GATED[name]
    for shape in SHAPES:
        in_shape = shape[:-1] + (2 * shape[-1],)
        x, x64 = make_input(rng, in_shape, in_dtype)
        g = to_np(rng.normal(0, 1, shape), in_dtype)
        out = poisoned(in_shape, out_dtype)
        run_bwd(name, g, x, out)
        g64 = g.astype(np.float64)
        mult = np.concatenate([g64 * x64[..., shape[-1]:], g64], axis=-1)
        assert_close_scaled(out, dgated_ref(act, dact, g64, x64), out_dtype, mult)


@pytest.mark.parametrize("name", list(GATED))
def test_gated_structured(name):
    act, dact, _ = GATED[name]
    a = np.linspace(-20, 20, 41, dtype=np.float32)
    x = np.stack([np.concatenate([a, np.ones_like(a)]), np.concatenate([a, np.arange(41, dtype=np.float32)])])
    x64, gate = x.astype(np.float64), x[:, 41:].astype(np.float64)
    out = poisoned((2, 41), "float32")
    run_fwd(name, x, out)
    assert_close_scaled(out, gated_ref(act, x64), "float32", gate)
    g = np.ones((2, 41), np.float32)
    dout = poisoned((2, 82), "float32")
    run_bwd(name, g, x, dout)
    mult = np.concatenate([gate, np.ones_like(gate)], axis=-1)
    assert_close_scaled(dout, dgated_ref(act, dact, g.astype(np.float64), x64), "float32", mult)


# ------------------------------------------------------------ FP8 outputs


def assert_fp8_close(got_u8, ref32, fmt):
    """The library's float32 result can differ from the float64 reference by a float32 ulp or so
    (tanhf/expf), which may flip an FP8 rounding decision at a midpoint: allow the neighbouring
    code, require the exact code almost everywhere."""
    exp = fp8_encode_ref(ref32, fmt)

    def ordinal(c):
        c = c.astype(np.int32)
        return np.where(c & 0x80, -(c & 0x7F), c & 0x7F)

    diff = np.abs(ordinal(got_u8) - ordinal(exp))
    assert diff.max(initial=0) <= 1, f"FP8 codes differ by more than one step: max {diff.max()}"
    assert (diff == 0).mean() >= 0.98 if diff.size else True


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("name", list(ELEMENTWISE) + list(GATED))
def test_fp8_output(name, fmt, rng):
    gated = name in GATED
    act, dact, _ = GATED[name] if gated else ELEMENTWISE[name]
    scale = 2.0  # srelu(20) * 2 = 800 saturates E4M3
    for shape in [(7, 33), (31, 16), (0, 4)]:
        in_shape = shape[:-1] + (2 * shape[-1],) if gated else shape
        x, x64 = make_input(rng, in_shape, "bfloat16")
        # Forward.
        ref = gated_ref(act, x64) if gated else act(x64)
        o = FP8Out(shape, fmt, scale=scale, columnwise=True)
        getattr(nvte, name)(T(x), o.tensor)
        assert_fp8_close(o.data, ref.astype(np.float32) * np.float32(scale), fmt)
        assert_bits_equal(o.col, o.data.reshape(-1, shape[-1]).T)
        assert_close(o.amax, [np.abs(ref).max(initial=0.0)])
        assert o.scale_inv[0] == np.float32(1.0 / scale)
        # Backward.
        g = to_np(rng.normal(0, 1, shape), "bfloat16")
        g64 = g.astype(np.float64)
        dref = dgated_ref(act, dact, g64, x64) if gated else g64 * dact(x64)
        o = FP8Out(in_shape, fmt, scale=scale)
        getattr(nvte, "d" + name)(T(g), T(x), o.tensor)
        assert_fp8_close(o.data, dref.astype(np.float32) * np.float32(scale), fmt)
        assert_close(o.amax, [np.abs(dref).max(initial=0.0)])


def test_fp8_amax_is_max_accumulated():
    x = np.full((2, 4), 3.0, np.float32)
    o = FP8Out((2, 4), "e4m3", amax=100.0)
    nvte.relu(nvte.Tensor(x), o.tensor)
    assert o.amax[0] == 100.0
    o = FP8Out((2, 4), "e4m3", amax=1.0)
    nvte.relu(nvte.Tensor(x), o.tensor)
    assert o.amax[0] == 3.0


def test_empty_leaves_outputs_alone():
    o = FP8Out((0, 6), "e5m2", amax=5.0)
    nvte.geglu(nvte.Tensor(np.zeros((0, 12), np.float32)), o.tensor)
    nvte.dgelu(nvte.Tensor(np.zeros((4, 0), np.float32)), nvte.Tensor(np.zeros((4, 0), np.float32)),
               nvte.Tensor(np.zeros((4, 0), np.float32)))
    assert o.amax[0] == 5.0


# ------------------------------------------------------------ misuse


def f32(*shape):
    return nvte.Tensor(np.zeros(shape, np.float32))


@pytest.mark.parametrize("call, match", [
    (lambda: nvte.geglu(f32(3, 5), f32(3, 2)), r"nvte_geglu: input has shape \[3, 5\].*even last dim"),
    (lambda: nvte.dswiglu(f32(3, 2), f32(3, 5), f32(3, 5)), r"nvte_dswiglu: input has shape \[3, 5\]"),
    (lambda: nvte.glu(f32(3, 8), f32(3, 8)), r"nvte_glu: output has shape \[3, 8\].*expected \[3, 4\]"),
    (lambda: nvte.dreglu(f32(3, 3), f32(3, 8), f32(3, 8)), r"nvte_dreglu: grad has shape \[3, 3\].*\[3, 4\]"),
    (lambda: nvte.dqgeglu(f32(3, 4), f32(3, 8), f32(3, 4)), r"nvte_dqgeglu: output has shape \[3, 4\].*\[3, 8\]"),
    (lambda: nvte.gelu(f32(4, 6), f32(4, 7)), r"nvte_gelu: output has shape \[4, 7\].*expected \[4, 6\]"),
    (lambda: nvte.dsilu(f32(4, 5), f32(4, 6), f32(4, 6)), r"nvte_dsilu: grad has shape \[4, 5\]"),
    (lambda: nvte.relu(nvte.Tensor(np.zeros((2, 2), np.int32)), f32(2, 2)),
     r"nvte_relu: input must be float32, float16 or bfloat16, got int32"),
    (lambda: nvte.relu(nvte.Tensor(np.zeros((2, 2), np.uint8), dtype=DT.kFloat8E4M3, scale_inv=scalar(1)),
                       f32(2, 2)), r"nvte_relu: input must be .* got float8_e4m3"),
    (lambda: nvte.srelu(f32(2, 2), nvte.Tensor(np.zeros((2, 2), np.int64))),
     r"nvte_srelu: output must be .* got int64"),
    (lambda: nvte.dgelu(nvte.Tensor(np.zeros((2, 2), np.int16)), f32(2, 2), f32(2, 2)),
     r"nvte_dgelu: grad must be .* got int16"),
    (lambda: nvte.dgelu(None, f32(2, 2), f32(2, 2)), r"nvte_dgelu: grad is a NULL tensor handle"),
    (lambda: nvte.qgelu(nvte.Tensor(), f32(2, 2)), r"nvte_qgelu: input has no data"),
    (lambda: nvte.silu(f32(2, 2), nvte.Tensor(np.zeros((2, 2), np.uint8), dtype=DT.kFloat8E4M3)),
     r"nvte_silu: output is FP8 \(float8_e4m3\) but has no scale"),
])
def test_errors(call, match):
    with pytest.raises(nvte.Error, match=match):
        call()
    # The process survives and a valid call still works.
    x = np.array([[1.0, -2.0]], np.float32)
    out = np.zeros_like(x)
    nvte.relu(nvte.Tensor(x), nvte.Tensor(out))
    assert out.tolist() == [[1.0, 0.0]]
