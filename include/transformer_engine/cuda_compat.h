/*
 * cuda_compat.h - the only public header that names a CUDA type.
 *
 * Every nvte_* entry point takes a cudaStream_t. When the CUDA runtime headers
 * are visible we use their definition; otherwise we declare the same opaque
 * pointer type so that every public header compiles on a machine without the
 * CUDA toolkit (and from plain C99). Pass NULL (0) for the default stream or
 * for host (CPU) data, where the stream is ignored.
 */
#ifndef TRANSFORMER_ENGINE_CUDA_COMPAT_H_
#define TRANSFORMER_ENGINE_CUDA_COMPAT_H_

#if defined(NVTE_HAVE_CUDA_RUNTIME_HEADERS) || defined(__CUDACC__)
#include <cuda_runtime_api.h>
#elif !defined(__DRIVER_TYPES_H__)
/* Same spelling as the CUDA runtime's definition, so the two are interchangeable. */
typedef struct CUstream_st *cudaStream_t;
#endif

#endif /* TRANSFORMER_ENGINE_CUDA_COMPAT_H_ */
