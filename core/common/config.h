// config.h - internal layout of the quantization and matmul option objects.
#pragma once

#include "tensor.h"
#include "transformer_engine/gemm.h"

struct NVTEQuantizationConfig_ {
  bool force_pow2_scales = false;
  float amax_epsilon = 0.0f;
  NVTETensor noop_tensor = nullptr;
};

struct NVTEMatmulConfig_ {
  NVTETensor bias_tensor = nullptr;
  NVTETensor dbias_tensor = nullptr;
  bool with_gelu_epilogue = false;
  bool with_dgelu_epilogue = false;
  NVTETensor epilogue_aux_tensor = nullptr;
  bool use_split_accumulator = true;
  int sm_count = 0;
};
