// cuda/cudnn/fused_attn_sink.cu - see fused_attn_sink.h. Memory-bound: one read of O and dO.
// Grid (chunk, head): each warp takes rows (b, i) of its chunk (several at once when d_v is short),
// forms D = dO . O over d_v in float32 (16-byte loads when aligned), weights it by the sink's
// probability exp(alpha - stats), and the block sums its warps in a fixed order into one partial
// per (head, chunk); a second kernel adds each head's partials in order, so the result does not
// depend on scheduling.
#include "../common.cuh"
#include "../cuda_check.h"
#include "fused_attn_sink.h"

namespace nvte::cuda {
namespace {

constexpr int kWarps = 8;
constexpr size_t kChunks = 64;  // partials per head

// D = dO . O of one row over d_v, by the `lpr` lanes (a power of two) of the calling lane's group;
// every lane of the warp calls it (the shuffles need them all), `active` lanes load.
template <class T, int W>
__device__ float row_dot(const T *a, const T *b, size_t d, int sl, int lpr, bool active) {
  float acc = 0.0f;
  if (active) {
    for (size_t k = (size_t)sl * W; k < d; k += (size_t)lpr * W) {
      if constexpr (W == 1) {
        acc += load_f32(a[k]) * load_f32(b[k]);
      } else {
        const Vec<T, W> x = load_vec<T, W>(a + k), y = load_vec<T, W>(b + k);
#pragma unroll
        for (int j = 0; j < W; ++j) acc += load_f32(x.v[j]) * load_f32(y.v[j]);
      }
    }
  }
  for (int off = lpr / 2; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  return acc;
}

// A warp takes 32 / lpr rows at a time, lpr lanes each (lpr: d_v / W rounded up to a power of two,
// at most 32), so that short rows (d_v 128: 16 lanes of 16-byte loads) keep every lane loading.
template <class T, int W>
__global__ void __launch_bounds__(kWarps * 32) sink_partial_kernel(SinkRows g, int lpr, float *partial) {
  const size_t h = blockIdx.y, chunk = blockIdx.x, rows = g.batch * g.max_q;
  const size_t per = (rows + gridDim.x - 1) / gridDim.x, r0 = chunk * per, r1 = min(rows, r0 + per);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, sub = lane / lpr, sl = lane % lpr;
  const size_t rpw = 32 / lpr;  // rows per warp step
  const float alpha = g.alpha[h];
  float acc = 0.0f;
  for (size_t base = r0 + warp * rpw; base < r1; base += kWarps * rpw) {  // (warp-uniform bound)
    const size_t r = base + sub;
    float lse = -INFINITY;
    size_t off = 0;
    if (r < r1) {
      const size_t b = r / g.max_q, i = r % g.max_q;
      lse = g.stats[(b * g.heads + h) * g.max_q + i];
      off = attn::element_offset(g.out, attn::token_row(g.out.format, b, i, g.batch, g.max_q, 0), h);
    }
    const bool active = lse != -INFINITY;  // (padded rows and rows past the chunk contribute nothing)
    const float d = row_dot<T, W>(static_cast<const T *>(g.o) + off, static_cast<const T *>(g.d_o) + off, g.d_v, sl,
                                  lpr, active);
    if (active && sl == 0) acc += expf(alpha - lse) * d;
  }
  for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  __shared__ float warp_sum[kWarps];
  if (lane == 0) warp_sum[warp] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    float s = 0.0f;
    for (int w = 0; w < kWarps; ++w) s += warp_sum[w];
    partial[h * gridDim.x + chunk] = s;
  }
}

__global__ void sink_sum_kernel(const float *partial, size_t chunks, size_t heads, float *dalpha) {
  const size_t h = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (h >= heads) return;
  float s = 0.0f;
  for (size_t c = 0; c < chunks; ++c) s += partial[h * chunks + c];
  dalpha[h] = -s;
}

template <class T>
void launch(const SinkRows &g, float *partial, size_t chunks, cudaStream_t stream) {
  const dim3 grid((unsigned)chunks, (unsigned)g.heads);
  const bool vec = g.d_v % 8 == 0 && g.out.row_stride % 8 == 0 && g.out.head_stride % 8 == 0 &&
                   reinterpret_cast<uintptr_t>(g.o) % 16 == 0 && reinterpret_cast<uintptr_t>(g.d_o) % 16 == 0;
  const size_t w = vec ? 8 : 1, units = (g.d_v + w - 1) / w;
  int lpr = 1;
  while (lpr < 32 && (size_t)lpr < units) lpr *= 2;
  if (vec) sink_partial_kernel<T, 8><<<grid, kWarps * 32, 0, stream>>>(g, lpr, partial);
  else sink_partial_kernel<T, 1><<<grid, kWarps * 32, 0, stream>>>(g, lpr, partial);
}

// One warp per (row, head): the row's d_v elements times its sink factor, rounded once more.
template <class T>
__global__ void sink_rescale_kernel(SinkRows r) {
  const size_t idx = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (idx >= r.batch * r.max_q * r.heads) return;
  const size_t h = idx % r.heads, row = idx / r.heads, b = row / r.max_q, i = row % r.max_q;
  const float lse = r.stats[(b * r.heads + h) * r.max_q + i];
  if (!(lse > -INFINITY)) return;  // (padded rows, rows without keys: zero already)
  const float f = 1.0f / (1.0f + expf(r.alpha[h] - lse));
  T *p = static_cast<T *>(r.o) + attn::element_offset(r.out, attn::token_row(r.out.format, b, i, r.batch, r.max_q, 0), h);
  for (size_t k = lane; k < r.d_v; k += 32) p[k] = store_f32<T>(load_f32(p[k]) * f);
}

}  // namespace

void sink_rescale_rows(const SinkRows &r, cudaStream_t stream) {
  const size_t warps = r.batch * r.max_q * r.heads;
  if (warps == 0) return;
  const unsigned blocks = (unsigned)((warps * 32 + 255) / 256);
  if (r.dtype == kNVTEBFloat16) sink_rescale_kernel<bf16><<<blocks, 256, 0, stream>>>(r);
  else sink_rescale_kernel<fp16><<<blocks, 256, 0, stream>>>(r);
  NVTE_CHECK_LAUNCH();
}

size_t softmax_offset_grad_scratch_bytes(size_t heads) { return (heads * kChunks * 4 + 255) / 256 * 256; }

void softmax_offset_grad(const SinkRows &g, float *dalpha, void *scratch, cudaStream_t stream) {
  if (g.heads == 0) return;
  NVTE_CHECK(g.heads <= 65535, "softmax offset gradient: ", g.heads, " heads exceed the grid");
  const size_t rows = g.batch * g.max_q;
  if (rows == 0) {
    NVTE_CHECK_CUDA(cudaMemsetAsync(dalpha, 0, g.heads * 4, stream));
    return;
  }
  const size_t chunks = rows < kChunks ? rows : kChunks;
  float *partial = static_cast<float *>(scratch);
  if (g.dtype == kNVTEBFloat16) launch<bf16>(g, partial, chunks, stream);
  else launch<fp16>(g, partial, chunks, stream);
  NVTE_CHECK_LAUNCH();
  sink_sum_kernel<<<(unsigned)((g.heads + 127) / 128), 128, 0, stream>>>(partial, chunks, g.heads, dalpha);
  NVTE_CHECK_LAUNCH();
}

}  // namespace nvte::cuda
