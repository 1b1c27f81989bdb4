// cpu/fused_attn_fp8.cpp - CPU reference of FP8 fused attention (fused_attn.h, "FP8
// attention"): Transformer Engine's FP8 DPA dataflow, i.e. the per-tensor-scaled graphs TE
// builds with cuDNN's sdpa_fp8 / sdpa_fp8_backward, computed in float64 with each FP8
// quantization point emulated bit-exactly (cpu/attn_fp8_io.h), so that a GPU FP8 path has an
// oracle. Masks, windows, GQA/MQA, dropout, softmax types and layouts are shared with the
// high-precision path (cpu/attn_rows.h); FP8 has no bias and no max logit (as in TE).
//
// Notation: dq, dk, dv, dO_s, O_s = the scale_inv of Q, K, V, dO, O (inputs are decoded as
// value * scale_inv); s_S, s_dP, s_O, s_dQ, ... = the scales of S, dP, O, dQ, ...;
// Q8(x, s, fmt) = the FP8 number float32(x) * s rounds to, divided by s (attn_fp8_io.h).
//
// Forward, query row i of head h:
//   z_j   = attn_scale * (dq Q_i) . (dk K_j)                for the visible keys j
//   m     = max_j z_j (and the sink),  l = sum_j exp(z_j - m) (+ exp(sink - m)),  lse = m + log l
//   U_j   = exp(z_j - m) * keep_j / (1 - p)   (unnormalized, in (0, 1] without dropout)
//   amax_S = max U_j;  U~_j = Q8(U_j, s_S, E4M3)            (quantization point 1)
//   O_i   = (sum_j U~_j (dv V_j)) / l;  amax_O = max |O|;  O stored as fp8(O * s_O), or as
//           float16/bfloat16 (TE's current scaling: O unscaled).
//   cuDNN's FP8 kernel is a flash (online-softmax) kernel that quantizes the exponentials before
//   the division by the row sum (on an H200 its O agrees with this to within one FP8 step for
//   >99% of elements, with the same error against float64; quantizing normalized P instead
//   disagreed by up to ~180 steps). amax_S is that of U, i.e. 1 (the row maximum's exp(0));
//   cuDNN's own amax output is the normalized P's, which the CUDA backend replaces (see
//   cuda/cudnn/fused_attn_cudnn.cpp). The kernel's running maximum is per key block; the
//   reference uses the row's final maximum, which changes only the rounding of rows whose
//   maximum lies past the first block.
// Backward, from the stored float32 lse (P and P~ are recomputed as in the forward):
//   P_j   = exp(z_j - lse) (normalized: the backward recomputes it from the stored lse),
//   Pd_j  = P_j * keep_j / (1 - p),  P~_j = Q8(Pd_j, s_S, E4M3)
//   D_i   = (dO_s dO_i) . (O_s O_i)            (O_s = 1 for a float16/bfloat16 O)
//   dP_j  = (dO_s dO_i) . (dv V_j)
//   dS_j  = attn_scale * P_j * (keep_j / (1 - p) * dP_j - D_i)
//   amax_dP = max |dS_j|;  dS~_j = Q8(dS_j, s_dP, dO's format)   (quantization point 2)
//   dQ_i  = sum_j dS~_j (dk K_j);  dK_j = sum_i dS~_j (dq Q_i);  dV_j = sum_i P~_j (dO_s dO_i)
//           (dK, dV summed over the Q heads of a K/V head); each with its amax, stored as
//           fp8(x * s_x) or as float16/bfloat16.
//   dSoftmaxOffset_h = -sum exp(sink_h - lse) D (float32).
// Choices where TE/cuDNN leave room (cuDNN fuses these in one kernel and documents only the
// graph): P~ and dS~ are dequantized with exactly 1/scale (S's and dP's scale_inv are written
// as 1.0f / scale, as every FP8 output of this library; TE's recipe keeps them so), the dS
// quantized is the one that already carries attn_scale (so dQ/dK need no further factor), and
// amax_S is taken after dropout, both as in cuDNN's graphs. Every element of O and of the
// gradients is written (padding rows and THD gaps: 0). Tasks own disjoint outputs and amax is
// a max, so results do not depend on the thread count.
#include "fused_attn.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "attn_fp8_io.h"
#include "attn_rows.h"
#include "parallel.h"

namespace nvte::cpu {

using attn::AttnParams;
using attn::KeyRange;
using attn_fp8::Fp8Point;
using attn_fp8::ScaledInput;
using attn_fp8::ScaledOutput;
using namespace attn_rows;

namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

size_t stats_index(const AttnParams &p, size_t b, size_t h, int64_t i) {
  return (b * p.h_q + h) * p.max_sq + static_cast<size_t>(i);
}

size_t key_count(const KeyRange &r) { return r.hi >= r.lo ? static_cast<size_t>(r.hi - r.lo + 1) : 0; }

// Dropout factor of (b, h, i, j): keep / (1 - p), or 1 without dropout.
double drop_factor(const RowContext &c, size_t b, size_t h, int64_t i, int64_t j) {
  if (!c.dropout()) return 1.0;
  return c.keep(b, h, i, j) ? c.keep_scale : 0.0;
}

}  // namespace

void fused_attn_fp8_fwd(const AttnParams &p, const attn::AttnFwdTensors &t) {
  const SeqBounds seq =
      seq_bounds(p, t.cu_q, t.cu_kv, t.cu_q_padded, t.cu_kv_padded, t.page_k, t.page_v);
  const RowContext c = make_context(p, *t.q, *t.k, *t.v, nullptr, t.softmax_offset, t.rng_state, seq);
  Fp8Point s_point(*t.s, "S", p.dtype);  // P~ takes Q's format (E4M3), as in cuDNN
  ScaledOutput o(*t.o, "O");
  float *stats = t.stats ? static_cast<float *>(t.stats->params[kNVTERowwiseData].data_ptr) : nullptr;
  std::memset(o.data(), 0, numel(t.o->params[kNVTERowwiseData].shape) * dtype_size(o.dtype()));
  if (stats) std::fill(stats, stats + p.batch * p.h_q * p.max_sq, -std::numeric_limits<float>::infinity());
  copy_aux_slot(t.aux_rng, t.rng_state);
  copy_aux_slot(t.aux_offset, t.softmax_offset);

  parallel_for(p.batch * p.h_q, 1, [&](size_t t0, size_t t1) {
    std::vector<double> q(p.d_qk), acc(p.d_v), z, bias_row;
    float amax_s = 0.0f;
    for (size_t task = t0; task < t1; ++task) {
      const size_t b = task / p.h_q, h = task % p.h_q;
      const HeadKV kv = load_head_kv(c, b, c.kv_head(h));
      for (int64_t i = 0; i < seq.len_q[b]; ++i) {
        load_query(c, b, h, i, q.data());
        const KeyRange r = c.keys(b, i);
        const size_t n = key_count(r);
        z.resize(n);
        if (n > 0) row_logits(c, b, h, i, q.data(), kv, r, z.data(), bias_row);
        const RowStats st = row_softmax_stats(c, h, z.data(), n);
        std::fill(acc.begin(), acc.end(), 0.0);
        if (st.lse != kNegInf) {
          // m as in row_softmax_stats (the sink counts), l = exp(lse - m).
          const double m = (!c.alpha.empty() && c.alpha[h] > st.max_logit) ? c.alpha[h] : st.max_logit;
          const double l = std::exp(st.lse - m);
          for (size_t k = 0; k < n; ++k) {
            const int64_t j = r.lo + static_cast<int64_t>(k);
            const double u = std::exp(z[k] - m) * drop_factor(c, b, h, i, j);
            const float a = static_cast<float>(u);
            amax_s = a > amax_s ? a : amax_s;
            const double uq = s_point.qdq(u);
            const double *vj = &kv.v[static_cast<size_t>(j) * p.d_v];
            for (size_t e = 0; e < p.d_v; ++e) acc[e] += uq * vj[e];
          }
          for (size_t e = 0; e < p.d_v; ++e) acc[e] /= l;
        }
        o.store(attn::element_offset(p.out, c.q_row(b, i), h), p.d_v, acc.data());
        if (stats) stats[stats_index(p, b, h, i)] = static_cast<float>(st.lse);
      }
    }
    s_point.fold_amax(amax_s);
  });
  o.finish();
  s_point.record(*t.s);
}

void fused_attn_fp8_bwd(const AttnParams &p, const attn::AttnBwdTensors &t) {
  const SeqBounds seq = seq_bounds(p, t.cu_q, t.cu_kv, t.cu_q_padded, t.cu_kv_padded);
  const RowContext c = make_context(p, *t.q, *t.k, *t.v, nullptr, t.softmax_offset, t.rng_state, seq);
  const ScaledInput o_in(*t.o, "O"), do_in(*t.d_o, "dO");
  const Fp8Point s_point(*t.s, "S", p.dtype);
  Fp8Point dp_point(*t.dp, "dP", do_in.dtype);  // dS~ takes dO's format (E5M2 under HYBRID)
  ScaledOutput dq(*t.dq, "dQ"), dk(*t.dk, "dK"), dv(*t.dv, "dV");
  const float *stats = static_cast<const float *>(t.stats->params[kNVTERowwiseData].data_ptr);
  zero_tensor(dq.data(), dq.dtype(), p.qkv.t[attn::kQ], p.rows_q, p.h_q, p.d_qk);
  zero_tensor(dk.data(), dk.dtype(), p.qkv.t[attn::kK], p.rows_kv, p.h_kv, p.d_qk);
  zero_tensor(dv.data(), dv.dtype(), p.qkv.t[attn::kV], p.rows_kv, p.h_kv, p.d_v);
  const size_t group = p.h_q / p.h_kv;
  const double scale = p.scale;
  const bool learnable = p.softmax_type == NVTE_LEARNABLE_SOFTMAX;
  std::vector<double> dalpha(p.batch * p.h_q, 0.0);  // per (b, h): reduced over b afterwards

  parallel_for(p.batch * p.h_kv, 1, [&](size_t t0, size_t t1) {
    std::vector<double> q(p.d_qk), d_o(p.d_v), o(p.d_v), z, bias_row, dq_row(p.d_qk), dk_acc, dv_acc;
    float amax_dp = 0.0f;
    for (size_t task = t0; task < t1; ++task) {
      const size_t b = task / p.h_kv, hk = task % p.h_kv;
      const HeadKV kv = load_head_kv(c, b, hk);
      const size_t len = static_cast<size_t>(kv.len);
      dk_acc.assign(len * p.d_qk, 0.0);
      dv_acc.assign(len * p.d_v, 0.0);
      for (size_t h = hk * group; h < (hk + 1) * group; ++h) {
        for (int64_t i = 0; i < seq.len_q[b]; ++i) {
          const double lse = stats[stats_index(p, b, h, i)];
          const KeyRange r = c.keys(b, i);
          const size_t n = key_count(r);
          if (lse == kNegInf || n == 0) continue;  // no key: zero gradients, D irrelevant
          load_query(c, b, h, i, q.data());
          const size_t orow = attn::element_offset(p.out, c.q_row(b, i), h);
          do_in.load(orow, p.d_v, d_o.data());
          o_in.load(orow, p.d_v, o.data());
          double D = 0.0;
          for (size_t e = 0; e < p.d_v; ++e) D += d_o[e] * o[e];
          z.resize(n);
          row_logits(c, b, h, i, q.data(), kv, r, z.data(), bias_row);
          std::fill(dq_row.begin(), dq_row.end(), 0.0);
          for (size_t k = 0; k < n; ++k) {
            const size_t j = static_cast<size_t>(r.lo) + k;
            const double prob = std::exp(z[k] - lse);
            const double drop = drop_factor(c, b, h, i, static_cast<int64_t>(j));
            const double pq = s_point.qdq(prob * drop);
            const double *vj = &kv.v[j * p.d_v];
            double dpj = 0.0;
            for (size_t e = 0; e < p.d_v; ++e) dpj += d_o[e] * vj[e];
            const double ds = scale * (prob * (dpj * drop - D));
            const float a = std::fabs(static_cast<float>(ds));
            amax_dp = a > amax_dp ? a : amax_dp;
            const double dsq = dp_point.qdq(ds);
            const double *kj = &kv.k[j * p.d_qk];
            double *dkj = &dk_acc[j * p.d_qk], *dvj = &dv_acc[j * p.d_v];
            for (size_t e = 0; e < p.d_qk; ++e) {
              dq_row[e] += dsq * kj[e];
              dkj[e] += dsq * q[e];
            }
            for (size_t e = 0; e < p.d_v; ++e) dvj[e] += pq * d_o[e];
          }
          dq.store(attn::element_offset(p.qkv.t[attn::kQ], c.q_row(b, i), h), p.d_qk, dq_row.data());
          if (learnable) dalpha[b * p.h_q + h] -= std::exp(c.alpha[h] - lse) * D;
        }
      }
      for (size_t j = 0; j < len; ++j) {
        const size_t row = c.kv_row(b, static_cast<int64_t>(j));
        dk.store(attn::element_offset(p.qkv.t[attn::kK], row, hk), p.d_qk, &dk_acc[j * p.d_qk]);
        dv.store(attn::element_offset(p.qkv.t[attn::kV], row, hk), p.d_v, &dv_acc[j * p.d_v]);
      }
    }
    dp_point.fold_amax(amax_dp);
  });
  dq.finish();
  dk.finish();
  dv.finish();
  dp_point.record(*t.dp);
  if (t.dsoftmax_offset != nullptr) {
    float *out = static_cast<float *>(t.dsoftmax_offset->params[kNVTERowwiseData].data_ptr);
    for (size_t h = 0; h < p.h_q; ++h) {
      double s = 0.0;
      for (size_t b = 0; b < p.batch; ++b) s += dalpha[b * p.h_q + h];
      out[h] = static_cast<float>(s);
    }
  }
}

}  // namespace nvte::cpu
