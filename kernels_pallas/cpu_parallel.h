// Shared by the CPU custom calls: run work items on XLA's intra-op thread pool, with the calling thread taking
// items too, so it never waits on a task that has not started (no deadlock when the pool is busy).
#ifndef NIGHTJAR_CPU_PARALLEL_H_
#define NIGHTJAR_CPU_PARALLEL_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace nightjar {

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Spins (`pause`, then `yield`) until done() is true: the waits here are one work item, tens of microseconds,
// shorter than a futex wake-up on a busy VM.
template <typename Done>
inline void SpinUntil(Done done) {
  for (int spins = 0; !done(); ++spins) {
    if (spins < 4096) {
      CpuRelax();
    } else {
      std::this_thread::yield();
    }
  }
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
  SpinUntil([&] { return shared->running.load() == 0; });
}


// Runs phases in order, each a set of items taken dynamically by the caller and up to pool.num_threads() - 1
// helpers (as ParallelFor); a thread starts phase p + 1 only when every item of phase p is done, so a phase may read
// what the one before wrote (a one-item phase is a serial step: one thread runs it while the others spin). One pool
// wake-up for a chain of dependent products instead of one per product; between phases the threads spin (a
// barrier of a few hundred nanoseconds) rather than return to the pool. A helper that starts late skips the phases
// already done; the caller never waits on an item nobody took (the caller takes every item no helper has).
struct Phase {
  int64_t items;
  std::function<void(int64_t)> work;
};

inline void ParallelPhases(xla::ffi::ThreadPool& pool, const std::vector<Phase>& phases) {
  struct Shared {
    explicit Shared(size_t n) : items(n), next(n), done(n) {}
    std::vector<int64_t> items;  // copied: a late helper must not read the caller's `phases`
    std::vector<std::atomic<int64_t>> next, done;
    std::atomic<int64_t> running{0};
  };
  const size_t count = phases.size();
  auto shared = std::make_shared<Shared>(count);
  for (size_t p = 0; p < count; ++p) shared->items[p] = phases[p].items;
  const Phase* ph = phases.data();  // read only for an item taken, which the caller waits for
  auto drain = [shared, ph, count]() {
    for (size_t p = 0; p < count; ++p) {
      const int64_t items = shared->items[p];
      for (int64_t it; (it = shared->next[p].fetch_add(1)) < items;) {
        ph[p].work(it);
        shared->done[p].fetch_add(1);
      }
      SpinUntil([&] { return shared->done[p].load() >= items; });
    }
  };
  int64_t widest = 1;
  for (const Phase& p : phases) widest = std::max(widest, p.items);
  const int64_t helpers = std::min<int64_t>(pool.num_threads() - 1, widest - 1);
  for (int64_t t = 0; t < helpers; ++t) {
    pool.Schedule([shared, count, drain]() {
      // every item of the last phase taken: the caller may be gone (and `phases` with it)
      if (count == 0 || shared->next[count - 1].load() >= shared->items[count - 1]) return;
      shared->running.fetch_add(1);
      drain();
      shared->running.fetch_sub(1);
    });
  }
  drain();
  SpinUntil([&] { return shared->running.load() == 0; });
}

}  // namespace nightjar

#endif  // NIGHTJAR_CPU_PARALLEL_H_
