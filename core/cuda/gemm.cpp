// cuda/gemm.cpp - nvte_cublas_gemm on CUDA tensors: one cuBLASLt matmul with the fused
// epilogue of gemm.h, plus the amax / scale_inv bookkeeping of an FP8 output.
//
// TE's convention is cuBLAS's, so operands map straight onto cuBLASLt (column-major, D =
// op(A) op(B)). Everything about a call except its pointers (shapes, dtypes, flags,
// epilogue, alignment classes, workspace size, device) forms a cache key; its entry
// holds the matmul descriptor, the four layouts and the algorithm, so a repeated shape costs
// only the pointer attributes and the launch. The algorithm is cuBLASLt's heuristic first
// choice; for large shapes (NVTE_GEMM_AUTOTUNE, gemm_autotune.h) the plan's early calls time
// the heuristic's other candidates, check each against the first choice bit for bit, and keep
// the fastest of those that agree (gemm_tuner.h); with NVTE_GEMM_AUTOTUNE_CACHE a plan takes a
// choice recorded in that file (gemm_tune_cache.h) from its first call.
#include "gemm.h"

#include <cuda_runtime_api.h>

#include <array>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "../common/error.h"
#include "cuda_check.h"
#include "cublaslt_loader.h"
#include "gemm_autotune.h"
#include "gemm_tuner.h"

namespace nvte::cuda {
namespace {

constexpr size_t kCublasWorkspace = size_t(32) << 20;  // cuBLASLt's recommendation for Hopper
// Scratch at the workspace's start: cuBLASLt's FP8 amax target, aligned copies of the
// A / B / D scale factors (one 16-byte slot each) and the two output hashes of an autotune
// check, padded to keep the rest 256-byte aligned.
constexpr size_t kScratchBytes = 256;
constexpr size_t kAmaxSlot = 0, kScaleASlot = 16, kScaleBSlot = 32, kScaleDSlot = 48, kHashSlot = 64;

// ------------------------------------------------------------------------ helpers
cudaDataType_t cuda_type(NVTEDType t) {
  switch (t) {
    case kNVTEFloat32: return CUDA_R_32F;
    case kNVTEFloat16: return CUDA_R_16F;
    case kNVTEBFloat16: return CUDA_R_16BF;
    case kNVTEFloat8E4M3: return CUDA_R_8F_E4M3;
    case kNVTEFloat8E5M2: return CUDA_R_8F_E5M2;
    default: NVTE_FAIL(NVTE_ERROR_INVALID_ARGUMENT, "dtype ", dtype_name(t), " cannot be a GEMM operand");
  }
}

// Largest power of two (<= 256) dividing the address: the alignment cuBLASLt may assume.
uint32_t align_of(const void *p) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  if (a == 0) return 256;
  uint32_t r = 1;
  while (r < 256 && a % (r * 2) == 0) r *= 2;
  return r;
}

const char *epilogue_name(cublasLtEpilogue_t e) {
  switch (e) {
    case CUBLASLT_EPILOGUE_DEFAULT: return "DEFAULT";
    case CUBLASLT_EPILOGUE_BIAS: return "BIAS";
    case CUBLASLT_EPILOGUE_GELU_AUX: return "GELU_AUX";
    case CUBLASLT_EPILOGUE_GELU_AUX_BIAS: return "GELU_AUX_BIAS";
    case CUBLASLT_EPILOGUE_DGELU: return "DGELU";
    case CUBLASLT_EPILOGUE_DGELU_BGRAD: return "DGELU_BGRAD";
    case CUBLASLT_EPILOGUE_BGRADB: return "BGRADB";
    default: return "?";
  }
}

#define NVTE_CHECK_CUBLAS(call)                                                                \
  do {                                                                                         \
    const cublasStatus_t st_ = (call);                                                         \
    if (st_ != CUBLAS_STATUS_SUCCESS)                                                          \
      NVTE_FAIL(NVTE_ERROR_CUDA, #call, " failed: ", cublas_status_str(st_));                  \
  } while (0)

// A tensor's rowwise buffer (what cuBLASLt reads or writes for C, D, bias, aux).
const NVTEBasicTensor &rowwise(const Tensor &t, const char *name) {
  const NVTEBasicTensor &b = t.params[kNVTERowwiseData];
  NVTE_CHECK_SUPPORTED(buffer_set(b), "the CUDA GEMM needs the rowwise data of ", name,
                       " (it has only columnwise data)");
  return b;
}

// ------------------------------------------------------------------ handles
cublasLtHandle_t handle_for(int device) {
  static std::mutex mu;
  static std::vector<cublasLtHandle_t> handles;
  const CublasLtApi &lt = cublaslt();
  std::lock_guard<std::mutex> lk(mu);
  if ((int)handles.size() <= device) handles.resize(device + 1, nullptr);
  if (handles[device] == nullptr) NVTE_CHECK_CUBLAS(lt.Create(&handles[device]));  // kept for the process
  return handles[device];
}

// --------------------------------------------------------------------- plans
// Everything a cached plan depends on.
struct Key {
  std::array<int64_t, 32> v{};
  bool operator<(const Key &o) const { return v < o.v; }
};

struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr, ld = nullptr;
  cublasLtMatmulAlgo_t algo{};          // the heuristic's first choice, the cache's, then the tuner's
  std::unique_ptr<GemmTuner> tuner;     // while the candidates are being timed
  std::string cache_key;                // with NVTE_GEMM_AUTOTUNE_CACHE: the plan's key in the file
  std::mutex mu;  // the descriptor's pointer attributes (and the tuner) are used under it
};

// The full problem for one call, pointers included.
struct Problem {
  const GemmArgs *g;
  cublasOperation_t opa, opb;
  cudaDataType_t ta, tb, tc, td;
  bool fp8 = false, d_fp8 = false;
  cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_DEFAULT;
  const void *c_ptr = nullptr;
  void *d_ptr = nullptr;
  void *bias_ptr = nullptr;
  cudaDataType_t bias_type = CUDA_R_32F;
  void *aux_ptr = nullptr;
  cudaDataType_t aux_type = CUDA_R_32F;
  const float *d_scale = nullptr;
  // The scale pointers cuBLASLt reads: the tensors' own, or scratch copies when not 16-byte
  // aligned (cuBLASLt 13.1's FP8 matmul returns NOT_SUPPORTED for a 4- or 8-byte aligned one).
  const float *lt_scale_a = nullptr, *lt_scale_b = nullptr, *lt_scale_d = nullptr;
  float *amax_tmp = nullptr;  // cuBLASLt's AMAX_D target (scratch)
  bool tune = false;   // the plan times candidates (gemm_autotune.h: large, re-runnable calls)
  unsigned long long *hash_sums = nullptr;  // (scratch) a check's two output hashes
  // What a call writes, for the autotune check: D, a GELU aux output, a bias gradient.
  struct Span {
    const void *p;
    size_t bytes;
  } outputs[3] = {};
  bool cache = false;  // NVTE_GEMM_AUTOTUNE_CACHE set
  void *ws = nullptr;
  size_t ws_bytes = 0;
  int8_t fast_accum = 0;
  int device = 0;

  std::string describe() const {
    const GemmArgs &a = *g;
    std::string s = concat("m=", a.m, " n=", a.n, " k=", a.k, ", A ", dtype_name(a.a.dtype), " op ",
                           opa == CUBLAS_OP_T ? "T" : "N", ", B ", dtype_name(a.b.dtype), " op ",
                           opb == CUBLAS_OP_T ? "T" : "N", ", D ", dtype_name(d_type()), ", C type ",
                           (int)tc, ", epilogue ", epilogue_name(epilogue));
    if (bias_ptr) s += concat(", bias type ", (int)bias_type);
    if (aux_ptr) s += concat(", aux type ", (int)aux_type);
    if (fp8) s += concat(", fast_accum ", (int)fast_accum);
    if (a.sm_count > 0) s += concat(", sm_count ", a.sm_count);
    s += concat(", workspace ", ws_bytes, " bytes");
    if (a.batch > 1) s += concat(", batch ", a.batch);
    return s;
  }
  NVTEDType d_type() const { return g->d->params[kNVTERowwiseData].dtype; }

  Key key() const {
    const GemmArgs &a = *g;
    Key k;
    int i = 0;
    auto put = [&](int64_t x) { k.v[i++] = x; };
    put(device);
    put((tune ? 1 : 0) | (cache ? 2 : 0));  // (the cache file's key leaves out these two)
    put((int64_t)a.m), put((int64_t)a.n), put((int64_t)a.k);
    put(ta), put(tb), put(tc), put(td), put(opa), put(opb);
    put((int64_t)a.a.cols), put((int64_t)a.b.cols);
    put(epilogue), put(bias_ptr ? bias_type : -1), put(aux_ptr ? aux_type : -1);
    put(fast_accum), put(a.sm_count), put((int64_t)ws_bytes);
    put(align_of(a.a.data)), put(align_of(a.b.data)), put(align_of(c_ptr)), put(align_of(d_ptr));
    put(bias_ptr ? align_of(bias_ptr) : 0), put(aux_ptr ? align_of(aux_ptr) : 0);
    put(amax_tmp != nullptr), put(d_scale != nullptr);
    put(a.beta != 0.0f);
    put((int64_t)a.batch);
    return k;
  }
};

// Pointer attributes (also set before the heuristic, which reads their alignment).
void set_pointers(const CublasLtApi &lt, cublasLtMatmulDesc_t desc, const Problem &p) {
  auto set = [&](cublasLtMatmulDescAttributes_t attr, const void *v, size_t size) {
    NVTE_CHECK_CUBLAS(lt.MatmulDescSetAttribute(desc, attr, v, size));
  };
  if (p.bias_ptr) set(CUBLASLT_MATMUL_DESC_BIAS_POINTER, &p.bias_ptr, sizeof(p.bias_ptr));
  if (p.aux_ptr) set(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &p.aux_ptr, sizeof(p.aux_ptr));
  if (p.fp8) {
    set(CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &p.lt_scale_a, sizeof(p.lt_scale_a));
    set(CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &p.lt_scale_b, sizeof(p.lt_scale_b));
  }
  if (p.lt_scale_d) set(CUBLASLT_MATMUL_DESC_D_SCALE_POINTER, &p.lt_scale_d, sizeof(p.lt_scale_d));
  if (p.amax_tmp) set(CUBLASLT_MATMUL_DESC_AMAX_D_POINTER, &p.amax_tmp, sizeof(p.amax_tmp));
}

std::unique_ptr<Plan> make_plan(const CublasLtApi &lt, cublasLtHandle_t h, const Problem &p) {
  const GemmArgs &g = *p.g;
  auto plan = std::make_unique<Plan>();
  struct Cleanup {  // frees a half-built plan on error
    const CublasLtApi &lt;
    Plan *p;
    ~Cleanup() {
      if (!p) return;
      if (p->desc) lt.MatmulDescDestroy(p->desc);
      for (auto l : {p->la, p->lb, p->lc, p->ld})
        if (l) lt.MatrixLayoutDestroy(l);
    }
  } cleanup{lt, plan.get()};

  NVTE_CHECK_CUBLAS(lt.MatmulDescCreate(&plan->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  auto set = [&](cublasLtMatmulDescAttributes_t attr, const void *v, size_t size) {
    NVTE_CHECK_CUBLAS(lt.MatmulDescSetAttribute(plan->desc, attr, v, size));
  };
  const int32_t opa = p.opa, opb = p.opb;
  set(CUBLASLT_MATMUL_DESC_TRANSA, &opa, sizeof(opa));
  set(CUBLASLT_MATMUL_DESC_TRANSB, &opb, sizeof(opb));
  const uint32_t epi = p.epilogue;
  set(CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi));
  if (p.bias_ptr) {
    const int32_t bt = p.bias_type;
    set(CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt, sizeof(bt));
  }
  if (p.aux_ptr) {
    const int64_t aux_ld = (int64_t)g.m;
    const int32_t at = p.aux_type;
    set(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &aux_ld, sizeof(aux_ld));
    set(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE, &at, sizeof(at));
  }
  if (p.fp8) set(CUBLASLT_MATMUL_DESC_FAST_ACCUM, &p.fast_accum, sizeof(p.fast_accum));
  if (g.sm_count > 0) {
    const int32_t sms = g.sm_count;
    set(CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET, &sms, sizeof(sms));
  }
  set_pointers(lt, plan->desc, p);

  // Layouts: a stored row-major [rows, cols] buffer is column-major cols x rows, ld = cols.
  NVTE_CHECK_CUBLAS(lt.MatrixLayoutCreate(&plan->la, p.ta, g.a.cols, g.a.rows, (int64_t)g.a.cols));
  NVTE_CHECK_CUBLAS(lt.MatrixLayoutCreate(&plan->lb, p.tb, g.b.cols, g.b.rows, (int64_t)g.b.cols));
  NVTE_CHECK_CUBLAS(lt.MatrixLayoutCreate(&plan->lc, p.tc, g.m, g.n, (int64_t)g.m));
  NVTE_CHECK_CUBLAS(lt.MatrixLayoutCreate(&plan->ld, p.td, g.m, g.n, (int64_t)g.m));
  if (g.batch > 1) {  // dense stacks: each matrix right after the previous one
    const int32_t count = (int32_t)g.batch;
    const int64_t strides[4] = {(int64_t)(g.a.rows * g.a.cols), (int64_t)(g.b.rows * g.b.cols), (int64_t)(g.m * g.n),
                                (int64_t)(g.m * g.n)};
    const cublasLtMatrixLayout_t layouts[4] = {plan->la, plan->lb, plan->lc, plan->ld};
    for (int i = 0; i < 4; ++i) {
      NVTE_CHECK_CUBLAS(lt.MatrixLayoutSetAttribute(layouts[i], CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count,
                                                    sizeof(count)));
      NVTE_CHECK_CUBLAS(lt.MatrixLayoutSetAttribute(layouts[i], CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                                                    &strides[i], sizeof(strides[i])));
    }
  }

  cublasLtMatmulPreference_t pref = nullptr;
  NVTE_CHECK_CUBLAS(lt.MatmulPreferenceCreate(&pref));
  struct PrefGuard {
    const CublasLtApi &lt;
    cublasLtMatmulPreference_t p;
    ~PrefGuard() { lt.MatmulPreferenceDestroy(p); }
  } pref_guard{lt, pref};
  auto pset = [&](cublasLtMatmulPreferenceAttributes_t attr, const void *v, size_t size) {
    NVTE_CHECK_CUBLAS(lt.MatmulPreferenceSetAttribute(pref, attr, v, size));
  };
  const uint64_t ws = p.ws_bytes;
  pset(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
  // Split-k partial sums stay in float32: the in-place and output-type reductions round them
  // to D's dtype (bf16 / fp16) before the final sum, several ulps off the float32 result.
  const uint32_t reduction = CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
  pset(CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &reduction, sizeof(reduction));
  const uint32_t al_a = align_of(g.a.data), al_b = align_of(g.b.data), al_c = align_of(p.c_ptr),
                 al_d = align_of(p.d_ptr);
  pset(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al_a, sizeof(al_a));
  pset(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al_b, sizeof(al_b));
  pset(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al_c, sizeof(al_c));
  pset(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al_d, sizeof(al_d));

  cublasLtMatmulHeuristicResult_t results[GemmTuner::kCandidates] = {};
  int found = 0;
  const cublasStatus_t st = lt.MatmulAlgoGetHeuristic(h, plan->desc, plan->la, plan->lb, plan->lc, plan->ld,
                                                      pref, p.tune || p.cache ? GemmTuner::kCandidates : 1, results,
                                                      &found);
  const cublasLtMatmulHeuristicResult_t &result = results[0];
  if (st == CUBLAS_STATUS_NOT_SUPPORTED || st == CUBLAS_STATUS_INVALID_VALUE ||
      (st == CUBLAS_STATUS_SUCCESS && found == 0))
    NVTE_FAIL(NVTE_ERROR_NOT_SUPPORTED, "cuBLASLt ", lt.version, " has no algorithm for this GEMM (", p.describe(),
              "; alignments A ", al_a, " B ", al_b, " C ", al_c, " D ", al_d, " bytes)",
              st == CUBLAS_STATUS_SUCCESS ? "" : concat(": ", cublas_status_str(st)),
              p.epilogue == CUBLASLT_EPILOGUE_BGRADB && p.opb == CUBLAS_OP_N
                  ? "; cuBLASLt computes the bias gradient of op(B) (grad with bias and no pre_gelu_out) only "
                    "for a transposed B (transb = true, the wgrad layout)"
                  : "");
  NVTE_CHECK_CUBLAS(st);
  plan->algo = result.algo;
  const char *cache_path = p.cache ? tune_cache_path() : nullptr;
  if (cache_path) {
    const Key k = p.key();
    plan->cache_key = tune_cache_key(lt, p.device, k.v.data() + 2, (int)k.v.size() - 2);
    const TuneRecord *r = cached_choice(cache_path, plan->cache_key);
    if (r && r->index < found && results[r->index].state == CUBLAS_STATUS_SUCCESS &&
        algo_config_ids(lt, results[r->index].algo) == r->config) {
      plan->algo = results[r->index].algo;
      if (autotune_log())
        std::fprintf(stderr, "[nvte gemm autotune] %s: from NVTE_GEMM_AUTOTUNE_CACHE -> #%d\n", p.describe().c_str(),
                     r->index);
      cleanup.p = nullptr;
      return plan;  // no tuning: the recorded choice from the first call
    }
  }
  if (p.tune) {
    // Candidates that split k as the first choice does. On the H100 (cuBLASLt 13.1) their
    // outputs were bit-identical to the first choice's at the benchmark's Linear shapes
    // (M = 8192), not at every small shape: the tuner checks each one (gemm_tuner.h).
    Candidates c = tuning_candidates(lt, results, found);
    if (c.algos.size() > 1) plan->tuner = std::make_unique<GemmTuner>(std::move(c.algos), std::move(c.index));
  }
  cleanup.p = nullptr;
  return plan;
}

Plan &plan_for(const CublasLtApi &lt, cublasLtHandle_t h, const Problem &p) {
  static std::mutex mu;
  static std::map<Key, std::unique_ptr<Plan>> cache;  // kept for the process
  const Key k = p.key();
  {
    std::lock_guard<std::mutex> lk(mu);
    auto it = cache.find(k);
    if (it != cache.end()) return *it->second;
  }
  std::unique_ptr<Plan> made = make_plan(lt, h, p);  // outside the lock: the heuristic is slow
  std::lock_guard<std::mutex> lk(mu);
  auto ins = cache.try_emplace(k, std::move(made));  // a concurrent maker may have won: keep one
  if (!ins.second) {
    lt.MatmulDescDestroy(made->desc);
    for (auto l : {made->la, made->lb, made->lc, made->ld}) lt.MatrixLayoutDestroy(l);
  }
  return *ins.first->second;
}

// The tuner has decided: its choice becomes the plan's algorithm (logged, and appended to the
// cache file when it came from timings), and the tuner goes. Under plan.mu.
void adopt_tuned_choice(const CublasLtApi &lt, Plan &plan, const Problem &p) {
  GemmTuner &t = *plan.tuner;
  plan.algo = t.algo(t.best());
  const int chosen = t.heuristic_index(t.best());
  if (autotune_log())
    std::fprintf(stderr, "[nvte gemm autotune] %s: %s -> #%d (the heuristic's #%d)\n", p.describe().c_str(),
                 t.summary().c_str(), t.best(), chosen);
  if (t.measured() && !plan.cache_key.empty())
    if (const char *path = tune_cache_path())
      remember_choice(path, TuneRecord{plan.cache_key, chosen, algo_config_ids(lt, plan.algo)});
  t.release();
  plan.tuner.reset();
}

// A tuning call (gemm_tuner.h): candidate call.cand >= 1 runs kRepeats times between two
// events, its outputs are hashed, the first choice (plan.algo while tuning) runs kRepeats times
// over the same inputs between two more events, the outputs are hashed again, and the
// candidate is flagged when the hashes differ. Returns the first choice's status: its outputs
// are the call's result. A call that reads D (beta != 0, e.g. a wgrad GEMM accumulating into
// main_grad) cannot run twice in place, so its timed runs write a stream-ordered scratch D
// (out of place: scratch = alpha op(A) op(B) + beta C, C untouched) and the call's result comes
// from one more in-place run of the first choice. Under plan.mu.
template <class Matmul>
cublasStatus_t tuning_call(GemmTuner &t, const GemmTuner::Call &call, const Problem &p, const Matmul &matmul,
                           cudaStream_t stream) {
  const bool reads_d = p.g->beta != 0.0f;
  void *d = nullptr;  // where the timed runs write D: null = D itself
  if (reads_d && cudaMallocAsync(&d, p.outputs[0].bytes, stream) != cudaSuccess) {
    cudaGetLastError();  // no room for the scratch D: the tuner gives up, the first choice stays
    t.finish(call, false);
    return matmul(nullptr, nullptr);
  }
  auto done = [&](cublasStatus_t st) {  // the call's own result, then the scratch goes
    if (reads_d) {
      if (st == CUBLAS_STATUS_SUCCESS) st = matmul(nullptr, nullptr);
      if (cudaFreeAsync(d, stream) != cudaSuccess) cudaGetLastError();
    }
    return st;
  };
  auto hash_all = [&](unsigned long long *sum) {
    bool ok = true;
    for (int i = 0; i < 3; ++i)
      if (p.outputs[i].p)
        ok = ok && launch_output_hash(i == 0 && d ? d : p.outputs[i].p, p.outputs[i].bytes, 1 + i, sum, stream);
    return ok;
  };
  bool ok = t.record(call, GemmTuner::kCandStart, stream);
  cublasStatus_t st = CUBLAS_STATUS_SUCCESS;
  for (int r = 0; r < GemmTuner::kRepeats && st == CUBLAS_STATUS_SUCCESS; ++r) st = matmul(&t.algo(call.cand), d);
  if (st != CUBLAS_STATUS_SUCCESS) {  // cuBLASLt refused the candidate
    t.refused(call);
    return done(reads_d ? CUBLAS_STATUS_SUCCESS : matmul(nullptr, nullptr));
  }
  ok = ok && t.record(call, GemmTuner::kCandStop, stream) &&
       cudaMemsetAsync(p.hash_sums, 0, 2 * sizeof(unsigned long long), stream) == cudaSuccess &&
       hash_all(p.hash_sums) && t.record(call, GemmTuner::kFirstStart, stream);
  for (int r = 0; r < GemmTuner::kRepeats && st == CUBLAS_STATUS_SUCCESS; ++r) st = matmul(nullptr, d);
  ok = ok && st == CUBLAS_STATUS_SUCCESS && t.record(call, GemmTuner::kFirstStop, stream) &&
       hash_all(p.hash_sums + 1) && launch_hash_compare(p.hash_sums, t.check_flag(call.cand), stream) &&
       t.record(call, GemmTuner::kChecked, stream);
  if (!ok) cudaGetLastError();  // a failed check launch: the tuner gives up, the GEMM stands
  t.finish(call, ok);
  return done(st);
}

// k = 0: the product is zero. Only the cases with an exact answer that needs no cuBLASLt run:
// D = 0 (beta 0) or D unchanged (beta 1 with C = D), bias gradient of op(B) = 0.
void gemm_k0(const GemmArgs &g, const Problem &p, cudaStream_t stream) {
  NVTE_CHECK_SUPPORTED(!g.bias && !g.gelu && !g.dgelu && (g.beta == 0.0f || (g.beta == 1.0f && g.c == g.d)),
                       "the CUDA GEMM with k = 0 supports only D = 0, accumulate into D and the bias gradient "
                       "of op(B) (", p.describe(), ")");
  const NVTEBasicTensor &d = g.d->params[kNVTERowwiseData];
  if (g.beta == 0.0f)
    NVTE_CHECK_CUDA(cudaMemsetAsync(d.data_ptr, 0, g.batch * g.m * g.n * dtype_size(d.dtype), stream));
  if (g.dbias) {
    const NVTEBasicTensor &b = rowwise(*g.dbias, "the bias gradient");
    NVTE_CHECK_CUDA(cudaMemsetAsync(b.data_ptr, 0, numel(b.shape) * dtype_size(b.dtype), stream));
  }
}

}  // namespace

size_t gemm_workspace_size() { return kCublasWorkspace + kScratchBytes; }

bool non_tn_fp8_supported() {
  int dev = 0, major = 0, minor = 0;
  NVTE_CHECK_CUDA(cudaGetDevice(&dev));
  NVTE_CHECK_CUDA(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  NVTE_CHECK_CUDA(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
  // cuBLASLt's FP8 kernels take only TN on Ada (8.9), Hopper (9.x) and consumer Blackwell (12.x).
  const int cc = major * 10 + minor;
  return !(cc == 89 || major == 9 || major == 12);
}

void gemm(const GemmArgs &g, cudaStream_t stream) {
  Problem p;
  p.g = &g;
  NVTE_CHECK_CUDA(cudaGetDevice(&p.device));
  const NVTEBasicTensor &d = rowwise(*g.d, "D");
  NVTE_CHECK_SUPPORTED(g.d->params[kNVTEColumnwiseData].data_ptr == nullptr,
                       "the CUDA GEMM writes only D's rowwise data, but D also has columnwise data (its "
                       "transpose); transpose D in a separate op");
  p.d_ptr = d.data_ptr;
  p.opa = g.a.trans ? CUBLAS_OP_T : CUBLAS_OP_N;
  p.opb = g.b.trans ? CUBLAS_OP_T : CUBLAS_OP_N;
  p.ta = cuda_type(g.a.dtype);
  p.tb = cuda_type(g.b.dtype);
  p.td = cuda_type(d.dtype);
  p.fp8 = is_fp8(g.a.dtype);
  p.d_fp8 = is_fp8(d.dtype);
  p.fast_accum = g.use_split_accumulator ? 0 : 1;
  p.cache = tune_cache_path() != nullptr;

  // Epilogue (gemm.h): forward bias / GELU with aux; backward dGELU (+ bias gradient of D's
  // columns) or the bias gradient of op(B) alone.
  if (g.dgelu)
    p.epilogue = g.dbias ? CUBLASLT_EPILOGUE_DGELU_BGRAD : CUBLASLT_EPILOGUE_DGELU;
  else if (g.gelu)
    p.epilogue = g.bias ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_AUX;
  else if (g.bias)
    p.epilogue = CUBLASLT_EPILOGUE_BIAS;
  else if (g.dbias)
    p.epilogue = CUBLASLT_EPILOGUE_BGRADB;
  const Tensor *bias_t = g.bias ? g.bias : g.dbias;
  if (bias_t) {
    const NVTEBasicTensor &b = rowwise(*bias_t, g.bias ? "bias" : "the bias gradient");
    p.bias_ptr = b.data_ptr;
    p.bias_type = cuda_type(b.dtype);
    // Outside FP8 GEMMs cuBLASLt's bias vector has D's type (FP8 GEMMs have their own table,
    // which cuBLASLt itself checks).
    NVTE_CHECK_SUPPORTED(p.fp8 || b.dtype == d.dtype, "the CUDA GEMM (cuBLASLt) needs ",
                         g.bias ? "bias" : "the bias gradient", " in D's dtype ", dtype_name(d.dtype),
                         " for a non-FP8 GEMM, got ", dtype_name(b.dtype));
  }
  if (g.gelu || g.dgelu) {
    const NVTEBasicTensor &x = rowwise(*g.aux, "pre_gelu_out");
    p.aux_ptr = x.data_ptr;
    p.aux_type = cuda_type(x.dtype);
    NVTE_CHECK_SUPPORTED(p.fp8 || x.dtype == d.dtype, "the CUDA GEMM (cuBLASLt) needs pre_gelu_out in D's dtype ",
                         dtype_name(d.dtype), " for a non-FP8 GEMM, got ", dtype_name(x.dtype));
    NVTE_CHECK_SUPPORTED(g.m % 8 == 0, "cuBLASLt's GELU epilogues need m (the last dimension of D and "
                         "pre_gelu_out) to be a multiple of 8, got m = ", g.m);
  }

  // cuBLASLt's FP8 GEMMs take a bf16/fp16 bias and GELU aux only: a float32 one (a float32
  // model under FP8) is applied by launch_bias_gelu after a plain GEMM, with the same math.
  const bool own_epilogue = p.fp8 && !p.d_fp8 && !g.dgelu && !g.dbias && (g.bias || g.gelu) &&
                            ((g.bias && rowwise(*g.bias, "bias").dtype == kNVTEFloat32) ||
                             (g.gelu && rowwise(*g.aux, "pre_gelu_out").dtype == kNVTEFloat32));
  if (own_epilogue) {
    p.epilogue = CUBLASLT_EPILOGUE_DEFAULT;
    p.bias_ptr = nullptr;
    p.aux_ptr = nullptr;
  }

  // C: the beta term. cuBLASLt reads C only when beta != 0; its type must be D's type, except
  // for an FP8 D, whose C is bf16 / fp16 (that of the bias, if any).
  if (g.beta != 0.0f) {
    const NVTEBasicTensor &c = rowwise(*g.c, "C");
    p.c_ptr = c.data_ptr;
    p.tc = cuda_type(c.dtype);
    NVTE_CHECK_SUPPORTED(p.d_fp8 || c.dtype == d.dtype, "the CUDA GEMM (cuBLASLt) needs C in D's dtype ",
                         dtype_name(d.dtype), ", got ", dtype_name(c.dtype));
  } else {
    // Not read. An FP8 D has a C of another type, so C must not alias D (cuBLASLt requires an
    // aliased C to have D's layout); NULL is accepted when beta is 0.
    p.c_ptr = p.d_fp8 ? nullptr : d.data_ptr;
    p.tc = p.d_fp8 ? (bias_t && p.bias_type == CUDA_R_16F ? CUDA_R_16F : CUDA_R_16BF) : p.td;
  }

  // FP8 rules of cuBLASLt (stated here so the message is precise).
  if (p.fp8) {
    NVTE_CHECK_SUPPORTED(!(g.a.dtype == kNVTEFloat8E5M2 && g.b.dtype == kNVTEFloat8E5M2),
                         "cuBLASLt has no FP8 GEMM with both operands in float8_e5m2");
    if (!non_tn_fp8_supported())
      NVTE_CHECK_SUPPORTED(g.a.trans && !g.b.trans, "FP8 GEMMs on this GPU need the TN layout (A transposed, B "
                           "not); give the operand its columnwise data (its transpose) to use instead");
    auto ld_ok = [](size_t ld_bytes) { return ld_bytes % 16 == 0; };
    NVTE_CHECK_SUPPORTED(ld_ok(g.a.cols) && ld_ok(g.b.cols),
                         "FP8 GEMMs on cuBLASLt need the leading dimensions of A and B to be multiples of 16 "
                         "bytes: A is stored as [", g.a.rows, ", ", g.a.cols, "], B as [", g.b.rows, ", ", g.b.cols,
                         "] (the last dimension is the leading one)");
    NVTE_CHECK_SUPPORTED(ld_ok(g.m * dtype_size(d.dtype)),
                         "FP8 GEMMs on cuBLASLt need D's leading dimension (m = ", g.m, " elements of ",
                         dtype_name(d.dtype), ") to be a multiple of 16 bytes");
    NVTE_CHECK_SUPPORTED(align_of(g.a.data) >= 16 && align_of(g.b.data) >= 16 && align_of(d.data_ptr) >= 16,
                         "FP8 GEMMs on cuBLASLt need A, B and D 16-byte aligned");
    NVTE_CHECK(g.a.scale_inv != nullptr && g.b.scale_inv != nullptr, "FP8 operands need scale_inv");
  } else {
    NVTE_CHECK_SUPPORTED(!p.d_fp8, "an FP8 D needs FP8 operands on the CUDA backend (cuBLASLt), got A ",
                         dtype_name(g.a.dtype), " and B ", dtype_name(g.b.dtype));
  }

  // Workspace: [scratch][cuBLASLt workspace], 256-byte aligned pieces. The scratch holds the
  // amax of an FP8 D and copies of scale factors that are not 16-byte aligned.
  float *amax = p.d_fp8 ? scalar_param(*g.d, kNVTEAmax, "D") : nullptr;
  if (p.d_fp8) p.d_scale = scalar_param(*g.d, kNVTEScale, "D");
  if (p.d_fp8) NVTE_CHECK(p.d_scale != nullptr, "D is FP8 (", dtype_name(d.dtype), ") but has no scale");
  p.lt_scale_a = p.fp8 ? g.a.scale_inv : nullptr;
  p.lt_scale_b = p.fp8 ? g.b.scale_inv : nullptr;
  p.lt_scale_d = p.d_scale;
  auto misaligned = [](const float *f) { return f != nullptr && align_of(f) < 16; };
  const bool copy_scales = misaligned(p.lt_scale_a) || misaligned(p.lt_scale_b) || misaligned(p.lt_scale_d);
  uintptr_t ws = reinterpret_cast<uintptr_t>(g.workspace);
  size_t ws_bytes = g.workspace ? g.workspace_bytes : 0;
  if (ws_bytes > 0 && ws % 256 != 0) {
    const size_t pad = 256 - ws % 256;
    ws_bytes = ws_bytes > pad ? ws_bytes - pad : 0;
    ws += pad;
  }
  // Autotuning (gemm_autotune.h): a large call that can run twice over its inputs, with the
  // scratch for the check's hashes.
  const TuneMode mode = autotune_mode();
  // (beta != 0 is tuned out of place, on a scratch D of D's size allocated outside the framework's
  // allocator: only up to kMaxTuneScratchBytes; batched calls are not tuned)
  const bool rerunnable = !p.d_fp8 && g.batch == 1 &&
                          (g.beta == 0.0f || g.m * g.n * dtype_size(d.dtype) <= kMaxTuneScratchBytes);
  p.tune = rerunnable && ws_bytes >= kScratchBytes &&
           (mode == TuneMode::all || (mode == TuneMode::large && (double)g.m * g.n * g.k >= kTuneMinVolume));
  uintptr_t scratch = 0;
  if (amax || copy_scales || ws_bytes >= kScratchBytes) {  // (always carved: one cuBLASLt workspace size)
    NVTE_CHECK(ws_bytes >= kScratchBytes, amax ? "an FP8 D with an amax" : "an FP8 scale factor that is not "
               "16-byte aligned (cuBLASLt reads it from an aligned copy)", " needs the GEMM workspace (",
               kScratchBytes, " bytes of scratch at least, nvte_cublas_gemm_workspace_size bytes for full speed); "
               "got ", g.workspace_bytes, " bytes");
    scratch = ws;
    ws += kScratchBytes;
    ws_bytes -= kScratchBytes;
  }
  if (amax) p.amax_tmp = reinterpret_cast<float *>(scratch + kAmaxSlot);
  if (p.tune) {
    p.hash_sums = reinterpret_cast<unsigned long long *>(scratch + kHashSlot);
    p.outputs[0] = {d.data_ptr, g.m * g.n * dtype_size(d.dtype)};
    if (p.aux_ptr && g.gelu) p.outputs[1] = {p.aux_ptr, g.m * g.n * dtype_size(rowwise(*g.aux, "pre_gelu_out").dtype)};
    if (p.bias_ptr && g.dbias) {
      const NVTEBasicTensor &b = rowwise(*g.dbias, "the bias gradient");
      p.outputs[2] = {b.data_ptr, numel(b.shape) * dtype_size(b.dtype)};
    }
  }
  float *copies[3] = {nullptr, nullptr, nullptr};  // scratch slots to fill from A / B / D's scale
  if (misaligned(p.lt_scale_a)) p.lt_scale_a = copies[0] = reinterpret_cast<float *>(scratch + kScaleASlot);
  if (misaligned(p.lt_scale_b)) p.lt_scale_b = copies[1] = reinterpret_cast<float *>(scratch + kScaleBSlot);
  if (misaligned(p.lt_scale_d)) p.lt_scale_d = copies[2] = reinterpret_cast<float *>(scratch + kScaleDSlot);
  p.ws = ws_bytes ? reinterpret_cast<void *>(ws) : nullptr;
  p.ws_bytes = ws_bytes;

  if (g.m > 0 && g.n > 0) {
    if (g.k == 0) {
      gemm_k0(g, p, stream);
      p.amax_tmp = nullptr;  // amax unchanged (max with 0)
    } else {
      NVTE_CHECK_SUPPORTED(g.m <= INT32_MAX && g.n <= INT32_MAX && g.k <= INT32_MAX,
                           "GEMM dimensions above 2^31 - 1 (", p.describe(), ")");
      const CublasLtApi &lt = cublaslt();
      const cublasLtHandle_t h = handle_for(p.device);
      Plan &plan = plan_for(lt, h, p);
      const float *scale_src[3] = {g.a.scale_inv, g.b.scale_inv, p.d_scale};
      for (int i = 0; i < 3; ++i)
        if (copies[i])
          NVTE_CHECK_CUDA(cudaMemcpyAsync(copies[i], scale_src[i], sizeof(float), cudaMemcpyDeviceToDevice, stream));
      std::lock_guard<std::mutex> lk(plan.mu);
      set_pointers(lt, plan.desc, p);
      const float alpha = g.alpha, beta = g.beta;
      // algo null: the plan's algorithm; d null: D itself (else a scratch D of D's layout)
      auto matmul = [&](const cublasLtMatmulAlgo_t *algo, void *d) {
        if (algo == nullptr) algo = &plan.algo;
        return lt.Matmul(h, plan.desc, &alpha, g.a.data, plan.la, g.b.data, plan.lb, &beta, p.c_ptr, plan.lc,
                         d ? d : p.d_ptr, plan.ld, algo, p.ws, p.ws_bytes, stream);
      };
      cublasStatus_t st;
      GemmTuner *t = plan.tuner.get();
      GemmTuner::Call call;
      if (t) call = t->begin(stream);
      if (call.cand > 0) {
        st = tuning_call(*t, call, p, matmul, stream);
      } else {
        if (t && t->done()) adopt_tuned_choice(lt, plan, p);
        st = matmul(nullptr, nullptr);
      }
      if (st == CUBLAS_STATUS_NOT_SUPPORTED || st == CUBLAS_STATUS_INVALID_VALUE)
        NVTE_FAIL(NVTE_ERROR_NOT_SUPPORTED, "cuBLASLt ", lt.version, " rejected this GEMM (", p.describe(), "): ",
                  cublas_status_str(st));
      if (st != CUBLAS_STATUS_SUCCESS)
        NVTE_FAIL(NVTE_ERROR_CUDA, "cublasLtMatmul failed (", p.describe(), "): ", cublas_status_str(st));
    }
  } else if (g.dbias) {  // an empty product: the bias gradient is all zeros
    const NVTEBasicTensor &b = rowwise(*g.dbias, "the bias gradient");
    if (numel(b.shape))
      NVTE_CHECK_CUDA(cudaMemsetAsync(b.data_ptr, 0, numel(b.shape) * dtype_size(b.dtype), stream));
    p.amax_tmp = nullptr;
  } else {
    p.amax_tmp = nullptr;
  }

  if (own_epilogue && g.k > 0) {
    const NVTEBasicTensor *bias = g.bias ? &rowwise(*g.bias, "bias") : nullptr;
    const NVTEBasicTensor *aux = g.gelu ? &rowwise(*g.aux, "pre_gelu_out") : nullptr;
    launch_bias_gelu(d.data_ptr, d.dtype, bias ? bias->data_ptr : nullptr, bias ? bias->dtype : kNVTEFloat32,
                     aux ? aux->data_ptr : nullptr, aux ? aux->dtype : kNVTEFloat32, g.m, g.n, g.gelu, stream);
  }

  if (p.d_fp8) {
    launch_fp8_output_finalize(p.amax_tmp, amax, p.d_scale, scalar_param(*g.d, kNVTERowwiseScaleInv, "D"),
                               scalar_param(*g.d, kNVTEColumnwiseScaleInv, "D"), stream);
  } else if (float *amax_hp = scalar_param(*g.d, kNVTEAmax, "D")) {
    launch_amax_update(d.data_ptr, d.dtype, g.m * g.n, amax_hp, stream);
  }
}

}  // namespace nvte::cuda
