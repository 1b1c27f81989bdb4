// error.h - the one error mechanism of the library.
//
// Inside the library, failed checks throw nvte::Error carrying an NVTEStatus and
// a message with the offending values and file:line. The ABI boundary
// (api_call) catches everything, stores the message for nvte_get_last_error()
// and returns the status, so no exception ever reaches a C caller.
#pragma once

#include <exception>
#include <new>
#include <sstream>
#include <string>
#include <utility>

#include "transformer_engine/transformer_engine.h"

namespace nvte {

class Error : public std::exception {
 public:
  Error(NVTEStatus status, std::string msg) : status_(status), msg_(std::move(msg)) {}
  const char *what() const noexcept override { return msg_.c_str(); }
  NVTEStatus status() const { return status_; }

 private:
  NVTEStatus status_;
  std::string msg_;
};

template <class... Args>
std::string concat(const Args &...args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}

[[noreturn]] void throw_error(NVTEStatus status, const char *file, int line, const std::string &msg);

// Stores "op: message" as this thread's last error.
void set_last_error(const char *op, const char *msg);

// A call on CUDA tensors runs with their device current (backend_of makes it so); the caller's
// device comes back when the outermost entry point returns (backend.cpp).
void begin_api_call() noexcept;
void end_api_call() noexcept;

// Runs f; converts any exception into a status + last-error message naming op.
template <class F>
NVTEStatus api_call(const char *op, F &&f) noexcept {
  struct Scope {
    Scope() { begin_api_call(); }
    ~Scope() { end_api_call(); }
  } scope;
  try {
    f();
    return NVTE_SUCCESS;
  } catch (const Error &e) {
    set_last_error(op, e.what());
    return e.status();
  } catch (const std::bad_alloc &) {
    set_last_error(op, "out of host memory");
    return NVTE_ERROR_OUT_OF_MEMORY;
  } catch (const std::exception &e) {
    set_last_error(op, e.what());
    return NVTE_ERROR_INTERNAL;
  } catch (...) {
    set_last_error(op, "unknown internal error");
    return NVTE_ERROR_INTERNAL;
  }
}

}  // namespace nvte

// Invalid argument (shape, dtype, null pointer, ...): the caller's mistake.
#define NVTE_CHECK(cond, ...)                                                               \
  do {                                                                                      \
    if (!(cond))                                                                            \
      ::nvte::throw_error(NVTE_ERROR_INVALID_ARGUMENT, __FILE__, __LINE__,                  \
                          ::nvte::concat(__VA_ARGS__));                                     \
  } while (0)

// A valid request this build or device does not support.
#define NVTE_CHECK_SUPPORTED(cond, ...)                                                     \
  do {                                                                                      \
    if (!(cond))                                                                            \
      ::nvte::throw_error(NVTE_ERROR_NOT_SUPPORTED, __FILE__, __LINE__,                     \
                          ::nvte::concat(__VA_ARGS__));                                     \
  } while (0)

#define NVTE_FAIL(status, ...) \
  ::nvte::throw_error(status, __FILE__, __LINE__, ::nvte::concat(__VA_ARGS__))
