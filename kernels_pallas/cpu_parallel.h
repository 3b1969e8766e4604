// Shared by the CPU custom calls: run work items on the caller and helper threads (a team of our own that spins
// between calls, or XLA's intra-op pool when the team is busy or off), the calling thread taking items too, so it
// never waits on a task that has not started (no deadlock when the pool is busy).
#ifndef NIGHTJAR_CPU_PARALLEL_H_
#define NIGHTJAR_CPU_PARALLEL_H_

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


// Helper threads of our own, shared by every custom call in the process, that spin for a while after each call
// before they sleep. XLA's pool wakes a parked thread per call: 17-19 us before the helper starts, measured on the
// 2-vCPU Zen 4 VM at batch 1 (61 calls per step, each 20-120 us), so the caller ran much of every call alone. Within
// a step the next call comes a few microseconds after the last, while the team still spins. One job at a time: a
// call that finds the team busy (another thread's call) uses XLA's pool as before. The team is a function-local
// static in an inline function, a GNU unique symbol: the attention, linear and sampling libraries share one team
// (none spins while another's call runs). NIGHTJAR_CPU_SPIN_US sets the spin (default 30; 0: XLA's pool only).
// 30 us covers the gaps between a step's calls: a decode step 0.88-0.95x its time with XLA's pool at batch 1-64
// (profile_step.py --compare-spin-us); 100 us and more cost batch 32-64 up to 8%, the spinning thread taking a
// core from XLA's own multi-threaded ops between the calls.
class SpinTeam {
 public:
  using Job = std::function<void()>;

  static SpinTeam& Get() {
    static SpinTeam* team = new SpinTeam();  // never destroyed: its threads outlive static destruction
    return *team;
  }

  // True when this call may use the team (then it must call End). `threads`: the XLA pool's, helpers + caller.
  bool Begin(int64_t threads) {
    if (spin_ns_.load() <= 0 || threads < 2) return false;
    if (busy_.exchange(true)) return false;
    std::call_once(started_, [&] {
      for (int64_t i = 0; i < threads - 1; ++i) std::thread([this, i] { Loop(i); }).detach();
      size_ = threads - 1;
    });
    return true;
  }
  int64_t size() const { return size_; }
  void set_spin_us(int64_t us) { spin_ns_.store(1000 * std::max<int64_t>(0, us)); }
  int64_t spin_us() const { return spin_ns_.load() / 1000; }

  // Offers `job` to `helpers` team threads; each that joins calls job() once.
  void Publish(const Job* job, int64_t helpers) {
    wanted_.store(helpers);
    job_.store(job);
    gen_.fetch_add(1);
    if (sleepers_.load() > 0) {
      { std::lock_guard<std::mutex> lock(mu_); }
      cv_.notify_all();
    }
  }

  // Withdraws the job and waits for every thread inside it. A thread counts itself in `running_` before it reads
  // `job_` (seq_cst), so after the store below it either is seen here or reads null.
  void End() {
    job_.store(nullptr);
    SpinUntil([&] { return running_.load() == 0; });
    busy_.store(false);
  }

 private:
  SpinTeam() {
    const char* env = std::getenv("NIGHTJAR_CPU_SPIN_US");
    set_spin_us(env != nullptr ? std::atoll(env) : 30);
  }

  static int64_t NowNs() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch()).count();
  }

  void Loop(int64_t index) {
    uint64_t seen = gen_.load();
    for (;;) {
      uint64_t g = gen_.load();
      for (int64_t spins = 0, start = NowNs(); g == seen; g = gen_.load(), ++spins) {
        CpuRelax();
        if ((spins & 255) == 255 && NowNs() - start > spin_ns_.load()) {
          std::unique_lock<std::mutex> lock(mu_);
          sleepers_.fetch_add(1);
          cv_.wait(lock, [&] { return gen_.load() != seen; });
          sleepers_.fetch_sub(1);
        }
      }
      seen = g;
      if (index >= wanted_.load()) continue;
      running_.fetch_add(1);
      if (const Job* job = job_.load()) (*job)();
      running_.fetch_sub(1);
    }
  }

  std::atomic<int64_t> spin_ns_{0};
  int64_t size_ = 0;
  std::once_flag started_;
  std::atomic<bool> busy_{false};
  std::atomic<uint64_t> gen_{0};
  std::atomic<int64_t> wanted_{0}, running_{0}, sleepers_{0};
  std::atomic<const Job*> job_{nullptr};
  std::mutex mu_;
  std::condition_variable cv_;
};

// Runs `drain` (safe to call by any number of threads, at any time until the caller's own call returns) on the
// caller and up to `helpers` other threads: the spin team's when free, else XLA's pool. Each helper runs its own
// copy of `drain` (per-thread scratch in the work closures).
template <typename Drain>
void RunShared(xla::ffi::ThreadPool& pool, int64_t helpers, const Drain& drain) {
  if (helpers <= 0) {
    Drain own = drain;
    own();
    return;
  }
  SpinTeam& team = SpinTeam::Get();
  if (team.Begin(pool.num_threads())) {
    const SpinTeam::Job job = [&drain] {
      Drain own = drain;
      own();
    };
    team.Publish(&job, std::min(helpers, team.size()));
    Drain own = drain;
    own();
    team.End();
    return;
  }
  struct Shared {
    std::atomic<int64_t> running{0};
    std::atomic<bool> open{true};
  };
  auto shared = std::make_shared<Shared>();
  for (int64_t t = 0; t < helpers; ++t) {
    pool.Schedule([shared, own = Drain(drain)]() mutable {
      shared->running.fetch_add(1);
      if (shared->open.load()) own();  // closed: the caller is gone, and whatever drain refers to with it
      shared->running.fetch_sub(1);
    });
  }
  Drain own = drain;
  own();
  shared->open.store(false);
  SpinUntil([&] { return shared->running.load() == 0; });
}

// Calls work(item) once for every item in [0, items), on up to pool.num_threads() - 1 helpers plus the caller, and
// returns when all calls have returned. Each helper works on its own copy of `work`.
template <typename Work>
void ParallelFor(xla::ffi::ThreadPool& pool, int64_t items, Work work) {
  std::atomic<int64_t> next{0};
  auto drain = [&next, items, work]() mutable {
    for (int64_t it; (it = next.fetch_add(1)) < items;) work(it);
  };
  RunShared(pool, std::min<int64_t>(pool.num_threads() - 1, items - 1), drain);
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
  const size_t count = phases.size();
  std::vector<std::atomic<int64_t>> next(count), done(count);
  const Phase* ph = phases.data();
  auto drain = [&next, &done, ph, count]() {
    for (size_t p = 0; p < count; ++p) {
      const int64_t items = ph[p].items;
      for (int64_t it; (it = next[p].fetch_add(1)) < items;) {
        ph[p].work(it);
        done[p].fetch_add(1);
      }
      SpinUntil([&] { return done[p].load() >= items; });
    }
  };
  int64_t widest = 1;
  for (const Phase& p : phases) widest = std::max(widest, p.items);
  RunShared(pool, std::min<int64_t>(pool.num_threads() - 1, widest - 1), drain);
}

}  // namespace nightjar

// The spin team's setting from Python (cpu_build.spin_us): every library exports these, all reach one team.
extern "C" __attribute__((used)) inline void NightjarSetSpinUs(int64_t us) {
  nightjar::SpinTeam::Get().set_spin_us(us);
}
extern "C" __attribute__((used)) inline int64_t NightjarSpinUs() { return nightjar::SpinTeam::Get().spin_us(); }

#endif  // NIGHTJAR_CPU_PARALLEL_H_
