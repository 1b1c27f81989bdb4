// cuda/cudnn/fused_attn_cudnn_fp8.cpp - the FP8 graphs and calls of the CUDA attention backend:
// cuDNN's per-tensor-scaled sdpa_fp8 (forward) and sdpa_fp8_backward, i.e. the dataflow of
// fused_attn.h "FP8 attention" and of its CPU reference (cpu/fused_attn_fp8.cpp):
//   forward   z = attn_scale * descale_q * descale_k * (Q K^T), stats = lse; the flash kernel
//             quantizes U = exp(z - running row max) as fp8_E4M3(U * scale_S) and divides
//             (U~ V) * descale_S * descale_V by the row sum afterwards (measured on an H200: O
//             agrees with the CPU reference of that dataflow); amax_O = max |O| (before scaling),
//             stored as O * scale_O. Its amax_S output is the normalized P's (the caller replaces
//             it by 1, the amax of U: see fp8_fwd below).
//   backward  D = rowsum(dO * O) * descale_dO * descale_O; P recomputed from stats,
//             P~ = fp8_E4M3(P * scale_S); dV = (P~^T dO) * descale_S * descale_dO;
//             dS = attn_scale * P * ((dO V^T) * descale_dO * descale_V - D); amax_dP = max |dS|;
//             dS~ = fp8_{dO's format}(dS * scale_dP); dQ = (dS~ K) * descale_dP * descale_K,
//             dK = (dS~^T Q) * descale_dP * descale_Q; each gradient's amax before its scale.
// The calls (fp8_fwd / fp8_bwd below) bind descale_S = 1/scale_S and descale_dP = 1/scale_dP
// (computed on the device), a scale of 1 for float16/bfloat16 outputs, and folds the amax
// outputs into the tensors' amax buffers afterwards. Every descale/scale is a float32 [1]
// device tensor, so one built graph serves every scale value.
//
// Supported: E4M3 Q/K/V, BSHD/SBHD (packed too), no_mask / causal / padding / padding_causal
// (bottom-right where cuDNN allows: Blackwell), left (sliding) windows, GQA/MQA, no bias, no
// dropout, vanilla softmax; head dims, sequence lengths, float16/bfloat16 O or gradients (Blackwell only) are
// cuDNN's call (its reason is reported; on Hopper the backward takes head_dim 128 only). The scales live on the device:
// before a graph runs, a tiny kernel writes 1/scale_S, 1/scale_dP (and 1 for float16/bfloat16
// outputs) into the workspace; after it, amax values are max-folded into the tensors' amax
// buffers and every FP8 output's scale_inv is written as 1/scale, as the CPU reference does.
#include <algorithm>
#include <cstdint>

#include "../cuda_check.h"
#include "fused_attn_cudnn_internal.h"
#include "fused_attn_seqlens.h"

namespace nvte::cuda::cudnn_attn {
namespace {

constexpr fe::DataType_t kF32 = fe::DataType_t::FLOAT;

// Masking shared by both graphs (the support rules admit no bias, ALiBi or dropout, and of the
// windows only a left one, top-left aligned: cuDNN's band keeps keys j > i - left_bound).
template <class Attr>
void fp8_options(fe::graph::Graph &g, const AttnParams &p, Attr &a) {
  a.set_attn_scale(p.scale);
  if (p.rule.causal && bottom_right(p)) a.set_causal_mask_bottom_right(true);
  else if (p.rule.causal) a.set_causal_mask(true);
  if (p.rule.window_left >= 0) {
    a.set_diagonal_band_left_bound((int)p.rule.window_left + 1);
  } else if (p.rule.causal && !bottom_right(p) && std::max(p.max_sq, p.max_skv) < (size_t)INT32_MAX) {
    // A left bound that masks nothing (query i < max_sq < bound sees every key j >= 0 > i - bound).
    // With it, cuDNN 9.19's FP8 kernels skip the key tiles a causal mask hides, which they compute
    // without it: on an H200, module fwd+bwd at b=4 h=32 d=128 causal went from 20.4 to 13.2 ms at
    // s=8192 and from 1.81 to 1.45 ms at s=2048 (benchmarks/gpu_attention_window.py).
    a.set_diagonal_band_left_bound((int)std::max(p.max_sq, p.max_skv) + 1);
  }
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
  a.set_deterministic_algorithm(p.deterministic);
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

// ------------------------------------------------------------------ calls

namespace {

// A float32 [1] metadata buffer of t (scale, amax, scale_inv), or null.
float *meta(const Tensor *t, NVTETensorParam k) {
  return t ? static_cast<float *>(t->params[k].data_ptr) : nullptr;
}

float *required_meta(const Tensor *t, NVTETensorParam k, const char *what) {
  float *m = meta(t, k);
  NVTE_CHECK(m != nullptr, "FP8 attention: ", what, " is missing");
  return m;
}

NVTEDType dtype_of(const Tensor *t) { return t->params[kNVTERowwiseData].dtype; }

// The pointers both FP8 graphs bind: Q, K, V, O and the descales of Q, K, V (their scale_inv),
// S's descale and scale.
template <class Tensors>
VariantPack fp8_common_pack(const Tensors &t, float *descale_s, float *scale_s) {
  return {{kUQ, data(t.q)},
          {kUK, data(t.k)},
          {kUV, data(t.v)},
          {kUO, data(t.o)},
          {kUDescaleQ, required_meta(t.q, kNVTERowwiseScaleInv, "Q's scale_inv")},
          {kUDescaleK, required_meta(t.k, kNVTERowwiseScaleInv, "K's scale_inv")},
          {kUDescaleV, required_meta(t.v, kNVTERowwiseScaleInv, "V's scale_inv")},
          {kUDescaleS, descale_s},
          {kUScaleS, scale_s}};
}

}  // namespace

void fp8_fwd(const AttnParams &p, const attn::AttnFwdTensors &t, Tensor *workspace, cudaStream_t stream) {
  Fp8Types ty;
  ty.o = dtype_of(t.o);
  auto b = graph_for(p, false, false, stream, &ty);
  char *ws = workspace_ptr(workspace, total_bytes(p, *b));
  float *sc = fp8_scalars(p, *b, ws);
  float *descale_s = sc, *scale_o = sc + 1, *amax_s = sc + 2, *amax_o = sc + 3;
  const bool o8 = is_fp8(ty.o);
  float *scale_s = required_meta(t.s, kNVTEScale, "S's scale");
  ScalarOps pre;
  pre.add(descale_s, scale_s, ScalarOp::kRecip);
  pre.add(scale_o, o8 ? required_meta(t.o, kNVTEScale, "O's scale") : nullptr, ScalarOp::kSet);
  run_scalar_ops(pre, stream);
  VariantPack pack = fp8_common_pack(t, descale_s, scale_s);
  pack.insert({{kUScaleO, scale_o}, {kUAmaxS, amax_s}, {kUAmaxO, amax_o}});
  if (p.is_training) pack[kUStats] = data(t.stats);
  bind_seqlens(p, t.cu_q, t.cu_kv, ws + cudnn_bytes(*b), pack, stream);
  execute(*b, pack, ws, stream);
  clear_unused_rows(p, pack, data(t.o), p.out, false, p.h_q, p.d_v, ty.o, stream);  // byte 0 is +0 in FP8 too
  if (p.is_training) clear_unused_stats(p, pack, static_cast<float *>(data(t.stats)), nullptr, stream);
  ScalarOps post;
  // cuDNN quantizes the unnormalized exp(z - row max) (at most 1; O matches that on an H200)
  // but reports the amax of the normalized probabilities (0.2-0.4 in no-mask tests). A
  // delayed-scaling recipe fed the latter picks an S scale under which every exponential above
  // it saturates (a 30% O error in a no-mask module test), so S's amax is that of the tensor
  // actually quantized: 1 whenever some row had a key (cuDNN's value > 0), as on the CPU.
  post.add(meta(t.s, kNVTEAmax), amax_s, ScalarOp::kFoldUnit);
  post.add(meta(t.s, kNVTERowwiseScaleInv), scale_s, ScalarOp::kRecip);
  post.add(meta(t.o, kNVTEAmax), amax_o, ScalarOp::kFoldMax);
  if (o8) post.add(meta(t.o, kNVTERowwiseScaleInv), meta(t.o, kNVTEScale), ScalarOp::kRecip);
  run_scalar_ops(post, stream);
}

void fp8_bwd(const AttnParams &p, const attn::AttnBwdTensors &t, Tensor *workspace, cudaStream_t stream) {
  Fp8Types ty;
  ty.o = dtype_of(t.o);
  ty.d_o = dtype_of(t.d_o);
  ty.grad = dtype_of(t.dq);
  NVTE_CHECK_SUPPORTED(dtype_of(t.dk) == ty.grad && dtype_of(t.dv) == ty.grad,
                       "FP8 attention on the GPU writes dQ, dK, dV in one dtype");
  auto b = graph_for(p, true, false, stream, &ty);
  char *ws = workspace_ptr(workspace, total_bytes(p, *b));
  float *sc = fp8_scalars(p, *b, ws);
  float *descale_s = sc, *descale_dp = sc + 1, *descale_o = sc + 2, *scale_g = sc + 3, *amax_g = sc + 6,
        *amax_dp = sc + 9;  // scale_g / amax_g: dQ, dK, dV
  const bool o8 = is_fp8(ty.o), g8 = is_fp8(ty.grad);
  float *scale_s = required_meta(t.s, kNVTEScale, "S's scale");
  float *scale_dp = required_meta(t.dp, kNVTEScale, "dP's scale");
  const Tensor *grads[3] = {t.dq, t.dk, t.dv};
  const char *gscale[3] = {"dQ's scale", "dK's scale", "dV's scale"};
  ScalarOps pre;
  pre.add(descale_s, scale_s, ScalarOp::kRecip);
  pre.add(descale_dp, scale_dp, ScalarOp::kRecip);
  pre.add(descale_o, o8 ? required_meta(t.o, kNVTERowwiseScaleInv, "O's scale_inv") : nullptr, ScalarOp::kSet);
  for (int i = 0; i < 3; ++i)
    pre.add(scale_g + i, g8 ? required_meta(grads[i], kNVTEScale, gscale[i]) : nullptr, ScalarOp::kSet);
  run_scalar_ops(pre, stream);
  VariantPack pack = fp8_common_pack(t, descale_s, scale_s);
  pack.insert({
      {kUdO, data(t.d_o)},
      {kUStats, data(t.stats)},
      {kUdQ, data(t.dq)},
      {kUdK, data(t.dk)},
      {kUdV, data(t.dv)},
      {kUDescaleO, descale_o},
      {kUDescaledO, required_meta(t.d_o, kNVTERowwiseScaleInv, "dO's scale_inv")},
      {kUDescaledP, descale_dp},
      {kUScaledQ, scale_g},
      {kUScaledK, scale_g + 1},
      {kUScaledV, scale_g + 2},
      {kUScaledP, scale_dp},
      {kUAmaxdQ, amax_g},
      {kUAmaxdK, amax_g + 1},
      {kUAmaxdV, amax_g + 2},
      {kUAmaxdP, amax_dp}});
  bind_seqlens(p, t.cu_q, t.cu_kv, ws + cudnn_bytes(*b), pack, stream);
  execute(*b, pack, ws, stream);
  const attn::TensorPlacement *pl[3] = {&p.qkv.t[attn::kQ], &p.qkv.t[attn::kK], &p.qkv.t[attn::kV]};
  const size_t heads[3] = {p.h_q, p.h_kv, p.h_kv}, d[3] = {p.d_qk, p.d_qk, p.d_v};
  for (int i = 0; i < 3; ++i)
    clear_unused_rows(p, pack, data(grads[i]), *pl[i], i > 0, heads[i], d[i], ty.grad, stream);
  ScalarOps post;
  for (int i = 0; i < 3; ++i) {
    post.add(meta(grads[i], kNVTEAmax), amax_g + i, ScalarOp::kFoldMax);
    if (g8) post.add(meta(grads[i], kNVTERowwiseScaleInv), meta(grads[i], kNVTEScale), ScalarOp::kRecip);
  }
  post.add(meta(t.dp, kNVTEAmax), amax_dp, ScalarOp::kFoldMax);
  post.add(meta(t.dp, kNVTERowwiseScaleInv), scale_dp, ScalarOp::kRecip);
  run_scalar_ops(post, stream);
}

}  // namespace nvte::cuda::cudnn_attn
