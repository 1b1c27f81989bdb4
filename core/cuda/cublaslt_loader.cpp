// cublaslt_loader.cpp - dlopen/dlsym of cuBLASLt (see cublaslt_loader.h).
#include "cublaslt_loader.h"

#include <dlfcn.h>

#include <cstdlib>
#include <mutex>
#include <vector>

#include "../common/error.h"

namespace nvte::cuda {
namespace {

struct Loaded {
  CublasLtApi api;
  std::string error;  // empty when api is usable
};

template <class F>
bool resolve(void *lib, const char *name, F *out, std::string *missing) {
  void *p = dlsym(lib, name);
  if (p == nullptr) {
    if (!missing->empty()) *missing += ", ";
    *missing += name;
    return false;
  }
  *out = reinterpret_cast<F>(p);
  return true;
}

Loaded load() {
  Loaded r;
  std::vector<std::string> candidates;
  if (const char *env = std::getenv("NVTE_CUBLASLT_PATH"); env != nullptr && *env != '\0')
    candidates.emplace_back(env);
  candidates.emplace_back("libcublasLt.so.13");
  candidates.emplace_back("/usr/local/cuda/lib64/libcublasLt.so.13");
  candidates.emplace_back("/usr/local/cuda/targets/x86_64-linux/lib/libcublasLt.so.13");

  std::string tried;
  for (const std::string &path : candidates) {
    dlerror();
    void *lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      const char *why = dlerror();
      tried += concat("\n  ", path, ": ", why ? why : "not found");
      continue;
    }
    CublasLtApi &a = r.api;
    std::string missing;
    bool ok = true;
    ok &= resolve(lib, "cublasLtCreate", &a.Create, &missing);
    ok &= resolve(lib, "cublasLtDestroy", &a.Destroy, &missing);
    ok &= resolve(lib, "cublasLtGetVersion", &a.GetVersion, &missing);
    ok &= resolve(lib, "cublasLtGetStatusString", &a.GetStatusString, &missing);
    ok &= resolve(lib, "cublasLtMatmulDescCreate", &a.MatmulDescCreate, &missing);
    ok &= resolve(lib, "cublasLtMatmulDescDestroy", &a.MatmulDescDestroy, &missing);
    ok &= resolve(lib, "cublasLtMatmulDescSetAttribute", &a.MatmulDescSetAttribute, &missing);
    ok &= resolve(lib, "cublasLtMatrixLayoutCreate", &a.MatrixLayoutCreate, &missing);
    ok &= resolve(lib, "cublasLtMatrixLayoutDestroy", &a.MatrixLayoutDestroy, &missing);
    ok &= resolve(lib, "cublasLtMatrixLayoutSetAttribute", &a.MatrixLayoutSetAttribute, &missing);
    ok &= resolve(lib, "cublasLtMatmulPreferenceCreate", &a.MatmulPreferenceCreate, &missing);
    ok &= resolve(lib, "cublasLtMatmulPreferenceDestroy", &a.MatmulPreferenceDestroy, &missing);
    ok &= resolve(lib, "cublasLtMatmulPreferenceSetAttribute", &a.MatmulPreferenceSetAttribute, &missing);
    ok &= resolve(lib, "cublasLtMatmulAlgoGetHeuristic", &a.MatmulAlgoGetHeuristic, &missing);
    ok &= resolve(lib, "cublasLtMatmulAlgoConfigGetAttribute", &a.MatmulAlgoConfigGetAttribute, &missing);
    ok &= resolve(lib, "cublasLtMatmul", &a.Matmul, &missing);
    if (!ok) {
      tried += concat("\n  ", path, ": opened, but lacks ", missing);
      dlclose(lib);
      a = CublasLtApi{};
      continue;
    }
    a.version = a.GetVersion();
    if (a.version < 120000) {  // FP8 and the epilogues used here need cuBLASLt 12+
      tried += concat("\n  ", path, ": version ", a.version, " is older than 12.0");
      dlclose(lib);
      a = CublasLtApi{};
      continue;
    }
    a.path = path;
    return r;  // the handle stays open for the life of the process
  }
  r.error = concat("cuBLASLt could not be loaded (GEMMs on CUDA tensors need libcublasLt.so.13: pip install "
                   "nvidia-cublas, or point NVTE_CUBLASLT_PATH at the file). Tried:",
                   tried);
  return r;
}

}  // namespace

const CublasLtApi &cublaslt() {
  static const Loaded loaded = load();  // thread-safe one-time initialisation
  if (!loaded.error.empty()) NVTE_FAIL(NVTE_ERROR_NOT_SUPPORTED, loaded.error);
  return loaded.api;
}

std::string cublas_status_str(cublasStatus_t s) {
  const char *name = nullptr;
  try {
    name = cublaslt().GetStatusString(s);
  } catch (...) {
  }
  return concat(name ? name : "cuBLAS status", " (", static_cast<int>(s), ")");
}

}  // namespace nvte::cuda
