// cast_dact.cu - instantiations of the tiled kernel for the fused activation-backward +
// quantize (+ transpose) + dbias ops.
//
// Design: the common case (act input of the input's dtype, aligned buffers, row length a
// multiple of the vector width) gets a kernel specialised on the activation, so the
// derivative inlines into the 16-byte load loop. Everything else (mixed input dtypes,
// misaligned or odd-length rows) shares one scalar kernel per (input, output) dtype pair that
// picks the activation and the act input's dtype at run time: correct for any layout at
// modest cost, and it keeps the number of instantiations (and the build) small.
#include "../common/dtype_switch.h"
#include "cast_tiles.cuh"

namespace nvte::cuda {

namespace {

template <class InT, class OutT>
void launch_for(NVTEDType act_t, int act_kind, tiles::Args a, cudaStream_t stream) {
  a.col_vec = tiles::col_vec_ok(a.out_col, a.rows, sizeof(OutT));
  constexpr NVTEDType kInT = std::is_same_v<InT, float> ? kNVTEFloat32
                             : std::is_same_v<InT, bf16> ? kNVTEBFloat16 : kNVTEFloat16;
  const bool same = act_t == kInT;
  if (same && tiles::vec_ok<InT, InT, OutT>(a)) {
    switch (static_cast<Act>(act_kind)) {
      case Act::GELU: return tiles::launch<InT, InT, OutT, (int)Act::GELU, true, true, false>(a, stream);
      case Act::ReLU: return tiles::launch<InT, InT, OutT, (int)Act::ReLU, true, true, false>(a, stream);
      case Act::SiLU: return tiles::launch<InT, InT, OutT, (int)Act::SiLU, true, true, false>(a, stream);
      case Act::QGELU: return tiles::launch<InT, InT, OutT, (int)Act::QGELU, true, true, false>(a, stream);
      case Act::SReLU: return tiles::launch<InT, InT, OutT, (int)Act::SReLU, true, true, false>(a, stream);
      default: break;
    }
  }
  tiles::launch<InT, AnyFloat, OutT, kRuntimeAct, true, false, false>(a, stream);
}

}  // namespace

void launch_dact_tiles(NVTEDType in_t, NVTEDType act_t, NVTEDType out_t, int act_kind, tiles::Args a,
                       cudaStream_t stream) {
  NVTE_CHECK(is_high_precision(act_t), "act_input must be float32, float16 or bfloat16, got ", dtype_name(act_t));
  with_float_dtype(in_t, "input", [&](auto itag) {
    using InT = typename decltype(itag)::type;
    with_float_dtype(out_t, "output", [&](auto otag) {
      using OutT = typename decltype(otag)::type;
      if constexpr (is_fp8_type<InT>::value) {
        NVTE_FAIL(NVTE_ERROR_INVALID_ARGUMENT, "input must be float32, float16 or bfloat16");
      } else {
        launch_for<InT, OutT>(act_t, act_kind, a, stream);
      }
    });
  });
}

}  // namespace nvte::cuda
