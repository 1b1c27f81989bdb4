// cuda/cudnn/fused_attn_cudnn_internal.h - the graph-building helpers the two cuDNN attention
// translation units that build graphs share: fused_attn_cudnn.cpp (loading, graph cache and
// execution, the float16/bfloat16 graphs and calls) and fused_attn_cudnn_fp8.cpp (the FP8 graphs
// and calls). Internal to core/cuda/cudnn/; includes the cuDNN frontend, so only those two files
// include it. What needs no frontend types is in fused_attn_cudnn_calls.h.
#pragma once

#define NV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING 1
// The frontend (third-party) defines a static helper these files never call.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-function"
#include <cudnn_frontend.h>
#pragma GCC diagnostic pop

#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "../fused_attn.h"
#include "fused_attn_cudnn_calls.h"
#include "fused_attn_cudnn_rules.h"

namespace nvte::cuda::cudnn_attn {
namespace fe = cudnn_frontend;



using TensorPtr = std::shared_ptr<fe::graph::Tensor_attributes>;

#define NVTE_FE_TRY(call)                                                      \
  do {                                                                         \
    auto e_ = (call);                                                          \
    if (e_.is_bad()) return concat(#call, ": ", e_.get_message());             \
  } while (0)

inline fe::DataType_t fe_type(NVTEDType t) {
  switch (t) {
    case kNVTEBFloat16: return fe::DataType_t::BFLOAT16;
    case kNVTEFloat16: return fe::DataType_t::HALF;
    case kNVTEFloat8E4M3: return fe::DataType_t::FP8_E4M3;
    case kNVTEFloat8E5M2: return fe::DataType_t::FP8_E5M2;
    default: return fe::DataType_t::FLOAT;
  }
}

// [b, h, s, d] strides of a tensor with the given placement and padded sequence length. THD
// tensors are described like BSHD; their ragged offsets replace the batch stride.
inline std::vector<int64_t> strides_of(const attn::TensorPlacement &t, size_t batch, size_t seq) {
  const int64_t rs = (int64_t)t.row_stride, hs = (int64_t)t.head_stride;
  if (t.format == NVTE_BSHD || t.format == NVTE_THD) return {(int64_t)seq * rs, hs, rs, 1};
  return {rs, hs, (int64_t)batch * rs, 1};  // SBHD
}

// Q, K or V as cuDNN's [b, h, s, d]; a paged K/V cache as [num_pages, h, page_size, d] (cuDNN's
// paged container, read through the page tables).
inline TensorPtr qkv_tensor(fe::graph::Graph &g, const AttnParams &p, int role, int64_t uid, const char *name) {
  const bool q = role == attn::kQ, paged = !q && p.layout.paged;
  const size_t h = q ? p.h_q : p.h_kv, d = role == attn::kV ? p.d_v : p.d_qk;
  const size_t b = paged ? p.num_pages : p.batch, s = paged ? p.page_size : (q ? p.max_sq : p.max_skv);
  return g.tensor(fe::graph::Tensor_attributes()
                      .set_name(name)
                      .set_uid(uid)
                      .set_dim({(int64_t)b, (int64_t)h, (int64_t)s, (int64_t)d})
                      .set_stride(strides_of(p.qkv.t[role], b, s)));
}

// A fresh graph in b whose inputs/outputs default to io_type (float32 intermediates and compute).
inline void new_graph(Built &b, fe::DataType_t io_type) {
  b.graph = std::make_shared<fe::graph::Graph>();
  b.graph->set_io_data_type(io_type)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
}

// A tensor the graph reads: name, uid, dims, strides, element type.
inline TensorPtr input_tensor(fe::graph::Graph &g, const char *name, int64_t uid, const std::vector<int64_t> &dim,
                              const std::vector<int64_t> &stride, fe::DataType_t type) {
  return g.tensor(
      fe::graph::Tensor_attributes().set_name(name).set_uid(uid).set_dim(dim).set_stride(stride).set_data_type(type));
}

inline TensorPtr scalar_tensor(fe::graph::Graph &g, int64_t uid, const char *name, fe::DataType_t t,
                               int64_t n = 1) {
  return g.tensor(fe::graph::Tensor_attributes()
                      .set_name(name)
                      .set_uid(uid)
                      .set_dim({n, 1, 1, 1})
                      .set_stride({1, 1, 1, 1})
                      .set_data_type(t));
}

// The backward graphs' inputs: Q, K, V in the call's layout, O and dO [b, h_q, max_sq, d_v] in
// O's (of element types o_type / do_type).
struct BwdInputs {
  TensorPtr q, k, v, o, d_o;
};
inline BwdInputs bwd_inputs(fe::graph::Graph &g, const AttnParams &p, fe::DataType_t o_type,
                            fe::DataType_t do_type) {
  const std::vector<int64_t> odim{(int64_t)p.batch, (int64_t)p.h_q, (int64_t)p.max_sq, (int64_t)p.d_v};
  const std::vector<int64_t> ostride = strides_of(p.out, p.batch, p.max_sq);
  return {qkv_tensor(g, p, attn::kQ, kUQ, "Q"), qkv_tensor(g, p, attn::kK, kUK, "K"),
          qkv_tensor(g, p, attn::kV, kUV, "V"), input_tensor(g, "O", kUO, odim, ostride, o_type),
          input_tensor(g, "dO", kUdO, odim, ostride, do_type)};
}

// The [b, h_q, max_sq, 1] float32 softmax statistics (natural-log LSE), as the aux pack holds them.
inline std::vector<int64_t> stats_dim(const AttnParams &p) {
  return {(int64_t)p.batch, (int64_t)p.h_q, (int64_t)p.max_sq, 1};
}
inline std::vector<int64_t> stats_stride(const AttnParams &p) {
  return {(int64_t)(p.h_q * p.max_sq), (int64_t)p.max_sq, 1, 1};
}

// A float32 output shaped like the statistics (cuDNN's Max and Sum_exp, which the SDPA attributes
// take as tensors the caller declares).
inline TensorPtr row_tensor(fe::graph::Graph &g, const char *name, int64_t uid, const AttnParams &p) {
  return g.tensor(fe::graph::Tensor_attributes()
                      .set_name(name)
                      .set_uid(uid)
                      .set_dim(stats_dim(p))
                      .set_stride(stats_stride(p))
                      .set_data_type(fe::DataType_t::FLOAT));
}

// validate, build the operation graph, pick plans (heuristics A), check support, build plans and
// read the workspace size; "" or the first failure.
inline std::string finish(fe::graph::Graph &g, cudnnHandle_t h, Built &b) {
  NVTE_FE_TRY(g.validate());
  NVTE_FE_TRY(g.build_operation_graph(h));
  NVTE_FE_TRY(g.create_execution_plans({fe::HeurMode_t::A}));
  NVTE_FE_TRY(g.check_support(h));
  NVTE_FE_TRY(g.build_plans(h));
  NVTE_FE_TRY(g.get_workspace_size(b.workspace));
  return "";
}

// The FP8 graphs (fused_attn_cudnn_fp8.cpp): cuDNN's sdpa_fp8 / sdpa_fp8_backward with per-tensor
// scales bound by uid (kUDescale*, kUScale*) and float32 [1] amax outputs (kUAmax*).
std::string build_fp8_fwd(const AttnParams &p, const Fp8Types &ty, cudnnHandle_t h, Built &b);
std::string build_fp8_bwd(const AttnParams &p, const Fp8Types &ty, cudnnHandle_t h, Built &b);

}  // namespace nvte::cuda::cudnn_attn
