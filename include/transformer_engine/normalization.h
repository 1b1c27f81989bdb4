/*
 * normalization.h - LayerNorm and RMSNorm, forward and backward.
 *
 * x is viewed as 2D [N, H] (H = last dim). Statistics are float32 [N]:
 *   LayerNorm: mu = mean(x), rsigma = 1 / sqrt(mean((x - mu)^2) + epsilon),
 *              z = (x - mu) * rsigma * g + beta
 *   RMSNorm:   rsigma = 1 / sqrt(mean(x^2) + epsilon), z = x * rsigma * g
 * with g = gamma, or 1 + gamma when zero_centered_gamma. Math is float32.
 * z may be FP8 (norm fused with quantize, rule of cast.h) or high precision.
 * dgamma/dbeta reductions are deterministic (fixed summation order).
 *
 * Workspace (TE convention): if workspace's data pointer is NULL and the op needs
 * scratch memory, only workspace's shape/dtype are set and nothing is computed.
 * The CPU backend needs none. multiprocessorCount is a GPU hint (ignored on CPU).
 */
#ifndef TRANSFORMER_ENGINE_NORMALIZATION_H_
#define TRANSFORMER_ENGINE_NORMALIZATION_H_

#include <stdbool.h>

#include "transformer_engine.h"

#ifdef __cplusplus
extern "C" {
#endif

/** \param[in] x [N, H]; gamma, beta [H]. \param[out] z [N, H]; mu, rsigma float32 [N]. */
NVTE_API NVTEStatus nvte_layernorm_fwd(const NVTETensor x, const NVTETensor gamma,
                                       const NVTETensor beta, const float epsilon, NVTETensor z,
                                       NVTETensor mu, NVTETensor rsigma, NVTETensor workspace,
                                       const int multiprocessorCount,
                                       const bool zero_centered_gamma, cudaStream_t stream);

/** \param[in] dz, x [N, H]; mu, rsigma [N]; gamma [H].
 *  \param[out] dx [N, H]; dgamma, dbeta [H]. */
NVTE_API NVTEStatus nvte_layernorm_bwd(const NVTETensor dz, const NVTETensor x, const NVTETensor mu,
                                       const NVTETensor rsigma, const NVTETensor gamma,
                                       NVTETensor dx, NVTETensor dgamma, NVTETensor dbeta,
                                       NVTETensor workspace, const int multiprocessorCount,
                                       const bool zero_centered_gamma, cudaStream_t stream);

/** \param[in] x [N, H]; gamma [H]. \param[out] z [N, H]; rsigma float32 [N]. */
NVTE_API NVTEStatus nvte_rmsnorm_fwd(const NVTETensor x, const NVTETensor gamma, const float epsilon,
                                     NVTETensor z, NVTETensor rsigma, NVTETensor workspace,
                                     const int multiprocessorCount, const bool zero_centered_gamma,
                                     cudaStream_t stream);

/** \param[out] dx [N, H]; dgamma [H]. */
NVTE_API NVTEStatus nvte_rmsnorm_bwd(const NVTETensor dz, const NVTETensor x,
                                     const NVTETensor rsigma, const NVTETensor gamma, NVTETensor dx,
                                     NVTETensor dgamma, NVTETensor workspace,
                                     const int multiprocessorCount, const bool zero_centered_gamma,
                                     cudaStream_t stream);

/** \brief nvte_rmsnorm_bwd with a residual gradient added: dx = rmsnorm_dx + add. */
NVTE_API NVTEStatus nvte_rmsnorm_bwd_add(const NVTETensor dz, const NVTETensor x,
                                         const NVTETensor add, const NVTETensor rsigma,
                                         const NVTETensor gamma, NVTETensor dx, NVTETensor dgamma,
                                         NVTETensor workspace, const int multiprocessorCount,
                                         const bool zero_centered_gamma, cudaStream_t stream);

/** \brief Bytes of workspace the forward (is_forward) or backward of a norm of x needs. */
NVTE_API NVTEStatus nvte_normalization_workspace_size(const NVTETensor x, bool is_forward,
                                                      size_t *bytes);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* TRANSFORMER_ENGINE_NORMALIZATION_H_ */
