// attn_softmax.h - the validated arguments of nvte_attn_softmax_{forward,backward} (softmax.h)
// as plain pointers and strides, and the per-element rules (visible keys, additive term),
// shared by the CPU and CUDA backends so both build each logit the same way.
#pragma once

#include <cstddef>
#include <cstdint>

#include "attn_mask.h"
#include "numeric.h"  // NVTE_HD
#include "transformer_engine/transformer_engine.h"

namespace nvte::attn {

enum class ScoreBias : int { None = 0, PreScale = 1, PostScale = 2, Alibi = 3 };
enum class ScoreCausal : int { None = 0, TopLeft = 1, BottomRight = 2 };

struct SoftmaxArgs {
  size_t b = 0, h = 0, sq = 0, sk = 0;
  float scale = 1.0f;
  ScoreBias bias_type = ScoreBias::None;
  ScoreCausal causal = ScoreCausal::None;
  // pre/post-scale bias [1 or B, 1 or H, Sq, Sk]: element strides of a batch and a head entry
  // (0 where the bias broadcasts).
  const void *bias = nullptr;
  NVTEDType bias_dtype = kNVTEFloat32;
  size_t bias_sb = 0, bias_sh = 0;
  // ALiBi: slopes [H] or [B, H] (null: TE's default), diagonal [1] or [B] (strides 0 or 1 / H).
  const float *slopes = nullptr;
  size_t slopes_sb = 0;
  const int64_t *diag = nullptr;
  size_t diag_sb = 0;
  // explicit mask [1 or B, 1 or H, Sq, Sk], 1 = hidden (strides as for bias)
  const uint8_t *mask = nullptr;
  size_t mask_sb = 0, mask_sh = 0;
  const float *offset = nullptr;  // sink logits [H]
};

// Offset of element (i, 0) of batch bb, head hh in a [1 or B, 1 or H, Sq, Sk] operand.
NVTE_HD size_t broadcast_row(size_t sb, size_t sh, size_t bb, size_t hh, size_t i, size_t sk) {
  return bb * sb + hh * sh + i * sk;
}

// Keys [0, n) of query row i that the causal mask type leaves in the row (all of them
// without one); 0 when the row sees nothing (bottom-right with Sk < Sq).
NVTE_HD size_t causal_keys(const SoftmaxArgs &a, size_t i) {
  if (a.causal == ScoreCausal::None) return a.sk;
  const long long d = a.causal == ScoreCausal::BottomRight ? (long long)a.sk - (long long)a.sq : 0;
  const long long last = (long long)i + d;
  if (last < 0) return 0;
  return last + 1 >= (long long)a.sk ? a.sk : (size_t)(last + 1);
}

// The ALiBi slope of (bb, hh): the given one or TE's default.
NVTE_HD float score_slope(const SoftmaxArgs &a, size_t bb, size_t hh) {
  if (a.slopes != nullptr) return a.slopes[bb * a.slopes_sb + hh];
  return (float)default_alibi_slope(hh, a.h);
}

// Logit of key j from the scaled score s = scale * x, the bias element bv (0 unless a
// pre/post-scale bias is given) and, for ALiBi, the row's slope and u = i + diag.
NVTE_HD float score_logit(const SoftmaxArgs &a, float s, float bv, float slope, long long u, size_t j) {
  switch (a.bias_type) {
    case ScoreBias::PreScale: return s + a.scale * bv;
    case ScoreBias::PostScale: return s + bv;
    case ScoreBias::Alibi: {
      const long long dist = u - (long long)j;
      return s - slope * (float)(dist < 0 ? -dist : dist);
    }
    default: return s;
  }
}

constexpr float kMaskedLogit = -10000.0f;  // the explicit mask's fill (nvte_scaled_masked_softmax)

// Whether a row's keys are all left out, given the largest logit among its keys (-inf when it has
// none): none, or every logit -inf (a -inf bias excludes its key, as in fused attention), or an
// explicit mask hiding all of them (TE's kernel rule: the row's maximum is the -10000 fill). Such
// a row's keys get y = 0 (a sink, if any, then takes the whole row): never NaN, never uniform.
NVTE_HD bool keys_left_out(float key_max, bool has_mask) {
  return key_max == -__builtin_huge_valf() || (has_mask && key_max == kMaskedLogit);
}

}  // namespace nvte::attn
