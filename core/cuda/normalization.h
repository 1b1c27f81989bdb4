// cuda/normalization.h - CUDA backend of normalization.h: the same two routines as
// cpu/normalization.h (a NULL beta/mu/dbeta means RMSNorm), run on `stream`, plus the
// backward's workspace plan. Arguments are validated by the API layer.
#pragma once

#include <cstddef>

#include "../common/tensor.h"

namespace nvte::cuda {

// Multiprocessors the launch plans use: hint when > 0, else the current device's count.
int norm_sm(int hint);

// Bytes of float32 scratch the backward of an [n, h] norm needs when planned for `sm`
// multiprocessors: [parts, h] dgamma partials then [parts, h] dbeta partials, with
// parts a function of (n, h, sm) only. 0 when n == 0 or h == 0.
size_t norm_bwd_workspace_bytes(size_t n, size_t h, int sm);

// z = (x - mu) * rsigma * g + beta (FP8 z: scaled, amax updated, scale_inv written).
void norm_fwd(const Tensor &x, const Tensor &gamma, const Tensor *beta, float epsilon, Tensor &z,
              Tensor *mu, Tensor &rsigma, bool zero_centered_gamma, cudaStream_t stream);

// dx (+ add when given), dgamma and (LayerNorm only) dbeta. workspace holds at least
// norm_bwd_workspace_bytes(n, h, sm) bytes (4-byte aligned) of device memory.
void norm_bwd(const Tensor &dz, const Tensor &x, const Tensor *add, const Tensor *mu,
              const Tensor &rsigma, const Tensor &gamma, Tensor &dx, Tensor &dgamma, Tensor *dbeta,
              bool zero_centered_gamma, void *workspace, int sm, cudaStream_t stream);

}  // namespace nvte::cuda
