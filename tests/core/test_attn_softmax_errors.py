"""Misuse of nvte_attn_softmax_forward / _backward: every invalid operand raises nvte.Error with a
message naming it, and the process survives."""
import numpy as np
import pytest

from attn_softmax_case import BIAS, BT, MT
from transformer_engine import _nvte as nvte

# ------------------------------------------------------------ misuse


def f32(*shape):
    return nvte.Tensor(np.zeros(shape, np.float32))


def arr(dtype, *shape):
    return nvte.Tensor(np.zeros(shape, dtype))


def u8(*shape):
    return arr(np.uint8, *shape)


def i64(*shape):
    return arr(np.int64, *shape)


def fwd(inp=None, bias=None, slopes=None, diag=None, mask=None, offset=None, out=None, sink=None,
        bias_type="no_bias", mask_type=MT.NVTE_NO_MASK):
    """A forward on [2, 3, 4, 5] unless overridden (mask_type: an NVTE_Mask_Type)."""
    inp = f32(2, 3, 4, 5) if inp is None else inp
    out = f32(2, 3, 4, 5) if out is None else out
    return nvte.attn_softmax_forward(inp, bias, slopes, diag, mask, offset, out, sink, 1.0,
                                     BIAS[bias_type], mask_type)


def bwd(dy=None, y=None, mask=None, sink=None, dx=None, dl=None, doff=None):
    dy = f32(2, 3, 4, 5) if dy is None else dy
    y = f32(2, 3, 4, 5) if y is None else y
    dx = f32(2, 3, 4, 5) if dx is None else dx
    return nvte.attn_softmax_backward(dy, y, mask, sink, dx, dl, doff, 1.0)


@pytest.mark.parametrize("call, match", [
    # bias
    (lambda: fwd(bias=f32(2, 3, 4, 6), bias_type="post"), r"bias has shape \[2, 3, 4, 6\]"),
    (lambda: fwd(bias=f32(3, 1, 4, 5), bias_type="pre"), r"bias has shape \[3, 1, 4, 5\]"),
    (lambda: fwd(bias=f32(3, 4, 5), bias_type="pre"), r"bias has shape \[3, 4, 5\]"),
    (lambda: fwd(bias=f32(2, 3, 4, 5)), r"bias"),  # bias with NVTE_NO_BIAS
    (lambda: fwd(bias_type="pre"), r"bias"),  # pre-scale bias missing
    (lambda: fwd(bias=arr(np.int32, 1, 1, 4, 5), bias_type="post"), r"bias.*int32"),
    # ALiBi
    (lambda: fwd(bias_type="alibi"), r"alibi_diagonal"),
    (lambda: fwd(diag=arr(np.int32, 1), bias_type="alibi"), r"alibi_diagonal.*int"),
    (lambda: fwd(diag=i64(3), bias_type="alibi"), r"alibi_diagonal has shape \[3\]"),
    (lambda: fwd(slopes=f32(4), diag=i64(1), bias_type="alibi"), r"alibi_slopes has shape \[4\]"),
    (lambda: fwd(slopes=f32(3, 3), diag=i64(1), bias_type="alibi"), r"alibi_slopes has shape \[3, 3\]"),
    (lambda: fwd(slopes=f32(2, 3, 1), diag=i64(1), bias_type="alibi"), r"alibi_slopes has shape \[2, 3, 1\]"),
    (lambda: fwd(slopes=arr(np.float16, 3), diag=i64(1), bias_type="alibi"), r"alibi_slopes.*float"),
    (lambda: fwd(bias=f32(2, 3, 4, 5), slopes=f32(3), bias_type="post"), r"alibi"),  # ALiBi only
    # explicit mask
    (lambda: fwd(mask=u8(2, 3, 4, 6)), r"mask has shape \[2, 3, 4, 6\]"),
    (lambda: fwd(mask=u8(3, 1, 4, 5)), r"mask has shape \[3, 1, 4, 5\]"),
    (lambda: fwd(mask=u8(2, 2, 4, 5)), r"mask has shape \[2, 2, 4, 5\]"),
    (lambda: fwd(mask=u8(4, 5)), r"mask has shape \[4, 5\]"),
    (lambda: fwd(mask=f32(2, 1, 4, 5)), r"mask.*uint8"),
    # sink
    (lambda: fwd(offset=f32(4)), r"softmax_offset has shape \[4\]"),
    (lambda: fwd(offset=arr(np.float16, 3)), r"softmax_offset.*float"),
    (lambda: fwd(sink=f32(2, 3, 4)), r"sink_probs"),  # sink_probs without softmax_offset
    (lambda: fwd(offset=f32(3), sink=f32(2, 3, 5)), r"sink_probs has shape \[2, 3, 5\]"),
    (lambda: fwd(offset=f32(3), sink=arr(np.float16, 2, 3, 4)), r"sink_probs.*float"),
    # mask types
    (lambda: fwd(mask_type=MT.NVTE_PADDING_MASK), r"(?i)mask.?type|PADDING"),
    (lambda: fwd(mask_type=MT.NVTE_PADDING_CAUSAL_MASK), r"(?i)mask.?type|PADDING"),
    (lambda: fwd(mask_type=MT.NVTE_ARBITRARY_MASK), r"(?i)mask.?type|ARBITRARY"),
    # input / output
    (lambda: fwd(inp=f32(3, 4, 5), out=f32(3, 4, 5)), r"input has shape \[3, 4, 5\]"),
    (lambda: fwd(inp=arr(np.int32, 2, 3, 4, 5)), r"input must be float32, float16 or bfloat16, got int32"),
    (lambda: fwd(out=f32(2, 3, 4, 6)), r"softmax_results has shape \[2, 3, 4, 6\]"),
    (lambda: fwd(out=arr(np.float16, 2, 3, 4, 5)), r"softmax_results"),  # dtype must be input's
    (lambda: fwd(out=nvte.Tensor()), r"softmax_results"),  # no data
    (lambda: bwd(dx=nvte.Tensor()), r"output_grads"),
    # backward
    (lambda: bwd(doff=f32(2, 3, 4)), r"offset_grads|sink_probs"),  # offset_grads without sink_probs
    (lambda: bwd(sink=f32(2, 3, 4), doff=f32(2, 3, 5)), r"offset_grads has shape \[2, 3, 5\]"),
    (lambda: bwd(sink=f32(2, 4, 3), doff=f32(2, 3, 4)), r"sink_probs has shape \[2, 4, 3\]"),
    (lambda: bwd(dy=f32(2, 3, 4, 6)), r"incoming_grads has shape \[2, 3, 4, 6\]"),
    (lambda: bwd(dx=f32(2, 3, 5, 4)), r"output_grads has shape \[2, 3, 5, 4\]"),
    (lambda: bwd(dl=f32(2, 3, 4, 6)), r"logit_grads has shape \[2, 3, 4, 6\]"),
    (lambda: bwd(mask=u8(2, 3, 4, 6)), r"mask has shape \[2, 3, 4, 6\]"),
    (lambda: bwd(dy=f32(3, 4, 5), y=f32(3, 4, 5), dx=f32(3, 4, 5)), r"has shape \[3, 4, 5\]"),
    (lambda: bwd(dx=arr(np.int32, 2, 3, 4, 5)), r"output_grads must be float32, float16 or bfloat16"),
])
def test_errors(call, match):
    with pytest.raises(nvte.Error, match=match):
        call()
    # The process survives and a valid call still works.
    y = np.zeros((1, 1, 1, 2), np.float32)
    nvte.attn_softmax_forward(f32(1, 1, 1, 2), None, None, None, None, None, nvte.Tensor(y), None, 1.0,
                              BT.NVTE_NO_BIAS, MT.NVTE_NO_MASK)
    assert y.tolist() == [[[[0.5, 0.5]]]]


def test_scale_must_be_finite():
    """A NaN scale had given all-zero rows (looking fully masked), an infinite one NaNs."""
    for scale in (float("nan"), float("inf"), -float("inf")):
        y = np.full((1, 1, 2, 3), 7.0, np.float32)
        with pytest.raises(nvte.Error, match="scale must be finite"):
            nvte.attn_softmax_forward(f32(1, 1, 2, 3), None, None, None, None, None, nvte.Tensor(y), None, scale,
                                      BT.NVTE_NO_BIAS, MT.NVTE_NO_MASK)
        assert (y == 7.0).all()
        with pytest.raises(nvte.Error, match="scale must be finite"):
            nvte.attn_softmax_backward(f32(1, 1, 2, 3), f32(1, 1, 2, 3), None, None, f32(1, 1, 2, 3), None, None,
                                       scale)


def _view(base, offset_rows, shape):
    """A float32 handle over `base` starting `offset_rows` rows of its last dim in."""
    t = nvte.Tensor()
    t.set_param(nvte.Param.kRowwiseData, base.ctypes.data + offset_rows * base.shape[-1] * 4, list(shape),
                nvte.DType.kFloat32)
    t._refs = base
    return t


def test_partial_overlap_is_refused_in_place_is_not():
    """An output starting one row into its input would read rows already overwritten; exactly in
    place stays allowed (forward and backward)."""
    base = np.random.default_rng(0).normal(size=(1, 1, 5, 4)).astype(np.float32)
    with pytest.raises(nvte.Error, match="softmax_results overlaps input without being the same buffer"):
        nvte.attn_softmax_forward(_view(base, 0, (1, 1, 4, 4)), None, None, None, None, None,
                                  _view(base, 1, (1, 1, 4, 4)), None, 1.0, BT.NVTE_NO_BIAS, MT.NVTE_NO_MASK)
    y = np.random.default_rng(1).random((1, 1, 4, 4)).astype(np.float32)
    with pytest.raises(nvte.Error, match="output_grads overlaps incoming_grads without being the same buffer"):
        nvte.attn_softmax_backward(_view(base, 0, (1, 1, 4, 4)), nvte.Tensor(y), None, None,
                                   _view(base, 1, (1, 1, 4, 4)), None, None, 1.0)
    x = base[:, :, :4].copy()
    want = np.exp(x - x.max(-1, keepdims=True))
    want /= want.sum(-1, keepdims=True)
    t = nvte.Tensor(x)
    nvte.attn_softmax_forward(t, None, None, None, None, None, t, None, 1.0, BT.NVTE_NO_BIAS, MT.NVTE_NO_MASK)
    np.testing.assert_allclose(x, want, rtol=1e-6)
