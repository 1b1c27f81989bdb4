// numeric.h - storage types and bit-exact conversions shared by host and device code.
//
// FP8 encoding (both backends use exactly these functions, so casts agree bit for bit):
// round to nearest even; |x| beyond the largest finite value (infinities included)
// saturates to +-max (448 for E4M3, 57344 for E5M2), like the GPU's satfinite
// conversion; NaN becomes the canonical NaN 0x7F. Where others differ (tested on
// purpose in tests/core/test_fp8_codec.py): ml_dtypes maps E4M3 overflow to NaN and
// E5M2 overflow to inf; torch 2.13 (CPU) saturates float8_e4m3fn but maps float8_e5m2
// overflow to inf.
// bf16/fp16 conversions round to nearest even and keep inf/NaN (standard IEEE rules).
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define NVTE_HD __host__ __device__ __forceinline__
#else
#define NVTE_HD inline
#endif

namespace nvte {

struct bf16 { uint16_t bits; };
struct fp16 { uint16_t bits; };
struct fp8e4m3 { uint8_t bits; };
struct fp8e5m2 { uint8_t bits; };

NVTE_HD uint32_t f32_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}
NVTE_HD float bits_f32(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

// Generic float32 -> 8-bit float with M mantissa bits and exponent bias B.
// max_code is the code of the largest finite value (0x7E for E4M3, 0x7B for E5M2).
template <int M, int B, uint32_t MaxCode>
NVTE_HD uint8_t f32_to_fp8_bits(float x) {
  const uint32_t u = f32_bits(x);
  const uint32_t sign = (u >> 24) & 0x80u;
  const uint32_t abs = u & 0x7FFFFFFFu;
  if (abs > 0x7F800000u) return 0x7F;  // NaN
  // Largest finite value as float32 bits: exponent (MaxCode >> M) - B, mantissa MaxCode & mask.
  constexpr uint32_t kMaxF32 =
      ((((MaxCode >> M) - B + 127u) << 23) | ((MaxCode & ((1u << M) - 1u)) << (23 - M)));
  if (abs > kMaxF32) return static_cast<uint8_t>(sign | MaxCode);  // saturate (inf too)
  constexpr uint32_t kMinNormalF32 = (uint32_t)(1 - B + 127) << 23;
  uint32_t code;
  if (abs < kMinNormalF32) {
    // Subnormal target: the code is |x| / 2^(1-B-M) rounded to nearest even; this
    // integer naturally reaches 2^M (the smallest normal code) when it rounds up.
    // Done in integers on the float32 fields so host and device agree exactly.
    const int exp = (int)(abs >> 23);                     // biased float32 exponent
    const uint32_t mant = exp ? ((abs & 0x7FFFFFu) | 0x800000u) : (abs & 0x7FFFFFu);
    // value = mant * 2^(e - 150) with e = max(exp, 1); code = value * 2^(B + M - 1).
    const int shift = 150 - (exp ? exp : 1) - (B + M - 1);  // right shift, >= 24 - M here
    if (shift >= 32) {
      code = 0;  // far below half the smallest subnormal
    } else {
      const uint32_t q = mant >> shift;
      const uint32_t rem = mant & ((1u << shift) - 1u);
      const uint32_t half = 1u << (shift - 1);
      code = q + ((rem > half || (rem == half && (q & 1u))) ? 1u : 0u);
    }
  } else {
    // Normal target: round the 23-bit mantissa to M bits (carry may bump the exponent).
    constexpr int kShift = 23 - M;
    const uint32_t lsb = (abs >> kShift) & 1u;
    const uint32_t rounded = (abs + ((1u << (kShift - 1)) - 1u) + lsb) >> kShift;
    code = rounded - ((uint32_t)(127 - B) << M);
  }
  return static_cast<uint8_t>(sign | code);
}

template <int M, int B>
NVTE_HD float fp8_bits_to_f32(uint8_t v, bool is_e4m3) {
  const uint32_t sign = (uint32_t)(v & 0x80u) << 24;
  const uint32_t e = (v >> M) & ((1u << (7 - M)) - 1u);
  const uint32_t m = v & ((1u << M) - 1u);
  if (is_e4m3) {
    if ((v & 0x7Fu) == 0x7Fu) return bits_f32(0x7FC00000u | sign);
  } else if (e == 0x1Fu) {
    return bits_f32(sign | 0x7F800000u | (m ? 0x400000u : 0u));  // inf or NaN
  }
  if (e == 0) {
    // Subnormal: m * 2^(1 - B - M), exact in float32.
    const float mag = (float)m * bits_f32((uint32_t)(127 + 1 - B - M) << 23);
    return sign ? -mag : mag;
  }
  return bits_f32(sign | ((e - B + 127u) << 23) | (m << (23 - M)));
}

NVTE_HD uint8_t float_to_e4m3(float x) { return f32_to_fp8_bits<3, 7, 0x7Eu>(x); }
NVTE_HD uint8_t float_to_e5m2(float x) { return f32_to_fp8_bits<2, 15, 0x7Bu>(x); }
NVTE_HD float e4m3_to_float(uint8_t v) { return fp8_bits_to_f32<3, 7>(v, true); }
NVTE_HD float e5m2_to_float(uint8_t v) { return fp8_bits_to_f32<2, 15>(v, false); }

NVTE_HD float bf16_to_float(uint16_t b) { return bits_f32((uint32_t)b << 16); }
NVTE_HD uint16_t float_to_bf16(float f) {
  const uint32_t u = f32_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40u);  // quiet NaN
  return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

NVTE_HD float fp16_to_float(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1Fu;
  const uint32_t m = h & 0x3FFu;
  if (e == 0x1F) return bits_f32(sign | 0x7F800000u | (m << 13));
  if (e == 0) {
    const float mag = (float)m * bits_f32(103u << 23);  // m * 2^-24
    return sign ? -mag : mag;
  }
  return bits_f32(sign | ((e + 112u) << 23) | (m << 13));
}
NVTE_HD uint16_t float_to_fp16(float f) {
  const uint32_t u = f32_bits(f);
  const uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7FFFFFFFu;
  if (abs > 0x7F800000u) return (uint16_t)(sign | 0x7E00u);  // NaN
  if (abs >= 0x477FF000u) return (uint16_t)(sign | 0x7C00u);  // rounds to >= 65536: inf
  if (abs < 0x38800000u) {                                     // below 2^-14: subnormal
    const int exp = (int)(abs >> 23);
    const uint32_t mant = exp ? ((abs & 0x7FFFFFu) | 0x800000u) : (abs & 0x7FFFFFu);
    const int shift = 126 - (exp ? exp : 1);  // value * 2^24 = mant >> shift
    if (shift >= 32) return sign;
    const uint32_t q = mant >> shift, rem = mant & ((1u << shift) - 1u), half = 1u << (shift - 1);
    return (uint16_t)(sign | (q + ((rem > half || (rem == half && (q & 1u))) ? 1u : 0u)));
  }
  const uint32_t lsb = (abs >> 13) & 1u;
  return (uint16_t)(sign | (((abs + 0xFFFu + lsb) >> 13) - (112u << 10)));
}

// Uniform conversion interface used by the typed loops: to_f32(T) and from_f32<T>(float).
NVTE_HD float to_f32(float v) { return v; }
NVTE_HD float to_f32(bf16 v) { return bf16_to_float(v.bits); }
NVTE_HD float to_f32(fp16 v) { return fp16_to_float(v.bits); }
NVTE_HD float to_f32(fp8e4m3 v) { return e4m3_to_float(v.bits); }
NVTE_HD float to_f32(fp8e5m2 v) { return e5m2_to_float(v.bits); }

template <class T> NVTE_HD T from_f32(float v);
template <> NVTE_HD float from_f32<float>(float v) { return v; }
template <> NVTE_HD bf16 from_f32<bf16>(float v) { return bf16{float_to_bf16(v)}; }
template <> NVTE_HD fp16 from_f32<fp16>(float v) { return fp16{float_to_fp16(v)}; }
template <> NVTE_HD fp8e4m3 from_f32<fp8e4m3>(float v) { return fp8e4m3{float_to_e4m3(v)}; }
template <> NVTE_HD fp8e5m2 from_f32<fp8e5m2>(float v) { return fp8e5m2{float_to_e5m2(v)}; }

template <class T> struct is_fp8_type { static constexpr bool value = false; };
template <> struct is_fp8_type<fp8e4m3> { static constexpr bool value = true; };
template <> struct is_fp8_type<fp8e5m2> { static constexpr bool value = true; };

}  // namespace nvte
