// config.cpp - option objects of quantization and matmul (get/set by attribute id).
#include "config.h"

#include <cstring>

using namespace nvte;

namespace {

// Copies between an attribute field and the caller's buffer, checking its size. A getter with
// buf NULL only reports the size (TE's documented query).
template <class T>
void get_field(const T &field, void *buf, size_t size, size_t *size_written) {
  if (size_written) *size_written = sizeof(T);
  if (buf == nullptr) return;
  NVTE_CHECK(size >= sizeof(T), "buffer must hold ", sizeof(T), " bytes, got ", size);
  std::memcpy(buf, &field, sizeof(T));
}
template <class T>
void set_field(T &field, const void *buf, size_t size) {
  NVTE_CHECK(buf != nullptr, "buffer is NULL (it must hold ", sizeof(T), " bytes)");
  NVTE_CHECK(size == sizeof(T), "buffer must hold ", sizeof(T), " bytes, got ", size);
  std::memcpy(&field, buf, sizeof(T));
}

// Applies op(field) to the field an attribute id names.
template <class Op>
void with_quant_field(NVTEQuantizationConfig_ &c, NVTEQuantizationConfigAttribute a, Op &&op) {
  switch (a) {
    case kNVTEQuantizationConfigForcePow2Scales: return op(c.force_pow2_scales);
    case kNVTEQuantizationConfigAmaxEpsilon: return op(c.amax_epsilon);
    case kNVTEQuantizationConfigNoopTensor: return op(c.noop_tensor);
    default: NVTE_CHECK(false, "unknown quantization config attribute ", (int)a);
  }
}
template <class Op>
void with_matmul_field(NVTEMatmulConfig_ &c, NVTEMatmulConfigAttribute a, Op &&op) {
  switch (a) {
    case kNVTEMatmulConfigBiasTensor: return op(c.bias_tensor);
    case kNVTEMatmulConfigDBiasTensor: return op(c.dbias_tensor);
    case kNVTEMatmulConfigWithGELUEpilogue: return op(c.with_gelu_epilogue);
    case kNVTEMatmulConfigWithDGELUEpilogue: return op(c.with_dgelu_epilogue);
    case kNVTEMatmulConfigEpilogueAuxTensor: return op(c.epilogue_aux_tensor);
    case kNVTEMatmulConfigUseSplitAccumulator: return op(c.use_split_accumulator);
    case kNVTEMatmulConfigSMCount: return op(c.sm_count);
    default: NVTE_CHECK(false, "unknown matmul config attribute ", (int)a);
  }
}

}  // namespace

extern "C" {

NVTEQuantizationConfig nvte_create_quantization_config(void) {
  return new (std::nothrow) NVTEQuantizationConfig_();
}
void nvte_destroy_quantization_config(NVTEQuantizationConfig config) { delete config; }

NVTEStatus nvte_get_quantization_config_attribute(NVTEQuantizationConfig config,
                                                  NVTEQuantizationConfigAttribute attr, void *buf,
                                                  size_t size_in_bytes, size_t *size_written) {
  return api_call("nvte_get_quantization_config_attribute", [&] {
    NVTE_CHECK(config != nullptr, "config is NULL");
    with_quant_field(*config, attr, [&](auto &f) { get_field(f, buf, size_in_bytes, size_written); });
  });
}

NVTEStatus nvte_set_quantization_config_attribute(NVTEQuantizationConfig config,
                                                  NVTEQuantizationConfigAttribute attr,
                                                  const void *buf, size_t size_in_bytes) {
  return api_call("nvte_set_quantization_config_attribute", [&] {
    NVTE_CHECK(config != nullptr, "config is NULL");
    with_quant_field(*config, attr, [&](auto &f) { set_field(f, buf, size_in_bytes); });
  });
}

NVTEMatmulConfig nvte_create_matmul_config(void) { return new (std::nothrow) NVTEMatmulConfig_(); }
void nvte_destroy_matmul_config(NVTEMatmulConfig config) { delete config; }

NVTEStatus nvte_get_matmul_config_attribute(NVTEMatmulConfig config, NVTEMatmulConfigAttribute attr,
                                            void *buf, size_t size_in_bytes, size_t *size_written) {
  return api_call("nvte_get_matmul_config_attribute", [&] {
    NVTE_CHECK(config != nullptr, "config is NULL");
    with_matmul_field(*config, attr, [&](auto &f) { get_field(f, buf, size_in_bytes, size_written); });
  });
}

NVTEStatus nvte_set_matmul_config_attribute(NVTEMatmulConfig config, NVTEMatmulConfigAttribute attr,
                                            const void *buf, size_t size_in_bytes) {
  return api_call("nvte_set_matmul_config_attribute", [&] {
    NVTE_CHECK(config != nullptr, "config is NULL");
    with_matmul_field(*config, attr, [&](auto &f) { set_field(f, buf, size_in_bytes); });
  });
}

}  // extern "C"
