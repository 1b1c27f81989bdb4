/*
 * activation.h - elementwise activations and gated linear units, forward and backward.
 *
 * gelu is the tanh approximation 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)));
 * qgelu = x sigmoid(1.702 x); silu = x sigmoid(x); srelu = relu(x)^2.
 * Gated forms take input [N, 2H] and give output [N, H] = act(input[:, :H]) * input[:, H:]
 * (the first half is activated, the second half is the linear gate); glu uses sigmoid.
 * Gated backward: grad [N, H], input [N, 2H] -> output [N, 2H] with
 *   output[:, :H] = grad * input[:, H:] * act'(input[:, :H]),  output[:, H:] = grad * act(input[:, :H]).
 * Math is float32. Any output may be FP8 (activation fused with quantize, rule of cast.h).
 */
#ifndef TRANSFORMER_ENGINE_ACTIVATION_H_
#define TRANSFORMER_ENGINE_ACTIVATION_H_

#include "transformer_engine.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Elementwise forward: output = act(input), same shape.
 * Elementwise backward: output = grad * act'(input), all the same shape. */
NVTE_API NVTEStatus nvte_gelu(const NVTETensor input, NVTETensor output, cudaStream_t stream);
NVTE_API NVTEStatus nvte_dgelu(const NVTETensor grad, const NVTETensor input, NVTETensor output,
                                cudaStream_t stream);
NVTE_API NVTEStatus nvte_relu(const NVTETensor input, NVTETensor output, cudaStream_t stream);
NVTE_API NVTEStatus nvte_drelu(const NVTETensor grad, const NVTETensor input, NVTETensor output,
                                cudaStream_t stream);
NVTE_API NVTEStatus nvte_silu(const NVTETensor input, NVTETensor output, cudaStream_t stream);
NVTE_API NVTEStatus nvte_dsilu(const NVTETensor grad, const NVTETensor input, NVTETensor output,
                                cudaStream_t stream);
NVTE_API NVTEStatus nvte_qgelu(const NVTETensor input, NVTETensor output, cudaStream_t stream);
NVTE_API NVTEStatus nvte_dqgelu(const NVTETensor grad, const NVTETensor input, NVTETensor output,
                                cudaStream_t stream);
NVTE_API NVTEStatus nvte_srelu(const NVTETensor input, NVTETensor output, cudaStream_t stream);
NVTE_API NVTEStatus nvte_dsrelu(const NVTETensor grad, const NVTETensor input, NVTETensor output,
                                cudaStream_t stream);

/* Gated forward: input [N, 2H] -> output [N, H]. Gated backward: see the file comment. */
NVTE_API NVTEStatus nvte_glu(const NVTETensor input, NVTETensor output, cudaStream_t stream);
NVTE_API NVTEStatus nvte_dglu(const NVTETensor grad, const NVTETensor input, NVTETensor output,
                                cudaStream_t stream);
NVTE_API NVTEStatus nvte_geglu(const NVTETensor input, NVTETensor output, cudaStream_t stream);
NVTE_API NVTEStatus nvte_dgeglu(const NVTETensor grad, const NVTETensor input, NVTETensor output,
                                cudaStream_t stream);
NVTE_API NVTEStatus nvte_reglu(const NVTETensor input, NVTETensor output, cudaStream_t stream);
NVTE_API NVTEStatus nvte_dreglu(const NVTETensor grad, const NVTETensor input, NVTETensor output,
                                cudaStream_t stream);
NVTE_API NVTEStatus nvte_swiglu(const NVTETensor input, NVTETensor output, cudaStream_t stream);
NVTE_API NVTEStatus nvte_dswiglu(const NVTETensor grad, const NVTETensor input, NVTETensor output,
                                cudaStream_t stream);
NVTE_API NVTEStatus nvte_qgeglu(const NVTETensor input, NVTETensor output, cudaStream_t stream);
NVTE_API NVTEStatus nvte_dqgeglu(const NVTETensor grad, const NVTETensor input, NVTETensor output,
                                cudaStream_t stream);
NVTE_API NVTEStatus nvte_sreglu(const NVTETensor input, NVTETensor output, cudaStream_t stream);
NVTE_API NVTEStatus nvte_dsreglu(const NVTETensor grad, const NVTETensor input, NVTETensor output,
                                cudaStream_t stream);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* TRANSFORMER_ENGINE_ACTIVATION_H_ */
