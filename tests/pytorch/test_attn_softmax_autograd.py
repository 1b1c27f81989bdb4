"""transformer_engine.pytorch.attn_softmax (the autograd wiring of nvte_attn_softmax_*): the
probabilities and the gradients of the scores, of a pre/post-scale bias broadcast over batch or
heads (the library's score / logit gradients summed over the broadcast dims) and of the sink
logits (the per-row terms summed over batch and queries), against float64 torch autograd; ALiBi
with a causal rule; the op traced by torch.compile without graph breaks; mask shape errors.
The library's own rules (every mask, dtype, size) are tested in tests/core/test_attn_softmax*.py."""
import pytest
import torch

from transformer_engine.pytorch import custom_ops
from transformer_engine.pytorch.attn_softmax import attn_softmax

from _util import dev, rel_err, seeded

B, H, SQ, SK = 2, 3, 5, 7
SCALE = 0.3


def ref(x, bias_type, bias, offset, hidden, slopes=None, causal=False):
    """float64 autograd reference: logits, -10000 fill where hidden, the sink column; a row whose
    kept keys are all hidden has none (zeros, TE's kernel rule; the sink takes it)."""
    z = SCALE * x
    if bias_type == "pre_scale_bias":
        z = SCALE * (x + bias)
    elif bias_type == "post_scale_bias":
        z = z + bias
    elif bias_type == "alibi":
        i = torch.arange(SQ, dtype=torch.float64).view(SQ, 1)
        j = torch.arange(SK, dtype=torch.float64).view(1, SK)
        z = z - slopes.view(1, H, 1, 1) * (i - j).abs()
    whole = None
    if hidden is not None:
        z = z.masked_fill(hidden, -10000.0)
        gone = hidden | torch.ones(SQ, SK, dtype=torch.bool).triu(1) if causal else hidden
        whole = gone.expand(B, H, SQ, SK).all(-1, keepdim=True)
    if causal:
        z = z.masked_fill(torch.ones(SQ, SK, dtype=torch.bool).triu(1), float("-inf"))
    if offset is None:
        y = torch.softmax(z, -1)
    else:
        col = offset.view(1, H, 1, 1).expand(B, H, SQ, 1)
        y = torch.softmax(torch.cat([z, col], -1), -1)[..., :-1]
    return y if whole is None else torch.where(whole, torch.zeros_like(y), y)


def leaf(t):
    return t.detach().clone().requires_grad_(True)


@pytest.mark.parametrize("bias_type", ["pre_scale_bias", "post_scale_bias"])
@pytest.mark.parametrize("bias_shape", [(1, H, SQ, SK), (B, 1, SQ, SK), (H, SQ, SK), (B, H, SQ, SK)])
@pytest.mark.parametrize("sink", [False, True])
def test_gradients(bias_type, bias_shape, sink, rng):
    g = seeded(rng)
    x = torch.randn(B, H, SQ, SK, generator=g, dtype=torch.float64) * 2
    bias = torch.randn(*bias_shape, generator=g, dtype=torch.float64)
    offset = torch.randn(H, generator=g, dtype=torch.float64) if sink else None
    hidden = torch.rand(B, 1, SQ, SK, generator=g) < 0.3
    hidden[0, 0, 1] = True  # one row hidden wholly: uniform, zero gradient
    dy = torch.randn(B, H, SQ, SK, generator=g, dtype=torch.float64)

    xs, bs = leaf(x.float()), leaf(bias.float())
    os_ = leaf(offset.float()) if sink else None
    y = attn_softmax(dev(xs), SCALE, bias_type, dev(bs), mask=dev(hidden), offset=dev(os_) if sink else None)
    y.backward(dev(dy.float()))

    xr, br = leaf(x), leaf(bias)
    orf = leaf(offset) if sink else None
    br4 = br if br.dim() == 4 else br.unsqueeze(0)
    yr = ref(xr, bias_type, br4, orf, hidden)
    yr.backward(dy)
    assert rel_err(y, yr) < 1e-5
    assert rel_err(xs.grad, xr.grad) < 1e-5
    assert bs.grad.shape == bias.shape and rel_err(bs.grad, br.grad) < 1e-5
    if sink:
        assert rel_err(os_.grad, orf.grad) < 1e-5
    assert torch.all(xs.grad[0, :, 1] == 0)  # the wholly hidden row


def test_alibi_causal_and_bf16_bias(rng):
    """ALiBi ([h] slopes, diagonal 0) with the causal rule; a bf16 bias gets a bf16 gradient."""
    g = seeded(rng)
    x = torch.randn(B, H, SQ, SK, generator=g, dtype=torch.float64)
    slopes = torch.rand(H, generator=g, dtype=torch.float64)
    xs = leaf(x.float())
    y = attn_softmax(dev(xs), SCALE, "alibi", alibi_slopes=dev(slopes.float()),
                     alibi_diagonal=dev(torch.zeros(1, dtype=torch.int64)), causal="causal")
    dy = torch.randn(B, H, SQ, SK, generator=g, dtype=torch.float64)
    y.backward(dev(dy.float()))
    xr = leaf(x)
    yr = ref(xr, "alibi", None, None, None, slopes=slopes, causal=True)
    yr.backward(dy)
    assert rel_err(y, yr) < 1e-5 and rel_err(xs.grad, xr.grad) < 1e-5

    bias = leaf(torch.randn(1, H, SQ, SK, generator=g).bfloat16())
    attn_softmax(dev(leaf(x.float())), SCALE, "post_scale_bias", dev(bias)).sum().backward()
    assert bias.grad.dtype == torch.bfloat16


def test_torch_compile_fullgraph(rng):
    """The registered ops let dynamo trace forward and backward in one graph, with the eager results."""
    torch._dynamo.reset()
    g = seeded(rng)
    x = torch.randn(B, H, SQ, SK, generator=g)
    bias = torch.randn(1, H, SQ, SK, generator=g)
    offset = torch.randn(H, generator=g)

    def f(x, bias, offset):
        return attn_softmax(x, SCALE, "post_scale_bias", bias, offset=offset, causal="causal_bottom_right")

    outs = []
    for fn in (f, torch.compile(f, fullgraph=True, backend="aot_eager")):
        xs, bs, os_ = leaf(x), leaf(bias), leaf(offset)
        y = fn(dev(xs), dev(bs), dev(os_))
        (y * torch.arange(SK, device=y.device)).sum().backward()
        outs.append((y.cpu(), xs.grad, bs.grad, os_.grad))
    torch._dynamo.reset()
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def test_empty_tensors_with_mixed_dtypes():
    """Empty scores (torch gives every empty tensor the same null address): the float32-probability
    path of a learnable sink and a post-scale bias's logit gradients are not taken for aliases."""
    x = dev(torch.zeros(2, H, 0, SK, dtype=torch.bfloat16)).requires_grad_(True)
    off = dev(torch.zeros(H)).requires_grad_(True)
    bias = dev(torch.zeros(1, H, 0, SK, dtype=torch.bfloat16)).requires_grad_(True)
    y = attn_softmax(x, SCALE, "post_scale_bias", bias, offset=off)
    assert y.shape == x.shape and y.dtype == torch.bfloat16
    y.sum().backward()
    assert x.grad.shape == x.shape and bias.grad.shape == bias.shape and torch.all(off.grad == 0)


def test_float64_bias(rng):
    """A float64 bias runs (the library takes it as float32) and gets a float64 gradient."""
    g = seeded(rng)
    x = torch.randn(4, H, SQ, SK, generator=g, dtype=torch.float64)
    bias = torch.randn(1, H, SQ, SK, generator=g, dtype=torch.float64)
    dy = torch.randn(4, H, SQ, SK, generator=g, dtype=torch.float64)
    b64 = leaf(bias)
    attn_softmax(dev(leaf(x.float())), SCALE, "post_scale_bias", dev(b64)).backward(dev(dy.float()))
    br = leaf(bias)
    ref(leaf(x), "post_scale_bias", br, None, None).backward(dy)
    assert b64.grad.dtype == torch.float64 and rel_err(b64.grad, br.grad) < 1e-5


def test_sink_probabilities_exact_only_when_training_the_sink():
    """A learnable sink keeps float32 probabilities for its gradient only when one will be taken."""
    x = dev(torch.randn(B, H, SQ, SK).bfloat16())
    off = dev(torch.zeros(H)).requires_grad_(True)
    seen = []
    real = custom_ops.attn_softmax_forward

    def spy(*a):
        seen.append(a[-1])
        return real(*a)
    custom_ops.attn_softmax_forward = spy
    try:
        attn_softmax(x, SCALE, offset=off)
        with torch.no_grad():
            attn_softmax(x, SCALE, offset=off)
        attn_softmax(x, SCALE, offset=off.detach())
    finally:
        custom_ops.attn_softmax_forward = real
    assert seen == [torch.float32, torch.bfloat16, torch.bfloat16]


def test_mask_errors():
    x = dev(torch.randn(B, H, SQ, SK))
    with pytest.raises(ValueError, match="must be 4D"):
        attn_softmax(x, SCALE, mask=dev(torch.zeros(SQ, SK, dtype=torch.bool)))
    with pytest.raises(ValueError, match="does not broadcast"):
        attn_softmax(x, SCALE, mask=dev(torch.zeros(B, 2, SQ, SK, dtype=torch.bool)))
    with pytest.raises(ValueError, match="unknown core_attention_bias_type"):
        attn_softmax(x, SCALE, "bias")
