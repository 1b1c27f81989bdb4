// parallel.h - a small persistent thread pool for the CPU backend.
//
// Own threads rather than OpenMP so the library never fights the OpenMP runtime
// a host framework (PyTorch, JAX, Paddle) already loaded. Threads: NVTE_CPU_THREADS
// or the hardware concurrency. Nested calls run serially in the calling thread.
#pragma once

#include <atomic>
#include <cstddef>
#include <functional>

namespace nvte::cpu {

int num_threads();

// Calls fn(begin, end) on disjoint chunks covering [0, n), each at least `grain` long
// (except possibly the last), spread over the pool; returns when all are done.
// The first exception thrown by fn is rethrown here.
void parallel_for(size_t n, size_t grain, const std::function<void(size_t, size_t)> &fn);

// Lock-free max for amax reductions across threads; NaN candidates are ignored
// (same rule as the GPU's fmaxf-based reduction).
inline void atomic_fmax(std::atomic<float> &target, float v) {
  if (!(v == v)) return;
  float cur = target.load(std::memory_order_relaxed);
  while (v > cur && !target.compare_exchange_weak(cur, v, std::memory_order_relaxed)) {
  }
}

}  // namespace nvte::cpu
