// gemm_autotune.cpp - see gemm_autotune.h.
#include "gemm_autotune.h"

#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>

namespace nvte::cuda {

TuneMode autotune_mode() {
  const char *e = std::getenv("NVTE_GEMM_AUTOTUNE");
  if (e != nullptr && std::strcmp(e, "0") == 0) return TuneMode::off;
  if (e != nullptr && std::strcmp(e, "1") == 0) return TuneMode::all;
  return TuneMode::large;
}

bool autotune_log() {
  const char *e = std::getenv("NVTE_GEMM_AUTOTUNE_LOG");
  return e != nullptr && std::strcmp(e, "1") == 0;
}

const char *tune_cache_path() {
  const char *e = std::getenv("NVTE_GEMM_AUTOTUNE_CACHE");
  return e != nullptr && *e != '\0' ? e : nullptr;
}

std::vector<int64_t> algo_config_ids(const CublasLtApi &lt, const cublasLtMatmulAlgo_t &algo) {
  std::vector<int64_t> ids;
  for (auto attr : {CUBLASLT_ALGO_CONFIG_TILE_ID, CUBLASLT_ALGO_CONFIG_STAGES_ID, CUBLASLT_ALGO_CONFIG_SPLITK_NUM,
                    CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING,
                    CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID}) {
    uint32_t v = 0;
    size_t written = 0;
    ids.push_back(lt.MatmulAlgoConfigGetAttribute(&algo, attr, &v, sizeof(v), &written) == CUBLAS_STATUS_SUCCESS
                      ? (int64_t)v : (int64_t)-1);
  }
  return ids;
}

Candidates tuning_candidates(const CublasLtApi &lt, const cublasLtMatmulHeuristicResult_t *results, int found) {
  Candidates c;
  if (found <= 0) return c;
  // ids[2] / ids[3]: split-k count and reduction scheme
  const std::vector<int64_t> first = algo_config_ids(lt, results[0].algo);
  c.algos.push_back(results[0].algo);
  c.index.push_back(0);
  for (int i = 1; i < found; ++i) {
    if (results[i].state != CUBLAS_STATUS_SUCCESS || first[2] < 0) continue;
    const std::vector<int64_t> ids = algo_config_ids(lt, results[i].algo);
    if (ids[2] == first[2] && ids[3] == first[3]) {
      c.algos.push_back(results[i].algo);
      c.index.push_back(i);
    }
  }
  return c;
}

std::string tune_cache_key(const CublasLtApi &lt, int device, const int64_t *fields, int n) {
  int major = 0, minor = 0;
  char name[256] = "unknown";
  cudaDeviceProp prop;
  if (cudaGetDeviceProperties(&prop, device) == cudaSuccess) {
    std::snprintf(name, sizeof(name), "%s", prop.name);
    major = prop.major;
    minor = prop.minor;
  } else {
    cudaGetLastError();
  }
  for (char *c = name; *c; ++c)
    if (*c == ' ' || *c == '\t') *c = '_';
  std::string key = "cublaslt=" + std::to_string(lt.version) + " sm=" + std::to_string(major * 10 + minor) + " " +
                    name + " plan=";
  for (int i = 0; i < n; ++i) key += (i ? "," : "") + std::to_string(fields[i]);
  return key;
}

namespace {
std::mutex cache_mu;
std::map<std::string, std::map<std::string, TuneRecord>> &cache_files() {
  static std::map<std::string, std::map<std::string, TuneRecord>> files;  // path -> key -> record
  return files;
}
}  // namespace

const TuneRecord *cached_choice(const std::string &path, const std::string &key) {
  std::lock_guard<std::mutex> lk(cache_mu);
  auto &files = cache_files();
  auto f = files.find(path);
  if (f == files.end()) f = files.emplace(path, read_tune_cache(path)).first;
  auto r = f->second.find(key);
  return r == f->second.end() ? nullptr : &r->second;  // map nodes do not move
}

void remember_choice(const std::string &path, const TuneRecord &record) {
  std::lock_guard<std::mutex> lk(cache_mu);
  auto &files = cache_files();
  auto f = files.find(path);
  if (f == files.end()) f = files.emplace(path, read_tune_cache(path)).first;
  f->second.emplace(record.key, record);
  if (!append_tune_record(path, record)) {
    static bool told = false;
    if (!told) std::fprintf(stderr, "[nvte gemm autotune] cannot append to NVTE_GEMM_AUTOTUNE_CACHE=%s\n", path.c_str());
    told = true;
  }
}

}  // namespace nvte::cuda
