// cuda/cudnn/fused_attn_cudnn_rules.cpp - see fused_attn_cudnn_rules.h. The support matrix is
// described at the top of fused_attn_cudnn.cpp.
#include "fused_attn_cudnn_rules.h"

#include <algorithm>

#include "../../common/error.h"

namespace nvte::cuda::cudnn_attn {

bool thd(const AttnParams &p) { return p.layout.q_format == NVTE_THD; }
bool kv_thd(const AttnParams &p) { return p.layout.kv_format == NVTE_THD; }

bool bottom_right(const AttnParams &p) {
  return p.rule.bottom_right && (p.padding || thd(p) || p.max_sq != p.max_skv);
}

bool windowed(const AttnParams &p) {
  return p.rule.window_left >= 0 || (p.rule.window_right >= 0 && !p.rule.causal);
}

bool causal_hides_nothing(const AttnParams &p) {
  return p.rule.causal && bottom_right(p) && p.max_sq == 1 && p.rule.window_left < 0;
}

namespace {
// cuDNN's SDPA (forward and backward, FP8 too) rejects a bottom-right causal mask together with a
// bias, ALiBi or dropout; said here so that the backend query knows it.
std::string bottom_right_reason(const AttnParams &p) {
  if (!(p.rule.causal && bottom_right(p))) return "";
  if (p.bias_type != NVTE_NO_BIAS) return "cuDNN takes no bias or ALiBi with a bottom-right causal mask";
  if (p.dropout > 0.0f) return "cuDNN takes no dropout with a bottom-right causal mask";
  return "";
}

std::string fp8_unsupported_reason(const AttnParams &p) {
  if (p.dtype != kNVTEFloat8E4M3)
    return concat("cuDNN FP8 attention takes float8_e4m3 Q, K, V; got ", dtype_name(p.dtype));
  // cuDNN's FP8 backward takes no ragged (THD) tensors on Hopper (frontend 1.32's sdpa_fp8_backward
  // check), so FP8 THD training cannot run there; paged caches are not taken with FP8 at all.
  if (p.layout.q_format == NVTE_THD || p.layout.kv_format == NVTE_THD || p.layout.paged)
    return concat("layout ", p.layout.name, " (THD / paged) is not supported by the CUDA FP8 attention (cuDNN's "
                  "FP8 backward takes no THD tensors on Hopper)");
  if (p.softmax_type != NVTE_VANILLA_SOFTMAX) return "FP8 attention on the GPU takes the vanilla softmax only";
  if (p.bias_type != NVTE_NO_BIAS) return "FP8 attention has no bias or ALiBi (cuDNN's sdpa_fp8, as in TE)";
  // cuDNN's sdpa_fp8 graphs take dropout, but with cuDNN 9.19 the forward kernel (sm90 flash
  // fprop, f8) faults with it: compute-sanitizer shows out-of-bounds shared-memory writes inside
  // cuDNN, on an H100 in the library and on an H200 in a cuDNN-only program
  // (benchmarks/cudnn_fp8_attention_plans.cu, DROPOUT=0.1: every plan of every heuristic mode).
  // The same program with cuDNN 9.14 ran forward and backward clean; 9.19 is the copy PyTorch
  // ships and the process shares, so the rule stands for every version.
  if (p.dropout > 0.0f)
    return "FP8 attention with dropout is not supported by the CUDA backend (cuDNN 9.19's FP8 forward kernel "
           "faulted with dropout on an H100)";
  if (p.return_max_logit) return "FP8 attention has no max logit";
  if (p.rule.window_right >= 0 && !(p.rule.causal && p.rule.window_right == 0))
    return "FP8 attention with a bounded right window other than the causal one is not supported on the GPU";
  if (p.rule.window_left >= 0 && bottom_right(p))
    return "FP8 attention with a left window and bottom-right alignment is not supported on the GPU";
  if (const std::string r = bottom_right_reason(p); !r.empty()) return r;
  // Measured on an H200 with cuDNN 9.19: at s = 200 the FP8 backward's dQ was twice as far from
  // float64 attention as the reference's (at 128 and 256 it matched); cuDNN's validation accepts
  // it, so the rule is here.
  if (p.is_training && (p.max_sq % 128 != 0 || p.max_skv % 128 != 0))
    return concat("FP8 attention training (cuDNN's FP8 backward) needs max_seqlen_q and max_seqlen_kv that are "
                  "multiples of 128 on the GPU (got ", p.max_sq, ", ", p.max_skv,
                  "; other lengths gave a wrong dQ): pad the sequences");
  return "";
}

std::string thd_unsupported_reason(const AttnParams &p) {
  if (p.bias_type != NVTE_NO_BIAS)
    return concat("THD layouts on the GPU take no bias or ALiBi (got bias_type ", attn::bias_name(p.bias_type), ")");
  // Ragged offsets are int32 element counts from each tensor's pointer.
  const attn::TensorPlacement *pl[4] = {&p.qkv.t[attn::kQ], &p.qkv.t[attn::kK], &p.qkv.t[attn::kV], &p.out};
  const size_t rows[4] = {p.rows_q, p.rows_kv, p.rows_kv, p.rows_q};
  const char *names[4] = {"Q", "K", "V", "O"};
  for (int i = 0; i < 4; ++i) {
    if ((i == 0 || i == 3 || kv_thd(p)) && rows[i] * pl[i]->row_stride >= (size_t(1) << 31))
      return concat("THD tensor ", names[i], " spans ", rows[i] * pl[i]->row_stride,
                    " elements; cuDNN's ragged offsets are int32, so the GPU takes THD tensors of fewer than 2^31");
  }
  return "";
}

// The off-by-one and learnable softmax run as cuDNN's sink token (cuDNN >= 9.13; the frontend
// reports older versions at the graph build).
std::string sink_unsupported_reason(const AttnParams &p) {
  const char *what = p.softmax_type == NVTE_OFF_BY_ONE_SOFTMAX ? "the off-by-one softmax" : "the learnable softmax";
  if (thd(p) || kv_thd(p))
    return concat(what, " is not supported with THD layouts on the GPU (cuDNN 9.19's ragged backward takes no sink "
                  "token; it needs 9.26)");
  if (p.return_max_logit) return concat(what, " is not supported with return_max_logit on the GPU");
  if (sink_rescale(p) && p.is_training)
    return concat(what, " with ", p.layout.paged ? "a paged K/V cache" : "max_seqlen_q 1",
                  " runs forward only (inference) on the GPU: cuDNN takes no sink token there, and the library "
                  "rescales a vanilla graph's output instead");
  return "";
}

size_t pow2_at_least(size_t x) {
  size_t n = 1;
  while (n < x) n *= 2;
  return n;
}

}  // namespace

std::string unsupported_reason(const AttnParams &p) {
  // cuDNN's graph validation rejects these at the call; the query must say so first, so that
  // callers can choose another path (the PyTorch adapter's unfused one).
  if (p.d_qk % 8 || p.d_v % 8 || p.d_qk > 256 || p.d_v > 256)
    return concat("cuDNN attention takes head sizes that are multiples of 8 and at most 256; got d_qk ", p.d_qk,
                  ", d_v ", p.d_v);
  if (is_fp8(p.dtype)) return fp8_unsupported_reason(p);
  if (p.dtype != kNVTEBFloat16 && p.dtype != kNVTEFloat16)
    return concat("cuDNN attention takes bfloat16/float16 Q, K, V; got ", dtype_name(p.dtype));
  if (kv_thd(p) && !thd(p))
    return concat("layout ", p.layout.name, " (THD K/V with BSHD/SBHD queries) is not supported by the CUDA backend");
  // (page_size is 0 in the tensor-less backend query; the workspace queries and the call see it)
  if (p.layout.paged && p.page_size > 0 && (p.page_size & (p.page_size - 1)) != 0)
    return concat("a paged K/V cache takes page sizes that are powers of two on the GPU (cuDNN's paged load); got ",
                  p.page_size);
  // THD queries over BSHD/SBHD K/V (TE's inference layouts): forward only on the GPU.
  if (thd(p) && !kv_thd(p) && !p.layout.paged && p.is_training)
    return concat("layout ", p.layout.name, " (THD queries, BSHD/SBHD K/V) runs on the GPU for inference only "
                  "(is_training false); its backward is not supported by the CUDA backend");
  if (thd(p)) {
    const std::string r = thd_unsupported_reason(p);
    if (!r.empty()) return r;
  }
  if (p.softmax_type != NVTE_VANILLA_SOFTMAX) {
    const std::string r = sink_unsupported_reason(p);
    if (!r.empty()) return r;
  }
  if (p.bias_type == NVTE_PRE_SCALE_BIAS) return "pre-scale bias is not supported by cuDNN";
  if (p.bias_type == NVTE_ALIBI && p.slopes_b != 0) return "ALiBi with caller-given slopes is not supported on the GPU";
  if (p.bias_type == NVTE_ALIBI && !p.rule.causal) return "cuDNN applies ALiBi only with a causal mask";
  // Windows are cuDNN's diagonal band (>= 9.10; common_options builds it). Those beyond a top-left
  // left one (a bottom-right left bound, a right bound without the causal mask) were checked on the
  // GPU with the vanilla softmax and without bias or dropout only: with those they stay rejected.
  const bool band = (p.rule.window_left >= 0 && bottom_right(p)) || (p.rule.window_right >= 0 && !p.rule.causal);
  if (band && (p.bias_type != NVTE_NO_BIAS || p.dropout > 0.0f || p.softmax_type != NVTE_VANILLA_SOFTMAX))
    return "a window with a bottom-right left bound or a bounded right side takes no bias, ALiBi, dropout or "
           "attention sink on the GPU";
  // K/V caches (paged, or THD queries over BSHD/SBHD K/V) were checked on the GPU with causal
  // windows only: the others stay rejected there.
  if ((p.layout.paged || thd(p) != kv_thd(p)) && windowed(p) && !p.rule.causal)
    return concat("layout ", p.layout.name, " (a K/V cache) takes a window on the GPU with a causal mask only");
  return bottom_right_reason(p);
}

bool sink_rescale(const AttnParams &p) {
  return p.softmax_type != NVTE_VANILLA_SOFTMAX && (p.layout.paged || p.max_sq == 1) && !thd(p) && !kv_thd(p);
}

AttnParams graph_params(const AttnParams &p) {
  AttnParams g = p;
  if (sink_rescale(p)) {  // a vanilla graph whose statistics rescale its output (sink_rescale)
    g.softmax_type = NVTE_VANILLA_SOFTMAX;
    g.is_training = true;
  }
  if (!thd(p)) {
    // cuDNN's bottom-right causal mask takes max_seqlen_q > max_seqlen_kv only with its padding
    // mask (frontend validation): such a call runs the padding graph with every length at its
    // maximum (bind_seqlens).
    // The same for a window's band (either alignment): cuDNN takes it at max_seqlen_q >
    // max_seqlen_kv with the padding mask only.
    if (((p.rule.causal && bottom_right(p)) || windowed(p)) && p.max_sq > p.max_skv) g.padding = true;
    return g;
  }
  g.padding = true;
  // At least 2: with max_seqlen_q 1, cuDNN 9.19's decode kernel writes row 0 of an empty query
  // sequence, which in THD is the next sequence's first token (BSHD zeroes it after the graph:
  // UnusedRows; THD decode steps run as BSHD queries: thd_decode).
  g.max_sq = std::max<size_t>(pow2_at_least(p.max_sq), 2);
  if (kv_thd(p)) g.max_skv = pow2_at_least(p.max_skv);
  const auto per = [](size_t rows, size_t s) { return (rows + s - 1) / s; };
  if (!kv_thd(p) && !p.layout.paged) {  // K/V tensors [b, s] / [s, b]: their batch, one run
    g.batch = std::max<size_t>(p.batch, 1);
    return g;
  }
  // A paged cache's pages are read through the tables, whatever the batch.
  g.batch = pow2_at_least(std::max(per(p.rows_q, g.max_sq), kv_thd(p) ? per(p.rows_kv, g.max_skv) : size_t(0)));
  return g;
}

size_t graph_pages(const AttnParams &p) {
  return p.layout.paged ? (p.max_skv + p.page_size - 1) / p.page_size : 0;
}

bool ragged_padding(const AttnParams &p) {
  // (graph_params' padding: a bottom-right causal call with max_seqlen_q > max_seqlen_kv has it too)
  // (a sink token: cuDNN's ragged backward takes none before 9.26)
  if (!graph_params(p).padding || is_fp8(p.dtype) || p.layout.paged || p.bias_type != NVTE_NO_BIAS || p.max_sq < 2 ||
      p.softmax_type != NVTE_VANILLA_SOFTMAX)
    return false;
  if (p.layout.q_format == NVTE_THD || p.layout.kv_format == NVTE_THD) return false;
  const attn::TensorPlacement *pl[4] = {&p.qkv.t[attn::kQ], &p.qkv.t[attn::kK], &p.qkv.t[attn::kV], &p.out};
  const size_t rows[4] = {p.rows_q, p.rows_kv, p.rows_kv, p.rows_q};
  for (int i = 0; i < 4; ++i)
    if (rows[i] * pl[i]->row_stride >= (size_t(1) << 31)) return false;
  return true;
}

bool thd_decode(const AttnParams &p) {
  return thd(p) && !kv_thd(p) && p.max_sq == 1 && !is_fp8(p.dtype) && p.dropout == 0.0f && !p.return_max_logit;
}

AttnParams decode_view(const AttnParams &p) {
  AttnParams v = p;
  v.layout.q_format = NVTE_BSHD;
  v.qkv.t[attn::kQ] = attn::TensorPlacement{NVTE_BSHD, p.h_q * p.d_qk, p.d_qk, attn::kQ, 0};
  v.out = attn::TensorPlacement{NVTE_BSHD, p.h_q * p.d_v, p.d_v, attn::kQ, 0};
  v.padding = true;  // lengths from cu_seqlens, as THD has them
  if (p.layout.paged) {
    // The workspace queries see no batch (no page tables): the graph takes chunks of a power of two
    // >= the query rows (at least every sequence with a query row), and the tables' used columns.
    v.batch = pow2_at_least(std::max<size_t>(p.rows_q, 1));
    v.pages_per_seq = graph_pages(p);
  }
  v.rows_q = v.batch;
  return v;
}

}  // namespace nvte::cuda::cudnn_attn
