// cuda/gemm.h - the GEMM of gemm.h on CUDA tensors through cuBLASLt, on operands the API
// layer has already validated and resolved (which buffer of each operand, trans flags
// in cuBLAS terms, FP8 scale_inv device pointers). Plain C++: no CUDA headers.
#pragma once

#include <cstddef>
#include <cstdint>

#include "../common/tensor.h"

namespace nvte::cuda {

// One cuBLAS operand: a row-major stored buffer [rows, cols] (so column-major cols x rows
// with leading dimension cols) used with op = trans ? T : N.
struct GemmOperand {
  const void *data = nullptr;
  NVTEDType dtype = kNVTEFloat32;
  bool trans = false;
  size_t rows = 0, cols = 0;
  const float *scale_inv = nullptr;  // FP8 only: device pointer, the cuBLASLt A/B scale
};

// cuBLAS terms: D (m x n, column-major, ld m) = alpha * op(A) (m x k) * op(B) (k x n) + beta * C,
// i.e. row-major D [n, m] = op_te(B) @ op_te(A) of gemm.h.
struct GemmArgs {
  GemmOperand a, b;
  size_t m = 0, n = 0, k = 0;
  float alpha = 1.0f, beta = 0.0f;
  const Tensor *c = nullptr;  // read when beta != 0 (may be d)
  Tensor *d = nullptr;
  const Tensor *bias = nullptr;  // forward bias [m]
  Tensor *dbias = nullptr;       // bias gradient: [m] with dgelu, else [n] (of op(B))
  Tensor *aux = nullptr;         // pre_gelu_out [n, m]: written with gelu, read with dgelu
  bool gelu = false, dgelu = false;
  void *workspace = nullptr;  // device scratch (may be null: 0 bytes)
  size_t workspace_bytes = 0;
  bool use_split_accumulator = true;  // FP8: false selects cuBLASLt's fast accumulation
  int sm_count = 0;                   // 0: all SMs
  // Strided batch: A, B, C and D are `batch` dense matrices one after another (strides a.rows *
  // a.cols, b.rows * b.cols and m * n elements), one cuBLASLt call; no epilogue or FP8 with > 1.
  size_t batch = 1;
};

void gemm(const GemmArgs &g, cudaStream_t stream);

// Bytes of workspace one GEMM wants: cuBLASLt's 32 MiB plus the FP8 amax scratch.
size_t gemm_workspace_size();

// True when the current device runs FP8 GEMMs in every layout (not only TN).
bool non_tn_fp8_supported();

// ------------------------------------------------------ kernels (gemm_epilogue.cu)
// FP8 D: *amax = fmaxf(*amax, *amax_tmp) (amax_tmp null: unchanged) and scale_inv = 1 / *scale.
void launch_fp8_output_finalize(const float *amax_tmp, float *amax, const float *scale, float *scale_inv,
                                float *col_scale_inv, cudaStream_t stream);
// D [n, m] (row-major, non-FP8): D = gelu(D + bias) with aux = D + bias, or D = D + bias
// (bias [m] or null; aux null: not stored). The epilogue of FP8 GEMMs with a float32 bias/aux.
void launch_bias_gelu(void *d, NVTEDType td, const void *bias, NVTEDType tb, void *aux, NVTEDType ta, size_t m,
                      size_t n, bool gelu, cudaStream_t stream);
// Non-FP8 D with an amax buffer: *amax = max(*amax, max |d|) over numel elements.
void launch_amax_update(const void *d, NVTEDType dtype, size_t numel, float *amax, cudaStream_t stream);


// ------------------------------------------------- autotune checks (gemm_check.cu)
// *sum += a position-dependent hash of the bytes of data (order-free: any grid). False when
// the launch failed (the error is consumed: the caller gives up tuning, not the GEMM).
bool launch_output_hash(const void *data, size_t bytes, uint64_t salt, unsigned long long *sum,
                        cudaStream_t stream);
// *flag = 1 when sums[0] != sums[1] (flag: device pointer, may be mapped host memory).
bool launch_hash_compare(const unsigned long long *sums, int *flag, cudaStream_t stream);

}  // namespace nvte::cuda
