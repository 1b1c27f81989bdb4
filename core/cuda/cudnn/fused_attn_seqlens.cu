// cuda/cudnn/fused_attn_seqlens.cu - see fused_attn_seqlens.h. Clamping keeps a malformed
// cu_seqlens from sending cuDNN lengths beyond the padded tensors.
#include "../common.cuh"
#include "fused_attn_seqlens.h"

namespace nvte::cuda {
namespace {

__global__ void seqlens_kernel(const int32_t *cu_q, const int32_t *cu_kv, int32_t *seq_q, int32_t *seq_kv,
                               size_t batch, int32_t max_q, int32_t max_kv) {
  const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= batch) return;
  const int32_t lq = cu_q[i + 1] - cu_q[i], lkv = cu_kv[i + 1] - cu_kv[i];
  seq_q[i] = lq < 0 ? 0 : (lq > max_q ? max_q : lq);
  seq_kv[i] = lkv < 0 ? 0 : (lkv > max_kv ? max_kv : lkv);
}

}  // namespace

void seqlens_from_cu(const int32_t *cu_q, const int32_t *cu_kv, int32_t *seq_q, int32_t *seq_kv, size_t batch,
                     size_t max_q, size_t max_kv, cudaStream_t stream) {
  if (batch == 0) return;
  seqlens_kernel<<<(unsigned)((batch + 255) / 256), 256, 0, stream>>>(cu_q, cu_kv, seq_q, seq_kv, batch,
                                                                      (int32_t)max_q, (int32_t)max_kv);
  NVTE_CHECK_LAUNCH();
}

}  // namespace nvte::cuda
