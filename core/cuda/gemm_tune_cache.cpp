// gemm_tune_cache.cpp - see gemm_tune_cache.h.
#include "gemm_tune_cache.h"

#include <fcntl.h>
#include <unistd.h>

#include <fstream>
#include <sstream>

namespace nvte::cuda {

namespace {
constexpr const char *kArrow = " -> ";
}

std::string format_tune_record(const TuneRecord &r) {
  std::string s = r.key + kArrow + std::to_string(r.index);
  for (int64_t c : r.config) s += " " + std::to_string(c);
  return s;
}

bool parse_tune_record(const std::string &line, TuneRecord *r) {
  const size_t at = line.find(kArrow);
  if (at == std::string::npos || at == 0) return false;
  TuneRecord out;
  out.key = line.substr(0, at);
  std::istringstream in(line.substr(at + std::string(kArrow).size()));
  if (!(in >> out.index) || out.index < 0) return false;
  for (int64_t c; in >> c;) out.config.push_back(c);
  if (!in.eof() || out.config.empty()) return false;  // stopped on something not a number
  *r = std::move(out);
  return true;
}

std::map<std::string, TuneRecord> read_tune_cache(const std::string &path) {
  std::map<std::string, TuneRecord> records;
  std::ifstream f(path);
  for (std::string line; std::getline(f, line);) {
    TuneRecord r;
    if (parse_tune_record(line, &r)) records.emplace(r.key, std::move(r));  // the first one stays
  }
  return records;
}

bool append_tune_record(const std::string &path, const TuneRecord &r) {
  const std::string line = format_tune_record(r) + "\n";
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd < 0) return false;
  const ssize_t n = ::write(fd, line.data(), line.size());
  const bool closed = ::close(fd) == 0;
  return n == (ssize_t)line.size() && closed;
}

}  // namespace nvte::cuda
