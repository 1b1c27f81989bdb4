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
// are heavy to compile, so only this file and fused_attn_cudnn_fp8.cpp include them
// (fused_attn_cudnn_internal.h).
//
// Supported here: BF16/FP16, BSHD/SBHD (all packed forms), THD (below), no_mask / causal /
// causal_bottom_right / padding / padding_causal(_bottom_right) (padding from cu_seqlens),
// no bias or post-scale bias, ALiBi with the default slopes, GQA/MQA, head_dim_qk != head_dim_v
// where cuDNN accepts it, dropout from rng_state (seed, offset) on the device, windows with
// an unbounded right side or the causal one, paged K/V caches (below). Anything else (the
// backward of THD queries over BSHD/SBHD K/V, pre-scale bias, custom ALiBi slopes, float32)
// reports NVTE_ERROR_NOT_SUPPORTED with the reason.
//
// Off-by-one and learnable softmax (BSHD/SBHD): cuDNN's sink token, float32 [1, h_q, 1, 1] (the
// learnable offset, or zeros in the workspace for off-by-one). The learnable offset's gradient is
// the library's own kernel (fused_attn_sink.h). Where cuDNN takes no sink token (paged caches,
// max_seqlen_q 1: decode steps), the forward runs the vanilla graph with statistics into the
// workspace and rescales each output row by its sink share afterwards (sink_rescale).
//
// Paged K/V caches (forward): cuDNN's paged attention. K, V are its containers [pages, h,
// page_size, d] (the cache's BSHD/SBHD strides); the page tables [b, 1, ceil(max_seqlen_kv /
// page_size), 1] are the caller's (any width) copied into the workspace, entries clamped into
// the cache, so neither graph nor workspace depends on the tables' width.
//
// THD (float16/bfloat16; no bias or ALiBi): cuDNN's ragged tensors [n, h, max_s, d] (packed token
// and head strides) with int32 [n + 1] ragged offsets (each sequence's first token, from
// cu_seqlens_*_padded or cu_seqlens, times the token stride) written into the workspace on the
// device, and the padding mask with lengths from cu_seqlens. THD queries over BSHD/SBHD K/V or
// paged caches (TE's inference layouts): only Q and O are ragged. The workspace queries see no
// cu_seqlens, so with THD K/V or paged caches the graph's batch n is fixed by the token counts
// (the power of two >= rows / max_seqlen) and a call runs it over sequences [0, n), [n, 2n), ...
// (empty ones fill the last run); with BSHD/SBHD K/V, n is their batch (one run). A THD side's
// max_seqlen is rounded up to a power of two (it changes from batch to batch; this bounds the
// graphs built). Statistics go through an [n, h, graph max_sq] scratch (rows past a length get
// -inf, as on the CPU). Query rows that see no key are not cuDNN's business: their O / dQ rows
// are zeroed after each run and the backward gives cuDNN +inf statistics there. Offsets are
// int32: a ragged tensor of 2^31 elements or more is NOT_SUPPORTED. A decode step (max_seqlen_q 1)
// of THD queries over BSHD/SBHD K/V or a paged cache runs as BSHD queries instead
// (fused_attn_thd_decode.cpp: cuDNN's decode kernel).
//
// BSHD/SBHD padding-mask calls describe Q, K, V, O as ragged tensors (ragged_padding in
// fused_attn_cudnn_rules.h): cuDNN's packed-sequence kernels were faster than its padded ones for
// the same sequences.
//
// BSHD/SBHD rows that fused_attn.h defines and cuDNN does not compute (padded rows, rows that see
// no key, keys that no query sees) are zeroed after the graph ran (UnusedRows in
// fused_attn_seqlens.h), which touches only those rows. THD likewise after its runs: rows that
// see no key and keys no query sees per run (ragged_zero_rows), then the rows of no sequence
// (gaps, unused rows), found through a byte map of the rows the sequences cover.
//
// return_max_logit (float16/bfloat16, BSHD/SBHD and THD): the forward graph outputs cuDNN's Max
// (row maximum of the softmax input, i.e. of the scaled logits with bias, ALiBi and masks
// applied, in natural units, before dropout: the CPU backend's max logit) and Sum_exp (row sum
// of exp(logit - Max)) in place of Stats, since cuDNN before 9.21 gives one or the other; a small
// kernel then writes the statistics Max + log(Sum_exp) and the max logit, both -inf for padded
// rows and rows that see no key, as the CPU backend does.
//
// FP8 (fused_attn.h "FP8 attention"): graphs and calls in fused_attn_cudnn_fp8.cpp.
#include <dlfcn.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <type_traits>
#include <vector>

#include "../cuda_check.h"
#include "fused_attn_cudnn_internal.h"
#include "fused_attn_cudnn_rules.h"
#include "fused_attn_seqlens.h"
#include "fused_attn_sink.h"
#include "fused_attn_thd_decode.h"

// The frontend's shim resolves every cuDNN symbol through this handle.
namespace cudnn_frontend {
void *cudnn_dlhandle = nullptr;
}

namespace nvte::cuda::cudnn_attn {
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

// ------------------------------------------------------------------ graph description
// Everything a graph depends on; calls with equal keys share one built graph.
struct Key {
  bool bwd;
  int device;
  std::vector<int64_t> v;
  bool operator<(const Key &o) const { return std::tie(bwd, device, v) < std::tie(o.bwd, o.device, o.v); }
};

// fp8: the output / gradient element types of an FP8 call (null otherwise).
Key key_of(const AttnParams &p, bool bwd, bool has_dbias, const Fp8Types *fp8) {
  Key k{bwd, 0, {}};
  NVTE_CHECK_CUDA(cudaGetDevice(&k.device));
  auto add = [&](std::initializer_list<int64_t> l) { k.v.insert(k.v.end(), l); };
  add({(int64_t)p.dtype, (int64_t)p.batch, (int64_t)p.h_q, (int64_t)p.h_kv, (int64_t)p.d_qk, (int64_t)p.d_v,
       (int64_t)p.max_sq, (int64_t)p.max_skv, (int64_t)p.bias_type, (int64_t)p.padding, (int64_t)p.rule.causal,
       (int64_t)p.rule.bottom_right, p.rule.window_left, p.rule.window_right, (int64_t)(p.dropout > 0.0f),
       (int64_t)p.is_training, (int64_t)p.return_max_logit, (int64_t)p.bias_b, (int64_t)p.bias_h,
       (int64_t)has_dbias, (int64_t)p.page_size, (int64_t)p.num_pages, (int64_t)p.softmax_type,
       (int64_t)(bwd && p.deterministic)});
  for (const auto &t : p.qkv.t) add({(int64_t)t.format, (int64_t)t.row_stride, (int64_t)t.head_stride});
  add({(int64_t)p.out.format, (int64_t)p.out.row_stride, (int64_t)p.out.head_stride});
  int32_t sb;  // the scale and dropout probability are baked into the graph
  std::memcpy(&sb, &p.scale, 4);
  add({sb});
  std::memcpy(&sb, &p.dropout, 4);
  add({sb});
  if (fp8) add({(int64_t)fp8->o, (int64_t)fp8->d_o, (int64_t)fp8->grad});
  else add({-1, -1, -1});
  return k;
}

// The mask / bias / dropout options shared by forward and backward attributes.
template <class Attr>
void common_options(fe::graph::Graph &g, const AttnParams &p, Attr &a, bool has_dbias) {
  a.set_attn_scale(p.scale);
  // A decode step's bottom-right causal mask is left out: it hides nothing, and without it cuDNN
  // 9.19 picks its decode kernel (H100, b=16, 32/8 heads, d=128, 4096 cached keys, paged:
  // 101.8 -> 93.6 us per call).
  if (p.rule.causal && !causal_hides_nothing(p)) {
    if (bottom_right(p)) a.set_causal_mask_bottom_right(true);
    else a.set_causal_mask(true);
  } else if (!p.rule.causal && windowed(p)) {  // a band without the causal mask: its own alignment
    a.set_diagonal_alignment(bottom_right(p) ? fe::DiagonalAlignment_t::BOTTOM_RIGHT
                                             : fe::DiagonalAlignment_t::TOP_LEFT);
    if (p.rule.window_right >= 0) a.set_diagonal_band_right_bound((int)p.rule.window_right);
  }
  // cuDNN keeps keys j > i - left_bound (i, j on the aligned diagonal): the window's wl keys back
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
  if (p.softmax_type != NVTE_VANILLA_SOFTMAX) {
    const int64_t h = (int64_t)p.h_q;
    a.set_sink_token(input_tensor(g, "sink", kUSink, {1, h, 1, 1}, {h, 1, 1, 1}, fe::DataType_t::FLOAT));
  }
  if (p.dropout > 0.0f) {
    a.set_dropout(p.dropout, scalar_tensor(g, kUSeed, "seed", fe::DataType_t::INT64),
                  scalar_tensor(g, kUOffset, "offset", fe::DataType_t::INT64));
  }
}

// THD and ragged_padding: the ragged offset tensors of Q, K, V, O (int32 [b + 1]); null pointers
// otherwise (and for K, V when only Q is THD).
struct Ragged {
  TensorPtr off[4];
};
Ragged ragged_offsets(fe::graph::Graph &g, const AttnParams &p) {
  Ragged r;
  if (!thd(p) && !ragged_padding(p)) return r;
  const int64_t uid[4] = {kURaggedQ, kURaggedK, kURaggedV, kURaggedO};
  const char *name[4] = {"ragged_q", "ragged_k", "ragged_v", "ragged_o"};
  for (int i = 0; i < 4; ++i)
    if (i == 0 || i == 3 || kv_thd(p) || !thd(p))
      r.off[i] = scalar_tensor(g, uid[i], name[i], fe::DataType_t::INT32, (int64_t)p.batch + 1);
  return r;
}

void set_ragged(const TensorPtr &t, const TensorPtr &off) {
  if (off) t->set_ragged_offset(off);
}

std::string build_fwd(const AttnParams &p, cudnnHandle_t h, Built &b) {
  new_graph(b, fe_type(p.dtype));
  fe::graph::Graph &g = *b.graph;
  auto q = qkv_tensor(g, p, attn::kQ, kUQ, "Q"), k = qkv_tensor(g, p, attn::kK, kUK, "K"),
       v = qkv_tensor(g, p, attn::kV, kUV, "V");
  const Ragged r = ragged_offsets(g, p);
  set_ragged(q, r.off[0]);
  set_ragged(k, r.off[1]);
  set_ragged(v, r.off[2]);
  fe::graph::SDPA_attributes a;
  if (p.layout.paged) {
    const int64_t n = (int64_t)graph_pages(p);
    const std::vector<int64_t> dim{(int64_t)p.batch, 1, n, 1}, stride{n, n, 1, 1};
    a.set_paged_attention_k_table(input_tensor(g, "page_table_k", kUPageK, dim, stride, fe::DataType_t::INT32))
        .set_paged_attention_v_table(input_tensor(g, "page_table_v", kUPageV, dim, stride, fe::DataType_t::INT32))
        .set_paged_attention_max_seq_len_kv((int)p.max_skv);
  }
  // return_max_logit: cuDNN before 9.21 gives either Stats or Max and Sum_exp (not both), so such a
  // graph outputs Max and Sum_exp and the statistics are computed from them (logit_stats).
  a.set_name("nvte_sdpa_fwd").set_generate_stats(p.is_training && !p.return_max_logit);
  common_options(g, p, a, false);
  if (p.return_max_logit) {
    a.set_logit_max(row_tensor(g, "max", kUMax, p));
    a.set_score_sum_exp(row_tensor(g, "sum_exp", kUSumExp, p));
  }
  auto [o, stats] = g.sdpa(q, k, v, a);
  o->set_output(true)
      .set_uid(kUO)
      .set_dim({(int64_t)p.batch, (int64_t)p.h_q, (int64_t)p.max_sq, (int64_t)p.d_v})
      .set_stride(strides_of(p.out, p.batch, p.max_sq));
  set_ragged(o, r.off[3]);
  if (p.is_training && !p.return_max_logit) {
    stats->set_output(true)
        .set_uid(kUStats)
        .set_data_type(fe::DataType_t::FLOAT)
        .set_dim(stats_dim(p))
        .set_stride(stats_stride(p));
  }
  return finish(g, h, b);
}

std::string build_bwd(const AttnParams &p, bool has_dbias, cudnnHandle_t h, Built &b) {
  new_graph(b, fe_type(p.dtype));
  fe::graph::Graph &g = *b.graph;
  const auto [q, k, v, o, dout] = bwd_inputs(g, p, fe_type(p.dtype), fe_type(p.dtype));
  const Ragged r = ragged_offsets(g, p);  // gradients share the offsets of Q, K, V; dO those of O
  set_ragged(q, r.off[0]);
  set_ragged(k, r.off[1]);
  set_ragged(v, r.off[2]);
  set_ragged(o, r.off[3]);
  set_ragged(dout, r.off[3]);
  auto stats = input_tensor(g, "stats", kUStats, stats_dim(p), stats_stride(p), fe::DataType_t::FLOAT);
  fe::graph::SDPA_backward_attributes a;
  a.set_name("nvte_sdpa_bwd");
  a.set_deterministic_algorithm(p.deterministic);  // (cuDNN's default: dQ accumulated by atomics)
  common_options(g, p, a, has_dbias);
  auto [dq, dk, dv] = g.sdpa_backward(q, k, v, o, dout, stats, a);
  // Gradients have the layout (and, for packed layouts, the pack) of Q, K, V.
  dq->set_output(true).set_uid(kUdQ).set_dim(q->get_dim()).set_stride(q->get_stride());
  dk->set_output(true).set_uid(kUdK).set_dim(k->get_dim()).set_stride(k->get_stride());
  dv->set_output(true).set_uid(kUdV).set_dim(v->get_dim()).set_stride(v->get_stride());
  set_ragged(dq, r.off[0]);
  set_ragged(dk, r.off[1]);
  set_ragged(dv, r.off[2]);
  return finish(g, h, b);
}

std::mutex g_cache_mutex;
std::map<Key, std::shared_ptr<Built>> g_cache;

}  // namespace

std::shared_ptr<Built> graph_for(const AttnParams &call, bool bwd, bool has_dbias, cudaStream_t stream,
                                 const Fp8Types *fp8) {
  const std::string why = unsupported_reason(call);
  NVTE_CHECK_SUPPORTED(why.empty(), why);
  NVTE_CHECK(is_fp8(call.dtype) == (fp8 != nullptr), "internal: FP8 attention graph requested without its types");
  const AttnParams p = graph_params(call);
  const Key key = key_of(p, bwd, has_dbias, fp8);
  cudnnHandle_t h = handle_for(stream);
  std::lock_guard<std::mutex> lock(g_cache_mutex);
  auto it = g_cache.find(key);
  if (it == g_cache.end()) {
    auto b = std::make_shared<Built>();
    try {
      if (fp8) b->error = bwd ? build_fp8_bwd(p, *fp8, h, *b) : build_fp8_fwd(p, *fp8, h, *b);
      else b->error = bwd ? build_bwd(p, has_dbias, h, *b) : build_fwd(p, h, *b);
    } catch (const std::exception &e) {  // the frontend throws on loader failures
      b->error = e.what();
    }
    it = g_cache.emplace(key, b).first;
  }
  NVTE_CHECK_SUPPORTED(it->second->error.empty(), "cuDNN rejects this attention configuration (",
                       cudnn_description(), "): ", it->second->error);
  return it->second;
}

void execute(const Built &b, VariantPack &pack, void *ws, cudaStream_t stream) {
  cudnnHandle_t h = handle_for(stream);
  auto e = b.graph->execute(h, pack, ws);
  NVTE_CHECK(e.is_good(), "cuDNN attention execution failed: ", e.get_message(), " (", cudnn_description(), ")");
}

namespace {

// ------------------------------------------------------------------ float16 / bfloat16 calls

// The sink token of an off-by-one / learnable softmax call: the learnable offset, or float32
// zeros in the workspace for off-by-one; null for the vanilla softmax. Bound to the graph unless
// the call rescales a vanilla graph's output (sink_rescale).
const float *bind_sink(const AttnParams &p, const Built &b, const Tensor *offset, char *ws, VariantPack &pack,
                       cudaStream_t stream) {
  if (p.softmax_type == NVTE_VANILLA_SOFTMAX) return nullptr;
  float *sink = static_cast<float *>(data(offset));
  if (p.softmax_type == NVTE_OFF_BY_ONE_SOFTMAX) {
    sink = reinterpret_cast<float *>(sink_area(p, b, ws));
    NVTE_CHECK_CUDA(cudaMemsetAsync(sink, 0, p.h_q * sizeof(float), stream));
  }
  NVTE_CHECK(sink != nullptr, "internal: the learnable softmax without its offset tensor");
  if (!sink_rescale(p)) pack[kUSink] = sink;
  return sink;
}

// The rows of a BSHD/SBHD call's O (and dO) for the sink kernels (fused_attn_sink.h).
SinkRows sink_rows(const AttnParams &p, void *o, const void *d_o, const float *stats, const float *alpha) {
  SinkRows r;
  r.o = o;
  r.d_o = d_o;
  r.dtype = p.dtype;
  r.out = p.out;
  r.batch = p.batch;
  r.max_q = p.max_sq;
  r.heads = p.h_q;
  r.d_v = p.d_v;
  r.stats = stats;
  r.alpha = alpha;
  return r;
}

// The graph's Bias / dBias take Q's dtype (cuDNN's default for an untyped tensor): a bias of
// another dtype would be read (written) as Q's.
void check_bias_dtype(const AttnParams &p, const Tensor *t, const char *what) {
  if (p.bias_type != NVTE_POST_SCALE_BIAS || t == nullptr || data(t) == nullptr) return;
  NVTE_CHECK_SUPPORTED(logical_dtype(*t) == p.dtype, "CUDA fused attention takes ", what, " in Q's dtype ",
                       dtype_name(p.dtype), ", got ", dtype_name(logical_dtype(*t)));
}

void fwd_f16(const AttnParams &p, const attn::AttnFwdTensors &t, Tensor *workspace, cudaStream_t stream) {
  check_bias_dtype(p, t.bias, "Bias");
  auto b = graph_for(p, false, false, stream);
  char *ws = workspace_ptr(workspace, total_bytes(p, *b));
  VariantPack pack{{kUQ, data(t.q)}, {kUK, data(t.k)}, {kUV, data(t.v)}, {kUO, data(t.o)}};
  float *stats = static_cast<float *>(data(t.stats)), *max_logit = static_cast<float *>(data(t.max_logit));
  if (p.return_max_logit) {
    // Sum_exp goes into the statistics' buffer; logit_stats turns it into the statistics.
    NVTE_CHECK(stats != nullptr && max_logit != nullptr, "internal: max logit requested without its aux buffers");
    pack[kUSumExp] = stats;
    pack[kUMax] = max_logit;
  } else if (p.is_training) {
    pack[kUStats] = stats;
  }
  if (p.bias_type == NVTE_POST_SCALE_BIAS) pack[kUBias] = data(t.bias);
  const float *sink = bind_sink(p, *b, t.softmax_offset, ws, pack, stream);
  float *rescale_stats = sink_rescale(p) ? reinterpret_cast<float *>(sink_scratch(p, *b, ws)) : nullptr;
  if (rescale_stats) pack[kUStats] = rescale_stats;  // (the vanilla graph's statistics: forward only)
  if (p.dropout > 0.0f) {
    int64_t *rng = static_cast<int64_t *>(data(t.rng_state));
    pack[kUSeed] = rng;
    pack[kUOffset] = rng + 1;
  }
  if (thd(p)) {
    ThdInputs in{t.cu_q, t.cu_kv, t.cu_q_padded, t.cu_kv_padded, p.dropout > 0.0f ? t.rng_state : nullptr,
                 p.is_training || p.return_max_logit ? stats : nullptr};
    in.max_logit = p.return_max_logit ? max_logit : nullptr;
    in.o = data(t.o);
    in.page_k = t.page_k;
    in.page_v = t.page_v;
    return run_thd(p, *b, in, pack, ws, stream);
  }
  bind_seqlens(p, t.cu_q, t.cu_kv, ws ? ws + cudnn_bytes(*b) : nullptr, pack, stream);
  if (p.layout.paged) bind_page_tables(p, *b, t.page_k, t.page_v, 0, ws, pack, stream);
  execute(*b, pack, ws, stream);
  clear_unused_rows(p, pack, data(t.o), p.out, false, p.h_q, p.d_v, p.dtype, stream);
  if (rescale_stats) {
    clear_unused_stats(p, pack, rescale_stats, nullptr, stream);  // (-inf: rows left alone)
    sink_rescale_rows(sink_rows(p, data(t.o), nullptr, rescale_stats, sink), stream);
  }
  if (p.is_training && !p.return_max_logit) clear_unused_stats(p, pack, stats, sink, stream);
  if (p.return_max_logit) {
    const auto seq = [&](int64_t uid) { return p.padding ? static_cast<const int32_t *>(pack.at(uid)) : nullptr; };
    logit_stats(stats, max_logit, seq(kUSeqQ), seq(kUSeqKV), p.batch, p.h_q, p.max_sq, p.max_skv, p.rule, stream);
  }
}

void bwd_f16(const AttnParams &p, const attn::AttnBwdTensors &t, Tensor *workspace, cudaStream_t stream) {
  check_bias_dtype(p, t.bias, "Bias");
  check_bias_dtype(p, t.dbias, "dBias");
  const bool db = p.bias_type == NVTE_POST_SCALE_BIAS && t.dbias != nullptr && data(t.dbias) != nullptr;
  auto b = graph_for(p, true, db, stream);
  char *ws = workspace_ptr(workspace, total_bytes(p, *b));
  VariantPack pack{{kUQ, data(t.q)},   {kUK, data(t.k)},   {kUV, data(t.v)},
                                           {kUO, data(t.o)},   {kUdO, data(t.d_o)}, {kUStats, data(t.stats)},
                                           {kUdQ, data(t.dq)}, {kUdK, data(t.dk)}, {kUdV, data(t.dv)}};
  if (p.bias_type == NVTE_POST_SCALE_BIAS) pack[kUBias] = data(t.bias);
  if (db) pack[kUdBias] = data(t.dbias);
  const float *sink = bind_sink(p, *b, t.softmax_offset, ws, pack, stream);
  if (p.dropout > 0.0f) {
    int64_t *rng = static_cast<int64_t *>(data(t.rng_state));
    pack[kUSeed] = rng;
    pack[kUOffset] = rng + 1;
  }
  if (thd(p)) {
    ThdInputs in{t.cu_q, t.cu_kv, t.cu_q_padded, t.cu_kv_padded, p.dropout > 0.0f ? t.rng_state : nullptr,
                 static_cast<float *>(data(t.stats))};
    in.dq = data(t.dq);
    in.dk = data(t.dk);
    in.dv = data(t.dv);
    return run_thd(p, *b, in, pack, ws, stream);
  }
  bind_seqlens(p, t.cu_q, t.cu_kv, ws ? ws + cudnn_bytes(*b) : nullptr, pack, stream);
  execute(*b, pack, ws, stream);
  clear_unused_rows(p, pack, data(t.dq), p.qkv.t[attn::kQ], false, p.h_q, p.d_qk, p.dtype, stream);
  clear_unused_rows(p, pack, data(t.dk), p.qkv.t[attn::kK], true, p.h_kv, p.d_qk, p.dtype, stream);
  clear_unused_rows(p, pack, data(t.dv), p.qkv.t[attn::kV], true, p.h_kv, p.d_v, p.dtype, stream);
  if (p.softmax_type == NVTE_LEARNABLE_SOFTMAX && t.dsoftmax_offset != nullptr) {
    const SinkRows g = sink_rows(p, data(t.o), data(t.d_o), static_cast<const float *>(data(t.stats)), sink);
    softmax_offset_grad(g, static_cast<float *>(data(t.dsoftmax_offset)), sink_scratch(p, *b, ws), stream);
  }
}

// The workspace queries see only Q, K, V: they size the graph of TE's HYBRID recipe (E4M3 O,
// E5M2 dO and gradients). Other output formats build their own graph at the call, whose cuDNN
// workspace is checked against the one given.
const Fp8Types kQueryFp8Types{};

}  // namespace
}  // namespace nvte::cuda::cudnn_attn

namespace nvte::cuda {
using namespace cudnn_attn;

bool fused_attn_supported(const AttnParams &p, std::string *why) {
  const std::string r = unsupported_reason(p);
  if (why) *why = r;
  return r.empty();
}

// cuDNN takes no empty problem (a zero length reached an integer division by zero: SIGFPE).
void check_nonempty(const AttnParams &p) {
  NVTE_CHECK_SUPPORTED(p.max_sq > 0 && p.max_skv > 0, "CUDA fused attention needs max_seqlen_q and max_seqlen_kv "
                       "above 0, got ", p.max_sq, " and ", p.max_skv);
}

size_t fused_attn_fwd_workspace_bytes(const AttnParams &p) {
  check_nonempty(p);
  if (thd_decode(p)) return thd_decode_fwd_workspace_bytes(p);
  const Fp8Types *fp8 = is_fp8(p.dtype) ? &kQueryFp8Types : nullptr;
  size_t bytes = total_bytes(p, *graph_for(p, false, false, nullptr, fp8));
  if (p.return_max_logit) {
    // A call without an aux pack runs the plain graph (fused_attn_fwd): enough for either.
    AttnParams plain = p;
    plain.return_max_logit = false;
    bytes = std::max(bytes, fused_attn_fwd_workspace_bytes(plain));
  }
  return bytes;
}

size_t fused_attn_bwd_workspace_bytes(const AttnParams &p) {
  check_nonempty(p);
  // dBias is only known at the call; size for the larger graph.
  const bool db = p.bias_type == NVTE_POST_SCALE_BIAS;
  const Fp8Types *fp8 = is_fp8(p.dtype) ? &kQueryFp8Types : nullptr;
  return total_bytes(p, *graph_for(p, true, db, nullptr, fp8));
}

void fused_attn_fwd(const AttnParams &call, const attn::AttnFwdTensors &t, Tensor *workspace, cudaStream_t stream) {
  // Without an aux pack there is no max-logit buffer: the plain graph runs (as on the CPU).
  check_nonempty(call);
  AttnParams p = call;
  p.return_max_logit = call.return_max_logit && t.max_logit != nullptr;
  if (is_fp8(p.dtype)) {
    fp8_fwd(p, t, workspace, stream);
  } else if (thd_decode(p)) {
    thd_decode_fwd(p, t, workspace, stream);
  } else {
    fwd_f16(p, t, workspace, stream);
  }
  if (t.aux_rng && t.rng_state)
    NVTE_CHECK_CUDA(cudaMemcpyAsync(data(t.aux_rng), data(t.rng_state), 16, cudaMemcpyDeviceToDevice, stream));
  if (t.aux_bias && t.bias)
    NVTE_CHECK_CUDA(
        cudaMemcpyAsync(data(t.aux_bias), data(t.bias), bytes_of(*t.bias), cudaMemcpyDeviceToDevice, stream));
  if (t.aux_offset) {  // the learnable offset, or zeros for the off-by-one softmax (as on the CPU)
    if (t.softmax_offset)
      NVTE_CHECK_CUDA(cudaMemcpyAsync(data(t.aux_offset), data(t.softmax_offset), bytes_of(*t.softmax_offset),
                                      cudaMemcpyDeviceToDevice, stream));
    else
      NVTE_CHECK_CUDA(cudaMemsetAsync(data(t.aux_offset), 0, bytes_of(*t.aux_offset), stream));
  }
}

void fused_attn_bwd(const AttnParams &p, const attn::AttnBwdTensors &t, Tensor *workspace, cudaStream_t stream) {
  check_nonempty(p);
  if (is_fp8(p.dtype)) return fp8_bwd(p, t, workspace, stream);
  bwd_f16(p, t, workspace, stream);
}

}  // namespace nvte::cuda
