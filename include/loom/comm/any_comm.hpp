#pragma once
// any_comm: one communicator type for every backend (type erasure).
//
// Why: a template over `communicator C` is compiled once per backend it runs on. A program
// that can run on one rank, on thread ranks and under mpirun (llama-train, llama-generate,
// llama-serve) would otherwise compile its trainer or engine three times, the costliest
// templates in the tree, for code that differs only in how bytes move. any_comm is itself a
// communicator: the program compiles its algorithm once, over any_comm, and picks the backend
// at run time. The price is one virtual call per collective, each of which moves a whole
// bucket, a layer's activations or a plan; the element loop stays in the backend. The
// typed API (argument checks included) is collective_api's, as for every backend; the
// backend's untyped entry points follow (collective_api::untyped_*).
//
//   loom::comm::run_ranks(4, [&](loom::comm::thread_comm& tc) {
//     loom::comm::any_comm c(std::ref(tc));   // borrows tc; any_comm(std::move(tc)) owns it
//     my_algorithm(c);                        // my_algorithm<any_comm>: compiled once
//   });
//
// Groups made by split() are any_comms owning the backend's own subgroup. target<C>() gives
// the backend back (nullptr if it is not a C).

#include <loom/comm/collective_api.hpp>
#include <loom/comm/communicator.hpp>

#include <concepts>
#include <cstddef>
#include <functional>
#include <memory>
#include <type_traits>
#include <typeinfo>
#include <utility>

namespace loom::comm {

/// Requires: C is a communicator built on collective_api (thread_comm, mpi_comm, nccl_comm,
/// self_comm), whose untyped entry points any_comm forwards to.
template <class C>
concept erasable_communicator = communicator<C> && std::derived_from<C, collective_api<C>>;

class any_comm : public collective_api<any_comm> {
 public:
  /// Owns `c`.
  template <erasable_communicator C>
  explicit any_comm(C c) : impl_(std::make_unique<model<C, C>>(std::move(c))) {}
  /// Borrows the communicator `c` refers to, which must outlive this any_comm and the
  /// operations started on it.
  template <erasable_communicator C>
  explicit any_comm(std::reference_wrapper<C> c) : impl_(std::make_unique<model<C, C*>>(&c.get())) {}

  any_comm(any_comm&&) noexcept = default;
  any_comm& operator=(any_comm&&) noexcept = default;

  int rank() const { return impl_->rank(); }
  int size() const { return impl_->size(); }
  void barrier() { impl_->barrier(); }
  /// Ranks with the same color form a new group, ordered by (key, rank): the backend's split.
  any_comm split(int color, int key) { return any_comm(impl_->split(color, key)); }

  /// The backend, if it is a C (owned or borrowed); else nullptr.
  template <class C>
  C* target() noexcept {
    return static_cast<C*>(impl_->target(typeid(C)));
  }

 private:
  friend class collective_api<any_comm>;

  struct base {
    virtual ~base() = default;
    virtual int rank() const = 0;
    virtual int size() const = 0;
    virtual void barrier() = 0;
    virtual std::unique_ptr<base> split(int color, int key) = 0;
    virtual void* target(const std::type_info& t) noexcept = 0;
    virtual work all_gather(const void* in, void* out, std::size_t n, dtype t, bool async) = 0;
    virtual work reduce_scatter(const void* in, void* out, std::size_t n, dtype t, reduce_op op, bool async) = 0;
    virtual work all_reduce(const void* in, void* out, std::size_t n, dtype t, reduce_op op, bool async) = 0;
    virtual work broadcast(void* buf, std::size_t n, dtype t, int root, bool async) = 0;
    virtual work send(const void* in, std::size_t n, dtype t, int peer, int tag, bool async) = 0;
    virtual work recv(void* out, std::size_t n, dtype t, int peer, int tag, bool async) = 0;
  };

  // Holder is C (owned) or C* (borrowed).
  template <class C, class Holder>
  struct model final : base {
    explicit model(Holder h) : held(std::move(h)) {}
    C& c() noexcept {
      if constexpr (std::is_pointer_v<Holder>)
        return *held;
      else
        return held;
    }
    const C& c() const noexcept {
      if constexpr (std::is_pointer_v<Holder>)
        return *held;
      else
        return held;
    }
    int rank() const override { return c().rank(); }
    int size() const override { return c().size(); }
    void barrier() override { c().barrier(); }
    std::unique_ptr<base> split(int color, int key) override { return std::make_unique<model<C, C>>(c().split(color, key)); }
    void* target(const std::type_info& t) noexcept override { return t == typeid(C) ? static_cast<void*>(&c()) : nullptr; }
    work all_gather(const void* in, void* out, std::size_t n, dtype t, bool async) override {
      return c().untyped_all_gather(in, out, n, t, async);
    }
    work reduce_scatter(const void* in, void* out, std::size_t n, dtype t, reduce_op op, bool async) override {
      return c().untyped_reduce_scatter(in, out, n, t, op, async);
    }
    work all_reduce(const void* in, void* out, std::size_t n, dtype t, reduce_op op, bool async) override {
      return c().untyped_all_reduce(in, out, n, t, op, async);
    }
    work broadcast(void* buf, std::size_t n, dtype t, int root, bool async) override {
      return c().untyped_broadcast(buf, n, t, root, async);
    }
    work send(const void* in, std::size_t n, dtype t, int peer, int tag, bool async) override {
      return c().untyped_send(in, n, t, peer, tag, async);
    }
    work recv(void* out, std::size_t n, dtype t, int peer, int tag, bool async) override {
      return c().untyped_recv(out, n, t, peer, tag, async);
    }
    Holder held;
  };

  explicit any_comm(std::unique_ptr<base> impl) : impl_(std::move(impl)) {}

  // collective_api's backend contract
  work start_all_gather(const void* in, void* out, std::size_t n, dtype t, bool async) {
    return impl_->all_gather(in, out, n, t, async);
  }
  work start_reduce_scatter(const void* in, void* out, std::size_t n, dtype t, reduce_op op, bool async) {
    return impl_->reduce_scatter(in, out, n, t, op, async);
  }
  work start_all_reduce(const void* in, void* out, std::size_t n, dtype t, reduce_op op, bool async) {
    return impl_->all_reduce(in, out, n, t, op, async);
  }
  work start_broadcast(void* buf, std::size_t n, dtype t, int root, bool async) {
    return impl_->broadcast(buf, n, t, root, async);
  }
  work start_send(const void* in, std::size_t n, dtype t, int peer, int tag, bool async) {
    return impl_->send(in, n, t, peer, tag, async);
  }
  work start_recv(void* out, std::size_t n, dtype t, int peer, int tag, bool async) {
    return impl_->recv(out, n, t, peer, tag, async);
  }

  std::unique_ptr<base> impl_;
};

static_assert(communicator<any_comm>);

}  // namespace loom::comm
