// cuda/cudnn/fused_attn_thd_decode.cpp - see fused_attn_thd_decode.h. Why: a THD graph has to
// take max_seqlen_q >= 2 (cuDNN 9.19's decode kernel writes row 0 of a sequence without queries,
// which in THD is the next sequence's token: graph_params), and cuDNN then runs its general
// kernel (H100, b=16, 32/8 heads, d=128, 4096 cached keys: 0.262 ms against 0.107 as BSHD
// queries). As BSHD queries [n, 1] the decode kernel runs, and a row it writes for a sequence
// without a query stays in the scratch. The copies move n * h * d elements each way, next to the
// b * s_kv * h_kv * d of K and V that the step reads. No cuDNN frontend here: the BSHD call goes
// through the backend's own entry point (fused_attn_fwd on decode_view's parameters).
//
// With plain K/V the graph's batch is the call's (K and V are [b, s] tensors): one run. With a
// paged cache the graph's batch n is fixed by the query rows (the workspace queries see no batch)
// and the call runs over sequences [0, n), [n, 2n), ..., each run with its own cu_seqlens and
// page-table rows copied into the workspace (decode_chunk_inputs) and, in training, its
// statistics through a scratch.
#include "fused_attn_thd_decode.h"

#include <cuda_runtime.h>

#include "../cuda_check.h"
#include "fused_attn_cudnn_calls.h"
#include "fused_attn_seqlens.h"

namespace nvte::cuda::cudnn_attn {
namespace {

const int32_t *i32(const Tensor *t) { return static_cast<const int32_t *>(data(t)); }

Tensor device_tensor(void *ptr, NVTEDType dtype, std::initializer_list<size_t> dims) {
  Tensor t;
  t.params[kNVTERowwiseData].data_ptr = ptr;
  t.params[kNVTERowwiseData].dtype = dtype;
  t.params[kNVTERowwiseData].shape = nvte_make_shape(dims.begin(), dims.size());
  return t;
}

// The workspace after the BSHD call's: Q and O scratch [n, h, d], then (paged) the chunk's
// cu_seqlens of both sides, its page-table rows of K and V and (training) its statistics.
struct Layout {
  size_t inner, q, o, cu_q, cu_kv, page_k, page_v, stats, total;
};
Layout layout_of(const AttnParams &p, const AttnParams &v) {
  const size_t n = v.batch, es = dtype_size(p.dtype);
  Layout l{};
  l.inner = align256(fused_attn_fwd_workspace_bytes(v));
  l.q = l.inner;
  l.o = l.q + align256(n * p.h_q * p.d_qk * es);
  size_t x = l.o + align256(n * p.h_q * p.d_v * es);
  if (p.layout.paged) {
    l.cu_q = x;
    l.cu_kv = x += align256((n + 1) * 4);
    l.page_k = x += align256((n + 1) * 4);
    l.page_v = x += align256(n * v.pages_per_seq * 4);
    l.stats = x += align256(n * v.pages_per_seq * 4);
    if (p.is_training) x += align256(n * p.h_q * 4);
  }
  l.total = x;
  return l;
}

}  // namespace

size_t thd_decode_fwd_workspace_bytes(const AttnParams &p) { return layout_of(p, decode_view(p)).total; }

void thd_decode_fwd(const AttnParams &p, const attn::AttnFwdTensors &t, Tensor *workspace, cudaStream_t stream) {
  NVTE_CHECK(t.cu_q != nullptr && t.cu_kv != nullptr, "THD needs cu_seqlens_q and cu_seqlens_kv");
  const AttnParams v = decode_view(p);
  const Layout l = layout_of(p, v);
  const size_t n = v.batch, es = dtype_size(p.dtype);
  char *ws = static_cast<char *>(data(workspace));
  const NVTEBasicTensor wb = workspace ? workspace->params[kNVTERowwiseData] : NVTEBasicTensor{};
  NVTE_CHECK(ws != nullptr && numel(wb.shape) * dtype_size(wb.dtype) >= l.total, "fused attention on the GPU needs a ",
             "workspace of ", l.total, " bytes (query it with nvte_fused_attn_fwd_workspace_size)");
  NVTE_CHECK(reinterpret_cast<uintptr_t>(ws) % 256 == 0, "the fused attention workspace must be 256-byte aligned");

  // Rows of no sequence are zero (fused_attn.h); each run copies its decode rows over them.
  const NVTEBasicTensor &ob = t.o->params[kNVTERowwiseData];
  NVTE_CHECK_CUDA(cudaMemsetAsync(data(t.o), 0, numel(ob.shape) * dtype_size(ob.dtype), stream));
  const attn::TensorPlacement &pq = p.qkv.t[attn::kQ];
  const int32_t *cu = i32(t.cu_q), *pad = i32(t.cu_q_padded);
  Tensor qs = device_tensor(ws + l.q, p.dtype, {n, 1, p.h_q, p.d_qk});
  Tensor os = device_tensor(ws + l.o, p.dtype, {n, 1, p.h_q, p.d_v});
  Tensor wsi = device_tensor(ws, kNVTEByte, {l.inner});
  Tensor cq = device_tensor(ws + l.cu_q, kNVTEInt32, {n + 1}), ckv = device_tensor(ws + l.cu_kv, kNVTEInt32, {n + 1});
  Tensor pk = device_tensor(ws + l.page_k, kNVTEInt32, {n, v.pages_per_seq});
  Tensor pv = device_tensor(ws + l.page_v, kNVTEInt32, {n, v.pages_per_seq});
  float *stats = static_cast<float *>(data(t.stats));
  Tensor st = device_tensor(ws + l.stats, kNVTEFloat32, {n, p.h_q, 1, 1});
  for (size_t start = 0; start < p.batch; start += n) {
    thd_decode_rows(const_cast<void *>(data(t.q)), ws + l.q, true, cu, pad, p.batch, start, n, p.rows_q,
                    pq.row_stride * es, p.h_q, pq.head_stride * es, p.d_qk * es, stream);
    attn::AttnFwdTensors tv = t;
    tv.q = &qs;
    tv.o = &os;
    tv.cu_q_padded = nullptr;
    tv.aux_rng = tv.aux_bias = tv.aux_offset = nullptr;  // the caller's fused_attn_fwd copies them
    if (p.layout.paged) {
      DecodeChunk c;
      c.cu_q = cu;
      c.cu_kv = i32(t.cu_kv);
      c.page_k = i32(t.page_k);
      c.page_v = i32(t.page_v);
      c.cu_q_out = static_cast<int32_t *>(data(&cq));
      c.cu_kv_out = static_cast<int32_t *>(data(&ckv));
      c.page_k_out = static_cast<int32_t *>(data(&pk));
      c.page_v_out = static_cast<int32_t *>(data(&pv));
      c.batch = p.batch;
      c.start = start;
      c.n = n;
      c.width = p.pages_per_seq;
      c.used = v.pages_per_seq;
      decode_chunk_inputs(c, stream);
      tv.cu_q = &cq;
      tv.cu_kv = &ckv;
      tv.page_k = &pk;
      tv.page_v = &pv;
      if (stats) tv.stats = &st;
    }
    fused_attn_fwd(v, tv, &wsi, stream);
    thd_decode_rows(data(t.o), ws + l.o, false, cu, pad, p.batch, start, n, p.rows_q, p.out.row_stride * es, p.h_q,
                    p.out.head_stride * es, p.d_v * es, stream);
    if (p.layout.paged && stats) {  // statistics [b, h, 1]: the run's sequences are one span
      const size_t count = p.batch - start < n ? p.batch - start : n;
      NVTE_CHECK_CUDA(cudaMemcpyAsync(stats + start * p.h_q, ws + l.stats, count * p.h_q * 4,
                                      cudaMemcpyDeviceToDevice, stream));
    }
  }
}

}  // namespace nvte::cuda::cudnn_attn
