#pragma once
// timed<C>: the communicator C, counting the wall time this rank spends in communication.
//
// A program's "communication share" (the time a step loses to its collectives and transfers)
// is what tells a user whether more ranks will help. timed<C> measures it the same way on
// every backend: the time inside each blocking call, and inside wait()/test() of the handles
// its _async calls return (plus the call that starts them). It is wall time on this rank, so
// it includes waiting for slower peers as well as moving bytes: both are time the rank
// spends not computing, which is the share that matters. Groups split from a timed
// communicator count into the same clock, so a rank in a tensor and a pipeline group gets one
// figure. The cost is two steady_clock reads per call.
//
//   comm::timed<comm::thread_comm> tc(std::move(c));
//   ... run with tc ...
//   std::printf("%.1f%% of the time in communication\n", 100.0 * tc.clock().seconds() / wall);

#include <loom/comm/communicator.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <utility>

namespace loom::comm {

/// Time spent in communication and the number of calls, shared by a timed communicator and
/// the groups split from it (thread-safe: async handles may complete on another thread).
class comm_clock {
 public:
  double seconds() const noexcept { return double(ns_.load(std::memory_order_relaxed)) * 1e-9; }
  std::uint64_t calls() const noexcept { return calls_.load(std::memory_order_relaxed); }
  void reset() noexcept { ns_.store(0, std::memory_order_relaxed), calls_.store(0, std::memory_order_relaxed); }
  void add(std::chrono::steady_clock::duration d, std::uint64_t calls) noexcept {
    ns_.fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(d).count(), std::memory_order_relaxed);
    calls_.fetch_add(calls, std::memory_order_relaxed);
  }

 private:
  std::atomic<std::int64_t> ns_{0};
  std::atomic<std::uint64_t> calls_{0};
};

namespace detail {
// fn(), its wall time (and `calls`) added to the clock, also when it throws.
template <class Fn>
decltype(auto) timed_call(comm_clock& clock, std::uint64_t calls, Fn&& fn) {
  struct stop {
    comm_clock& c;
    std::chrono::steady_clock::time_point t0;
    std::uint64_t n;
    ~stop() { c.add(std::chrono::steady_clock::now() - t0, n); }
  } s{clock, std::chrono::steady_clock::now(), calls};
  return std::forward<Fn>(fn)();
}
}  // namespace detail

template <communicator C>
class timed {
 public:
  explicit timed(C inner, std::shared_ptr<comm_clock> clock = std::make_shared<comm_clock>())
      : inner_(std::move(inner)), clock_(std::move(clock)) {}

  int rank() const { return inner_.rank(); }
  int size() const { return inner_.size(); }
  C& inner() noexcept { return inner_; }
  const comm_clock& clock() const noexcept { return *clock_; }
  comm_clock& clock() noexcept { return *clock_; }

  // Each call forwards its arguments as they are, so every overload and default argument of
  // C's typed API (collective_api) is C's own.
  template <class... A>
  void all_gather(A&&... a) {
    measure(1, [&] { inner_.all_gather(std::forward<A>(a)...); });
  }
  template <class... A>
  void reduce_scatter(A&&... a) {
    measure(1, [&] { inner_.reduce_scatter(std::forward<A>(a)...); });
  }
  template <class... A>
  void all_reduce(A&&... a) {
    measure(1, [&] { inner_.all_reduce(std::forward<A>(a)...); });
  }
  template <class... A>
  void broadcast(A&&... a) {
    measure(1, [&] { inner_.broadcast(std::forward<A>(a)...); });
  }
  template <class... A>
  void send(A&&... a) {
    measure(1, [&] { inner_.send(std::forward<A>(a)...); });
  }
  template <class... A>
  void recv(A&&... a) {
    measure(1, [&] { inner_.recv(std::forward<A>(a)...); });
  }
  void barrier() {
    measure(1, [&] { inner_.barrier(); });
  }
  template <class... A>
  work all_gather_async(A&&... a) {
    return wrap([&] { return inner_.all_gather_async(std::forward<A>(a)...); });
  }
  template <class... A>
  work reduce_scatter_async(A&&... a) {
    return wrap([&] { return inner_.reduce_scatter_async(std::forward<A>(a)...); });
  }
  template <class... A>
  work all_reduce_async(A&&... a) {
    return wrap([&] { return inner_.all_reduce_async(std::forward<A>(a)...); });
  }
  template <class... A>
  work broadcast_async(A&&... a) {
    return wrap([&] { return inner_.broadcast_async(std::forward<A>(a)...); });
  }
  template <class... A>
  work send_async(A&&... a) {
    return wrap([&] { return inner_.send_async(std::forward<A>(a)...); });
  }
  template <class... A>
  work recv_async(A&&... a) {
    return wrap([&] { return inner_.recv_async(std::forward<A>(a)...); });
  }
  /// The subgroup, counting into this communicator's clock.
  timed split(int color, int key) {
    return timed(measure(0, [&] { return inner_.split(color, key); }), clock_);
  }

 private:
  template <class Fn>
  decltype(auto) measure(std::uint64_t calls, Fn&& fn) {
    return detail::timed_call(*clock_, calls, std::forward<Fn>(fn));
  }
  // An async call: its start is timed here, its completion in the handle's wait()/test().
  class timed_work final : public work_state {
   public:
    timed_work(work w, std::shared_ptr<comm_clock> c) : w_(std::move(w)), clock_(std::move(c)) {}
    void wait() override { detail::timed_call(*clock_, 0, [&] { w_.wait(); }); }
    bool test() override { return detail::timed_call(*clock_, 0, [&] { return w_.test(); }); }

   private:
    work w_;
    std::shared_ptr<comm_clock> clock_;
  };
  template <class Fn>
  work wrap(Fn&& start) {
    work w = measure(1, std::forward<Fn>(start));
    if (w.done()) return w;
    return work(std::make_shared<timed_work>(std::move(w), clock_));
  }

  C inner_;
  std::shared_ptr<comm_clock> clock_;
};

}  // namespace loom::comm
