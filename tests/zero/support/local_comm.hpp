#pragma once
// A minimal in-process communicator for the zero/sched tests, used until loom's thread_comm
// is available on this branch: ranks are threads sharing a `local_group`; every collective
// is synchronous (its _async form completes before returning). Only what the ZeRO tests
// need; point-to-point and split throw.

#include <loom/comm/communicator.hpp>
#include <loom/core/error.hpp>

#include <algorithm>
#include <barrier>
#include <cstddef>
#include <exception>
#include <functional>
#include <memory>
#include <span>
#include <thread>
#include <vector>

namespace loom::test {

struct local_group {
  explicit local_group(int n) : size(n), sync(n), ptrs(static_cast<std::size_t>(n)) {}
  int size;
  std::barrier<> sync;
  std::vector<const void*> ptrs;
};

class local_comm {
 public:
  local_comm(std::shared_ptr<local_group> g, int rank) : g_(std::move(g)), rank_(rank) {}
  int rank() const { return rank_; }
  int size() const { return g_->size; }

  template <class T>
  void all_gather(std::span<const T> in, std::span<T> out) {
    LOOM_CHECK(out.size() == in.size() * size(), "local_comm::all_gather: out size");
    post(in.data());
    for (int r = 0; r < size(); ++r)
      std::copy_n(static_cast<const T*>(g_->ptrs[r]), in.size(), out.data() + r * in.size());
    g_->sync.arrive_and_wait();
  }
  template <class T>
  void reduce_scatter(std::span<const T> in, std::span<T> out, comm::reduce_op op) {
    LOOM_CHECK(in.size() == out.size() * size(), "local_comm::reduce_scatter: in size");
    post(in.data());
    for (std::size_t i = 0; i < out.size(); ++i) out[i] = reduce_at<T>(i + rank_ * out.size(), op);
    g_->sync.arrive_and_wait();
  }
  template <class T>
  void all_reduce(std::span<const T> in, std::span<T> out, comm::reduce_op op) {
    post(in.data());
    std::vector<T> tmp(in.size());
    for (std::size_t i = 0; i < in.size(); ++i) tmp[i] = reduce_at<T>(i, op);
    g_->sync.arrive_and_wait();
    std::copy(tmp.begin(), tmp.end(), out.begin());
  }
  template <class T>
  void broadcast(std::span<T> buf, int root) {
    post(buf.data());
    std::vector<T> tmp(static_cast<const T*>(g_->ptrs[root]), static_cast<const T*>(g_->ptrs[root]) + buf.size());
    g_->sync.arrive_and_wait();
    std::copy(tmp.begin(), tmp.end(), buf.begin());
  }
  template <class T> void send(std::span<const T>, int, int) { LOOM_THROW("local_comm: send unsupported"); }
  template <class T> void recv(std::span<T>, int, int) { LOOM_THROW("local_comm: recv unsupported"); }
  void barrier() { g_->sync.arrive_and_wait(); }
  template <class T> comm::work all_gather_async(std::span<const T> in, std::span<T> out) { all_gather(in, out); return {}; }
  template <class T> comm::work reduce_scatter_async(std::span<const T> in, std::span<T> out, comm::reduce_op op) {
    reduce_scatter(in, out, op);
    return {};
  }
  template <class T> comm::work all_reduce_async(std::span<const T> in, std::span<T> out, comm::reduce_op op) {
    all_reduce(in, out, op);
    return {};
  }
  template <class T> comm::work send_async(std::span<const T> in, int p, int t) { send(in, p, t); return {}; }
  template <class T> comm::work recv_async(std::span<T> out, int p, int t) { recv(out, p, t); return {}; }
  local_comm split(int, int) { LOOM_THROW("local_comm: split unsupported"); }

 private:
  void post(const void* p) {
    g_->ptrs[rank_] = p;
    g_->sync.arrive_and_wait();
  }
  template <class T>
  T reduce_at(std::size_t i, comm::reduce_op op) const {
    float acc = static_cast<float>(static_cast<const T*>(g_->ptrs[0])[i]);
    for (int r = 1; r < size(); ++r) {
      const float x = static_cast<float>(static_cast<const T*>(g_->ptrs[r])[i]);
      switch (op) {
        case comm::reduce_op::sum: case comm::reduce_op::avg: acc += x; break;
        case comm::reduce_op::max: acc = std::max(acc, x); break;
        case comm::reduce_op::min: acc = std::min(acc, x); break;
      }
    }
    if (op == comm::reduce_op::avg) acc /= static_cast<float>(size());
    return static_cast<T>(acc);
  }
  std::shared_ptr<local_group> g_;
  int rank_;
};
static_assert(comm::communicator<local_comm>);

/// Runs fn(comm) on `n` thread ranks; rethrows the first rank's exception.
inline void run_ranks(int n, const std::function<void(local_comm&)>& fn) {
  auto g = std::make_shared<local_group>(n);
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      local_comm c(g, r);
      try {
        fn(c);
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

}  // namespace loom::test
