// cpu/normalization.h - CPU reference of LayerNorm / RMSNorm (normalization.h).
//
// Arguments are validated by the API layer (shapes, dtypes, epsilon); these
// functions only compute. A NULL beta/mu/dbeta means RMSNorm (no mean, no shift).
#pragma once

#include "../common/tensor.h"

namespace nvte::cpu {

// z = (x - mu) * rsigma * g + beta; mu (LayerNorm only) and rsigma per row.
void norm_fwd(const Tensor &x, const Tensor &gamma, const Tensor *beta, float epsilon, Tensor &z,
              Tensor *mu, Tensor &rsigma, bool zero_centered_gamma);

// dx (+ add when given), dgamma and (LayerNorm only) dbeta; deterministic reductions.
void norm_bwd(const Tensor &dz, const Tensor &x, const Tensor *add, const Tensor *mu,
              const Tensor &rsigma, const Tensor &gamma, Tensor &dx, Tensor &dgamma, Tensor *dbeta,
              bool zero_centered_gamma);

}  // namespace nvte::cpu
