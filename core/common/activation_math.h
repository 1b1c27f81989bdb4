// activation_math.h - scalar activation functions and derivatives in float32, shared by
// the CPU and CUDA backends (activations, fused dact+dbias, GEMM GELU epilogues) so both
// evaluate the same formulas.
#pragma once

#include <cmath>
#include <type_traits>

#include "error.h"

#include "numeric.h"

namespace nvte {

enum class Act { GELU, ReLU, SiLU, QGELU, SReLU, Sigmoid };

// exp(x) and 1/y: exact library calls on the host; on the device the special-function unit
// alone (ex2.approx.ftz, rcp.approx.ftz: a few ulps, one instruction each; the flush-to-zero
// forms skip the range fix-ups of __expf / __fdividef, which only matter for results below
// 2^-126, where sigmoid and GELU are 0 to float32 output precision anyway). That keeps the
// memory-bound activation kernels from becoming issue-bound. The host/device difference
// stays within the GPU tests' float32 tolerance (tests/gpu/test_activation_gpu.py).
#ifdef __CUDA_ARCH__
__device__ __forceinline__ float ex2_approx(float x) {  // 2^x
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float rcp_approx(float x) {  // 1/x; 0 for |x| >= 2^126 and inf
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
#endif
NVTE_HD float exp_fast(float x) {
#ifdef __CUDA_ARCH__
  return ex2_approx(x * 1.4426950408889634f);
#else
  return std::exp(x);
#endif
}
NVTE_HD float rcp_fast(float y) {
#ifdef __CUDA_ARCH__
  return rcp_approx(y);
#else
  return 1.0f / y;
#endif
}

NVTE_HD float sigmoidf_(float x) { return rcp_fast(1.0f + exp_fast(-x)); }

// gelu, tanh approximation: 0.5 x (1 + tanh(u)), u = k (x + 0.044715 x^3), k = sqrt(2/pi),
// evaluated as x * sigmoid(2u) (0.5 (1 + tanh u) == sigmoid(2u) exactly): one exp and one
// reciprocal instead of tanhf, and no cancellation in 1 + tanh(u) for negative x.
// d/dx = s + 2 x s (1 - s) u', s = sigmoid(2u) = 1 / (1 + e), e = exp(-2u), 1 - s = e s,
// u' = k (1 + 3 * 0.044715 x^2).
#ifdef __CUDA_ARCH__
// exp(-2u) = 2^(x (kGeluC0 + kGeluC1 x^2)) with the constants folded (device forms below).
constexpr float kGeluC0 = -2.0f * 0.7978845608028654f * 1.4426950408889634f;
constexpr float kGeluC1 = kGeluC0 * 0.044715f;
#endif

NVTE_HD float gelu_f(float x) {
#ifdef __CUDA_ARCH__
  // 2 FMUL, 1 FFMA, 2 MUFU, 1 FADD
  const float e = ex2_approx(x * fmaf(x * x, kGeluC1, kGeluC0));
  return x * rcp_approx(1.0f + e);
#else
  const float k2 = 2.0f * 0.7978845608028654f;
  return x * sigmoidf_(k2 * (x + 0.044715f * x * x * x));
#endif
}
NVTE_HD float dgelu_f(float x) {
  const float k = 0.7978845608028654f;
#ifdef __CUDA_ARCH__
  const float x2 = x * x;
  const float s = rcp_approx(1.0f + ex2_approx(x * fmaf(x2, kGeluC1, kGeluC0)));
  // s (1 - s) as one FMA, s - s^2: where s is near 1 it cancels, but there the term is a small
  // correction to s (absolute error ~1e-7 |x| u'), and it stays exact-ish where s is small.
  return fmaf(x * fmaf(-s, s, s), fmaf(x2, 2.0f * k * 3.0f * 0.044715f, 2.0f * k), s);
#else
  const float e = exp_fast(-2.0f * k * (x + 0.044715f * x * x * x));
  const float s = rcp_fast(1.0f + e);
  const float oms = e < 1.0f ? e * s : 1.0f - s;  // 1 - s, without cancellation where s > 1/2
  return s + 2.0f * x * s * oms * k * (1.0f + 3.0f * 0.044715f * x * x);
#endif
}

NVTE_HD float act_f(Act a, float x) {
  switch (a) {
    case Act::GELU: return gelu_f(x);
    case Act::ReLU: return x > 0.0f ? x : 0.0f;
    case Act::SiLU: return x * sigmoidf_(x);
    case Act::QGELU: return x * sigmoidf_(1.702f * x);
    case Act::SReLU: return x > 0.0f ? x * x : 0.0f;
    case Act::Sigmoid: return sigmoidf_(x);
  }
  return 0.0f;
}

// d act(x) / dx.
NVTE_HD float dact_f(Act a, float x) {
  switch (a) {
    case Act::GELU: return dgelu_f(x);
    case Act::ReLU: return x > 0.0f ? 1.0f : 0.0f;
    case Act::SiLU: {
      const float s = sigmoidf_(x);
      return s * (1.0f + x * (1.0f - s));
    }
    case Act::QGELU: {
      const float s = sigmoidf_(1.702f * x);
      return s * (1.0f + 1.702f * x * (1.0f - s));
    }
    case Act::SReLU: return x > 0.0f ? 2.0f * x : 0.0f;
    case Act::Sigmoid: {
      const float s = sigmoidf_(x);
      return s * (1.0f - s);
    }
  }
  return 0.0f;
}

// Runs f(std::integral_constant<Act, a>{}) so loops and kernels are specialised per activation
// instead of switching on every element. kWithSigmoid = false skips instantiating the Sigmoid
// case (it only occurs inside glu), which saves code in callers that never take it.
template <bool kWithSigmoid = true, class F>
void with_act(Act a, F &&f) {
  switch (a) {
    case Act::GELU: return f(std::integral_constant<Act, Act::GELU>{});
    case Act::ReLU: return f(std::integral_constant<Act, Act::ReLU>{});
    case Act::SiLU: return f(std::integral_constant<Act, Act::SiLU>{});
    case Act::QGELU: return f(std::integral_constant<Act, Act::QGELU>{});
    case Act::SReLU: return f(std::integral_constant<Act, Act::SReLU>{});
    case Act::Sigmoid:
      if constexpr (kWithSigmoid) return f(std::integral_constant<Act, Act::Sigmoid>{});
      break;
  }
  NVTE_FAIL(NVTE_ERROR_INTERNAL, "unsupported activation ", static_cast<int>(a));
}

}  // namespace nvte
