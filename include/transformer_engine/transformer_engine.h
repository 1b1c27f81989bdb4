/*
 * transformer_engine.h - handles, data types, status codes and version of the
 * transformer_engine C API.
 *
 * Source-compatible with the public C API of NVIDIA Transformer Engine 2.x:
 * the same type, enum and function names, enum numbering and argument order.
 * Differences, all of which keep TE call sites compiling:
 *  - every compute entry point returns an NVTEStatus (TE returns void) and no
 *    C++ exception ever crosses the ABI; nvte_get_last_error() gives the text;
 *  - NVTETensor, NVTEQuantizationConfig and NVTEMatmulConfig are pointers to
 *    distinct incomplete structs, so passing the wrong kind is a compile error;
 *  - workspace sizes can be queried explicitly (nvte_<op>_workspace_size).
 *
 * Data may live in host memory (CPU backend) or in CUDA device memory (CUDA
 * backend); each call runs where its tensors live. A call mixing host and
 * device tensors fails with NVTE_ERROR_INVALID_ARGUMENT.
 */
#ifndef TRANSFORMER_ENGINE_TRANSFORMER_ENGINE_H_
#define TRANSFORMER_ENGINE_TRANSFORMER_ENGINE_H_

#include <stddef.h>
#include <stdint.h>

#include "cuda_compat.h"

#if defined(_WIN32)
#define NVTE_API __declspec(dllexport)
#else
#define NVTE_API __attribute__((visibility("default")))
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------- version */
#define NVTE_VERSION_MAJOR 0
#define NVTE_VERSION_MINOR 1
#define NVTE_VERSION_PATCH 0
/** Packed as major*10000 + minor*100 + patch. */
#define NVTE_VERSION (NVTE_VERSION_MAJOR * 10000 + NVTE_VERSION_MINOR * 100 + NVTE_VERSION_PATCH)

/** \brief Version of the loaded library (NVTE_VERSION of its build).
 *  Adapters compare it with the NVTE_VERSION they were compiled against. */
NVTE_API int nvte_get_version(void);

/* ----------------------------------------------------------------- status */
/** Result of every compute entry point. Values are append-only. */
typedef enum NVTEStatus {
  NVTE_SUCCESS = 0,
  NVTE_ERROR_INVALID_ARGUMENT = 1, /**< bad shape, dtype, null pointer, mixed devices, ... */
  NVTE_ERROR_NOT_SUPPORTED = 2,    /**< valid request this build or device cannot run */
  NVTE_ERROR_CUDA = 3,             /**< a CUDA / cuBLASLt / cuDNN call failed */
  NVTE_ERROR_OUT_OF_MEMORY = 4,
  NVTE_ERROR_INTERNAL = 5
} NVTEStatus;

/** \brief Message of the last failed call on this thread ("" if none).
 *  The pointer stays valid until the next failing call on the same thread. */
NVTE_API const char *nvte_get_last_error(void);

/** \brief Reset this thread's last error to "". */
NVTE_API void nvte_clear_last_error(void);

/* ------------------------------------------------------------------ dtypes */
/** Element types; numbering matches TE >= 2.4. Append-only. */
typedef enum NVTEDType {
  kNVTEByte = 0,
  kNVTEInt16 = 1,
  kNVTEInt32 = 2,
  kNVTEInt64 = 3,
  kNVTEFloat32 = 4,
  kNVTEFloat16 = 5,   /**< IEEE half (E5M10) */
  kNVTEBFloat16 = 6,  /**< bfloat16 (E8M7) */
  kNVTEFloat8E4M3 = 7, /**< OCP E4M3 "fn": max 448, no infinities */
  kNVTEFloat8E5M2 = 8, /**< OCP E5M2: max 57344 */
  kNVTEFloat8E8M0 = 9, /**< power-of-two scale factors (MX formats) */
  kNVTEFloat4E2M1 = 10,
  kNVTENumTypes
} NVTEDType;

/* ------------------------------------------------------------------ shapes */
#define NVTE_MAX_DIMS 15
/** Tensor shape: data[0..ndim) are the dimensions, row-major. */
typedef struct NVTEShape {
  size_t data[NVTE_MAX_DIMS];
  size_t ndim;
} NVTEShape;

/** \brief Build a shape from ndim sizes (ndim <= NVTE_MAX_DIMS; extra dims are dropped
 *  and reported through nvte_get_last_error). */
NVTE_API NVTEShape nvte_make_shape(const size_t *data, size_t ndim);

/** A non-owning view of one buffer: pointer, element type and shape. */
typedef struct NVTEBasicTensor {
  void *data_ptr;
  NVTEDType dtype;
  NVTEShape shape;
} NVTEBasicTensor;

/** Which buffer of a tensor to set or get. Numbering as in TE. */
typedef enum NVTETensorParam {
  kNVTERowwiseData = 0,       /**< data in its logical (row-major) layout */
  kNVTEColumnwiseData = 1,    /**< the same data transposed (2D view [last dim, rest]) */
  kNVTEScale = 2,             /**< float32[1]: multiply before casting to FP8 */
  kNVTEAmax = 3,              /**< float32[1]: max |x| seen, updated by producing ops */
  kNVTERowwiseScaleInv = 4,   /**< float32[1]: 1/scale, to decode rowwise data */
  kNVTEColumnwiseScaleInv = 5, /**< float32[1]: 1/scale, to decode columnwise data */
  kNVTEColumnwiseAmax = 6,
  kNVTENumTensorParams
} NVTETensorParam;

/** Granularity of FP8 scaling. Only NVTE_DELAYED_TENSOR_SCALING (one scale per
 *  tensor; also used for unquantized tensors) is implemented; others are
 *  accepted by nvte_create_tensor and rejected by ops with NVTE_ERROR_NOT_SUPPORTED. */
typedef enum NVTEScalingMode {
  NVTE_DELAYED_TENSOR_SCALING = 0,
  NVTE_MXFP8_1D_SCALING = 1,
  NVTE_BLOCK_SCALING_1D = 2,
  NVTE_BLOCK_SCALING_2D = 3,
  NVTE_NVFP4_1D_SCALING = 4,
  NVTE_INVALID_SCALING = 100
} NVTEScalingMode;

/* ----------------------------------------------------------------- tensors */
/** Opaque tensor handle. A tensor never owns memory: it records pointers,
 *  dtypes and shapes of its buffers (see NVTETensorParam). */
typedef struct NVTETensor_ *NVTETensor;

/** \brief Create an empty tensor handle (all buffers null).
 *  \return the handle, or NULL on allocation failure. Free with nvte_destroy_tensor. */
NVTE_API NVTETensor nvte_create_tensor(NVTEScalingMode scaling_mode);

/** \brief Destroy a handle made by nvte_create_tensor (NULL is ignored). Buffers are not freed. */
NVTE_API void nvte_destroy_tensor(NVTETensor tensor);

/** \brief Set one buffer of a tensor. *param is copied; the memory it points to is borrowed.
 *  \param[in,out] tensor  pointer to the handle (TE 2.x signature).
 *  \param[in] param_name  which buffer.
 *  \param[in] param       pointer, dtype and shape of the buffer. */
NVTE_API NVTEStatus nvte_set_tensor_param(NVTETensor *tensor, NVTETensorParam param_name,
                                          const NVTEBasicTensor *param);

/** \brief Get one buffer of a tensor (data_ptr NULL when unset). */
NVTE_API NVTEBasicTensor nvte_get_tensor_param(const NVTETensor tensor, NVTETensorParam param_name);

/** \brief TE 2.x "_v2" setter / getter: buf points to an NVTEBasicTensor (size_in_bytes = its
 *  size); the getter with buf NULL only writes the size to size_written. */
NVTE_API NVTEStatus nvte_set_tensor_param_v2(NVTETensor tensor, NVTETensorParam param,
                                             const void *buf, size_t size_in_bytes);
NVTE_API NVTEStatus nvte_get_tensor_param_v2(const NVTETensor tensor, NVTETensorParam param,
                                             void *buf, size_t size_in_bytes, size_t *size_written);

/** Accessors. For a tensor with only columnwise data, the logical shape and dtype
 *  come from the columnwise buffer (its shape transposed back). */
NVTE_API NVTEDType nvte_tensor_type(const NVTETensor tensor);
NVTE_API NVTEShape nvte_tensor_shape(const NVTETensor tensor);
NVTE_API NVTEShape nvte_tensor_columnwise_shape(const NVTETensor tensor);
NVTE_API size_t nvte_tensor_ndims(const NVTETensor tensor);
NVTE_API size_t nvte_tensor_size(const NVTETensor tensor, size_t dim);
NVTE_API size_t nvte_tensor_numel(const NVTETensor tensor);
NVTE_API size_t nvte_tensor_element_size(const NVTETensor tensor);
NVTE_API size_t nvte_tensor_size_bytes(const NVTETensor tensor);
NVTE_API void *nvte_tensor_data(const NVTETensor tensor);
NVTE_API void *nvte_tensor_columnwise_data(const NVTETensor tensor);
NVTE_API float *nvte_tensor_amax(const NVTETensor tensor);
NVTE_API float *nvte_tensor_scale(const NVTETensor tensor);
NVTE_API float *nvte_tensor_scale_inv(const NVTETensor tensor);
NVTE_API float *nvte_tensor_columnwise_scale_inv(const NVTETensor tensor);
NVTE_API NVTEShape nvte_tensor_scale_inv_shape(const NVTETensor tensor);
NVTE_API NVTEScalingMode nvte_tensor_scaling_mode(const NVTETensor tensor);

/** \brief Size in bytes of one element of dtype (FP4 reports 1: two values per byte). */
NVTE_API size_t nvte_dtype_size(NVTEDType dtype);

/** \brief Name of a dtype ("float32", "float8_e4m3", ...), "invalid" if out of range. */
NVTE_API const char *nvte_dtype_name(NVTEDType dtype);

/** \brief Zero every buffer of the tensor (data, columnwise data, amax, scale_inv);
 *  scale is left alone. Runs on `stream` for device data. */
NVTE_API NVTEStatus nvte_zero_tensor(const NVTETensor tensor, cudaStream_t stream);

/* ------------------------------------------------------------ tensor packs */
#define NVTE_TENSOR_PACK_MAX_SIZE 10
/** A small list of tensors (auxiliary outputs, e.g. of fused attention). */
typedef struct NVTETensorPack {
  NVTETensor tensors[NVTE_TENSOR_PACK_MAX_SIZE];
  size_t size;
} NVTETensorPack;

/** \brief Create NVTE_TENSOR_PACK_MAX_SIZE empty tensors in the pack (size is set to 0). */
NVTE_API NVTEStatus nvte_tensor_pack_create(NVTETensorPack *pack);
/** \brief Destroy the tensors made by nvte_tensor_pack_create. */
NVTE_API NVTEStatus nvte_tensor_pack_destroy(NVTETensorPack *pack);

/* --------------------------------------------------- quantization config */
typedef struct NVTEQuantizationConfig_ *NVTEQuantizationConfig;

/** Options of quantization (current scaling and nvte_quantize_v2). Numbering as in TE. */
typedef enum NVTEQuantizationConfigAttribute {
  kNVTEQuantizationConfigForcePow2Scales = 0, /**< bool: round scales down to powers of 2 */
  kNVTEQuantizationConfigAmaxEpsilon = 1,     /**< float: amax is clamped to at least this */
  kNVTEQuantizationConfigNoopTensor = 2,      /**< NVTETensor: float32[1]; 1 = skip the op */
  kNVTEQuantizationConfigNumAttributes
} NVTEQuantizationConfigAttribute;

/** \brief Create a config with defaults (no pow2 rounding, epsilon 0, no noop tensor). */
NVTE_API NVTEQuantizationConfig nvte_create_quantization_config(void);
/** \brief Read an attribute into buf (size_in_bytes at least the attribute's size);
 *  *size_written (may be NULL) receives the attribute's size. With buf NULL only the size is
 *  reported (the call succeeds). */
NVTE_API NVTEStatus nvte_get_quantization_config_attribute(NVTEQuantizationConfig config,
                                                           NVTEQuantizationConfigAttribute attr,
                                                           void *buf, size_t size_in_bytes,
                                                           size_t *size_written);
/** \brief Set an attribute from buf (size_in_bytes must be the attribute's size). */
NVTE_API NVTEStatus nvte_set_quantization_config_attribute(NVTEQuantizationConfig config,
                                                           NVTEQuantizationConfigAttribute attr,
                                                           const void *buf, size_t size_in_bytes);
NVTE_API void nvte_destroy_quantization_config(NVTEQuantizationConfig config);

/* ----------------------------------------------------------------- backends */
/** Where a call runs; decided from where its tensors' data lives. */
typedef enum NVTEBackend {
  kNVTEBackendCPU = 0,
  kNVTEBackendCUDA = 1
} NVTEBackend;

/** \brief 1 if FP8 GEMMs accept layouts other than TN on the current device (CPU: 1). */
NVTE_API int nvte_is_non_tn_fp8_gemm_supported(void);

/** \brief 1 if this build contains the CUDA backend and a CUDA device is visible. */
NVTE_API int nvte_cuda_backend_available(void);

/** \brief Backend a pointer belongs to (host memory or a CUDA allocation). */
NVTE_API NVTEBackend nvte_pointer_backend(const void *ptr);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* TRANSFORMER_ENGINE_TRANSFORMER_ENGINE_H_ */
