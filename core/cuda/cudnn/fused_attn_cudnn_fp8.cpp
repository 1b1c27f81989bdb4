// cuda/cudnn/fused_attn_cudnn_fp8.cpp - the FP8 graphs of the CUDA attention backend: cuDNN's
// per-tensor-scaled sdpa_fp8 (forward) and sdpa_fp8_backward, i.e. the dataflow of
// fused_attn.h "FP8 attention" and of its CPU reference (cpu/fused_attn_fp8.cpp):
//   forward   z = attn_scale * descale_q * descale_k * (Q K^T), stats = lse; the flash kernel
//             quantizes U = exp(z - running row max) as fp8_E4M3(U * scale_S) and divides
//             (U~ V) * descale_S * descale_V by the row sum afterwards (measured on an H200: O
//             agrees with the CPU reference of that dataflow); amax_O = max |O| (before scaling),
//             stored as O * scale_O. Its amax_S output is the normalized P's (the caller replaces
//             it by 1, the amax of U: see fused_attn_cudnn.cpp).
//   backward  D = rowsum(dO * O) * descale_dO * descale_O; P recomputed from stats,
//             P~ = fp8_E4M3(P * scale_S); dV = (P~^T dO) * descale_S * descale_dO;
//             dS = attn_scale * P * ((dO V^T) * descale_dO * descale_V - D); amax_dP = max |dS|;
//             dS~ = fp8_{dO's format}(dS * scale_dP); dQ = (dS~ K) * descale_dP * descale_K,
//             dK = (dS~^T Q) * descale_dP * descale_Q; each gradient's amax before its scale.
// The caller (fused_attn_cudnn.cpp) binds descale_S = 1/scale_S and descale_dP = 1/scale_dP
// (computed on the device), a scale of 1 for float16/bfloat16 outputs, and folds the amax
// outputs into the tensors' amax buffers afterwards. Every descale/scale is a float32 [1]
// device tensor, so one built graph serves every scale value.
#include "fused_attn_cudnn_internal.h"

namespace nvte::cuda::cudnn_attn {
namespace {

constexpr fe::DataType_t kF32 = fe::DataType_t::FLOAT;

// Masking shared by both graphs (the support rules admit no bias, ALiBi, window or dropout).
template <class Attr>
void fp8_options(fe::graph::Graph &g, const AttnParams &p, Attr &a) {
  a.set_attn_scale(p.scale);
  if (p.rule.causal && p.rule.bottom_right) a.set_causal_mask_bottom_right(true);
  else if (p.rule.causal) a.set_causal_mask(true);
  if (p.padding) {
    a.set_padding_mask(true);
    a.set_seq_len_q(scalar_tensor(g, kUSeqQ, "seq_q", fe::DataType_t::INT32, (int64_t)p.batch));
    a.set_seq_len_kv(scalar_tensor(g, kUSeqKV, "seq_kv", fe::DataType_t::INT32, (int64_t)p.batch));
  }
}

void set_amax(const TensorPtr &t, int64_t uid) {
  t->set_output(true).set_uid(uid).set_dim({1, 1, 1, 1}).set_stride({1, 1, 1, 1}).set_data_type(kF32);
}


// The float32 [1] scalars both graphs take: the descales of Q, K, V and S, and S's scale.
struct QkvsScalars {
  TensorPtr descale_q, descale_k, descale_v, descale_s, scale_s;
};
QkvsScalars qkvs_scalars(fe::graph::Graph &g) {
  return {scalar_tensor(g, kUDescaleQ, "descale_q", kF32), scalar_tensor(g, kUDescaleK, "descale_k", kF32),
          scalar_tensor(g, kUDescaleV, "descale_v", kF32), scalar_tensor(g, kUDescaleS, "descale_s", kF32),
          scalar_tensor(g, kUScaleS, "scale_s", kF32)};
}


}  // namespace

std::string build_fp8_fwd(const AttnParams &p, const Fp8Types &ty, cudnnHandle_t h, Built &b) {
  new_graph(b, fe::DataType_t::FP8_E4M3);
  fe::graph::Graph &g = *b.graph;
  auto q = qkv_tensor(g, p, attn::kQ, kUQ, "Q"), k = qkv_tensor(g, p, attn::kK, kUK, "K"),
       v = qkv_tensor(g, p, attn::kV, kUV, "V");
  const QkvsScalars c = qkvs_scalars(g);
  auto scale_o = scalar_tensor(g, kUScaleO, "scale_o", kF32);
  fe::graph::SDPA_fp8_attributes a;
  a.set_name("nvte_sdpa_fp8_fwd").set_generate_stats(p.is_training);
  fp8_options(g, p, a);
  auto [o, stats, amax_s, amax_o] =
      g.sdpa_fp8(q, k, v, c.descale_q, c.descale_k, c.descale_v, c.descale_s, c.scale_s, scale_o, a);
  o->set_output(true)
      .set_uid(kUO)
      .set_dim({(int64_t)p.batch, (int64_t)p.h_q, (int64_t)p.max_sq, (int64_t)p.d_v})
      .set_stride(strides_of(p.out, p.batch, p.max_sq))
      .set_data_type(fe_type(ty.o));
  if (p.is_training) {
    if (stats == nullptr) return "cuDNN's sdpa_fp8 returned no statistics tensor for a training forward";
    stats->set_output(true).set_uid(kUStats).set_data_type(kF32).set_dim(stats_dim(p)).set_stride(stats_stride(p));
  }
  set_amax(amax_s, kUAmaxS);
  set_amax(amax_o, kUAmaxO);
  return finish(g, h, b);
}

std::string build_fp8_bwd(const AttnParams &p, const Fp8Types &ty, cudnnHandle_t h, Built &b) {
  new_graph(b, fe::DataType_t::FP8_E4M3);
  fe::graph::Graph &g = *b.graph;
  const auto [q, k, v, o, dout] = bwd_inputs(g, p, fe_type(ty.o), fe_type(ty.d_o));
  auto stats = input_tensor(g, "stats", kUStats, stats_dim(p), stats_stride(p), kF32);
  const QkvsScalars c = qkvs_scalars(g);
  auto descale_o = scalar_tensor(g, kUDescaleO, "descale_o", kF32);
  auto descale_do = scalar_tensor(g, kUDescaledO, "descale_dO", kF32);
  auto descale_dp = scalar_tensor(g, kUDescaledP, "descale_dP", kF32);
  auto scale_dq = scalar_tensor(g, kUScaledQ, "scale_dQ", kF32);
  auto scale_dk = scalar_tensor(g, kUScaledK, "scale_dK", kF32);
  auto scale_dv = scalar_tensor(g, kUScaledV, "scale_dV", kF32);
  auto scale_dp = scalar_tensor(g, kUScaledP, "scale_dP", kF32);
  fe::graph::SDPA_fp8_backward_attributes a;
  a.set_name("nvte_sdpa_fp8_bwd");
  fp8_options(g, p, a);
  auto [dq, dk, dv, amax_dq, amax_dk, amax_dv, amax_dp] =
      g.sdpa_fp8_backward(q, k, v, o, dout, stats, c.descale_q, c.descale_k, c.descale_v, descale_o, descale_do,
                          c.descale_s, descale_dp, c.scale_s, scale_dq, scale_dk, scale_dv, scale_dp, a);
  // Gradients have the layout (and, for packed layouts, the pack) of Q, K, V.
  const fe::DataType_t gt = fe_type(ty.grad);
  dq->set_output(true).set_uid(kUdQ).set_dim(q->get_dim()).set_stride(q->get_stride()).set_data_type(gt);
  dk->set_output(true).set_uid(kUdK).set_dim(k->get_dim()).set_stride(k->get_stride()).set_data_type(gt);
  dv->set_output(true).set_uid(kUdV).set_dim(v->get_dim()).set_stride(v->get_stride()).set_data_type(gt);
  set_amax(amax_dq, kUAmaxdQ);
  set_amax(amax_dk, kUAmaxdK);
  set_amax(amax_dv, kUAmaxdV);
  set_amax(amax_dp, kUAmaxdP);
  return finish(g, h, b);
}

}  // namespace nvte::cuda::cudnn_attn
