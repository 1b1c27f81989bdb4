// api/fused_attn.cpp - fused attention entry points (fused_attn.h): the layout/format queries,
// the backend query, forward and backward (with TE's aux-pack protocol) and the workspace
// queries. Argument checks live in api/attn_checks.cpp; the math in cpu/fused_attn.cpp.
#include "transformer_engine/fused_attn.h"

#include <string>
#include <vector>

#include "../common/backend.h"
#include "../cpu/fused_attn.h"
#include "alias_checks.h"
#include "attn_checks.h"
#ifdef NVTE_WITH_CUDNN
#include "../cuda/fused_attn.h"
#endif

using namespace nvte;
using attn::AttnParams;
using nvte::api::AttnScalars;

namespace {

bool has_bias_tensor(NVTE_Bias_Type b) {
  return b == NVTE_PRE_SCALE_BIAS || b == NVTE_POST_SCALE_BIAS;
}

const Tensor *opt(const NVTETensor t, const char *name) {
  return present(t) ? &require(t, name) : nullptr;
}

#if defined(NVTE_WITH_CUDA) && !defined(NVTE_WITH_CUDNN)
// Device tensors in a CUDA build without the cuDNN headers (core/cuda/cudnn/ not compiled).
[[noreturn]] void cuda_attn_missing(const char *op) {
  NVTE_FAIL(NVTE_ERROR_NOT_SUPPORTED, op, ": this library was built without cuDNN (cudnn.h and the "
            "cuDNN frontend headers were not found), so fused attention runs on host tensors only");
}
#endif

Tensor *workspace_of(NVTETensor ws) { return present(ws) ? &require_mut(ws, "workspace") : nullptr; }

// Outputs must share no memory with what a call reads, nor with each other: the CPU backend fills
// its outputs before it reads the inputs and the GPU's kernels read and write concurrently, so a
// shared byte is a silently wrong result (api::bytes_overlap; where packed Q/K/V and dQ/dK/dV sit
// is check_packing's business).
struct Span {
  const Tensor *t;  // (null: absent)
  const char *name;
};

Span span(const Tensor *t, const char *name) { return {t, name}; }

void check_apart(const Span &out, const Span &other) {
  NVTE_CHECK(out.t == nullptr || other.t == nullptr || !api::bytes_overlap(*out.t, *other.t), out.name,
             " shares memory with ", other.name, ": an output must not overlap an input or another output");
}

template <class Together>
void check_outputs_apart(const std::vector<Span> &outs, const std::vector<Span> &ins, Together together) {
  for (size_t i = 0; i < outs.size(); ++i) {
    for (const Span &in : ins) check_apart(outs[i], in);
    for (size_t j = i + 1; j < outs.size(); ++j)
      if (!together(i, j)) check_apart(outs[i], outs[j]);
  }
}

// The scalar arguments every entry point shares, in one place.
AttnScalars scalars(size_t max_sq, size_t max_skv, bool is_training, bool return_max_logit, float scale,
                    float dropout, NVTE_QKV_Layout layout, NVTE_Bias_Type bias, NVTE_Mask_Type mask,
                    NVTE_Softmax_Type softmax, int64_t window_left, int64_t window_right, bool bottom_right) {
  AttnScalars s;
  s.max_sq = max_sq;
  s.max_skv = max_skv;
  s.is_training = is_training;
  s.return_max_logit = return_max_logit;
  s.scale = scale;
  s.dropout = dropout;
  s.layout = layout;
  s.bias_type = bias;
  s.mask_type = mask;
  s.softmax_type = softmax;
  // A window of 2^31 - 1 or more reaches every key of any sequence (lengths and offsets are int32,
  // cu_seqlens): it is read as unbounded (-1), which also keeps the band arithmetic (i + diagonal
  // +- window) from overflowing and cuDNN's int band bounds from truncating.
  constexpr int64_t kReachesAll = INT32_MAX;
  s.window_left = window_left >= kReachesAll ? -1 : window_left;
  s.window_right = window_right >= kReachesAll ? -1 : window_right;
  s.bottom_right_diagonal = bottom_right;
  return s;
}

// ------------------------------------------------------------------ aux pack of the forward

// Slot positions of the forward's aux pack (-1: absent), in TE's order.
struct AuxSlots {
  int stats = 0, max = -1, rng = -1, bias = -1, offset = -1;
  int size = 0;
};

AuxSlots fwd_aux_slots(const AttnParams &p) {
  AuxSlots a;
  int i = 0;
  a.stats = i++;
  if (p.return_max_logit) a.max = i++;
  a.rng = i++;
  if (has_bias_tensor(p.bias_type) || (p.bias_type == NVTE_ALIBI && p.slopes_b != 0)) a.bias = i++;
  if (p.softmax_type != NVTE_VANILLA_SOFTMAX) a.offset = i++;
  a.size = i;
  return a;
}

Tensor &slot(NVTETensorPack *pack, int i) {
  NVTE_CHECK(pack->tensors[i] != nullptr, "Aux_CTX_Tensors->tensors[", i,
             "] is a NULL handle (create the pack with nvte_tensor_pack_create)");
  return *pack->tensors[i];
}

void describe_slot(Tensor &t, NVTEDType dtype, const NVTEShape &shape) {
  t.params[kNVTERowwiseData] = NVTEBasicTensor{nullptr, dtype, shape};
}

// TE's first call: only shapes and dtypes of the aux tensors, nothing computed.
void describe_aux(NVTETensorPack *pack, const AuxSlots &a, const AttnParams &p, const Tensor *bias) {
  NVTE_CHECK(static_cast<size_t>(a.size) <= NVTE_TENSOR_PACK_MAX_SIZE, "aux pack too small");
  describe_slot(slot(pack, a.stats), kNVTEFloat32, api::stats_shape(p));
  if (a.max >= 0) describe_slot(slot(pack, a.max), kNVTEFloat32, api::stats_shape(p));
  describe_slot(slot(pack, a.rng), kNVTEInt64, api::make_shape({2}));
  if (a.bias >= 0) {
    const NVTEBasicTensor &b = bias->params[kNVTERowwiseData];
    describe_slot(slot(pack, a.bias), b.dtype, b.shape);
  }
  if (a.offset >= 0)
    describe_slot(slot(pack, a.offset), kNVTEFloat32, api::make_shape({1, p.h_q, 1, 1}));
  pack->size = static_cast<size_t>(a.size);
}

// A copy slot: when its data pointer is NULL it is pointed at the source (TE's behaviour) and
// nothing is left to copy; otherwise the backend copies the source (or zeros) into it.
Tensor *bind_copy_slot(Tensor &s, const Tensor *src) {
  NVTEBasicTensor &b = s.params[kNVTERowwiseData];
  const void *sp = src ? src->params[kNVTERowwiseData].data_ptr : nullptr;
  if (b.data_ptr == nullptr) {
    b.data_ptr = const_cast<void *>(sp);
    return nullptr;
  }
  return b.data_ptr == sp ? nullptr : &s;
}

void run_fwd(const char *op, const NVTETensor Q, const NVTETensor K, const NVTETensor V,
             const NVTETensor Bias, const NVTETensor SoftmaxOffset, NVTETensor S, NVTETensor O,
             NVTETensorPack *aux, const NVTETensor cu_q, const NVTETensor cu_kv,
             const NVTETensor cu_q_pad, const NVTETensor cu_kv_pad, const NVTETensor page_k,
             const NVTETensor page_v, const NVTETensor rng_state, const AttnScalars &s,
             NVTETensor workspace, cudaStream_t stream) {
  const Tensor &q = require(Q, "Q"), &k = require(K, "K"), &v = require(V, "V");
  const attn::ParsedLayout pl = attn::parse_layout(s.layout);
  NVTE_CHECK(!pl.valid || pl.info.paged || (!present(page_k) && !present(page_v)), "page tables were "
             "given, but qkv_layout ", pl.info.name, " is not a paged layout (paged_kv_*)");
  api::AttnSideTensors side;
  side.page_k = opt(page_k, "page_table_k");
  side.page_v = opt(page_v, "page_table_v");
  side.bias = opt(Bias, "Bias");
  side.softmax_offset = opt(SoftmaxOffset, "SoftmaxOffset");
  side.cu_q = opt(cu_q, "cu_seqlens_q");
  side.cu_kv = opt(cu_kv, "cu_seqlens_kv");
  side.cu_q_padded = opt(cu_q_pad, "cu_seqlens_q_padded");
  side.cu_kv_padded = opt(cu_kv_pad, "cu_seqlens_kv_padded");
  const AttnParams p = api::describe(s, q, k, v, side);
  Tensor &o = require_mut(O, "O");
  const bool fp8 = is_fp8(p.dtype);
  if (fp8) {
    api::check_fp8_fwd(q, k, v, S, o, p);
  } else {
    api::check_out_like(o, "O", p);
  }
  const Tensor *rng = opt(rng_state, "rng_state");
  if (p.dropout > 0.0f) {
    NVTE_CHECK(rng != nullptr, "dropout ", p.dropout, " in training needs rng_state, int64 [2] "
               "(seed, offset)");
  }
  if (rng != nullptr) api::check_exact(*rng, "rng_state", kNVTEInt64, api::make_shape({2}), true);

  attn::AttnFwdTensors t;
  t.q = &q;
  t.k = &k;
  t.v = &v;
  t.bias = (has_bias_tensor(p.bias_type) || p.slopes_b != 0) ? side.bias : nullptr;
  t.softmax_offset = p.softmax_type == NVTE_LEARNABLE_SOFTMAX ? side.softmax_offset : nullptr;
  t.cu_q = side.cu_q;
  t.cu_kv = side.cu_kv;
  t.cu_q_padded = side.cu_q_padded;
  t.cu_kv_padded = side.cu_kv_padded;
  t.rng_state = rng;
  t.page_k = p.layout.paged ? side.page_k : nullptr;
  t.page_v = p.layout.paged ? side.page_v : nullptr;
  t.o = &o;
  t.s = fp8 ? S : nullptr;

  std::vector<NamedTensor> all = {
      {"Q", Q}, {"K", K}, {"V", V}, {"Bias", Bias}, {"SoftmaxOffset", SoftmaxOffset}, {"O", O},
      {"cu_seqlens_q", cu_q}, {"cu_seqlens_kv", cu_kv}, {"cu_seqlens_q_padded", cu_q_pad},
      {"cu_seqlens_kv_padded", cu_kv_pad}, {"rng_state", rng_state}, {"page_table_k", page_k},
      {"page_table_v", page_v}};
  if (fp8) all.push_back({"S", S});
  AuxSlots a;
  if (aux == nullptr) {
    NVTE_CHECK(!p.is_training, "is_training needs Aux_CTX_Tensors to keep the softmax statistics "
               "for the backward (pass an empty pack first to have it described)");
  } else {
    a = fwd_aux_slots(p);
    if (aux->size == 0) return describe_aux(aux, a, p, side.bias);
    NVTE_CHECK(aux->size == static_cast<size_t>(a.size), "Aux_CTX_Tensors has ", aux->size,
               " tensors; expected 0 (to have them described) or ", a.size,
               " (statistics", p.return_max_logit ? ", max logit" : "", ", rng_state",
               a.bias >= 0 ? ", bias" : "", a.offset >= 0 ? ", softmax offset" : "", ")");
    t.stats = &slot(aux, a.stats);
    api::check_exact(*t.stats, "Aux_CTX_Tensors[0] (softmax statistics)", kNVTEFloat32,
                     api::stats_shape(p), true);
    all.push_back({"Aux_CTX_Tensors statistics", aux->tensors[a.stats]});
    if (a.max >= 0) {
      t.max_logit = &slot(aux, a.max);
      api::check_exact(*t.max_logit, "Aux_CTX_Tensors[1] (max logit)", kNVTEFloat32,
                       api::stats_shape(p), true);
      all.push_back({"Aux_CTX_Tensors max logit", aux->tensors[a.max]});
    }
    api::check_exact(slot(aux, a.rng), "Aux_CTX_Tensors rng_state slot", kNVTEInt64,
                     api::make_shape({2}), false);
    all.push_back({"Aux_CTX_Tensors rng_state", aux->tensors[a.rng]});
    if (a.bias >= 0) {
      const NVTEBasicTensor &b = side.bias->params[kNVTERowwiseData];
      api::check_exact(slot(aux, a.bias), "Aux_CTX_Tensors bias slot", b.dtype, b.shape, false);
      all.push_back({"Aux_CTX_Tensors bias", aux->tensors[a.bias]});
    }
    if (a.offset >= 0) {
      api::check_exact(slot(aux, a.offset), "Aux_CTX_Tensors softmax offset slot", kNVTEFloat32,
                       api::make_shape({1, p.h_q, 1, 1}), false);
      all.push_back({"Aux_CTX_Tensors softmax offset", aux->tensors[a.offset]});
    }
  }
  std::vector<Span> outs = {span(&o, "O")};
  if (t.stats) outs.push_back(span(t.stats, "Aux_CTX_Tensors[0] (softmax statistics)"));
  if (t.max_logit) outs.push_back(span(t.max_logit, "Aux_CTX_Tensors[1] (max logit)"));
  check_outputs_apart(outs,
                      {span(&q, "Q"), span(&k, "K"), span(&v, "V"), span(t.bias, "Bias"),
                       span(t.softmax_offset, "SoftmaxOffset"), span(side.cu_q, "cu_seqlens_q"),
                       span(side.cu_kv, "cu_seqlens_kv"), span(side.cu_q_padded, "cu_seqlens_q_padded"),
                       span(side.cu_kv_padded, "cu_seqlens_kv_padded"), span(t.page_k, "page_table_k"),
                       span(t.page_v, "page_table_v"), span(rng, "rng_state")},
                      [](size_t, size_t) { return false; });
  switch (backend_of(all.data(), all.size())) {
    case Backend::CPU:
      if (aux != nullptr) {
        t.aux_rng = bind_copy_slot(slot(aux, a.rng), rng);
        if (a.bias >= 0) t.aux_bias = bind_copy_slot(slot(aux, a.bias), side.bias);
        if (a.offset >= 0) t.aux_offset = bind_copy_slot(slot(aux, a.offset), t.softmax_offset);
      }
      return cpu::fused_attn_fwd(p, t);
    case Backend::CUDA:
#if defined(NVTE_WITH_CUDNN)
      if (aux != nullptr) {
        t.aux_rng = bind_copy_slot(slot(aux, a.rng), rng);
        if (a.bias >= 0) t.aux_bias = bind_copy_slot(slot(aux, a.bias), side.bias);
        if (a.offset >= 0) t.aux_offset = bind_copy_slot(slot(aux, a.offset), t.softmax_offset);
      }
      return cuda::fused_attn_fwd(p, t, workspace_of(workspace), stream);
#elif defined(NVTE_WITH_CUDA)
      cuda_attn_missing(op);
#else
      cuda_not_built(op);
#endif
  }
}

// ------------------------------------------------------------------ aux pack of the backward

// Paged K/V caches serve inference: the backward takes no page tables (TE's signature), and
// cuDNN's paged attention is forward-only.
void reject_paged_backward(const AttnScalars &s) {
  const attn::ParsedLayout pl = attn::parse_layout(s.layout);
  NVTE_CHECK_SUPPORTED(!pl.valid || !pl.info.paged, "qkv_layout ", pl.info.name, " (paged KV cache) has "
                       "no backward: paged caches are for inference (the backward takes no page tables)");
}

struct BwdAux {
  const Tensor *stats = nullptr, *rng = nullptr, *bias = nullptr, *offset = nullptr;
};

// The forward's pack: [stats, (max), rng_state, (bias or ALiBi slopes), (softmax offset)].
// A max-logit slot is recognised by being a float32 tensor shaped like the statistics.
BwdAux parse_bwd_aux(const NVTETensorPack *pack, const AttnScalars &s) {
  NVTE_CHECK(pack != nullptr, "Aux_CTX_Tensors is NULL; the backward needs the pack filled by the "
             "training forward");
  const bool bias = has_bias_tensor(s.bias_type), offset = s.softmax_type != NVTE_VANILLA_SOFTMAX;
  const bool alibi = s.bias_type == NVTE_ALIBI;
  const size_t base = 2 + (bias ? 1 : 0) + (offset ? 1 : 0), most = base + 1 + (alibi ? 1 : 0);
  NVTE_CHECK(pack->size >= base && pack->size <= most, "Aux_CTX_Tensors has ", pack->size,
             " tensors; the forward of this configuration leaves ", base,
             " (statistics, rng_state", bias ? ", bias" : "", offset ? ", softmax offset" : "",
             "), plus the max logit when asked for", alibi ? " and the ALiBi slopes when given" : "");
  for (size_t i = 0; i < pack->size; ++i)
    NVTE_CHECK(pack->tensors[i] != nullptr, "Aux_CTX_Tensors->tensors[", i, "] is a NULL handle");
  size_t extra = pack->size - base, i = 0;
  BwdAux r;
  r.stats = pack->tensors[i++];
  if (extra > 0) {
    const NVTEBasicTensor &s0 = r.stats->params[kNVTERowwiseData];
    const NVTEBasicTensor &s1 = pack->tensors[1]->params[kNVTERowwiseData];
    bool like = s1.dtype == kNVTEFloat32 && s1.shape.ndim == s0.shape.ndim;
    for (size_t d = 0; like && d < s0.shape.ndim; ++d) like = s0.shape.data[d] == s1.shape.data[d];
    if (like) {
      ++i;
      --extra;
    }
  }
  r.rng = pack->tensors[i++];
  if (bias) {
    r.bias = pack->tensors[i++];
    NVTE_CHECK(present(const_cast<Tensor *>(r.bias)), "Aux_CTX_Tensors[", i - 1,
               "] (the forward's Bias) has no data");
  } else if (alibi && extra > 0) {
    r.bias = pack->tensors[i++];
    --extra;
  }
  NVTE_CHECK(extra == 0, "Aux_CTX_Tensors has an extra tensor the forward of this configuration "
             "does not produce");
  if (offset) r.offset = pack->tensors[i++];
  return r;
}

void run_bwd(const char *op, const NVTETensor Q, const NVTETensor K, const NVTETensor V,
             const NVTETensor O, const NVTETensor dO, const NVTETensor S, NVTETensor dP,
             const NVTETensorPack *aux, NVTETensor dQ,
             NVTETensor dK, NVTETensor dV, NVTETensor dBias, NVTETensor dSoftmaxOffset,
             const NVTETensor cu_q, const NVTETensor cu_kv, const NVTETensor cu_q_pad,
             const NVTETensor cu_kv_pad, const AttnScalars &s, NVTETensor workspace,
             cudaStream_t stream) {
  const Tensor &q = require(Q, "Q"), &k = require(K, "K"), &v = require(V, "V");
  reject_paged_backward(s);
  const BwdAux ax = parse_bwd_aux(aux, s);
  api::AttnSideTensors side;
  side.bias = ax.bias;
  side.softmax_offset = ax.offset;
  side.cu_q = opt(cu_q, "cu_seqlens_q");
  side.cu_kv = opt(cu_kv, "cu_seqlens_kv");
  side.cu_q_padded = opt(cu_q_pad, "cu_seqlens_q_padded");
  side.cu_kv_padded = opt(cu_kv_pad, "cu_seqlens_kv_padded");
  const AttnParams p = api::describe(s, q, k, v, side);
  const Tensor &o = require(O, "O"), &d_o = require(dO, "dO");
  const bool fp8 = is_fp8(p.dtype);
  if (!fp8) {
    api::check_out_like(o, "O", p);
    api::check_out_like(d_o, "dO", p);
  }
  api::check_exact(*ax.stats, "Aux_CTX_Tensors[0] (softmax statistics)", kNVTEFloat32,
                   api::stats_shape(p), true);
  if (p.dropout > 0.0f) {
    api::check_exact(*ax.rng, "Aux_CTX_Tensors rng_state", kNVTEInt64, api::make_shape({2}), true);
  }
  Tensor &dq = require_mut(dQ, "dQ"), &dk = require_mut(dK, "dK"), &dv = require_mut(dV, "dV");
  if (fp8) {
    api::check_fp8_bwd(q, k, v, o, d_o, S, dP, dq, dk, dv, p);
  } else {
    api::check_qkv_grads(dq, dk, dv, q, k, v, p, p.dtype);
  }

  attn::AttnBwdTensors t;
  t.q = &q;
  t.k = &k;
  t.v = &v;
  t.o = &o;
  t.d_o = &d_o;
  t.stats = ax.stats;
  t.rng_state = p.dropout > 0.0f ? ax.rng : nullptr;
  t.bias = ax.bias;
  t.softmax_offset = p.softmax_type == NVTE_LEARNABLE_SOFTMAX ? ax.offset : nullptr;
  t.cu_q = side.cu_q;
  t.cu_kv = side.cu_kv;
  t.cu_q_padded = side.cu_q_padded;
  t.cu_kv_padded = side.cu_kv_padded;
  t.dq = &dq;
  t.dk = &dk;
  t.dv = &dv;
  if (fp8) {
    t.s = S;
    t.dp = dP;
  }
  if (has_bias_tensor(p.bias_type) && present(dBias)) {
    t.dbias = &require_mut(dBias, "dBias");
    const NVTEBasicTensor &b = ax.bias->params[kNVTERowwiseData];
    NVTE_CHECK(is_high_precision(logical_dtype(*t.dbias)), "dBias must be float32, float16 or "
               "bfloat16, got ", dtype_name(logical_dtype(*t.dbias)));
    api::check_exact(*t.dbias, "dBias", logical_dtype(*t.dbias), b.shape, true);
  }
  if (p.softmax_type == NVTE_LEARNABLE_SOFTMAX && present(dSoftmaxOffset)) {
    t.dsoftmax_offset = &require_mut(dSoftmaxOffset, "dSoftmaxOffset");
    api::check_exact(*t.dsoftmax_offset, "dSoftmaxOffset", kNVTEFloat32,
                     api::make_shape({1, p.h_q, 1, 1}), true);
  }
  std::vector<NamedTensor> all = {
      {"Q", Q}, {"K", K}, {"V", V}, {"O", O}, {"dO", dO}, {"dQ", dQ}, {"dK", dK}, {"dV", dV},
      {"dBias", t.dbias ? dBias : nullptr},
      {"dSoftmaxOffset", t.dsoftmax_offset ? dSoftmaxOffset : nullptr},
      {"cu_seqlens_q", cu_q}, {"cu_seqlens_kv", cu_kv}, {"cu_seqlens_q_padded", cu_q_pad},
      {"cu_seqlens_kv_padded", cu_kv_pad}};
  for (size_t i = 0; i < aux->size; ++i) all.push_back({"Aux_CTX_Tensors", aux->tensors[i]});
  if (fp8) {
    all.push_back({"S", S});
    all.push_back({"dP", dP});
  }
  {
    // dQ, dK, dV of a packed layout share one buffer (3HD / H3D: all three; HD_2HD / HD_H2D: dK, dV)
    const NVTE_QKV_Layout_Group g = p.layout.group;
    const bool qkv_packed = g == NVTE_3HD || g == NVTE_H3D;
    const bool kv_packed = qkv_packed || g == NVTE_HD_2HD || g == NVTE_HD_H2D;
    check_outputs_apart({span(&dq, "dQ"), span(&dk, "dK"), span(&dv, "dV"), span(t.dbias, "dBias"),
                         span(t.dsoftmax_offset, "dSoftmaxOffset")},
                        {span(&q, "Q"), span(&k, "K"), span(&v, "V"), span(&o, "O"), span(&d_o, "dO"),
                         span(ax.stats, "Aux_CTX_Tensors[0] (softmax statistics)"),
                         span(t.rng_state, "Aux_CTX_Tensors rng_state"), span(ax.bias, "the bias"),
                         span(t.softmax_offset, "the softmax offset"), span(side.cu_q, "cu_seqlens_q"),
                         span(side.cu_kv, "cu_seqlens_kv"), span(side.cu_q_padded, "cu_seqlens_q_padded"),
                         span(side.cu_kv_padded, "cu_seqlens_kv_padded")},
                        [&](size_t i, size_t j) {
                          return (i == 0 && j <= 2 && qkv_packed) || (i == 1 && j == 2 && kv_packed);
                        });
  }
  switch (backend_of(all.data(), all.size())) {
    case Backend::CPU: return cpu::fused_attn_bwd(p, t);
    case Backend::CUDA:
#if defined(NVTE_WITH_CUDNN)
      return cuda::fused_attn_bwd(p, t, workspace_of(workspace), stream);
#elif defined(NVTE_WITH_CUDA)
      cuda_attn_missing(op);
#else
      cuda_not_built(op);
#endif
  }
}

// Backend of a workspace query: where Q, K, V live. `bias` is the Bias (forward) or dBias
// (backward) tensor; only its shape is read.
size_t workspace_bytes(const char *op, const NVTETensor Q, const NVTETensor K, const NVTETensor V,
                       const NVTETensor bias, const AttnScalars &s, bool backward) {
  const Tensor &q = require(Q, "Q"), &k = require(K, "K"), &v = require(V, "V");
  if (backward) reject_paged_backward(s);
  api::check_config(s, api::qkv_dims(s, q, k, v));
  // The sizes do not depend on cu_seqlens (values, or for THD the batch size): the call is
  // described without them, on either backend (so both refuse what the call would).
  AttnScalars s2 = s;
  if (backward) s2.is_training = true;
  api::AttnSideTensors side;
  side.bias = opt(bias, backward ? "dBias" : "Bias");
  const AttnParams p = api::describe(s2, q, k, v, side, /*with_cu=*/false);
  (void)p;  // (read by the CUDA backend only)
  switch (backend_of({{"Q", Q}, {"K", K}, {"V", V}})) {
    case Backend::CPU: return 0;
    case Backend::CUDA:
#if defined(NVTE_WITH_CUDNN)
      return backward ? cuda::fused_attn_bwd_workspace_bytes(p) : cuda::fused_attn_fwd_workspace_bytes(p);
#elif defined(NVTE_WITH_CUDA)
      cuda_attn_missing(op);
#else
      cuda_not_built(op);
#endif
  }
  return 0;
}

template <class R>
R layout_query(const char *op, NVTE_QKV_Layout layout, R (*pick)(const attn::LayoutInfo &)) {
  R r = static_cast<R>(-1);
  api_call(op, [&] {
    const attn::ParsedLayout pl = attn::parse_layout(layout);
    NVTE_CHECK(pl.valid, "qkv_layout ", static_cast<int>(layout),
               " is not an NVTE_QKV_Layout value (0..24)");
    r = pick(pl.info);
  });
  return r;
}

}  // namespace

extern "C" {

NVTE_QKV_Layout_Group nvte_get_qkv_layout_group(NVTE_QKV_Layout qkv_layout) {
  return layout_query<NVTE_QKV_Layout_Group>("nvte_get_qkv_layout_group", qkv_layout,
                                             [](const attn::LayoutInfo &l) { return l.group; });
}

NVTE_QKV_Format nvte_get_qkv_format(NVTE_QKV_Layout qkv_layout) {
  return layout_query<NVTE_QKV_Format>("nvte_get_qkv_format", qkv_layout,
                                       [](const attn::LayoutInfo &l) {
                                         return attn::combined_format(l.q_format, l.kv_format);
                                       });
}

NVTE_QKV_Format nvte_get_q_format(NVTE_QKV_Layout qkv_layout) {
  return layout_query<NVTE_QKV_Format>("nvte_get_q_format", qkv_layout,
                                       [](const attn::LayoutInfo &l) { return l.q_format; });
}

NVTE_QKV_Format nvte_get_kv_format(NVTE_QKV_Layout qkv_layout) {
  return layout_query<NVTE_QKV_Format>("nvte_get_kv_format", qkv_layout,
                                       [](const attn::LayoutInfo &l) { return l.kv_format; });
}

NVTE_Fused_Attn_Backend nvte_get_fused_attn_backend(
    bool is_training, NVTEDType q_dtype, NVTEDType kv_dtype, NVTE_QKV_Layout qkv_layout,
    NVTE_Bias_Type bias_type, NVTE_Mask_Type attn_mask_type, NVTE_Softmax_Type softmax_type,
    float dropout, size_t num_attn_heads, size_t num_gqa_groups, size_t max_seqlen_q,
    size_t max_seqlen_kv, size_t head_dim_qk, size_t head_dim_v, int64_t window_size_left,
    int64_t window_size_right, bool return_max_logit, bool cuda_graph, bool deterministic) {
  // The CPU reference runs every configuration check_config accepts. With a CUDA device (and
  // cuDNN in the build) the answer is the GPU's: its static rules (cuda/fused_attn.h); cuDNN
  // itself may still reject a particular shape at the call (NOT_SUPPORTED with its reason).
  const NVTEStatus st = api_call("nvte_get_fused_attn_backend", [&] {
    const AttnScalars s = scalars(max_seqlen_q, max_seqlen_kv, is_training, return_max_logit, 1.0f, dropout,
                                  qkv_layout, bias_type, attn_mask_type, softmax_type, window_size_left,
                                  window_size_right, false);
    const attn::LayoutInfo l =
        api::check_config(s, {q_dtype, kv_dtype, num_attn_heads, num_gqa_groups, head_dim_qk, head_dim_v});
    if (is_training) reject_paged_backward(s);  // training needs the backward, which paged layouts lack
#if defined(NVTE_WITH_CUDNN)
    if (nvte_cuda_backend_available()) {
      AttnParams p;
      p.layout = l;
      p.dtype = q_dtype;
      p.h_q = num_attn_heads;
      p.h_kv = num_gqa_groups;
      p.d_qk = head_dim_qk;
      p.d_v = head_dim_v;
      p.max_sq = max_seqlen_q;
      p.max_skv = max_seqlen_kv;
      p.bias_type = bias_type;
      p.mask_type = attn_mask_type;
      p.padding = api::is_padding(attn_mask_type);  // (the rules' bottom-right alignment depends on it)
      p.softmax_type = softmax_type;
      p.is_training = is_training;
      p.dropout = is_training ? dropout : 0.0f;
      p.return_max_logit = return_max_logit;
      p.deterministic = is_training && deterministic;
      p.rule = api::mask_rule(s);
      std::string why;
      NVTE_CHECK_SUPPORTED(cuda::fused_attn_supported(p, &why), "CUDA fused attention: ", why);
    }
#endif
  });
  if (st != NVTE_SUCCESS) return NVTE_No_Backend;
  return is_fp8(q_dtype) ? NVTE_FP8 : NVTE_F16_arbitrary_seqlen;
}

NVTEStatus nvte_fused_attn_fwd(
    const NVTETensor Q, const NVTETensor K, const NVTETensor V, const NVTETensor Bias,
    const NVTETensor SoftmaxOffset, NVTETensor S, NVTETensor O, NVTETensorPack *Aux_CTX_Tensors,
    const NVTETensor cu_seqlens_q, const NVTETensor cu_seqlens_kv,
    const NVTETensor cu_seqlens_q_padded, const NVTETensor cu_seqlens_kv_padded,
    const NVTETensor page_table_k, const NVTETensor page_table_v, const NVTETensor rng_state,
    size_t max_seqlen_q, size_t max_seqlen_kv, bool is_training, bool return_max_logit,
    bool cuda_graph, float attn_scale, float dropout, NVTE_QKV_Layout qkv_layout,
    NVTE_Bias_Type bias_type, NVTE_Mask_Type attn_mask_type, NVTE_Softmax_Type softmax_type,
    int64_t window_size_left, int64_t window_size_right, bool bottom_right_diagonal,
    NVTETensor workspace, cudaStream_t stream) {
  const char *op = "nvte_fused_attn_fwd";
  return api_call(op, [&] {
    const AttnScalars s = scalars(max_seqlen_q, max_seqlen_kv, is_training, return_max_logit, attn_scale, dropout,
                                  qkv_layout, bias_type, attn_mask_type, softmax_type, window_size_left,
                                  window_size_right, bottom_right_diagonal);
    run_fwd(op, Q, K, V, Bias, SoftmaxOffset, S, O, Aux_CTX_Tensors, cu_seqlens_q, cu_seqlens_kv,
            cu_seqlens_q_padded, cu_seqlens_kv_padded, page_table_k, page_table_v, rng_state, s,
            workspace, stream);
  });
}

NVTEStatus nvte_fused_attn_bwd(
    const NVTETensor Q, const NVTETensor K, const NVTETensor V, const NVTETensor O,
    const NVTETensor dO, const NVTETensor S, NVTETensor dP, const NVTETensorPack *Aux_CTX_Tensors,
    NVTETensor dQ, NVTETensor dK, NVTETensor dV, NVTETensor dBias, NVTETensor dSoftmaxOffset,
    const NVTETensor cu_seqlens_q, const NVTETensor cu_seqlens_kv,
    const NVTETensor cu_seqlens_q_padded, const NVTETensor cu_seqlens_kv_padded,
    size_t max_seqlen_q, size_t max_seqlen_kv, float attn_scale, float dropout,
    NVTE_QKV_Layout qkv_layout, NVTE_Bias_Type bias_type, NVTE_Mask_Type attn_mask_type,
    NVTE_Softmax_Type softmax_type, int64_t window_size_left, int64_t window_size_right,
    bool bottom_right_diagonal, bool deterministic, bool cuda_graph, NVTETensor workspace,
    cudaStream_t stream) {
  const char *op = "nvte_fused_attn_bwd";
  return api_call(op, [&] {
    const AttnScalars s = scalars(max_seqlen_q, max_seqlen_kv, true, false, attn_scale, dropout, qkv_layout,
                                  bias_type, attn_mask_type, softmax_type, window_size_left, window_size_right,
                                  bottom_right_diagonal);
    AttnScalars sd = s;
    sd.deterministic = deterministic;
    run_bwd(op, Q, K, V, O, dO, S, dP, Aux_CTX_Tensors, dQ, dK, dV, dBias, dSoftmaxOffset, cu_seqlens_q,
            cu_seqlens_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded, sd, workspace, stream);
  });
}

NVTEStatus nvte_fused_attn_fwd_workspace_size(
    const NVTETensor Q, const NVTETensor K, const NVTETensor V, const NVTETensor Bias,
    size_t max_seqlen_q, size_t max_seqlen_kv, bool is_training, bool return_max_logit,
    float dropout, NVTE_QKV_Layout qkv_layout, NVTE_Bias_Type bias_type,
    NVTE_Mask_Type attn_mask_type, NVTE_Softmax_Type softmax_type, int64_t window_size_left,
    int64_t window_size_right, bool bottom_right_diagonal, size_t *bytes) {
  const char *op = "nvte_fused_attn_fwd_workspace_size";
  return api_call(op, [&] {
    NVTE_CHECK(bytes != nullptr, "bytes is NULL");
    const AttnScalars s = scalars(max_seqlen_q, max_seqlen_kv, is_training, return_max_logit, 1.0f, dropout,
                                  qkv_layout, bias_type, attn_mask_type, softmax_type, window_size_left,
                                  window_size_right, bottom_right_diagonal);
    *bytes = workspace_bytes(op, Q, K, V, Bias, s, false);
  });
}

NVTEStatus nvte_fused_attn_bwd_workspace_size(
    const NVTETensor Q, const NVTETensor K, const NVTETensor V, const NVTETensor dBias,
    size_t max_seqlen_q, size_t max_seqlen_kv, float dropout, NVTE_QKV_Layout qkv_layout,
    NVTE_Bias_Type bias_type, NVTE_Mask_Type attn_mask_type, NVTE_Softmax_Type softmax_type,
    int64_t window_size_left, int64_t window_size_right, bool bottom_right_diagonal,
    bool deterministic, size_t *bytes) {
  const char *op = "nvte_fused_attn_bwd_workspace_size";
  return api_call(op, [&] {
    NVTE_CHECK(bytes != nullptr, "bytes is NULL");
    AttnScalars s = scalars(max_seqlen_q, max_seqlen_kv, true, false, 1.0f, dropout, qkv_layout, bias_type,
                            attn_mask_type, softmax_type, window_size_left, window_size_right, bottom_right_diagonal);
    s.deterministic = deterministic;
    *bytes = workspace_bytes(op, Q, K, V, dBias, s, true);
  });
}

}  // extern "C"
