// cuda/cudnn/fused_attn_thd_decode.cpp - see fused_attn_thd_decode.h. Why: a THD graph has to
// take max_seqlen_q >= 2 (cuDNN 9.19's decode kernel writes row 0 of a sequence without queries,
// which in THD is the next sequence's token: graph_params), and cuDNN then runs its general
// kernel (H100, b=16, 32/8 heads, d=128, 4096 cached keys: 0.266 ms against 0.108 before that
// rule). As BSHD queries [b, 1] the decode kernel runs, and a row it writes for a sequence
// without a query stays in the scratch. The copies move b * h * d elements each way, next to the
// b * s_kv * h_kv * d of K and V that the step reads. No cuDNN frontend here: the BSHD call goes
// through the backend's own entry point.
#include "fused_attn_thd_decode.h"

#include <cuda_runtime.h>

#include "../cuda_check.h"
#include "fused_attn_seqlens.h"

namespace nvte::cuda::cudnn_attn {
namespace {

size_t align256(size_t n) { return (n + 255) / 256 * 256; }

size_t q_scratch_bytes(const AttnParams &p) { return align256(p.batch * p.h_q * p.d_qk * dtype_size(p.dtype)); }
size_t o_scratch_bytes(const AttnParams &p) { return align256(p.batch * p.h_q * p.d_v * dtype_size(p.dtype)); }

void *data(const Tensor *t) { return t ? t->params[kNVTERowwiseData].data_ptr : nullptr; }
const int32_t *i32(const Tensor *t) { return static_cast<const int32_t *>(data(t)); }

// A [b, 1, h, d] tensor of p's dtype over scratch memory.
Tensor scratch_tensor(void *ptr, const AttnParams &p, size_t d) {
  Tensor t;
  t.params[kNVTERowwiseData].data_ptr = ptr;
  t.params[kNVTERowwiseData].dtype = p.dtype;
  const size_t dims[4] = {p.batch, 1, p.h_q, d};
  t.params[kNVTERowwiseData].shape = nvte_make_shape(dims, 4);
  return t;
}

}  // namespace

size_t thd_decode_fwd_workspace_bytes(const AttnParams &p) {
  return align256(fused_attn_fwd_workspace_bytes(decode_view(p))) + q_scratch_bytes(p) + o_scratch_bytes(p);
}

void thd_decode_fwd(const AttnParams &p, const attn::AttnFwdTensors &t, Tensor *workspace, cudaStream_t stream) {
  NVTE_CHECK(t.cu_q != nullptr && t.cu_kv != nullptr, "THD needs cu_seqlens_q and cu_seqlens_kv");
  const AttnParams v = decode_view(p);
  const size_t inner = align256(fused_attn_fwd_workspace_bytes(v)), need = thd_decode_fwd_workspace_bytes(p);
  char *ws = static_cast<char *>(data(workspace));
  const NVTEBasicTensor &wb = workspace ? workspace->params[kNVTERowwiseData] : NVTEBasicTensor{};
  NVTE_CHECK(ws != nullptr && numel(wb.shape) * dtype_size(wb.dtype) >= need, "fused attention on the GPU needs a ",
             "workspace of ", need, " bytes (query it with nvte_fused_attn_fwd_workspace_size)");
  NVTE_CHECK(reinterpret_cast<uintptr_t>(ws) % 256 == 0, "the fused attention workspace must be 256-byte aligned");
  void *q_scratch = ws + inner, *o_scratch = ws + inner + q_scratch_bytes(p);
  const size_t es = dtype_size(p.dtype);
  const attn::TensorPlacement &pq = p.qkv.t[attn::kQ];
  const int32_t *cu = i32(t.cu_q), *pad = i32(t.cu_q_padded);
  thd_decode_rows(const_cast<void *>(data(t.q)), q_scratch, true, cu, pad, p.batch, p.rows_q, pq.row_stride * es,
                  p.h_q, pq.head_stride * es, p.d_qk * es, stream);

  Tensor qs = scratch_tensor(q_scratch, p, p.d_qk), os = scratch_tensor(o_scratch, p, p.d_v);
  Tensor wsi;
  wsi.params[kNVTERowwiseData].data_ptr = inner ? ws : nullptr;
  wsi.params[kNVTERowwiseData].dtype = kNVTEByte;
  wsi.params[kNVTERowwiseData].shape = nvte_make_shape(&inner, 1);
  attn::AttnFwdTensors tv = t;
  tv.q = &qs;
  tv.o = &os;
  tv.cu_q_padded = nullptr;
  tv.aux_rng = tv.aux_bias = tv.aux_offset = nullptr;  // the caller's fused_attn_fwd copies them
  fused_attn_fwd(v, tv, &wsi, stream);

  // Rows of no sequence are zero (fused_attn.h); the decode rows are then copied over them.
  void *o = data(t.o);
  const NVTEBasicTensor &ob = t.o->params[kNVTERowwiseData];
  NVTE_CHECK_CUDA(cudaMemsetAsync(o, 0, numel(ob.shape) * dtype_size(ob.dtype), stream));
  thd_decode_rows(o, o_scratch, false, cu, pad, p.batch, p.rows_q, p.out.row_stride * es, p.h_q,
                  p.out.head_stride * es, p.d_v * es, stream);
}

}  // namespace nvte::cuda::cudnn_attn
