// api/normalization.cpp - nvte_layernorm_* / nvte_rmsnorm_* entry points: validate, pick the backend, run.
#include "transformer_engine/normalization.h"

#include <cmath>

#include "../common/backend.h"
#include "../cpu/normalization.h"
#include "alias_checks.h"
#ifdef NVTE_WITH_CUDA
#include "../cuda/normalization.h"
#endif

using namespace nvte;

namespace {

// An x-like [N, H] input in high precision (FP8 inputs are not part of the API); returns its 2D view.
Dims2 check_input(const Tensor &t, const char *name) {
  const NVTEDType dt = logical_dtype(t);
  NVTE_CHECK(is_high_precision(dt), name, " has dtype ", dtype_name(dt),
             "; expected float32, float16 or bfloat16");
  NVTE_CHECK(buffer_set(t.params[kNVTERowwiseData]), name, " needs rowwise data");
  return flat2d(logical_shape(t));
}

// A tensor that must have x's 2D view [N, H] (z, dz, dx, add).
void check_like_x(const Tensor &t, const char *name, const Tensor &x, Dims2 xd) {
  const NVTEShape s = logical_shape(t);
  const Dims2 d = flat2d(s);
  NVTE_CHECK(d.rows == xd.rows && d.cols == xd.cols, name, " has shape ", shape_str(s), " but x has shape ",
             shape_str(logical_shape(x)), "; expected the same [N, H] = [", xd.rows, ", ", xd.cols, "]");
}

// gamma, beta, dgamma, dbeta: high precision, H elements, last dim H.
void check_vec(const Tensor &t, const char *name, size_t h) {
  const NVTEBasicTensor &b = t.params[kNVTERowwiseData];
  NVTE_CHECK(buffer_set(b), name, " needs rowwise data");
  NVTE_CHECK(is_high_precision(b.dtype), name, " has dtype ", dtype_name(b.dtype),
             "; expected float32, float16 or bfloat16");
  NVTE_CHECK(numel(b.shape) == h && (b.shape.ndim == 0 ? h == 1 : b.shape.data[b.shape.ndim - 1] == h), name,
             " has shape ", shape_str(b.shape), "; expected [", h, "] (H = last dim of x)");
}

// mu, rsigma: float32 with one value per row.
void check_stats(const Tensor &t, const char *name, size_t n) {
  const NVTEBasicTensor &b = t.params[kNVTERowwiseData];
  NVTE_CHECK(buffer_set(b), name, " needs rowwise data");
  NVTE_CHECK(b.dtype == kNVTEFloat32, name, " has dtype ", dtype_name(b.dtype), "; expected float32");
  NVTE_CHECK(numel(b.shape) == n, name, " has shape ", shape_str(b.shape), " (", numel(b.shape),
             " elements); expected [", n, "] (N = rows of x)");
}

void check_epsilon(float eps) {
  NVTE_CHECK(eps >= 0.0f, "epsilon must be >= 0, got ", eps);  // NaN fails too
}

// The CPU backend needs no scratch memory: a query call (NULL workspace data) is told
// 0 bytes and is computed right away; a given workspace is left untouched.
void no_workspace(NVTETensor workspace) {
  if (workspace == nullptr) return;
  NVTEBasicTensor &b = workspace->params[kNVTERowwiseData];
  if (b.data_ptr != nullptr) return;
  b.dtype = kNVTEByte;
  b.shape.ndim = 1;
  b.shape.data[0] = 0;
}

#ifdef NVTE_WITH_CUDA
// The CUDA backward's workspace (TE convention): a workspace whose data pointer is NULL is
// told the bytes needed (shape [bytes], dtype byte) and, when that is > 0, nothing is
// computed (returns false). Otherwise the given buffer must be large enough.
bool cuda_workspace(NVTETensor workspace, size_t bytes, void **data) {
  *data = nullptr;
  if (workspace == nullptr) {
    NVTE_CHECK(bytes == 0, "the CUDA normalization backward needs a workspace of ", bytes,
               " bytes; pass a workspace tensor (a NULL data pointer queries the size)");
    return true;
  }
  NVTEBasicTensor &b = workspace->params[kNVTERowwiseData];
  if (b.data_ptr == nullptr) {
    b.dtype = kNVTEByte;
    b.shape.ndim = 1;
    b.shape.data[0] = bytes;
    return bytes == 0;
  }
  const size_t have = numel(b.shape) * dtype_size(b.dtype);
  NVTE_CHECK(have >= bytes, "workspace has ", have, " bytes (shape ", shape_str(b.shape), ", dtype ",
             dtype_name(b.dtype), "); the CUDA normalization backward needs ", bytes);
  *data = b.data_ptr;
  return true;
}
#endif

// ln: LayerNorm (beta, mu present); otherwise RMSNorm.
void norm_fwd(const char *op, bool ln, const NVTETensor x, const NVTETensor gamma, const NVTETensor beta, float eps,
              NVTETensor z, NVTETensor mu, NVTETensor rsigma, NVTETensor workspace, bool zc, cudaStream_t stream) {
  const Tensor &xt = require(x, "x");
  const Tensor &gt = require(gamma, "gamma");
  const Tensor *bt = ln ? &require(beta, "beta") : nullptr;
  Tensor &zt = require_mut(z, "z");
  Tensor *mt = ln ? &require_mut(mu, "mu") : nullptr;
  Tensor &rt = require_mut(rsigma, "rsigma");
  const Dims2 d = check_input(xt, "x");
  check_vec(gt, "gamma", d.cols);
  if (bt) check_vec(*bt, "beta", d.cols);
  check_like_x(zt, "z", xt, d);
  if (mt) check_stats(*mt, "mu", d.rows);
  check_stats(rt, "rsigma", d.rows);
  check_epsilon(eps);
  // z may be exactly x (same dtype and shape): the CPU and every CUDA forward kernel read a row
  // of x (or, in norm_fwd_any's last pass, each element) before writing it. The statistics and
  // the columnwise z share no memory with anything.
  api::check_alias(zt, "z", xt, "x");
  api::check_disjoint(zt, "z", gt, "gamma", "every row of z reads all of gamma");
  if (bt) api::check_disjoint(zt, "z", *bt, "beta", "every row of z reads all of beta");
  const char *stats_why = "the row statistics are written while other rows are still being read";
  for (Tensor *st : {mt, &rt}) {
    if (st == nullptr) continue;
    const char *sn = st == mt ? "mu" : "rsigma";
    api::check_disjoint(*st, sn, xt, "x", stats_why);
    api::check_disjoint(*st, sn, gt, "gamma", stats_why);
    if (bt) api::check_disjoint(*st, sn, *bt, "beta", stats_why);
    api::check_disjoint(*st, sn, zt, "z", stats_why);
  }
  if (mt) api::check_disjoint(*mt, "mu", rt, "rsigma", "mu and rsigma are separate outputs");
  switch (backend_of({{"x", x}, {"gamma", gamma}, {"beta", beta}, {"z", z}, {"mu", mu},
                      {"rsigma", rsigma}, {"workspace", workspace}})) {
    case Backend::CPU:
      no_workspace(workspace);
      return cpu::norm_fwd(xt, gt, bt, eps, zt, mt, rt, zc);
    case Backend::CUDA:
#ifdef NVTE_WITH_CUDA
      no_workspace(workspace);  // the forward needs no scratch memory either
      return cuda::norm_fwd(xt, gt, bt, eps, zt, mt, rt, zc, stream);
#else
      cuda_not_built(op);
#endif
  }
}

void norm_bwd(const char *op, bool ln, const NVTETensor dz, const NVTETensor x, const NVTETensor add,
              const NVTETensor mu, const NVTETensor rsigma, const NVTETensor gamma, NVTETensor dx,
              NVTETensor dgamma, NVTETensor dbeta, NVTETensor workspace, bool zc, bool with_add, int sm_hint,
              cudaStream_t stream) {
  const Tensor &dzt = require(dz, "dz");
  const Tensor &xt = require(x, "x");
  const Tensor *at = with_add ? &require(add, "add") : nullptr;
  const Tensor *mt = ln ? &require(mu, "mu") : nullptr;
  const Tensor &rt = require(rsigma, "rsigma");
  const Tensor &gt = require(gamma, "gamma");
  Tensor &dxt = require_mut(dx, "dx");
  Tensor &dgt = require_mut(dgamma, "dgamma");
  Tensor *dbt = ln ? &require_mut(dbeta, "dbeta") : nullptr;
  const Dims2 d = check_input(xt, "x");
  check_input(dzt, "dz");
  check_like_x(dzt, "dz", xt, d);
  if (at) {
    check_input(*at, "add");
    check_like_x(*at, "add", xt, d);
  }
  if (mt) check_stats(*mt, "mu", d.rows);
  check_stats(rt, "rsigma", d.rows);
  check_vec(gt, "gamma", d.cols);
  check_like_x(dxt, "dx", xt, d);
  NVTE_CHECK(is_high_precision(logical_dtype(dxt)), "dx has dtype ", dtype_name(logical_dtype(dxt)),
             "; expected float32, float16 or bfloat16");
  check_vec(dgt, "dgamma", d.cols);
  if (dbt) check_vec(*dbt, "dbeta", d.cols);
  // dx may be exactly dz, x or add (same dtype and shape): the CPU and the CUDA kernels read a
  // row's dz, x and add (or each element of them, in norm_bwd_any's last pass) before writing
  // that row of dx.
  api::check_alias(dxt, "dx", dzt, "dz");
  api::check_alias(dxt, "dx", xt, "x");
  if (at) api::check_alias(dxt, "dx", *at, "add");
  const char *why = "dx must not overlap the statistics or gamma, which every row reads";
  if (mt) api::check_disjoint(dxt, "dx", *mt, "mu", why);
  api::check_disjoint(dxt, "dx", rt, "rsigma", why);
  api::check_disjoint(dxt, "dx", gt, "gamma", why);
  // dgamma and dbeta are written once every row's inputs have been read (CPU: after the row
  // loop; CUDA: by the finalize kernel), so they may overlap the inputs, but not dx or each other.
  const char *red_why = "dgamma and dbeta are sums over all rows, written after dx";
  api::check_disjoint(dgt, "dgamma", dxt, "dx", red_why);
  if (dbt) api::check_disjoint(*dbt, "dbeta", dxt, "dx", red_why);
  if (dbt) api::check_disjoint(dgt, "dgamma", *dbt, "dbeta", "dgamma and dbeta are separate outputs");
  switch (backend_of({{"dz", dz}, {"x", x}, {"add", add}, {"mu", mu}, {"rsigma", rsigma}, {"gamma", gamma},
                      {"dx", dx}, {"dgamma", dgamma}, {"dbeta", dbeta}, {"workspace", workspace}})) {
    case Backend::CPU:
      no_workspace(workspace);
      return cpu::norm_bwd(dzt, xt, at, mt, rt, gt, dxt, dgt, dbt, zc);
    case Backend::CUDA: {
#ifdef NVTE_WITH_CUDA
      const int sm = cuda::norm_sm(sm_hint);
      void *ws = nullptr;
      if (!cuda_workspace(workspace, cuda::norm_bwd_workspace_bytes(d.rows, d.cols, sm), &ws)) return;
      return cuda::norm_bwd(dzt, xt, at, mt, rt, gt, dxt, dgt, dbt, zc, ws, sm, stream);
#else
      (void)sm_hint;
      (void)stream;
      cuda_not_built(op);
#endif
    }
  }
}

}  // namespace

extern "C" {

NVTEStatus nvte_layernorm_fwd(const NVTETensor x, const NVTETensor gamma, const NVTETensor beta,
                              const float epsilon, NVTETensor z, NVTETensor mu, NVTETensor rsigma,
                              NVTETensor workspace, const int multiprocessorCount,
                              const bool zero_centered_gamma, cudaStream_t stream) {
  (void)multiprocessorCount;  // the forward's launch shape depends on the row length only
  return api_call("nvte_layernorm_fwd", [&] {
    norm_fwd("nvte_layernorm_fwd", true, x, gamma, beta, epsilon, z, mu, rsigma, workspace, zero_centered_gamma,
             stream);
  });
}

NVTEStatus nvte_layernorm_bwd(const NVTETensor dz, const NVTETensor x, const NVTETensor mu,
                              const NVTETensor rsigma, const NVTETensor gamma, NVTETensor dx,
                              NVTETensor dgamma, NVTETensor dbeta, NVTETensor workspace,
                              const int multiprocessorCount, const bool zero_centered_gamma,
                              cudaStream_t stream) {
  return api_call("nvte_layernorm_bwd", [&] {
    norm_bwd("nvte_layernorm_bwd", true, dz, x, nullptr, mu, rsigma, gamma, dx, dgamma, dbeta, workspace,
             zero_centered_gamma, false, multiprocessorCount, stream);
  });
}

NVTEStatus nvte_rmsnorm_fwd(const NVTETensor x, const NVTETensor gamma, const float epsilon, NVTETensor z,
                            NVTETensor rsigma, NVTETensor workspace, const int multiprocessorCount,
                            const bool zero_centered_gamma, cudaStream_t stream) {
  (void)multiprocessorCount;
  return api_call("nvte_rmsnorm_fwd", [&] {
    norm_fwd("nvte_rmsnorm_fwd", false, x, gamma, nullptr, epsilon, z, nullptr, rsigma, workspace,
             zero_centered_gamma, stream);
  });
}

NVTEStatus nvte_rmsnorm_bwd(const NVTETensor dz, const NVTETensor x, const NVTETensor rsigma,
                            const NVTETensor gamma, NVTETensor dx, NVTETensor dgamma, NVTETensor workspace,
                            const int multiprocessorCount, const bool zero_centered_gamma,
                            cudaStream_t stream) {
  return api_call("nvte_rmsnorm_bwd", [&] {
    norm_bwd("nvte_rmsnorm_bwd", false, dz, x, nullptr, nullptr, rsigma, gamma, dx, dgamma, nullptr, workspace,
             zero_centered_gamma, false, multiprocessorCount, stream);
  });
}

NVTEStatus nvte_rmsnorm_bwd_add(const NVTETensor dz, const NVTETensor x, const NVTETensor add,
                                const NVTETensor rsigma, const NVTETensor gamma, NVTETensor dx,
                                NVTETensor dgamma, NVTETensor workspace, const int multiprocessorCount,
                                const bool zero_centered_gamma, cudaStream_t stream) {
  return api_call("nvte_rmsnorm_bwd_add", [&] {
    norm_bwd("nvte_rmsnorm_bwd_add", false, dz, x, add, nullptr, rsigma, gamma, dx, dgamma, nullptr, workspace,
             zero_centered_gamma, true, multiprocessorCount, stream);
  });
}

// On CUDA: 0 for the forward; for the backward, the bytes nvte_*norm_bwd asks for on the
// current device with multiprocessorCount <= 0 (LayerNorm's, which RMSNorm's never exceed).
NVTEStatus nvte_normalization_workspace_size(const NVTETensor x, bool is_forward, size_t *bytes) {
  return api_call("nvte_normalization_workspace_size", [&] {
    NVTE_CHECK(bytes != nullptr, "bytes is a NULL pointer");
    const Tensor &xt = require(x, "x");
    switch (backend_of({{"x", x}})) {
      case Backend::CPU: *bytes = 0; return;
      case Backend::CUDA: {
#ifdef NVTE_WITH_CUDA
        const Dims2 d = flat2d(logical_shape(xt));
        *bytes = is_forward ? 0 : cuda::norm_bwd_workspace_bytes(d.rows, d.cols, cuda::norm_sm(0));
        return;
#else
        (void)xt;
        (void)is_forward;
        cuda_not_built("nvte_normalization_workspace_size");
#endif
      }
    }
  });
}

}  // extern "C"
