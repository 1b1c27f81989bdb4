// cuda/cudnn/fused_attn_cudnn_internal.h - what the two cuDNN attention translation units share:
// fused_attn_cudnn.cpp (loading, graph cache, binding and execution, workspace layout, the
// float16/bfloat16 graphs and calls) and fused_attn_cudnn_fp8.cpp (the FP8 graphs and calls).
// Internal to core/cuda/cudnn/; includes the cuDNN frontend, so only those two files include it.
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
#include "fused_attn_cudnn_rules.h"

namespace nvte::cuda::cudnn_attn {
namespace fe = cudnn_frontend;
using attn::AttnParams;

// Graph tensor ids (variant-pack keys). FP8 graphs add their scale tensors and amax outputs.
enum Uid : int64_t {
  kUQ = 1, kUK, kUV, kUO, kUStats, kUBias, kUSeqQ, kUSeqKV, kUSeed, kUOffset, kUdO, kUdQ, kUdK, kUdV, kUdBias,
  kUDescaleQ, kUDescaleK, kUDescaleV, kUDescaleO, kUDescaledO, kUDescaleS, kUDescaledP,
  kUScaleS, kUScaleO, kUScaledQ, kUScaledK, kUScaledV, kUScaledP,
  kUAmaxS, kUAmaxO, kUAmaxdQ, kUAmaxdK, kUAmaxdV, kUAmaxdP,
  kURaggedQ, kURaggedK, kURaggedV, kURaggedO,  // THD: ragged offsets of Q/dQ, K/dK, V/dV, O/dO
  kUMax, kUSumExp,                              // return_max_logit: cuDNN's row max and sum of exp
  kUPageK, kUPageV                              // paged K/V caches: the (clamped) page tables
};

// Element types of an FP8 call beyond Q/K/V (always E4M3): O (E4M3/E5M2, or float16/bfloat16),
// dO (E4M3/E5M2; dS~ takes its format) and the gradients dQ = dK = dV (FP8 or float16/bfloat16).
struct Fp8Types {
  NVTEDType o = kNVTEFloat8E4M3, d_o = kNVTEFloat8E5M2, grad = kNVTEFloat8E5M2;
};

struct Built {
  std::shared_ptr<fe::graph::Graph> graph;
  int64_t workspace = 0;
  std::string error;  // non-empty: cuDNN rejected the configuration (cached too)
};

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

// ------------------------------------------------------------------ calls (fused_attn_cudnn.cpp)

using VariantPack = std::unordered_map<int64_t, void *>;

// The built graph of a call (built on first use, then cached). Throws NOT_SUPPORTED with the
// reason when the support rules or cuDNN reject it. fp8: the FP8 element types (FP8 calls only).
std::shared_ptr<Built> graph_for(const AttnParams &call, bool bwd, bool has_dbias, cudaStream_t stream,
                                 const Fp8Types *fp8 = nullptr);

// Runs a built graph with the pointers of pack on stream.
void execute(const Built &b, VariantPack &pack, void *ws, cudaStream_t stream);

// Workspace layout (fused_attn_cudnn.cpp): cuDNN's own bytes, then the sequence lengths of padding
// masks, then what each kind of call adds (THD: ragged offsets and scratch; FP8: scalars).
size_t cudnn_bytes(const Built &b);
size_t seqlen_bytes(const AttnParams &p);
size_t total_bytes(const AttnParams &p, const Built &b);
// FP8 calls: the float32 scalars in the workspace (descales the graph reads, amax values it writes).
float *fp8_scalars(const AttnParams &p, const Built &b, char *ws);

// The workspace's data pointer after checking that it holds `need` bytes (null when need is 0).
char *workspace_ptr(Tensor *ws, size_t need);

// Padding masks: computes seq_q / seq_kv from cu_seqlens into the workspace (`extra`: the bytes
// after cuDNN's) and binds them; nothing otherwise.
void bind_seqlens(const AttnParams &p, const Tensor *cu_q, const Tensor *cu_kv, char *extra, VariantPack &pack,
                  cudaStream_t stream);

// BSHD/SBHD (THD: run_thd's ragged_zero_rows and row maps): after the graph ran, zeroes the rows of
// a Q-side (kv_side false: O, dQ) or K/V-side (dK, dV) tensor that fused_attn.h defines as zero
// and cuDNN may leave undefined (UnusedRows in fused_attn_seqlens.h); clear_unused_stats sets the
// statistics of those query rows to -inf. Padding masks need the lengths bound by bind_seqlens.
// No launch when the mask uses every row.
void clear_unused_rows(const AttnParams &p, const VariantPack &pack, void *base, const attn::TensorPlacement &pl,
                       bool kv_side, size_t heads, size_t d, NVTEDType dtype, cudaStream_t stream);
void clear_unused_stats(const AttnParams &p, const VariantPack &pack, float *stats, cudaStream_t stream);

inline void *data(const Tensor *t) { return t ? t->params[kNVTERowwiseData].data_ptr : nullptr; }

inline size_t bytes_of(const Tensor &t) {
  const NVTEBasicTensor &b = t.params[kNVTERowwiseData];
  return numel(b.shape) * dtype_size(b.dtype);
}

// The FP8 calls (fused_attn_cudnn_fp8.cpp).
void fp8_fwd(const AttnParams &p, const attn::AttnFwdTensors &t, Tensor *workspace, cudaStream_t stream);
void fp8_bwd(const AttnParams &p, const attn::AttnBwdTensors &t, Tensor *workspace, cudaStream_t stream);

}  // namespace nvte::cuda::cudnn_attn
