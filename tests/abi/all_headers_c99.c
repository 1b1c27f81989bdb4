/* Compiled as strict C99 in CI: every public header must be valid C. */
#include <transformer_engine/activation.h>
#include <transformer_engine/cast.h>
#include <transformer_engine/fused_attn.h>
#include <transformer_engine/fused_rope.h>
#include <transformer_engine/gemm.h>
#include <transformer_engine/normalization.h>
#include <transformer_engine/recipe.h>
#include <transformer_engine/softmax.h>
#include <transformer_engine/transformer_engine.h>
#include <transformer_engine/transpose.h>

/* Handles are distinct types: this would not compile with NVTETensor in place of config. */
static NVTEStatus touch(NVTEQuantizationConfig config) {
  return nvte_set_quantization_config_attribute(config, kNVTEQuantizationConfigAmaxEpsilon, 0, 0);
}

int nvte_c99_header_check(void) { return touch(0) == NVTE_SUCCESS; }
