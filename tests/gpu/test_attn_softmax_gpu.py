"""nvte_attn_softmax_forward / nvte_attn_softmax_backward (softmax.h) on the CUDA backend vs the
CPU backend (the oracle, itself held to float64 in tests/core/test_attn_softmax*.py) on the same
inputs: row lengths 1, 7, 128, 1000, 4097, 20000 (warp per row, block per row with the logits
staged in shared memory) and 25000 / 30001 (past the staging limit of 24576: logits rebuilt in each
pass), every bias type (pre/post-scale bias broadcast over batch and heads in each float dtype;
ALiBi with default, [H] and [B, H] slopes and diagonals [1] / [B] of either sign), the causal mask
types with rows that see nothing, explicit masks broadcast in batch and heads with wholly hidden
rows, the attention sink (softmax_offset, sink_probs, offset_grads), float32 / float16 /
bfloat16, in-place forward and backward, poisoned (NaN) outputs, buffers one element past an
aligned address, many rows (grid limits), empty tensors, host/device mixes. (An nvte tensor does
not own its buffers: every torch tensor passed in is kept in a local until the call returns.)

Tolerances: both backends compute in float32, but the device computes exp as 2^(d log2 e) on its
special-function unit (ex2.approx: a few ulp from the CPU's expf, ~5e-6 relative at worst;
results below 2^-126 flush to 0) and sums a row (sum of exp, sum of dy * y) in a different order
(tree vs sequential), a relative difference of order sqrt(Sk) float32 ulps: rtol 5e-5 on float32
results, plus one ulp of a 16-bit output dtype. The logits z = scale * x + t may also round
differently (the device contracts multiply-adds into FMAs): an absolute difference up to ~2^-23
(|scale * x| + |t|) per logit, which exp turns into a relative one of y; per element that adds
2^-22 (mag_j + mag at the row max + sum_k y_k mag_k), mag = |scale * x| + |t| over the keys in the
row (ALiBi at distance 10^4 makes it large exactly where y underflows). The backward's
cancellation (dy - d) turns the dot's error into an absolute error of ~|scale * y| * sum|dy * y| *
2e-5; offset_grads = -sink * d the same with sink for scale * y. Keys hidden by mask_type and
keys hidden by the explicit mask in the backward must be exactly 0 on the device."""
import math

import pytest
import torch

from transformer_engine import _nvte as nvte

from gpu_util import T, _explain, poisoned, sync

BT = nvte.NVTE_Bias_Type
MT = nvte.NVTE_Mask_Type
BIAS = {"no_bias": BT.NVTE_NO_BIAS, "pre": BT.NVTE_PRE_SCALE_BIAS, "post": BT.NVTE_POST_SCALE_BIAS,
        "alibi": BT.NVTE_ALIBI}
MASK = {"no_mask": MT.NVTE_NO_MASK, "causal": MT.NVTE_CAUSAL_MASK,
        "bottom_right": MT.NVTE_CAUSAL_BOTTOM_RIGHT_MASK}
HP = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
ULP = {torch.float32: 0.0, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}
FLOOR = {torch.float32: 1e-30, torch.float16: 2.0**-24, torch.bfloat16: 1e-30}  # fp16 subnormals
RTOL32 = 5e-5
SKS = [1, 7, 128, 1000, 4097, 20000]


def tt(x):
    """The nvte.Tensor over a torch tensor, or None (a null handle)."""
    return None if x is None else T(x).t


def gen(seed):
    return torch.Generator().manual_seed(seed)


def randn(shape, dtype, g, spread=3.0):
    return (torch.randn(shape, generator=g) * spread).to(dtype)


def rows_shape(sk, b=2, h=3, sq=4):
    """A [B, H, Sq, Sk] shape for row length sk, smaller for the long rows."""
    return (1, 2, 3, sk) if sk >= 4097 else (b, h, sq, sk)


def bias_of(g, shape, bcast, dtype):
    b, h, sq, sk = shape
    return randn((b if "B" in bcast else 1, h if "H" in bcast else 1, sq, sk), dtype, g, 2.0)


def mask_of(g, shape, bcast="BH", density=0.3):
    """uint8 [B or 1, H or 1, Sq, Sk]; with Sq > 1, row 0 of entry (0, 0) wholly hidden, row 1 open."""
    b, h, sq, sk = shape
    m = (torch.rand((b if "B" in bcast else 1, h if "H" in bcast else 1, sq, sk), generator=g) < density)
    m = m.to(torch.uint8)
    if sq > 1:
        m[0, 0, 0, :] = 1
        m[0, 0, 1, :] = 0
    return m


def default_slopes(h):
    n = 1
    while 2 * n <= h:
        n *= 2
    return torch.tensor([2.0 ** (-8.0 * (k + 1) / n) if k < n else 2.0 ** (-4.0 * (2 * (k - n) + 1) / n)
                         for k in range(h)], dtype=torch.float64)


# ------------------------------------------------------------ tolerance terms (host, float64)


def terms(x, scale, bias_type="no_bias", bias=None, slopes=None, diag=None, mask=None, mask_type="no_mask"):
    """s = scale * x, the additive term t, hidden (mask type) and explicit (mask), [B, H, Sq, Sk]."""
    x = x.double()
    b, h, sq, sk = x.shape
    s = scale * x
    if bias_type in ("pre", "post"):
        t = bias.double().expand(x.shape) * (scale if bias_type == "pre" else 1.0)
    elif bias_type == "alibi":
        sl = default_slopes(h)[None] if slopes is None else slopes.double().reshape(-1, h)
        sl = sl.expand(b, h)
        dg = diag.reshape(-1).expand(b)
        i = torch.arange(sq)[None, :, None]
        j = torch.arange(sk)[None, None, :]
        dist = (i + dg[:, None, None] - j).abs().double()
        t = -sl[:, :, None, None] * dist[:, None]
    else:
        t = torch.zeros(x.shape, dtype=torch.float64)
    i = torch.arange(sq)[:, None]
    j = torch.arange(sk)[None, :]
    if mask_type == "causal":
        hidden = j > i
    elif mask_type == "bottom_right":
        hidden = j > i + (sk - sq)
    else:
        hidden = torch.zeros((sq, sk), dtype=torch.bool)
    hidden = hidden.expand(x.shape)
    explicit = torch.zeros(x.shape, dtype=torch.bool) if mask is None else mask.bool().expand(x.shape)
    return s, t, hidden, explicit


def logit_rtol(x, scale, y, **kw):
    """Per-element relative difference the float32 logits allow (module docstring), and per row
    that of the sink share."""
    s, t, hidden, explicit = terms(x, scale, **kw)
    out = hidden | explicit
    mag = torch.where(out, 0.0, s.abs() + t.abs())
    if x.shape[-1] == 0:
        return mag, mag.sum(-1)
    z = torch.where(out, float("-inf"), s + t)
    star = torch.gather(mag, -1, z.argmax(-1, keepdim=True))
    avg = (y.double().cpu() * mag).sum(-1, keepdim=True)
    return 2.0**-22 * (mag + star + avg), 2.0**-22 * (star + avg)[..., 0]


def assert_fwd_close(got, ref, rel=0.0):
    g, r = got.detach().cpu().double(), ref.detach().cpu().double()
    assert g.shape == r.shape, f"{g.shape} vs {r.shape}"
    tol = (RTOL32 + ULP[ref.dtype] + rel) * r.abs() + FLOOR[ref.dtype]
    bad = ~((g - r).abs() <= tol)
    assert not bool(bad.any()), _explain(g, r, bad)


def assert_bwd_close(got, ref, dy, y, scale):
    g, r = got.detach().cpu().double(), ref.detach().cpu().double()
    assert g.shape == r.shape, f"{g.shape} vs {r.shape}"
    dy, y = dy.detach().cpu().double(), y.detach().cpu().double()
    mult = (scale * y).abs() * (dy.abs() + (dy * y).abs().sum(-1, keepdim=True))
    tol = (1e-5 + ULP[ref.dtype]) * r.abs() + 2e-5 * mult + FLOOR[ref.dtype]
    bad = ~((g - r).abs() <= tol)
    assert not bool(bad.any()), _explain(g, r, bad)


def assert_offset_grads_close(got, ref, dy, y, sink):
    g, r = got.detach().cpu().double(), ref.detach().cpu().double()
    dy, y = dy.detach().cpu().double(), y.detach().cpu().double()
    mult = sink.detach().cpu().double().abs() * (dy * y).abs().sum(-1)
    tol = 1e-5 * r.abs() + 2e-5 * mult + 1e-30
    bad = ~((g - r).abs() <= tol)
    assert not bool(bad.any()), _explain(g, r, bad)


# ------------------------------------------------------------ both backends


def to_device(t, misalign=False):
    """A CUDA copy of t; misalign: a view one element past the start of its allocation."""
    if t is None:
        return None
    if not misalign:
        return t.cuda()
    buf = torch.empty(t.numel() + 1, dtype=t.dtype, device="cuda")
    v = buf[1:].view(t.shape)
    v.copy_(t)
    return v


def device_out(shape, dtype, misalign=False):
    """A NaN-poisoned CUDA output (and its allocation, whose element 0 must stay NaN when misaligned)."""
    if not misalign:
        o = poisoned(shape, dtype, "cuda")
        return o, None
    buf = torch.full((math.prod(shape) + 1,), float("nan"), dtype=dtype, device="cuda")
    return buf[1:].view(shape), buf


def forward_both(x, scale, bias_type="no_bias", mask_type="no_mask", bias=None, slopes=None, diag=None,
                 mask=None, offset=None, want_sink=False, misalign=False, in_place=False, out_dtype=None):
    """The op on CUDA (copies of every input) and on the CPU; returns ((y, sink) device, (y, sink) host).
    out_dtype: y's dtype (default x's)."""
    shape = tuple(x.shape)
    ydt = out_dtype or x.dtype
    xd, bd, sd_, dd, md, od = (to_device(a, misalign) for a in (x, bias, slopes, diag, mask, offset))
    if in_place:
        yd, ybuf = xd, None
    else:
        yd, ybuf = device_out(shape, ydt, misalign)
    sinkd, sbuf = device_out(shape[:3], torch.float32, misalign) if want_sink else (None, None)
    nvte.attn_softmax_forward(tt(xd), tt(bd), tt(sd_), tt(dd), tt(md), tt(od), tt(yd), tt(sinkd), scale,
                              BIAS[bias_type], MASK[mask_type])
    yc = poisoned(shape, ydt, "cpu")
    sinkc = poisoned(shape[:3], torch.float32, "cpu") if want_sink else None
    xc = x.clone()
    nvte.attn_softmax_forward(tt(xc), tt(bias), tt(slopes), tt(diag), tt(mask), tt(offset), tt(yc), tt(sinkc),
                              scale, BIAS[bias_type], MASK[mask_type])
    sync()
    for buf in (ybuf, sbuf):
        if buf is not None:
            assert torch.isnan(buf[0]).item(), "wrote before the output"
    return (yd, sinkd), (yc, sinkc)


def check_forward(x, scale, bias_type="no_bias", mask_type="no_mask", bias=None, slopes=None, diag=None,
                  mask=None, offset=None, want_sink=False, misalign=False, in_place=False, out_dtype=None):
    kw = dict(bias_type=bias_type, bias=bias, slopes=slopes, diag=diag, mask=mask, mask_type=mask_type)
    (yd, sd), (yc, sc) = forward_both(x, scale, offset=offset, want_sink=want_sink, misalign=misalign,
                                      in_place=in_place, out_dtype=out_dtype, **kw)
    rel, rel_sink = logit_rtol(x, scale, yc, **kw)
    assert_fwd_close(yd, yc, rel)
    _, _, hidden, _ = terms(x, scale, **kw)
    y = yd.cpu()
    assert bool((y[hidden] == 0).all()), "keys hidden by mask_type must be exactly 0"
    no_keys = hidden.all(-1)
    assert bool((y[no_keys] == 0).all()), "rows without keys must be all zeros"
    if want_sink:
        assert_fwd_close(sd, sc, rel_sink)
        assert bool((sd.cpu()[no_keys] == 1).all()), "rows without keys: the sink takes everything"
    return yd, sd


# ------------------------------------------------------------ forward


@pytest.mark.parametrize("dtype", list(HP))
@pytest.mark.parametrize("bias_type", ["pre", "post"])
def test_forward_bias(bias_type, dtype):
    """Pre/post-scale bias over every row length, its broadcast and dtype cycling."""
    g = gen(1)
    bcasts = ["11", "B1", "1H", "BH"]
    bdts = list(HP.values())
    for n, sk in enumerate(SKS + [2048, 16384]):
        shape = rows_shape(sk)
        x = randn(shape, HP[dtype], g)
        bias = bias_of(g, shape, bcasts[n % 4], bdts[n % 3])
        check_forward(x, 0.125, bias_type, bias=bias)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_forward_float32_output(dtype):
    """16-bit scores, float32 probabilities (the learnable sink's exact y): bias, sink, causal, mask,
    vector and scalar paths (odd Sk), misaligned buffers."""
    g = gen(11)
    for n, sk in enumerate(SKS + [2048]):
        shape = rows_shape(sk)
        x = randn(shape, HP[dtype], g)
        bias = bias_of(g, shape, "1H", HP[dtype])
        offset = torch.randn(shape[1], generator=g)
        check_forward(x, 0.125, "post", "causal", bias=bias, offset=offset, want_sink=True, out_dtype=torch.float32,
                      misalign=n % 2 == 1)


@pytest.mark.parametrize("dtype", list(HP))
@pytest.mark.parametrize("sk", [25000, 30001])
def test_forward_rows_past_the_staging_limit(sk, dtype):
    """Rows longer than shared memory stages (24576 logits): the three passes rebuild the logits
    (bias, ALiBi, mask, sink, causal rows; vector and scalar chunks; misaligned; in place)."""
    g = gen(14)
    shape = (1, 2, 3, sk)
    x = randn(shape, HP[dtype], g)
    bias = bias_of(g, shape, "1H", HP[dtype])
    offset = torch.randn(2, generator=g)
    check_forward(x, 0.125, "post", "bottom_right", bias=bias, offset=offset, want_sink=True)
    check_forward(x, 0.125, "alibi", "causal", diag=torch.tensor([sk - 3], dtype=torch.int64),
                  mask=mask_of(g, shape, "B1"), misalign=True)
    check_forward(x, 0.125, "pre", bias=bias, in_place=True)


@pytest.mark.parametrize("mask_type", list(MASK))
@pytest.mark.parametrize("slopes_kind", ["default", "H", "BH"])
def test_forward_alibi(slopes_kind, mask_type):
    """ALiBi over every row length; diagonals [1] (0, negative, bottom-right) and [B] of either sign."""
    g = gen(2)
    for sk in SKS:
        b, h, sq, _ = shape = (2, 3, 4, sk) if sk < 4097 else (2, 2, 3, sk)
        x = randn(shape, torch.float32, g, 1.0)
        slopes = None
        if slopes_kind == "H":
            slopes = torch.rand(h, generator=g) * 0.5 + 0.01
        elif slopes_kind == "BH":
            slopes = torch.rand((b, h), generator=g) * 0.5 + 0.01
        for d in [[0], [-3], [sk - sq], [5, -2]]:
            check_forward(x, 0.5, "alibi", mask_type, slopes=slopes, diag=torch.tensor(d, dtype=torch.int64))


@pytest.mark.parametrize("dtype", list(HP))
@pytest.mark.parametrize("mask_type", ["causal", "bottom_right"])
def test_forward_causal(mask_type, dtype):
    """Sq == Sk, Sq < Sk, Sq > Sk (bottom-right: the first Sq - Sk rows see nothing), long rows,
    many rows."""
    g = gen(3)
    for shape in [(2, 3, 6, 6), (1, 2, 4, 11), (2, 1, 9, 5), (1, 1, 3, 1), (2, 2, 5, 128), (1, 2, 7, 1000),
                  (1, 1, 3, 4097), (1, 2, 100, 7), (1, 1, 2, 20000), (1, 1, 20, 3000), (2, 4, 128, 128),
                  (1, 1, 600, 300)]:
        x = randn(shape, HP[dtype], g)
        check_forward(x, 0.125, "no_bias", mask_type)


@pytest.mark.parametrize("dtype", list(HP))
@pytest.mark.parametrize("mask_type", list(MASK))
@pytest.mark.parametrize("bcast", ["11", "B1", "1H", "BH"])
def test_forward_explicit_mask(bcast, mask_type, dtype):
    """Explicit masks broadcast in each dim, with a wholly hidden row (zeros) and an open one."""
    g = gen(4)
    for sk in SKS:
        shape = rows_shape(sk)
        x = randn(shape, HP[dtype], g)
        for density in [0.3, 1.0]:
            mask = mask_of(g, shape, bcast, density)
            yd, _ = check_forward(x, 0.25, "no_bias", mask_type, mask=mask)
            full = mask.bool().all(-1, keepdim=True).expand(shape)
            assert bool((yd.cpu()[full] == 0).all()), "a wholly masked row must be all zeros (TE's kernel rule)"


@pytest.mark.parametrize("want_sink", [True, False])
@pytest.mark.parametrize("dtype", list(HP))
@pytest.mark.parametrize("mask_type", list(MASK))
def test_forward_sink(mask_type, dtype, want_sink):
    """softmax_offset (and sink_probs) over every row length; rows without keys (y 0, sink 1); an
    offset that takes nearly everything; with an explicit mask and a post-scale bias."""
    g = gen(5)
    for sk in SKS + [3]:
        b, h, sq, _ = shape = rows_shape(sk) if sk != 3 else (2, 3, 8, 3)
        x = randn(shape, HP[dtype], g)
        offset = torch.randn(h, generator=g) * 2.0
        check_forward(x, 0.5, "no_bias", mask_type, offset=offset, want_sink=want_sink)
        offset[0] = 30.0
        check_forward(x, 0.5, "post", mask_type, bias=bias_of(g, shape, "1H", torch.float32),
                      mask=mask_of(g, shape, "B1"), offset=offset, want_sink=want_sink)


@pytest.mark.parametrize("mask_type", list(MASK))
@pytest.mark.parametrize("bias_type", list(BIAS))
def test_forward_combinations(bias_type, mask_type):
    """Every bias type with every mask type, explicit mask and sink together."""
    g = gen(6)
    for sk in [7, 1000, 4097]:
        b, h, sq, _ = shape = rows_shape(sk)
        x = randn(shape, torch.bfloat16, g)
        kw = {}
        if bias_type in ("pre", "post"):
            kw["bias"] = bias_of(g, shape, "BH", torch.bfloat16)
        if bias_type == "alibi":
            kw["diag"] = torch.tensor([sk - sq], dtype=torch.int64)
        check_forward(x, 0.3, bias_type, mask_type, mask=mask_of(g, shape, "BH"),
                      offset=torch.randn(h, generator=g), want_sink=True, **kw)


@pytest.mark.parametrize("dtype", list(HP))
@pytest.mark.parametrize("sk", [256, 512, 1024, 1032, 2056, 4096, 8192, 8200, 16392])
def test_forward_register_rows(sk, dtype):
    """Vector rows around the register path's chunk counts (2, 4, 8 chunks a thread for a warp or
    a block, and just past them into shared memory): bias, ALiBi, no term; causal rules, an
    explicit mask, the sink, in place."""
    g = gen(15)
    shape = (1, 2, 3, sk) if sk > 4096 else (2, 2, 3, sk)
    b, h, sq, _ = shape
    x = randn(shape, HP[dtype], g)
    check_forward(x, 0.125, "post", "bottom_right", bias=bias_of(g, shape, "1H", HP[dtype]),
                  offset=torch.randn(h, generator=g), want_sink=True)
    check_forward(x, 0.125, "alibi", "causal", diag=torch.tensor([sk - sq], dtype=torch.int64),
                  mask=mask_of(g, shape, "B1"))
    check_forward(x, 0.125, "no_bias", "no_mask", in_place=True)


@pytest.mark.parametrize("sk", [7, 128, 1000, 4096, 20000])
def test_forward_minus_inf_bias_rows(sk):
    """A -inf bias leaves its key out; a row whose keys it leaves out all is zeros (never NaN),
    its sink share 1 (scalar and vector chunks, register, staged and rebuilt rows)."""
    g = gen(16)
    shape = (1, 2, 3, sk)
    x = randn(shape, torch.bfloat16, g)
    bias = torch.zeros(1, 2, 3, sk, dtype=torch.bfloat16)
    bias[0, 0, 0] = float("-inf")
    bias[0, 1, 1, sk // 2:] = float("-inf")
    for offset in (None, torch.randn(2, generator=g)):
        (yd, sd), (yc, sc) = forward_both(x, 0.125, "post", bias=bias, offset=offset, want_sink=offset is not None)
        assert not bool(yd.isnan().any()) and bool((yd[0, 0, 0] == 0).all())
        y = yd.cpu()
        assert torch.equal(y[0, 0, 0], yc[0, 0, 0]) and torch.equal(y[0, 1, 1, sk // 2:], yc[0, 1, 1, sk // 2:])
        rest = torch.ones(shape, dtype=torch.bool)
        rest[0, 0, 0] = False
        assert_fwd_close(y[rest], yc[rest], 1e-6)
        if offset is not None:
            assert sd[0, 0, 0].item() == 1.0
            assert_fwd_close(sd, sc, 1e-6)


def many_rows(shapes):
    g = gen(7)
    for shape in shapes:
        x = randn(shape, torch.bfloat16, g)
        check_forward(x, 0.5, "no_bias", "bottom_right", offset=torch.randn(shape[1], generator=g),
                      want_sink=True)
        dy = randn(shape, torch.bfloat16, g, 1.0)
        y, sink = forward_cpu(x, None, torch.randn(shape[1], generator=g), "causal", torch.bfloat16)
        backward_check(dy, y, None, sink, 0.5, torch.bfloat16, torch.float32)


def test_forward_many_rows():
    """More rows than one grid dimension holds (65535), forward and backward."""
    many_rows([(1, 1, 70000, 7)])


def test_many_rows_large():
    """Many rows of a warp-per-row and a block-sized length ("large": skipped under memcheck)."""
    many_rows([(2, 2, 17000, 33), (1, 1, 66000, 128)])


@pytest.mark.parametrize("dtype", list(HP))
def test_forward_in_place(dtype):
    """softmax_results aliasing input."""
    g = gen(8)
    for sk in SKS:
        shape = rows_shape(sk)
        x = randn(shape, HP[dtype], g)
        check_forward(x, 0.5, "pre", "causal", bias=bias_of(g, shape, "B1", HP[dtype]), in_place=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_misaligned_buffers(dtype):
    """Every input and output one element past a 16-byte boundary (element-wise loads), forward
    and backward; the element before each output stays untouched."""
    g = gen(9)
    for sk in [7, 128, 1000, 4096, 16384, 20000]:
        b, h, sq, _ = shape = rows_shape(sk)
        x = randn(shape, dtype, g)
        bias = bias_of(g, shape, "1H", dtype)
        mask = mask_of(g, shape, "B1")
        offset = torch.randn(h, generator=g)
        check_forward(x, 0.7, "post", "causal", bias=bias, mask=mask, offset=offset, want_sink=True, misalign=True)
        check_forward(x, 0.7, "alibi", "no_mask", slopes=torch.rand((b, h), generator=g),
                      diag=torch.tensor([3] * b, dtype=torch.int64), misalign=True)
        y, sink = forward_cpu(x, mask, offset, "causal", dtype)
        dy = randn(shape, dtype, g, 1.0)
        backward_check(dy, y, mask, sink, 0.7, dtype, torch.float32, misalign=True)


# ------------------------------------------------------------ backward


def backward_both(dy, y, mask, sink, scale, out_dtype, logit_dtype, want_off, misalign=False):
    """The backward on CUDA and on the CPU; returns ((dx, dl, doff) device, (dx, dl, doff) host)."""
    shape = tuple(y.shape)
    dyd, yd, md, sd = (to_device(a, misalign) for a in (dy, y, mask, sink))
    dxd, b1 = device_out(shape, out_dtype, misalign)
    dld, b2 = device_out(shape, logit_dtype, misalign) if logit_dtype is not None else (None, None)
    dod, b3 = device_out(shape[:3], torch.float32, misalign) if want_off else (None, None)
    nvte.attn_softmax_backward(tt(dyd), tt(yd), tt(md), tt(sd), tt(dxd), tt(dld), tt(dod), scale)
    dxc = poisoned(shape, out_dtype, "cpu")
    dlc = poisoned(shape, logit_dtype, "cpu") if logit_dtype is not None else None
    doc = poisoned(shape[:3], torch.float32, "cpu") if want_off else None
    nvte.attn_softmax_backward(tt(dy), tt(y), tt(mask), tt(sink), tt(dxc), tt(dlc), tt(doc), scale)
    sync()
    for buf in (b1, b2, b3):
        if buf is not None:
            assert torch.isnan(buf[0]).item(), "wrote before the output"
    return (dxd, dld, dod), (dxc, dlc, doc)


def backward_check(dy, y, mask, sink, scale, out_dtype, logit_dtype, misalign=False):
    (dxd, dld, dod), (dxc, dlc, doc) = backward_both(dy, y, mask, sink, scale, out_dtype, logit_dtype,
                                                     sink is not None, misalign)
    assert_bwd_close(dxd, dxc, dy, y, scale)
    if logit_dtype is not None:
        assert_bwd_close(dld, dlc, dy, y, 1.0)
    if sink is not None:
        assert_offset_grads_close(dod, doc, dy, y, sink)
    if mask is not None:
        hid = mask.bool().expand(y.shape)
        assert bool((dxd.cpu()[hid] == 0).all()), "keys the explicit mask hides get no gradient"
        if logit_dtype is not None:
            assert bool((dld.cpu()[hid] == 0).all())


def forward_cpu(x, mask=None, offset=None, mask_type="no_mask", dtype=torch.float32):
    """y (dtype) and sink_probs from the CPU backend, the inputs of a backward."""
    y = poisoned(tuple(x.shape), dtype, "cpu")
    sink = poisoned(tuple(x.shape[:3]), torch.float32, "cpu") if offset is not None else None
    xc = x.to(dtype)
    nvte.attn_softmax_forward(tt(xc), None, None, None, tt(mask), tt(offset), tt(y), tt(sink), 1.0,
                              BT.NVTE_NO_BIAS, MASK[mask_type])
    return y, sink


@pytest.mark.parametrize("variant", ["plain", "mask", "sink", "mask+sink"])
@pytest.mark.parametrize("dtype", list(HP))
def test_backward(dtype, variant):
    """output_grads, logit_grads, offset_grads over every row length (causal rows without keys
    included); 16-bit and float32 output dtypes."""
    g = gen(10)
    for n, sk in enumerate(SKS + [2048, 16384]):
        b, h, sq, _ = shape = rows_shape(sk)
        mask_type = ["no_mask", "causal", "bottom_right"][n % 3]
        x = randn(shape, torch.float32, g, 2.0)
        mask = mask_of(g, shape, ["B1", "1H", "BH", "11"][n % 4]) if "mask" in variant else None
        offset = torch.randn(h, generator=g) if "sink" in variant else None
        y, sink = forward_cpu(x, mask, offset, mask_type, HP[dtype])
        dy = randn(shape, HP[dtype], g, 1.0)
        out_dtype = HP[dtype] if n % 2 == 0 else torch.float32
        logit_dtype = [torch.float32, None, HP[dtype]][n % 3]
        backward_check(dy, y, mask, sink, 0.125, out_dtype, logit_dtype)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_backward_float32_probabilities(dtype):
    """float32 y with 16-bit dy, dx and logit grads (the learnable sink's backward: typed kernel),
    vector and scalar paths, misaligned buffers."""
    g = gen(12)
    for n, sk in enumerate(SKS + [2048]):
        b, h, sq, _ = shape = rows_shape(sk)
        x = randn(shape, torch.float32, g, 2.0)
        mask = mask_of(g, shape, "B1") if n % 2 else None
        y, sink = forward_cpu(x, mask, torch.randn(h, generator=g), "causal", torch.float32)
        dy = randn(shape, HP[dtype], g, 1.0)
        backward_check(dy, y, mask, sink, 0.125, HP[dtype], HP[dtype] if n % 3 else None, misalign=n % 2 == 1)


@pytest.mark.parametrize("mask_type", ["causal", "bottom_right"])
@pytest.mark.parametrize("dtype", list(HP))
def test_backward_mask_type(mask_type, dtype):
    """The forward's mask type in the backward: hidden keys unread (NaN in y and dy there) and zero,
    the rest as the CPU backend computes it; vector and scalar paths."""
    g = gen(13)
    for sk in SKS + [2048]:
        b, h, sq, _ = shape = rows_shape(sk)
        x = randn(shape, torch.float32, g, 2.0)
        y, _ = forward_cpu(x, None, None, mask_type, HP[dtype])
        dy = randn(shape, HP[dtype], g, 1.0)
        hid = torch.ones(sq, sk, dtype=torch.bool).triu(1 + (sk - sq if mask_type == "bottom_right" else 0))
        hid = hid.expand(shape)
        dxc = poisoned(shape, HP[dtype], "cpu")
        nvte.attn_softmax_backward(tt(dy), tt(y), None, None, tt(dxc), None, None, 0.25, MASK[mask_type])
        yn, dyn = y.clone(), dy.clone()
        yn[hid] = float("nan")
        dyn[hid] = float("nan")
        yd, dyd = yn.cuda(), dyn.cuda()
        dxd = poisoned(shape, HP[dtype], "cuda")
        nvte.attn_softmax_backward(tt(dyd), tt(yd), None, None, tt(dxd), None, None, 0.25, MASK[mask_type])
        sync()
        assert bool((dxd.cpu()[hid] == 0).all()), "hidden keys: zero gradient, not read"
        assert_bwd_close(dxd, dxc, dy, y, 0.25)


@pytest.mark.parametrize("dtype", list(HP))
def test_backward_in_place(dtype):
    """output_grads aliasing incoming_grads, then softmax_results, with logit_grads and offset_grads."""
    g = gen(11)
    for sk in SKS:
        b, h, sq, _ = shape = rows_shape(sk)
        x = randn(shape, torch.float32, g, 2.0)
        mask = mask_of(g, shape, "B1")
        y, sink = forward_cpu(x, mask, torch.randn(h, generator=g), "causal", HP[dtype])
        dy = randn(shape, HP[dtype], g, 1.0)
        dxc, dlc, doc = poisoned(shape, HP[dtype], "cpu"), poisoned(shape, torch.float32, "cpu"), \
            poisoned(shape[:3], torch.float32, "cpu")
        nvte.attn_softmax_backward(tt(dy), tt(y), tt(mask), tt(sink), tt(dxc), tt(dlc), tt(doc), 0.5)
        md, sd = mask.cuda(), sink.cuda()
        for alias in ["incoming_grads", "softmax_results"]:
            dyd, yd = dy.cuda(), y.cuda()
            dld, dod = poisoned(shape, torch.float32, "cuda"), poisoned(shape[:3], torch.float32, "cuda")
            out = dyd if alias == "incoming_grads" else yd
            nvte.attn_softmax_backward(tt(dyd), tt(yd), tt(md), tt(sd), tt(out), tt(dld), tt(dod), 0.5)
            sync()
            assert_bwd_close(out, dxc, dy, y, 0.5)
            assert_bwd_close(dld, dlc, dy, y, 1.0)
            assert_offset_grads_close(dod, doc, dy, y, sink)


def test_empty_launches_nothing():
    for shape in [(2, 3, 0, 5), (2, 3, 4, 0), (0, 3, 4, 5)]:
        x = torch.zeros(shape, device="cuda")
        y = torch.empty(shape, device="cuda")
        off = torch.zeros(3, device="cuda")
        sink = torch.full(shape[:3], float("nan"), device="cuda")
        nvte.attn_softmax_forward(tt(x), None, None, None, None, tt(off), tt(y), tt(sink), 1.0,
                                  BT.NVTE_NO_BIAS, MT.NVTE_CAUSAL_MASK)
        doff = torch.full(shape[:3], float("nan"), device="cuda")
        nvte.attn_softmax_backward(tt(x), tt(x), None, tt(sink), tt(y), None, tt(doff), 1.0)
        sync()
        assert bool((sink == 1).all()) and bool((doff == 0).all())


def test_host_device_mixes_are_rejected():
    x = torch.randn(2, 3, 4, 5, device="cuda")
    y = torch.empty(2, 3, 4, 5, device="cuda")
    for kw in [dict(bias=torch.zeros(1, 1, 4, 5)), dict(mask=torch.zeros(1, 1, 4, 5, dtype=torch.uint8))]:
        bias, mask = kw.get("bias"), kw.get("mask")
        with pytest.raises(nvte.Error, match="tensors live on different devices"):
            nvte.attn_softmax_forward(tt(x), tt(bias), None, None, tt(mask), None, tt(y), None, 1.0,
                                      BT.NVTE_POST_SCALE_BIAS if bias is not None else BT.NVTE_NO_BIAS,
                                      MT.NVTE_NO_MASK)
    # The device is fine afterwards.
    nvte.attn_softmax_forward(tt(x), None, None, None, None, None, tt(y), None, 1.0, BT.NVTE_NO_BIAS,
                              MT.NVTE_NO_MASK)
    sync()
    assert torch.allclose(y.sum(-1), torch.ones(2, 3, 4, device="cuda"))
