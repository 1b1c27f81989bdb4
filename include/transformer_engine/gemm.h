/*
 * gemm.h - matrix multiplication with fused epilogues.
 *
 * Convention (TE's, from cuBLAS): matrices are column-major, so for the row-major
 * buffers frameworks hold, nvte_cublas_gemm computes
 *     D = op(B) @ op(A)        op(A) = transa ? A^T : A,  op(B) = transb ? B^T : B
 * with every operand row-major: A [.., k] or [k, ..] etc., D [n, m] where
 * op(B) is [n, k] and op(A) is [k, m]. In Linear-layer terms:
 *     fprop  "TN": A = W [out, in], B = X [tok, in]        -> D = X W^T   [tok, out]
 *     dgrad  "NN": A = W [out, in], B = dY [tok, out]      -> D = dY W    [tok, in]
 *     wgrad  "NT": A = X [tok, in], B = dY [tok, out]      -> D = dY^T X  [out, in]
 * FP8 operands are decoded with their scale_inv; when an FP8 operand has only
 * columnwise data (its transpose), that buffer is used with the trans flag flipped.
 * Accumulation is in float32. An FP8 D is quantized with D's scale; D's amax is
 * max-accumulated and its scale_inv written.
 *
 * CUDA: cuBLASLt with its heuristic's first algorithm, cached per shape. NVTE_GEMM_AUTOTUNE=1
 * makes each shape's first ~40 calls time up to 8 candidates (CUDA events, no synchronisation)
 * and keep the fastest; while that runs, equal calls may differ in the last bits.
 * NVTE_GEMM_AUTOTUNE_LOG=1 prints each choice to stderr. NVTE_GEMM_AUTOTUNE_CACHE=<file>
 * appends the choices to the file; a process started with the file (tuning off) runs them from
 * each shape's first call.
 *
 * Epilogues (grad = false): bias [m] is added to every row of D; with pre_gelu_out,
 * pre_gelu_out = result (+ bias) and D = gelu_tanh(pre_gelu_out).
 * Epilogues (grad = true): with pre_gelu_out, D = result * dgelu(pre_gelu_out) and
 * bias (if given) receives the column sums of that D ([m]); without pre_gelu_out,
 * bias (if given) receives the bias gradient of op(B): bias[i] = sum_k op(B)[i, k] ([n]).
 */
#ifndef TRANSFORMER_ENGINE_GEMM_H_
#define TRANSFORMER_ENGINE_GEMM_H_

#include <stdbool.h>

#include "transformer_engine.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct NVTEMatmulConfig_ *NVTEMatmulConfig;

/** Options of nvte_cublas_gemm_v2. Numbering as in TE. */
typedef enum NVTEMatmulConfigAttribute {
  kNVTEMatmulConfigBiasTensor = 0,          /**< NVTETensor: bias added in the epilogue */
  kNVTEMatmulConfigDBiasTensor = 1,         /**< NVTETensor: receives the bias gradient */
  kNVTEMatmulConfigWithGELUEpilogue = 2,    /**< bool */
  kNVTEMatmulConfigWithDGELUEpilogue = 3,   /**< bool */
  kNVTEMatmulConfigEpilogueAuxTensor = 4,   /**< NVTETensor: GELU input (out for GELU, in for dGELU) */
  kNVTEMatmulConfigUseSplitAccumulator = 5, /**< bool: FP8 GEMM accumulates in full precision */
  kNVTEMatmulConfigSMCount = 6,             /**< int: SMs to use, 0 = all */
  kNVTEMatmulConfigNumAttributes
} NVTEMatmulConfigAttribute;

NVTE_API NVTEMatmulConfig nvte_create_matmul_config(void);
/** \brief Read an attribute into buf (size_in_bytes at least its size); *size_written (may be
 *  NULL) receives its size; with buf NULL only the size is reported. */
NVTE_API NVTEStatus nvte_get_matmul_config_attribute(NVTEMatmulConfig config,
                                                     NVTEMatmulConfigAttribute attr, void *buf,
                                                     size_t size_in_bytes, size_t *size_written);
NVTE_API NVTEStatus nvte_set_matmul_config_attribute(NVTEMatmulConfig config,
                                                     NVTEMatmulConfigAttribute attr,
                                                     const void *buf, size_t size_in_bytes);
NVTE_API void nvte_destroy_matmul_config(NVTEMatmulConfig config);

/** \brief D = op(B) @ op(A) (+ epilogues), see the file comment.
 *  \param[in] bias          optional (NULL or empty): see epilogues; dtype of D (or bf16/fp32).
 *  \param[in,out] pre_gelu_out optional: GELU input, written when !grad, read when grad.
 *  \param[in,out] workspace  scratch (bytes from nvte_cublas_gemm_workspace_size); may be empty on CPU.
 *                           On CUDA it is needed (256 bytes at least) for an FP8 D with an amax
 *                           and for FP8 scale factors that are not 16-byte aligned (cuBLASLt reads
 *                           an aligned copy made on `stream`).
 *  \param[in] accumulate    D += result instead of D = result (non-FP8 D only).
 *  \param[in] use_split_accumulator  FP8: accumulate in full precision (always true on CPU).
 *  \param[in] math_sm_count SMs to use on the GPU (0 = all); ignored on CPU. */
NVTE_API NVTEStatus nvte_cublas_gemm(const NVTETensor A, const NVTETensor B, NVTETensor D,
                                     const NVTETensor bias, NVTETensor pre_gelu_out, bool transa,
                                     bool transb, bool grad, NVTETensor workspace, bool accumulate,
                                     bool use_split_accumulator, int math_sm_count,
                                     cudaStream_t stream);

/** \brief D = alpha * op(B) @ op(A) + beta * C (+ epilogues from config).
 *  alpha and beta are host pointers to float; C may equal D or be NULL (then beta must be 0
 *  or C is taken to be D). config may be NULL (no epilogue). */
NVTE_API NVTEStatus nvte_cublas_gemm_v2(int transa, int transb, const float *alpha,
                                        const NVTETensor A, const NVTETensor B, const float *beta,
                                        const NVTETensor C, NVTETensor D, NVTETensor workspace,
                                        NVTEMatmulConfig config, cudaStream_t stream);

/** \brief num_gemms independent nvte_cublas_gemm calls sharing the flags.
 *  bias and pre_gelu_out entries may be NULL/empty; workspace may hold fewer entries
 *  than num_gemms (they are reused round-robin) or be NULL on the CPU. */
NVTE_API NVTEStatus nvte_multi_tensor_gemm(const NVTETensor *A, const NVTETensor *B, NVTETensor *D,
                                           const NVTETensor *bias, NVTETensor *pre_gelu_out,
                                           const int num_gemms, bool transa, bool transb, bool grad,
                                           NVTETensor *workspace, bool accumulate,
                                           bool use_split_accumulator, int math_sm_count,
                                           cudaStream_t stream);

/** \brief batch independent GEMMs over dense stacks, D[i] = op(B[i]) @ op(A[i]) (+ D[i] with
 *  accumulate): attention's score and context products, for example. On the GPU one strided-batched
 *  cuBLASLt call (not autotuned); on the CPU one GEMM per matrix.
 *  \param[in]  A, B        rowwise [batch, rows, cols], float32 / float16 / bfloat16 (no FP8, no
 *                          epilogue); each matrix as in nvte_cublas_gemm.
 *  \param[in,out] D        [batch, n, m], float32 / float16 / bfloat16.
 *  \param[in]  transa, transb, accumulate, workspace, stream  as in nvte_cublas_gemm. */
NVTE_API NVTEStatus nvte_batched_gemm(const NVTETensor A, const NVTETensor B, NVTETensor D, bool transa,
                                      bool transb, bool accumulate, NVTETensor workspace, cudaStream_t stream);

/** \brief Bytes of workspace one GEMM wants on the given backend (0 on the CPU). */
NVTE_API NVTEStatus nvte_cublas_gemm_workspace_size(NVTEBackend backend, size_t *bytes);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* TRANSFORMER_ENGINE_GEMM_H_ */
