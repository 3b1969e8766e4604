// Shared by the CPU custom calls: run work items on XLA's intra-op thread pool, with the calling thread taking
// items too, so it never waits on a task that has not started (no deadlock when the pool is busy).
#ifndef NIGHTJAR_CPU_PARALLEL_H_
#define NIGHTJAR_CPU_PARALLEL_H_

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>

#include "xla/ffi/api/ffi.h"

namespace nightjar {

// Calls work(item) once for every item in [0, items), on up to pool.num_threads() helpers plus the caller, and
// returns when all calls have returned. `work` is copied into each helper task; state it shares must outlive the
// call (it does: the caller waits for every helper that took an item).
template <typename Work>
void ParallelFor(xla::ffi::ThreadPool& pool, int64_t items, Work work) {
  struct Shared {
    std::atomic<int64_t> next{0};
    std::mutex mu;
    std::condition_variable cv;
    int64_t running = 0;  // helper tasks that took an item and have not finished
  };
  auto shared = std::make_shared<Shared>();
  auto drain = [shared, items, work]() mutable {
    for (int64_t it; (it = shared->next.fetch_add(1)) < items;) work(it);
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads() - 1, items - 1);
  for (int64_t t = 0; t < helpers; ++t) {
    pool.Schedule([shared, items, drain]() mutable {
      {
        std::lock_guard<std::mutex> lock(shared->mu);
        if (shared->next.load() >= items) return;  // nothing left: the caller may already be gone
        ++shared->running;
      }
      drain();
      std::lock_guard<std::mutex> lock(shared->mu);
      if (--shared->running == 0) shared->cv.notify_all();
    });
  }
  drain();
  // every item is taken; wait for helpers still finishing theirs (they are running, so this cannot deadlock)
  std::unique_lock<std::mutex> lock(shared->mu);
  shared->cv.wait(lock, [&] { return shared->running == 0; });
}

}  // namespace nightjar

#endif  // NIGHTJAR_CPU_PARALLEL_H_
