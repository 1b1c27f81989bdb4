// api/cast.cpp - nvte_quantize* / nvte_dequantize entry points: validate, pick the backend, run.
// Also defines the shared runners declared in runners.h.
#include "transformer_engine/cast.h"

#include <optional>

#include "../common/backend.h"
#include "../common/config.h"
#include "../cpu/cast.h"
#include "runners.h"

namespace nvte::api {

bool noop_set(const NVTETensor noop, Backend b) {
  if (noop == nullptr || noop->params[kNVTERowwiseData].data_ptr == nullptr) return false;
  const NVTEBasicTensor &d = noop->params[kNVTERowwiseData];
  NVTE_CHECK(d.dtype == kNVTEFloat32 && numel(d.shape) >= 1, "noop must be a float32 tensor of one element, got ",
             dtype_name(d.dtype), " ", shape_str(d.shape));
  NVTE_CHECK_SUPPORTED(b == Backend::CPU, "noop tensors on the GPU are handled by the CUDA kernels");
  return *static_cast<const float *>(d.data_ptr) == 1.0f;
}

namespace {

void check_same_numel(const Tensor &in, const char *in_name, const Tensor &out, const char *out_name) {
  NVTE_CHECK(numel(logical_shape(in)) == numel(logical_shape(out)), in_name, " shape ",
             shape_str(logical_shape(in)), " and ", out_name, " shape ", shape_str(logical_shape(out)),
             " hold different numbers of elements");
}

void check_high_precision(const Tensor &t, const char *name) {
  NVTE_CHECK(is_high_precision(logical_dtype(t)), name, " must be float32, float16 or bfloat16, got ",
             dtype_name(logical_dtype(t)));
}

}  // namespace

void run_quantize(const char *op, const NVTETensor input, NVTETensor output, const NVTETensor noop) {
  const Tensor &in = require(input, "input");
  Tensor &out = require_mut(output, "output");
  check_high_precision(in, "input");
  check_same_numel(in, "input", out, "output");
  const Backend b = backend_of({{"input", input}, {"output", output}, {"noop", noop}});
  switch (b) {
    case Backend::CPU:
      if (noop_set(noop, b)) return;
      return cpu::quantize(in, out);
    case Backend::CUDA: cuda_not_built(op);
  }
}

void run_quantize_dbias(const char *op, const NVTETensor input, const NVTETensor act_input,
                        NVTETensor output, NVTETensor dbias, NVTETensor workspace,
                        std::optional<Act> act) {
  const Tensor &in = require(input, "input");
  check_high_precision(in, "input");
  const Dims2 d = flat2d(logical_shape(in));
  const Tensor *act_in = nullptr;
  if (act) {
    act_in = &require(act_input, "act_input");
    check_high_precision(*act_in, "act_input");
    const Dims2 da = flat2d(logical_shape(*act_in));
    NVTE_CHECK(da.rows == d.rows && da.cols == d.cols, "act_input shape ", shape_str(logical_shape(*act_in)),
               " differs from input shape ", shape_str(logical_shape(in)));
  }
  Tensor &out = require_mut(output, "output");
  check_same_numel(in, "input", out, "output");
  Tensor &db = require_mut(dbias, "dbias");
  NVTE_CHECK(buffer_set(db.params[kNVTERowwiseData]), "dbias needs rowwise data");
  check_high_precision(db, "dbias");
  const NVTEShape dbs = db.params[kNVTERowwiseData].shape;
  const Dims2 dd = flat2d(dbs);
  NVTE_CHECK(dbs.ndim >= 1 && dd.rows == 1 && dd.cols == d.cols, "dbias has shape ", shape_str(dbs),
             "; expected [", d.cols, "] (the last dim of input ", shape_str(logical_shape(in)), ")");
  // The CPU backend needs no workspace, so it always computes (workspace may be NULL or empty).
  switch (backend_of({{"input", input}, {"act_input", act ? act_input : nullptr}, {"output", output},
                      {"dbias", dbias}, {"workspace", workspace}})) {
    case Backend::CPU: return cpu::quantize_dbias(in, act_in, act, out, db);
    case Backend::CUDA: cuda_not_built(op);
  }
}

}  // namespace nvte::api

using namespace nvte;
using nvte::api::run_quantize;
using nvte::api::run_quantize_dbias;

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

NVTEStatus nvte_quantize_dbias(const NVTETensor input, NVTETensor output, NVTETensor dbias,
                               NVTETensor workspace, cudaStream_t stream) {
  (void)stream;
  return api_call("nvte_quantize_dbias", [&] {
    run_quantize_dbias("nvte_quantize_dbias", input, nullptr, output, dbias, workspace, std::nullopt);
  });
}

NVTEStatus nvte_quantize_dbias_workspace_size(const NVTETensor input, size_t *bytes) {
  return api_call("nvte_quantize_dbias_workspace_size", [&] {
    NVTE_CHECK(bytes != nullptr, "bytes is NULL");
    require(input, "input");
    switch (backend_of({{"input", input}})) {
      case Backend::CPU: *bytes = 0; return;
      case Backend::CUDA: cuda_not_built("nvte_quantize_dbias_workspace_size");
    }
  });
}

#define NVTE_DEFINE_QUANTIZE_DBIAS_DACT(name, act)                                                   \
  NVTEStatus nvte_quantize_dbias_##name(const NVTETensor input, const NVTETensor act_input,          \
                                        NVTETensor output, NVTETensor dbias, NVTETensor workspace,   \
                                        cudaStream_t stream) {                                       \
    (void)stream;                                                                                    \
    return api_call("nvte_quantize_dbias_" #name, [&] {                                              \
      run_quantize_dbias("nvte_quantize_dbias_" #name, input, act_input, output, dbias, workspace,   \
                         act);                                                                       \
    });                                                                                              \
  }

NVTE_DEFINE_QUANTIZE_DBIAS_DACT(dgelu, Act::GELU)
NVTE_DEFINE_QUANTIZE_DBIAS_DACT(drelu, Act::ReLU)
NVTE_DEFINE_QUANTIZE_DBIAS_DACT(dsilu, Act::SiLU)
NVTE_DEFINE_QUANTIZE_DBIAS_DACT(dqgelu, Act::QGELU)
NVTE_DEFINE_QUANTIZE_DBIAS_DACT(dsrelu, Act::SReLU)
#undef NVTE_DEFINE_QUANTIZE_DBIAS_DACT

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
