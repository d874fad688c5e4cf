#pragma once
// The communicator concept: what every multi-rank algorithm in loom is written against.
//
// Three implementations satisfy it: thread_comm (ranks are threads of one process),
// mpi_comm (Boost.MPI / Open MPI processes, one or many hosts) and nccl_comm (NCCL on CUDA
// streams). An algorithm (ZeRO, the pipeline executor, tensor-parallel layers) is a template
// over `communicator C` and runs unchanged on all three.
//
// Buffers are spans of elements; for nccl_comm they hold device pointers (never dereferenced
// on the host). Counts are per rank:
//   all_gather(in[n], out[n * size])           out = concat over ranks of in
//   reduce_scatter(in[n * size], out[n], op)   out = block `rank` of op-reduction of all ins
//   all_reduce(in[n], out[n], op)              in == out (in place) allowed
//   broadcast(buf[n], root)
//   send(in[n], peer, tag) / recv(out[n], peer, tag)   tagged point-to-point
// Every collective has an _async form returning a `work` handle; the buffers must stay
// alive and untouched until wait() returns or test() returned true. half and bfloat16
// reductions accumulate in float. Element types: loom::element (float, double, half,
// bfloat16, int32, int64, ...).
//
// A collective on a group in which a rank has failed throws loom::error; it never hangs.

#include <loom/core/dtype.hpp>
#include <loom/core/error.hpp>

#include <concepts>
#include <cstddef>
#include <memory>
#include <span>
#include <string_view>

namespace loom::comm {

enum class reduce_op { sum, avg, max, min };

constexpr std::string_view reduce_op_name(reduce_op op) noexcept {
  switch (op) {
    case reduce_op::sum: return "sum";
    case reduce_op::avg: return "avg";
    case reduce_op::max: return "max";
    case reduce_op::min: return "min";
  }
  return "unknown";
}

/// Completion state of an asynchronous operation; implemented by each communicator.
class work_state {
 public:
  virtual ~work_state() = default;
  /// Blocks until the operation completed; throws loom::error if it failed.
  virtual void wait() = 0;
  /// Non-blocking: true once complete (and progresses the operation where the backend needs
  /// polling, as Open MPI does); throws loom::error if it failed.
  virtual bool test() = 0;
};

/// Handle to an asynchronous operation. A default-constructed work is already complete.
class work {
 public:
  work() = default;
  explicit work(std::shared_ptr<work_state> s) : state_(std::move(s)) {}
  void wait() {
    if (state_) {
      state_->wait();
      state_.reset();
    }
  }
  bool test() {
    if (!state_) return true;
    if (state_->test()) {
      state_.reset();
      return true;
    }
    return false;
  }
  bool done() const noexcept { return !state_; }

 private:
  std::shared_ptr<work_state> state_;
};

/// Requires: C is a group of ranks with loom's collectives (see the file comment).
template <class C>
concept communicator = std::movable<C> && requires(C& c, const C& cc, std::span<const float> in, std::span<float> out,
                                                   reduce_op op, int peer, int tag, int color, int key) {
  { cc.rank() } -> std::convertible_to<int>;
  { cc.size() } -> std::convertible_to<int>;
  c.all_gather(in, out);
  c.reduce_scatter(in, out, op);
  c.all_reduce(in, out, op);
  c.broadcast(out, peer);
  c.send(in, peer, tag);
  c.recv(out, peer, tag);
  c.barrier();
  { c.all_gather_async(in, out) } -> std::same_as<work>;
  { c.reduce_scatter_async(in, out, op) } -> std::same_as<work>;
  { c.all_reduce_async(in, out, op) } -> std::same_as<work>;
  { c.send_async(in, peer, tag) } -> std::same_as<work>;
  { c.recv_async(out, peer, tag) } -> std::same_as<work>;
  { c.split(color, key) } -> std::same_as<C>;
};

/// Requires: R maps this rank's scalar of type T to the value over all ranks. The hook a
/// global decision takes (the gradient norm's square sum, "did any rank overflow"), so the
/// same code runs on one rank (`no_reduce`) and on a group (`scalar_all_reduce`).
template <class R, class T>
concept scalar_reducer = std::invocable<R&, T> && std::convertible_to<std::invoke_result_t<R&, T>, T>;

/// One rank: the local value is the value.
struct no_reduce {
  template <class T>
  T operator()(T x) const noexcept {
    return x;
  }
};

/// All-reduces one scalar over `comm` with `op`. A bool is a flag: true when any rank's is.
template <communicator C>
struct scalar_all_reduce {
  C* comm = nullptr;
  reduce_op op = reduce_op::sum;
  double operator()(double x) const {
    comm->all_reduce(std::span<const double>(&x, 1), std::span<double>(&x, 1), op);
    return x;
  }
  bool operator()(bool any) const {
    float flag = any ? 1.f : 0.f;
    comm->all_reduce(std::span<const float>(&flag, 1), std::span<float>(&flag, 1), reduce_op::max);
    return flag > 0.f;
  }
};

}  // namespace loom::comm
