// cuda/attn_merge.cu - the softmax-statistics merge of context-parallel attention on the GPU.
//
// Design: one warp per (token, head). Its lanes read the two statistics first, compute the
// weights in float32 (common/attn_merge.h's rule, shared with the CPU reference), scale-and-add
// the head's row of out in 4-element vectors where the row length and buffers allow, and lane 0
// writes the new statistic after a __syncwarp: no other warp touches that (token, head), so the
// in-place update needs no second pass. It replaces the ~10 elementwise torch kernels per ring
// step (logaddexp, exps, broadcast multiplies) that the adapter used to launch. The sink's
// gradient: a cluster of blocks per head on sm_90 (one block elsewhere), its rows summed in a
// fixed order (no scratch, deterministic; see sink_grad_block_sum).
#include <cooperative_groups.h>

#include <algorithm>

#include "attn_merge.h"
#include "common.cuh"
#include "pdl.cuh"

namespace nvte::cuda {
namespace {

constexpr int kWarps = 8;

template <class P, int V, bool kZero>
__global__ void __launch_bounds__(kWarps * 32)
    merge_kernel(attn_merge::Geometry g, float *__restrict__ out, float *__restrict__ lse,
                 const P *__restrict__ part, const float *__restrict__ plse, int64_t pairs) {
  const int lane = threadIdx.x & 31;
  const int64_t pair = (int64_t)blockIdx.x * kWarps + (threadIdx.x >> 5);
  if (pair >= pairs) return;
  const int64_t h = pair % g.heads, tok = pair / g.heads;
  const int64_t j = tok % g.part_rows, n = tok / g.part_rows, s = g.row_offset + j;
  float *lp = lse + n * g.lse_n + s * g.lse_s + h * g.lse_h;
  const float a = *lp, b = plse[n * g.plse_n + j * g.plse_s + h * g.plse_h];
  float wa, wb, nl;
  if (!attn_merge::merge_weights<float>(a, b, wa, wb, nl)) return;
  const int64_t hd = g.heads * g.dim;
  float *o = out + (n * g.out_tok_n + s * g.out_tok_s) * hd + h * g.dim;
  const P *p = kZero ? nullptr : part + (n * g.part_tok_n + j * g.part_tok_s) * hd + h * g.dim;
  for (int64_t d = (int64_t)lane * V; d < g.dim; d += 32 * V) {
    Vec<float, V> ov = load_vec<float, V>(o + d);
    if constexpr (kZero) {
#pragma unroll
      for (int i = 0; i < V; ++i) ov.v[i] *= wa;
    } else {
      const Vec<P, V> pv = load_vec<P, V>(p + d);
#pragma unroll
      for (int i = 0; i < V; ++i) ov.v[i] = wa * ov.v[i] + wb * load_f32(pv.v[i]);
    }
    store_vec<float, V>(o + d, ov);
  }
  __syncwarp();  // every lane has read *lp (at the top) before it changes
  if (lane == 0) *lp = nl;
}

bool aligned(const void *p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

template <class P, bool kZero>
void launch(const attn_merge::Geometry &g, float *o, float *l, const P *p, const float *pl, cudaStream_t stream) {
  const int64_t pairs = g.batch * g.part_rows * g.heads;
  const int64_t blocks = (pairs + kWarps - 1) / kWarps;
  NVTE_CHECK(blocks <= 0x7fffffff, "attn_merge: ", pairs, " (token, head) pairs are too many for one launch");
  const bool vec4 = g.dim % 4 == 0 && aligned(o, 16) && (kZero || aligned(p, 4 * sizeof(P)));
  if (vec4)
    merge_kernel<P, 4, kZero><<<(unsigned)blocks, kWarps * 32, 0, stream>>>(g, o, l, p, pl, pairs);
  else
    merge_kernel<P, 1, kZero><<<(unsigned)blocks, kWarps * 32, 0, stream>>>(g, o, l, p, pl, pairs);
  NVTE_CHECK_LAUNCH();
}

// dsink of one head. Each row is read by `lpr` consecutive threads (a power of two covering the
// head dim in V-element vectors: 16 of them at d 128 in bf16), so a 1024-thread block reads
// 1024 / lpr rows per pass and keeps several passes' loads in flight. The row's sink share
// exp(sink - lse) is the same for its threads, so each thread folds it into its own partial dot
// and the block reduces once at the end, in a fixed order: the same rows always meet the same
// threads and the same sums (deterministic, no scratch). A per-row shuffle reduction made the
// first version latency-bound (233 GB/s on an H100, slower than the torch ops it replaced).
// With one block per head only `heads` SMs work (873 GB/s at 32 heads on an H100), so on sm_90 a
// cluster of kClusterBlocks blocks shares each head's rows and block 0 adds the blocks' sums
// from their shared memory (distributed shared memory) in rank order: still deterministic and
// without scratch, with every SM busy.
constexpr int kGradThreads = 1024;
constexpr int kClusterBlocks = 8;

// The block's sum over rows [r0, r1) of exp(sink - lse) * dot(out, dout), in thread 0 (fixed order).
template <class O, int V>
__device__ float sink_grad_block_sum(const attn_merge::Geometry &g, const O *__restrict__ dout,
                                     const O *__restrict__ out, const float *__restrict__ lse, float alpha,
                                     int64_t h, int64_t r0, int64_t r1, int lpr) {
  const int64_t hd = g.heads * g.dim, per_pass = kGradThreads / lpr;
  const int sl = threadIdx.x % lpr;
  float acc = 0.0f;
#pragma unroll 4
  for (int64_t r = r0 + threadIdx.x / lpr; r < r1; r += per_pass) {
    const int64_t n = r / g.rows, s = r % g.rows;
    const float a = lse[n * g.lse_n + s * g.lse_s + h * g.lse_h];
    const float share = a == -INFINITY ? 0.0f : expf(alpha - a);  // (rows without keys: none)
    const int64_t off = (n * g.out_tok_n + s * g.out_tok_s) * hd + h * g.dim;
    float dot = 0.0f;
    for (int64_t k = (int64_t)sl * V; k < g.dim; k += (int64_t)lpr * V) {
      const Vec<O, V> x = load_vec<O, V>(out + off + k), y = load_vec<O, V>(dout + off + k);
#pragma unroll
      for (int i = 0; i < V; ++i) dot += load_f32(x.v[i]) * load_f32(y.v[i]);
    }
    acc += share * dot;
  }
  for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  __shared__ float warp_sum[kGradThreads / 32];
  if (threadIdx.x % 32 == 0) warp_sum[threadIdx.x / 32] = acc;
  __syncthreads();
  float total = 0.0f;
  if (threadIdx.x == 0)
    for (int w = 0; w < kGradThreads / 32; ++w) total += warp_sum[w];
  return total;
}

template <class O, int V>
__global__ void __launch_bounds__(kGradThreads)
    sink_grad_kernel(attn_merge::Geometry g, const O *__restrict__ dout, const O *__restrict__ out,
                     const float *__restrict__ lse, const float *__restrict__ sink, float *__restrict__ dsink,
                     int lpr) {
  const int64_t h = blockIdx.x;
  const float total = sink_grad_block_sum<O, V>(g, dout, out, lse, sink[h], h, 0, g.batch * g.rows, lpr);
  if (threadIdx.x == 0) dsink[h] = -total;
}

// Launched with clusters of kClusterBlocks along x (sm_90 code only: launch_grad checks the binary).
template <class O, int V>
__global__ void __launch_bounds__(kGradThreads)
    sink_grad_cluster_kernel(attn_merge::Geometry g, const O *__restrict__ dout, const O *__restrict__ out,
                             const float *__restrict__ lse, const float *__restrict__ sink,
                             float *__restrict__ dsink, int lpr) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  const int part = (int)cluster.block_rank();
  const int64_t h = blockIdx.x / kClusterBlocks, rows = g.batch * g.rows;
  const int64_t chunk = (rows + kClusterBlocks - 1) / kClusterBlocks;
  const int64_t r0 = std::min<int64_t>(rows, part * chunk), r1 = std::min<int64_t>(rows, r0 + chunk);
  __shared__ float block_total;
  const float total = sink_grad_block_sum<O, V>(g, dout, out, lse, sink[h], h, r0, r1, lpr);
  if (threadIdx.x == 0) block_total = total;
  cluster.sync();  // every block's sum is in its shared memory
  if (part == 0 && threadIdx.x == 0) {
    float sum = 0.0f;
    for (int b = 0; b < kClusterBlocks; ++b) sum += *cluster.map_shared_rank(&block_total, b);
    dsink[h] = -sum;
  }
  cluster.sync();  // (the peers' shared memory stays until block 0 has read it)
#endif
}

// Whether `kernel` runs as code compiled for sm_90+ on this device (its PTX version: a JIT of
// older PTX on Hopper still has the empty pre-sm_90 body).
bool compiled_sm90(const void *kernel) {
  cudaFuncAttributes a{};
  NVTE_CHECK_CUDA(cudaFuncGetAttributes(&a, kernel));
  return a.ptxVersion >= 90;
}

template <class O, int V>
void launch_grad_kernel(const attn_merge::Geometry &g, const O *d, const O *o, const float *l, const float *sk,
                        float *ds, int lpr, cudaStream_t stream) {
  if (!pdl_supported() || !compiled_sm90((const void *)sink_grad_cluster_kernel<O, V>)) {  // (pdl: sm_90+)
    sink_grad_kernel<O, V><<<(unsigned)g.heads, kGradThreads, 0, stream>>>(g, d, o, l, sk, ds, lpr);
    NVTE_CHECK_LAUNCH();
    return;
  }
  NVTE_CHECK(g.heads <= 0x7fffffff / kClusterBlocks, "attn_merge_sink_grad: too many heads (", g.heads, ")");
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3((unsigned)(g.heads * kClusterBlocks));
  cfg.blockDim = dim3(kGradThreads);
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = kClusterBlocks;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  NVTE_CHECK_CUDA(cudaLaunchKernelEx(&cfg, sink_grad_cluster_kernel<O, V>, g, d, o, l, sk, ds, lpr));
}

template <class O>
void launch_grad(const attn_merge::Geometry &g, const O *d, const O *o, const float *l, const float *sk, float *ds,
                 cudaStream_t stream) {
  NVTE_CHECK(g.heads <= 0x7fffffff, "attn_merge_sink_grad: too many heads (", g.heads, ")");
  constexpr int kV = 16 / sizeof(O);  // 16-byte loads
  const bool vec = g.dim % kV == 0 && aligned(o, 16) && aligned(d, 16);
  const int64_t units = vec ? g.dim / kV : g.dim;
  int lpr = 1;
  while (lpr < 32 && lpr < units) lpr *= 2;
  if (vec)
    launch_grad_kernel<O, kV>(g, d, o, l, sk, ds, lpr, stream);
  else
    launch_grad_kernel<O, 1>(g, d, o, l, sk, ds, lpr, stream);
}

}  // namespace

void attn_merge_sink_grad(const attn_merge::Geometry &g, const Tensor &dout, const Tensor &out, const Tensor &lse,
                          const Tensor &sink, Tensor &dsink, cudaStream_t stream) {
  if (g.heads == 0) return;
  const void *d = dout.params[kNVTERowwiseData].data_ptr, *o = out.params[kNVTERowwiseData].data_ptr;
  const float *l = static_cast<const float *>(lse.params[kNVTERowwiseData].data_ptr);
  const float *sk = static_cast<const float *>(sink.params[kNVTERowwiseData].data_ptr);
  float *ds = static_cast<float *>(dsink.params[kNVTERowwiseData].data_ptr);
  switch (logical_dtype(out)) {
    case kNVTEFloat32:
      return launch_grad(g, static_cast<const float *>(d), static_cast<const float *>(o), l, sk, ds, stream);
    case kNVTEBFloat16:
      return launch_grad(g, static_cast<const bf16 *>(d), static_cast<const bf16 *>(o), l, sk, ds, stream);
    case kNVTEFloat16:
      return launch_grad(g, static_cast<const fp16 *>(d), static_cast<const fp16 *>(o), l, sk, ds, stream);
    default: NVTE_FAIL(NVTE_ERROR_INVALID_ARGUMENT, "out must be float32, bfloat16 or float16");
  }
}

void attn_merge(const attn_merge::Geometry &g, Tensor &out, Tensor &lse, const Tensor *out_part,
                const Tensor &lse_part, cudaStream_t stream) {
  float *o = static_cast<float *>(out.params[kNVTERowwiseData].data_ptr);
  float *l = static_cast<float *>(lse.params[kNVTERowwiseData].data_ptr);
  const float *pl = static_cast<const float *>(lse_part.params[kNVTERowwiseData].data_ptr);
  if (out_part == nullptr) return launch<float, true>(g, o, l, nullptr, pl, stream);
  const void *p = out_part->params[kNVTERowwiseData].data_ptr;
  switch (logical_dtype(*out_part)) {
    case kNVTEFloat32: return launch<float, false>(g, o, l, static_cast<const float *>(p), pl, stream);
    case kNVTEBFloat16: return launch<bf16, false>(g, o, l, static_cast<const bf16 *>(p), pl, stream);
    case kNVTEFloat16: return launch<fp16, false>(g, o, l, static_cast<const fp16 *>(p), pl, stream);
    default: NVTE_FAIL(NVTE_ERROR_INVALID_ARGUMENT, "out_part must be float32, bfloat16 or float16");
  }
}

}  // namespace nvte::cuda
