// api/cast.cpp - nvte_quantize* / nvte_dequantize entry points: validate, pick the backend, run.
#include "transformer_engine/cast.h"

#include "../common/backend.h"
#include "../common/config.h"
#include "../cpu/cast.h"

using namespace nvte;

namespace {

void check_quantize_args(const Tensor &in, const Tensor &out) {
  NVTE_CHECK(is_high_precision(logical_dtype(in)), "input must be float32, float16 or bfloat16, got ",
             dtype_name(logical_dtype(in)));
  NVTE_CHECK(numel(logical_shape(in)) == numel(logical_shape(out)), "input shape ",
             shape_str(logical_shape(in)), " and output shape ", shape_str(logical_shape(out)),
             " hold different numbers of elements");
}

// True when a noop flag tensor (float32[1]) holds 1: TE's "skip this cast" signal.
bool noop_set(const NVTETensor noop, Backend b) {
  if (noop == nullptr || noop->params[kNVTERowwiseData].data_ptr == nullptr) return false;
  const NVTEBasicTensor &d = noop->params[kNVTERowwiseData];
  NVTE_CHECK(d.dtype == kNVTEFloat32 && numel(d.shape) >= 1, "noop must be a float32 tensor of one element, got ",
             dtype_name(d.dtype), " ", shape_str(d.shape));
  NVTE_CHECK_SUPPORTED(b == Backend::CPU, "noop tensors on the GPU are handled by the CUDA kernels");
  return *static_cast<const float *>(d.data_ptr) == 1.0f;
}

void run_quantize(const char *op, const NVTETensor input, NVTETensor output, const NVTETensor noop) {
  const Tensor &in = require(input, "input");
  Tensor &out = require_mut(output, "output");
  check_quantize_args(in, out);
  const Backend b = backend_of({{"input", input}, {"output", output}, {"noop", noop}});
  switch (b) {
    case Backend::CPU:
      if (noop_set(noop, b)) return;
      return cpu::quantize(in, out);
    case Backend::CUDA: cuda_not_built(op);
  }
}

}  // namespace

extern "C" {

NVTEStatus nvte_quantize(const NVTETensor input, NVTETensor output, cudaStream_t stream) {
  (void)stream;
  return api_call("nvte_quantize", [&] { run_quantize("nvte_quantize", input, output, nullptr); });
}

NVTEStatus nvte_quantize_noop(const NVTETensor input, NVTETensor output, NVTETensor noop,
                              cudaStream_t stream) {
  (void)stream;
  return api_call("nvte_quantize_noop", [&] { run_quantize("nvte_quantize_noop", input, output, noop); });
}

NVTEStatus nvte_quantize_v2(const NVTETensor input, NVTETensor output,
                            const NVTEQuantizationConfig quant_config, cudaStream_t stream) {
  (void)stream;
  return api_call("nvte_quantize_v2", [&] {
    run_quantize("nvte_quantize_v2", input, output, quant_config ? quant_config->noop_tensor : nullptr);
  });
}

NVTEStatus nvte_dequantize(const NVTETensor input, NVTETensor output, cudaStream_t stream) {
  (void)stream;
  return api_call("nvte_dequantize", [&] {
    const Tensor &in = require(input, "input");
    Tensor &out = require_mut(output, "output");
    NVTE_CHECK(is_fp8(logical_dtype(in)), "input must be FP8, got ", dtype_name(logical_dtype(in)));
    NVTE_CHECK(numel(logical_shape(in)) == numel(logical_shape(out)), "input shape ",
               shape_str(logical_shape(in)), " and output shape ", shape_str(logical_shape(out)),
               " hold different numbers of elements");
    switch (backend_of({{"input", input}, {"output", output}})) {
      case Backend::CPU: return cpu::dequantize(in, out);
      case Backend::CUDA: cuda_not_built("nvte_dequantize");
    }
  });
}

}  // extern "C"
