// cuda/softmax.cu - fused scale + mask + softmax (softmax.h) on the GPU.
//
// Design: a row is owned by one group of G threads - one warp (G = 32, several rows per block)
// for rows up to 1024 elements, one block (G = 128..512) up to 16384 - and lives in that
// group's registers: each thread holds ELEMS values (a compile-time count, so the array stays
// in registers) as chunks of V contiguous elements, loaded as one vector when the pointers are
// aligned and Sk % V == 0 (else element by element at the same positions). The row is read
// once and written once; max and sum are warp shuffles (plus one shared-memory step for block
// groups), all math in float32 in the CPU's order (scale, mask, max, exp, sum, multiply by
// 1 / sum; exp on the special-function unit, within a few ulp of expf). Longer rows take a
// block kernel that makes three passes over global memory.
// The mask family is a run-time argument (one uniform branch per row); the causal families
// skip loading the hidden part of the row. Every thread writes only positions it has read
// itself, after the row's reductions, so outputs may alias inputs (in-place backward).
// Mixed dtypes (rare) run one instantiation that converts through a run-time dtype switch.
#include <climits>
#include <type_traits>

#include "../common/attn_softmax.h"
#include "common.cuh"
#include "softmax_rows.cuh"
#include "softmax.h"
#include "transpose.h"

namespace nvte::cuda {
namespace {


// Chunk width: up to 16 bytes, at most the thread's element count; 1 for AnyT.
template <class T, int ELEMS>
constexpr int chunk_width() {
  if constexpr (std::is_same_v<T, AnyT>) {
    return 1;
  } else {
    return (int)(16 / sizeof(T)) < ELEMS ? (int)(16 / sizeof(T)) : ELEMS;
  }
}

enum MaskKind : int { kNone = 0, kExplicit = 1, kCausal = 2 };

struct SmParams {
  const void *x = nullptr;  // forward: input; backward: incoming grads
  const void *y = nullptr;  // backward: softmax results
  void *out = nullptr;
  const uint8_t *mask = nullptr;
  size_t rows = 0;
  int sk = 0;         // row length
  size_t sq = 1;      // query length (rows cycle through it); 1 for kNone
  size_t hsq = 1;     // heads * sq: rows per batch entry (explicit mask)
  bool mask_per_batch = false;
  int kind = kNone;
  float scale = 1.0f;
  float *amax = nullptr;
  NVTEDType x_dt = kNVTEFloat32, y_dt = kNVTEFloat32, out_dt = kNVTEFloat32;
  bool vec = false;  // vector loads/stores are legal (alignment and Sk % V == 0)
};

// Folds the group's max |value| into *amax (thread 0 of the group does the atomic).
template <int G>
__device__ __forceinline__ void group_amax(float local, float *amax, int t, float *sh) {
  const float v = group_max<G>(local, sh);
  if (t == 0 && v > 0.0f) atomic_max_nonneg(amax, v);
}

// The visible prefix [0, valid) of row `row` (all of it unless causal) and its mask row.
struct RowInfo {
  int valid;
  const uint8_t *mrow;
};
__device__ __forceinline__ RowInfo row_info(const SmParams &p, size_t row) {
  RowInfo ri{p.sk, nullptr};
  const size_t i = row % p.sq;
  if (p.kind == kCausal) {
    // Visible: j <= i + (Sk - Sq); rows that see nothing (Sk < Sq) are all zeros.
    const long long last = (long long)i + (long long)p.sk - (long long)p.sq;
    ri.valid = last < 0 ? 0 : (last + 1 >= p.sk ? p.sk : (int)(last + 1));
  } else if (p.kind == kExplicit) {
    const size_t b = p.mask_per_batch ? row / p.hsq : 0;
    ri.mrow = p.mask + (b * p.sq + i) * (size_t)p.sk;
  }
  return ri;
}

constexpr int kWarpBlock = 128;  // threads per block for warp-per-row kernels

template <int G>
constexpr int block_threads() {
  return G > 32 ? G : kWarpBlock;
}

// ------------------------------------------------------------------ forward, row in registers
template <class T, int ELEMS, int G>
__global__ void __launch_bounds__(block_threads<G>()) softmax_fwd_kernel(const SmParams p) {
  constexpr int V = chunk_width<T, ELEMS>();
  constexpr int K = ELEMS / V;
  constexpr float kNegInf = -__builtin_huge_valf();
  __shared__ float sh[G > 32 ? G / 32 : 1];
  const int t = G > 32 ? (int)threadIdx.x : (int)(threadIdx.x & 31);
  constexpr int kGroups = block_threads<G>() / G;
  const size_t first = (size_t)blockIdx.x * kGroups + (G > 32 ? 0 : threadIdx.x >> 5);
  for (size_t row = first; row < p.rows; row += (size_t)gridDim.x * kGroups) {
    const RowInfo ri = row_info(p, row);
    const size_t base = row * (size_t)p.sk;
    float v[ELEMS];
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int j0 = (k * G + t) * V;
      bool done = false;
      if constexpr (!std::is_same_v<T, AnyT>) {
        if (p.vec) {  // Sk % V == 0: a chunk lies wholly inside or outside the row
          if (j0 < ri.valid) {
            load_chunk<T, V>(p.x, base + j0, v + k * V);
          } else {
#pragma unroll
            for (int e = 0; e < V; ++e) v[k * V + e] = kNegInf;
          }
          done = true;
        }
      }
      if (!done) {
#pragma unroll
        for (int e = 0; e < V; ++e) v[k * V + e] = j0 + e < ri.valid ? ld<T>(p.x, base + j0 + e, p.x_dt) : kNegInf;
      }
    }
    // Scale, mask, max.
    float m = kNegInf;
#pragma unroll
    for (int k = 0; k < K; ++k) {
#pragma unroll
      for (int e = 0; e < V; ++e) {
        const int j = (k * G + t) * V + e;
        float a = v[k * V + e] * p.scale;
        if (ri.mrow != nullptr && j < p.sk && ri.mrow[j]) a = attn::kMaskedLogit;
        a = j < ri.valid ? a : kNegInf;
        v[k * V + e] = a;
        m = fmaxf(m, a);
      }
    }
    m = group_max<G>(m, sh);
    // keys left out (none visible, all -inf, or all masked: TE's rule): the row is all zeros
    const bool keys = ri.valid > 0 && !attn::keys_left_out(m, ri.mrow != nullptr);
    float sum = 0.0f;
    if (keys) {
#pragma unroll
      for (int k = 0; k < K; ++k) {
#pragma unroll
        for (int e = 0; e < V; ++e) {
          const int j = (k * G + t) * V + e;
          const float ex = j < ri.valid ? exp_nonpos(v[k * V + e] - m) : 0.0f;
          v[k * V + e] = ex;
          sum += ex;
        }
      }
    }
    sum = group_sum<G>(sum, sh);
    const float inv = keys ? 1.0f / sum : 0.0f;
    float am = 0.0f;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int j0 = (k * G + t) * V;
#pragma unroll
      for (int e = 0; e < V; ++e) {
        const float yv = keys ? v[k * V + e] * inv : 0.0f;
        v[k * V + e] = yv;
        am = fmaxf(am, fabsf(yv));
      }
      bool done = false;
      if constexpr (!std::is_same_v<T, AnyT>) {
        if (p.vec) {
          if (j0 < p.sk) store_chunk<T, V>(p.out, base + j0, v + k * V);
          done = true;
        }
      }
      if (!done) {
#pragma unroll
        for (int e = 0; e < V; ++e)
          if (j0 + e < p.sk) st<T>(p.out, base + j0 + e, v[k * V + e], p.out_dt);
      }
    }
    if (p.amax != nullptr) group_amax<G>(am, p.amax, t, sh);
  }
}

// ------------------------------------------------------------------ backward, row in registers
template <class T, int ELEMS, int G>
__global__ void __launch_bounds__(block_threads<G>()) softmax_bwd_kernel(const SmParams p) {
  constexpr int V = chunk_width<T, ELEMS>();
  constexpr int K = ELEMS / V;
  __shared__ float sh[G > 32 ? G / 32 : 1];
  const int t = G > 32 ? (int)threadIdx.x : (int)(threadIdx.x & 31);
  constexpr int kGroups = block_threads<G>() / G;
  const size_t first = (size_t)blockIdx.x * kGroups + (G > 32 ? 0 : threadIdx.x >> 5);
  for (size_t row = first; row < p.rows; row += (size_t)gridDim.x * kGroups) {
    const size_t base = row * (size_t)p.sk;
    float g[ELEMS], y[ELEMS];
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int j0 = (k * G + t) * V;
      bool done = false;
      if constexpr (!std::is_same_v<T, AnyT>) {
        if (p.vec) {
          if (j0 < p.sk) {
            load_chunk<T, V>(p.x, base + j0, g + k * V);
            load_chunk<T, V>(p.y, base + j0, y + k * V);
          } else {
#pragma unroll
            for (int e = 0; e < V; ++e) g[k * V + e] = y[k * V + e] = 0.0f;
          }
          done = true;
        }
      }
      if (!done) {
#pragma unroll
        for (int e = 0; e < V; ++e) {
          const bool in = j0 + e < p.sk;
          g[k * V + e] = in ? ld<T>(p.x, base + j0 + e, p.x_dt) : 0.0f;
          y[k * V + e] = in ? ld<T>(p.y, base + j0 + e, p.y_dt) : 0.0f;
        }
      }
    }
    float dot = 0.0f;
#pragma unroll
    for (int e = 0; e < ELEMS; ++e) dot += g[e] * y[e];
    dot = group_sum<G>(dot, sh);
    float am = 0.0f;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int j0 = (k * G + t) * V;
#pragma unroll
      for (int e = 0; e < V; ++e) {
        const float d = p.scale * y[k * V + e] * (g[k * V + e] - dot);
        g[k * V + e] = d;
        am = fmaxf(am, fabsf(d));
      }
      bool done = false;
      if constexpr (!std::is_same_v<T, AnyT>) {
        if (p.vec) {
          if (j0 < p.sk) store_chunk<T, V>(p.out, base + j0, g + k * V);
          done = true;
        }
      }
      if (!done) {
#pragma unroll
        for (int e = 0; e < V; ++e)
          if (j0 + e < p.sk) st<T>(p.out, base + j0 + e, g[k * V + e], p.out_dt);
      }
    }
    if (p.amax != nullptr) group_amax<G>(am, p.amax, t, sh);
  }
}

// ------------------------------------------------------------------ rows too long for registers
constexpr int kLongThreads = 512;

// Masked logit of element j (j < valid).
template <class T>
__device__ __forceinline__ float logit(const SmParams &p, const RowInfo &ri, size_t base, int j) {
  if (ri.mrow != nullptr && ri.mrow[j]) return attn::kMaskedLogit;
  return ld<T>(p.x, base + j, p.x_dt) * p.scale;
}

template <class T>
__global__ void __launch_bounds__(kLongThreads) softmax_fwd_long_kernel(const SmParams p) {
  constexpr int G = kLongThreads;
  __shared__ float sh[G / 32];
  const int t = threadIdx.x;
  for (size_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const RowInfo ri = row_info(p, row);
    const size_t base = row * (size_t)p.sk;
    float m = -__builtin_huge_valf();
    for (int j = t; j < ri.valid; j += G) m = fmaxf(m, logit<T>(p, ri, base, j));
    m = group_max<G>(m, sh);
    const int valid = attn::keys_left_out(m, ri.mrow != nullptr) ? 0 : ri.valid;  // (as the register kernel)
    float sum = 0.0f;
    for (int j = t; j < valid; j += G) sum += exp_nonpos(logit<T>(p, ri, base, j) - m);
    sum = group_sum<G>(sum, sh);
    const float inv = valid > 0 ? 1.0f / sum : 0.0f;
    float am = 0.0f;
    for (int j = t; j < p.sk; j += G) {
      const float yv = j < valid ? exp_nonpos(logit<T>(p, ri, base, j) - m) * inv : 0.0f;
      am = fmaxf(am, fabsf(yv));
      st<T>(p.out, base + j, yv, p.out_dt);
    }
    if (p.amax != nullptr) group_amax<G>(am, p.amax, t, sh);
  }
}

template <class T>
__global__ void __launch_bounds__(kLongThreads) softmax_bwd_long_kernel(const SmParams p) {
  constexpr int G = kLongThreads;
  __shared__ float sh[G / 32];
  const int t = threadIdx.x;
  for (size_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const size_t base = row * (size_t)p.sk;
    float dot = 0.0f;
    for (int j = t; j < p.sk; j += G) dot += ld<T>(p.x, base + j, p.x_dt) * ld<T>(p.y, base + j, p.y_dt);
    dot = group_sum<G>(dot, sh);
    float am = 0.0f;
    for (int j = t; j < p.sk; j += G) {
      const float yv = ld<T>(p.y, base + j, p.y_dt);
      const float d = p.scale * yv * (ld<T>(p.x, base + j, p.x_dt) - dot);
      am = fmaxf(am, fabsf(d));
      st<T>(p.out, base + j, d, p.out_dt);
    }
    if (p.amax != nullptr) group_amax<G>(am, p.amax, t, sh);
  }
}

// ------------------------------------------------------------------ host side

unsigned grid_for_rows(size_t rows, int rows_per_block) {
  const size_t want = (rows + rows_per_block - 1) / rows_per_block;
  return (unsigned)(want > (size_t)INT_MAX ? (size_t)INT_MAX : want);
}

template <class T, int ELEMS, int G>
void launch_regs(bool backward, SmParams p, cudaStream_t stream) {
  constexpr int V = chunk_width<T, ELEMS>();
  if constexpr (!std::is_same_v<T, AnyT>) {
    const size_t bytes = V * sizeof(T);
    p.vec = p.sk % V == 0 && aligned(p.x, bytes) && aligned(p.out, bytes) && (!backward || aligned(p.y, bytes));
  }
  constexpr int threads = block_threads<G>();
  const unsigned grid = grid_for_rows(p.rows, threads / G);
  if (backward) {
    softmax_bwd_kernel<T, ELEMS, G><<<grid, threads, 0, stream>>>(p);
  } else {
    softmax_fwd_kernel<T, ELEMS, G><<<grid, threads, 0, stream>>>(p);
  }
  NVTE_CHECK_LAUNCH();
}

// Picks the kernel for the row length: warp per row up to 1024, block per row up to 16384
// (row in registers), the three-pass block kernel beyond.
template <class T>
void launch(bool backward, const SmParams &p, cudaStream_t stream) {
  const int sk = p.sk;
  if (sk <= 32) return launch_regs<T, 1, 32>(backward, p, stream);
  if (sk <= 64) return launch_regs<T, 2, 32>(backward, p, stream);
  if (sk <= 128) return launch_regs<T, 4, 32>(backward, p, stream);
  if (sk <= 256) return launch_regs<T, 8, 32>(backward, p, stream);
  if (sk <= 512) return launch_regs<T, 16, 32>(backward, p, stream);
  if (sk <= 1024) return launch_regs<T, 32, 32>(backward, p, stream);
  if (sk <= 2048) return launch_regs<T, 16, 128>(backward, p, stream);
  if (sk <= 4096) return launch_regs<T, 16, 256>(backward, p, stream);
  if (sk <= 8192) return launch_regs<T, 16, 512>(backward, p, stream);
  if (sk <= 16384) return launch_regs<T, 32, 512>(backward, p, stream);
  const unsigned grid = grid_for_rows(p.rows, 1);
  if (backward) {
    softmax_bwd_long_kernel<T><<<grid, kLongThreads, 0, stream>>>(p);
  } else {
    softmax_fwd_long_kernel<T><<<grid, kLongThreads, 0, stream>>>(p);
  }
  NVTE_CHECK_LAUNCH();
}

// One storage type when all the tensors share it, else the run-time-typed instantiation.
void dispatch(bool backward, const SmParams &p, cudaStream_t stream) {
  const bool same = p.x_dt == p.out_dt && (!backward || p.y_dt == p.out_dt);
  if (!same) return launch<AnyT>(backward, p, stream);
  switch (p.out_dt) {
    case kNVTEFloat32: return launch<float>(backward, p, stream);
    case kNVTEFloat16: return launch<fp16>(backward, p, stream);
    case kNVTEBFloat16: return launch<bf16>(backward, p, stream);
    default: NVTE_FAIL(NVTE_ERROR_INTERNAL, "unexpected softmax dtype ", dtype_name(p.out_dt));
  }
}

const NVTEBasicTensor &rowwise(const Tensor &t, const char *name) {
  const NVTEBasicTensor &b = t.params[kNVTERowwiseData];
  NVTE_CHECK(buffer_set(b), name, " needs rowwise data");
  return b;
}

// The output's rowwise buffer, and its columnwise buffer (the [cols, rows] transpose of the 2D
// view) or null. The kernels write rows; a columnwise copy is transposed from them afterwards,
// so it needs the rowwise buffer too.
void *output_data(const Tensor &t, const char *name, NVTEDType *dt, void **col) {
  const NVTEBasicTensor &c = t.params[kNVTEColumnwiseData];
  NVTE_CHECK_SUPPORTED(buffer_set(t.params[kNVTERowwiseData]) || !buffer_set(c), name,
                       " has only columnwise data; the CUDA softmax needs the rowwise buffer as well");
  const NVTEBasicTensor &b = rowwise(t, name);
  *col = buffer_set(c) ? c.data_ptr : nullptr;
  *dt = b.dtype;
  return b.data_ptr;
}

}  // namespace

void softmax_forward(SoftmaxMask kind, const Tensor &in, const Tensor *mask, Tensor &out, float scale,
                     cudaStream_t stream) {
  const NVTEBasicTensor &ib = rowwise(in, "input");
  SmParams p;
  p.x = ib.data_ptr;
  p.x_dt = ib.dtype;
  void *col = nullptr;
  p.out = output_data(out, "softmax_results", &p.out_dt, &col);
  p.amax = scalar_param(out, kNVTEAmax, "softmax_results");
  p.scale = scale;
  const Dims2 d = flat2d(ib.shape);
  if (d.rows == 0 || d.cols == 0) return;
  NVTE_CHECK_SUPPORTED(d.cols <= (size_t)INT_MAX, "rows of ", d.cols, " elements are too long");
  p.rows = d.rows;
  p.sk = (int)d.cols;
  const NVTEShape &s = ib.shape;
  switch (kind) {
    case SoftmaxMask::None: p.kind = kNone; break;
    case SoftmaxMask::Explicit: {
      p.kind = kExplicit;
      const NVTEBasicTensor &mb = rowwise(*mask, "mask");
      p.mask = static_cast<const uint8_t *>(mb.data_ptr);
      p.mask_per_batch = mb.shape.data[0] != 1;
      break;
    }
    case SoftmaxMask::UpperTriang:
    case SoftmaxMask::AlignedCausal: p.kind = kCausal; break;
  }
  if (kind != SoftmaxMask::None) {
    p.sq = s.data[s.ndim - 2];
    p.hsq = (s.ndim == 4 ? s.data[1] : 1) * p.sq;
  }
  dispatch(false, p, stream);
  if (col != nullptr) transpose_raw(p.out, col, d.rows, d.cols, dtype_size(p.out_dt), stream);
}

void softmax_backward(const Tensor &dy, const Tensor &y, Tensor &dx, float scale, cudaStream_t stream) {
  const NVTEBasicTensor &gb = rowwise(dy, "incoming_grads");
  const NVTEBasicTensor &yb = rowwise(y, "softmax_results");
  SmParams p;
  p.x = gb.data_ptr;
  p.x_dt = gb.dtype;
  p.y = yb.data_ptr;
  p.y_dt = yb.dtype;
  void *col = nullptr;
  p.out = output_data(dx, "output_grads", &p.out_dt, &col);
  p.amax = scalar_param(dx, kNVTEAmax, "output_grads");
  p.scale = scale;
  const Dims2 d = flat2d(yb.shape);
  if (d.rows == 0 || d.cols == 0) return;
  NVTE_CHECK_SUPPORTED(d.cols <= (size_t)INT_MAX, "rows of ", d.cols, " elements are too long");
  p.rows = d.rows;
  p.sk = (int)d.cols;
  dispatch(true, p, stream);
  if (col != nullptr) transpose_raw(p.out, col, d.rows, d.cols, dtype_size(p.out_dt), stream);
}

}  // namespace nvte::cuda
