// cuda/cudnn/fused_attn_cudnn_calls.h - what the cuDNN attention translation units share that needs
// no cuDNN frontend types: graph tensor ids, the built-graph handle, the workspace layout, binding
// of lengths / offsets / page tables, the clean-up of rows cuDNN leaves undefined, and THD runs
// (fused_attn_cudnn_bind.cpp, which compiles without the heavy frontend headers), plus the entry
// points of fused_attn_cudnn.cpp and fused_attn_cudnn_fp8.cpp. Internal to core/cuda/cudnn/.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>

#include "../fused_attn.h"

namespace cudnn_frontend::graph {
class Graph;
}

namespace nvte::cuda::cudnn_attn {
using attn::AttnParams;

// Graph tensor ids (variant-pack keys). FP8 graphs add their scale tensors and amax outputs.
enum Uid : int64_t {
  kUQ = 1, kUK, kUV, kUO, kUStats, kUBias, kUSeqQ, kUSeqKV, kUSeed, kUOffset, kUdO, kUdQ, kUdK, kUdV, kUdBias,
  kUDescaleQ, kUDescaleK, kUDescaleV, kUDescaleO, kUDescaledO, kUDescaleS, kUDescaledP,
  kUScaleS, kUScaleO, kUScaledQ, kUScaledK, kUScaledV, kUScaledP,
  kUAmaxS, kUAmaxO, kUAmaxdQ, kUAmaxdK, kUAmaxdV, kUAmaxdP,
  kURaggedQ, kURaggedK, kURaggedV, kURaggedO,  // THD: ragged offsets of Q/dQ, K/dK, V/dV, O/dO
  kUMax, kUSumExp,                              // return_max_logit: cuDNN's row max and sum of exp
  kUPageK, kUPageV,                             // paged K/V caches: the (clamped) page tables
  kUSink                                        // off-by-one / learnable softmax: float32 [1, h_q, 1, 1]
};

// Element types of an FP8 call beyond Q/K/V (always E4M3): O (E4M3/E5M2, or float16/bfloat16),
// dO (E4M3/E5M2; dS~ takes its format) and the gradients dQ = dK = dV (FP8 or float16/bfloat16).
struct Fp8Types {
  NVTEDType o = kNVTEFloat8E4M3, d_o = kNVTEFloat8E5M2, grad = kNVTEFloat8E5M2;
};

struct Built {
  std::shared_ptr<cudnn_frontend::graph::Graph> graph;
  int64_t workspace = 0;
  std::string error;  // non-empty: cuDNN rejected the configuration (cached too)
};

inline size_t align256(size_t n) { return (n + 255) / 256 * 256; }

using VariantPack = std::unordered_map<int64_t, void *>;

// The built graph of a call (built on first use, then cached). Throws NOT_SUPPORTED with the
// reason when the support rules or cuDNN reject it. fp8: the FP8 element types (FP8 calls only).
std::shared_ptr<Built> graph_for(const AttnParams &call, bool bwd, bool has_dbias, cudaStream_t stream,
                                 const Fp8Types *fp8 = nullptr);

// Runs a built graph with the pointers of pack on stream.
void execute(const Built &b, VariantPack &pack, void *ws, cudaStream_t stream);

// Workspace layout (fused_attn_cudnn_bind.cpp): cuDNN's own bytes, then the sequence lengths of
// padding masks, then what each kind of call adds (THD: ragged offsets and scratch; FP8: scalars).
size_t cudnn_bytes(const Built &b);
size_t seqlen_bytes(const AttnParams &p);
size_t total_bytes(const AttnParams &p, const Built &b);
// FP8 calls: the float32 scalars in the workspace (descales the graph reads, amax values it writes).
float *fp8_scalars(const AttnParams &p, const Built &b, char *ws);
// Off-by-one / learnable softmax: float32 [h_q] (the off-by-one softmax's zero sink token), and
// after it a scratch: a sink_rescale call's statistics, else softmax_offset_grad's partial sums
// (fused_attn_sink.h).
char *sink_area(const AttnParams &p, const Built &b, char *ws);
char *sink_scratch(const AttnParams &p, const Built &b, char *ws);

// The workspace's data pointer after checking that it holds `need` bytes (null when need is 0).
char *workspace_ptr(Tensor *ws, size_t need);

// Padding masks: computes seq_q / seq_kv from cu_seqlens into the workspace (`extra`: the bytes
// after cuDNN's) and binds them; nothing otherwise.
void bind_seqlens(const AttnParams &p, const Tensor *cu_q, const Tensor *cu_kv, char *extra, VariantPack &pack,
                  cudaStream_t stream);

// BSHD/SBHD (THD: run_thd's ragged_zero_rows and row maps): after the graph ran, zeroes the rows of
// a Q-side (kv_side false: O, dQ) or K/V-side (dK, dV) tensor that fused_attn.h defines as zero
// and cuDNN may leave undefined (UnusedRows in fused_attn_seqlens.h); clear_unused_stats sets the
// statistics of those query rows to -inf, or, with a sink token (`sink`: float32 [h_q], else
// null), those of rows inside their sequence that see no key to the sink (the softmax has only
// the sink's term there). Padding masks need the lengths bound by bind_seqlens. No launch when
// the mask uses every row.
void clear_unused_rows(const AttnParams &p, const VariantPack &pack, void *base, const attn::TensorPlacement &pl,
                       bool kv_side, size_t heads, size_t d, NVTEDType dtype, cudaStream_t stream);
void clear_unused_stats(const AttnParams &p, const VariantPack &pack, float *stats, const float *sink,
                        cudaStream_t stream);

inline void *data(const Tensor *t) { return t ? t->params[kNVTERowwiseData].data_ptr : nullptr; }

inline size_t bytes_of(const Tensor &t) {
  const NVTEBasicTensor &b = t.params[kNVTERowwiseData];
  return numel(b.shape) * dtype_size(b.dtype);
}

// The FP8 calls (fused_attn_cudnn_fp8.cpp).
void fp8_fwd(const AttnParams &p, const attn::AttnFwdTensors &t, Tensor *workspace, cudaStream_t stream);
void fp8_bwd(const AttnParams &p, const attn::AttnBwdTensors &t, Tensor *workspace, cudaStream_t stream);

// Paged caches: binds the page tables of rows [start, start + the graph's batch) of the call's,
// clamped into the cache (rows past the batch: page 0, read by no key), copied into the workspace.
void bind_page_tables(const AttnParams &p, const Built &b, const Tensor *page_k, const Tensor *page_v, size_t start,
                      char *ws, VariantPack &pack, cudaStream_t stream);

// THD: runs the graph over sequences [0, n), [n, 2n), ... of the call (n: the graph's batch). The
// lengths, ragged offsets, dropout seed and statistics of each run go through the workspace
// (stream order keeps a run's inputs until its graph has read them). The forward writes the
// statistics to the caller's buffer after each run, the backward reads them before; rows that
// see no key are fixed up after each run (fused_attn_seqlens.h).
struct ThdInputs {
  const Tensor *cu_q, *cu_kv, *pad_q, *pad_kv, *rng;
  float *stats;                     // the caller's [batch, h_q, max_sq] statistics, or null (inference)
  float *max_logit = nullptr;       // forward with return_max_logit: the caller's max logit
  void *o = nullptr;                // forward: O
  void *dq = nullptr, *dk = nullptr, *dv = nullptr;  // backward: the gradients
  const Tensor *page_k = nullptr, *page_v = nullptr;  // paged caches: the page tables
};
void run_thd(const AttnParams &p, const Built &b, const ThdInputs &in, VariantPack &pack, char *ws,
             cudaStream_t stream);

}  // namespace nvte::cuda::cudnn_attn
