"""Views of Float8Tensor parameters (quantized_model_init / fp8_model_init) share the FP8 bytes:
reads through a view give the parameter's values, and an in-place op through a view writes the
parameter (its bytes, and its transpose, which must stay the same bytes transposed).

Each write is checked against a plain-tensor reference: the parameter's dequantized value, with the
same view taken and the same in-place op applied, then cast to FP8 as a whole by the library with
the parameter's scale (a write to part of a parameter keeps the scale) or with the parameter's
quantizer (a view covering all of it); the parameter's bytes must equal that cast exactly. Inputs
are random and structured (arange), the shapes odd."""
import copy
import io
import pickle

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common import recipe
from transformer_engine.pytorch import _ops, custom_ops
from transformer_engine.pytorch.tensor import Float8Tensor, WeightQuantizer
from _util import DEVICE, FP8, dev, seeded

E4M3, E5M2 = int(_ops.DType.kFloat8E4M3), int(_ops.DType.kFloat8E5M2)
SHAPES = [(5, 7), (9, 4), (3, 11), (13, 6)]
KINDS = ["current", "delayed"]
DTYPES = [torch.float32, torch.bfloat16]


# ------------------------------------------------------------------ parameters and references
def _src(gen, shape, structured):
    rows, cols = shape
    if structured:  # every element distinct, signs mixed
        return (torch.arange(rows * cols, dtype=torch.float64).reshape(rows, cols) - rows * cols / 3) / 7
    return torch.randn(shape, generator=gen, dtype=torch.float64) * 3


def _param(kind, shape, dtype, columnwise, src):
    """An FP8 parameter holding the cast of src: a te.Linear's weight (delayed scaling: the
    module's FP8 metadata and slot) or a Float8Tensor of a current-scaling quantizer."""
    rows, cols = shape
    if kind == "delayed":
        with te.fp8_model_init(enabled=True, recipe=recipe.DelayedScaling(amax_history_len=4)):
            with torch.set_grad_enabled(columnwise):  # (the transpose is kept when built with grad)
                m = te.Linear(cols, rows, bias=False, params_dtype=dtype, device=DEVICE)
        w = m.weight
        with torch.no_grad():
            w.copy_(dev(src.to(dtype)))
        w._module = m  # (keep the module, whose FP8 metadata the quantizer uses, alive)
        return w
    q = WeightQuantizer(recipe.Float8CurrentScaling(), E4M3)
    return torch.nn.Parameter(Float8Tensor.quantize(dev(src.to(dtype)), q, columnwise=columnwise),
                              requires_grad=True)


def _cast_with_scale(x, scale_inv, fmt):
    """The library's FP8 cast of the plain tensor x with scale 1 / scale_inv -> uint8 bytes of x's
    shape; checked against torch's own float8 cast (saturating, round to nearest even)."""
    scale = torch.reciprocal(scale_inv.to(torch.float32).reshape(1))
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    d, _, _, _ = custom_ops.quantize(x2, scale, None, 0, fmt, True, False, False, False, 0.0)
    dt, mx = FP8["e4m3" if fmt == E4M3 else "e5m2"]
    emul = (x2.float().cpu() * scale.cpu()).clamp(-mx, mx).to(dt).view(torch.uint8)
    assert torch.equal(d.cpu(), emul)
    return d.reshape(x.shape)


def _check_consistent(w):
    if w._transpose is not None:
        assert torch.equal(w._transpose, w._data.t()), "the transpose no longer holds the bytes transposed"


def _check_partial_write(w, ref, scale_inv_before):
    """w's bytes are the cast of the plain reference `ref` with w's unchanged scale. Returns the
    reference as the parameter holds it (cast), for further writes."""
    assert torch.equal(w._scale_inv, scale_inv_before)
    want = _cast_with_scale(ref, scale_inv_before, w.fp8_dtype)
    assert torch.equal(w._data, want)
    _check_consistent(w)
    got = w.dequantize(torch.float32).double().cpu()
    exact = custom_ops.dequantize(want.contiguous(), scale_inv_before, w.fp8_dtype, torch.float32).double().cpu()
    assert torch.equal(got, exact)
    # and within FP8 rounding of the float64 value written
    dt, mx = FP8["e4m3" if w.fp8_dtype == E4M3 else "e5m2"]
    tol = float(scale_inv_before) * 2.0 ** -9 + ref.double().abs().cpu() * 2.0 ** -3
    assert bool(((got - ref.double().cpu()).abs() <= tol).all())
    return w.dequantize().clone()


def _lim(w):
    """Largest magnitude a partial write may hold (the FP8 range of w's scale)."""
    return float(w._scale_inv) * (448.0 if w.fp8_dtype == E4M3 else 57344.0)


# ------------------------------------------------------------------ view and write catalogue
def _pick(x, i):
    return x[i] if isinstance(x, (list, tuple)) else x


# name -> view of a 2-D tensor (same function for the parameter and the reference)
VIEWS = {
    "select_row": lambda w: w[1],
    "select_last_row": lambda w: w[-1],
    "select_col": lambda w: w[:, 2],
    "slice_rows": lambda w: w[1:4],
    "slice_rows_step": lambda w: w[::2],
    "slice_cols": lambda w: w[:, :3],
    "slice_cols_step": lambda w: w[:, 1::2],
    "block": lambda w: w[1:, 1:3],
    "narrow_rows": lambda w: w.narrow(0, 1, 2),
    "narrow_cols": lambda w: w.narrow(1, 1, 2),
    "split_rows": lambda w: w.split(2)[1],
    "split_sizes_cols": lambda w: w.split([1, w.shape[1] - 1], dim=1)[1],
    "chunk_rows": lambda w: w.chunk(3)[-1],
    "unbind_rows": lambda w: w.unbind(0)[2],
    "unbind_cols": lambda w: w.unbind(1)[1],
    "tensor_split": lambda w: w.tensor_split(2)[0],
    "t_row": lambda w: w.t()[1],
    "t_slice": lambda w: w.t()[:, 1:3],
    "transpose_slice": lambda w: w.transpose(0, 1)[1:3],
    "T_select": lambda w: w.T[0],
    "nested": lambda w: w[1:][:, 1:][0],
    "flat_slice": lambda w: w.view(-1)[3:11],
    "reshape_slice": lambda w: w.reshape(-1)[2:9],
    "unsqueeze_select": lambda w: w.unsqueeze(0)[0, 1:3],
    "diagonal": lambda w: w.diagonal(),
    "as_strided": lambda w: w.as_strided((2, 2), (w.shape[1], 1), 1),
}


def _write(name, v, gen_seed, lim, shape_dtype_dev):
    """Apply write `name` in place to the view v (parameter's or reference's alike)."""
    dtype, device = shape_dtype_dev
    g = torch.Generator(device=device).manual_seed(gen_seed)
    if name == "zero_":
        v.zero_()
    elif name == "fill_":
        v.fill_(0.37 * lim)
    elif name == "mul_":
        v.mul_(-0.5)
    elif name == "copy_":
        x = (torch.rand(v.shape, generator=torch.Generator().manual_seed(gen_seed), dtype=torch.float64) - 0.5) * lim
        v.copy_(x.to(device))
    elif name == "mul_add_":
        x = (torch.rand(v.shape, generator=torch.Generator().manual_seed(gen_seed), dtype=torch.float64) - 0.5) * lim
        v.mul_(0.5).add_(x.to(device=device, dtype=dtype) * 0.8)
    elif name == "normal_":  # (drawn into a tensor of the view's shape: the reference copies it in)
        tmp = torch.empty(v.shape, dtype=dtype, device=device).normal_(0.0, lim / 8, generator=g)
        if isinstance(v, Float8Tensor):
            v.normal_(0.0, lim / 8, generator=torch.Generator(device=device).manual_seed(gen_seed))
        else:
            v.copy_(tmp)
    elif name == "init_uniform_":
        tmp = torch.empty(v.shape, dtype=dtype, device=device).uniform_(-lim / 2, lim / 2, generator=g)
        if isinstance(v, Float8Tensor):
            torch.nn.init.uniform_(v, -lim / 2, lim / 2, generator=torch.Generator(device=device).manual_seed(gen_seed))
        else:
            v.copy_(tmp)
    elif name == "init_constant_":
        torch.nn.init.constant_(v, -0.25 * lim)
    else:
        raise AssertionError(name)


WRITES = ["zero_", "fill_", "mul_", "copy_", "mul_add_", "normal_", "init_uniform_", "init_constant_"]


@pytest.mark.parametrize("view", list(VIEWS))
@pytest.mark.parametrize("write", WRITES)
@pytest.mark.parametrize("kind", KINDS)
def test_write_through_view_reaches_parameter(rng, view, write, kind):
    structured = bool(rng.integers(2))
    shape = SHAPES[int(rng.integers(len(SHAPES)))]
    dtype = DTYPES[int(rng.integers(len(DTYPES)))]
    columnwise = bool(rng.integers(4))  # mostly with the transpose
    w = _param(kind, shape, dtype, columnwise, _src(seeded(rng), shape, structured))
    ref = w.dequantize().clone()  # the plain reference (nominal dtype, on the device)
    si = w._scale_inv.clone()
    assert torch.equal(_cast_with_scale(ref, si, w.fp8_dtype), w._data)  # the round trip is exact
    seed = int(rng.integers(1 << 30))
    with torch.no_grad():
        v = VIEWS[view](w)
        assert isinstance(v, Float8Tensor)
        assert v._data.untyped_storage().data_ptr() == w._data.untyped_storage().data_ptr()
        assert v._scale_inv is w._scale_inv
        _write(write, v, seed, _lim(w), (dtype, w.device))
        _write(write, VIEWS[view](ref), seed, _lim(w), (dtype, w.device))
    _check_partial_write(w, ref, si)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("structured", [False, True])
def test_sequence_of_view_writes(rng, kind, structured):
    """Many writes through different views of one parameter (views of views, columns, the
    transpose), each checked; the bytes never drift from the reference."""
    shape = (11, 9)
    dtype = torch.float32
    w = _param(kind, shape, dtype, True, _src(seeded(rng), shape, structured))
    ref = w.dequantize().clone()
    si = w._scale_inv.clone()
    names = list(VIEWS)
    with torch.no_grad():
        for step in range(24):
            view = names[int(rng.integers(len(names)))]
            write = WRITES[int(rng.integers(len(WRITES)))]
            seed = int(rng.integers(1 << 30))
            _write(write, VIEWS[view](w), seed, _lim(w), (dtype, w.device))
            _write(write, VIEWS[view](ref), seed, _lim(w), (dtype, w.device))
            ref = _check_partial_write(w, ref, si)  # (the parameter holds the cast value)


INITS = {
    "kaiming_uniform_": lambda t, g: torch.nn.init.kaiming_uniform_(t, a=5 ** 0.5, generator=g),
    "kaiming_normal_": lambda t, g: torch.nn.init.kaiming_normal_(t, generator=g),
    "xavier_uniform_": lambda t, g: torch.nn.init.xavier_uniform_(t, generator=g),
    "xavier_normal_": lambda t, g: torch.nn.init.xavier_normal_(t, generator=g),
    "orthogonal_": lambda t, g: torch.nn.init.orthogonal_(t, generator=g),
    "eye_": lambda t, g: torch.nn.init.eye_(t),
    "ones_": lambda t, g: torch.nn.init.ones_(t),
    "zeros_": lambda t, g: torch.nn.init.zeros_(t),
}


@pytest.mark.parametrize("init", list(INITS))
@pytest.mark.parametrize("view", ["slice_rows", "slice_cols", "block", "t_slice", "split_rows"])
def test_nn_init_on_slice(rng, init, view):
    """torch.nn.init functions on a slice of an FP8 parameter (delayed scaling: the module's scale,
    whose range holds these values) write it; the reference runs the init on a plain tensor of the
    slice's shape with the same generator and copies it in."""
    shape = (12, 10)
    w = _param("delayed", shape, torch.float32, True, _src(seeded(rng), shape, bool(rng.integers(2))))
    ref = w.dequantize().clone()
    si = w._scale_inv.clone()
    seed = int(rng.integers(1 << 30))
    with torch.no_grad():
        INITS[init](VIEWS[view](w), torch.Generator(device=w.device).manual_seed(seed))
        rv = VIEWS[view](ref)
        tmp = rv.contiguous().clone()
        INITS[init](tmp, torch.Generator(device=w.device).manual_seed(seed))
        rv.copy_(tmp)
    _check_partial_write(w, ref, si)


@pytest.mark.parametrize("kind", KINDS)
def test_setitem_writes_parameter(rng, kind):
    shape = (7, 5)
    w = _param(kind, shape, torch.float32, True, _src(seeded(rng), shape, False))
    ref = w.dequantize().clone()
    si = w._scale_inv.clone()
    lim = _lim(w)
    col = dev((torch.rand(7, generator=seeded(rng)) - 0.5) * lim)
    blk = dev((torch.rand(2, 3, generator=seeded(rng)) - 0.5) * lim)

    def set_row(t):
        t[1] = 0.25 * lim

    def set_col(t):
        t[:, 3] = col

    def set_block(t):
        t[4:6, ::2] = blk

    def set_element(t):
        t[-1, -1] = -0.5 * lim

    def iadd_rows(t):  # (rows 2 and 3 scaled first: their sum stays in range)
        t[2:4] *= 0.5
        t[2] += t[3]

    for step in (set_row, set_col, set_block, set_element, iadd_rows):
        with torch.no_grad():
            step(w)
            step(ref)
        ref = _check_partial_write(w, ref, si)


# views covering the whole parameter: a whole write, cast with the parameter's quantizer
WHOLE = {
    "t": lambda w: w.t(),
    "T": lambda w: w.T,
    "full_slice": lambda w: w[:],
    "flatten": lambda w: w.view(-1),
    "unsqueeze": lambda w: w.unsqueeze(0),
    "split_one": lambda w: w.split(w.shape[0])[0],
}


@pytest.mark.parametrize("view", list(WHOLE))
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("structured", [False, True])
def test_write_through_whole_view(rng, view, kind, structured):
    shape = (7, 10)
    w = _param(kind, shape, torch.float32, True, _src(seeded(rng), shape, structured))
    ref = w.dequantize().clone()
    x = dev(torch.randn(shape, generator=seeded(rng)))
    q = w._quantizer
    # each in-place op is a write of its own (cast after it); the second goes beyond the old range:
    # the scale follows (current scaling)
    for op in (lambda v: v.mul_(2.0), lambda v: v.add_(WHOLE[view](x))):
        with torch.no_grad():
            op(WHOLE[view](w))
            op(WHOLE[view](ref))
        d, _, si = q(ref.contiguous(), False)  # the cast a write to the parameter makes
        assert torch.equal(w._scale_inv, si)
        assert torch.equal(w._data, d)
        _check_consistent(w)
        if kind == "current":  # the new value is held without clipping
            assert float(w._scale_inv) * 448.0 >= float(ref.abs().max()) * (1 - 1e-6)
        ref = w.detach().dequantize().clone()


@pytest.mark.parametrize("kind", KINDS)
def test_reads_through_views(rng, kind):
    shape = (9, 7)
    w = _param(kind, shape, torch.float32, True, _src(seeded(rng), shape, bool(rng.integers(2))))
    ref = w.dequantize().clone()
    views = dict(VIEWS, **WHOLE)
    views.update({"expand": lambda t: t[1:2].expand(3, 7), "unfold": lambda t: t.unfold(0, 2, 3),
                  "permute": lambda t: t.permute(1, 0), "squeeze": lambda t: t[1:2].squeeze(0),
                  "reshape3d": lambda t: t.reshape(3, 3, 7), "movedim": lambda t: t.movedim(0, 1)})
    for name, fn in views.items():
        v, rv = fn(w), fn(ref)
        assert isinstance(v, Float8Tensor), name
        assert tuple(v.shape) == tuple(rv.shape) and v.stride() == rv.stride(), name
        assert torch.equal(v.dequantize(), rv), name
        assert torch.equal(v.float(), rv.float()), name
        assert torch.equal(v * 2 + 1, rv * 2 + 1), name
        assert torch.equal(v.sum(), rv.contiguous().sum()), name
        c = v.clone()
        assert isinstance(c, Float8Tensor) and c._data.is_contiguous() and torch.equal(c.dequantize(), rv), name
    # reads through views of views, lists of views
    for a, b in zip(w.split([2, 3, 4]), ref.split([2, 3, 4])):
        assert torch.equal(a.t()[1:].dequantize(), b.t()[1:])


def test_views_of_view_without_transpose_view():
    """A flattening view has no strided transpose: a write through it (and through its own views)
    re-derives the parameter's transpose."""
    w = _param("current", (6, 5), torch.float32, True, _src(None, (6, 5), True))
    ref = w.dequantize().clone()
    si = w._scale_inv.clone()
    with torch.no_grad():
        for t in (w, ref):
            f = t.view(-1)
            f[7:13].fill_(0.1 * _lim(w))
            f.view(3, 10)[1, 2:].mul_(0.5)
            t.as_strided((3,), (6,), 2).zero_()  # a diagonal-like pattern
    _check_partial_write(w, ref, si)


@pytest.mark.parametrize("kind", KINDS)
def test_partial_write_beyond_range_raises(rng, kind):
    w = _param(kind, (6, 5), torch.float32, True, _src(seeded(rng), (6, 5), False))
    before = (w._data.clone(), w._transpose.clone(), w._scale_inv.clone())
    with torch.no_grad():
        with pytest.raises(ValueError, match="existing scale"):
            w[1:3].fill_(2.5 * _lim(w))
        with pytest.raises(ValueError, match="existing scale"):
            w[:, 0].copy_(torch.full((6,), -3 * _lim(w)))
        with pytest.raises(ValueError, match="existing scale"):
            w[0, 0] = float("inf")
    assert torch.equal(w._data, before[0]) and torch.equal(w._transpose, before[1])
    assert torch.equal(w._scale_inv, before[2])
    # just beyond the largest value, but rounding to it (E4M3: up to 464 / 448 of it): written
    ref = w.dequantize().clone()
    with torch.no_grad():
        for t in (w, ref):
            t[2, 1:3] = 1.03 * _lim(w)
            t[3, 0] = -1.03 * _lim(w)
    ref = _check_partial_write(w, ref, before[2])
    assert float(w.detach()[2, 1]) == pytest.approx(_lim(w), rel=1e-6)


def test_unsupported_view_writes_raise():
    w = _param("current", (6, 5), torch.float32, True, _src(None, (6, 5), True))
    before = (w._data.clone(), w._transpose.clone(), w._scale_inv.clone())
    with torch.no_grad():
        with pytest.raises(NotImplementedError, match="view\\(dtype\\)"):
            w.view(torch.int32)
        with pytest.raises(RuntimeError, match="changing the shape"):
            w.t_()
        with pytest.raises(RuntimeError, match="changing the shape"):
            w[1:3].unsqueeze_(0)
        with pytest.raises(RuntimeError):  # several elements on one byte
            w[1:2].expand(4, 5).fill_(0.0)
    assert torch.equal(w._data, before[0]) and torch.equal(w._transpose, before[1])
    assert torch.equal(w._scale_inv, before[2])
    # a view of a leaf that requires grad: autograd refuses the in-place op outside no_grad
    with pytest.raises(RuntimeError, match="leaf"):
        w[0].zero_()


def test_copies_of_views_are_independent():
    w = _param("current", (6, 5), torch.float32, True, _src(None, (6, 5), True))
    ref = w.dequantize().clone()
    v = w[1:4, 1:]
    for c in (v.clone(), copy.deepcopy(v), pickle.loads(pickle.dumps(v)), v.t().contiguous()):
        assert isinstance(c, Float8Tensor) and c._data.untyped_storage().data_ptr() != \
            w._data.untyped_storage().data_ptr()
        want = ref[1:4, 1:] if c.shape == v.shape else ref[1:4, 1:].t()
        assert torch.equal(c.dequantize(), want)
        with torch.no_grad():
            c.zero_()
    assert torch.equal(w.dequantize(), ref)
    buf = io.BytesIO()
    torch.save({"row": w[2], "blk": v}, buf)
    got = torch.load(io.BytesIO(buf.getvalue()))
    assert torch.equal(got["row"].dequantize(), ref[2]) and torch.equal(got["blk"].dequantize(), ref[1:4, 1:])


def test_fp8_operand_whole_and_view():
    w = _param("current", (6, 16), torch.float32, True, _src(None, (6, 16), True))
    fmt = w.fp8_dtype
    d, t, si = w.fp8_operand(fmt, True)
    assert d is w._data and t is w._transpose and si is w._scale_inv  # the parameter's own bytes
    with torch.no_grad():
        w[2:4, 3:9].mul_(0.5)
    d, t, si = w.fp8_operand(fmt, True)
    assert d is w._data and t is w._transpose
    for v, rd in ((w[1:5], w._data[1:5]), (w[:, 4:12], w._data[:, 4:12]), (w.t(), w._data.t())):
        d, t, si = v.fp8_operand(fmt, True)
        assert d.is_contiguous() and t.is_contiguous() and si is w._scale_inv
        assert torch.equal(d, rd) and torch.equal(t, rd.t())
    with pytest.raises(ValueError, match="2-D"):
        w[0].fp8_operand(fmt, True)


def test_view_grad_flows_to_parameter():
    w = _param("current", (4, 3), torch.float32, True, _src(None, (4, 3), True))
    (w[1] * 2).sum().backward()
    want = torch.zeros(4, 3)
    want[1] = 2
    assert torch.equal(w.grad.cpu(), want)


@pytest.mark.parametrize("kind", KINDS)
def test_module_forward_backward_after_view_writes(rng, kind):
    """After writes through views, the FP8 GEMMs read the new bytes: zeroed rows of the weight give
    the bias in the forward, zeroed columns give zero input gradient (the dgrad GEMM reads the
    transpose)."""
    rec = recipe.DelayedScaling(amax_history_len=4) if kind == "delayed" else recipe.Float8CurrentScaling()
    with te.fp8_model_init(enabled=True, recipe=rec):
        m = te.Linear(32, 48, device=DEVICE)
        ms = te.Linear(32, 48, parameters_split=("a", "b"), device=DEVICE)
    with torch.no_grad():
        m.weight[5:9].zero_()
        m.weight[:, 3:7].zero_()
        m.weight.t()[20].zero_()
        ms.b_weight[1].zero_()
    _check_consistent(m.weight)
    x = dev(torch.randn(16, 32, generator=seeded(rng))).requires_grad_()
    with te.fp8_autocast(enabled=True, fp8_recipe=rec):
        y = m(x)
        ys = ms(x)
    assert torch.equal(y[:, 5:9], m.bias[5:9].expand(16, 4).to(y.dtype))
    assert torch.equal(ys[:, 25], ms.b_bias[1].expand(16).to(ys.dtype))
    y.backward(dev(torch.randn(16, 48, generator=seeded(rng))))
    assert bool((x.grad[:, 3:7] == 0).all()) and bool((x.grad[:, 20] == 0).all())
    assert bool((x.grad[:, 8:20] != 0).any())
