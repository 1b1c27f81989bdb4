// cpu/attn_rows.h - the per-row machinery the CPU fused attention forward and backward share:
// sequence bounds read from cu_seqlens, float64 copies of one head's K/V (FP8 inputs decoded
// and multiplied by their scale_inv), the logits of one query row (scale, bias, ALiBi, mask
// band), its softmax statistics and the dropout decision.
//
// The forward and the backward call exactly these functions, so the backward sees the very
// logits and dropout mask the forward used.
#pragma once

#include <cstdint>
#include <vector>

#include "../common/attn_params.h"

namespace nvte::cpu::attn_rows {

using attn::AttnParams;
using attn::KeyRange;

// float64 <-> element conversions for the float dtypes of fused attention.
void load_f64(const void *base, NVTEDType t, size_t offset, size_t n, double *out);
void store_f64(void *base, NVTEDType t, size_t offset, size_t n, const double *in);

// Aux copy slots: the source's bytes, or zeros when there is no source (dst null: nothing).
void copy_aux_slot(Tensor *dst, const Tensor *src);

// Sets `heads` x `d` elements of every token row of a (possibly packed) tensor to zero.
void zero_tensor(void *base, NVTEDType t, const attn::TensorPlacement &pl, size_t rows,
                 size_t heads, size_t d);

// Per-sequence lengths and THD token offsets, checked against the tensors' sizes; for paged
// layouts the page tables too (each sequence's used entries checked against the page count).
struct SeqBounds {
  std::vector<int64_t> len_q, len_kv, off_q, off_kv;
  std::vector<int32_t> page_k, page_v;  // paged layouts: [b][pages_per_seq]
};
SeqBounds seq_bounds(const AttnParams &p, const Tensor *cu_q, const Tensor *cu_kv,
                     const Tensor *cu_q_padded, const Tensor *cu_kv_padded,
                     const Tensor *page_k = nullptr, const Tensor *page_v = nullptr);

// Everything a row computation reads, resolved once per call.
struct RowContext {
  const AttnParams *p = nullptr;
  SeqBounds seq;
  const void *q = nullptr, *k = nullptr, *v = nullptr;
  const void *bias = nullptr;           // PRE/POST bias data
  NVTEDType bias_dtype = kNVTEFloat32;
  std::vector<double> slopes;           // ALiBi: [slopes_b or 1][h_q]
  std::vector<double> alpha;            // softmax sink logit per head (empty: vanilla)
  uint64_t seed = 0, offset = 0;
  uint32_t threshold = 0;               // dropout threshold (0: keep everything)
  double keep_scale = 1.0;              // 1 / (1 - dropout)
  double descale_q = 1.0, descale_k = 1.0, descale_v = 1.0;  // FP8: the inputs' scale_inv

  size_t kv_head(size_t h) const { return h / (p->h_q / p->h_kv); }
  size_t q_row(size_t b, int64_t i) const;   // token row of query i of sequence b
  size_t kv_row(size_t b, int64_t j, int role = attn::kK) const;  // token row of key j of sequence b in K or V
  KeyRange keys(size_t b, int64_t i) const;
  bool dropout() const { return threshold != 0; }
  bool keep(size_t b, size_t h, int64_t i, int64_t j) const;
};

RowContext make_context(const AttnParams &p, const Tensor &q, const Tensor &k, const Tensor &v,
                        const Tensor *bias, const Tensor *softmax_offset, const Tensor *rng_state,
                        const SeqBounds &seq);

// K and V of one (batch entry, K/V head) as float64 rows [len_kv][d] (times descale_k/v).
struct HeadKV {
  int64_t len = 0;
  std::vector<double> k, v;
};
HeadKV load_head_kv(const RowContext &c, size_t b, size_t hk);

// Loads query i of (b, h) as float64 [d_qk] (times descale_q).
void load_query(const RowContext &c, size_t b, size_t h, int64_t i, double *out);

// Softmax statistics of one row of n visible logits z and the sink logit of head h (none when
// c.alpha is empty): lse = m + log(sum exp(z - m) + exp(sink - m)), m = max(z, sink);
// lse = -inf when the row has neither a key nor a sink. max_logit = max(z) (-inf when n = 0).
struct RowStats {
  double lse, max_logit;
};
RowStats row_softmax_stats(const RowContext &c, size_t h, const double *z, size_t n);

// Logits z[j - r.lo] of query row i (loaded in q) against keys r.lo..r.hi of (b, h); masked
// keys are simply outside r, and bias entries of -inf stay -inf. bias_row is scratch.
void row_logits(const RowContext &c, size_t b, size_t h, int64_t i, const double *q,
                const HeadKV &kv, const KeyRange &r, double *z, std::vector<double> &bias_row);

}  // namespace nvte::cpu::attn_rows
