// cuda/cudnn/fused_attn_cudnn_bind.cpp - the parts of a cuDNN attention call around the graph:
// the workspace layout, binding of sequence lengths, ragged offsets and page tables, zeroing the
// rows cuDNN leaves undefined, and THD runs. Kept apart from fused_attn_cudnn.cpp so it compiles
// without the cuDNN frontend headers (fused_attn_cudnn_calls.h).
#include <cstring>

#include "../cuda_check.h"
#include "fused_attn_cudnn_calls.h"
#include "fused_attn_cudnn_rules.h"
#include "fused_attn_seqlens.h"
#include "fused_attn_sink.h"

namespace nvte::cuda::cudnn_attn {

// Workspace: cuDNN's, then (padding masks, THD) two int32 [b] sequence-length arrays (with
// ragged_padding followed by the offsets of Q, K, V, O, int32 [b + 1] each), then (THD) the ragged
// offsets of Q, K, V, O (int32 [b + 1] each), the run's (seed, offset), the statistics scratch
// [b, h_q, max_sq] (b: the graph's batch; with return_max_logit two of them, cuDNN's Sum_exp and
// Max) and the row maps of Q and K/V (a byte per token row), then (paged caches) the clamped page
// tables of K and V (int32 [b, pages] each), then (FP8) a block of float32 scalars (descales the
// graph reads, amax values it writes), then (off-by-one / learnable softmax) float32 [h_q] (the
// off-by-one softmax's zero sink token) and either the statistics [b, h_q, max_sq] of a
// sink_rescale call or the partial sums of the learnable offset's gradient.
size_t seqlen_bytes(const AttnParams &p) {
  const AttnParams g = graph_params(p);
  const size_t ragged = ragged_padding(p) ? 4 * align256((g.batch + 1) * 4) : 0;  // bind_seqlens' offsets
  return g.padding ? 2 * align256(g.batch * 4) + ragged : 0;
}
namespace {
// The clamped page tables: [graph batch, pages] each (THD queries: a run's rows).
size_t page_table_bytes(const AttnParams &p) { return align256(graph_params(p).batch * graph_pages(p) * 4); }
size_t page_bytes(const AttnParams &p) { return 2 * page_table_bytes(p); }
// THD: the row maps of mark_sequence_rows (a byte per token row of Q, and of K/V when THD).
size_t row_map_bytes(const AttnParams &p) {
  return thd(p) ? align256(p.rows_q) + (kv_thd(p) ? align256(p.rows_kv) : 0) : 0;
}
size_t ragged_bytes(const AttnParams &p) {
  if (!thd(p)) return 0;
  const AttnParams g = graph_params(p);
  const size_t scratches = g.return_max_logit ? 2 : (g.is_training ? 1 : 0);
  return 4 * align256((g.batch + 1) * 4) + 256 + scratches * align256(g.batch * g.h_q * g.max_sq * 4) +
         row_map_bytes(p);
}
constexpr size_t kFp8ScalarBytes = 256;
size_t fp8_scalar_bytes(const AttnParams &p) { return is_fp8(p.dtype) ? kFp8ScalarBytes : 0; }
size_t sink_bytes(const AttnParams &p) {
  if (p.softmax_type == NVTE_VANILLA_SOFTMAX) return 0;
  const AttnParams g = graph_params(p);
  return align256(p.h_q * 4) + (sink_rescale(p) ? align256(g.batch * p.h_q * g.max_sq * 4)
                                                  : softmax_offset_grad_scratch_bytes(p.h_q));
}
}  // namespace
size_t cudnn_bytes(const Built &b) { return align256((size_t)b.workspace); }
size_t total_bytes(const AttnParams &p, const Built &b) {
  return cudnn_bytes(b) + seqlen_bytes(p) + ragged_bytes(p) + page_bytes(p) + fp8_scalar_bytes(p) + sink_bytes(p);
}
char *sink_area(const AttnParams &p, const Built &b, char *ws) {
  return ws + cudnn_bytes(b) + seqlen_bytes(p) + ragged_bytes(p) + page_bytes(p) + fp8_scalar_bytes(p);
}
char *sink_scratch(const AttnParams &p, const Built &b, char *ws) { return sink_area(p, b, ws) + align256(p.h_q * 4); }
float *fp8_scalars(const AttnParams &p, const Built &b, char *ws) {
  return reinterpret_cast<float *>(ws + cudnn_bytes(b) + seqlen_bytes(p) + ragged_bytes(p) + page_bytes(p));
}

void bind_page_tables(const AttnParams &p, const Built &b, const Tensor *page_k, const Tensor *page_v, size_t start,
                      char *ws, VariantPack &pack, cudaStream_t stream) {
  const size_t n = graph_params(p).batch, used = graph_pages(p);
  int32_t *pk = reinterpret_cast<int32_t *>(ws + cudnn_bytes(b) + seqlen_bytes(p) + ragged_bytes(p));
  int32_t *pv = pk + page_table_bytes(p) / 4;
  const auto rows = [&](const Tensor *t) { return static_cast<const int32_t *>(data(t)) + start * p.pages_per_seq; };
  clamped_page_tables(rows(page_k), rows(page_v), pk, pv, n, p.batch > start ? p.batch - start : 0, p.pages_per_seq,
                      used, p.num_pages, stream);
  pack[kUPageK] = pk;
  pack[kUPageV] = pv;
}

static UnusedRows unused_rows(const AttnParams &p, const VariantPack &pack) {
  UnusedRows u;
  if (p.padding) {
    u.seq_q = static_cast<const int32_t *>(pack.at(kUSeqQ));
    u.seq_kv = static_cast<const int32_t *>(pack.at(kUSeqKV));
  }
  u.batch = p.batch;
  u.max_q = p.max_sq;
  u.max_kv = p.max_skv;
  u.rule = p.rule;
  u.rule.bottom_right = bottom_right(p);  // as the graph aligns it (the same rows at equal lengths)
  return u;
}

void clear_unused_rows(const AttnParams &p, const VariantPack &pack, void *base, const attn::TensorPlacement &pl,
                       bool kv_side, size_t heads, size_t d, NVTEDType dtype, cudaStream_t stream) {
  if (thd(p)) return;
  const size_t es = dtype_size(dtype);
  UnusedRows u = unused_rows(p, pack);
  u.key_side = kv_side;
  u.rows = kv_side ? p.max_skv : p.max_sq;
  u.sbhd = pl.format == NVTE_SBHD;
  u.row_stride = pl.row_stride * es;
  u.heads = heads;
  u.head_stride = pl.head_stride * es;
  u.row_bytes = d * es;
  zero_unused_rows(base, u, stream);
}

void clear_unused_stats(const AttnParams &p, const VariantPack &pack, float *stats, const float *sink,
                        cudaStream_t stream) {
  if (thd(p)) return;
  UnusedRows u = unused_rows(p, pack);
  u.heads = p.h_q;
  u.sink = sink;
  stats_unused_rows(stats, u, stream);
}

char *workspace_ptr(Tensor *ws, size_t need) {
  if (need == 0) return nullptr;
  NVTE_CHECK(ws != nullptr && data(ws) != nullptr && bytes_of(*ws) >= need,
             "fused attention on the GPU needs a workspace of ", need,
             " bytes (query it with nvte_fused_attn_{fwd,bwd}_workspace_size)");
  NVTE_CHECK(aligned(data(ws), 256), "the fused attention workspace must be 256-byte aligned");
  return static_cast<char *>(data(ws));
}

void bind_seqlens(const AttnParams &p, const Tensor *cu_q, const Tensor *cu_kv, char *extra, VariantPack &pack,
                  cudaStream_t stream) {
  if (!graph_params(p).padding) return;
  // Without the caller's padding mask (graph_params' bottom-right case) every length is its maximum.
  NVTE_CHECK(!p.padding || (cu_q != nullptr && cu_kv != nullptr), "padding masks need cu_seqlens_q and cu_seqlens_kv");
  int32_t *sq = reinterpret_cast<int32_t *>(extra);
  int32_t *skv = reinterpret_cast<int32_t *>(extra + align256(p.batch * 4));
  seqlens_from_cu(p.padding ? static_cast<const int32_t *>(data(cu_q)) : nullptr,
                  p.padding ? static_cast<const int32_t *>(data(cu_kv)) : nullptr, sq, skv, p.batch, p.max_sq,
                  p.max_skv, stream);
  if (ragged_padding(p)) {  // sequence b's first row: row b * max_seqlen (BSHD) or b (SBHD)
    int32_t *off = reinterpret_cast<int32_t *>(extra + 2 * align256(p.batch * 4));
    const size_t step = align256((p.batch + 1) * 4) / 4;
    const attn::TensorPlacement *pl[4] = {&p.qkv.t[attn::kQ], &p.qkv.t[attn::kK], &p.qkv.t[attn::kV], &p.out};
    const int64_t uid[4] = {kURaggedQ, kURaggedK, kURaggedV, kURaggedO};
    int64_t per[4];
    for (int i = 0; i < 4; ++i) {
      const size_t rows = pl[i]->format == NVTE_SBHD ? 1 : (i == 1 || i == 2 ? p.max_skv : p.max_sq);
      per[i] = (int64_t)(rows * pl[i]->row_stride);
    }
    batch_offsets(off, step, per, p.batch, stream);
    for (int i = 0; i < 4; ++i) pack[uid[i]] = off + i * step;
  }
  pack[kUSeqQ] = sq;
  pack[kUSeqKV] = skv;
}



void run_thd(const AttnParams &p, const Built &b, const ThdInputs &in, VariantPack &pack, char *ws,
             cudaStream_t stream) {
  NVTE_CHECK(in.cu_q != nullptr && in.cu_kv != nullptr, "THD needs cu_seqlens_q and cu_seqlens_kv");
  RaggedRun r;
  r.n = graph_params(p).batch;
  r.graph_max_q = graph_params(p).max_sq;
  char *x = ws + cudnn_bytes(b);
  r.seq_q = reinterpret_cast<int32_t *>(x);
  r.seq_kv = reinterpret_cast<int32_t *>(x + seqlen_bytes(p) / 2);
  x += seqlen_bytes(p);
  for (int i = 0; i < 4; ++i, x += align256((r.n + 1) * 4)) r.off[i] = reinterpret_cast<int32_t *>(x);
  if (in.rng) r.rng = reinterpret_cast<int64_t *>(x);
  float *scratch = in.stats ? reinterpret_cast<float *>(x + 256) : nullptr;
  // return_max_logit: scratch takes cuDNN's Sum_exp, max_scratch its Max.
  float *max_scratch = in.max_logit ? scratch + align256(r.n * p.h_q * r.graph_max_q * 4) / 4 : nullptr;

  RaggedSource s;
  const auto i32 = [](const Tensor *t) { return t ? static_cast<const int32_t *>(data(t)) : nullptr; };
  s.cu_q = i32(in.cu_q);
  s.cu_kv = i32(in.cu_kv);
  s.pad_q = i32(in.pad_q);
  s.pad_kv = kv_thd(p) ? i32(in.pad_kv) : nullptr;
  s.rng = in.rng ? static_cast<const int64_t *>(data(in.rng)) : nullptr;
  s.batch = p.batch;
  s.max_q = p.max_sq;
  s.max_kv = p.max_skv;
  s.rows_q = p.rows_q;
  // BSHD/SBHD K/V or a paged cache: cu_seqlens_kv gives lengths only, never rows to clamp them by.
  s.rows_kv = kv_thd(p) ? p.rows_kv : p.batch * p.max_skv;
  s.rule = p.rule;
  const attn::TensorPlacement *pl[4] = {&p.qkv.t[attn::kQ], &p.qkv.t[attn::kK], &p.qkv.t[attn::kV], &p.out};
  for (int i = 0; i < 4; ++i) s.stride[i] = (int64_t)pl[i]->row_stride;

  pack[kUSeqQ] = r.seq_q;
  pack[kUSeqKV] = r.seq_kv;
  const int64_t uid[4] = {kURaggedQ, kURaggedK, kURaggedV, kURaggedO};
  for (int i = 0; i < 4; ++i)
    if (i == 0 || i == 3 || kv_thd(p)) pack[uid[i]] = r.off[i];
  if (r.rng) {
    pack[kUSeed] = r.rng;
    pack[kUOffset] = r.rng + 1;
  }
  if (max_scratch) {
    pack[kUSumExp] = scratch;
    pack[kUMax] = max_scratch;
  } else if (scratch) {
    pack[kUStats] = scratch;
  }
  const bool fwd = in.o != nullptr;
  for (r.start = 0; r.start < p.batch; r.start += r.n) {
    ragged_run(s, r, stream);
    if (p.layout.paged) bind_page_tables(p, b, in.page_k, in.page_v, r.start, ws, pack, stream);
    if (scratch && !fwd) ragged_stats(in.stats, scratch, s, r, p.h_q, false, stream);
    execute(b, pack, ws, stream);
    if (fwd) {
      if (max_scratch) ragged_logit_stats(in.stats, in.max_logit, max_scratch, scratch, s, r, p.h_q, stream);
      else if (scratch) ragged_stats(in.stats, scratch, s, r, p.h_q, true, stream);
      ragged_zero_rows(in.o, s, r, 3, false, p.h_q, p.out.head_stride, p.d_v, stream);
    } else {
      ragged_zero_rows(in.dq, s, r, 0, false, p.h_q, pl[0]->head_stride, p.d_qk, stream);
      ragged_zero_rows(in.dk, s, r, 1, true, p.h_kv, pl[1]->head_stride, p.d_qk, stream);
      ragged_zero_rows(in.dv, s, r, 2, true, p.h_kv, pl[2]->head_stride, p.d_v, stream);
    }
  }
  // Token rows of no sequence (gaps, unused rows at the end) are zero (fused_attn.h); cuDNN
  // writes only the rows of its sequences.
  uint8_t *map_q = reinterpret_cast<uint8_t *>(ws + cudnn_bytes(b) + seqlen_bytes(p) + ragged_bytes(p) -
                                               row_map_bytes(p));
  uint8_t *map_kv = map_q + align256(p.rows_q);
  const size_t es = dtype_size(p.dtype);
  const auto zero_rest = [&](void *base, const uint8_t *map, size_t rows, const attn::TensorPlacement &t,
                             size_t heads, size_t d) {
    zero_unmarked_rows(base, map, rows, t.row_stride * es, heads, t.head_stride * es, d * es, stream);
  };
  mark_sequence_rows(map_q, s.cu_q, s.pad_q, s.batch, s.max_q, s.rows_q, stream);
  if (fwd) return zero_rest(in.o, map_q, p.rows_q, p.out, p.h_q, p.d_v);
  zero_rest(in.dq, map_q, p.rows_q, *pl[0], p.h_q, p.d_qk);
  if (!kv_thd(p)) return;  // (BSHD/SBHD K/V: the backward is not supported there)
  mark_sequence_rows(map_kv, s.cu_kv, s.pad_kv, s.batch, s.max_kv, s.rows_kv, stream);
  zero_rest(in.dk, map_kv, p.rows_kv, *pl[1], p.h_kv, p.d_qk);
  zero_rest(in.dv, map_kv, p.rows_kv, *pl[2], p.h_kv, p.d_v);
}

}  // namespace nvte::cuda::cudnn_attn
