"""nvte_attn_softmax_backward on the CPU backend against float64 (attn_softmax_case.py): its three
outputs (scores', logits' and sink gradients), the forward's mask type, aliasing, and agreement
with finite differences of the forward."""
import numpy as np
import pytest

from attn_softmax_case import (DTYPES, MASK, T, attn_softmax_backward_ref, attn_softmax_ref, causal_hidden, mask_for,
                               offset_for, randn)
from util import TOLERANCE, assert_close, poisoned, to_np
from transformer_engine import _nvte as nvte

# ------------------------------------------------------------ backward


def backward_case(rng, shape, dtype, with_mask, with_sink, mask_type="no_mask", bcast="B1"):
    """(dy, y, mask, sink): y and sink from the float64 forward (y in dtype, sink float32)."""
    b, h, sq, sk = shape
    x = rng.normal(0.0, 2.0, shape)
    mask = mask_for(rng, b, h, sq, sk, bcast, 0.3) if with_mask else None
    offset = offset_for(rng, h) if with_sink else None
    y, sink = attn_softmax_ref(x, 1.0, mask=mask, mask_type=mask_type, offset=offset)
    y = to_np(y, dtype)
    sink = None if sink is None else sink.astype(np.float32)
    dy = randn(rng, shape, dtype, 1.0)
    return dy, y, mask, sink


def bwd_atol(dtype, dy, y, scale):
    dy, y = np.asarray(dy, np.float64), np.asarray(y, np.float64)
    mult = np.abs(scale * y) * (np.abs(dy) + np.abs(dy * y).sum(axis=-1, keepdims=True))
    return TOLERANCE[dtype][0] + 2.0**-18 * mult


@pytest.mark.parametrize("out_dtype", ["same", "float32"])
@pytest.mark.parametrize("variant", ["plain", "mask", "sink", "mask+sink"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_backward(dtype, variant, out_dtype, rng):
    """output_grads = scale * g, logit_grads = g, offset_grads = -sink * d against float64, g = 0
    where the explicit mask hides (wholly hidden rows: zero gradient), causal rows without keys."""
    od = dtype if out_dtype == "same" else out_dtype
    ld = "float32" if out_dtype == "same" else dtype  # logit_grads: float32, or 16-bit
    for shape, mask_type, bcast in [((2, 3, 5, 7), "no_mask", "B1"), ((1, 1, 3, 1), "no_mask", "11"),
                                    ((2, 3, 4, 33), "causal", "1H"), ((1, 3, 6, 130), "bottom_right", "BH"),
                                    ((2, 1, 5, 3), "bottom_right", "BH")]:
        dy, y, mask, sink = backward_case(rng, shape, dtype, "mask" in variant, "sink" in variant, mask_type,
                                          bcast)
        scale = 0.125
        dx = poisoned(shape, od)
        dl = poisoned(shape, ld)
        doff = poisoned(shape[:3], "float32") if sink is not None else None
        nvte.attn_softmax_backward(T(dy), T(y), T(mask), T(sink), T(dx), T(dl), T(doff), scale)
        rdx, rg, rdoff = attn_softmax_backward_ref(dy, y, scale, mask, sink)
        assert_close(dx, rdx, od, atol=bwd_atol(od, dy, y, scale))
        assert_close(dl, rg, ld, atol=bwd_atol(ld, dy, y, 1.0))
        if sink is not None:
            d_mult = np.abs(np.asarray(dy, np.float64) * np.asarray(y, np.float64)).sum(axis=-1)
            assert_close(doff, rdoff, "float32", atol=1e-6 + 2.0**-18 * np.abs(sink) * d_mult)
        if mask is not None:
            hid = np.broadcast_to(mask.astype(bool), shape)
            assert np.all(np.asarray(dx, np.float64)[hid] == 0.0)
            assert np.all(np.asarray(dl, np.float64)[hid] == 0.0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_optional_outputs(dtype, rng):
    """logit_grads and offset_grads are optional (null): output_grads alone is the same."""
    dy, y, mask, sink = backward_case(rng, (2, 3, 4, 9), dtype, True, True)
    full = poisoned(y.shape, dtype)
    dl, doff = poisoned(y.shape, "float32"), poisoned(y.shape[:3], "float32")
    nvte.attn_softmax_backward(T(dy), T(y), T(mask), T(sink), T(full), T(dl), T(doff), 0.5)
    alone = poisoned(y.shape, dtype)
    nvte.attn_softmax_backward(T(dy), T(y), T(mask), None, T(alone), None, None, 0.5)
    rdx, _, _ = attn_softmax_backward_ref(dy, y, 0.5, mask, sink)
    assert_close(full, rdx, dtype, atol=bwd_atol(dtype, dy, y, 0.5))
    assert np.array_equal(full.view(np.uint8), alone.view(np.uint8))


@pytest.mark.parametrize("mask_type", ["causal", "bottom_right"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_mask_type(mask_type, dtype, rng):
    """With the forward's mask type the backward leaves the hidden keys unread: NaN there in y and
    dy still gives zero gradients there and the reference elsewhere (Sq > Sk: rows without keys)."""
    for sq, sk in [(5, 9), (6, 4), (7, 7)]:
        x = rng.standard_normal((2, 3, sq, sk)) * 2
        hidden = np.broadcast_to(causal_hidden(sq, sk, mask_type), x.shape)
        y = to_np(attn_softmax_ref(x, 0.5, mask_type=mask_type)[0], dtype)
        dy = to_np(rng.standard_normal(x.shape), dtype)
        ref = attn_softmax_backward_ref(dy, y, 0.5)
        y[hidden] = np.nan
        dy[hidden] = np.nan
        dx = poisoned(x.shape, dtype)
        dl = poisoned(x.shape, "float32")
        nvte.attn_softmax_backward(T(dy), T(y), None, None, T(dx), T(dl), None, 0.5, MASK[mask_type])
        assert np.all(np.asarray(dx, np.float64)[hidden] == 0) and np.all(np.asarray(dl)[hidden] == 0)
        assert_close(np.where(hidden, 0.0, np.asarray(dx, np.float64)), ref[0], dtype)
        assert_close(dl, ref[1], "float32", rtol=2.0**-18)


@pytest.mark.parametrize("alias", ["incoming_grads", "softmax_results"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_in_place(dtype, alias, rng):
    """output_grads aliasing incoming_grads or softmax_results (same dtype), with the other outputs."""
    for shape in [(2, 3, 5, 7), (1, 2, 3, 130)]:
        dy, y, mask, sink = backward_case(rng, shape, dtype, True, True, "causal")
        rdx, rg, rdoff = attn_softmax_backward_ref(dy, y, 0.25, mask, sink)
        atol, atol_g = bwd_atol(dtype, dy, y, 0.25), bwd_atol("float32", dy, y, 1.0)
        d_mult = np.abs(np.asarray(dy, np.float64) * np.asarray(y, np.float64)).sum(axis=-1)
        atol_off = 1e-6 + 2.0**-18 * np.abs(sink) * d_mult
        dl = poisoned(shape, "float32")
        doff = poisoned(shape[:3], "float32")
        t = T(dy) if alias == "incoming_grads" else T(y)
        tdy = t if alias == "incoming_grads" else T(dy)
        ty = t if alias == "softmax_results" else T(y)
        nvte.attn_softmax_backward(tdy, ty, T(mask), T(sink), t, T(dl), T(doff), 0.25)
        assert_close(dy if alias == "incoming_grads" else y, rdx, dtype, atol=atol)
        assert_close(dl, rg, "float32", atol=atol_g)
        assert_close(doff, rdoff, "float32", atol=atol_off)


def test_backward_matches_forward_differences(rng):
    """The backward is the gradient of the forward: central differences of L = sum(w * y) in float64
    over the reference forward (causal, explicit mask, sink) match the float64 backward formula
    with dy = w, for x (output_grads) and for the offset (offset_grads summed over b and i); this
    checks the reference itself, and the op agrees."""
    shape = (1, 2, 3, 5)
    x = rng.normal(0.0, 1.0, shape)
    mask = np.zeros((1, 1, 3, 5), np.uint8)
    mask[0, 0, 1, 0] = 1
    mask[0, 0, 2, :] = 1  # row 2: every key hidden (its gradient is 0)
    offset = np.array([0.5, -1.0])
    w = rng.normal(0.0, 1.0, shape)
    scale = 0.7

    def loss(xx, off):
        return (w * attn_softmax_ref(xx, scale, mask=mask, mask_type="causal", offset=off)[0]).sum()

    eps = 1e-6
    num = np.zeros(shape)
    for idx in np.ndindex(shape):
        xp, xm = x.copy(), x.copy()
        xp[idx] += eps
        xm[idx] -= eps
        num[idx] = (loss(xp, offset) - loss(xm, offset)) / (2 * eps)
    num_off = np.zeros(2)
    for hh in range(2):
        op, om = offset.copy(), offset.copy()
        op[hh] += eps
        om[hh] -= eps
        num_off[hh] = (loss(x, op) - loss(x, om)) / (2 * eps)
    y, sink = attn_softmax_ref(x, scale, mask=mask, mask_type="causal", offset=offset)
    rdx, _, rdoff = attn_softmax_backward_ref(w, y, scale, mask, sink)
    np.testing.assert_allclose(rdx, num, atol=1e-7)
    np.testing.assert_allclose(rdoff.sum(axis=(0, 2)), num_off, atol=1e-7)
    dx = poisoned(shape, "float32")
    doff = poisoned(shape[:3], "float32")
    w32, y32, s32 = w.astype(np.float32), y.astype(np.float32), sink.astype(np.float32)
    nvte.attn_softmax_backward(T(w32), T(y32), T(mask), T(s32), T(dx), None, T(doff), scale)
    np.testing.assert_allclose(dx, num, atol=2e-6)
    np.testing.assert_allclose(doff.sum(axis=(0, 2)), num_off, atol=2e-6)
    assert np.all(dx[0, :, 2] == 0.0)
