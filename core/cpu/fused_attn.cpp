// cpu/fused_attn.cpp - CPU reference of fused attention: forward and backward over
// (batch entry, head) tasks on the thread pool, float64 throughout, one rounding per stored
// value. FP8 inputs go to cpu/fused_attn_fp8.cpp (same rows, quantized dataflow).
//
// Forward, per query row: z = logits of the visible keys, m = max(z, sink), lse = m +
// log(sum exp(z - m) + exp(sink - m)), P = exp(z - lse), O = sum_j dropout(P_j) V_j.
// Backward, per row, from the stored lse (so it sees the forward's P exactly):
// dP_j = dropout(dO . V_j), D = dO . O, dz_j = P_j (dP_j - D); dQ = scale dz K,
// dK += scale dz^T Q, dV += dropout(P)^T dO, dSink = -exp(sink - lse) D, dBias from dz.
// Tasks own disjoint outputs (forward: (b, h); backward: (b, K/V head) with its Q heads), and
// dBias / dSoftmaxOffset are reduced in a fixed order, so results do not depend on threads.
#include "fused_attn.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "attn_rows.h"
#include "parallel.h"

namespace nvte::cpu {

using attn::AttnParams;
using attn::KeyRange;
using namespace attn_rows;

namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

void *data(const Tensor *t) { return t ? t->params[kNVTERowwiseData].data_ptr : nullptr; }

size_t stats_index(const AttnParams &p, size_t b, size_t h, int64_t i) {
  return (b * p.h_q + h) * p.max_sq + static_cast<size_t>(i);
}

// Forward of query row i of (b, h): acc = O row (d_v); lse = -inf when the row sees no key.
RowStats attend_row(const RowContext &c, size_t b, size_t h, int64_t i, const double *q,
                    const HeadKV &kv, std::vector<double> &z, std::vector<double> &bias_row,
                    double *acc) {
  const AttnParams &p = *c.p;
  std::fill(acc, acc + p.d_v, 0.0);
  const KeyRange r = c.keys(b, i);
  const size_t n = r.hi >= r.lo ? static_cast<size_t>(r.hi - r.lo + 1) : 0;
  if (n > 0) {
    z.resize(n);
    row_logits(c, b, h, i, q, kv, r, z.data(), bias_row);
  }
  const RowStats st = row_softmax_stats(c, h, z.data(), n);
  if (st.lse == kNegInf) return st;  // no visible key and no sink: O = 0
  const double lse = st.lse;
  for (size_t t = 0; t < n; ++t) {
    const int64_t j = r.lo + static_cast<int64_t>(t);
    double pz = std::exp(z[t] - lse);
    if (c.dropout()) {
      if (!c.keep(b, h, i, j)) continue;
      pz *= c.keep_scale;
    }
    const double *vj = &kv.v[static_cast<size_t>(j) * p.d_v];
    for (size_t e = 0; e < p.d_v; ++e) acc[e] += pz * vj[e];
  }
  return st;
}

// Inputs of the backward row gradient.
struct GradInputs {
  const void *o, *d_o;
  const float *stats;
};

// Scratch and results of one backward row.
struct RowGrad {
  KeyRange r{0, -1};
  double lse = 0.0, D = 0.0;
  std::vector<double> q, d_o, o, z, ds, pd, bias_row;
};

// dz (ds) and dropout-scaled probabilities (pd) of query row i of (b, h); false when the row
// contributes nothing (no visible key, or a forward that saw none).
bool row_grad(const RowContext &c, const GradInputs &g, size_t b, size_t h, int64_t i,
              const HeadKV &kv, RowGrad &w) {
  const AttnParams &p = *c.p;
  w.lse = g.stats[stats_index(p, b, h, i)];
  w.r = c.keys(b, i);
  if (w.lse == kNegInf || w.r.hi < w.r.lo) return false;
  const size_t n = static_cast<size_t>(w.r.hi - w.r.lo + 1);
  w.q.resize(p.d_qk);
  w.d_o.resize(p.d_v);
  w.o.resize(p.d_v);
  load_query(c, b, h, i, w.q.data());
  const size_t orow = attn::element_offset(p.out, c.q_row(b, i), h);
  load_f64(g.d_o, p.dtype, orow, p.d_v, w.d_o.data());
  load_f64(g.o, p.dtype, orow, p.d_v, w.o.data());
  w.D = 0.0;
  for (size_t e = 0; e < p.d_v; ++e) w.D += w.d_o[e] * w.o[e];
  w.z.resize(n);
  w.ds.resize(n);
  w.pd.resize(n);
  row_logits(c, b, h, i, w.q.data(), kv, w.r, w.z.data(), w.bias_row);
  for (size_t t = 0; t < n; ++t) {
    const int64_t j = w.r.lo + static_cast<int64_t>(t);
    const double prob = std::exp(w.z[t] - w.lse);
    const double *vj = &kv.v[static_cast<size_t>(j) * p.d_v];
    double dp = 0.0;
    for (size_t e = 0; e < p.d_v; ++e) dp += w.d_o[e] * vj[e];
    double drop = 1.0;
    if (c.dropout()) drop = c.keep(b, h, i, j) ? c.keep_scale : 0.0;
    w.pd[t] = prob * drop;
    w.ds[t] = prob * (dp * drop - w.D);
  }
  return true;
}

// dBias: one task per bias slot (broadcast dims summed over their batch entries and heads in
// a fixed order); the logits are recomputed rather than kept.
void bias_grad(const RowContext &c, const GradInputs &g, Tensor &dbias) {
  const AttnParams &p = *c.p;
  const NVTEBasicTensor &db = dbias.params[kNVTERowwiseData];
  const double factor = p.bias_type == NVTE_PRE_SCALE_BIAS ? static_cast<double>(p.scale) : 1.0;
  const size_t plane = p.max_sq * p.max_skv;
  parallel_for(p.bias_b * p.bias_h, 1, [&](size_t s0, size_t s1) {
    std::vector<double> acc(plane);
    RowGrad w;
    for (size_t s = s0; s < s1; ++s) {
      const size_t bb = s / p.bias_h, bh = s % p.bias_h;
      std::fill(acc.begin(), acc.end(), 0.0);
      for (size_t b = 0; b < p.batch; ++b) {
        if (p.bias_b != 1 && b != bb) continue;
        for (size_t h = 0; h < p.h_q; ++h) {
          if (p.bias_h != 1 && h != bh) continue;
          const HeadKV kv = load_head_kv(c, b, c.kv_head(h));
          for (int64_t i = 0; i < c.seq.len_q[b]; ++i) {
            if (!row_grad(c, g, b, h, i, kv, w)) continue;
            double *arow = &acc[static_cast<size_t>(i) * p.max_skv + static_cast<size_t>(w.r.lo)];
            for (size_t t = 0; t < w.ds.size(); ++t) arow[t] += factor * w.ds[t];
          }
        }
      }
      store_f64(db.data_ptr, db.dtype, s * plane, plane, acc.data());
    }
  });
}

}  // namespace

void fused_attn_fwd(const AttnParams &p, const attn::AttnFwdTensors &t) {
  if (is_fp8(p.dtype)) return fused_attn_fp8_fwd(p, t);
  const SeqBounds seq =
      seq_bounds(p, t.cu_q, t.cu_kv, t.cu_q_padded, t.cu_kv_padded, t.page_k, t.page_v);
  const RowContext c = make_context(p, *t.q, *t.k, *t.v, t.bias, t.softmax_offset, t.rng_state, seq);
  void *o = data(t.o);
  float *stats = static_cast<float *>(data(t.stats));
  float *max_logit = static_cast<float *>(data(t.max_logit));
  // Rows no query writes (padding positions, THD gaps) stay 0 / -inf.
  std::memset(o, 0, numel(t.o->params[kNVTERowwiseData].shape) * dtype_size(p.dtype));
  const size_t n_stats = p.batch * p.h_q * p.max_sq;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  if (stats) std::fill(stats, stats + n_stats, neg_inf);
  if (max_logit) std::fill(max_logit, max_logit + n_stats, neg_inf);
  copy_aux_slot(t.aux_rng, t.rng_state);
  copy_aux_slot(t.aux_bias, t.bias);
  copy_aux_slot(t.aux_offset, t.softmax_offset);

  parallel_for(p.batch * p.h_q, 1, [&](size_t t0, size_t t1) {
    std::vector<double> q(p.d_qk), acc(p.d_v), z, bias_row;
    for (size_t task = t0; task < t1; ++task) {
      const size_t b = task / p.h_q, h = task % p.h_q;
      const HeadKV kv = load_head_kv(c, b, c.kv_head(h));
      for (int64_t i = 0; i < seq.len_q[b]; ++i) {
        load_query(c, b, h, i, q.data());
        const RowStats rs = attend_row(c, b, h, i, q.data(), kv, z, bias_row, acc.data());
        store_f64(o, p.dtype, attn::element_offset(p.out, c.q_row(b, i), h), p.d_v, acc.data());
        if (stats) stats[stats_index(p, b, h, i)] = static_cast<float>(rs.lse);
        if (max_logit) max_logit[stats_index(p, b, h, i)] = static_cast<float>(rs.max_logit);
      }
    }
  });
}

void fused_attn_bwd(const AttnParams &p, const attn::AttnBwdTensors &t) {
  if (is_fp8(p.dtype)) return fused_attn_fp8_bwd(p, t);
  const SeqBounds seq = seq_bounds(p, t.cu_q, t.cu_kv, t.cu_q_padded, t.cu_kv_padded);
  const RowContext c = make_context(p, *t.q, *t.k, *t.v, t.bias, t.softmax_offset, t.rng_state, seq);
  const GradInputs g{data(t.o), data(t.d_o), static_cast<const float *>(data(t.stats))};
  void *dq = data(t.dq), *dk = data(t.dk), *dv = data(t.dv);
  // Every gradient element is written: rows no sequence covers get 0.
  zero_tensor(dq, p.dtype, p.qkv.t[attn::kQ], p.rows_q, p.h_q, p.d_qk);
  zero_tensor(dk, p.dtype, p.qkv.t[attn::kK], p.rows_kv, p.h_kv, p.d_qk);
  zero_tensor(dv, p.dtype, p.qkv.t[attn::kV], p.rows_kv, p.h_kv, p.d_v);
  const size_t group = p.h_q / p.h_kv;
  const double scale = p.scale;
  const bool learnable = p.softmax_type == NVTE_LEARNABLE_SOFTMAX;
  std::vector<double> dalpha(p.batch * p.h_q, 0.0);  // per (b, h): reduced over b afterwards

  parallel_for(p.batch * p.h_kv, 1, [&](size_t t0, size_t t1) {
    RowGrad w;
    std::vector<double> dq_row(p.d_qk), dk_acc, dv_acc;
    for (size_t task = t0; task < t1; ++task) {
      const size_t b = task / p.h_kv, hk = task % p.h_kv;
      const HeadKV kv = load_head_kv(c, b, hk);
      const size_t len = static_cast<size_t>(kv.len);
      dk_acc.assign(len * p.d_qk, 0.0);
      dv_acc.assign(len * p.d_v, 0.0);
      for (size_t h = hk * group; h < (hk + 1) * group; ++h) {
        for (int64_t i = 0; i < seq.len_q[b]; ++i) {
          if (!row_grad(c, g, b, h, i, kv, w)) continue;
          std::fill(dq_row.begin(), dq_row.end(), 0.0);
          for (size_t t = 0; t < w.ds.size(); ++t) {
            const size_t j = static_cast<size_t>(w.r.lo) + t;
            const double ds = w.ds[t], pd = w.pd[t];
            const double *kj = &kv.k[j * p.d_qk];
            double *dkj = &dk_acc[j * p.d_qk], *dvj = &dv_acc[j * p.d_v];
            for (size_t e = 0; e < p.d_qk; ++e) {
              dq_row[e] += ds * kj[e];
              dkj[e] += ds * w.q[e];
            }
            for (size_t e = 0; e < p.d_v; ++e) dvj[e] += pd * w.d_o[e];
          }
          for (double &x : dq_row) x *= scale;
          store_f64(dq, p.dtype, attn::element_offset(p.qkv.t[attn::kQ], c.q_row(b, i), h), p.d_qk,
                    dq_row.data());
          if (learnable) dalpha[b * p.h_q + h] -= std::exp(c.alpha[h] - w.lse) * w.D;
        }
      }
      for (double &x : dk_acc) x *= scale;
      for (size_t j = 0; j < len; ++j) {
        const size_t row = c.kv_row(b, static_cast<int64_t>(j));
        store_f64(dk, p.dtype, attn::element_offset(p.qkv.t[attn::kK], row, hk), p.d_qk,
                  &dk_acc[j * p.d_qk]);
        store_f64(dv, p.dtype, attn::element_offset(p.qkv.t[attn::kV], row, hk), p.d_v,
                  &dv_acc[j * p.d_v]);
      }
    }
  });

  if (t.dsoftmax_offset != nullptr) {
    float *out = static_cast<float *>(data(t.dsoftmax_offset));
    for (size_t h = 0; h < p.h_q; ++h) {
      double s = 0.0;
      for (size_t b = 0; b < p.batch; ++b) s += dalpha[b * p.h_q + h];
      out[h] = static_cast<float>(s);
    }
  }
  if (t.dbias != nullptr) bias_grad(c, g, *t.dbias);
}

}  // namespace nvte::cpu
