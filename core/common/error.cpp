// error.cpp - thread-local last-error storage and the exported error accessors.
#include "error.h"

#include <cstring>

namespace nvte {
namespace {
thread_local std::string g_last_error;
}

void throw_error(NVTEStatus status, const char *file, int line, const std::string &msg) {
  // Keep only the path below the repository root so messages stay short.
  const char *short_file = std::strstr(file, "core/");
  throw Error(status, concat(msg, " [", short_file ? short_file : file, ":", line, "]"));
}

void set_last_error(const char *op, const char *msg) { g_last_error = concat(op, ": ", msg); }

}  // namespace nvte

extern "C" {
const char *nvte_get_last_error(void) { return nvte::g_last_error.c_str(); }
void nvte_clear_last_error(void) { nvte::g_last_error.clear(); }
int nvte_get_version(void) { return NVTE_VERSION; }
}
