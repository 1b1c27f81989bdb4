// cuda/cudnn/fused_attn_seqlens.cu - see fused_attn_seqlens.h. Clamping keeps a malformed
// cu_seqlens from sending cuDNN lengths beyond the padded tensors. The FP8 scalar operations use
// __frcp_rn (IEEE round-to-nearest reciprocal, whatever the fast-math flags) so that a
// scale_inv / descale equals the host's 1.0f / scale bit for bit.
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

// One thread applies the ops in order: several may fold into the same buffer (the PyTorch
// adapter gives dQ, dK and dV one amax), and parallel read-modify-writes would keep only one.
__global__ void scalar_ops_kernel(ScalarOps ops) {
  for (int i = 0; i < ops.n; ++i) {
    const ScalarOp o = ops.op[i];
    if (o.dst == nullptr) continue;
    switch (o.kind) {
      case ScalarOp::kSet: *o.dst = o.src ? *o.src : 1.0f; break;
      case ScalarOp::kRecip: *o.dst = __frcp_rn(*o.src); break;
      case ScalarOp::kFoldUnit: *o.dst = fmaxf(*o.dst, *o.src > 0.0f ? 1.0f : 0.0f); break;
      default: *o.dst = fmaxf(*o.dst, *o.src); break;
    }
  }
}

}  // namespace

void run_scalar_ops(const ScalarOps &ops, cudaStream_t stream) {
  if (ops.n == 0) return;
  scalar_ops_kernel<<<1, 1, 0, stream>>>(ops);
  NVTE_CHECK_LAUNCH();
}

void seqlens_from_cu(const int32_t *cu_q, const int32_t *cu_kv, int32_t *seq_q, int32_t *seq_kv, size_t batch,
                     size_t max_q, size_t max_kv, cudaStream_t stream) {
  if (batch == 0) return;
  seqlens_kernel<<<(unsigned)((batch + 255) / 256), 256, 0, stream>>>(cu_q, cu_kv, seq_q, seq_kv, batch,
                                                                      (int32_t)max_q, (int32_t)max_kv);
  NVTE_CHECK_LAUNCH();
}

}  // namespace nvte::cuda
