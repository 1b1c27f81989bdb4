// gemm_autotune.h - what gemm.cpp's plans need for NVTE_GEMM_AUTOTUNE (gemm_tuner.h) and
// NVTE_GEMM_AUTOTUNE_CACHE (gemm_tune_cache.h): the switches, the candidate list, the
// config ids of an algorithm and the cache file's key and records.
#pragma once

#include <cublasLt.h>

#include <cstddef>
#include <string>
#include <vector>

#include "cublaslt_loader.h"
#include "gemm_tune_cache.h"

namespace nvte::cuda {

// NVTE_GEMM_AUTOTUNE: which plans time the heuristic's candidates (gemm_tuner.h).
//   unset (or any other value): plans with m * n * k >= kTuneMinVolume (default);
//   1: every plan; 0: none (every call runs cuBLASLt's first choice, what cuBLAS and torch run,
//   or the cache file's choice).
// Only plans whose calls can run twice over the same inputs are tuned (D not FP8: cuBLASLt's
// amax and scale outputs stay the first choice's; a D that is read, beta != 0, is timed on a
// scratch copy, see gemm.cpp's tuning_call), since every tuning call of a candidate is checked
// bit for bit against the first choice, and only with a workspace (the check's hashes live in
// its scratch).
enum class TuneMode { off, large, all };
TuneMode autotune_mode();
// 2^34, e.g. 4096 x 4096 x 1024: about 25 us of FP8 work on an H100. Below it a few percent
// of a GEMM is a few microseconds, less than the host time of a call.
constexpr double kTuneMinVolume = 17179869184.0;
// The largest D an accumulating call (beta != 0) is tuned with: its timed runs write a scratch D
// of D's size from cudaMallocAsync, memory the framework's allocator does not see. 512 MiB:
// e.g. a float32 main_grad of 16384 x 8192.
constexpr size_t kMaxTuneScratchBytes = size_t(512) << 20;
// NVTE_GEMM_AUTOTUNE_LOG=1: each plan's timings and choice (or cached choice) on stderr.
bool autotune_log();
// NVTE_GEMM_AUTOTUNE_CACHE=<file>, or nullptr: plans built while it is set take the file's
// choice for their key from their first call; the tuner appends its choices to it.
const char *tune_cache_path();

// Tile, stages, split-k, reduction scheme, swizzle, custom option and cluster ids (-1 where
// cuBLASLt does not answer).
std::vector<int64_t> algo_config_ids(const CublasLtApi &lt, const cublasLtMatmulAlgo_t &algo);

// The heuristic's results that split k as the first does (same split count and reduction
// scheme), the first included, with their positions in `results`.
struct Candidates {
  std::vector<cublasLtMatmulAlgo_t> algos;
  std::vector<int> index;
};
Candidates tuning_candidates(const CublasLtApi &lt, const cublasLtMatmulHeuristicResult_t *results, int found);

// The cache file's key of a plan: cuBLASLt version, device (compute capability and name) and
// the plan's fields (shapes, types, epilogue, alignments, workspace; not the device index).
std::string tune_cache_key(const CublasLtApi &lt, int device, const int64_t *fields, int n);

// The record of `key` in the file (read once per process and file), or nullptr.
const TuneRecord *cached_choice(const std::string &path, const std::string &key);
// Appends a choice to the file (a failure to write is reported on stderr once, not raised:
// the GEMM itself has run).
void remember_choice(const std::string &path, const TuneRecord &record);

}  // namespace nvte::cuda
