// cublaslt_loader.h - cuBLASLt opened at run time. The library is never linked: the
// first GEMM on a CUDA tensor dlopens it (NVTE_CUBLASLT_PATH, then the soname, then the
// toolkit folders) and resolves every entry point once. cublasLt.h is included for its
// types and enums only; decltype of its declarations gives the pointer types.
#pragma once

#include <cublasLt.h>

#include <string>

namespace nvte::cuda {

struct CublasLtApi {
  decltype(&cublasLtCreate) Create = nullptr;
  decltype(&cublasLtDestroy) Destroy = nullptr;
  decltype(&cublasLtGetVersion) GetVersion = nullptr;
  decltype(&cublasLtGetStatusString) GetStatusString = nullptr;
  decltype(&cublasLtMatmulDescCreate) MatmulDescCreate = nullptr;
  decltype(&cublasLtMatmulDescDestroy) MatmulDescDestroy = nullptr;
  decltype(&cublasLtMatmulDescSetAttribute) MatmulDescSetAttribute = nullptr;
  decltype(&cublasLtMatrixLayoutCreate) MatrixLayoutCreate = nullptr;
  decltype(&cublasLtMatrixLayoutDestroy) MatrixLayoutDestroy = nullptr;
  decltype(&cublasLtMatrixLayoutSetAttribute) MatrixLayoutSetAttribute = nullptr;
  decltype(&cublasLtMatmulPreferenceCreate) MatmulPreferenceCreate = nullptr;
  decltype(&cublasLtMatmulPreferenceDestroy) MatmulPreferenceDestroy = nullptr;
  decltype(&cublasLtMatmulPreferenceSetAttribute) MatmulPreferenceSetAttribute = nullptr;
  decltype(&cublasLtMatmulAlgoGetHeuristic) MatmulAlgoGetHeuristic = nullptr;
  decltype(&cublasLtMatmulAlgoConfigGetAttribute) MatmulAlgoConfigGetAttribute = nullptr;
  decltype(&cublasLtMatmul) Matmul = nullptr;

  std::string path;     // the file that was opened
  size_t version = 0;   // cublasLtGetVersion(), e.g. 130002
};

// The resolved API; loads on first use (thread-safe). Throws NVTE_ERROR_NOT_SUPPORTED,
// naming every path tried, when no usable cuBLASLt is found.
const CublasLtApi &cublaslt();

// "CUBLAS_STATUS_...: text" for messages.
std::string cublas_status_str(cublasStatus_t s);

}  // namespace nvte::cuda
