// cpu/attn_rows.cpp - sequence bounds, typed float64 loads and the logits of one query row
// for the CPU fused attention (attn_rows.h).
#include "attn_rows.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "../common/dtype_switch.h"
#include "attn_fp8_io.h"

namespace nvte::cpu::attn_rows {

void load_f64(const void *base, NVTEDType t, size_t offset, size_t n, double *out) {
  with_float_dtype(t, "attention input", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T *src = static_cast<const T *>(base) + offset;
    for (size_t i = 0; i < n; ++i) out[i] = static_cast<double>(to_f32(src[i]));
  });
}

namespace {

// double -> float rounded to odd (an inexact result gets its last mantissa bit set): rounding
// that float once more to a format at least two bits narrower (bf16, fp16) then gives the
// correctly rounded result of the double, as one rounding would. Plain double -> float -> bf16
// rounds twice and misses ties by one ulp.
float f64_to_f32_odd(double d) {
  float f = static_cast<float>(d);
  if (static_cast<double>(f) == d || std::isnan(d) || std::isinf(f)) return f;
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if (std::fabs(static_cast<double>(f)) > std::fabs(d)) --u;  // round-to-nearest went up: truncate
  u |= 1u;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

}  // namespace

void store_f64(void *base, NVTEDType t, size_t offset, size_t n, const double *in) {
  with_float_dtype(t, "attention output", [&](auto tag) {
    using T = typename decltype(tag)::type;
    T *dst = static_cast<T *>(base) + offset;
    if constexpr (std::is_same_v<T, float>) {
      for (size_t i = 0; i < n; ++i) dst[i] = static_cast<float>(in[i]);
    } else {
      for (size_t i = 0; i < n; ++i) dst[i] = from_f32<T>(f64_to_f32_odd(in[i]));
    }
  });
}

void copy_aux_slot(Tensor *dst, const Tensor *src) {
  if (dst == nullptr) return;
  const NVTEBasicTensor &d = dst->params[kNVTERowwiseData];
  const size_t bytes = numel(d.shape) * dtype_size(d.dtype);
  if (src != nullptr) {
    std::memcpy(d.data_ptr, src->params[kNVTERowwiseData].data_ptr, bytes);
  } else {
    std::memset(d.data_ptr, 0, bytes);
  }
}

void zero_tensor(void *base, NVTEDType t, const attn::TensorPlacement &pl, size_t rows,
                 size_t heads, size_t d) {
  const size_t es = dtype_size(t);
  for (size_t r = 0; r < rows; ++r)
    for (size_t h = 0; h < heads; ++h)
      std::memset(static_cast<char *>(base) + attn::element_offset(pl, r, h) * es, 0, d * es);
}

namespace {

const int32_t *int32_data(const Tensor *t) {
  return t ? static_cast<const int32_t *>(t->params[kNVTERowwiseData].data_ptr) : nullptr;
}

// Lengths (and THD offsets) of one side: from cu_seqlens when the mask pads or the format is
// THD, else every sequence has the padded length.
void fill_side(const AttnParams &p, bool from_cu, bool thd, const Tensor *cu, const Tensor *cu_pad,
               size_t max_len, size_t rows, const char *cu_name, const char *pad_name,
               std::vector<int64_t> &len, std::vector<int64_t> &off) {
  len.assign(p.batch, static_cast<int64_t>(max_len));
  off.assign(p.batch, 0);
  if (!from_cu) return;
  const int32_t *c = int32_data(cu);
  const int32_t *cp = cu_pad ? int32_data(cu_pad) : c;
  const char *off_name = cu_pad ? pad_name : cu_name;
  for (size_t b = 0; b < p.batch; ++b) {
    NVTE_CHECK(c[b] >= 0 && c[b + 1] >= c[b], cu_name, " must be non-decreasing from >= 0, but "
               "entries ", b, " and ", b + 1, " are ", c[b], " and ", c[b + 1]);
    len[b] = c[b + 1] - c[b];
    NVTE_CHECK(len[b] <= static_cast<int64_t>(max_len), cu_name, " gives sequence ", b, " length ",
               len[b], ", more than max_seqlen ", max_len);
    if (!thd) continue;
    off[b] = cp[b];
    NVTE_CHECK(off[b] >= 0 && off[b] + len[b] <= static_cast<int64_t>(rows), off_name,
               " places sequence ", b, " at tokens [", off[b], ", ", off[b] + len[b],
               ") but the THD tensor has ", rows, " tokens");
    NVTE_CHECK(b == 0 || off[b - 1] + len[b - 1] <= off[b], off_name, " makes sequences ", b - 1,
               " and ", b, " overlap (tokens [", off[b - 1], ", ", off[b - 1] + len[b - 1],
               ") and [", off[b], ", ", off[b] + len[b], "))");
  }
}

// A page table's entries for the keys each sequence has, checked to name a page of the cache.
std::vector<int32_t> page_table(const AttnParams &p, const Tensor *t, const char *name,
                                const std::vector<int64_t> &len_kv) {
  NVTE_CHECK(t != nullptr, "paged layout ", p.layout.name, " needs ", name);
  const int32_t *d = int32_data(t);
  std::vector<int32_t> table(d, d + p.batch * p.pages_per_seq);
  for (size_t b = 0; b < p.batch; ++b) {
    const size_t used = (static_cast<size_t>(len_kv[b]) + p.page_size - 1) / p.page_size;
    for (size_t i = 0; i < used; ++i) {
      const int32_t pg = table[b * p.pages_per_seq + i];
      NVTE_CHECK(pg >= 0 && static_cast<size_t>(pg) < p.num_pages, name, "[", b, "][", i, "] is ", pg,
                 p.num_pages == 0 ? std::string(", but the K/V caches hold no pages")
                                  : concat(", but the K/V caches hold pages 0..", p.num_pages - 1),
                 " (sequence ", b, " has ", len_kv[b], " keys, so its first ", used, " entries are read)");
    }
  }
  return table;
}

}  // namespace

SeqBounds seq_bounds(const AttnParams &p, const Tensor *cu_q, const Tensor *cu_kv,
                     const Tensor *cu_q_padded, const Tensor *cu_kv_padded, const Tensor *page_k,
                     const Tensor *page_v) {
  const bool q_thd = p.layout.q_format == NVTE_THD, kv_thd = p.layout.kv_format == NVTE_THD;
  SeqBounds s;
  fill_side(p, p.padding || q_thd, q_thd, cu_q, q_thd ? cu_q_padded : nullptr, p.max_sq, p.rows_q,
            "cu_seqlens_q", "cu_seqlens_q_padded", s.len_q, s.off_q);
  fill_side(p, p.padding || kv_thd, kv_thd, cu_kv, kv_thd ? cu_kv_padded : nullptr, p.max_skv,
            p.rows_kv, "cu_seqlens_kv", "cu_seqlens_kv_padded", s.len_kv, s.off_kv);
  if (p.layout.paged) {
    s.page_k = page_table(p, page_k, "page_table_k", s.len_kv);
    s.page_v = page_table(p, page_v, "page_table_v", s.len_kv);
  }
  return s;
}

size_t RowContext::q_row(size_t b, int64_t i) const {
  return attn::token_row(p->layout.q_format, b, static_cast<size_t>(i), p->batch, p->max_sq,
                         static_cast<size_t>(seq.off_q[b]));
}

size_t RowContext::kv_row(size_t b, int64_t j, int role) const {
  if (p->layout.paged) {  // a cache is [pages, page_size] (BSHD) or [page_size, pages] (SBHD) rows
    const std::vector<int32_t> &table = role == attn::kV ? seq.page_v : seq.page_k;
    const size_t jj = static_cast<size_t>(j);
    const size_t page = static_cast<size_t>(table[b * p->pages_per_seq + jj / p->page_size]);
    return attn::token_row(p->layout.kv_format, page, jj % p->page_size, p->num_pages, p->page_size, 0);
  }
  return attn::token_row(p->layout.kv_format, b, static_cast<size_t>(j), p->batch, p->max_skv,
                         static_cast<size_t>(seq.off_kv[b]));
}

KeyRange RowContext::keys(size_t b, int64_t i) const {
  return attn::visible_keys(p->rule, i, seq.len_q[b], seq.len_kv[b]);
}

bool RowContext::keep(size_t b, size_t h, int64_t i, int64_t j) const {
  return attn::dropout_keep(seed, offset, static_cast<uint64_t>(b) * p->h_q + h,
                            static_cast<uint64_t>(i), static_cast<uint64_t>(j), threshold);
}

RowContext make_context(const AttnParams &p, const Tensor &q, const Tensor &k, const Tensor &v,
                        const Tensor *bias, const Tensor *softmax_offset, const Tensor *rng_state,
                        const SeqBounds &seq) {
  RowContext c;
  c.p = &p;
  c.seq = seq;
  c.q = q.params[kNVTERowwiseData].data_ptr;
  c.k = k.params[kNVTERowwiseData].data_ptr;
  c.v = v.params[kNVTERowwiseData].data_ptr;
  if (p.bias_type == NVTE_PRE_SCALE_BIAS || p.bias_type == NVTE_POST_SCALE_BIAS) {
    c.bias = bias->params[kNVTERowwiseData].data_ptr;
    c.bias_dtype = bias->params[kNVTERowwiseData].dtype;
  } else if (p.bias_type == NVTE_ALIBI) {
    if (p.slopes_b != 0) {
      const float *s = static_cast<const float *>(bias->params[kNVTERowwiseData].data_ptr);
      c.slopes.assign(s, s + p.slopes_b * p.h_q);
    } else {
      for (size_t h = 0; h < p.h_q; ++h) c.slopes.push_back(attn::default_alibi_slope(h, p.h_q));
    }
  }
  if (p.softmax_type == NVTE_OFF_BY_ONE_SOFTMAX) {
    c.alpha.assign(p.h_q, 0.0);  // the "1 +" of the denominator is exp(0)
  } else if (p.softmax_type == NVTE_LEARNABLE_SOFTMAX) {
    const float *a = static_cast<const float *>(softmax_offset->params[kNVTERowwiseData].data_ptr);
    c.alpha.assign(a, a + p.h_q);
  }
  if (is_fp8(p.dtype)) {  // the API layer checked that each has a scale_inv
    c.descale_q = attn_fp8::checked_scale(*scalar_param(q, kNVTERowwiseScaleInv, "Q scale_inv"), "Q", "scale_inv");
    c.descale_k = attn_fp8::checked_scale(*scalar_param(k, kNVTERowwiseScaleInv, "K scale_inv"), "K", "scale_inv");
    c.descale_v = attn_fp8::checked_scale(*scalar_param(v, kNVTERowwiseScaleInv, "V scale_inv"), "V", "scale_inv");
  }
  if (p.dropout > 0.0f) {
    const int64_t *r = static_cast<const int64_t *>(rng_state->params[kNVTERowwiseData].data_ptr);
    c.seed = static_cast<uint64_t>(r[0]);
    c.offset = static_cast<uint64_t>(r[1]);
    c.threshold = attn::dropout_threshold(p.dropout);
    if (c.threshold != 0) c.keep_scale = 1.0 / (1.0 - static_cast<double>(p.dropout));
  }
  return c;
}

HeadKV load_head_kv(const RowContext &c, size_t b, size_t hk) {
  const AttnParams &p = *c.p;
  HeadKV kv;
  kv.len = c.seq.len_kv[b];
  const size_t n = static_cast<size_t>(kv.len);
  kv.k.resize(n * p.d_qk);
  kv.v.resize(n * p.d_v);
  for (size_t j = 0; j < n; ++j) {
    const int64_t jj = static_cast<int64_t>(j);
    load_f64(c.k, p.dtype, attn::element_offset(p.qkv.t[attn::kK], c.kv_row(b, jj, attn::kK), hk),
             p.d_qk, &kv.k[j * p.d_qk]);
    load_f64(c.v, p.dtype, attn::element_offset(p.qkv.t[attn::kV], c.kv_row(b, jj, attn::kV), hk),
             p.d_v, &kv.v[j * p.d_v]);
  }
  // Exact in float64: an FP8 value has at most 4 significant bits, a float32 scale_inv 24.
  if (c.descale_k != 1.0)
    for (double &x : kv.k) x *= c.descale_k;
  if (c.descale_v != 1.0)
    for (double &x : kv.v) x *= c.descale_v;
  return kv;
}

void load_query(const RowContext &c, size_t b, size_t h, int64_t i, double *out) {
  const AttnParams &p = *c.p;
  load_f64(c.q, p.dtype, attn::element_offset(p.qkv.t[attn::kQ], c.q_row(b, i), h), p.d_qk, out);
  if (c.descale_q != 1.0)
    for (size_t e = 0; e < p.d_qk; ++e) out[e] *= c.descale_q;
}

RowStats row_softmax_stats(const RowContext &c, size_t h, const double *z, size_t n) {
  constexpr double kNegInf = -std::numeric_limits<double>::infinity();
  double mx = kNegInf;
  for (size_t t = 0; t < n; ++t)
    if (z[t] > mx || std::isnan(z[t])) mx = z[t];
  const bool sink = !c.alpha.empty();
  const double alpha = sink ? c.alpha[h] : kNegInf;
  const double m = (sink && alpha > mx) ? alpha : mx;
  if (m == kNegInf) return {kNegInf, mx};
  double sum = sink ? std::exp(alpha - m) : 0.0;
  for (size_t t = 0; t < n; ++t) sum += std::exp(z[t] - m);
  return {m + std::log(sum), mx};
}

void row_logits(const RowContext &c, size_t b, size_t h, int64_t i, const double *q,
                const HeadKV &kv, const KeyRange &r, double *z, std::vector<double> &bias_row) {
  const AttnParams &p = *c.p;
  const size_t d = p.d_qk;
  const size_t n = static_cast<size_t>(r.hi - r.lo + 1);
  const double scale = p.scale;
  const bool pre = p.bias_type == NVTE_PRE_SCALE_BIAS, post = p.bias_type == NVTE_POST_SCALE_BIAS;
  if (pre || post) {
    const size_t bb = p.bias_b == 1 ? 0 : b, bh = p.bias_h == 1 ? 0 : h;
    const size_t row = ((bb * p.bias_h + bh) * p.max_sq + static_cast<size_t>(i)) * p.max_skv;
    bias_row.resize(n);
    load_f64(c.bias, c.bias_dtype, row + static_cast<size_t>(r.lo), n, bias_row.data());
  }
  const bool alibi = p.bias_type == NVTE_ALIBI;
  const double slope = alibi ? c.slopes[(p.slopes_b > 1 ? b * p.h_q : 0) + h] : 0.0;
  const int64_t diag = attn::diagonal(p.rule, c.seq.len_q[b], c.seq.len_kv[b]);
  for (size_t t = 0; t < n; ++t) {
    const double *kj = &kv.k[(static_cast<size_t>(r.lo) + t) * d];
    double dot = 0.0;
    for (size_t e = 0; e < d; ++e) dot += q[e] * kj[e];
    if (pre) {
      z[t] = scale * (dot + bias_row[t]);
    } else if (post) {
      z[t] = scale * dot + bias_row[t];
    } else if (alibi) {
      z[t] = scale * dot + attn::alibi_term(slope, i, r.lo + static_cast<int64_t>(t), diag);
    } else {
      z[t] = scale * dot;
    }
  }
}

}  // namespace nvte::cpu::attn_rows
