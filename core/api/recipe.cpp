// api/recipe.cpp - FP8 scaling recipe entry points: validate, pick the backend, run.
#include "transformer_engine/recipe.h"

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "../common/backend.h"
#include "../common/config.h"
#include "../cpu/recipe.h"
#include "runners.h"
#ifdef NVTE_WITH_CUDA
#include "../cuda/recipe.h"
#endif

using namespace nvte;

namespace {

cpu::AmaxAlgo parse_algo(const char *algo) {
  NVTE_CHECK(algo != nullptr, "amax_compute_algo is NULL; expected \"max\" or \"most_recent\"");
  if (std::strcmp(algo, "max") == 0) return cpu::AmaxAlgo::Max;
  if (std::strcmp(algo, "most_recent") == 0) return cpu::AmaxAlgo::MostRecent;
  NVTE_FAIL(NVTE_ERROR_INVALID_ARGUMENT, "unknown amax_compute_algo \"", algo,
            "\"; expected \"max\" or \"most_recent\"");
}

float recipe_fp8_max(NVTEDType t) {
  NVTE_CHECK(is_fp8(t), "fp8_dtype must be float8_e4m3 or float8_e5m2, got ", dtype_name(t));
  return fp8_max(t);
}

// A float32 buffer's data pointer after checking its dtype (rowwise data of a handle).
float *f32_data(const Tensor &t, const std::string &name) {
  const NVTEBasicTensor &b = t.params[kNVTERowwiseData];
  NVTE_CHECK(buffer_set(b), name, " needs rowwise data");
  NVTE_CHECK(b.dtype == kNVTEFloat32, name, " must be float32, got ", dtype_name(b.dtype));
  return static_cast<float *>(b.data_ptr);
}

// History shape [len, n] or [len] (n = 1).
cpu::History history_of(const NVTETensor hist, const NVTETensor scale, const std::string &hname,
                        const std::string &sname) {
  const Tensor &h = require(hist, hname.c_str());
  const Tensor &s = require(scale, sname.c_str());
  cpu::History r{f32_data(h, hname), f32_data(s, sname), 0, 0};
  const NVTEShape hs = h.params[kNVTERowwiseData].shape;
  NVTE_CHECK(hs.ndim == 1 || hs.ndim == 2, hname, " has shape ", shape_str(hs), "; expected [len, n] or [len]");
  r.len = hs.data[0];
  r.n = hs.ndim == 2 ? hs.data[1] : 1;
  NVTE_CHECK(r.len >= 1, hname, " has shape ", shape_str(hs), "; the history needs at least one row");
  const NVTEShape ss = s.params[kNVTERowwiseData].shape;
  NVTE_CHECK(numel(ss) == r.n && ss.ndim <= 1, sname, " has shape ", shape_str(ss), "; expected [", r.n,
             "] to match ", hname, " ", shape_str(hs));
  return r;
}

// 2^margin must be a finite, normal float32 (a NaN margin gave NaN scales, +inf or 200 a scale of
// 0, -inf FLT_MAX: every later cast broken, with SUCCESS).
void check_margin(float margin) {
  NVTE_CHECK(std::isfinite(margin) && std::fabs(margin) <= 126.0f, "margin must be finite and within [-126, 126], got ",
             margin);
}

void run_update(const NVTETensor amax_history, const NVTETensor scale, NVTETensor updated_amax_history,
                NVTETensor updated_scale, const char *algo_name, NVTEDType fp8_dtype, float margin,
                cudaStream_t stream) {
  check_margin(margin);
  const cpu::AmaxAlgo algo = parse_algo(algo_name);
  const float fmax = recipe_fp8_max(fp8_dtype);
  const cpu::History in = history_of(amax_history, scale, "amax_history", "scale");
  const cpu::History out = history_of(updated_amax_history, updated_scale, "updated_amax_history", "updated_scale");
  NVTE_CHECK(in.len == out.len && in.n == out.n, "updated_amax_history has shape ",
             shape_str(updated_amax_history->params[kNVTERowwiseData].shape), "; expected ",
             shape_str(amax_history->params[kNVTERowwiseData].shape), " like amax_history");
  switch (backend_of({{"amax_history", amax_history}, {"scale", scale},
                      {"updated_amax_history", updated_amax_history}, {"updated_scale", updated_scale}})) {
    case Backend::CPU:
      return cpu::amax_and_scale_update(in.hist, in.scale, out.hist, out.scale, in.len, in.n, algo, fmax, margin);
    case Backend::CUDA:
#ifdef NVTE_WITH_CUDA
      return cuda::amax_and_scale_update(in.hist, in.scale, out.hist, out.scale, in.len, in.n, algo, fmax, margin,
                                         stream);
#else
      cuda_not_built("nvte_delayed_scaling_recipe_amax_and_scale_update");
#endif
  }
}

void run_after_reduction(const NVTETensor buffer, const NVTETensor *hists, const NVTETensor *scales,
                         size_t num, const char *algo_name, NVTEDType fp8_dtype, float margin,
                         cudaStream_t stream) {
  check_margin(margin);
  const cpu::AmaxAlgo algo = parse_algo(algo_name);
  const float fmax = recipe_fp8_max(fp8_dtype);
  NVTE_CHECK(num == 0 || (hists != nullptr && scales != nullptr),
             "amax_histories or scales is NULL with num_tensors = ", num);
  std::vector<std::string> names;
  names.reserve(2 * num);
  std::vector<cpu::History> hs;
  std::vector<NamedTensor> all{{"amax_reduction_buffer", buffer}};
  size_t total = 0;
  for (size_t i = 0; i < num; ++i) {
    names.push_back("amax_histories[" + std::to_string(i) + "]");
    names.push_back("scales[" + std::to_string(i) + "]");
    hs.push_back(history_of(hists[i], scales[i], names[2 * i], names[2 * i + 1]));
    total += hs.back().n;
  }
  for (size_t i = 0; i < num; ++i) {
    all.push_back({names[2 * i].c_str(), hists[i]});
    all.push_back({names[2 * i + 1].c_str(), scales[i]});
  }
  // An empty buffer (NULL handle or zero elements) means "use each history's row 0".
  const float *buf = nullptr;
  const NVTEBasicTensor *bb = buffer ? &buffer->params[kNVTERowwiseData] : nullptr;
  const bool empty = bb == nullptr || (bb->data_ptr == nullptr && bb->shape.ndim == 0) ||
                     (bb->shape.ndim > 0 && numel(bb->shape) == 0);
  if (!empty) {
    const NVTEShape bs = bb->shape;
    buf = f32_data(require(buffer, "amax_reduction_buffer"), "amax_reduction_buffer");
    NVTE_CHECK(numel(bs) == total, "amax_reduction_buffer has shape ", shape_str(bs), " (", numel(bs),
               " values) but the ", num, " histories have ", total, " columns in total");
  }
  switch (backend_of(all.data(), all.size())) {
    case Backend::CPU: return cpu::amax_and_scale_update_after_reduction(buf, hs, algo, fmax, margin);
    case Backend::CUDA:
#ifdef NVTE_WITH_CUDA
      return cuda::amax_and_scale_update_after_reduction(buf, hs, algo, fmax, margin, stream);
#else
      cuda_not_built("nvte_delayed_scaling_recipe_amax_and_scale_update_after_reduction");
#endif
  }
}

}  // namespace

extern "C" {

NVTEStatus nvte_delayed_scaling_recipe_amax_and_scale_update(
    const NVTETensor amax_history, const NVTETensor scale, NVTETensor updated_amax_history,
    NVTETensor updated_scale, const char *amax_compute_algo, NVTEDType fp8_dtype, float margin,
    cudaStream_t stream) {
  return api_call("nvte_delayed_scaling_recipe_amax_and_scale_update", [&] {
    run_update(amax_history, scale, updated_amax_history, updated_scale, amax_compute_algo, fp8_dtype, margin,
               stream);
  });
}

NVTEStatus nvte_delayed_scaling_recipe_amax_and_scale_update_after_reduction(
    const NVTETensor amax_reduction_buffer, const NVTETensor *amax_histories, const NVTETensor *scales,
    size_t num_tensors, const char *amax_compute_algo, NVTEDType fp8_dtype, float margin,
    cudaStream_t stream) {
  return api_call("nvte_delayed_scaling_recipe_amax_and_scale_update_after_reduction", [&] {
    run_after_reduction(amax_reduction_buffer, amax_histories, scales, num_tensors, amax_compute_algo,
                        fp8_dtype, margin, stream);
  });
}

NVTEStatus nvte_compute_amax(const NVTETensor input, NVTETensor output, cudaStream_t stream) {
  return api_call("nvte_compute_amax", [&] {
    const Tensor &in = require(input, "input");
    NVTE_CHECK(is_high_precision(logical_dtype(in)), "input must be float32, float16 or bfloat16, got ",
               dtype_name(logical_dtype(in)));
    NVTE_CHECK(output != nullptr, "output is a NULL tensor handle");
    float *amax = scalar_param(*output, kNVTEAmax, "output amax");
    NVTE_CHECK(amax != nullptr, "output has no amax buffer to write");
    switch (backend_of({{"input", input}, {"output", output}})) {
      case Backend::CPU: return cpu::compute_amax(in, amax);
      case Backend::CUDA:
#ifdef NVTE_WITH_CUDA
        NVTE_CHECK(buffer_set(in.params[kNVTERowwiseData]), "input needs rowwise data");
        return cuda::compute_amax(in, amax, stream);
#else
        cuda_not_built("nvte_compute_amax");
#endif
    }
  });
}

NVTEStatus nvte_compute_scale_from_amax(NVTETensor output, const NVTEQuantizationConfig config,
                                        cudaStream_t stream) {
  return api_call("nvte_compute_scale_from_amax", [&] {
    NVTE_CHECK(output != nullptr, "output is a NULL tensor handle");
    const NVTEDType t = logical_dtype(*output);
    NVTE_CHECK(present(output) && is_fp8(t), "output must be an FP8 tensor (its dtype selects fp8_max), got ",
               present(output) ? dtype_name(t) : "a tensor without data");
    float *amax = scalar_param(*output, kNVTEAmax, "output amax");
    float *scale = scalar_param(*output, kNVTEScale, "output scale");
    NVTE_CHECK(amax != nullptr, "output has no amax buffer");
    NVTE_CHECK(scale != nullptr, "output has no scale buffer");
    const NVTEQuantizationConfig_ defaults;
    const NVTEQuantizationConfig_ &c = config ? *config : defaults;
    const Backend b = backend_of({{"output", output}, {"noop", c.noop_tensor}});
    switch (b) {
      case Backend::CPU:
        if (api::noop_set(c.noop_tensor, b)) return;
        *scale = cpu::scale_from_amax(*amax, fp8_max(t), c.force_pow2_scales, c.amax_epsilon);
        return;
      case Backend::CUDA:
#ifdef NVTE_WITH_CUDA
        return cuda::compute_scale_from_amax(amax, scale, api::noop_ptr(c.noop_tensor), fp8_max(t),
                                             c.force_pow2_scales, c.amax_epsilon, stream);
#else
        cuda_not_built("nvte_compute_scale_from_amax");
#endif
    }
  });
}

}  // extern "C"
