// api/softmax.cpp - nvte_scaled*_softmax_{forward,backward} entry points: validate the shape
// rule of each mask family, pick the backend, run. All families share one forward and one
// backward CPU routine (cpu/softmax.h).
#include "transformer_engine/softmax.h"

#include <cmath>

#include "../common/backend.h"
#include "alias_checks.h"
#include "../cpu/softmax.h"
#ifdef NVTE_WITH_CUDA
#include "../cuda/softmax.h"
#endif

using namespace nvte;
using api::check_alias;
using cpu::SoftmaxMask;

namespace {

const Tensor &require_float(const NVTETensor t, const char *name) {
  const Tensor &r = require(t, name);
  const NVTEDType d = logical_dtype(r);
  NVTE_CHECK(is_high_precision(d), name, " must be float32, float16 or bfloat16, got ", dtype_name(d));
  return r;
}

bool same_shape(const NVTEShape &a, const NVTEShape &b) {
  if (a.ndim != b.ndim) return false;
  for (size_t i = 0; i < a.ndim; ++i)
    if (a.data[i] != b.data[i]) return false;
  return true;
}

void check_same_shape(const Tensor &t, const char *name, const Tensor &ref, const char *ref_name) {
  const NVTEShape s = logical_shape(t), r = logical_shape(ref);
  NVTE_CHECK(same_shape(s, r), name, " has shape ", shape_str(s), " but ", ref_name, " has shape ",
             shape_str(r), "; they must match");
}

// The shape rule of each family, for the data tensor (input, or softmax_results in backward).
void check_family_shape(SoftmaxMask kind, const Tensor &t, const char *name) {
  NVTE_CHECK(buffer_set(t.params[kNVTERowwiseData]), name, " needs rowwise data (row-major [..., Sk])");
  const NVTEShape s = logical_shape(t);
  switch (kind) {
    case SoftmaxMask::None:
      NVTE_CHECK(s.ndim >= 2, name, " has shape ", shape_str(s),
                 "; expected rank >= 2 (softmax over the last dim)");
      break;
    case SoftmaxMask::Explicit:
    case SoftmaxMask::AlignedCausal:
      NVTE_CHECK(s.ndim == 4, name, " has shape ", shape_str(s), "; expected 4D [B, H, Sq, Sk]");
      break;
    case SoftmaxMask::UpperTriang:
      NVTE_CHECK(s.ndim == 3 && s.data[1] == s.data[2], name, " has shape ", shape_str(s),
                 "; expected 3D [batches, S, S] (square in the last two dims)");
      break;
  }
}

void check_mask(const Tensor &m, const Tensor &in) {
  const NVTEShape ms = logical_shape(m), is = logical_shape(in);
  NVTE_CHECK(logical_dtype(m) == kNVTEByte, "mask must be uint8 (kNVTEByte, 1 = masked), got ",
             dtype_name(logical_dtype(m)));
  NVTE_CHECK(buffer_set(m.params[kNVTERowwiseData]), "mask needs rowwise data");
  NVTE_CHECK(ms.ndim == 4 && (ms.data[0] == is.data[0] || ms.data[0] == 1) && ms.data[1] == 1 &&
                 ms.data[2] == is.data[2] && ms.data[3] == is.data[3],
             "mask has shape ", shape_str(ms), "; for input ", shape_str(is), " expected [", is.data[0],
             " or 1, 1, ", is.data[2], ", ", is.data[3], "]");
}

void run_forward(const char *op, SoftmaxMask kind, const NVTETensor input, const NVTETensor mask,
                 NVTETensor softmax_results, float scale, cudaStream_t stream) {
  const Tensor &in = require_float(input, "input");
  Tensor &out = const_cast<Tensor &>(require_float(softmax_results, "softmax_results"));
  check_family_shape(kind, in, "input");
  check_same_shape(out, "softmax_results", in, "input");
  check_alias(out, "softmax_results", in, "input");
  NVTE_CHECK(std::isfinite(scale), "scale must be finite, got ", scale);
  const Tensor *m = nullptr;
  if (kind == SoftmaxMask::Explicit) {
    m = &require(mask, "mask");
    check_mask(*m, in);
  }
  switch (backend_of({{"input", input}, {"mask", mask}, {"softmax_results", softmax_results}})) {
    case Backend::CPU: return cpu::softmax_forward(kind, in, m, out, scale);
    case Backend::CUDA:
#ifdef NVTE_WITH_CUDA
      return cuda::softmax_forward(kind, in, m, out, scale, stream);
#else
          cuda_not_built(op);
#endif
  }
}

void run_backward(const char *op, SoftmaxMask kind, const NVTETensor incoming_grads,
                  const NVTETensor softmax_results, NVTETensor output_grads, float scale, cudaStream_t stream) {
  const Tensor &dy = require_float(incoming_grads, "incoming_grads");
  const Tensor &y = require_float(softmax_results, "softmax_results");
  Tensor &dx = const_cast<Tensor &>(require_float(output_grads, "output_grads"));
  check_family_shape(kind, y, "softmax_results");
  check_family_shape(kind, dy, "incoming_grads");
  check_same_shape(dy, "incoming_grads", y, "softmax_results");
  check_same_shape(dx, "output_grads", y, "softmax_results");
  check_alias(dx, "output_grads", dy, "incoming_grads");
  check_alias(dx, "output_grads", y, "softmax_results");
  NVTE_CHECK(std::isfinite(scale), "scale must be finite, got ", scale);
  switch (backend_of({{"incoming_grads", incoming_grads},
                      {"softmax_results", softmax_results},
                      {"output_grads", output_grads}})) {
    case Backend::CPU: return cpu::softmax_backward(dy, y, dx, scale);
    case Backend::CUDA:
#ifdef NVTE_WITH_CUDA
      return cuda::softmax_backward(dy, y, dx, scale, stream);
#else
          cuda_not_built(op);
#endif
  }
}

}  // namespace

extern "C" {

NVTEStatus nvte_scaled_softmax_forward(const NVTETensor input, NVTETensor softmax_results,
                                       float scale_factor, cudaStream_t stream) {
  const char *op = "nvte_scaled_softmax_forward";
  return api_call(op, [&] { run_forward(op, SoftmaxMask::None, input, nullptr, softmax_results, scale_factor, stream); });
}

NVTEStatus nvte_scaled_softmax_backward(const NVTETensor incoming_grads, const NVTETensor softmax_results,
                                        NVTETensor output_grads, float scale_factor, cudaStream_t stream) {
  const char *op = "nvte_scaled_softmax_backward";
  return api_call(op, [&] {
    run_backward(op, SoftmaxMask::None, incoming_grads, softmax_results, output_grads, scale_factor, stream);
  });
}

NVTEStatus nvte_scaled_masked_softmax_forward(const NVTETensor input, const NVTETensor mask,
                                              NVTETensor softmax_results, float scale_factor,
                                              cudaStream_t stream) {
  const char *op = "nvte_scaled_masked_softmax_forward";
  return api_call(op, [&] { run_forward(op, SoftmaxMask::Explicit, input, mask, softmax_results, scale_factor, stream); });
}

NVTEStatus nvte_scaled_masked_softmax_backward(const NVTETensor incoming_grads, const NVTETensor softmax_results,
                                               NVTETensor output_grads, float scale_factor, cudaStream_t stream) {
  const char *op = "nvte_scaled_masked_softmax_backward";
  return api_call(op, [&] {
    run_backward(op, SoftmaxMask::Explicit, incoming_grads, softmax_results, output_grads, scale_factor, stream);
  });
}

NVTEStatus nvte_scaled_upper_triang_masked_softmax_forward(const NVTETensor input, NVTETensor softmax_results,
                                                           float scale_factor, cudaStream_t stream) {
  const char *op = "nvte_scaled_upper_triang_masked_softmax_forward";
  return api_call(op, [&] {
    run_forward(op, SoftmaxMask::UpperTriang, input, nullptr, softmax_results, scale_factor, stream);
  });
}

NVTEStatus nvte_scaled_upper_triang_masked_softmax_backward(const NVTETensor incoming_grads,
                                                            const NVTETensor softmax_results,
                                                            NVTETensor output_grads, float scale_factor,
                                                            cudaStream_t stream) {
  const char *op = "nvte_scaled_upper_triang_masked_softmax_backward";
  return api_call(op, [&] {
    run_backward(op, SoftmaxMask::UpperTriang, incoming_grads, softmax_results, output_grads, scale_factor, stream);
  });
}

NVTEStatus nvte_scaled_aligned_causal_masked_softmax_forward(const NVTETensor input, NVTETensor softmax_results,
                                                             float scale_factor, cudaStream_t stream) {
  const char *op = "nvte_scaled_aligned_causal_masked_softmax_forward";
  return api_call(op, [&] {
    run_forward(op, SoftmaxMask::AlignedCausal, input, nullptr, softmax_results, scale_factor, stream);
  });
}

NVTEStatus nvte_scaled_aligned_causal_masked_softmax_backward(const NVTETensor incoming_grads,
                                                              const NVTETensor softmax_results,
                                                              NVTETensor output_grads, float scale_factor,
                                                              cudaStream_t stream) {
  const char *op = "nvte_scaled_aligned_causal_masked_softmax_backward";
  return api_call(op, [&] {
    run_backward(op, SoftmaxMask::AlignedCausal, incoming_grads, softmax_results, output_grads, scale_factor, stream);
  });
}

}  // extern "C"
