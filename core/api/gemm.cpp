// api/gemm.cpp - nvte_cublas_gemm* / nvte_multi_tensor_gemm / nvte_batched_gemm entry points:
// resolve the operands (layout, transpose, FP8 scale_inv), check shapes and epilogue arguments,
// pick the backend, run.
#include "transformer_engine/gemm.h"

#include <string>

#include "../common/backend.h"
#include "../common/config.h"
#include "../cpu/gemm.h"
#include "../cpu/parallel.h"
#include "alias_checks.h"
#ifdef NVTE_WITH_CUDA
#include "../cuda/gemm.h"
#endif

using namespace nvte;

namespace {

// One GEMM request in the terms of gemm.h, common to the v1, v2 and multi-tensor calls.
struct Request {
  NVTETensor A = nullptr, B = nullptr, C = nullptr, D = nullptr;
  bool transa = false, transb = false;
  float alpha = 1.0f, beta = 0.0f;
  NVTETensor bias = nullptr, dbias = nullptr, aux = nullptr, workspace = nullptr;
  bool gelu = false, dgelu = false;
  bool use_split_accumulator = true;  // CUDA FP8 only; the CPU always accumulates in full precision
  int sm_count = 0;                   // CUDA only
  cudaStream_t stream = nullptr;
  // nvte_batched_gemm: A, B, D are matrix 0 of dense stacks of `batch`, the next ones
  // stride_* bytes further on.
  size_t batch = 1, stride_a = 0, stride_b = 0, stride_d = 0;
};

// An optional argument: NULL handles and tensors with no memory and no elements count as
// absent; anything else must be a valid tensor (a NULL pointer with elements is an error).
NVTETensor optional(NVTETensor t, const char *name) {
  if (t == nullptr) return nullptr;
  auto empty = [](const NVTEBasicTensor &b) {
    return b.data_ptr == nullptr && (b.shape.ndim == 0 || numel(b.shape) == 0);
  };
  if (empty(t->params[kNVTERowwiseData]) && empty(t->params[kNVTEColumnwiseData])) return nullptr;
  require(t, name);
  return t;
}

bool is_float(NVTEDType t) { return is_high_precision(t) || is_fp8(t); }

// A buffer as a row-major 2D matrix. Rowwise data of shape [.., c] is [rows, c]; columnwise
// data (the transpose of the logical [rest.., N]) has shape [N, rest..] and is [N, prod(rest)].
Dims2 stored_dims(const NVTEBasicTensor &b, bool columnwise) {
  if (!columnwise || b.shape.ndim == 0) return flat2d(b.shape);
  const size_t r = b.shape.data[0];
  return {r, r ? numel(b.shape) / r : 0};
}

// op(t) as a strided matrix view. An operand with only columnwise data (its transpose,
// as FP8 tensors often carry) is used through that buffer with the trans flag flipped.
// *scale_inv receives the FP8 scale_inv pointer (read only once the backend is known).
cpu::MatView op_view(const Tensor &t, const char *name, bool trans, const float **scale_inv) {
  const NVTEBasicTensor &row = t.params[kNVTERowwiseData], &col = t.params[kNVTEColumnwiseData];
  const bool use_col = !buffer_set(row) && buffer_set(col);
  const NVTEBasicTensor &b = use_col ? col : row;
  NVTE_CHECK(is_float(b.dtype), name, " has dtype ", dtype_name(b.dtype),
             "; expected float32, float16, bfloat16, float8_e4m3 or float8_e5m2");
  const Dims2 s = stored_dims(b, use_col);
  const bool tr = use_col ? !trans : trans;
  cpu::MatView v;
  v.data = b.data_ptr;
  v.dtype = b.dtype;
  v.rows = tr ? s.cols : s.rows;
  v.cols = tr ? s.rows : s.cols;
  v.row_stride = tr ? 1 : s.cols;
  v.col_stride = tr ? s.cols : 1;
  if (is_fp8(b.dtype)) {
    const float *si = scalar_param(t, use_col ? kNVTEColumnwiseScaleInv : kNVTERowwiseScaleInv, name);
    if (si == nullptr && use_col) si = scalar_param(t, kNVTERowwiseScaleInv, name);
    NVTE_CHECK(si != nullptr, name, " is FP8 (", dtype_name(b.dtype), ") but has no scale_inv");
    *scale_inv = si;
  }
  return v;
}

std::string tf(bool b) { return b ? "true" : "false"; }

#ifdef NVTE_WITH_CUDA
// The buffer of t that the CUDA GEMM reads, as a cuBLAS operand. `trans` is the flag the
// caller gave; `tn_trans` the flag an FP8 operand must end up with when the device takes
// FP8 GEMMs only in TN layout (A: true, B: false). The rowwise buffer is used when it fits,
// else the columnwise buffer (the transpose) with the flag flipped, as on the CPU.
cuda::GemmOperand cuda_operand(const Tensor &t, const char *name, const char *flag, bool trans, bool tn_trans,
                               bool tn_only) {
  const NVTEBasicTensor &row = t.params[kNVTERowwiseData], &col = t.params[kNVTEColumnwiseData];
  const bool has_row = buffer_set(row), has_col = buffer_set(col);
  const NVTEDType dt = has_row ? row.dtype : col.dtype;
  bool use_col = !has_row && has_col;
  if (is_fp8(dt) && tn_only) {
    if (has_row && trans == tn_trans) {
      use_col = false;
    } else if (has_col && !trans == tn_trans) {
      use_col = true;
    } else {
      NVTE_FAIL(NVTE_ERROR_NOT_SUPPORTED, "FP8 GEMMs on this GPU (sm_89 / sm_90) run only in TN layout (",
                flag, " = ", tf(tn_trans), " in cuBLAS terms), but ", name, " is FP8 with ", flag, " = ", tf(trans),
                has_row ? " and has no columnwise data (its transpose) to use instead"
                        : " and has only columnwise data, which needs the opposite flag",
                "; quantize ", name, " with columnwise data, or use a non-FP8 GEMM");
    }
  }
  const NVTEBasicTensor &b = use_col ? col : row;
  cuda::GemmOperand o;
  o.data = b.data_ptr;
  o.dtype = b.dtype;
  o.trans = use_col ? !trans : trans;
  const Dims2 s = stored_dims(b, use_col);
  o.rows = s.rows;
  o.cols = s.cols;
  if (is_fp8(b.dtype)) {
    const float *si = scalar_param(t, use_col ? kNVTEColumnwiseScaleInv : kNVTERowwiseScaleInv, name);
    if (si == nullptr && use_col) si = scalar_param(t, kNVTERowwiseScaleInv, name);
    NVTE_CHECK(si != nullptr, name, " is FP8 (", dtype_name(b.dtype), ") but has no scale_inv");
    o.scale_inv = si;
  }
  return o;
}

size_t buffer_bytes(const NVTETensor t) {
  if (t == nullptr) return 0;
  const NVTEBasicTensor &b = t->params[kNVTERowwiseData];
  return b.data_ptr ? numel(b.shape) * dtype_size(b.dtype) : 0;
}

void run_cuda(const Request &r, size_t m, size_t n, size_t k) {
  const bool tn_only = !cuda::non_tn_fp8_supported();
  cuda::GemmArgs g;
  g.a = cuda_operand(*r.A, "A", "transa", r.transa, true, tn_only);
  g.b = cuda_operand(*r.B, "B", "transb", r.transb, false, tn_only);
  // cuBLAS shapes: op(A) is m x k, op(B) is k x n; a stored [rows, cols] buffer is cols x rows.
  const size_t am = g.a.trans ? g.a.rows : g.a.cols, ak = g.a.trans ? g.a.cols : g.a.rows;
  const size_t bk = g.b.trans ? g.b.rows : g.b.cols, bn = g.b.trans ? g.b.cols : g.b.rows;
  NVTE_CHECK(am == m && ak == k && bk == k && bn == n, "the buffers chosen for the CUDA GEMM (A [", g.a.rows, ", ",
             g.a.cols, "], B [", g.b.rows, ", ", g.b.cols, "]) do not give m=", m, " n=", n, " k=", k,
             "; check the columnwise data's shape (the transpose of the rowwise shape)");
  g.m = m;
  g.n = n;
  g.k = k;
  g.alpha = r.alpha;
  g.beta = r.beta;
  g.c = r.C;
  g.d = r.D;
  g.bias = r.bias;
  g.dbias = r.dbias;
  g.aux = (r.gelu || r.dgelu) ? r.aux : nullptr;
  g.gelu = r.gelu;
  g.dgelu = r.dgelu;
  g.workspace = r.workspace ? r.workspace->params[kNVTERowwiseData].data_ptr : nullptr;
  g.workspace_bytes = buffer_bytes(r.workspace);
  g.use_split_accumulator = r.use_split_accumulator;
  g.sm_count = r.sm_count;
  g.batch = r.batch;
  cuda::gemm(g, r.stream);
}
#endif

void check_mn(const NVTETensor t, const char *name, size_t n, size_t m) {
  const NVTEShape s = logical_shape(*t);
  const Dims2 d = flat2d(s);
  NVTE_CHECK(d.rows == n && d.cols == m, name, " has shape ", shape_str(s), "; expected [n=", n, ", m=", m,
             "] (the shape of D = op(B) @ op(A))");
}

void check_vector(const NVTETensor t, const char *name, size_t len, const char *what) {
  const NVTEShape s = logical_shape(*t);
  NVTE_CHECK(numel(s) == len && flat2d(s).rows == 1, name, " has shape ", shape_str(s), "; expected [", len,
             "] (", what, ")");
  NVTE_CHECK(is_high_precision(logical_dtype(*t)), name, " has dtype ", dtype_name(logical_dtype(*t)),
             "; expected float32, float16 or bfloat16");
}

// The CPU's batched GEMM: one GEMM per matrix, checked once (run). With at least as many matrices
// as threads the pool takes matrices (each GEMM then runs serially in its thread: small per-head
// products gain most); with fewer, each GEMM is threaded itself.
void cpu_batched(const cpu::GemmProblem &p, const Tensor &d, const Request &r) {
  const size_t grain = r.batch >= (size_t)cpu::num_threads() ? 1 : r.batch;
  cpu::parallel_for(r.batch, grain, [&](size_t i0, size_t i1) {
    cpu::GemmProblem q = p;
    Tensor di = d;
    q.d = &di;
    if (q.c) q.c = &di;  // (accumulate: C is D)
    for (size_t i = i0; i < i1; ++i) {
      q.y.data = static_cast<const char *>(p.y.data) + i * r.stride_a;
      q.x.data = static_cast<const char *>(p.x.data) + i * r.stride_b;
      di.params[kNVTERowwiseData].data_ptr = static_cast<char *>(d.params[kNVTERowwiseData].data_ptr) + i * r.stride_d;
      cpu::gemm(q);
    }
  });
}

// Validates r and (execute) runs it; execute = false only validates (multi-tensor GEMMs check
// every GEMM before the first one writes).
void run(const char *op, Request r, bool execute = true) {
  const Tensor &A = require(r.A, "A");
  const Tensor &B = require(r.B, "B");
  Tensor &D = require_mut(r.D, "D");
  r.bias = optional(r.bias, "bias");
  r.dbias = optional(r.dbias, "bias gradient");
  r.aux = optional(r.aux, "pre_gelu_out");

  cpu::GemmProblem p;
  const float *a_scale_inv = nullptr, *b_scale_inv = nullptr;
  p.y = op_view(A, "A", r.transa, &a_scale_inv);
  p.x = op_view(B, "B", r.transb, &b_scale_inv);
  const size_t m = p.y.cols, k = p.y.rows, n = p.x.rows;
  NVTE_CHECK(p.x.cols == k, "inner dimensions differ: op(A) is [k=", k, ", m=", m, "] from A ",
             shape_str(logical_shape(A)), " (transa=", tf(r.transa), ") but op(B) is [n=", n, ", k=", p.x.cols,
             "] from B ", shape_str(logical_shape(B)), " (transb=", tf(r.transb), ")");
  NVTE_CHECK(is_fp8(p.x.dtype) == is_fp8(p.y.dtype), "A is ", dtype_name(p.y.dtype), " and B is ",
             dtype_name(p.x.dtype), ": an FP8 GEMM needs both A and B in FP8");
  check_mn(r.D, "D", n, m);
  const NVTEDType d_type = logical_dtype(D);
  NVTE_CHECK(is_float(d_type), "D has dtype ", dtype_name(d_type),
             "; expected float32, float16, bfloat16, float8_e4m3 or float8_e5m2");

  if (r.beta != 0.0f) {
    if (r.C == nullptr || r.C == r.D) {
      NVTE_CHECK(!is_fp8(d_type), "accumulating into D (beta = ", r.beta, ") needs a float32, float16 or ",
                 "bfloat16 D, got ", dtype_name(d_type));
      r.C = r.D;
    }
    require(r.C, "C");
    check_mn(r.C, "C", n, m);
    p.c = r.C;
  }
  NVTE_CHECK(!(r.gelu && r.dgelu), "the GELU and dGELU epilogues cannot be combined");
  NVTE_CHECK(!((r.gelu || r.dgelu) && r.aux == nullptr), r.gelu ? "the GELU" : "the dGELU",
             " epilogue needs the pre_gelu_out (aux) tensor");
  NVTE_CHECK(!(r.bias && (r.dbias || r.dgelu)), "bias (forward) cannot be combined with a backward epilogue");
  NVTE_CHECK(!(r.dbias && r.gelu), "a bias gradient cannot be combined with the forward GELU epilogue");
  if (r.bias) check_vector(r.bias, "bias", m, "one value per column of D, m");
  if (r.dbias) {
    if (r.dgelu)
      check_vector(r.dbias, "bias", m, "the dGELU bias gradient: column sums of D, m");
    else
      check_vector(r.dbias, "bias", n, "the bias gradient of op(B): one value per row, n");
  }
  if (r.aux) {
    check_mn(r.aux, "pre_gelu_out", n, m);
    NVTE_CHECK(is_high_precision(logical_dtype(*r.aux)), "pre_gelu_out has dtype ",
               dtype_name(logical_dtype(*r.aux)), "; expected float32, float16 or bfloat16");
  }
  // Memory. D is written while A, B, bias and (dGELU) pre_gelu_out are still being read (a float32
  // D takes the CPU's product directly, tile by tile; the epilogues read their inputs per row),
  // so it shares no byte with them. C is read element by element where D is written, so a
  // separate C handle may be exactly D's buffer (accumulate in place), nothing else.
  const char *why = "the GEMM writes D while it still reads its inputs";
  api::check_disjoint(D, "D", A, "A", why);
  api::check_disjoint(D, "D", B, "B", why);
  if (r.bias) api::check_disjoint(D, "D", *r.bias, "bias", why);
  if (r.beta != 0.0f && r.C != r.D) api::check_alias(D, "D", *r.C, "C");
  if (r.gelu || r.dgelu) {
    api::check_disjoint(D, "D", *r.aux, "pre_gelu_out",
                        r.gelu ? "D and pre_gelu_out are separate outputs of the GELU epilogue"
                               : "the dGELU epilogue reads pre_gelu_out while it writes D");
  }
  if (r.gelu) {
    const char *gwhy = "the GELU epilogue writes pre_gelu_out while it still reads the GEMM's inputs";
    api::check_disjoint(*r.aux, "pre_gelu_out", A, "A", gwhy);
    api::check_disjoint(*r.aux, "pre_gelu_out", B, "B", gwhy);
    if (r.bias) api::check_disjoint(*r.aux, "pre_gelu_out", *r.bias, "bias", gwhy);
  }
  if (r.dbias) {
    const char *bwhy = "the bias gradient is a separate output";
    api::check_disjoint(*r.dbias, "bias gradient", A, "A", bwhy);
    api::check_disjoint(*r.dbias, "bias gradient", B, "B", bwhy);
    api::check_disjoint(*r.dbias, "bias gradient", D, "D", bwhy);
    if (r.dgelu) api::check_disjoint(*r.dbias, "bias gradient", *r.aux, "pre_gelu_out", bwhy);
  }
  if (!execute) return;

  p.alpha = r.alpha;
  p.beta = r.beta;
  p.d = &D;
  p.bias = r.bias;
  p.dbias = r.dbias;
  p.aux = (r.gelu || r.dgelu) ? r.aux : nullptr;
  p.gelu = r.gelu;
  p.dgelu = r.dgelu;

  const NamedTensor ts[] = {{"A", r.A}, {"B", r.B}, {"C", r.C}, {"D", r.D}, {"bias", r.bias},
                            {"bias gradient", r.dbias}, {"pre_gelu_out", r.aux}, {"workspace", r.workspace}};
  switch (backend_of(ts, sizeof(ts) / sizeof(ts[0]))) {
    case Backend::CPU:  // the CPU needs no workspace
      if (a_scale_inv) p.y.scale_inv = *a_scale_inv;
      if (b_scale_inv) p.x.scale_inv = *b_scale_inv;
      if (r.batch == 1) return cpu::gemm(p);
      return cpu_batched(p, D, r);
    case Backend::CUDA:
#ifdef NVTE_WITH_CUDA
      return run_cuda(r, m, n, k);
#else
      cuda_not_built(op);
#endif
  }
}

// The v1 flags in terms of a Request (epilogue choice as in gemm.h's file comment).
Request v1_request(const NVTETensor A, const NVTETensor B, NVTETensor D, const NVTETensor bias,
                   NVTETensor pre_gelu_out, bool transa, bool transb, bool grad, NVTETensor workspace,
                   bool accumulate, bool use_split_accumulator, int math_sm_count, cudaStream_t stream) {
  Request r;
  r.use_split_accumulator = use_split_accumulator;
  r.sm_count = math_sm_count;
  r.stream = stream;
  r.A = A;
  r.B = B;
  r.D = D;
  r.transa = transa;
  r.transb = transb;
  r.beta = accumulate ? 1.0f : 0.0f;
  r.workspace = workspace;
  const NVTETensor aux = optional(pre_gelu_out, "pre_gelu_out");
  if (grad) {
    r.dbias = bias;
    r.aux = aux;
    r.dgelu = aux != nullptr;
  } else {
    r.bias = bias;
    r.aux = aux;
    r.gelu = aux != nullptr;
  }
  return r;
}

}  // namespace

extern "C" {

NVTEStatus nvte_cublas_gemm(const NVTETensor A, const NVTETensor B, NVTETensor D, const NVTETensor bias,
                            NVTETensor pre_gelu_out, bool transa, bool transb, bool grad,
                            NVTETensor workspace, bool accumulate, bool use_split_accumulator,
                            int math_sm_count, cudaStream_t stream) {
  return api_call("nvte_cublas_gemm", [&] {
    run("nvte_cublas_gemm", v1_request(A, B, D, bias, pre_gelu_out, transa, transb, grad, workspace, accumulate,
                                       use_split_accumulator, math_sm_count, stream));
  });
}

NVTEStatus nvte_cublas_gemm_v2(int transa, int transb, const float *alpha, const NVTETensor A,
                               const NVTETensor B, const float *beta, const NVTETensor C, NVTETensor D,
                               NVTETensor workspace, NVTEMatmulConfig config, cudaStream_t stream) {
  return api_call("nvte_cublas_gemm_v2", [&] {
    NVTE_CHECK(alpha != nullptr && beta != nullptr, "alpha and beta must be host pointers to float, got ",
               alpha ? "alpha set" : "alpha NULL", " and ", beta ? "beta set" : "beta NULL");
    Request r;
    r.A = A;
    r.B = B;
    r.C = optional(C, "C");
    r.D = D;
    r.transa = transa != 0;
    r.transb = transb != 0;
    r.alpha = *alpha;
    r.beta = *beta;
    r.workspace = workspace;
    r.stream = stream;
    if (config) {
      r.use_split_accumulator = config->use_split_accumulator;
      r.sm_count = config->sm_count;
      r.bias = config->bias_tensor;
      r.dbias = config->dbias_tensor;
      r.gelu = config->with_gelu_epilogue;
      r.dgelu = config->with_dgelu_epilogue;
      r.aux = config->epilogue_aux_tensor;
    }
    run("nvte_cublas_gemm_v2", r);
  });
}

NVTEStatus nvte_multi_tensor_gemm(const NVTETensor *A, const NVTETensor *B, NVTETensor *D,
                                  const NVTETensor *bias, NVTETensor *pre_gelu_out, const int num_gemms,
                                  bool transa, bool transb, bool grad, NVTETensor *workspace,
                                  bool accumulate, bool use_split_accumulator, int math_sm_count,
                                  cudaStream_t stream) {
  return api_call("nvte_multi_tensor_gemm", [&] {
    NVTE_CHECK(num_gemms >= 0, "num_gemms is ", num_gemms, "; expected >= 0");
    if (num_gemms == 0) return;
    NVTE_CHECK(A != nullptr && B != nullptr && D != nullptr, "the A, B and D arrays must be non-NULL (got A ",
               A ? "set" : "NULL", ", B ", B ? "set" : "NULL", ", D ", D ? "set" : "NULL", ")");
    // The call does not say how many workspaces there are, so every GEMM uses the first
    // one; they run one after another on `stream`, so sharing it is safe.
    const auto request = [&](int i) {
      return v1_request(A[i], B[i], D[i], bias ? bias[i] : nullptr, pre_gelu_out ? pre_gelu_out[i] : nullptr,
                        transa, transb, grad, workspace ? workspace[0] : nullptr, accumulate,
                        use_split_accumulator, math_sm_count, stream);
    };
    // Every GEMM is validated before the first one writes, so a bad one leaves every D untouched.
    // A D must not share memory with another GEMM's A, B or D either (they may run in any order).
    for (int pass = 0; pass < 2; ++pass) {
      for (int i = 0; i < num_gemms; ++i) {
        try {
          if (pass == 1) {
            run("nvte_multi_tensor_gemm", request(i));
            continue;
          }
          run("nvte_multi_tensor_gemm", request(i), false);
          const Tensor &di = *D[i];
          for (int j = 0; j < num_gemms; ++j) {
            if (j == i) continue;
            // (names are built only for a failure: this loop runs n^2 times per call)
            const auto disjoint = [&](const NVTETensor t, const char *what) {
              if (t == nullptr || !api::any_overlap(di, *t)) return;
              const std::string name = concat(what, " of GEMM ", j);
              api::check_disjoint(di, "D", *t, name.c_str(),
                                  "a GEMM's D must not share memory with another GEMM's operands");
            };
            disjoint(A[j], "A");
            disjoint(B[j], "B");
            if (j > i) disjoint(D[j], "D");
          }
        } catch (const Error &e) {
          throw Error(e.status(), concat("GEMM ", i, " of ", num_gemms, ": ", e.what()));
        }
      }
    }
  });
}

NVTEStatus nvte_batched_gemm(const NVTETensor A, const NVTETensor B, NVTETensor D, bool transa, bool transb,
                             bool accumulate, NVTETensor workspace, cudaStream_t stream) {
  const char *op = "nvte_batched_gemm";
  return api_call(op, [&] {
    const Tensor &a = require(A, "A"), &b = require(B, "B");
    Tensor &d = require_mut(D, "D");
    // Slice 0 of each stack as a 2-D tensor: run() checks the shapes, dtypes and flags on it.
    Tensor slices[3];
    const Tensor *whole[3] = {&a, &b, &d};
    const char *names[3] = {"A", "B", "D"};
    size_t batch = 0, stride[3] = {0, 0, 0};
    for (int i = 0; i < 3; ++i) {
      const NVTEBasicTensor &t = whole[i]->params[kNVTERowwiseData];
      NVTE_CHECK(buffer_set(t), names[i], " needs rowwise data (a dense [batch, rows, cols] stack)");
      NVTE_CHECK(t.shape.ndim == 3, names[i], " must be 3-D [batch, rows, cols], got ", shape_str(t.shape));
      NVTE_CHECK(is_high_precision(t.dtype), names[i], " has dtype ", dtype_name(t.dtype),
                 "; batched GEMMs take float32, float16 or bfloat16");
      if (i == 0) batch = t.shape.data[0];
      NVTE_CHECK(t.shape.data[0] == batch, names[i], " holds ", t.shape.data[0], " matrices but A holds ", batch);
      NVTEBasicTensor &v = slices[i].params[kNVTERowwiseData];
      v = t;
      v.shape.ndim = 2;
      v.shape.data[0] = t.shape.data[1];
      v.shape.data[1] = t.shape.data[2];
      stride[i] = t.shape.data[1] * t.shape.data[2] * dtype_size(t.dtype);
    }
    // The whole stacks, not just matrix 0: D is written while every matrix of A and B is read.
    const char *why = "the batched GEMM writes D while it still reads its inputs";
    api::check_disjoint(d, "D", a, "A", why);
    api::check_disjoint(d, "D", b, "B", why);
    Request r;
    r.A = &slices[0];
    r.B = &slices[1];
    r.D = &slices[2];
    r.transa = transa;
    r.transb = transb;
    r.beta = accumulate ? 1.0f : 0.0f;
    r.workspace = workspace;
    r.stream = stream;
    NVTE_CHECK(batch <= 0x7fffffff, "a batched GEMM takes at most 2^31 - 1 matrices, got ", batch);
    r.batch = batch;
    r.stride_a = stride[0];
    r.stride_b = stride[1];
    r.stride_d = stride[2];
    if (batch > 0) run(op, r);
  });
}

NVTEStatus nvte_cublas_gemm_workspace_size(NVTEBackend backend, size_t *bytes) {
  return api_call("nvte_cublas_gemm_workspace_size", [&] {
    NVTE_CHECK(bytes != nullptr, "bytes is NULL");
    NVTE_CHECK(backend == kNVTEBackendCPU || backend == kNVTEBackendCUDA, "unknown backend ", (int)backend);
    // CPU: none. CUDA: cuBLASLt's recommended 32 MiB (Hopper) plus the FP8 amax scratch.
    *bytes = backend == kNVTEBackendCPU ? 0 : (size_t(32) << 20) + 256;
  });
}

}  // extern "C"
