"""nvte_fused_attn_fwd / _bwd refuse outputs that share memory with what the call reads or with
another output (O, the statistics over Q / V; dQ over Q or dO, dK = dV, dV over the statistics);
packed gradients (one buffer by the layout) still pass; the CPU workspace queries check shapes as
the calls do; shapes whose byte count overflows size_t are refused where they are set. A shared
byte had been a silently wrong result (the outputs are filled before the inputs are read)."""
import numpy as np
import pytest

from transformer_engine import _nvte as nvte

L, M, BT, ST = nvte.NVTE_QKV_Layout, nvte.NVTE_Mask_Type, nvte.NVTE_Bias_Type, nvte.NVTE_Softmax_Type
D = nvte.DType
NV = {np.dtype(np.float32): D.kFloat32, np.dtype(np.int64): D.kInt64}
B, S, H, DH = 2, 5, 2, 4


def T(arr, shape=None, dtype=None, ptr=None):
    t = nvte.Tensor()
    t.set_param(nvte.Param.kRowwiseData, arr.ctypes.data if ptr is None else ptr,
                list(arr.shape if shape is None else shape), NV[arr.dtype] if dtype is None else dtype)
    t._refs = arr
    return t


def fwd_kw(**over):
    kw = dict(Bias=None, SoftmaxOffset=None, S=None, cu_seqlens_q=None, cu_seqlens_kv=None,
              cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None, page_table_k=None, page_table_v=None,
              rng_state=None, max_seqlen_q=S, max_seqlen_kv=S, is_training=True, return_max_logit=False,
              cuda_graph=False, attn_scale=0.5, dropout=0.0, qkv_layout=L.NVTE_BSHD_BSHD_BSHD,
              bias_type=BT.NVTE_NO_BIAS, attn_mask_type=M.NVTE_NO_MASK, softmax_type=ST.NVTE_VANILLA_SOFTMAX,
              window_size_left=-1, window_size_right=-1, bottom_right_diagonal=False)
    kw.update(over)
    return kw


def bwd_kw(**over):
    kw = dict(S=None, dP=None, dBias=None, dSoftmaxOffset=None, cu_seqlens_q=None, cu_seqlens_kv=None,
              cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None, max_seqlen_q=S, max_seqlen_kv=S,
              attn_scale=0.5, dropout=0.0, qkv_layout=L.NVTE_BSHD_BSHD_BSHD, bias_type=BT.NVTE_NO_BIAS,
              attn_mask_type=M.NVTE_NO_MASK, softmax_type=ST.NVTE_VANILLA_SOFTMAX, window_size_left=-1,
              window_size_right=-1, bottom_right_diagonal=False, deterministic=True, cuda_graph=False)
    kw.update(over)
    return kw


def draw(seed):
    g = np.random.default_rng(seed)
    return [g.normal(size=(B, S, H, DH)).astype(np.float32) for _ in range(3)]


def forward(q, k, v, o=None, stats_over=None):
    """A training forward; stats_over: an array whose start the statistics slot is laid over."""
    o = np.zeros_like(q) if o is None else o
    desc = nvte.fused_attn_fwd(T(q), T(k), T(v), O=T(o), aux=[], **fwd_kw())
    stats = np.zeros(desc[0][0], np.float32)
    rng = np.zeros(2, np.int64)
    hs = [T(stats) if stats_over is None else T(stats_over, desc[0][0], D.kFloat32), T(rng)]
    nvte.fused_attn_fwd(T(q), T(k), T(v), O=T(o), aux=hs, **fwd_kw())
    return o, stats, hs


def test_forward_outputs_apart_from_inputs():
    q, k, v = draw(1)
    o_ref, _, _ = forward(q, k, v)
    for name, make in (("O shares memory with Q", lambda c: dict(q=c, o=c)),
                       ("O shares memory with V", lambda c: dict(v=c, o=c))):
        args = dict(q=q, k=k, v=v)
        c = (q if "Q" in name else v).copy()
        args.update(make(c))
        before = c.copy()
        with pytest.raises(nvte.Error, match=name):
            forward(args["q"], args["k"], args["v"], o=args["o"])
        assert np.array_equal(c, before)  # refused before anything was written
    qc = q.copy()
    with pytest.raises(nvte.Error, match=r"softmax statistics\) shares memory with Q"):
        forward(qc, k, v, stats_over=qc)
    o, _, _ = forward(q, k, v)  # and separate buffers still work
    assert np.array_equal(o, o_ref)


def test_backward_outputs_apart_from_inputs_and_each_other():
    q, k, v = draw(2)
    do = draw(3)[0]
    o, stats, hs = forward(q, k, v)

    def bwd(dq=None, dk=None, dv=None, q_=q, do_=do, aux=hs):
        dq = np.zeros_like(q) if dq is None else dq
        dk = np.zeros_like(k) if dk is None else dk
        dv = np.zeros_like(v) if dv is None else dv
        nvte.fused_attn_bwd(T(q_), T(k), T(v), T(o), T(do_), aux=aux, dQ=T(dq), dK=T(dk), dV=T(dv), **bwd_kw())
        return dq, dk, dv

    ref = bwd()
    qc, doc, shared = q.copy(), do.copy(), np.zeros_like(k)
    with pytest.raises(nvte.Error, match="dQ shares memory with Q"):
        bwd(dq=qc, q_=qc)
    with pytest.raises(nvte.Error, match="dQ shares memory with dO"):
        bwd(dq=doc, do_=doc)
    with pytest.raises(nvte.Error, match="dK shares memory with dV"):
        bwd(dk=shared, dv=shared)
    dv = np.zeros_like(v)
    dv.reshape(-1)[:stats.size] = stats.reshape(-1)
    with pytest.raises(nvte.Error, match=r"dV shares memory with Aux_CTX_Tensors\[0\]"):
        bwd(dv=dv, aux=[T(dv, stats.shape, D.kFloat32), hs[1]])
    assert all(np.array_equal(a, b) for a, b in zip(bwd(), ref))


def test_packed_gradients_share_their_buffer():
    """BS3HD: dQ, dK, dV are one interleaved buffer by the layout (not an overlap)."""
    g = np.random.default_rng(4)
    qkv = g.normal(size=(B, S, 3, H, DH)).astype(np.float32)
    dqkv = np.zeros_like(qkv)
    o, do = np.zeros((B, S, H, DH), np.float32), g.normal(size=(B, S, H, DH)).astype(np.float32)
    step = H * DH * 4
    Q, K, V = (T(qkv, (B, S, H, DH), ptr=qkv.ctypes.data + i * step) for i in range(3))
    kw = fwd_kw(qkv_layout=L.NVTE_BS3HD)
    desc = nvte.fused_attn_fwd(Q, K, V, O=T(o), aux=[], **kw)
    stats, rng = np.zeros(desc[0][0], np.float32), np.zeros(2, np.int64)
    hs = [T(stats), T(rng)]
    nvte.fused_attn_fwd(Q, K, V, O=T(o), aux=hs, **kw)
    dQ, dK, dV = (T(dqkv, (B, S, H, DH), ptr=dqkv.ctypes.data + i * step) for i in range(3))
    nvte.fused_attn_bwd(Q, K, V, T(o), T(do), aux=hs, dQ=dQ, dK=dK, dV=dV, **bwd_kw(qkv_layout=L.NVTE_BS3HD))
    assert np.isfinite(dqkv).all() and np.abs(dqkv).sum() > 0


def test_cpu_workspace_queries_check_shapes():
    q, k, v = draw(5)
    k3 = np.zeros((3, S, H, DH), np.float32)
    sc = dict(dropout=0.0, qkv_layout=L.NVTE_BSHD_BSHD_BSHD, bias_type=BT.NVTE_NO_BIAS,
              attn_mask_type=M.NVTE_NO_MASK, softmax_type=ST.NVTE_VANILLA_SOFTMAX)
    assert nvte.fused_attn_fwd_workspace_size(T(q), T(k), T(v), None, S, S, True, False, *sc.values(),
                                              -1, -1, False) == 0
    with pytest.raises(nvte.Error, match="K has batch 3 but Q has batch 2"):
        nvte.fused_attn_fwd_workspace_size(T(q), T(k3), T(k3), None, S, S, True, False, *sc.values(), -1, -1, False)
    with pytest.raises(nvte.Error, match="K has batch 3 but Q has batch 2"):
        nvte.fused_attn_bwd_workspace_size(T(q), T(k3), T(k3), None, S, S, *sc.values(), -1, -1, False, False)
    sc["bias_type"] = BT.NVTE_POST_SCALE_BIAS
    with pytest.raises(nvte.Error, match="needs a Bias tensor"):
        nvte.fused_attn_fwd_workspace_size(T(q), T(k), T(v), None, S, S, True, False, *sc.values(), -1, -1, False)


def test_byte_count_overflow_is_refused_where_the_shape_is_set():
    """2^64 elements wrap to 0 in size_t: every later size check would pass (the forward then read
    through a 64-byte buffer and died of SIGSEGV)."""
    buf = np.zeros(16, np.float32)
    t = nvte.Tensor()
    with pytest.raises(nvte.Error, match="more bytes than size_t can count"):
        t.set_param(nvte.Param.kRowwiseData, buf.ctypes.data, [1, 2 ** 32, 2 ** 16, 2 ** 16], D.kFloat32)
    with pytest.raises(nvte.Error, match="more bytes than size_t can count"):
        t.set_param(nvte.Param.kRowwiseData, buf.ctypes.data, [2 ** 62, 8], D.kFloat32)
    t.set_param(nvte.Param.kRowwiseData, buf.ctypes.data, [0, 2 ** 62, 2 ** 62], D.kFloat32)  # empty: fine
    t.set_param(nvte.Param.kRowwiseData, buf.ctypes.data, [4, 4], D.kFloat32)
