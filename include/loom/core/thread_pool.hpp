#pragma once
// A small fork-join pool for loom's own host kernels (GEMM row blocks, attention heads,
// row-wise norms, elementwise activations): `parallel_for(n, grain, fn)` splits [0, n) into contiguous parts,
// one per participant (the caller is one of them), and returns when all parts are done.
//
// Why this shape:
// - Static contiguous parts, not work stealing: part p of a given n and pool size is always
//   the same range, so a kernel whose parts write disjoint outputs gives bit-identical results
//   run to run (resume tests and rank-vs-single-rank comparisons rely on that).
// - Parts are claimed, not assigned: the caller runs part 0, and every participant (caller
//   included) then takes the next unclaimed part until none is left. A worker that is late
//   (asleep, or its core taken by another process or rank thread) leaves its part to whoever
//   is free instead of holding up the join; which thread runs a part never changes what the
//   part computes, so results stay bit-identical.
// - Idle threads poll for a short while (default 100 us), then block on a condition variable.
//   A training step issues over a hundred fork-joins a few hundred microseconds apart, and a
//   wake-up through the kernel costs tens of microseconds each time (measured: the 1.8M-param
//   LLaMA step on 2 threads is about 10% slower without the poll; 20 to 1,000 us all do). Bounded, because ranks may outnumber cores (thread_comm tests run 8 ranks on 2
//   cores) and a thread that only polls takes a core from one that works.
//   LOOM_POOL_SPIN_US sets the time for host_pool() (0: block at once).
// - A call that finds the pool busy (another rank thread is using it) or that comes from
//   inside a part runs serially in the caller: never a deadlock, never oversubscription
//   beyond one pool's worth of threads.
// - The first exception thrown by a part is rethrown in the caller after every part ended.
//
// Size of the process-wide pool, `host_pool()`: LOOM_NUM_THREADS, else OPENBLAS_NUM_THREADS,
// else OMP_NUM_THREADS, else std::thread::hardware_concurrency(); a value that is not a
// positive integer is a loom::error naming it (LOOM_POOL_SPIN_US likewise).

#include <loom/core/error.hpp>
#include <loom/core/tensor_view.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

namespace loom {

class thread_pool {
 public:
  /// How long a worker polls for the next part, and the caller for the last part to end,
  /// before blocking.
  static constexpr std::chrono::microseconds default_spin{100};
  /// Participants at most (a job's part count lives in 16 bits of its claim word).
  static constexpr int max_threads = 65535;

  /// `threads` participants: the caller plus threads - 1 workers (threads >= 1); idle
  /// threads poll for `spin` before they block (0: block at once).
  explicit thread_pool(int threads, std::chrono::microseconds spin = default_spin) : spin_(spin) {
    LOOM_CHECK(threads >= 1 && threads <= max_threads, "thread_pool: threads must be in 1..", max_threads,
               ", got threads=", threads);
    LOOM_CHECK(spin.count() >= 0, "thread_pool: spin must be >= 0 microseconds, got spin=", spin.count());
    for (int i = 1; i < threads; ++i) workers_.emplace_back([this] { work(); });
  }
  ~thread_pool() {
    {
      std::lock_guard lk(m_);
      stop_ = true;
      stop_flag_.store(true);
    }
    cv_work_.notify_all();
    for (auto& t : workers_) t.join();
  }
  thread_pool(const thread_pool&) = delete;
  thread_pool& operator=(const thread_pool&) = delete;

  int size() const noexcept { return static_cast<int>(workers_.size()) + 1; }

  /// How many parts parallel_for(n, grain, ...) uses: at most size(), each at least `grain`
  /// items (grain >= 1), at least one.
  int parts(index_t n, index_t grain = 1) const noexcept {
    const index_t by_grain = n / std::max<index_t>(grain, 1);
    return static_cast<int>(std::clamp<index_t>(by_grain, 1, size()));
  }

  /// Calls fn(part, begin, end) for the parts of [0, n): part p covers
  /// [p * n / parts, (p + 1) * n / parts); part 0 runs on the caller, the others on whichever
  /// participant claims them first (each exactly once). Blocks until every part returned.
  template <class F>
  void parallel_for(index_t n, index_t grain, F&& fn) {
    if (n <= 0) return;
    const int np = parts(n, grain);
    std::unique_lock busy(busy_, std::try_to_lock);
    if (np == 1 || !busy.owns_lock() || in_part()) {
      fn(0, index_t(0), n);
      return;
    }
    auto call = [](void* ctx, int p, index_t b, index_t e) {
      (*static_cast<std::remove_reference_t<F>*>(ctx))(p, b, e);
    };
    std::uint32_t gen = 0;
    {
      std::lock_guard lk(m_);
      job_ = {const_cast<void*>(static_cast<const void*>(&fn)), call, n, np};
      pending_.store(np, std::memory_order_relaxed);
      error_ = nullptr;
      gen = static_cast<std::uint32_t>(generation_.fetch_add(1, std::memory_order_release) + 1);
      // parts 1.. are up for claims; part 0 is the caller's
      claim_.store(std::uint64_t(gen) << 32 | std::uint64_t(np) << 16 | 1u, std::memory_order_release);
      if (sleepers_ > 0) cv_work_.notify_all();
    }
    for (int p = 0; p >= 0; p = claim(gen)) {  // part 0, then whatever is still unclaimed
      run_part(p);
      pending_.fetch_sub(1, std::memory_order_acq_rel);
    }
    if (!spin_until([&] { return pending_.load(std::memory_order_acquire) == 0; })) {
      std::unique_lock lk(m_);
      cv_done_.wait(lk, [&] { return pending_.load(std::memory_order_acquire) == 0; });
    }
    std::lock_guard lk(m_);
    if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
  }

 private:
  struct job {
    void* ctx = nullptr;
    void (*call)(void*, int, index_t, index_t) = nullptr;
    index_t n = 0;
    int parts = 0;
  };

  /// The next unclaimed part of job `gen` (marked claimed), or -1 when that job has none
  /// left or a later job replaced it.
  int claim(std::uint32_t gen) {
    std::uint64_t v = claim_.load(std::memory_order_acquire);
    for (;;) {
      const int next = static_cast<int>(v & 0xFFFFu), np = static_cast<int>(v >> 16 & 0xFFFFu);
      if (static_cast<std::uint32_t>(v >> 32) != gen || next >= np) return -1;
      if (claim_.compare_exchange_weak(v, v + 1, std::memory_order_acq_rel, std::memory_order_acquire)) return next;
    }
  }

  static bool& in_part() {
    thread_local bool inside = false;
    return inside;
  }

  void run_part(int p) {
    const index_t b = job_.n * p / job_.parts, e = job_.n * (p + 1) / job_.parts;
    in_part() = true;
    try {
      job_.call(job_.ctx, p, b, e);
    } catch (...) {
      std::lock_guard lk(m_);
      if (!error_) error_ = std::current_exception();
    }
    in_part() = false;
  }

  /// Polls `ready` for up to spin_; true when it became true meanwhile.
  template <class P>
  bool spin_until(P&& ready) const {
    if (ready()) return true;
    if (spin_.count() == 0) return false;
    const auto until = std::chrono::steady_clock::now() + spin_;
    for (;;) {
      for (int i = 0; i < 64; ++i) {
        if (ready()) return true;
        cpu_relax();
      }
      if (std::chrono::steady_clock::now() >= until) return ready();
    }
  }

  static void cpu_relax() noexcept {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    asm volatile("yield");
#endif
  }

  void work() {
    std::uint64_t seen = 0;
    for (;;) {
      if (!spin_until([&] { return generation_.load(std::memory_order_acquire) != seen || stop_flag_.load(std::memory_order_relaxed); })) {
        std::unique_lock lk(m_);
        ++sleepers_;
        cv_work_.wait(lk, [&] { return stop_ || generation_.load(std::memory_order_acquire) != seen; });
        --sleepers_;
      }
      {
        std::lock_guard lk(m_);
        if (stop_) return;
        seen = generation_.load(std::memory_order_relaxed);
      }
      for (int p; (p = claim(static_cast<std::uint32_t>(seen))) >= 0;) {
        run_part(p);
        if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
          std::lock_guard lk(m_);
          cv_done_.notify_one();
        }
      }
    }
  }

  std::vector<std::thread> workers_;
  std::mutex busy_;  // held by the caller of a parallel_for for its duration
  std::mutex m_;
  std::condition_variable cv_work_, cv_done_;
  job job_{};
  std::atomic<int> pending_{0};  // parts of the current job not yet returned
  // the current job's generation (low 32 bits, high word), its parts (bits 16-31) and its
  // next unclaimed part (bits 0-15): one word, so a claim can never take a part of a job
  // other than the one its claimer saw
  std::atomic<std::uint64_t> claim_{0};
  std::atomic<std::uint64_t> generation_{0};
  std::atomic<bool> stop_flag_{false};
  int sleepers_ = 0;  // workers waiting on cv_work_ (guarded by m_)
  std::chrono::microseconds spin_;
  std::exception_ptr error_;
  bool stop_ = false;
};

namespace detail {
/// The integer in environment variable `var`, in [lo, hi]; -1 when unset or empty.
inline long env_count(const char* var, long lo, long hi, const char* what) {
  const char* v = std::getenv(var);
  if (!v || !*v) return -1;
  char* end = nullptr;
  const long n = std::strtol(v, &end, 10);
  LOOM_CHECK(*end == '\0' && n >= lo && n <= hi, "host_pool: ", var, "='", v, "' is not ", what, " (", lo, "..", hi, ")");
  return n;
}
/// The pool size the environment asks for (see the header comment).
inline int host_pool_threads() {
  for (const char* var : {"LOOM_NUM_THREADS", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"})
    if (const long n = env_count(var, 1, 4096, "a thread count"); n > 0) return static_cast<int>(n);
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}
inline std::chrono::microseconds host_pool_spin() {
  const long us = env_count("LOOM_POOL_SPIN_US", 0, 1000000, "a spin time in microseconds");
  return us < 0 ? thread_pool::default_spin : std::chrono::microseconds(us);
}
inline thread_pool*& host_pool_override() noexcept {
  static thread_pool* p = nullptr;
  return p;
}
}  // namespace detail

/// The pool of loom's host kernels: the one a host_pool_scope installed, else the
/// process-wide pool sized from the environment, made on first use.
inline thread_pool& host_pool() {
  if (thread_pool* p = detail::host_pool_override()) return *p;
  static thread_pool pool(detail::host_pool_threads(), detail::host_pool_spin());
  return pool;
}

/// While alive, host_pool() is `pool` (process-wide; scopes nest). For a program that sizes
/// its pool from its own option (e.g. --threads), and for tests comparing thread counts.
/// Make and end scopes while no kernel runs.
class host_pool_scope {
 public:
  explicit host_pool_scope(thread_pool& pool) noexcept : old_(std::exchange(detail::host_pool_override(), &pool)) {}
  ~host_pool_scope() { detail::host_pool_override() = old_; }
  host_pool_scope(const host_pool_scope&) = delete;
  host_pool_scope& operator=(const host_pool_scope&) = delete;

 private:
  thread_pool* old_;
};

}  // namespace loom
