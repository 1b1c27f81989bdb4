// dtype_switch.h - the one runtime dtype -> compile-time type helper, and the one
// runtime bool -> compile-time bool helper.
//
// Usage:
//   with_float_dtype(t.dtype, "input", [&](auto tag) {
//     using T = typename decltype(tag)::type;   // float, bf16, fp16, fp8e4m3 or fp8e5m2
//     ...
//   });
//   with_bool(has_bias, [&](auto kHasBias) { if constexpr (kHasBias) {...} });
#pragma once

#include <type_traits>

#include "error.h"
#include "numeric.h"
#include "tensor.h"

namespace nvte {

template <class T>
struct TypeTag {
  using type = T;
};

template <class F>
decltype(auto) with_float_dtype(NVTEDType t, const char *what, F &&f) {
  switch (t) {
    case kNVTEFloat32: return f(TypeTag<float>{});
    case kNVTEFloat16: return f(TypeTag<fp16>{});
    case kNVTEBFloat16: return f(TypeTag<bf16>{});
    case kNVTEFloat8E4M3: return f(TypeTag<fp8e4m3>{});
    case kNVTEFloat8E5M2: return f(TypeTag<fp8e5m2>{});
    default:
      NVTE_FAIL(NVTE_ERROR_INVALID_ARGUMENT, what, " has dtype ", dtype_name(t),
                "; expected float32, float16, bfloat16, float8_e4m3 or float8_e5m2");
  }
}

template <class F>
decltype(auto) with_bool(bool b, F &&f) {
  if (b) return f(std::true_type{});
  return f(std::false_type{});
}

}  // namespace nvte
