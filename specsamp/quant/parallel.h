// The work split shared by the native kernels (qkernels.cc, attention.cc).
//
// Items 0..count-1 are taken from a shared counter by the calling thread and by pool
// tasks: whoever is free takes the next one, and the caller waits only for items in
// flight, so a busy (or one-thread) pool can never block the call. A pool task that
// starts after the call returned finds no item left and touches nothing else.

#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace specsamp {

// The caller works too, so at most one helper fewer than the pool's threads keeps one
// thread per core (an extra thread gets preempted holding an item, and the call waits a
// time slice); no more helpers than items left after the caller's first.
template <typename F>
void parallel_for(xla::ffi::ThreadPool& pool, int64_t count, int64_t max_helpers, F fn) {
  struct Counters {
    std::atomic<int64_t> next{0}, done{0};
  };
  auto counters = std::make_shared<Counters>();
  auto work = [counters, count, fn] {
    for (int64_t i; (i = counters->next.fetch_add(1)) < count;) {
      fn(i);
      counters->done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t helpers = std::min<int64_t>(
      {std::max<int64_t>(pool.num_threads() - 1, 0), max_helpers, count - 1});
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule(decltype(work)(work));  // a copy each
  work();
  while (counters->done.load(std::memory_order_acquire) < count) std::this_thread::yield();
}

}  // namespace specsamp
