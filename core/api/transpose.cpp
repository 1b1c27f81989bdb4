// api/transpose.cpp - nvte_transpose and the cast + transpose family: validate, pick the backend, run.
#include "transformer_engine/transpose.h"

#include <optional>
#include <string>
#include <vector>

#include "../common/activation_math.h"
#include "../common/backend.h"
#include "../cpu/cast.h"
#include "alias_checks.h"
#include "runners.h"
#include "../cpu/rows.h"
#include "../cpu/transpose.h"
#ifdef NVTE_WITH_CUDA
#include "../cuda/cast.h"
#include "../cuda/transpose.h"
#endif

using namespace nvte;
using nvte::api::run_quantize;
using nvte::api::run_quantize_dbias;

namespace {

void run_transpose(const NVTETensor input, NVTETensor transposed_output, cudaStream_t stream) {
  const Tensor &in = require(input, "input");
  Tensor &out = require_mut(transposed_output, "transposed_output");
  const NVTEBasicTensor &src = in.params[kNVTERowwiseData];
  const NVTEBasicTensor &dst = out.params[kNVTERowwiseData];
  NVTE_CHECK(buffer_set(src), "input needs rowwise data");
  NVTE_CHECK(buffer_set(dst), "transposed_output needs rowwise data");
  NVTE_CHECK(src.dtype == dst.dtype, "input dtype ", dtype_name(src.dtype), " differs from transposed_output dtype ",
             dtype_name(dst.dtype));
  NVTE_CHECK_SUPPORTED(src.dtype != kNVTEFloat4E2M1, "transpose of ", dtype_name(src.dtype),
                       " (two values per byte) is not supported");
  const Dims2 d = flat2d(src.shape);
  NVTE_CHECK(dst.shape.ndim >= 1 && dst.shape.data[0] == d.cols && numel(dst.shape) == d.rows * d.cols,
             "transposed_output has shape ", shape_str(dst.shape), "; expected [", d.cols, ", ", d.rows,
             "] (input shape ", shape_str(src.shape), " transposed)");
  api::check_disjoint(out, "transposed_output", in, "input",
                      "a transpose cannot run in place or over part of its input");
  switch (backend_of({{"input", input}, {"transposed_output", transposed_output}})) {
    case Backend::CPU: return cpu::transpose(in, out);
    case Backend::CUDA:
#ifdef NVTE_WITH_CUDA
      return cuda::transpose(in, out, stream);
#else
      cuda_not_built("nvte_transpose");
#endif
  }
}

void run_multi_cast_transpose(size_t n, const NVTETensor *inputs, NVTETensor *outputs, cudaStream_t stream) {
  if (n == 0) return;
  NVTE_CHECK(inputs != nullptr && outputs != nullptr, "input_list or output_list is NULL with num_tensors = ", n);
  std::vector<std::string> names;
  names.reserve(2 * n);
  std::vector<NamedTensor> all;
  for (size_t i = 0; i < n; ++i) {
    names.push_back("input_list[" + std::to_string(i) + "]");
    names.push_back("output_list[" + std::to_string(i) + "]");
  }
  // Every pair is validated before anything is written, so a bad pair leaves all outputs untouched.
  for (size_t i = 0; i < n; ++i) {
    const char *in_name = names[2 * i].c_str(), *out_name = names[2 * i + 1].c_str();
    const Tensor &in = require(inputs[i], in_name);
    const Tensor &out = require(outputs[i], out_name);
    NVTE_CHECK(is_high_precision(logical_dtype(in)), in_name, " must be float32, float16 or bfloat16, got ",
               dtype_name(logical_dtype(in)));
    NVTE_CHECK(buffer_set(in.params[kNVTERowwiseData]), in_name, " needs rowwise data");
    NVTE_CHECK(numel(logical_shape(in)) == numel(logical_shape(out)), in_name, " shape ",
               shape_str(logical_shape(in)), " and ", out_name, " shape ", shape_str(logical_shape(out)),
               " hold different numbers of elements");
    all.push_back({in_name, inputs[i]});
    all.push_back({out_name, outputs[i]});
  }
  // Memory: each output may be exactly its own input (a same-dtype rowwise cast); it shares no
  // byte with another pair's input (the pairs run one after another) or with another output.
  for (size_t i = 0; i < n; ++i) {
    const char *out_name = names[2 * i + 1].c_str();
    for (size_t j = 0; j < n; ++j) {
      if (j == i) {
        api::check_alias(*outputs[i], out_name, *inputs[i], names[2 * i].c_str());
      } else {
        api::check_disjoint(*outputs[i], out_name, *inputs[j], names[2 * j].c_str(),
                            "an output may only overlap its own input");
        if (j > i)
          api::check_disjoint(*outputs[i], out_name, *outputs[j], names[2 * j + 1].c_str(),
                              "two outputs cannot share memory");
      }
    }
  }
  switch (backend_of(all.data(), all.size())) {
    case Backend::CPU:
      for (size_t i = 0; i < n; ++i) {
        const Dims2 d = flat2d(inputs[i]->params[kNVTERowwiseData].shape);
        cpu::OutputRows check(*outputs[i], names[2 * i + 1].c_str(), d.rows, d.cols);  // shapes, scale
      }
      for (size_t i = 0; i < n; ++i) cpu::quantize(*inputs[i], *outputs[i]);
      return;
    case Backend::CUDA:
#ifdef NVTE_WITH_CUDA
      for (size_t i = 0; i < n; ++i) {
        const Dims2 d = flat2d(inputs[i]->params[kNVTERowwiseData].shape);
        api::check_output(*outputs[i], names[2 * i + 1].c_str(), d.rows, d.cols);
      }
      cuda::multi_quantize(n, inputs, outputs, stream);
      return;
#else
      cuda_not_built("nvte_multi_cast_transpose");
#endif
  }
}

}  // namespace

extern "C" {

NVTEStatus nvte_cast_transpose(const NVTETensor input, NVTETensor output, cudaStream_t stream) {
  return api_call("nvte_cast_transpose",
                  [&] { run_quantize("nvte_cast_transpose", input, output, nullptr, stream); });
}

NVTEStatus nvte_transpose(const NVTETensor input, NVTETensor transposed_output, cudaStream_t stream) {
  return api_call("nvte_transpose", [&] { run_transpose(input, transposed_output, stream); });
}

NVTEStatus nvte_cast_transpose_dbias(const NVTETensor input, NVTETensor output, NVTETensor dbias,
                                     NVTETensor workspace, cudaStream_t stream) {
  return api_call("nvte_cast_transpose_dbias", [&] {
    run_quantize_dbias("nvte_cast_transpose_dbias", input, nullptr, output, dbias, workspace, std::nullopt,
                       stream);
  });
}

#define NVTE_DEFINE_CAST_TRANSPOSE_DBIAS_DACT(name, act)                                             \
  NVTEStatus nvte_cast_transpose_dbias_##name(const NVTETensor input, const NVTETensor act_input,    \
                                              NVTETensor output, NVTETensor dbias,                   \
                                              NVTETensor workspace, cudaStream_t stream) {           \
    return api_call("nvte_cast_transpose_dbias_" #name, [&] {                                        \
      run_quantize_dbias("nvte_cast_transpose_dbias_" #name, input, act_input, output, dbias,        \
                         workspace, act, stream);                                                    \
    });                                                                                              \
  }

NVTE_DEFINE_CAST_TRANSPOSE_DBIAS_DACT(dgelu, Act::GELU)
NVTE_DEFINE_CAST_TRANSPOSE_DBIAS_DACT(drelu, Act::ReLU)
NVTE_DEFINE_CAST_TRANSPOSE_DBIAS_DACT(dsilu, Act::SiLU)
NVTE_DEFINE_CAST_TRANSPOSE_DBIAS_DACT(dqgelu, Act::QGELU)
NVTE_DEFINE_CAST_TRANSPOSE_DBIAS_DACT(dsrelu, Act::SReLU)
#undef NVTE_DEFINE_CAST_TRANSPOSE_DBIAS_DACT

NVTEStatus nvte_multi_cast_transpose(size_t num_tensors, const NVTETensor *input_list,
                                     NVTETensor *output_list, cudaStream_t stream) {
  return api_call("nvte_multi_cast_transpose",
                  [&] { run_multi_cast_transpose(num_tensors, input_list, output_list, stream); });
}

}  // extern "C"
