#pragma once
// collective_api<Derived>: the typed surface every communicator shares (CRTP).
//
// Why: thread_comm, mpi_comm and nccl_comm differ only in how bytes move. The typed API
// (spans of any loom::element, argument checks, blocking forms as async().wait()) is written
// once here; a backend implements a handful of type-erased `start_*` functions taking
// (pointer, count, dtype) and returning a `work`, completed already when `async` is false.
// Input spans are taken as std::type_identity_t<std::span<const T>>, so the element type is
// deduced from the output and a mutable span converts to a const one without a second
// overload.
//
// Backend contract (Derived, reachable via `friend class collective_api<Derived>`):
//   int rank() const; int size() const;
//   work start_all_gather(const void* in, void* out, std::size_t n, dtype t, bool async);
//   work start_reduce_scatter(const void* in, void* out, std::size_t n, dtype t, reduce_op op, bool async);
//   work start_all_reduce(const void* in, void* out, std::size_t n, dtype t, reduce_op op, bool async);
//   work start_broadcast(void* buf, std::size_t n, dtype t, int root, bool async);
//   work start_send(const void* in, std::size_t n, dtype t, int peer, int tag, bool async);
//   work start_recv(void* out, std::size_t n, dtype t, int peer, int tag, bool async);
// where n counts elements (all_gather: per rank input; reduce_scatter: per rank output).

#include <loom/comm/communicator.hpp>
#include <loom/core/dtype.hpp>
#include <loom/core/error.hpp>

#include <cstddef>
#include <span>
#include <type_traits>

namespace loom::comm {

template <class Derived>
class collective_api {
  template <class T>
  using in_span = std::type_identity_t<std::span<const T>>;

 public:
  /// out[n * size] = concat over ranks of in[n]. in may be out's own block (in place).
  template <element T>
  void all_gather(in_span<T> in, std::span<T> out) { all_gather_async_(in, out, false).wait(); }
  template <element T>
  work all_gather_async(in_span<T> in, std::span<T> out) { return all_gather_async_(in, out, true); }

  /// out[n] = block `rank` of op-reduction over ranks of in[n * size].
  template <element T>
  void reduce_scatter(in_span<T> in, std::span<T> out, reduce_op op = reduce_op::sum) {
    reduce_scatter_async_(in, out, op, false).wait();
  }
  template <element T>
  work reduce_scatter_async(in_span<T> in, std::span<T> out, reduce_op op = reduce_op::sum) {
    return reduce_scatter_async_(in, out, op, true);
  }

  /// out[n] = op-reduction over ranks of in[n]; in == out allowed.
  template <element T>
  void all_reduce(in_span<T> in, std::span<T> out, reduce_op op = reduce_op::sum) {
    all_reduce_async_(in, out, op, false).wait();
  }
  template <element T>
  work all_reduce_async(in_span<T> in, std::span<T> out, reduce_op op = reduce_op::sum) {
    return all_reduce_async_(in, out, op, true);
  }
  /// In-place all-reduce.
  template <element T>
  void all_reduce(std::span<T> buf, reduce_op op = reduce_op::sum) {
    all_reduce_async_(std::span<const T>(buf), buf, op, false).wait();
  }

  /// buf[n] on every rank = buf[n] of `root`.
  template <element T>
  void broadcast(std::span<T> buf, int root) { broadcast_async_(buf, root, false).wait(); }
  template <element T>
  work broadcast_async(std::span<T> buf, int root) { return broadcast_async_(buf, root, true); }

  /// Tagged point-to-point. Messages between two ranks with one tag arrive in order.
  template <element T>
  void send(std::span<const T> in, int peer, int tag = 0) { send_async_(in, peer, tag, false).wait(); }
  template <element T>
    requires(!std::is_const_v<T>)
  void send(std::span<T> in, int peer, int tag = 0) { send_async_(std::span<const T>(in), peer, tag, false).wait(); }
  template <element T>
  work send_async(std::span<const T> in, int peer, int tag = 0) { return send_async_(in, peer, tag, true); }
  template <element T>
    requires(!std::is_const_v<T>)
  work send_async(std::span<T> in, int peer, int tag = 0) { return send_async_(std::span<const T>(in), peer, tag, true); }
  template <element T>
  void recv(std::span<T> out, int peer, int tag = 0) { recv_async_(out, peer, tag, false).wait(); }
  template <element T>
  work recv_async(std::span<T> out, int peer, int tag = 0) { return recv_async_(out, peer, tag, true); }

  /// The backend's untyped entry points behind the typed API (pointers, an element count and
  /// a run-time dtype, as in the backend contract above), without the typed API's argument
  /// checks: for adapters that erase the backend's type (any_comm.hpp), whose own typed API
  /// has checked the arguments before they reach these.
  work untyped_all_gather(const void* in, void* out, std::size_t n, dtype t, bool async) {
    return self().start_all_gather(in, out, n, t, async);
  }
  work untyped_reduce_scatter(const void* in, void* out, std::size_t n, dtype t, reduce_op op, bool async) {
    return self().start_reduce_scatter(in, out, n, t, op, async);
  }
  work untyped_all_reduce(const void* in, void* out, std::size_t n, dtype t, reduce_op op, bool async) {
    return self().start_all_reduce(in, out, n, t, op, async);
  }
  work untyped_broadcast(void* buf, std::size_t n, dtype t, int root, bool async) {
    return self().start_broadcast(buf, n, t, root, async);
  }
  work untyped_send(const void* in, std::size_t n, dtype t, int peer, int tag, bool async) {
    return self().start_send(in, n, t, peer, tag, async);
  }
  work untyped_recv(void* out, std::size_t n, dtype t, int peer, int tag, bool async) {
    return self().start_recv(out, n, t, peer, tag, async);
  }

 private:
  Derived& self() noexcept { return static_cast<Derived&>(*this); }
  int n_ranks() const noexcept { return static_cast<const Derived&>(*this).size(); }

  template <element T>
  work all_gather_async_(std::span<const T> in, std::span<T> out, bool async) {
    LOOM_CHECK(out.size() == in.size() * static_cast<std::size_t>(n_ranks()), "all_gather: out.size()=", out.size(),
               " must be in.size() (", in.size(), ") x size (", n_ranks(), ")");
    return self().start_all_gather(in.data(), out.data(), in.size(), dtype_of<T>, async);
  }
  template <element T>
  work reduce_scatter_async_(std::span<const T> in, std::span<T> out, reduce_op op, bool async) {
    LOOM_CHECK(in.size() == out.size() * static_cast<std::size_t>(n_ranks()), "reduce_scatter: in.size()=", in.size(),
               " must be out.size() (", out.size(), ") x size (", n_ranks(), ")");
    return self().start_reduce_scatter(in.data(), out.data(), out.size(), dtype_of<T>, op, async);
  }
  template <element T>
  work all_reduce_async_(std::span<const T> in, std::span<T> out, reduce_op op, bool async) {
    LOOM_CHECK(in.size() == out.size(), "all_reduce: in.size()=", in.size(), " must equal out.size()=", out.size());
    return self().start_all_reduce(in.data(), out.data(), out.size(), dtype_of<T>, op, async);
  }
  template <element T>
  work broadcast_async_(std::span<T> buf, int root, bool async) {
    LOOM_CHECK(root >= 0 && root < n_ranks(), "broadcast: root=", root, " is not a rank of this group of size ", n_ranks());
    return self().start_broadcast(buf.data(), buf.size(), dtype_of<T>, root, async);
  }
  template <element T>
  work send_async_(std::span<const T> in, int peer, int tag, bool async) {
    LOOM_CHECK(peer >= 0 && peer < n_ranks(), "send: peer=", peer, " is not a rank of this group of size ", n_ranks());
    LOOM_CHECK(tag >= 0, "send: tag=", tag, " must be >= 0");
    return self().start_send(in.data(), in.size(), dtype_of<T>, peer, tag, async);
  }
  template <element T>
  work recv_async_(std::span<T> out, int peer, int tag, bool async) {
    LOOM_CHECK(peer >= 0 && peer < n_ranks(), "recv: peer=", peer, " is not a rank of this group of size ", n_ranks());
    LOOM_CHECK(tag >= 0, "recv: tag=", tag, " must be >= 0");
    return self().start_recv(out.data(), out.size(), dtype_of<T>, peer, tag, async);
  }
};

}  // namespace loom::comm
