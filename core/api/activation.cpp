// api/activation.cpp - nvte_<act> / nvte_d<act> entry points: validate, pick the backend, run.
// The 22 entry points are generated from two tables mapping names to nvte::Act values.
#include "transformer_engine/activation.h"

#include "../common/activation_math.h"
#include "../common/backend.h"
#include "../cpu/activation.h"
#include "alias_checks.h"
#ifdef NVTE_WITH_CUDA
#include "../cuda/activation.h"
#endif

using namespace nvte;

namespace {

void check_float_in(const Tensor &t, const char *name) {
  const NVTEDType d = logical_dtype(t);
  NVTE_CHECK(is_high_precision(d), name, " must be float32, float16 or bfloat16, got ", dtype_name(d));
}

void check_out_dtype(const Tensor &t) {
  const NVTEDType d = logical_dtype(t);
  NVTE_CHECK(is_high_precision(d) || is_fp8(d), "output must be float32, float16, bfloat16 or FP8, got ",
             dtype_name(d));
}

// Checks that t's 2D view is [rows, cols].
void check_dims(const Tensor &t, const char *name, size_t rows, size_t cols, const char *why) {
  const NVTEShape s = logical_shape(t);
  const Dims2 d = flat2d(s);
  NVTE_CHECK(d.rows == rows && d.cols == cols, name, " has shape ", shape_str(s), " (2D view [", d.rows,
             ", ", d.cols, "]); expected [", rows, ", ", cols, "] ", why);
}

// Elementwise forward (backward false, grad unused) or backward.
void run_act(const char *op, Act a, bool backward, const NVTETensor grad, const NVTETensor input,
             NVTETensor output, cudaStream_t stream) {
  const Tensor &in = require(input, "input");
  const Tensor *g = backward ? &require(grad, "grad") : nullptr;
  Tensor &out = require_mut(output, "output");
  check_float_in(in, "input");
  check_out_dtype(out);
  const Dims2 d = flat2d(logical_shape(in));
  if (g) {
    check_float_in(*g, "grad");
    check_dims(*g, "grad", d.rows, d.cols, "(the input's shape)");
  }
  check_dims(out, "output", d.rows, d.cols, "(the input's shape)");
  // Elementwise: the output may be exactly the input's (or grad's) buffer, same dtype.
  api::check_alias(out, "output", in, "input");
  if (g) api::check_alias(out, "output", *g, "grad");
  switch (backend_of({{"grad", grad}, {"input", input}, {"output", output}})) {
    case Backend::CPU: return cpu::activation(a, g, in, out);
    case Backend::CUDA:
#ifdef NVTE_WITH_CUDA
      return cuda::activation(a, g, in, out, stream);
#else
      (void)stream;
      cuda_not_built(op);
#endif
  }
}

// Gated forward (backward false): [N, 2H] -> [N, H]; backward: grad [N, H] -> output [N, 2H].
void run_gated(const char *op, Act a, bool backward, const NVTETensor grad, const NVTETensor input,
               NVTETensor output, cudaStream_t stream) {
  const Tensor &in = require(input, "input");
  const Tensor *g = backward ? &require(grad, "grad") : nullptr;
  Tensor &out = require_mut(output, "output");
  check_float_in(in, "input");
  check_out_dtype(out);
  const NVTEShape s = logical_shape(in);
  const Dims2 d = flat2d(s);
  NVTE_CHECK(s.ndim >= 1 && d.cols % 2 == 0, "input has shape ", shape_str(s),
             "; a gated activation needs an even last dim [N, 2H] (activated half, then gate half)");
  const size_t h = d.cols / 2;
  if (g) {
    check_float_in(*g, "grad");
    check_dims(*g, "grad", d.rows, h, "(input is [N, 2H], grad is [N, H])");
    check_dims(out, "output", d.rows, 2 * h, "(the gradient of input [N, 2H])");
  } else {
    check_dims(out, "output", d.rows, h, "(input is [N, 2H], output is [N, H])");
  }
  if (g) {
    // The backward reads both halves of an input element pair before writing that pair of
    // the [N, 2H] output (CPU: whole rows; CUDA: gated_kernel), so it may write over the input
    // exactly; grad [N, H] has another row length, so any overlap with it is refused.
    api::check_alias(out, "output", in, "input");
    api::check_disjoint(out, "output", *g, "grad", "output [N, 2H] and grad [N, H] have different row lengths");
  } else {
    api::check_disjoint(out, "output", in, "input",
                        "a gated activation's output [N, H] cannot be written over its input [N, 2H]");
  }
  switch (backend_of({{"grad", grad}, {"input", input}, {"output", output}})) {
    case Backend::CPU: return cpu::gated_activation(a, g, in, out);
    case Backend::CUDA:
#ifdef NVTE_WITH_CUDA
      return cuda::gated_activation(a, g, in, out, stream);
#else
      (void)stream;
      cuda_not_built(op);
#endif
  }
}

}  // namespace

// name -> activation tables.
#define NVTE_ELEMENTWISE_ACTS(X) X(gelu, GELU) X(relu, ReLU) X(silu, SiLU) X(qgelu, QGELU) X(srelu, SReLU)
#define NVTE_GATED_ACTS(X) \
  X(glu, Sigmoid) X(geglu, GELU) X(reglu, ReLU) X(swiglu, SiLU) X(qgeglu, QGELU) X(sreglu, SReLU)

#define NVTE_DEFINE_ACT(name, act, runner)                                                  \
  NVTEStatus nvte_##name(const NVTETensor input, NVTETensor output, cudaStream_t stream) {  \
    return api_call("nvte_" #name, [&] {                                                    \
      runner("nvte_" #name, Act::act, false, nullptr, input, output, stream);               \
    });                                                                                     \
  }                                                                                         \
  NVTEStatus nvte_d##name(const NVTETensor grad, const NVTETensor input, NVTETensor output, \
                          cudaStream_t stream) {                                            \
    return api_call("nvte_d" #name,                                                         \
                    [&] { runner("nvte_d" #name, Act::act, true, grad, input, output, stream); }); \
  }
#define NVTE_DEFINE_ELEMENTWISE(name, act) NVTE_DEFINE_ACT(name, act, run_act)
#define NVTE_DEFINE_GATED(name, act) NVTE_DEFINE_ACT(name, act, run_gated)

extern "C" {
NVTE_ELEMENTWISE_ACTS(NVTE_DEFINE_ELEMENTWISE)
NVTE_GATED_ACTS(NVTE_DEFINE_GATED)
}  // extern "C"
