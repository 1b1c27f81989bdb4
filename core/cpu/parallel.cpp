// parallel.cpp - thread pool behind parallel_for.
#include "parallel.h"

#include <condition_variable>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace nvte::cpu {
namespace {

thread_local bool t_in_pool_task = false;

class Pool {
 public:
  explicit Pool(int n) : n_threads_(n) {
    for (int i = 1; i < n; ++i) workers_.emplace_back([this] { loop(); });
  }
  ~Pool() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto &w : workers_) w.join();
  }
  int size() const { return n_threads_; }

  void run(size_t n_chunks, const std::function<void(size_t)> &chunk_fn) {
    std::lock_guard<std::mutex> serial(run_mu_);  // one parallel region at a time
    {
      // Workers still draining the previous region must leave before its counters reset.
      std::unique_lock<std::mutex> lk(mu_);
      done_cv_.wait(lk, [&] { return active_ == 0; });
      job_ = &chunk_fn;
      n_chunks_ = n_chunks;
      next_.store(0);
      done_ = 0;
      error_ = nullptr;
      ++generation_;
    }
    cv_.notify_all();
    work();
    std::unique_lock<std::mutex> lk(mu_);
    done_cv_.wait(lk, [&] { return done_ == n_chunks_; });
    job_ = nullptr;
    if (error_) std::rethrow_exception(error_);
  }

 private:
  void work() {
    t_in_pool_task = true;
    for (;;) {
      const size_t c = next_.fetch_add(1);
      if (c >= n_chunks_) break;
      try {
        (*job_)(c);
      } catch (...) {
        std::lock_guard<std::mutex> lk(mu_);
        if (!error_) error_ = std::current_exception();
      }
      std::lock_guard<std::mutex> lk(mu_);
      if (++done_ == n_chunks_) done_cv_.notify_all();
    }
    t_in_pool_task = false;
  }
  void loop() {
    size_t seen = 0;
    for (;;) {
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return stop_ || (generation_ != seen && job_ != nullptr); });
        if (stop_) return;
        seen = generation_;
        ++active_;
      }
      work();
      std::lock_guard<std::mutex> lk(mu_);
      if (--active_ == 0) done_cv_.notify_all();
    }
  }

  int n_threads_;
  std::vector<std::thread> workers_;
  std::mutex run_mu_, mu_;
  std::condition_variable cv_, done_cv_;
  const std::function<void(size_t)> *job_ = nullptr;
  size_t n_chunks_ = 0, done_ = 0, generation_ = 0, active_ = 0;
  std::atomic<size_t> next_{0};
  std::exception_ptr error_;
  bool stop_ = false;
};

int configured_threads() {
  if (const char *env = std::getenv("NVTE_CPU_THREADS")) {
    const int n = std::atoi(env);
    if (n > 0) return n;
  }
  const unsigned hw = std::thread::hardware_concurrency();
  return hw ? static_cast<int>(hw) : 1;
}

Pool &pool() {
  static Pool p(configured_threads());
  return p;
}

}  // namespace

int num_threads() { return pool().size(); }

void parallel_for(size_t n, size_t grain, const std::function<void(size_t, size_t)> &fn) {
  if (n == 0) return;
  if (grain == 0) grain = 1;
  const size_t max_chunks = (n + grain - 1) / grain;
  const int threads = (t_in_pool_task || max_chunks < 2) ? 1 : num_threads();
  if (threads <= 1) {
    fn(0, n);
    return;
  }
  // A few chunks per thread balances uneven rows without much scheduling overhead.
  const size_t n_chunks = std::min(max_chunks, static_cast<size_t>(threads) * 4);
  const size_t chunk = (n + n_chunks - 1) / n_chunks;
  const size_t real_chunks = (n + chunk - 1) / chunk;
  pool().run(real_chunks, [&](size_t c) {
    const size_t b = c * chunk;
    fn(b, std::min(n, b + chunk));
  });
}

}  // namespace nvte::cpu
