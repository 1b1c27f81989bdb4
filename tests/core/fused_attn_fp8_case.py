"""The FP8 fused attention test harness: a fused_attn_case.Run whose Q, K, V, dO are FP8 with
per-tensor scales, whose O and dQ/dK/dV are FP8 (with scale, amax, scale_inv) or
float16/bfloat16, plus the S and dP metadata tensors; calls through _nvte and comparisons
against fused_attn_fp8_ref.py.

Comparison rule (derived, not tuned): the reference emulates every quantization point of the
kernel in float64, so the two differ only by float64 summation order and libm ulps (~1e-15
relative). That changes a stored FP8 value only when a value lies within ~1e-15 of a rounding
boundary, so FP8 outputs must agree code for code, with at most one code (one FP8 step) of
difference allowed for such boundary cases; float16/bfloat16 outputs use the central table
(one rounding). amax values are float32 maxima of the same values (float32 table)."""
from dataclasses import dataclass
from typing import Optional

import numpy as np

from fused_attn_case import MASKS, Run, T, aux_pack, logical_shape, pack, to_rows, view
from fused_attn_fp8_ref import (amax_f32, delayed_scale, descale, fp8_attn_bwd_ref, fp8_attn_fwd_ref,
                                fp8_codes)
from util import NP_TYPE, NVTE_DTYPE, assert_close, fp8_decode, scalar
from transformer_engine import _nvte as nvte

FP8 = ("e4m3", "e5m2")
NAN_CODE = 0x7F  # NaN in both formats: poison for FP8 outputs and padding positions of inputs


@dataclass
class Fp8Cfg:
    o: str = "e4m3"      # O: e4m3, e5m2, bfloat16, float16
    do: str = "e5m2"     # dO, and with it dS~ (E5M2 under TE's HYBRID recipe)
    dqkv: str = "e5m2"   # dQ, dK, dV: e4m3, e5m2, bfloat16, float16
    boost: float = 1.0   # multiplies every output/intermediate scale (> 1: saturation)
    amax_init: float = 0.0  # prefilled amax buffers (max-accumulation)


class Meta:
    """float32 [1] scale / amax / scale_inv buffers of one tensor (scale_inv poisoned to -1
    when the library writes it)."""

    def __init__(self, scale=None, amax=None, scale_inv=None):
        self.scale = None if scale is None else scalar(scale)
        self.amax = None if amax is None else scalar(amax)
        self.scale_inv = None if scale_inv is None else scalar(scale_inv)

    def attach(self, t):
        for p, a in ((nvte.Param.kScale, self.scale), (nvte.Param.kAmax, self.amax),
                     (nvte.Param.kRowwiseScaleInv, self.scale_inv)):
            if a is not None:
                t.set_array(p, a)
        return t

    def tensor(self):
        """A metadata-only tensor (S, dP): no data."""
        return self.attach(nvte.Tensor())


def ordinal(codes):
    """FP8 bytes -> integers in value order (adjacent FP8 numbers differ by 1; +0 == -0)."""
    c = np.asarray(codes, np.uint8).astype(np.int64)
    return np.where(c & 0x80, -(c & 0x7F), c & 0x7F)


def check_fp8_codes(got, ref_codes, fmt):
    mag = np.asarray(got, np.uint8) & 0x7F
    bad_code = (mag == 0x7F) if fmt == "e4m3" else (mag > 0x7B)
    assert not bad_code.any(), f"{int(bad_code.sum())} NaN/inf codes (unwritten or overflowed elements)"
    diff = np.abs(ordinal(got) - ordinal(ref_codes))
    bad = diff > 1
    if bad.any():
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        raise AssertionError(f"{int(bad.sum())} of {bad.size} FP8 values more than one step off; first at {idx}: "
                             f"got {fp8_decode(np.asarray(got)[idx], fmt)} ref {fp8_decode(ref_codes[idx], fmt)}")
    return int((diff == 0).sum()), diff.size


class Fp8Run(Run):
    def __init__(self, case, rng, f: Optional[Fp8Cfg] = None):
        case.dtype = "float32"  # the base draws float values; they are quantized here
        super().__init__(case, rng)
        self.f = f = f or Fp8Cfg()
        self.exact = self.total = 0  # FP8 output values compared / equal code for code
        self.codes, self.in_scale = {}, {}
        for name, fmt in (("q", "e4m3"), ("k", "e4m3"), ("v", "e4m3"), ("do", f.do)):
            x = getattr(self, name)
            sc = delayed_scale(np.abs(x).max(initial=0.0), fmt)
            self.codes[name] = fp8_codes(x, sc, fmt)
            self.in_scale[name] = sc
            setattr(self, name, fp8_decode(self.codes[name], fmt) * descale(sc))  # padding stays 0
        self.choose_scales()

    def choose_scales(self):
        """Scales from the amax of the unquantized math (the reference with no quantization),
        as a delayed-scaling recipe would hold them; boost > 1 saturates every point."""
        f, c = self.f, self.cfg
        o, lse, amax_s = fp8_attn_fwd_ref(self.q, self.k, self.v, c, self.ex, 1.0, None)
        dq, dk, dv, _, amax_dp = fp8_attn_bwd_ref(self.q, self.k, self.v, o, self.do, lse, c, self.ex,
                                                  1.0, 1.0, None, None)
        b = f.boost
        self.scale = {"s": delayed_scale(amax_s, "e4m3") * b, "dp": delayed_scale(amax_dp, f.do) * b}
        for name, x, fmt in (("o", o, f.o), ("dq", dq, f.dqkv), ("dk", dk, f.dqkv), ("dv", dv, f.dqkv)):
            self.scale[name] = delayed_scale(amax_f32(x), fmt) * b if fmt in FP8 else None

    # --- tensors
    def out_meta(self, key, fmt):
        a = self.f.amax_init
        return Meta(self.scale[key], a, -1.0) if fmt in FP8 else Meta(None, a, None)

    def typed_views(self, rows3, fmt, metas):
        """Q/K/V-shaped tensors (packed as the layout says) of FP8 codes or float values."""
        c = self.c
        np_t = np.uint8 if fmt in FP8 else NP_TYPE[fmt]
        _, views = pack(self.group, [r.astype(np_t) for r in rows3])
        shapes = [logical_shape(self.qf, c.b, c.sq, self.rows_q, c.hq, c.dqk),
                  logical_shape(self.kvf, c.b, c.skv, self.rows_kv, c.hkv, c.dqk),
                  logical_shape(self.kvf, c.b, c.skv, self.rows_kv, c.hkv, c.dv)]
        return [m.attach(view(vw, s, NVTE_DTYPE[fmt])) for vw, s, m in zip(views, shapes, metas)], views

    def o_like(self, fmt, meta, fill_rows=None):
        c = self.c
        shape = (self.rows_q, c.hq, c.dv)
        if fill_rows is None:
            arr = np.full(shape, NAN_CODE if fmt in FP8 else np.nan, np.uint8 if fmt in FP8 else NP_TYPE[fmt])
        else:
            arr = np.ascontiguousarray(fill_rows.astype(np.uint8 if fmt in FP8 else NP_TYPE[fmt]))
        t = view(arr, logical_shape(self.qf, c.b, c.sq, self.rows_q, c.hq, c.dv), NVTE_DTYPE[fmt])
        return meta.attach(t), arr

    def forward(self, aux="alloc"):
        c, f = self.c, self.f
        rows = self.qkv_rows(*(self.codes[n].astype(np.float64) for n in "qkv"), float(NAN_CODE))
        self.in_meta = [Meta(scale_inv=descale(self.in_scale[n])) for n in "qkv"]
        self.tq, _ = self.typed_views(rows, "e4m3", self.in_meta)
        self.o_meta = self.out_meta("o", f.o)
        self.o_t, self.o_arr = self.o_like(f.o, self.o_meta)
        self.s_meta = Meta(self.scale["s"], f.amax_init, -1.0)
        kw = dict(**self.side(), S=self.s_meta.tensor(), page_table_k=None, page_table_v=None,
                  rng_state=T(self.rng_state), is_training=c.is_training, return_max_logit=False,
                  cuda_graph=False, **self.scalars())
        call = lambda a: nvte.fused_attn_fwd(*self.tq, O=self.o_t, aux=a, **kw)
        if aux is None:
            self.aux_arrays = None
            return call(None)
        self.described = call([])
        self.aux_arrays, self.aux = aux_pack(self.described, np.float32)
        call(self.aux)

    def backward(self, **over):
        c, f = self.c, self.f
        do_rows = to_rows(self.codes["do"].astype(np.float64), self.qf, self.lens_q, self.offs_q,
                          self.rows_q, float(NAN_CODE))
        self.do_meta = Meta(scale_inv=descale(self.in_scale["do"]))
        self.do_t, _ = self.o_like(f.do, self.do_meta, do_rows)
        poison = NAN_CODE if f.dqkv in FP8 else np.nan
        shapes = [(self.rows_q, c.hq, c.dqk), (self.rows_kv, c.hkv, c.dqk), (self.rows_kv, c.hkv, c.dv)]
        self.grad_meta = [self.out_meta(n, f.dqkv) for n in ("dq", "dk", "dv")]
        self.grads_t, self.grad_views = self.typed_views([np.full(s, poison) for s in shapes], f.dqkv,
                                                         self.grad_meta)
        self.dp_meta = Meta(self.scale["dp"], f.amax_init, -1.0)
        self.dalpha_arr = None if self.alpha is None else np.full(self.alpha.shape, np.nan, np.float32)
        side = self.side()
        kw = dict(S=self.s_meta.tensor(), dP=self.dp_meta.tensor(), aux=self.aux, dBias=None,
                  dSoftmaxOffset=T(self.dalpha_arr), cu_seqlens_q=side["cu_seqlens_q"],
                  cu_seqlens_kv=side["cu_seqlens_kv"], cu_seqlens_q_padded=side["cu_seqlens_q_padded"],
                  cu_seqlens_kv_padded=side["cu_seqlens_kv_padded"], deterministic=True, cuda_graph=False,
                  **self.scalars())
        kw.update(over)
        tq = kw.pop("tensors", self.tq)
        o_t, do_t = kw.pop("O", self.o_t), kw.pop("dO", self.do_t)
        grads = kw.pop("grads", self.grads_t)
        nvte.fused_attn_bwd(*tq, o_t, do_t, dQ=grads[0], dK=grads[1], dV=grads[2], **kw)

    # --- checks
    def check_out(self, got, ref_canon, fmt, scale, meta, q_side):
        """One output against the reference values (canonical [b, s, h, d])."""
        ref = self.canon_rows(ref_canon, q_side)
        if fmt in FP8:
            exact, n = check_fp8_codes(got, fp8_codes(ref, scale, fmt), fmt)
            self.exact += exact
            self.total += n
            assert meta.scale_inv[0] == np.float32(1.0) / np.float32(scale), "scale_inv = 1 / scale"
        else:
            assert_close(got, np.asarray(ref, np.float32).astype(NP_TYPE[fmt]), fmt)
        assert_close(meta.amax[0], max(self.f.amax_init, amax_f32(ref)), "float32")

    def o_values(self):
        """The stored O decoded as the backward reads it, canonical [b, sq, hq, dv]."""
        f = self.f
        rows = fp8_decode(self.o_arr, f.o) * float(self.o_meta.scale_inv[0]) if f.o in FP8 else self.o_arr
        return self.canon_from_o(rows)

    def check_forward(self):
        o, lse, amax_s = fp8_attn_fwd_ref(self.q, self.k, self.v, self.cfg, self.ex, self.scale["s"])
        self.check_out(self.o_arr, o, self.f.o, self.scale["o"], self.o_meta, True)
        assert_close(self.s_meta.amax[0], max(self.f.amax_init, amax_s), "float32")
        assert self.s_meta.scale_inv[0] == np.float32(1.0) / np.float32(self.scale["s"])
        if self.aux_arrays is not None:
            assert_close(self.aux_arrays[0][..., 0], lse, "float32")
            assert [a.dtype for a in self.aux_arrays[:2]] == [np.float32, np.int64]

    def check_backward(self):
        f = self.f
        lse = self.aux_arrays[0][..., 0].astype(np.float64)
        dq, dk, dv, dalpha, amax_dp = fp8_attn_bwd_ref(self.q, self.k, self.v, self.o_values(), self.do, lse,
                                                       self.cfg, self.ex, self.scale["s"], self.scale["dp"],
                                                       "e4m3", f.do)
        for got, ref, key, meta, q_side in zip(self.grad_views, (dq, dk, dv), ("dq", "dk", "dv"),
                                               self.grad_meta, (True, False, False)):
            self.check_out(got, ref, f.dqkv, self.scale[key], meta, q_side)
        assert_close(self.dp_meta.amax[0], max(f.amax_init, amax_dp), "float32")
        assert self.dp_meta.scale_inv[0] == np.float32(1.0) / np.float32(self.scale["dp"])
        if self.dalpha_arr is not None:
            assert_close(self.dalpha_arr.reshape(-1), dalpha, "float32", atol=1e-5)


def run_fp8_case(case, rng, f=None, backward=True):
    r = Fp8Run(case, rng, f)
    r.forward()
    r.check_forward()
    if backward:
        r.backward()
        r.check_backward()
    # Boundary cases are ~1e-13 likely per element; all but a handful must match exactly.
    print(f"FP8 values equal code for code: {r.exact} of {r.total}")
    assert r.total - r.exact <= max(2, r.total // 1000), f"{r.total - r.exact} of {r.total} FP8 values off by one step"
    return r
