// fused_attn_seqlens.h - small device helpers of the cuDNN attention backend: per-sequence
// lengths from cu_seqlens for cuDNN's padding masks, THD ragged offsets and statistics, the
// statistics and max logit of return_max_logit, and the float32 scalar bookkeeping of the FP8
// graphs (descales computed as 1/scale before a graph runs, amax folding and scale_inv after).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "../../common/attn_mask.h"
#include "../../common/error.h"

namespace nvte::cuda {

// seq_q[i] = cu_q[i + 1] - cu_q[i] clamped to [0, max_q] (likewise kv), for i < batch, on stream;
// a null cu_q / cu_kv gives max_q / max_kv for every i.
void seqlens_from_cu(const int32_t *cu_q, const int32_t *cu_kv, int32_t *seq_q, int32_t *seq_kv, size_t batch,
                     size_t max_q, size_t max_kv, cudaStream_t stream);

// ragged_padding (fused_attn_cudnn_rules.h): four int32 [batch + 1] offset arrays, array a at
// off + a * step, entry i = i * per[a] (the element offset of sequence i's first row of Q, K, V, O).
struct BatchOffsets {
  int32_t *off = nullptr;
  size_t step = 0, batch = 0;
  int64_t per[4] = {};
};
void batch_offsets(int32_t *off, size_t step, const int64_t per[4], size_t batch, cudaStream_t stream);

// BSHD/SBHD rows that fused_attn.h defines and cuDNN may leave undefined: a query row outside
// attn::rows_with_keys of its sequence (padded, or sees no key) has O = 0, dQ = 0 and statistics
// -inf; a key row outside attn::keys_with_rows (padded, or seen by no query) has dK = dV = 0.
// cuDNN computes only the rows in range (its padded and empty rows are not defined: cuDNN 9.19's
// decode kernel writes O row 0 of a sequence without queries, seen on an H100), so these rows
// are set after the graph has run instead of zeroing the whole output before it.
struct UnusedRows {
  const int32_t *seq_q = nullptr, *seq_kv = nullptr;  // [batch] lengths (device); null: max_q / max_kv
  size_t batch = 0, max_q = 0, max_kv = 0;
  attn::MaskRule rule{};
  bool key_side = false;  // dK / dV (rows = max_kv) instead of O / dQ (rows = max_q)
  size_t rows = 0;        // the tensor's sequence dimension
  bool sbhd = false;      // [s, b, ...] instead of [b, s, ...]
  size_t row_stride = 0, heads = 0, head_stride = 0, row_bytes = 0;  // bytes; row_bytes = d * element size
  const float *sink = nullptr;  // statistics: [heads] sink token, the value of in-sequence rows without keys
};
// True when some row can be out of range (always with per-sequence lengths; without them when
// the mask rule leaves rows or keys unused at the maximum lengths): the calls below skip the
// launch otherwise.
bool unused_rows_possible(const UnusedRows &u);
// Zeroes the tensor's out-of-range rows (all heads, row_bytes each).
void zero_unused_rows(void *base, const UnusedRows &u, cudaStream_t stream);
// Statistics [batch, heads, max_q]: -inf in the query rows out of range (u.key_side is ignored);
// with u.sink, rows inside their sequence that see no key get sink[head] instead.
void stats_unused_rows(float *stats, const UnusedRows &u, cudaStream_t stream);

// Paged K/V caches: the first `used` entries of `rows` rows of both page tables ([.., width] ->
// [rows, used]), clamped to [0, num_pages - 1] so that a malformed table cannot send cuDNN
// outside the caches (the CPU backend reports such entries; here they read some page). Rows
// from `valid` on (sequences past the batch in a THD run) get page 0; their tables are not read.
void clamped_page_tables(const int32_t *k, const int32_t *v, int32_t *k_out, int32_t *v_out, size_t rows,
                         size_t valid, size_t width, size_t used, size_t num_pages, cudaStream_t stream);

// THD (ragged) inputs of one cuDNN graph run over sequences [start, start + n) of a packed batch.
// cuDNN takes each tensor as [n, h, max_s, d] with the packed token stride and a ragged offset
// array [n + 1]: element offset of each sequence's first token from the tensor's pointer.
struct RaggedSource {
  const int32_t *cu_q = nullptr, *cu_kv = nullptr;    // [batch + 1] lengths
  const int32_t *pad_q = nullptr, *pad_kv = nullptr;  // [batch + 1] token offsets; null: cu_*
  const int64_t *rng = nullptr;                       // (seed, offset) when dropout, else null
  size_t batch = 0, max_q = 0, max_kv = 0, rows_q = 0, rows_kv = 0;
  int64_t stride[4] = {};                             // token strides of Q, K, V, O (elements)
  attn::MaskRule rule{};                              // which keys each query sees
};
struct RaggedRun {
  size_t start = 0, n = 0;                      // the run's sequences
  size_t graph_max_q = 0;                       // the graph's max_seqlen_q (>= the call's)
  int32_t *seq_q = nullptr, *seq_kv = nullptr;  // [n] lengths (0 past the batch)
  int32_t *off[4] = {};                         // [n + 1] element offsets of Q, K, V, O
  int64_t *rng = nullptr;                       // [2] this run's (seed, offset) when dropout
};
// Fills r's arrays. Lengths are clamped to [0, max] and to the tensor's rows, offsets to
// [0, rows], so malformed cu_seqlens cannot send cuDNN outside the buffers. Entries past the
// batch are empty sequences placed where the last one ends.
void ragged_run(const RaggedSource &s, const RaggedRun &r, cudaStream_t stream);

// THD decode steps (max_seqlen_q 1, fused_attn_thd_decode.h): the query row of sequence
// start + i of a THD tensor (row pad[g], or cu[g] without pad, when cu[g + 1] - cu[g] >= 1;
// clamped as ragged_run clamps) and row i < n of a [n, heads, row_bytes] scratch. to_scratch:
// THD -> scratch, zeros for a sequence without a query row or past the batch; else scratch ->
// THD, skipping those. Sizes in bytes.
void thd_decode_rows(void *thd, void *scratch, bool to_scratch, const int32_t *cu, const int32_t *pad, size_t batch,
                     size_t start, size_t n, size_t rows, size_t row_stride_bytes, size_t heads,
                     size_t head_stride_bytes, size_t row_bytes, cudaStream_t stream);

// A paged THD decode chunk's inputs for sequences [start, start + n): cu_seqlens of both sides
// [n + 1] (entries past the batch repeat the last one: empty sequences) and the first `used`
// columns of both page tables ([batch, width] -> [n, used]; rows past the batch: page 0).
struct DecodeChunk {
  const int32_t *cu_q = nullptr, *cu_kv = nullptr, *page_k = nullptr, *page_v = nullptr;
  int32_t *cu_q_out = nullptr, *cu_kv_out = nullptr, *page_k_out = nullptr, *page_v_out = nullptr;
  size_t batch = 0, start = 0, n = 0, width = 0, used = 0;
};
void decode_chunk_inputs(const DecodeChunk &c, cudaStream_t stream);

// Softmax statistics of r's sequences between the caller's [batch, h, max_q] buffer and the
// graph's [n, h, graph_max_q] scratch. to_caller: rows that see no key and rows past a sequence's
// length get -inf (fused_attn.h). Otherwise the scratch gets +inf for rows that see no key (so
// that cuDNN's backward takes their probabilities as exp(z - inf) = 0, not NaN) and 0 past the
// length and for sequences past the batch.
void ragged_stats(float *caller, float *scratch, const RaggedSource &s, const RaggedRun &r, size_t h,
                  bool to_caller, cudaStream_t stream);

// return_max_logit (fused_attn_cudnn.cpp): cuDNN gives the row maximum of the logits `max` and
// sum_exp = sum of exp(logit - max) over the row, from which these write the statistics
// max + log(sum_exp) and the max logit, each -inf for rows past a sequence's length and rows that
// see no key (fused_attn.h).
// BSHD/SBHD, in place: `stats` holds sum_exp on entry, both buffers are [batch, h, max_q]. seq_q /
// seq_kv: the padding lengths (null: every sequence has max_q / max_kv).
void logit_stats(float *stats, float *max, const int32_t *seq_q, const int32_t *seq_kv, size_t batch, size_t h,
                 size_t max_q, size_t max_kv, const attn::MaskRule &rule, cudaStream_t stream);
// THD: from the graph's [n, h, graph_max_q] scratch of run r into the caller's [batch, h, max_q].
void ragged_logit_stats(float *stats, float *max, const float *max_scratch, const float *sum_scratch,
                        const RaggedSource &s, const RaggedRun &r, size_t h, cudaStream_t stream);

// Zeroes rows of one float16/bfloat16 THD tensor of r's sequences that cuDNN leaves undefined:
// key_side false: query rows that see no key (O, dQ: fused_attn.h says 0; cuDNN gives NaN or
// an average of V there, and NaN for empty K/V sequences before cuDNN 9.25); key_side true:
// keys that no query of their sequence sees (dK, dV; every key of a sequence without queries).
// role: which offset array of r (0..3).
void ragged_zero_rows(void *base, const RaggedSource &s, const RaggedRun &r, int role, bool key_side,
                      size_t heads, size_t head_stride, size_t d, cudaStream_t stream);

// THD token rows of no sequence (gaps between sequences, unused rows at the end), which are zero in
// O and the gradients (fused_attn.h): mark_sequence_rows sets map[t] = 1 for every row t of a
// sequence (rows [pad[g], +len g), clamped as ragged_run clamps; map: `rows` bytes of device
// memory, cleared first), zero_unmarked_rows zeroes every head of each row left 0. A map instead
// of the gaps between consecutive offsets: cu_seqlens_*_padded come from the caller and need not
// be sorted, and zeroing from one sequence's end to the next one's start could erase another's rows.
void mark_sequence_rows(uint8_t *map, const int32_t *cu, const int32_t *pad, size_t batch, size_t max_len,
                        size_t rows, cudaStream_t stream);
void zero_unmarked_rows(void *base, const uint8_t *map, size_t rows, size_t row_stride_bytes, size_t heads,
                        size_t head_stride_bytes, size_t row_bytes, cudaStream_t stream);

// One float32 scalar operation on device pointers:
//   kSet:     *dst = src ? *src : 1.0f       (a scale to bind, or 1 for a float16/bfloat16 output)
//   kRecip:   *dst = 1.0f / *src             (correctly rounded, as the CPU's 1.0f / scale)
//   kFoldMax: *dst = fmaxf(*dst, *src)       (amax max-accumulation; NaN-ignoring like std::fmax)
//   kFoldUnit: *dst = fmaxf(*dst, *src > 0 ? 1 : 0)  (S's amax: see fused_attn_cudnn.cpp fp8_fwd)
// A null dst skips the entry (an optional buffer the caller did not give).
struct ScalarOp {
  enum Kind : int { kSet = 0, kRecip = 1, kFoldMax = 2, kFoldUnit = 3 };
  float *dst = nullptr;
  const float *src = nullptr;
  int kind = kSet;
};
constexpr int kMaxScalarOps = 16;
struct ScalarOps {
  ScalarOp op[kMaxScalarOps];
  int n = 0;
  void add(float *dst, const float *src, int kind) {
    NVTE_CHECK(n < kMaxScalarOps, "internal: more than ", kMaxScalarOps, " FP8 scalar operations in one launch");
    op[n++] = ScalarOp{dst, src, kind};
  }
};

// Runs the operations in order in one tiny launch on stream; no host synchronization.
void run_scalar_ops(const ScalarOps &ops, cudaStream_t stream);

}  // namespace nvte::cuda
