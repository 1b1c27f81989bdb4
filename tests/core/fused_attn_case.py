"""The fused attention test harness: a Case (configuration), its inputs in canonical padded
form, the Q/K/V/O tensors in the case's layout (packed layouts as strided views into one
buffer, THD with gaps between sequences, NaN in every padding position of the inputs), the
forward/backward calls through _nvte and the comparisons against fused_attn_ref.py."""
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from fused_attn_ref import AttnCfg, AttnExtras, dropout_keep, fused_attn_bwd_ref, fused_attn_ref
from util import NP_TYPE, NVTE_DTYPE, assert_close, to_np
from transformer_engine import _nvte as nvte

L, M, BT, ST = nvte.NVTE_QKV_Layout, nvte.NVTE_Mask_Type, nvte.NVTE_Bias_Type, nvte.NVTE_Softmax_Type
DTYPES = ["float32", "float16", "bfloat16"]
LAYOUTS = [n for n in L.__members__ if not n.startswith("NVTE_Paged")]
PAGED_LAYOUTS = [n for n in L.__members__ if n.startswith("NVTE_Paged")]
# mask name -> (padding, causal, bottom-right diagonal)
MASKS = {"no_mask": (False, False, False), "padding": (True, False, False),
         "causal": (False, True, False), "padding_causal": (True, True, False),
         "causal_bottom_right": (False, True, True), "padding_causal_bottom_right": (True, True, True)}
BIAS_ENUM = {"no_bias": BT.NVTE_NO_BIAS, "pre": BT.NVTE_PRE_SCALE_BIAS,
             "post": BT.NVTE_POST_SCALE_BIAS, "alibi": BT.NVTE_ALIBI}
SOFTMAX_ENUM = {"vanilla": ST.NVTE_VANILLA_SOFTMAX, "off_by_one": ST.NVTE_OFF_BY_ONE_SOFTMAX,
                "learnable": ST.NVTE_LEARNABLE_SOFTMAX}


def mask_enum(name):
    return M.NVTE_NO_MASK if name == "no_mask" else getattr(M, "NVTE_" + name.upper() + "_MASK")


def layout_info(name):
    """(q_format, kv_format, group) from a layout name such as NVTE_BSHD_BS2HD (paged layouts:
    the group is "paged", kv_format the caches' format)."""
    if name.startswith("NVTE_Paged_KV_"):
        q, kv = layout_info("NVTE_" + name[len("NVTE_Paged_KV_"):])[:2]
        return q, kv, "paged"
    parts = name[5:].lower().split("_")
    fmt = [("thd" if p.startswith("t") else "sbhd" if p.startswith("sb") else "bshd") for p in parts]
    for g in ("3hd", "h3d", "2hd", "h2d"):
        if parts[-1].endswith(g):
            return fmt[0], fmt[0], g
    return fmt[0], fmt[1], "hd_hd_hd"


@dataclass
class Case:
    layout: str = "NVTE_BSHD_BSHD_BSHD"
    dtype: str = "float32"
    b: int = 2
    sq: int = 5
    skv: int = 5
    hq: int = 2
    hkv: int = 2
    dqk: int = 8
    dv: int = 8
    mask: str = "no_mask"
    bias: str = "no_bias"
    bias_shape: tuple = (1, 1)  # (1 or b, 1 or hq) selectors: 1 -> broadcast, 0 -> full
    custom_slopes: bool = False
    softmax: str = "vanilla"
    wl: int = -1
    wr: int = -1
    bottom_right_diagonal: bool = False
    dropout: float = 0.0
    is_training: bool = True
    return_max_logit: bool = False
    lens_q: Optional[list] = None
    lens_kv: Optional[list] = None
    thd_gaps: bool = True
    page_size: int = 2          # paged layouts: tokens per page
    spare_pages: int = 3        # paged layouts: pages no sequence uses (NaN)
    seed: int = 1234
    offset: int = 77
    scale: Optional[float] = None
    extra: dict = field(default_factory=dict)


# ------------------------------------------------------------------ tensors and layouts


NP_TO_NVTE = {np.dtype(np.float32): nvte.DType.kFloat32, np.dtype(np.float16): nvte.DType.kFloat16,
              np.dtype(NP_TYPE["bfloat16"]): nvte.DType.kBFloat16, np.dtype(np.int32): nvte.DType.kInt32,
              np.dtype(np.int64): nvte.DType.kInt64, np.dtype(np.uint8): nvte.DType.kByte}


def T(arr):
    """nvte.Tensor of a contiguous array (None stays None), any dtype used here."""
    if arr is None:
        return None
    arr = np.ascontiguousarray(arr)
    return view(arr, arr.shape, NP_TO_NVTE[arr.dtype])


def view(arr, shape, dtype):
    """An nvte.Tensor over a numpy array or view (possibly strided: its first element is the
    pointer, `shape` the logical shape); the array stays referenced by the handle."""
    t = nvte.Tensor()
    t.set_param(nvte.Param.kRowwiseData, arr.ctypes.data, list(shape), dtype)
    t._refs = arr
    return t


def aux_pack(described, float_dtype):
    """Arrays and views for the aux pack a forward describes ([(shape, dtype)]): float32 entries
    NaN-poisoned, int64 entries (rng state) zeroed, the others of float_dtype."""
    np_of = {nvte.DType.kInt64: np.int64, nvte.DType.kFloat32: np.float32}
    arrays = [np.full(shape, np.nan if dt == nvte.DType.kFloat32 else 0, np_of.get(dt, float_dtype))
              for shape, dt in described]
    return arrays, [view(a, a.shape, dt) for a, (_, dt) in zip(arrays, described)]


def logical_shape(fmt, b, s, rows, h, d):
    return {"bshd": (b, s, h, d), "sbhd": (s, b, h, d), "thd": (rows, h, d)}[fmt]


def to_rows(canon, fmt, lens, offs, rows, pad):
    """canonical [b, s, h, d] -> token rows [R, h, d]; positions past a length (and THD gaps)
    get `pad`."""
    b, s, h, d = canon.shape
    c = canon.copy()
    for i in range(b):
        c[i, lens[i]:] = pad
    if fmt == "bshd":
        return c.reshape(b * s, h, d)
    if fmt == "sbhd":
        return c.transpose(1, 0, 2, 3).reshape(s * b, h, d)
    r = np.full((rows, h, d), pad, np.float64)
    for i in range(b):
        r[offs[i]:offs[i] + lens[i]] = c[i, :lens[i]]
    return r


def pack(group, rows3):
    """Buffers of a layout group from Q/K/V token rows, and the three role views into them."""
    if group in ("3hd", "h3d"):
        buf = np.ascontiguousarray(np.stack(rows3, 1 if group == "3hd" else 2))
        views = [buf[:, r] if group == "3hd" else buf[:, :, r] for r in range(3)]
        return [buf], views
    if group in ("2hd", "h2d"):
        q = np.ascontiguousarray(rows3[0])
        kv = np.ascontiguousarray(np.stack(rows3[1:], 1 if group == "2hd" else 2))
        return [q, kv], [q] + [kv[:, r] if group == "2hd" else kv[:, :, r] for r in range(2)]
    bufs = [np.ascontiguousarray(r) for r in rows3]
    return bufs, bufs


def seq_layout(rng, b, s, given, padded, thd, gaps):
    """Lengths, cu_seqlens and THD offsets (with random gaps between sequences)."""
    lens = np.array(given if given is not None else
                    (rng.integers(0, s + 1, b) if padded or thd else [s] * b), np.int64)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    if not thd:
        return lens, cu, None, None, b * s
    gap = rng.integers(0, 3, b) if gaps else np.zeros(b, np.int64)
    offs = np.concatenate([[0], np.cumsum(lens + gap)]).astype(np.int32)
    return lens, cu, offs, offs[:-1], int(offs[-1]) + (1 if gaps else 0)


class Run:
    """Builds one case: inputs, tensors in the case's layout, the reference, and calls."""

    def __init__(self, case, rng):
        self.c = c = case
        self.rng = rng
        self.qf, self.kvf, self.group = layout_info(c.layout)
        self.nvdt = NVTE_DTYPE[c.dtype]
        self.npdt = NP_TYPE[c.dtype]
        padded, causal, bottom_right = MASKS[c.mask]
        thd_q, thd_kv = self.qf == "thd", self.kvf == "thd"
        packed_seq = self.group in ("3hd", "h3d")
        self.lens_q, self.cu_q, self.pad_q, self.offs_q, self.rows_q = seq_layout(
            rng, c.b, c.sq, c.lens_q, padded, thd_q, c.thd_gaps)
        if packed_seq and thd_q and c.lens_kv is None:  # one token list for Q, K and V
            self.lens_kv, self.cu_kv, self.pad_kv = self.lens_q, self.cu_q, self.pad_q
            self.offs_kv, self.rows_kv = self.offs_q, self.rows_q
        else:
            self.lens_kv, self.cu_kv, self.pad_kv, self.offs_kv, self.rows_kv = seq_layout(
                rng, c.b, c.skv, c.lens_kv, padded, thd_kv, c.thd_gaps)
        scale = c.scale if c.scale is not None else 1.0 / np.sqrt(c.dqk)
        self.cfg = AttnCfg(scale=float(np.float32(scale)), causal=causal,
                           bottom_right=bottom_right if causal else c.bottom_right_diagonal,
                           wl=c.wl, wr=c.wr, bias_type=c.bias, softmax=c.softmax,
                           dropout=c.dropout if c.is_training else 0.0)
        rnd = lambda *shape: to_np(rng.normal(0.0, 1.0, shape), c.dtype).astype(np.float64)
        self.q, self.do = rnd(c.b, c.sq, c.hq, c.dqk), rnd(c.b, c.sq, c.hq, c.dv)
        self.k, self.v = rnd(c.b, c.skv, c.hkv, c.dqk), rnd(c.b, c.skv, c.hkv, c.dv)
        for name in ("q", "do"):
            for i in range(c.b):
                getattr(self, name)[i, self.lens_q[i]:] = 0.0
        for name in ("k", "v"):
            for i in range(c.b):
                getattr(self, name)[i, self.lens_kv[i]:] = 0.0
        self.ex = AttnExtras(self.lens_q, self.lens_kv)
        self.bias_arr = None
        if c.bias in ("pre", "post"):
            shp = (1 if c.bias_shape[0] else c.b, 1 if c.bias_shape[1] else c.hq, c.sq, c.skv)
            self.bias_arr = to_np(c.extra.get("bias", rng.normal(0.0, 1.0, shp)), c.dtype)
            self.ex.bias = self.bias_arr.astype(np.float64)
        elif c.bias == "alibi" and c.custom_slopes:
            self.bias_arr = rng.uniform(0.05, 1.0, (c.hq,)).astype(np.float32)
            self.ex.slopes = self.bias_arr[None].astype(np.float64)
        self.alpha = None
        if c.softmax == "learnable":
            self.alpha = rng.normal(0.0, 1.0, (1, c.hq, 1, 1)).astype(np.float32)
            self.ex.alpha = self.alpha.reshape(-1).astype(np.float64)
        self.rng_state = np.array([c.seed, c.offset], np.int64)
        if self.cfg.dropout > 0:
            self.ex.keep = dropout_keep(c.seed, c.offset, c.dropout, c.b, c.hq, c.sq, c.skv)

    # --- tensors
    def page_tables(self):
        """Paged layouts: K's and V's page tables [b, pages per sequence], each a random
        placement of the sequences' pages among all pages; entries no key uses are -1."""
        c = self.c
        per = -(-c.skv // c.page_size)
        n = c.b * per + c.spare_pages
        tables = []
        for _ in range(2):
            t = self.rng.permutation(n)[:c.b * per].reshape(c.b, per).astype(np.int32)
            for i in range(c.b):
                t[i, -(-self.lens_kv[i] // c.page_size):] = -1
            tables.append(t)
        return n, tables

    def paged_cache(self, canon, table, n, pad):
        """A K or V cache [n pages, page_size] (bshd) or [page_size, n] (sbhd) rows holding each
        sequence's keys at the pages its table names; every other slot holds `pad`."""
        c = self.c
        b, _, h, d = canon.shape
        cache = np.full((n, c.page_size, h, d), pad, np.float64)
        for i in range(b):
            for j in range(self.lens_kv[i]):
                cache[table[i, j // c.page_size], j % c.page_size] = canon[i, j]
        return cache if self.kvf == "bshd" else np.ascontiguousarray(cache.transpose(1, 0, 2, 3))

    def qkv_rows(self, q, k, v, pad):
        return [to_rows(q, self.qf, self.lens_q, self.offs_q, self.rows_q, pad),
                to_rows(k, self.kvf, self.lens_kv, self.offs_kv, self.rows_kv, pad),
                to_rows(v, self.kvf, self.lens_kv, self.offs_kv, self.rows_kv, pad)]

    def qkv_tensors(self, rows3):
        c = self.c
        if self.group == "paged":  # rows3: Q rows and the K, V caches
            arrs = [np.ascontiguousarray(r.astype(self.npdt)) for r in rows3]
            shapes = [logical_shape(self.qf, c.b, c.sq, self.rows_q, c.hq, c.dqk)] + [a.shape for a in arrs[1:]]
            return [view(a, s, self.nvdt) for a, s in zip(arrs, shapes)], arrs
        bufs, views = pack(self.group, [r.astype(self.npdt) for r in rows3])
        shapes = [logical_shape(self.qf, c.b, c.sq, self.rows_q, c.hq, c.dqk),
                  logical_shape(self.kvf, c.b, c.skv, self.rows_kv, c.hkv, c.dqk),
                  logical_shape(self.kvf, c.b, c.skv, self.rows_kv, c.hkv, c.dv)]
        return [view(vw, s, self.nvdt) for vw, s in zip(views, shapes)], views

    def out_tensor(self, rows):
        c = self.c
        arr = np.ascontiguousarray(rows.astype(self.npdt))
        return view(arr, logical_shape(self.qf, c.b, c.sq, self.rows_q, c.hq, c.dv), self.nvdt), arr

    def side(self):
        c = self.c
        padded = MASKS[c.mask][0]
        return dict(Bias=T(self.bias_arr), SoftmaxOffset=T(self.alpha),
                    cu_seqlens_q=T(self.cu_q) if padded or self.qf == "thd" else None,
                    cu_seqlens_kv=T(self.cu_kv) if padded or self.kvf == "thd" else None,
                    cu_seqlens_q_padded=T(self.pad_q), cu_seqlens_kv_padded=T(self.pad_kv))

    def scalars(self):
        c = self.c
        return dict(max_seqlen_q=c.sq, max_seqlen_kv=c.skv, attn_scale=self.cfg.scale,
                    dropout=c.dropout, qkv_layout=getattr(L, c.layout),
                    bias_type=BIAS_ENUM[c.bias], attn_mask_type=mask_enum(c.mask),
                    softmax_type=SOFTMAX_ENUM[c.softmax], window_size_left=c.wl,
                    window_size_right=c.wr, bottom_right_diagonal=c.bottom_right_diagonal)

    def forward(self, aux="alloc"):
        c = self.c
        side = self.side()
        rows3 = self.qkv_rows(self.q, self.k, self.v, np.nan)
        self.tables = [None, None]
        if self.group == "paged":
            n, self.tables = self.page_tables()
            rows3 = [rows3[0], self.paged_cache(self.k, self.tables[0], n, np.nan),
                     self.paged_cache(self.v, self.tables[1], n, np.nan)]
        self.tq, _ = self.qkv_tensors(rows3)
        self.o_t, self.o_arr = self.out_tensor(np.full((self.rows_q, c.hq, c.dv), np.nan))
        kw = dict(**side, S=None, page_table_k=T(self.tables[0]), page_table_v=T(self.tables[1]),
                  rng_state=T(self.rng_state), is_training=c.is_training,
                  return_max_logit=c.return_max_logit, cuda_graph=False, **self.scalars())
        call = lambda a: nvte.fused_attn_fwd(*self.tq, O=self.o_t, aux=a, **kw)
        if aux is None:
            self.aux_arrays = None
            return call(None)
        self.described = call([])
        self.aux_arrays, self.aux = aux_pack(self.described, self.npdt)
        call(self.aux)

    def backward(self, aux="forward"):
        c = self.c
        do_rows = to_rows(self.do, self.qf, self.lens_q, self.offs_q, self.rows_q, np.nan)
        self.do_t, _ = self.out_tensor(do_rows)
        nan_rows = self.qkv_rows(*(np.full_like(x, np.nan) for x in (self.q, self.k, self.v)), np.nan)
        self.grads_t, self.grad_views = self.qkv_tensors(nan_rows)
        has_dbias = self.bias_arr is not None and c.bias != "alibi"
        self.dbias_arr = np.full(self.bias_arr.shape, np.nan, self.bias_arr.dtype) if has_dbias else None
        self.dalpha_arr = None if self.alpha is None else np.full(self.alpha.shape, np.nan, np.float32)
        side = self.side()
        nvte.fused_attn_bwd(*self.tq, self.o_t, self.do_t, None, None, self.aux if aux == "forward" else aux,
                            *self.grads_t, T(self.dbias_arr), T(self.dalpha_arr), side["cu_seqlens_q"],
                            side["cu_seqlens_kv"], side["cu_seqlens_q_padded"], side["cu_seqlens_kv_padded"],
                            deterministic=True, cuda_graph=False, **self.scalars())

    # --- checks
    def canon_rows(self, canon, q_side):
        if q_side:
            return to_rows(canon, self.qf, self.lens_q, self.offs_q, self.rows_q, 0.0)
        return to_rows(canon, self.kvf, self.lens_kv, self.offs_kv, self.rows_kv, 0.0)

    def check_forward(self):
        c = self.c
        o_ref, lse_ref, mx_ref = fused_attn_ref(self.q, self.k, self.v, self.cfg, self.ex)
        assert_close(self.o_arr, self.canon_rows(o_ref, True), c.dtype)
        if self.aux_arrays is None:
            return
        assert_close(self.aux_arrays[0][..., 0], lse_ref, "float32")
        i = 1
        if c.return_max_logit:
            assert_close(self.aux_arrays[1][..., 0], mx_ref, "float32")
            i = 2
        assert np.array_equal(self.aux_arrays[i], self.rng_state), "aux rng_state is a copy of rng_state"
        if self.bias_arr is not None:
            assert np.array_equal(self.aux_arrays[i + 1].view(np.uint8), self.bias_arr.view(np.uint8))
        if c.softmax != "vanilla":
            want = self.alpha if self.alpha is not None else np.zeros((1, c.hq, 1, 1), np.float32)
            assert np.array_equal(self.aux_arrays[-1], want)

    def check_backward(self):
        c = self.c
        o = self.canon_from_o()
        lse = self.aux_arrays[0][..., 0].astype(np.float64)
        bias_shape = None if self.dbias_arr is None else self.dbias_arr.shape
        dq, dk, dv, dbias, dalpha = fused_attn_bwd_ref(self.q, self.k, self.v, o, self.do, lse,
                                                       self.cfg, self.ex, bias_shape)
        for got, ref, q_side in zip(self.grad_views, (dq, dk, dv), (True, False, False)):
            assert_close(got, self.canon_rows(ref, q_side), c.dtype)
        if dbias is not None:
            assert_close(self.dbias_arr, dbias, c.dtype)
        if self.dalpha_arr is not None:
            assert_close(self.dalpha_arr.reshape(-1), dalpha, "float32", atol=1e-5)

    def canon_from_o(self, rows=None):
        """The stored O (or O-shaped token rows) in canonical form (what the kernel's backward reads)."""
        c = self.c
        rows = (self.o_arr if rows is None else rows).astype(np.float64)
        out = np.zeros((c.b, c.sq, c.hq, c.dv))
        if self.qf == "bshd":
            out[:] = rows.reshape(c.b, c.sq, c.hq, c.dv)
        elif self.qf == "sbhd":
            out[:] = rows.reshape(c.sq, c.b, c.hq, c.dv).transpose(1, 0, 2, 3)
        else:
            for i in range(c.b):
                out[i, :self.lens_q[i]] = rows[self.offs_q[i]:self.offs_q[i] + self.lens_q[i]]
        return out


def run_case(case, rng, backward=True):
    r = Run(case, rng)
    r.forward()
    r.check_forward()
    if backward:
        r.backward()
        r.check_backward()
    return r
