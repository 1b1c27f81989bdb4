// api/cast.cpp - nvte_quantize* / nvte_dequantize entry points: validate, pick the backend, run.
// Also defines the shared runners declared in runners.h.
#include "transformer_engine/cast.h"

#include <optional>

#include "../common/backend.h"
#include "../common/config.h"
#include "../cpu/cast.h"
#include "alias_checks.h"
#include "runners.h"
#ifdef NVTE_WITH_CUDA
#include "../cuda/cast.h"
#endif

namespace nvte::api {

// No noop tensor: a NULL handle or one without data. A data-less one that names elements is an
// error (as for any input), not "no noop": the caller meant a flag that is not there.
bool noop_absent(const NVTETensor noop) {
  if (noop == nullptr) return true;
  const NVTEBasicTensor &d = noop->params[kNVTERowwiseData];
  if (d.data_ptr != nullptr) return false;
  NVTE_CHECK(numel(d.shape) == 0 || d.shape.ndim == 0, "noop's rowwise data pointer is NULL but its shape ",
             shape_str(d.shape), " has ", numel(d.shape), " elements");
  return true;
}

bool noop_set(const NVTETensor noop, Backend b) {
  if (noop_absent(noop)) return false;
  const NVTEBasicTensor &d = noop->params[kNVTERowwiseData];
  NVTE_CHECK(d.dtype == kNVTEFloat32 && numel(d.shape) >= 1, "noop must be a float32 tensor of one element, got ",
             dtype_name(d.dtype), " ", shape_str(d.shape));
  NVTE_CHECK_SUPPORTED(b == Backend::CPU, "noop tensors on the GPU are handled by the CUDA kernels");
  return *static_cast<const float *>(d.data_ptr) == 1.0f;
}

const float *noop_ptr(const NVTETensor noop) {
  if (noop_absent(noop)) return nullptr;
  const NVTEBasicTensor &d = noop->params[kNVTERowwiseData];
  NVTE_CHECK(d.dtype == kNVTEFloat32 && numel(d.shape) >= 1, "noop must be a float32 tensor of one element, got ",
             dtype_name(d.dtype), " ", shape_str(d.shape));
  return static_cast<const float *>(d.data_ptr);
}

void check_output(const Tensor &out, const char *name, size_t rows, size_t cols) {
  const NVTEBasicTensor &rb = out.params[kNVTERowwiseData];
  const NVTEBasicTensor &cb = out.params[kNVTEColumnwiseData];
  NVTE_CHECK(buffer_set(rb) || buffer_set(cb), name, " has no data buffer");
  const NVTEDType dtype = buffer_set(rb) ? rb.dtype : cb.dtype;
  NVTE_CHECK(is_high_precision(dtype) || is_fp8(dtype), name, " has dtype ", dtype_name(dtype),
             "; expected float32, float16, bfloat16 or FP8");
  if (buffer_set(rb)) {
    const Dims2 d = flat2d(rb.shape);
    NVTE_CHECK(d.rows == rows && d.cols == cols, name, " has shape ", shape_str(rb.shape), " (2D view [", d.rows,
               ", ", d.cols, "]); expected [", rows, ", ", cols, "]");
  }
  if (buffer_set(cb)) {
    NVTE_CHECK(cb.dtype == dtype, name, " columnwise dtype ", dtype_name(cb.dtype), " differs from rowwise dtype ",
               dtype_name(dtype));
    NVTE_CHECK(numel(cb.shape) == rows * cols && (cb.shape.ndim == 0 || rows * cols == 0 || cb.shape.data[0] == cols),
               name, " columnwise data has shape ", shape_str(cb.shape), "; expected [", cols, ", ", rows,
               "] (the transpose)");
  }
  scalar_param(out, kNVTEAmax, name);
  if (is_fp8(dtype)) {
    NVTE_CHECK(scalar_param(out, kNVTEScale, name) != nullptr, name, " is FP8 (", dtype_name(dtype),
               ") but has no scale");
    scalar_param(out, kNVTERowwiseScaleInv, name);
    scalar_param(out, kNVTEColumnwiseScaleInv, name);
  }
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

void run_quantize(const char *op, const NVTETensor input, NVTETensor output, const NVTETensor noop,
                  cudaStream_t stream) {
  const Tensor &in = require(input, "input");
  Tensor &out = require_mut(output, "output");
  check_high_precision(in, "input");
  check_same_numel(in, "input", out, "output");
  // Rowwise output exactly over the input (a same-dtype cast) is elementwise; a columnwise
  // (transposed) output never may share the input's memory.
  check_alias(out, "output", in, "input");
  const Backend b = backend_of({{"input", input}, {"output", output}, {"noop", noop}});
  switch (b) {
    case Backend::CPU:
      if (noop_set(noop, b)) return;
      return cpu::quantize(in, out);
    case Backend::CUDA: {
#ifdef NVTE_WITH_CUDA
      NVTE_CHECK(buffer_set(in.params[kNVTERowwiseData]), "input needs rowwise data");
      const Dims2 d = flat2d(in.params[kNVTERowwiseData].shape);
      check_output(out, "output", d.rows, d.cols);
      return cuda::quantize(in, out, noop_ptr(noop), stream);
#else
      cuda_not_built(op);
#endif
    }
  }
}

void run_quantize_dbias(const char *op, const NVTETensor input, const NVTETensor act_input,
                        NVTETensor output, NVTETensor dbias, NVTETensor workspace,
                        std::optional<Act> act, cudaStream_t stream) {
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
  // Every row reads input and act_input before its output row is written (in place is fine);
  // dbias is a reduction over all rows, so it shares no memory with any of them.
  check_alias(out, "output", in, "input");
  if (act_in) check_alias(out, "output", *act_in, "act_input");
  check_disjoint(db, "dbias", in, "input", "dbias is a sum over all rows of input");
  if (act_in) check_disjoint(db, "dbias", *act_in, "act_input", "dbias is a sum over all rows of act_input");
  check_disjoint(db, "dbias", out, "output", "dbias and output are separate results");
  // The CPU backend needs no workspace, so it always computes (workspace may be NULL or empty).
  switch (backend_of({{"input", input}, {"act_input", act ? act_input : nullptr}, {"output", output},
                      {"dbias", dbias}, {"workspace", workspace}})) {
    case Backend::CPU: return cpu::quantize_dbias(in, act_in, act, out, db);
    case Backend::CUDA: {
#ifdef NVTE_WITH_CUDA
      NVTE_CHECK(buffer_set(in.params[kNVTERowwiseData]), "input needs rowwise data");
      if (act) NVTE_CHECK(buffer_set(act_in->params[kNVTERowwiseData]), "act_input needs rowwise data");
      check_output(out, "output", d.rows, d.cols);
      // TE's workspace convention: a workspace without memory is a size query.
      const size_t bytes = cuda::dbias_workspace_bytes(d.rows, d.cols);
      void *ws = nullptr;
      if (bytes > 0) {
        NVTE_CHECK(workspace != nullptr, op, " needs a workspace of ", bytes,
                   " bytes on the GPU (pass a workspace tensor without data to query its size)");
        NVTEBasicTensor &w = workspace->params[kNVTERowwiseData];
        if (w.data_ptr == nullptr) {
          w.shape.ndim = 1;
          w.shape.data[0] = bytes;
          w.dtype = kNVTEByte;
          return;
        }
        const size_t have = numel(w.shape) * dtype_size(w.dtype);
        NVTE_CHECK(have >= bytes, "workspace holds ", have, " bytes (shape ", shape_str(w.shape), ", ",
                   dtype_name(w.dtype), "); ", op, " needs ", bytes);
        ws = w.data_ptr;
      }
      return cuda::quantize_dbias(in, act_in, act, out, db, ws, stream);
#else
      cuda_not_built(op);
#endif
    }
  }
}

}  // namespace nvte::api

using namespace nvte;
using nvte::api::run_quantize;
using nvte::api::run_quantize_dbias;

extern "C" {

NVTEStatus nvte_quantize(const NVTETensor input, NVTETensor output, cudaStream_t stream) {
  return api_call("nvte_quantize", [&] { run_quantize("nvte_quantize", input, output, nullptr, stream); });
}

NVTEStatus nvte_quantize_noop(const NVTETensor input, NVTETensor output, NVTETensor noop,
                              cudaStream_t stream) {
  return api_call("nvte_quantize_noop", [&] { run_quantize("nvte_quantize_noop", input, output, noop, stream); });
}

NVTEStatus nvte_quantize_v2(const NVTETensor input, NVTETensor output,
                            const NVTEQuantizationConfig quant_config, cudaStream_t stream) {
  return api_call("nvte_quantize_v2", [&] {
    run_quantize("nvte_quantize_v2", input, output, quant_config ? quant_config->noop_tensor : nullptr, stream);
  });
}

NVTEStatus nvte_quantize_dbias(const NVTETensor input, NVTETensor output, NVTETensor dbias,
                               NVTETensor workspace, cudaStream_t stream) {
  return api_call("nvte_quantize_dbias", [&] {
    run_quantize_dbias("nvte_quantize_dbias", input, nullptr, output, dbias, workspace, std::nullopt, stream);
  });
}

NVTEStatus nvte_quantize_dbias_workspace_size(const NVTETensor input, size_t *bytes) {
  return api_call("nvte_quantize_dbias_workspace_size", [&] {
    NVTE_CHECK(bytes != nullptr, "bytes is NULL");
    require(input, "input");
    switch (backend_of({{"input", input}})) {
      case Backend::CPU: *bytes = 0; return;
      case Backend::CUDA: {
#ifdef NVTE_WITH_CUDA
        const Dims2 d = flat2d(logical_shape(*input));
        *bytes = cuda::dbias_workspace_bytes(d.rows, d.cols);
        return;
#else
        cuda_not_built("nvte_quantize_dbias_workspace_size");
#endif
      }
    }
  });
}

#define NVTE_DEFINE_QUANTIZE_DBIAS_DACT(name, act)                                                   \
  NVTEStatus nvte_quantize_dbias_##name(const NVTETensor input, const NVTETensor act_input,          \
                                        NVTETensor output, NVTETensor dbias, NVTETensor workspace,   \
                                        cudaStream_t stream) {                                       \
    return api_call("nvte_quantize_dbias_" #name, [&] {                                              \
      run_quantize_dbias("nvte_quantize_dbias_" #name, input, act_input, output, dbias, workspace,   \
                         act, stream);                                                               \
    });                                                                                              \
  }

NVTE_DEFINE_QUANTIZE_DBIAS_DACT(dgelu, Act::GELU)
NVTE_DEFINE_QUANTIZE_DBIAS_DACT(drelu, Act::ReLU)
NVTE_DEFINE_QUANTIZE_DBIAS_DACT(dsilu, Act::SiLU)
NVTE_DEFINE_QUANTIZE_DBIAS_DACT(dqgelu, Act::QGELU)
NVTE_DEFINE_QUANTIZE_DBIAS_DACT(dsrelu, Act::SReLU)
#undef NVTE_DEFINE_QUANTIZE_DBIAS_DACT

NVTEStatus nvte_dequantize(const NVTETensor input, NVTETensor output, cudaStream_t stream) {
  return api_call("nvte_dequantize", [&] {
    const Tensor &in = require(input, "input");
    Tensor &out = require_mut(output, "output");
    NVTE_CHECK(is_fp8(logical_dtype(in)), "input must be FP8, got ", dtype_name(logical_dtype(in)));
    NVTE_CHECK(numel(logical_shape(in)) == numel(logical_shape(out)), "input shape ",
               shape_str(logical_shape(in)), " and output shape ", shape_str(logical_shape(out)),
               " hold different numbers of elements");
    // (FP8 in, float32/16 out: an output over the input always has another dtype, so is refused)
    api::check_alias(out, "output", in, "input");
    switch (backend_of({{"input", input}, {"output", output}})) {
      case Backend::CPU: return cpu::dequantize(in, out);
      case Backend::CUDA: {
#ifdef NVTE_WITH_CUDA
        NVTE_CHECK(is_high_precision(logical_dtype(out)), "output must be float32, float16 or bfloat16, got ",
                   dtype_name(logical_dtype(out)));
        const Dims2 d = flat2d(logical_shape(in));
        api::check_output(out, "output", d.rows, d.cols);
        return cuda::dequantize(in, out, stream);
#else
        cuda_not_built("nvte_dequantize");
#endif
      }
    }
  });
}

}  // extern "C"
