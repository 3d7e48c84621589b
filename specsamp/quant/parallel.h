// The work split shared by the native kernels (qkernels.cc, attention.cc).
//
// Items 0..count-1 are taken from a shared counter by the calling thread and by helper
// threads: whoever is free takes the next one, and the caller waits only for items in
// flight, so busy (or missing) helpers can never block the call. A helper that joins
// after the call returned finds no item left and touches nothing else.
//
// Helpers: the kernels' own workers (one per core but the caller's), which keep spinning
// for a short while after each call. A decode step makes a few hundred short kernel calls
// back to back, each shorter than a sleeping thread takes to wake (XLA's pool wakes one per
// task), so with sleeping helpers the caller would do most of each call alone. Spinning
// workers are there within a microsecond; after a few microseconds of spinning they yield
// the core at each turn (XLA's own threads may need it), and sleep when no call came for
// SPECSAMP_KERNEL_SPIN_US (default 2000). Where the workers are taken (two calls at once
// from different threads) the call falls back to XLA's intra-op pool.
// SPECSAMP_KERNEL_HELPERS caps the helpers of a call (0: the caller alone).

#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include <unistd.h>

#include "xla/ffi/api/ffi.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define SPECSAMP_PAUSE() _mm_pause()
#else
#define SPECSAMP_PAUSE() std::this_thread::yield()
#endif

namespace specsamp {

struct Job {
  std::function<void(int64_t)> fn;
  int64_t count = 0;
  std::atomic<int64_t> next{0}, done{0};

  void work() {
    for (int64_t i; (i = next.fetch_add(1)) < count;) {
      fn(i);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

inline int64_t env_int(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::atoll(v) : fallback;
}

class Workers {
 public:
  // The process's workers (made on first use; again in a forked child, which has none).
  static Workers& get() {
    static std::mutex made;
    static Workers* workers = nullptr;
    std::lock_guard<std::mutex> lock(made);
    if (workers == nullptr || workers->pid_ != getpid()) workers = new Workers();  // never freed
    return *workers;
  }

  int64_t size() const { return static_cast<int64_t>(threads_.size()); }

  // Runs job on the caller and up to `helpers` workers; false if another call holds them.
  bool run(const std::shared_ptr<Job>& job, int64_t helpers) {
    if (busy_.test_and_set(std::memory_order_acquire)) return false;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      job_ = job;
      wanted_ = helpers;
    }
    generation_.fetch_add(1);
    if (sleeping_.load() > 0) {
      std::lock_guard<std::mutex> lock(mutex_);
      wake_.notify_all();
    }
    job->work();
    while (job->done.load(std::memory_order_acquire) < job->count) SPECSAMP_PAUSE();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      job_.reset();
    }
    busy_.clear(std::memory_order_release);
    return true;
  }

 private:
  Workers() : pid_(getpid()) {
    const int64_t cores = std::max<int64_t>(1, std::thread::hardware_concurrency());
    spin_ = std::chrono::microseconds(env_int("SPECSAMP_KERNEL_SPIN_US", 2000));
    for (int64_t i = 0; i + 1 < cores; ++i) threads_.emplace_back([this, i] { loop(i); });
    for (auto& t : threads_) t.detach();
  }

  void loop(int64_t index) {
    uint64_t seen = generation_.load();
    for (;;) {
      auto start = std::chrono::steady_clock::now();
      for (int spins = 0; generation_.load() == seen; ++spins) {
        // Pause-spin first (the next kernel call is usually microseconds away), then
        // yield: the core goes to whatever else is runnable (XLA's own threads, busy
        // with a float product between two kernel calls) instead of being burnt here.
        if (spins < 4096)
          SPECSAMP_PAUSE();
        else
          std::this_thread::yield();
        if ((spins & 255) == 0 && std::chrono::steady_clock::now() - start > spin_) {
          std::unique_lock<std::mutex> lock(mutex_);
          sleeping_.fetch_add(1);
          wake_.wait(lock, [&] { return generation_.load() != seen; });
          sleeping_.fetch_sub(1);
        }
      }
      seen = generation_.load();
      std::shared_ptr<Job> job;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        if (index < wanted_) job = job_;
      }
      if (job) job->work();
    }
  }

  const pid_t pid_;
  std::vector<std::thread> threads_;
  std::chrono::steady_clock::duration spin_;
  std::atomic_flag busy_ = ATOMIC_FLAG_INIT;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int64_t> sleeping_{0};
  std::mutex mutex_;
  std::condition_variable wake_;
  std::shared_ptr<Job> job_;
  int64_t wanted_ = 0;
};

// fn(i) for i in 0..count-1, on the caller and helper threads (no more than items left
// after the caller's first; SPECSAMP_KERNEL_HELPERS caps them).
template <typename F>
void parallel_for(xla::ffi::ThreadPool& pool, int64_t count, F fn) {
  static const int64_t cap = env_int("SPECSAMP_KERNEL_HELPERS", 1 << 20);
  auto job = std::make_shared<Job>();
  job->fn = fn;
  job->count = count;
  const int64_t helpers = std::min<int64_t>(cap, count - 1);
  if (helpers <= 0) return job->work();
  Workers& workers = Workers::get();
  if (workers.size() > 0 && workers.run(job, std::min(helpers, workers.size()))) return;
  // The workers are busy with another call: XLA's pool, one thread per core at most.
  const int64_t fallback = std::min<int64_t>(helpers, std::max<int64_t>(pool.num_threads() - 1, 0));
  for (int64_t i = 0; i < fallback; ++i) pool.Schedule([job] { job->work(); });
  job->work();
  while (job->done.load(std::memory_order_acquire) < count) std::this_thread::yield();
}

}  // namespace specsamp
