// api/attn_softmax.cpp - nvte_attn_softmax_{forward,backward}: validate every operand against
// the input's [B, H, Sq, Sk], turn them into attn::SoftmaxArgs (pointers and broadcast
// strides), pick the backend, run.
#include "transformer_engine/softmax.h"

#include <cmath>
#include <string>
#include <utility>

#include "../common/attn_softmax.h"
#include "../common/backend.h"
#include "alias_checks.h"
#include "../cpu/attn_softmax.h"
#ifdef NVTE_WITH_CUDA
#include "../cuda/attn_softmax.h"
#endif

using namespace nvte;
using api::check_alias;
using api::same_buffer;
using attn::SoftmaxArgs;

namespace {

const NVTEBasicTensor &data_of(const Tensor &t, const char *name) {
  const NVTEBasicTensor &b = t.params[kNVTERowwiseData];
  NVTE_CHECK(buffer_set(b), name, " needs rowwise data");
  return b;
}

// A float32/float16/bfloat16 tensor of the given shape.
const NVTEBasicTensor &float_like(const Tensor &t, const char *name, const NVTEShape &want) {
  const NVTEBasicTensor &b = data_of(t, name);
  NVTE_CHECK(is_high_precision(b.dtype), name, " must be float32, float16 or bfloat16, got ", dtype_name(b.dtype));
  const NVTEShape s = logical_shape(t);
  bool same = s.ndim == want.ndim;
  for (size_t k = 0; same && k < s.ndim; ++k) same = s.data[k] == want.data[k];
  NVTE_CHECK(same, name, " has shape ", shape_str(s), "; expected ", shape_str(want));
  return b;
}

const NVTEBasicTensor &exact(const Tensor &t, const char *name, NVTEDType dt, std::initializer_list<size_t> dims) {
  const NVTEBasicTensor &b = data_of(t, name);
  NVTE_CHECK(b.dtype == dt, name, " must be ", dtype_name(dt), ", got ", dtype_name(b.dtype));
  const NVTEShape s = logical_shape(t);
  bool same = s.ndim == dims.size();
  size_t k = 0;
  for (size_t d : dims) same = same && s.data[k++] == d;
  std::string want;
  for (size_t d : dims) want += (want.empty() ? "" : ", ") + std::to_string(d);
  NVTE_CHECK(same, name, " has shape ", shape_str(s), "; expected [", want, "]");
  return b;
}

// [1 or B, 1 or H, Sq, Sk] operand: its buffer and broadcast strides (0 on size-1 dims).
const NVTEBasicTensor &broadcast4(const Tensor &t, const char *name, const SoftmaxArgs &a, size_t *sb, size_t *sh) {
  const NVTEBasicTensor &b = data_of(t, name);
  const NVTEShape s = logical_shape(t);
  NVTE_CHECK(s.ndim == 4 && (s.data[0] == 1 || s.data[0] == a.b) && (s.data[1] == 1 || s.data[1] == a.h) &&
                 s.data[2] == a.sq && s.data[3] == a.sk,
             name, " has shape ", shape_str(s), "; expected [1 or ", a.b, ", 1 or ", a.h, ", ", a.sq, ", ", a.sk, "]");
  *sh = s.data[1] == 1 ? 0 : a.sq * a.sk;
  *sb = s.data[0] == 1 ? 0 : s.data[1] * a.sq * a.sk;
  return b;
}

const Tensor *optional(const NVTETensor t, const char *name) { return present(t) ? &require(t, name) : nullptr; }
Tensor *optional_mut(NVTETensor t, const char *name) { return present(t) ? &require_mut(t, name) : nullptr; }

// Shape [B, H, Sq, Sk] of the data tensor, and the mask's pointer and strides.
SoftmaxArgs base_args(const Tensor &x, const char *name, const Tensor *mask, float scale) {
  const NVTEBasicTensor &xb = data_of(x, name);
  NVTE_CHECK(is_high_precision(xb.dtype), name, " must be float32, float16 or bfloat16, got ", dtype_name(xb.dtype));
  const NVTEShape s = logical_shape(x);
  NVTE_CHECK(s.ndim == 4, name, " has shape ", shape_str(s), "; expected 4D [B, H, Sq, Sk]");
  SoftmaxArgs a;
  a.b = s.data[0];
  a.h = s.data[1];
  a.sq = s.data[2];
  a.sk = s.data[3];
  NVTE_CHECK(std::isfinite(scale), "scale must be finite, got ", scale);
  a.scale = scale;
  if (mask != nullptr) {
    const NVTEBasicTensor &mb = broadcast4(*mask, "mask", a, &a.mask_sb, &a.mask_sh);
    NVTE_CHECK(mb.dtype == kNVTEByte, "mask must be uint8 (kNVTEByte, 1 = hidden), got ", dtype_name(mb.dtype));
    a.mask = static_cast<const uint8_t *>(mb.data_ptr);
  }
  return a;
}

attn::ScoreCausal causal_rule(NVTE_Mask_Type mask_type) {
  switch (mask_type) {
    case NVTE_NO_MASK: return attn::ScoreCausal::None;
    case NVTE_CAUSAL_MASK: return attn::ScoreCausal::TopLeft;
    case NVTE_CAUSAL_BOTTOM_RIGHT_MASK: return attn::ScoreCausal::BottomRight;
    default:
      NVTE_FAIL(NVTE_ERROR_INVALID_ARGUMENT, "mask_type ", (int)mask_type,
                " is not taken: NVTE_NO_MASK, NVTE_CAUSAL_MASK or NVTE_CAUSAL_BOTTOM_RIGHT_MASK (padding and other "
                "masks come as the explicit mask tensor)");
  }
}

void forward(const NVTETensor input, const NVTETensor bias, const NVTETensor alibi_slopes,
             const NVTETensor alibi_diagonal, const NVTETensor mask, const NVTETensor softmax_offset,
             NVTETensor softmax_results, NVTETensor sink_probs, float scale, NVTE_Bias_Type bias_type,
             NVTE_Mask_Type mask_type, cudaStream_t stream) {
  const Tensor &in = require(input, "input");
  SoftmaxArgs a = base_args(in, "input", optional(mask, "mask"), scale);
  Tensor &out = require_mut(softmax_results, "softmax_results");
  const NVTEBasicTensor &ob = float_like(out, "softmax_results", logical_shape(in));
  NVTE_CHECK(ob.dtype == in.params[kNVTERowwiseData].dtype || ob.dtype == kNVTEFloat32,
             "softmax_results must have the input's dtype (", dtype_name(in.params[kNVTERowwiseData].dtype),
             ") or float32, got ", dtype_name(ob.dtype));
  check_alias(out, "softmax_results", in, "input");
  a.causal = causal_rule(mask_type);
  const bool biased = bias_type == NVTE_PRE_SCALE_BIAS || bias_type == NVTE_POST_SCALE_BIAS;
  NVTE_CHECK(bias_type == NVTE_NO_BIAS || biased || bias_type == NVTE_ALIBI, "unknown bias_type ", (int)bias_type);
  a.bias_type = static_cast<attn::ScoreBias>(bias_type);
  NVTE_CHECK(biased == present(bias), biased ? "a pre/post-scale bias_type needs the bias tensor"
                                             : "a bias tensor is given but bias_type takes none");
  if (biased) {
    const NVTEBasicTensor &bb = broadcast4(require(bias, "bias"), "bias", a, &a.bias_sb, &a.bias_sh);
    NVTE_CHECK(is_high_precision(bb.dtype), "bias must be float32, float16 or bfloat16, got ", dtype_name(bb.dtype));
    a.bias = bb.data_ptr;
    a.bias_dtype = bb.dtype;
  }
  const bool alibi = bias_type == NVTE_ALIBI;
  NVTE_CHECK(alibi || (!present(alibi_slopes) && !present(alibi_diagonal)),
             "alibi_slopes / alibi_diagonal are given but bias_type is not NVTE_ALIBI");
  if (alibi) {
    NVTE_CHECK(present(alibi_diagonal), "NVTE_ALIBI needs alibi_diagonal (int64 [1] or [B])");
    const Tensor &d = require(alibi_diagonal, "alibi_diagonal");
    const size_t nd = logical_shape(d).ndim == 1 ? logical_shape(d).data[0] : 0;
    a.diag = static_cast<const int64_t *>(exact(d, "alibi_diagonal", kNVTEInt64, {nd == 1 ? 1 : a.b}).data_ptr);
    a.diag_sb = nd == 1 ? 0 : 1;
    if (const Tensor *sl = optional(alibi_slopes, "alibi_slopes")) {
      const bool per_batch = logical_shape(*sl).ndim == 2;
      a.slopes = static_cast<const float *>(
          (per_batch ? exact(*sl, "alibi_slopes", kNVTEFloat32, {a.b, a.h})
                     : exact(*sl, "alibi_slopes", kNVTEFloat32, {a.h})).data_ptr);
      a.slopes_sb = per_batch ? a.h : 0;
    }
  }
  Tensor *sink = optional_mut(sink_probs, "sink_probs");
  if (const Tensor *off = optional(softmax_offset, "softmax_offset")) {
    a.offset = static_cast<const float *>(exact(*off, "softmax_offset", kNVTEFloat32, {a.h}).data_ptr);
  }
  NVTE_CHECK(sink == nullptr || a.offset != nullptr, "sink_probs is given without softmax_offset");
  if (sink != nullptr) exact(*sink, "sink_probs", kNVTEFloat32, {a.b, a.h, a.sq});
  switch (backend_of({{"input", input}, {"bias", bias}, {"alibi_slopes", alibi_slopes},
                      {"alibi_diagonal", alibi_diagonal}, {"mask", mask}, {"softmax_offset", softmax_offset},
                      {"softmax_results", softmax_results}, {"sink_probs", sink_probs}})) {
    case Backend::CPU:
      return cpu::attn_softmax_forward(a, in, out, sink);
    case Backend::CUDA:
#ifdef NVTE_WITH_CUDA
      return cuda::attn_softmax_forward(a, in, out, sink, stream);
#else
      (void)stream;
      cuda_not_built("nvte_attn_softmax_forward");
#endif
  }
}

void backward(const NVTETensor incoming_grads, const NVTETensor softmax_results, const NVTETensor mask,
              const NVTETensor sink_probs, NVTETensor output_grads, NVTETensor logit_grads, NVTETensor offset_grads,
              float scale, NVTE_Mask_Type mask_type, cudaStream_t stream) {
  const Tensor &y = require(softmax_results, "softmax_results");
  SoftmaxArgs a = base_args(y, "softmax_results", optional(mask, "mask"), scale);
  a.causal = causal_rule(mask_type);
  const NVTEShape shape = logical_shape(y);
  const Tensor &dy = require(incoming_grads, "incoming_grads");
  float_like(dy, "incoming_grads", shape);
  Tensor &dx = require_mut(output_grads, "output_grads");
  float_like(dx, "output_grads", shape);
  check_alias(dx, "output_grads", dy, "incoming_grads");
  check_alias(dx, "output_grads", y, "softmax_results");
  Tensor *lg = optional_mut(logit_grads, "logit_grads");
  if (lg != nullptr) {
    float_like(*lg, "logit_grads", shape);
    check_alias(*lg, "logit_grads", dy, "incoming_grads");
    check_alias(*lg, "logit_grads", y, "softmax_results");
    NVTE_CHECK(!same_buffer(*lg, dx), "logit_grads and output_grads must be different buffers");
  }
  Tensor *dsink = optional_mut(offset_grads, "offset_grads");
  const Tensor *sink = optional(sink_probs, "sink_probs");
  NVTE_CHECK(dsink == nullptr || sink != nullptr, "offset_grads needs sink_probs (the forward's)");
  if (sink != nullptr) exact(*sink, "sink_probs", kNVTEFloat32, {a.b, a.h, a.sq});
  if (dsink != nullptr) exact(*dsink, "offset_grads", kNVTEFloat32, {a.b, a.h, a.sq});
  switch (backend_of({{"incoming_grads", incoming_grads}, {"softmax_results", softmax_results}, {"mask", mask},
                      {"sink_probs", sink_probs}, {"output_grads", output_grads}, {"logit_grads", logit_grads},
                      {"offset_grads", offset_grads}})) {
    case Backend::CPU: return cpu::attn_softmax_backward(a, dy, y, dsink ? sink : nullptr, dx, lg, dsink);
    case Backend::CUDA:
#ifdef NVTE_WITH_CUDA
      return cuda::attn_softmax_backward(a, dy, y, dsink ? sink : nullptr, dx, lg, dsink, stream);
#else
      (void)stream;
      cuda_not_built("nvte_attn_softmax_backward");
#endif
  }
}

}  // namespace

extern "C" {

NVTEStatus nvte_attn_softmax_forward(const NVTETensor input, const NVTETensor bias, const NVTETensor alibi_slopes,
                                     const NVTETensor alibi_diagonal, const NVTETensor mask,
                                     const NVTETensor softmax_offset, NVTETensor softmax_results,
                                     NVTETensor sink_probs, float scale_factor, NVTE_Bias_Type bias_type,
                                     NVTE_Mask_Type mask_type, cudaStream_t stream) {
  return api_call("nvte_attn_softmax_forward", [&] {
    forward(input, bias, alibi_slopes, alibi_diagonal, mask, softmax_offset, softmax_results, sink_probs,
            scale_factor, bias_type, mask_type, stream);
  });
}

NVTEStatus nvte_attn_softmax_backward(const NVTETensor incoming_grads, const NVTETensor softmax_results,
                                      const NVTETensor mask, const NVTETensor sink_probs, NVTETensor output_grads,
                                      NVTETensor logit_grads, NVTETensor offset_grads, float scale_factor,
                                      NVTE_Mask_Type mask_type, cudaStream_t stream) {
  return api_call("nvte_attn_softmax_backward", [&] {
    backward(incoming_grads, softmax_results, mask, sink_probs, output_grads, logit_grads, offset_grads,
             scale_factor, mask_type, stream);
  });
}

}  // extern "C"
