// cuda/cudnn/fused_attn_cudnn.cpp - the CUDA backend of fused attention (cuda/fused_attn.h)
// through cuDNN's scaled-dot-product-attention graphs (cuDNN frontend, header-only).
//
// Design: one cuDNN graph per distinct call shape (dtype, sizes, strides of each tensor,
// mask, bias, dropout, training), built once (heuristics, support check, plan build) and
// kept in a process-wide cache; later calls only bind pointers and execute. Tensors are
// described in place: cuDNN takes [b, h, s, d] dims with arbitrary strides, so every BSHD/SBHD
// layout, packed or not, is a stride pattern over the caller's own pointers (no copies).
// cuDNN is opened at run time (dlopen, frontend dynamic loading): the copy already in the
// process (PyTorch's) first, then NVTE_CUDNN_PATH, then the loader path. The frontend headers
// are heavy to compile, so everything that includes them lives in this one file.
//
// Supported here: BF16/FP16, BSHD/SBHD (all packed forms), no_mask / causal /
// causal_bottom_right / padding / padding_causal(_bottom_right) (padding from cu_seqlens),
// no bias or post-scale bias, ALiBi with the default slopes, GQA/MQA, head_dim_qk != head_dim_v
// where cuDNN accepts it, dropout from rng_state (seed, offset) on the device, windows with
// an unbounded right side or the causal one. Anything else (THD, pre-scale bias, custom ALiBi
// slopes, float32, FP8, learnable softmax) reports NVTE_ERROR_NOT_SUPPORTED with the reason.
#define NV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING 1
#include <cudnn_frontend.h>
#include <dlfcn.h>

#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <type_traits>
#include <vector>

#include "../cuda_check.h"
#include "../fused_attn.h"
#include "fused_attn_seqlens.h"

// The frontend's shim resolves every cuDNN symbol through this handle.
namespace cudnn_frontend {
void *cudnn_dlhandle = nullptr;
}

namespace nvte::cuda {
namespace fe = cudnn_frontend;
using attn::AttnParams;

namespace {

// ------------------------------------------------------------------ loading cuDNN
std::once_flag g_once;
std::string g_cudnn_path, g_cudnn_error;

void load_cudnn() {
  // RTLD_NOLOAD first: a cuDNN already in the process (PyTorch's) is the one to share.
  std::vector<std::pair<std::string, int>> tries;
  tries.emplace_back("libcudnn.so.9", RTLD_NOW | RTLD_NOLOAD);
  if (const char *env = std::getenv("NVTE_CUDNN_PATH"); env != nullptr && *env != '\0')
    tries.emplace_back(env, RTLD_NOW | RTLD_LOCAL);
  tries.emplace_back("libcudnn.so.9", RTLD_NOW | RTLD_LOCAL);
  std::string tried;
  for (const auto &[path, flags] : tries) {
    dlerror();
    void *lib = dlopen(path.c_str(), flags);
    if (lib == nullptr) {
      const char *why = dlerror();
      if (!(flags & RTLD_NOLOAD)) tried += concat("\n  ", path, ": ", why ? why : "not found");
      continue;
    }
    if (dlsym(lib, "cudnnGetVersion") == nullptr) {
      tried += concat("\n  ", path, ": opened, but has no cudnnGetVersion");
      continue;
    }
    cudnn_frontend::cudnn_dlhandle = lib;
    Dl_info info{};
    const char *file = dladdr(dlsym(lib, "cudnnGetVersion"), &info) && info.dli_fname ? info.dli_fname : path.c_str();
    g_cudnn_path = concat(file, (flags & RTLD_NOLOAD) ? " (already loaded in this process)" : "");
    return;
  }
  g_cudnn_error = concat("cuDNN (libcudnn.so.9) could not be opened; set NVTE_CUDNN_PATH to its full path. Tried:",
                         tried);
}

void ensure_cudnn() {
  std::call_once(g_once, load_cudnn);
  NVTE_CHECK_SUPPORTED(g_cudnn_error.empty(), g_cudnn_error);
}

std::string cudnn_description() {
  return concat(g_cudnn_path, ", cuDNN ", (long long)fe::detail::get_backend_version());
}

cudnnHandle_t handle_for(cudaStream_t stream) {
  ensure_cudnn();
  thread_local std::map<int, cudnnHandle_t> handles;  // one per (thread, device)
  int dev = 0;
  NVTE_CHECK_CUDA(cudaGetDevice(&dev));
  cudnnHandle_t &h = handles[dev];
  if (h == nullptr) {
    const cudnnStatus_t st = fe::detail::create_handle(&h);
    NVTE_CHECK(st == CUDNN_STATUS_SUCCESS, "cudnnCreate failed (status ", (int)st, "; ", cudnn_description(), ")");
  }
  const cudnnStatus_t st = fe::detail::set_stream(h, stream);
  NVTE_CHECK(st == CUDNN_STATUS_SUCCESS, "cudnnSetStream failed (status ", (int)st, ")");
  return h;
}

// ------------------------------------------------------------------ static support rules
std::string unsupported_reason(const AttnParams &p) {
  if (p.dtype != kNVTEBFloat16 && p.dtype != kNVTEFloat16)
    return concat("cuDNN attention takes bfloat16/float16 Q, K, V; got ", dtype_name(p.dtype));
  if (p.layout.q_format == NVTE_THD || p.layout.kv_format == NVTE_THD || p.layout.paged)
    return concat("layout ", p.layout.name, " (THD / paged) is not supported by the CUDA backend yet");
  if (p.softmax_type != NVTE_VANILLA_SOFTMAX) return "only the vanilla softmax is supported on the GPU";
  if (p.bias_type == NVTE_PRE_SCALE_BIAS) return "pre-scale bias is not supported by cuDNN";
  if (p.bias_type == NVTE_ALIBI && p.slopes_b != 0) return "ALiBi with caller-given slopes is not supported on the GPU";
  if (p.bias_type == NVTE_ALIBI && !p.rule.causal) return "cuDNN applies ALiBi only with a causal mask";
  if (p.rule.window_right >= 0 && !(p.rule.causal && p.rule.window_right == 0))
    return "a bounded right window other than the causal one is not supported on the GPU";
  if (p.rule.window_left >= 0 && p.rule.bottom_right)
    return "a left window with bottom-right alignment is not supported on the GPU";
  return "";
}

// ------------------------------------------------------------------ graph description
enum Uid : int64_t { kUQ = 1, kUK, kUV, kUO, kUStats, kUBias, kUSeqQ, kUSeqKV, kUSeed, kUOffset, kUdO, kUdQ, kUdK, kUdV, kUdBias };

// [b, h, s, d] strides of a tensor with the given placement and padded sequence length.
std::vector<int64_t> strides_of(const attn::TensorPlacement &t, size_t batch, size_t seq) {
  const int64_t rs = (int64_t)t.row_stride, hs = (int64_t)t.head_stride;
  if (t.format == NVTE_BSHD) return {(int64_t)seq * rs, hs, rs, 1};
  return {rs, hs, (int64_t)batch * rs, 1};  // SBHD
}

// Everything a graph depends on; calls with equal keys share one built graph.
struct Key {
  bool bwd;
  int device;
  std::vector<int64_t> v;
  bool operator<(const Key &o) const { return std::tie(bwd, device, v) < std::tie(o.bwd, o.device, o.v); }
};

Key key_of(const AttnParams &p, bool bwd, bool has_dbias) {
  Key k{bwd, 0, {}};
  NVTE_CHECK_CUDA(cudaGetDevice(&k.device));
  auto add = [&](std::initializer_list<int64_t> l) { k.v.insert(k.v.end(), l); };
  add({(int64_t)p.dtype, (int64_t)p.batch, (int64_t)p.h_q, (int64_t)p.h_kv, (int64_t)p.d_qk, (int64_t)p.d_v,
       (int64_t)p.max_sq, (int64_t)p.max_skv, (int64_t)p.bias_type, (int64_t)p.padding, (int64_t)p.rule.causal,
       (int64_t)p.rule.bottom_right, p.rule.window_left, p.rule.window_right, (int64_t)(p.dropout > 0.0f),
       (int64_t)p.is_training, (int64_t)p.bias_b, (int64_t)p.bias_h, (int64_t)has_dbias});
  for (const auto &t : p.qkv.t) add({(int64_t)t.format, (int64_t)t.row_stride, (int64_t)t.head_stride});
  add({(int64_t)p.out.format, (int64_t)p.out.row_stride, (int64_t)p.out.head_stride});
  int32_t sb;  // the scale and dropout probability are baked into the graph
  std::memcpy(&sb, &p.scale, 4);
  add({sb});
  std::memcpy(&sb, &p.dropout, 4);
  add({sb});
  return k;
}

struct Built {
  std::shared_ptr<fe::graph::Graph> graph;
  int64_t workspace = 0;
  std::string error;  // non-empty: cuDNN rejected the configuration (cached too)
};

#define NVTE_FE_TRY(call)                                                      \
  do {                                                                         \
    auto e_ = (call);                                                          \
    if (e_.is_bad()) return concat(#call, ": ", e_.get_message());             \
  } while (0)

fe::DataType_t fe_type(NVTEDType t) {
  return t == kNVTEBFloat16 ? fe::DataType_t::BFLOAT16 : fe::DataType_t::HALF;
}

using TensorPtr = std::shared_ptr<fe::graph::Tensor_attributes>;

TensorPtr qkv_tensor(fe::graph::Graph &g, const AttnParams &p, int role, int64_t uid, const char *name) {
  const bool q = role == attn::kQ;
  const size_t h = q ? p.h_q : p.h_kv, s = q ? p.max_sq : p.max_skv, d = role == attn::kV ? p.d_v : p.d_qk;
  return g.tensor(fe::graph::Tensor_attributes()
                      .set_name(name)
                      .set_uid(uid)
                      .set_dim({(int64_t)p.batch, (int64_t)h, (int64_t)s, (int64_t)d})
                      .set_stride(strides_of(p.qkv.t[role], p.batch, s)));
}

TensorPtr scalar_tensor(fe::graph::Graph &g, int64_t uid, const char *name, fe::DataType_t t, int64_t n = 1) {
  return g.tensor(fe::graph::Tensor_attributes()
                      .set_name(name)
                      .set_uid(uid)
                      .set_dim({n, 1, 1, 1})
                      .set_stride({1, 1, 1, 1})
                      .set_data_type(t));
}

// The mask / bias / dropout options shared by forward and backward attributes.
template <class Attr>
void common_options(fe::graph::Graph &g, const AttnParams &p, Attr &a, bool has_dbias) {
  a.set_attn_scale(p.scale);
  if (p.rule.causal && p.rule.bottom_right) a.set_causal_mask_bottom_right(true);
  else if (p.rule.causal) a.set_causal_mask(true);
  if (p.rule.window_left >= 0) a.set_diagonal_band_left_bound((int)p.rule.window_left + 1);
  if (p.padding) {
    a.set_padding_mask(true)
        .set_seq_len_q(scalar_tensor(g, kUSeqQ, "seq_q", fe::DataType_t::INT32, (int64_t)p.batch))
        .set_seq_len_kv(scalar_tensor(g, kUSeqKV, "seq_kv", fe::DataType_t::INT32, (int64_t)p.batch));
  }
  if (p.bias_type == NVTE_POST_SCALE_BIAS) {
    const int64_t sq = (int64_t)p.max_sq, skv = (int64_t)p.max_skv;
    auto bias = g.tensor(fe::graph::Tensor_attributes()
                             .set_name("bias")
                             .set_uid(kUBias)
                             .set_dim({(int64_t)p.bias_b, (int64_t)p.bias_h, sq, skv})
                             .set_stride({(int64_t)p.bias_h * sq * skv, sq * skv, skv, 1}));
    a.set_bias(bias);
    if constexpr (std::is_same_v<Attr, fe::graph::SDPA_backward_attributes>) {
      if (has_dbias) {
        auto db = g.tensor(fe::graph::Tensor_attributes()
                               .set_name("dbias")
                               .set_uid(kUdBias)
                               .set_dim({(int64_t)p.bias_b, (int64_t)p.bias_h, sq, skv})
                               .set_stride({(int64_t)p.bias_h * sq * skv, sq * skv, skv, 1}));
        a.set_dbias(db);
      }
    }
  }
  if (p.bias_type == NVTE_ALIBI) a.set_alibi_mask(true);
  if (p.dropout > 0.0f) {
    a.set_dropout(p.dropout, scalar_tensor(g, kUSeed, "seed", fe::DataType_t::INT64),
                  scalar_tensor(g, kUOffset, "offset", fe::DataType_t::INT64));
  }
}

std::string finish(fe::graph::Graph &g, cudnnHandle_t h, Built &b) {
  NVTE_FE_TRY(g.validate());
  NVTE_FE_TRY(g.build_operation_graph(h));
  NVTE_FE_TRY(g.create_execution_plans({fe::HeurMode_t::A}));
  NVTE_FE_TRY(g.check_support(h));
  NVTE_FE_TRY(g.build_plans(h));
  NVTE_FE_TRY(g.get_workspace_size(b.workspace));
  return "";
}

std::string build_fwd(const AttnParams &p, cudnnHandle_t h, Built &b) {
  b.graph = std::make_shared<fe::graph::Graph>();
  fe::graph::Graph &g = *b.graph;
  g.set_io_data_type(fe_type(p.dtype))
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  auto q = qkv_tensor(g, p, attn::kQ, kUQ, "Q"), k = qkv_tensor(g, p, attn::kK, kUK, "K"),
       v = qkv_tensor(g, p, attn::kV, kUV, "V");
  fe::graph::SDPA_attributes a;
  a.set_name("nvte_sdpa_fwd").set_generate_stats(p.is_training);
  common_options(g, p, a, false);
  auto [o, stats] = g.sdpa(q, k, v, a);
  o->set_output(true)
      .set_uid(kUO)
      .set_dim({(int64_t)p.batch, (int64_t)p.h_q, (int64_t)p.max_sq, (int64_t)p.d_v})
      .set_stride(strides_of(p.out, p.batch, p.max_sq));
  if (p.is_training) {
    stats->set_output(true)
        .set_uid(kUStats)
        .set_data_type(fe::DataType_t::FLOAT)
        .set_dim({(int64_t)p.batch, (int64_t)p.h_q, (int64_t)p.max_sq, 1})
        .set_stride({(int64_t)(p.h_q * p.max_sq), (int64_t)p.max_sq, 1, 1});
  }
  return finish(g, h, b);
}

std::string build_bwd(const AttnParams &p, bool has_dbias, cudnnHandle_t h, Built &b) {
  b.graph = std::make_shared<fe::graph::Graph>();
  fe::graph::Graph &g = *b.graph;
  g.set_io_data_type(fe_type(p.dtype))
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  auto q = qkv_tensor(g, p, attn::kQ, kUQ, "Q"), k = qkv_tensor(g, p, attn::kK, kUK, "K"),
       v = qkv_tensor(g, p, attn::kV, kUV, "V");
  const std::vector<int64_t> odim{(int64_t)p.batch, (int64_t)p.h_q, (int64_t)p.max_sq, (int64_t)p.d_v};
  const std::vector<int64_t> ostride = strides_of(p.out, p.batch, p.max_sq);
  auto o = g.tensor(fe::graph::Tensor_attributes().set_name("O").set_uid(kUO).set_dim(odim).set_stride(ostride));
  auto dout = g.tensor(fe::graph::Tensor_attributes().set_name("dO").set_uid(kUdO).set_dim(odim).set_stride(ostride));
  auto stats = g.tensor(fe::graph::Tensor_attributes()
                            .set_name("stats")
                            .set_uid(kUStats)
                            .set_dim({(int64_t)p.batch, (int64_t)p.h_q, (int64_t)p.max_sq, 1})
                            .set_stride({(int64_t)(p.h_q * p.max_sq), (int64_t)p.max_sq, 1, 1})
                            .set_data_type(fe::DataType_t::FLOAT));
  fe::graph::SDPA_backward_attributes a;
  a.set_name("nvte_sdpa_bwd");
  common_options(g, p, a, has_dbias);
  auto [dq, dk, dv] = g.sdpa_backward(q, k, v, o, dout, stats, a);
  // Gradients have the layout (and, for packed layouts, the pack) of Q, K, V.
  dq->set_output(true).set_uid(kUdQ).set_dim(q->get_dim()).set_stride(q->get_stride());
  dk->set_output(true).set_uid(kUdK).set_dim(k->get_dim()).set_stride(k->get_stride());
  dv->set_output(true).set_uid(kUdV).set_dim(v->get_dim()).set_stride(v->get_stride());
  return finish(g, h, b);
}

std::mutex g_cache_mutex;
std::map<Key, std::shared_ptr<Built>> g_cache;

// The built graph of p (building it on first use). Throws NOT_SUPPORTED when cuDNN rejects it.
std::shared_ptr<Built> graph_for(const AttnParams &p, bool bwd, bool has_dbias, cudaStream_t stream) {
  const std::string why = unsupported_reason(p);
  NVTE_CHECK_SUPPORTED(why.empty(), why);
  const Key key = key_of(p, bwd, has_dbias);
  cudnnHandle_t h = handle_for(stream);
  std::lock_guard<std::mutex> lock(g_cache_mutex);
  auto it = g_cache.find(key);
  if (it == g_cache.end()) {
    auto b = std::make_shared<Built>();
    try {
      b->error = bwd ? build_bwd(p, has_dbias, h, *b) : build_fwd(p, h, *b);
    } catch (const std::exception &e) {  // the frontend throws on loader failures
      b->error = e.what();
    }
    it = g_cache.emplace(key, b).first;
  }
  NVTE_CHECK_SUPPORTED(it->second->error.empty(), "cuDNN rejects this attention configuration (",
                       cudnn_description(), "): ", it->second->error);
  return it->second;
}

// Workspace: cuDNN's, then (padding masks) two int32 [b] sequence-length arrays.
size_t seqlen_bytes(const AttnParams &p) { return p.padding ? 2 * ((p.batch * 4 + 255) / 256 * 256) : 0; }
size_t cudnn_bytes(const Built &b) { return ((size_t)b.workspace + 255) / 256 * 256; }

void *data(const Tensor *t) { return t ? t->params[kNVTERowwiseData].data_ptr : nullptr; }

size_t bytes_of(const Tensor &t) {
  const NVTEBasicTensor &b = t.params[kNVTERowwiseData];
  return numel(b.shape) * dtype_size(b.dtype);
}

// Bytes from a Q/K/V-like tensor's pointer to the end of its last element (packed tensors
// interleave: their footprint is wider than their element count).
size_t extent_bytes(const attn::TensorPlacement &t, size_t rows, size_t heads, size_t d, NVTEDType dt) {
  if (rows == 0 || heads == 0 || d == 0) return 0;
  return ((rows - 1) * t.row_stride + (heads - 1) * t.head_stride + d) * dtype_size(dt);
}

char *workspace_ptr(Tensor *ws, size_t need) {
  if (need == 0) return nullptr;
  NVTE_CHECK(ws != nullptr && data(ws) != nullptr && bytes_of(*ws) >= need,
             "fused attention on the GPU needs a workspace of ", need,
             " bytes (query it with nvte_fused_attn_{fwd,bwd}_workspace_size)");
  NVTE_CHECK(aligned(data(ws), 256), "the fused attention workspace must be 256-byte aligned");
  return static_cast<char *>(data(ws));
}

// Binds the padding lengths: seq_q / seq_kv computed from cu_seqlens into the workspace.
void bind_seqlens(const AttnParams &p, const Tensor *cu_q, const Tensor *cu_kv, char *extra,
                  std::unordered_map<int64_t, void *> &pack, cudaStream_t stream) {
  if (!p.padding) return;
  NVTE_CHECK(cu_q != nullptr && cu_kv != nullptr, "padding masks need cu_seqlens_q and cu_seqlens_kv");
  int32_t *sq = reinterpret_cast<int32_t *>(extra);
  int32_t *skv = reinterpret_cast<int32_t *>(extra + seqlen_bytes(p) / 2);
  seqlens_from_cu(static_cast<const int32_t *>(data(cu_q)), static_cast<const int32_t *>(data(cu_kv)), sq, skv,
                  p.batch, p.max_sq, p.max_skv, stream);
  pack[kUSeqQ] = sq;
  pack[kUSeqKV] = skv;
}

void run(const Built &b, std::unordered_map<int64_t, void *> &pack, void *ws, cudaStream_t stream) {
  cudnnHandle_t h = handle_for(stream);
  auto e = b.graph->execute(h, pack, ws);
  NVTE_CHECK(e.is_good(), "cuDNN attention execution failed: ", e.get_message(), " (", cudnn_description(), ")");
}

}  // namespace

bool fused_attn_supported(const AttnParams &p, std::string *why) {
  const std::string r = unsupported_reason(p);
  if (why) *why = r;
  return r.empty();
}

size_t fused_attn_fwd_workspace_bytes(const AttnParams &p) {
  return cudnn_bytes(*graph_for(p, false, false, nullptr)) + seqlen_bytes(p);
}

size_t fused_attn_bwd_workspace_bytes(const AttnParams &p) {
  // dBias is only known at the call; size for the larger graph.
  const bool db = p.bias_type == NVTE_POST_SCALE_BIAS;
  return cudnn_bytes(*graph_for(p, true, db, nullptr)) + seqlen_bytes(p);
}

void fused_attn_fwd(const AttnParams &p, const attn::AttnFwdTensors &t, Tensor *workspace, cudaStream_t stream) {
  auto b = graph_for(p, false, false, stream);
  char *ws = workspace_ptr(workspace, cudnn_bytes(*b) + seqlen_bytes(p));
  std::unordered_map<int64_t, void *> pack{{kUQ, data(t.q)}, {kUK, data(t.k)}, {kUV, data(t.v)}, {kUO, data(t.o)}};
  if (p.is_training) pack[kUStats] = data(t.stats);
  if (p.bias_type == NVTE_POST_SCALE_BIAS) pack[kUBias] = data(t.bias);
  if (p.dropout > 0.0f) {
    int64_t *rng = static_cast<int64_t *>(data(t.rng_state));
    pack[kUSeed] = rng;
    pack[kUOffset] = rng + 1;
  }
  bind_seqlens(p, t.cu_q, t.cu_kv, ws ? ws + cudnn_bytes(*b) : nullptr, pack, stream);
  // Padded positions are not computed by cuDNN: O starts as zeros there (fused_attn.h promise).
  if (p.padding) NVTE_CHECK_CUDA(cudaMemsetAsync(data(t.o), 0, bytes_of(*t.o), stream));
  run(*b, pack, ws, stream);
  if (t.aux_rng && t.rng_state)
    NVTE_CHECK_CUDA(cudaMemcpyAsync(data(t.aux_rng), data(t.rng_state), 16, cudaMemcpyDeviceToDevice, stream));
  if (t.aux_bias && t.bias)
    NVTE_CHECK_CUDA(cudaMemcpyAsync(data(t.aux_bias), data(t.bias), bytes_of(*t.bias), cudaMemcpyDeviceToDevice, stream));
  if (t.max_logit) NVTE_FAIL(NVTE_ERROR_NOT_SUPPORTED, "return_max_logit is not supported by the CUDA backend yet");
}

void fused_attn_bwd(const AttnParams &p, const attn::AttnBwdTensors &t, Tensor *workspace, cudaStream_t stream) {
  const bool db = p.bias_type == NVTE_POST_SCALE_BIAS && t.dbias != nullptr && data(t.dbias) != nullptr;
  auto b = graph_for(p, true, db, stream);
  char *ws = workspace_ptr(workspace, cudnn_bytes(*b) + seqlen_bytes(p));
  std::unordered_map<int64_t, void *> pack{{kUQ, data(t.q)},   {kUK, data(t.k)},   {kUV, data(t.v)},
                                           {kUO, data(t.o)},   {kUdO, data(t.d_o)}, {kUStats, data(t.stats)},
                                           {kUdQ, data(t.dq)}, {kUdK, data(t.dk)}, {kUdV, data(t.dv)}};
  if (p.bias_type == NVTE_POST_SCALE_BIAS) pack[kUBias] = data(t.bias);
  if (db) pack[kUdBias] = data(t.dbias);
  if (p.dropout > 0.0f) {
    int64_t *rng = static_cast<int64_t *>(data(t.rng_state));
    pack[kUSeed] = rng;
    pack[kUOffset] = rng + 1;
  }
  bind_seqlens(p, t.cu_q, t.cu_kv, ws ? ws + cudnn_bytes(*b) : nullptr, pack, stream);
  if (p.padding) {
    // Gradients of padded positions are zero; packed gradients share one buffer (set whole).
    const size_t ext[3] = {extent_bytes(p.qkv.t[attn::kQ], p.rows_q, p.h_q, p.d_qk, p.dtype),
                           extent_bytes(p.qkv.t[attn::kK], p.rows_kv, p.h_kv, p.d_qk, p.dtype),
                           extent_bytes(p.qkv.t[attn::kV], p.rows_kv, p.h_kv, p.d_v, p.dtype)};
    const Tensor *grads[3] = {t.dq, t.dk, t.dv};
    for (int i = 0; i < 3; ++i) NVTE_CHECK_CUDA(cudaMemsetAsync(data(grads[i]), 0, ext[i], stream));
  }
  run(*b, pack, ws, stream);
}

}  // namespace nvte::cuda
