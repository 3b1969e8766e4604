// Shared by the CPU custom calls: run work items on XLA's intra-op thread pool, with the calling thread taking
// items too, so it never waits on a task that has not started (no deadlock when the pool is busy).
#ifndef NIGHTJAR_CPU_PARALLEL_H_
#define NIGHTJAR_CPU_PARALLEL_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace nightjar {

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Calls work(item) once for every item in [0, items), on up to pool.num_threads() helpers plus the caller, and
// returns when all calls have returned. `work` is copied into each helper task; state it shares must outlive the
// call (it does: the caller waits for every helper that took an item).
template <typename Work>
void ParallelFor(xla::ffi::ThreadPool& pool, int64_t items, Work work) {
  struct Shared {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> running{0};  // helper tasks that may still be inside `drain`
  };
  auto shared = std::make_shared<Shared>();
  auto drain = [shared, items, work]() mutable {
    for (int64_t it; (it = shared->next.fetch_add(1)) < items;) work(it);
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads() - 1, items - 1);
  for (int64_t t = 0; t < helpers; ++t) {
    pool.Schedule([shared, items, drain]() mutable {
      if (shared->next.load() >= items) return;  // nothing left: the caller may already be gone
      shared->running.fetch_add(1);
      drain();
      shared->running.fetch_sub(1);
    });
  }
  drain();
  // Every item is taken. A helper that took one counted itself in `running` before its fetch_add on `next`, which
  // precedes the caller's last fetch_add (seq_cst), so the load below sees it. Spin rather than sleep: the wait is
  // at most one item (tens of microseconds at decode), shorter than a futex wake-up on a busy VM.
  for (int spins = 0; shared->running.load() != 0; ++spins) {
    if (spins < 4096) {
      CpuRelax();
    } else {
      std::this_thread::yield();
    }
  }
}

}  // namespace nightjar

#endif  // NIGHTJAR_CPU_PARALLEL_H_
