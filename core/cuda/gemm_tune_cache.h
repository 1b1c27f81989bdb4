// gemm_tune_cache.h - NVTE_GEMM_AUTOTUNE_CACHE: the GEMM autotuner's choices in a text file,
// so that a later process runs them from its first call: no tuning phase (whose calls run
// different algorithms), and the same algorithm in every run that reads the file.
//
// One line per GEMM plan: "<key> -> <index> <config ids>". The key names the cuBLASLt version,
// the device and the plan (shapes, types, epilogue, alignments, workspace); index is the
// chosen candidate's position in the heuristic's list (asked for with the same preferences);
// the config ids (tile, stages, split-k, reduction scheme, swizzle, custom option, cluster)
// are checked on reading, so a different heuristic answer falls back to the first choice.
// Plain C++ (tested without a GPU: tests/unit/test_gemm_tune_cache.cpp).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace nvte::cuda {

struct TuneRecord {
  std::string key;              // no " -> ", no newline
  int index = 0;                // position among the heuristic's candidates
  std::vector<int64_t> config;  // the candidate's config ids
};

std::string format_tune_record(const TuneRecord &r);  // one line, without the newline
bool parse_tune_record(const std::string &line, TuneRecord *r);  // false: malformed

// The records of a file; the first record of a key wins, malformed lines are skipped, a
// missing file reads as empty.
std::map<std::string, TuneRecord> read_tune_cache(const std::string &path);

// Appends one line with a single write (O_APPEND: processes sharing the file do not
// interleave lines). False when the file cannot be written.
bool append_tune_record(const std::string &path, const TuneRecord &r);

}  // namespace nvte::cuda
