// cuda/cudnn/fused_attn_seqlens.cu - see fused_attn_seqlens.h. Clamping keeps a malformed
// cu_seqlens from sending cuDNN lengths (and THD offsets) beyond the tensors. The FP8 scalar
// operations use __frcp_rn (IEEE round-to-nearest reciprocal, whatever the fast-math flags) so
// that a scale_inv / descale equals the host's 1.0f / scale bit for bit.
#include "../common.cuh"
#include "fused_attn_seqlens.h"

namespace nvte::cuda {
namespace {

__global__ void seqlens_kernel(const int32_t *cu_q, const int32_t *cu_kv, int32_t *seq_q, int32_t *seq_kv,
                               size_t batch, int32_t max_q, int32_t max_kv) {
  const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= batch) return;
  const int32_t lq = cu_q ? cu_q[i + 1] - cu_q[i] : max_q, lkv = cu_kv ? cu_kv[i + 1] - cu_kv[i] : max_kv;
  seq_q[i] = lq < 0 ? 0 : (lq > max_q ? max_q : lq);
  seq_kv[i] = lkv < 0 ? 0 : (lkv > max_kv ? max_kv : lkv);
}

// Element x of the four arrays: array x / (batch + 1), entry x % (batch + 1).
__global__ void batch_offsets_kernel(BatchOffsets o) {
  const size_t x = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (x >= 4 * (o.batch + 1)) return;
  const size_t a = x / (o.batch + 1), i = x % (o.batch + 1);
  o.off[a * o.step + i] = (int32_t)((int64_t)i * o.per[a]);  // (ragged_padding checked the int32 range)
}

__device__ int64_t clamp64(int64_t x, int64_t lo, int64_t hi) { return x < lo ? lo : (x > hi ? hi : x); }

// Block (x, y): rows [x * kTileRows, +kTileRows) of sequences y, y + gridDim.y, ...; a kept row
// costs one comparison, so a call with little padding costs about one launch. Stores
// are kChunk bytes (16 when every row start is 16-byte aligned, else 1); the inner loops use
// 32-bit indices without division where a token's heads are one span (64-bit division per store
// made this kernel slower than the memset it replaces).
constexpr size_t kTileRows = 16;
template <size_t kChunk>
__device__ void zero_chunk(uint8_t *p) {
  if constexpr (kChunk == 16) {
    *reinterpret_cast<uint4 *>(p) = make_uint4(0, 0, 0, 0);
  } else {
    *p = 0;
  }
}

// The block zeroes the `heads` head slices (row_bytes each, head_stride apart) of one token row:
// one run of chunks when the heads are back to back, else chunk by chunk with its head.
template <size_t kChunk>
__device__ void zero_row(uint8_t *row, size_t heads, size_t head_stride, size_t row_bytes) {
  const unsigned chunks = (unsigned)(row_bytes / kChunk), per_row = (unsigned)heads * chunks;
  if (head_stride == row_bytes) {
    for (unsigned x = threadIdx.x; x < per_row; x += blockDim.x) zero_chunk<kChunk>(row + (size_t)x * kChunk);
  } else {
    for (unsigned x = threadIdx.x; x < per_row; x += blockDim.x) {
      const unsigned h = x / chunks;
      zero_chunk<kChunk>(row + h * head_stride + (size_t)(x - h * chunks) * kChunk);
    }
  }
}

template <size_t kChunk>
__global__ void zero_unused_rows_kernel(uint8_t *base, UnusedRows u) {
  const size_t r0 = (size_t)blockIdx.x * kTileRows;
  const size_t r1 = r0 + kTileRows < u.rows ? r0 + kTileRows : u.rows;
  for (size_t b = blockIdx.y; b < u.batch; b += gridDim.y) {
    const int64_t lq = u.seq_q ? u.seq_q[b] : (int64_t)u.max_q, lkv = u.seq_kv ? u.seq_kv[b] : (int64_t)u.max_kv;
    const attn::KeyRange keep =
        u.key_side ? attn::keys_with_rows(u.rule, lq, lkv) : attn::rows_with_keys(u.rule, lq, lkv);
    for (size_t r = r0; r < r1; ++r) {
      if ((int64_t)r >= keep.lo && (int64_t)r <= keep.hi) continue;
      zero_row<kChunk>(base + (u.sbhd ? r * u.batch + b : b * u.rows + r) * u.row_stride, u.heads, u.head_stride,
                       u.row_bytes);
    }
  }
}

// Block (x, y): statistics rows [x * 256, +256) of (sequence, head) pairs y, y + gridDim.y, ...
__global__ void stats_unused_rows_kernel(float *stats, UnusedRows u) {
  const size_t row = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (row >= u.max_q) return;
  for (size_t bh = blockIdx.y; bh < u.batch * u.heads; bh += gridDim.y) {
    const size_t b = bh / u.heads;
    const int64_t lq = u.seq_q ? u.seq_q[b] : (int64_t)u.max_q, lkv = u.seq_kv ? u.seq_kv[b] : (int64_t)u.max_kv;
    const attn::KeyRange keep = attn::rows_with_keys(u.rule, lq, lkv);
    if ((int64_t)row < keep.lo || (int64_t)row > keep.hi)
      stats[bh * u.max_q + row] = u.sink && (int64_t)row < lq ? u.sink[bh % u.heads] : -INFINITY;
  }
}

// One thread per entry of the [rows, used] copies of both page tables.
__global__ void page_tables_kernel(const int32_t *k, const int32_t *v, int32_t *k_out, int32_t *v_out,
                                   size_t rows, size_t valid, size_t width, size_t used, int32_t num_pages) {
  const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= rows * used) return;
  const size_t row = i / used, src = row * width + i % used;
  k_out[i] = row < valid ? (int32_t)clamp64(k[src], 0, (int64_t)num_pages - 1) : 0;
  v_out[i] = row < valid ? (int32_t)clamp64(v[src], 0, (int64_t)num_pages - 1) : 0;
}

struct Span {
  int64_t start, len;  // first token row and length of one sequence
};

// Sequence g < batch of one side, clamped into the tensor (see fused_attn_seqlens.h).
__device__ Span real_span(const int32_t *cu, const int32_t *pad, size_t g, int64_t max_len, int64_t rows) {
  const int64_t start = clamp64((pad ? pad : cu)[g], 0, rows);
  const int64_t len = clamp64((int64_t)cu[g + 1] - cu[g], 0, max_len);
  return {start, len < rows - start ? len : rows - start};
}

// Sequence g of one side; past the batch an empty one where the last sequence ends, which keeps
// the offsets non-decreasing.
__device__ Span span(const int32_t *cu, const int32_t *pad, size_t g, size_t batch, int64_t max_len, int64_t rows) {
  if (g < batch) return real_span(cu, pad, g, max_len, rows);
  if (batch == 0) return {0, 0};
  const Span last = real_span(cu, pad, batch - 1, max_len, rows);
  return {last.start + last.len, 0};
}

__global__ void ragged_run_kernel(RaggedSource s, RaggedRun r) {
  const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i > r.n) return;
  const size_t g = r.start + i;
  const Span q = span(s.cu_q, s.pad_q, g, s.batch, (int64_t)s.max_q, (int64_t)s.rows_q);
  const Span kv = span(s.cu_kv, s.pad_kv, g, s.batch, (int64_t)s.max_kv, (int64_t)s.rows_kv);
  if (i < r.n) {
    r.seq_q[i] = (int32_t)q.len;
    r.seq_kv[i] = (int32_t)kv.len;
  }
  // The host checked rows * stride < 2^31 for every tensor.
  r.off[0][i] = (int32_t)(q.start * s.stride[0]);
  r.off[1][i] = (int32_t)(kv.start * s.stride[1]);
  r.off[2][i] = (int32_t)(kv.start * s.stride[2]);
  r.off[3][i] = (int32_t)(q.start * s.stride[3]);
  if (i == 0 && r.rng != nullptr) {
    // cuDNN draws the dropout mask by the sequence's index inside the run: a different seed per
    // run keeps sequences of different runs from sharing a mask (run 0 keeps the caller's).
    const uint64_t run = r.n ? r.start / r.n : 0;
    r.rng[0] = (int64_t)((uint64_t)s.rng[0] + run * 0x9E3779B97F4A7C15ull);
    r.rng[1] = s.rng[1];
  }
}

// Block i: sequence start + i's query row between the THD tensor and scratch row i (thd_decode_rows).
template <size_t kChunk>
__global__ void thd_decode_rows_kernel(uint8_t *thd, uint8_t *scratch, bool to_scratch, const int32_t *cu,
                                       const int32_t *pad, size_t batch, size_t start, size_t rows,
                                       size_t row_stride, size_t heads, size_t head_stride, size_t row_bytes) {
  const size_t g = start + blockIdx.x;
  const Span q = g < batch ? real_span(cu, pad, g, 1, (int64_t)rows) : Span{0, 0};
  if (q.len == 0 && !to_scratch) return;
  const unsigned chunks = (unsigned)(row_bytes / kChunk), total = (unsigned)heads * chunks;
  uint8_t *src_row = thd + (size_t)q.start * row_stride, *dst_row = scratch + (size_t)blockIdx.x * heads * row_bytes;
  for (unsigned x = threadIdx.x; x < total; x += blockDim.x) {
    const unsigned h = x / chunks, c = x - h * chunks;
    uint8_t *t = src_row + h * head_stride + (size_t)c * kChunk, *s = dst_row + (size_t)x * kChunk;
    if constexpr (kChunk == 16) {
      uint4 *tv = reinterpret_cast<uint4 *>(t), *sv = reinterpret_cast<uint4 *>(s);
      if (!to_scratch) *tv = *sv;
      else *sv = q.len ? *tv : make_uint4(0, 0, 0, 0);
    } else {
      if (!to_scratch) *t = *s;
      else *s = q.len ? *t : 0;
    }
  }
}

// Element x of a chunk's inputs: x <= n a cu_seqlens entry of both sides, then the page tables.
__global__ void decode_chunk_kernel(DecodeChunk c) {
  const size_t total = (c.n + 1) + c.n * c.used;
  for (size_t x = (size_t)blockIdx.x * blockDim.x + threadIdx.x; x < total; x += (size_t)gridDim.x * blockDim.x) {
    if (x <= c.n) {
      const size_t g = c.start + x < c.batch ? c.start + x : c.batch;
      c.cu_q_out[x] = c.cu_q[g];
      c.cu_kv_out[x] = c.cu_kv[g];
      continue;
    }
    const size_t e = x - (c.n + 1), i = e / c.used, j = e % c.used, g = c.start + i;
    c.page_k_out[e] = g < c.batch ? c.page_k[g * c.width + j] : 0;
    c.page_v_out[e] = g < c.batch ? c.page_v[g * c.width + j] : 0;
  }
}

// Query row `row` of run sequence i (< n): -1 past the batch or the length, 0 when it sees no
// key, 1 otherwise.
__device__ int query_row_kind(const RaggedSource &s, const RaggedRun &r, size_t i, size_t row) {
  if (r.start + i >= s.batch || row >= (size_t)r.seq_q[i]) return -1;
  const attn::KeyRange k = attn::visible_keys(s.rule, (int64_t)row, r.seq_q[i], r.seq_kv[i]);
  return k.lo <= k.hi ? 1 : 0;
}

__global__ void ragged_stats_kernel(float *caller, float *scratch, RaggedSource s, RaggedRun r, size_t h,
                                    bool to_caller) {
  const size_t sg = r.graph_max_q, total = r.n * h * sg;
  const float inf = __int_as_float(0x7f800000);
  for (size_t x = (size_t)blockIdx.x * blockDim.x + threadIdx.x; x < total; x += (size_t)gridDim.x * blockDim.x) {
    const size_t i = x / (h * sg), row = x % sg;
    const int kind = query_row_kind(s, r, i, row);
    const size_t c = ((r.start + i) * h + x / sg % h) * s.max_q + row;  // the caller's element
    if (to_caller) {
      if (r.start + i < s.batch && row < s.max_q) caller[c] = kind == 1 ? scratch[x] : -inf;
    } else {
      scratch[x] = kind == 1 ? caller[c] : (kind == 0 ? inf : 0.0f);
    }
  }
}

// The statistics and max logit of one row from cuDNN's max and sum_exp (fused_attn_seqlens.h).
__device__ void logit_row(bool sees_key, float m, float sum, float *stats, float *max) {
  const float neg_inf = __int_as_float(0xff800000);
  *stats = sees_key ? m + logf(sum) : neg_inf;
  *max = sees_key ? m : neg_inf;
}

__global__ void logit_stats_kernel(float *stats, float *max, const int32_t *seq_q, const int32_t *seq_kv,
                                   size_t batch, size_t h, size_t max_q, size_t max_kv, attn::MaskRule rule) {
  const size_t total = batch * h * max_q;
  for (size_t x = (size_t)blockIdx.x * blockDim.x + threadIdx.x; x < total; x += (size_t)gridDim.x * blockDim.x) {
    const size_t b = x / (h * max_q), row = x % max_q;
    const int64_t lq = seq_q ? seq_q[b] : (int64_t)max_q, lkv = seq_kv ? seq_kv[b] : (int64_t)max_kv;
    const attn::KeyRange k = attn::visible_keys(rule, (int64_t)row, lq, lkv);  // empty past lq
    logit_row(k.lo <= k.hi, max[x], stats[x], &stats[x], &max[x]);
  }
}

__global__ void ragged_logit_stats_kernel(float *stats, float *max, const float *max_scratch,
                                          const float *sum_scratch, RaggedSource s, RaggedRun r, size_t h) {
  const size_t sg = r.graph_max_q, total = r.n * h * sg;
  for (size_t x = (size_t)blockIdx.x * blockDim.x + threadIdx.x; x < total; x += (size_t)gridDim.x * blockDim.x) {
    const size_t i = x / (h * sg), row = x % sg;
    if (r.start + i >= s.batch || row >= s.max_q) continue;
    const size_t c = ((r.start + i) * h + x / sg % h) * s.max_q + row;  // the caller's element
    logit_row(query_row_kind(s, r, i, row) == 1, max_scratch[x], sum_scratch[x], &stats[c], &max[c]);
  }
}

__global__ void ragged_zero_rows_kernel(uint16_t *base, RaggedSource s, RaggedRun r, int role, bool key_side,
                                        size_t heads, size_t head_stride, size_t d) {
  const size_t rows = key_side ? s.max_kv : s.max_q, total = r.n * rows * heads;
  for (size_t x = (size_t)blockIdx.x * blockDim.x + threadIdx.x; x < total; x += (size_t)gridDim.x * blockDim.x) {
    const size_t i = x / (rows * heads), row = x / heads % rows, h = x % heads;
    if (r.start + i >= s.batch) continue;
    bool zero;
    if (key_side) {  // a key of the sequence that no query sees
      const attn::KeyRange seen = attn::keys_with_rows(s.rule, r.seq_q[i], r.seq_kv[i]);
      zero = row < (size_t)r.seq_kv[i] && ((int64_t)row < seen.lo || (int64_t)row > seen.hi);
    } else {
      zero = query_row_kind(s, r, i, row) == 0;
    }
    if (!zero) continue;
    uint16_t *p = base + r.off[role][i] + (int64_t)row * s.stride[role] + h * head_stride;
    for (size_t e = 0; e < d; ++e) p[e] = 0;
  }
}

// Block g: the rows of sequences g, g + gridDim.x, ... (clamped as ragged_run clamps them).
__global__ void mark_sequence_rows_kernel(uint8_t *map, const int32_t *cu, const int32_t *pad, size_t batch,
                                          int64_t max_len, int64_t rows) {
  for (size_t g = blockIdx.x; g < batch; g += gridDim.x) {
    const Span sp = real_span(cu, pad, g, max_len, rows);
    for (int64_t i = threadIdx.x; i < sp.len; i += blockDim.x) map[sp.start + i] = 1;
  }
}

// Block x: rows [x * kTileRows, +kTileRows); an unmarked row is zeroed (all heads).
template <size_t kChunk>
__global__ void zero_unmarked_rows_kernel(uint8_t *base, const uint8_t *map, size_t rows, size_t row_stride,
                                          size_t heads, size_t head_stride, size_t row_bytes) {
  const size_t r0 = (size_t)blockIdx.x * kTileRows, r1 = r0 + kTileRows < rows ? r0 + kTileRows : rows;
  for (size_t r = r0; r < r1; ++r)
    if (!map[r]) zero_row<kChunk>(base + r * row_stride, heads, head_stride, row_bytes);
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

void batch_offsets(int32_t *off, size_t step, const int64_t per[4], size_t batch, cudaStream_t stream) {
  BatchOffsets o;
  o.off = off;
  o.step = step;
  for (int i = 0; i < 4; ++i) o.per[i] = per[i];
  o.batch = batch;
  batch_offsets_kernel<<<grid_for(4 * (batch + 1), 256), 256, 0, stream>>>(o);
  NVTE_CHECK_LAUNCH();
}

void seqlens_from_cu(const int32_t *cu_q, const int32_t *cu_kv, int32_t *seq_q, int32_t *seq_kv, size_t batch,
                     size_t max_q, size_t max_kv, cudaStream_t stream) {
  if (batch == 0) return;
  seqlens_kernel<<<(unsigned)((batch + 255) / 256), 256, 0, stream>>>(cu_q, cu_kv, seq_q, seq_kv, batch,
                                                                      (int32_t)max_q, (int32_t)max_kv);
  NVTE_CHECK_LAUNCH();
}

bool unused_rows_possible(const UnusedRows &u) {
  if (u.batch == 0 || u.rows == 0) return false;
  if (u.seq_q || u.seq_kv) return true;  // per-sequence lengths: known on the device only
  const attn::KeyRange keep = u.key_side ? attn::keys_with_rows(u.rule, (int64_t)u.max_q, (int64_t)u.max_kv)
                                         : attn::rows_with_keys(u.rule, (int64_t)u.max_q, (int64_t)u.max_kv);
  return !(keep.lo == 0 && keep.hi == (int64_t)u.rows - 1);
}

void zero_unused_rows(void *base, const UnusedRows &u, cudaStream_t stream) {
  if (!unused_rows_possible(u) || u.heads * u.row_bytes == 0) return;
  const dim3 grid((unsigned)((u.rows + kTileRows - 1) / kTileRows), (unsigned)(u.batch < 65535 ? u.batch : 65535));
  const bool vec = reinterpret_cast<uintptr_t>(base) % 16 == 0 && u.row_stride % 16 == 0 && u.head_stride % 16 == 0 &&
                   u.row_bytes % 16 == 0;
  if (vec) {
    zero_unused_rows_kernel<16><<<grid, 256, 0, stream>>>(static_cast<uint8_t *>(base), u);
  } else {
    zero_unused_rows_kernel<1><<<grid, 256, 0, stream>>>(static_cast<uint8_t *>(base), u);
  }
  NVTE_CHECK_LAUNCH();
}

void stats_unused_rows(float *stats, const UnusedRows &u, cudaStream_t stream) {
  UnusedRows q = u;
  q.key_side = false;
  q.rows = u.max_q;
  if (stats == nullptr || !unused_rows_possible(q) || u.heads == 0) return;
  const size_t bh = u.batch * u.heads;
  const dim3 grid((unsigned)((u.max_q + 255) / 256), (unsigned)(bh < 65535 ? bh : 65535));
  stats_unused_rows_kernel<<<grid, 256, 0, stream>>>(stats, q);
  NVTE_CHECK_LAUNCH();
}

void clamped_page_tables(const int32_t *k, const int32_t *v, int32_t *k_out, int32_t *v_out, size_t rows,
                         size_t valid, size_t width, size_t used, size_t num_pages, cudaStream_t stream) {
  if (rows * used == 0) return;
  page_tables_kernel<<<(unsigned)((rows * used + 255) / 256), 256, 0, stream>>>(k, v, k_out, v_out, rows, valid,
                                                                                width, used, (int32_t)num_pages);
  NVTE_CHECK_LAUNCH();
}

void ragged_run(const RaggedSource &s, const RaggedRun &r, cudaStream_t stream) {
  ragged_run_kernel<<<(unsigned)((r.n + 1 + 255) / 256), 256, 0, stream>>>(s, r);
  NVTE_CHECK_LAUNCH();
}

void thd_decode_rows(void *thd, void *scratch, bool to_scratch, const int32_t *cu, const int32_t *pad, size_t batch,
                     size_t start, size_t n, size_t rows, size_t row_stride_bytes, size_t heads,
                     size_t head_stride_bytes, size_t row_bytes, cudaStream_t stream) {
  if (n == 0 || heads * row_bytes == 0) return;
  NVTE_CHECK(n <= 0x7fffffffu, "internal: THD decode chunk ", n, " exceeds the grid");
  const bool vec = reinterpret_cast<uintptr_t>(thd) % 16 == 0 && reinterpret_cast<uintptr_t>(scratch) % 16 == 0 &&
                   row_stride_bytes % 16 == 0 && head_stride_bytes % 16 == 0 && row_bytes % 16 == 0;
  uint8_t *t = static_cast<uint8_t *>(thd), *s = static_cast<uint8_t *>(scratch);
  if (vec) {
    thd_decode_rows_kernel<16><<<(unsigned)n, 128, 0, stream>>>(t, s, to_scratch, cu, pad, batch, start, rows,
                                                               row_stride_bytes, heads, head_stride_bytes, row_bytes);
  } else {
    thd_decode_rows_kernel<1><<<(unsigned)n, 128, 0, stream>>>(t, s, to_scratch, cu, pad, batch, start, rows,
                                                              row_stride_bytes, heads, head_stride_bytes, row_bytes);
  }
  NVTE_CHECK_LAUNCH();
}

void decode_chunk_inputs(const DecodeChunk &c, cudaStream_t stream) {
  const size_t total = (c.n + 1) + c.n * c.used;
  decode_chunk_kernel<<<grid_for(total, 256), 256, 0, stream>>>(c);
  NVTE_CHECK_LAUNCH();
}

void mark_sequence_rows(uint8_t *map, const int32_t *cu, const int32_t *pad, size_t batch, size_t max_len,
                        size_t rows, cudaStream_t stream) {
  if (rows == 0) return;
  NVTE_CHECK_CUDA(cudaMemsetAsync(map, 0, rows, stream));
  if (batch == 0) return;
  mark_sequence_rows_kernel<<<(unsigned)(batch < 65535 ? batch : 65535), 256, 0, stream>>>(map, cu, pad, batch,
                                                                                       (int64_t)max_len,
                                                                                       (int64_t)rows);
  NVTE_CHECK_LAUNCH();
}

void zero_unmarked_rows(void *base, const uint8_t *map, size_t rows, size_t row_stride_bytes, size_t heads,
                        size_t head_stride_bytes, size_t row_bytes, cudaStream_t stream) {
  if (rows == 0 || heads * row_bytes == 0) return;
  const unsigned grid = (unsigned)((rows + kTileRows - 1) / kTileRows);
  const bool vec = reinterpret_cast<uintptr_t>(base) % 16 == 0 && row_stride_bytes % 16 == 0 &&
                   head_stride_bytes % 16 == 0 && row_bytes % 16 == 0;
  uint8_t *b = static_cast<uint8_t *>(base);
  if (vec) {
    zero_unmarked_rows_kernel<16><<<grid, 256, 0, stream>>>(b, map, rows, row_stride_bytes, heads, head_stride_bytes,
                                                           row_bytes);
  } else {
    zero_unmarked_rows_kernel<1><<<grid, 256, 0, stream>>>(b, map, rows, row_stride_bytes, heads, head_stride_bytes,
                                                          row_bytes);
  }
  NVTE_CHECK_LAUNCH();
}

void ragged_stats(float *caller, float *scratch, const RaggedSource &s, const RaggedRun &r, size_t h,
                  bool to_caller, cudaStream_t stream) {
  const size_t total = r.n * h * r.graph_max_q;
  if (total == 0) return;
  ragged_stats_kernel<<<grid_for(total, 256), 256, 0, stream>>>(caller, scratch, s, r, h, to_caller);
  NVTE_CHECK_LAUNCH();
}

void logit_stats(float *stats, float *max, const int32_t *seq_q, const int32_t *seq_kv, size_t batch, size_t h,
                 size_t max_q, size_t max_kv, const attn::MaskRule &rule, cudaStream_t stream) {
  const size_t total = batch * h * max_q;
  if (total == 0) return;
  logit_stats_kernel<<<grid_for(total, 256), 256, 0, stream>>>(stats, max, seq_q, seq_kv, batch, h, max_q, max_kv,
                                                                rule);
  NVTE_CHECK_LAUNCH();
}

void ragged_logit_stats(float *stats, float *max, const float *max_scratch, const float *sum_scratch,
                        const RaggedSource &s, const RaggedRun &r, size_t h, cudaStream_t stream) {
  const size_t total = r.n * h * r.graph_max_q;
  if (total == 0) return;
  ragged_logit_stats_kernel<<<grid_for(total, 256), 256, 0, stream>>>(stats, max, max_scratch, sum_scratch, s, r,
                                                                       h);
  NVTE_CHECK_LAUNCH();
}

void ragged_zero_rows(void *base, const RaggedSource &s, const RaggedRun &r, int role, bool key_side,
                      size_t heads, size_t head_stride, size_t d, cudaStream_t stream) {
  const size_t total = r.n * (key_side ? s.max_kv : s.max_q) * heads;
  if (total == 0) return;
  ragged_zero_rows_kernel<<<grid_for(total, 256), 256, 0, stream>>>(static_cast<uint16_t *>(base), s, r, role,
                                                                    key_side, heads, head_stride, d);
  NVTE_CHECK_LAUNCH();
}

}  // namespace nvte::cuda
