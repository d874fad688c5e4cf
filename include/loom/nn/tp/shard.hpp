#pragma once
// Tensor parallelism (Megatron-LM style): the rank's place in the tensor group, how a full
// parameter is cut into this rank's shard, and the two conjugate collectives f and g.
//
//   f = copy_to_tensor_parallel:      forward identity,   backward all-reduce (of dx)
//   g = reduce_from_tensor_parallel:  forward all-reduce,  backward identity
//
// A column-parallel linear (output features split) is preceded by f, a row-parallel linear
// (input features split) is followed by g, so an attention or MLP block costs one all-reduce
// in forward and one in backward.
//
// Why shards are described as data (`shard_desc`): a rank's parameters are ordinary slots in
// its own flat buffer (nn/parameters.hpp: what ZeRO partitions and the optimizer steps), and
// each slot records which rectangle [row0, row0 + rows) x [col0, col0 + cols) of the full
// [full_rows, full_cols] tensor it holds. From that one description follow: initialisation
// that gives every shard element the same counter-RNG value as the unsharded model,
// consolidation of parameters or gradients back into the single-rank layout, and a rank's
// slice read straight from a checkpoint's byte ranges (read_shards).

#include <loom/comm/communicator.hpp>
#include <loom/core/error.hpp>
#include <loom/core/tensor_view.hpp>
#include <loom/nn/parameters.hpp>
#include <loom/nn/workspace.hpp>

#include <algorithm>
#include <cstddef>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

namespace loom::nn::tp {

/// This rank's index in the tensor-parallel group and the group's size.
struct tp_rank {
  int rank = 0, size = 1;
  void validate() const {
    LOOM_CHECK(size >= 1, "nn::tp: tensor-parallel size must be >= 1, got tp=", size);
    LOOM_CHECK(rank >= 0 && rank < size, "nn::tp: rank ", rank, " outside the tensor group of size ", size);
  }
  template <comm::communicator C>
  static tp_rank of(const C& c) {
    return {c.rank(), c.size()};
  }
};

/// n split into `parts` equal pieces; refuses (naming `what`) when it does not divide.
inline index_t split_even(index_t n, int parts, const char* what) {
  LOOM_CHECK(parts >= 1 && n % parts == 0, "nn::tp: ", what, " (", n, ") must be divisible by the tensor-parallel size tp=",
             parts);
  return n / parts;
}

/// Which rectangle of a full [full_rows, full_cols] tensor a local slot holds (1-D tensors
/// are [n, 1]; a replicated tensor is the whole rectangle).
struct shard_desc {
  std::string name;            ///< the full model's parameter name
  std::size_t local_offset = 0;
  index_t rows = 0, cols = 1;  ///< local shape
  index_t full_rows = 0, full_cols = 1;
  index_t row0 = 0, col0 = 0;
  int replica = 0;  ///< 0: the copy that counts (norms, consolidation); k > 0: the k-th duplicate
};

/// The shards of one rank's parameters, in declaration order.
using shard_list = std::vector<shard_desc>;

template <std::size_t R>
inline void record(shard_list* out, const std::string& name, const param_slot<R>& s, index_t full_rows, index_t full_cols,
                   index_t row0, index_t col0, int replica = 0) {
  if (!out) return;
  const index_t rows = s.shape[0], cols = R == 2 ? s.shape[R - 1] : 1;
  out->push_back({name, s.offset, rows, cols, full_rows, full_cols, row0, col0, replica});
}

/// fn(local_offset, full_offset, count) for every row of every shard; `full_offset(name)`
/// gives where a parameter starts in the single-rank layout.
template <class OffsetOf, class Fn>
inline void for_each_shard_row(const shard_list& shards, OffsetOf full_offset, Fn fn) {
  for (const shard_desc& d : shards) {
    const std::size_t fo = full_offset(d.name);
    for (index_t r = 0; r < d.rows; ++r)
      fn(d.local_offset + static_cast<std::size_t>(r * d.cols),
         fo + static_cast<std::size_t>((d.row0 + r) * d.full_cols + d.col0), static_cast<std::size_t>(d.cols));
  }
}

/// local <- this rank's rectangles of `full` (a buffer in the single-rank layout).
template <class E, class F, class OffsetOf>
inline void load_shards(const shard_list& shards, std::span<const F> full, std::span<E> local, OffsetOf full_offset) {
  for_each_shard_row(shards, full_offset, [&](std::size_t l, std::size_t f, std::size_t n) {
    LOOM_CHECK(l + n <= local.size() && f + n <= full.size(), "nn::tp::load_shards: a row is outside the buffers (local ",
               local.size(), ", full ", full.size(), ")");
    for (std::size_t c = 0; c < n; ++c) local[l + c] = static_cast<E>(full[f + c]);
  });
}

/// local <- this rank's rectangles, each row read from a source of the full tensors:
/// read(name, first, out) fills `out` with elements [first, first + out.size()) of the full
/// tensor `name` (row-major), e.g. a byte range of a checkpoint file, so that a rank reads its
/// slice without the whole model in memory.
template <class Read>
inline void read_shards(const shard_list& shards, std::span<float> local, Read read) {
  for (const shard_desc& d : shards)
    for (index_t r = 0; r < d.rows; ++r) {
      const auto l = d.local_offset + static_cast<std::size_t>(r * d.cols), n = static_cast<std::size_t>(d.cols);
      LOOM_CHECK(l + n <= local.size(), "nn::tp::read_shards: a row of '", d.name, "' is outside the local buffer (",
                 local.size(), " floats)");
      read(d.name, static_cast<std::size_t>((d.row0 + r) * d.full_cols + d.col0), local.subspan(l, n));
    }
}

/// full's rectangles <- this rank's `local` shards (consolidation).
template <class E, class F, class OffsetOf>
inline void store_shards(const shard_list& shards, std::span<const E> local, std::span<F> full, OffsetOf full_offset) {
  for_each_shard_row(shards, full_offset, [&](std::size_t l, std::size_t f, std::size_t n) {
    LOOM_CHECK(l + n <= local.size() && f + n <= full.size(), "nn::tp::store_shards: a row is outside the buffers (local ",
               local.size(), ", full ", full.size(), ")");
    for (std::size_t c = 0; c < n; ++c) full[f + c] = static_cast<F>(local[l + c]);
  });
}

/// f: identity in forward; in backward the partial input gradients of the ranks are summed.
template <comm::communicator C, class T>
inline void copy_to_tensor_parallel_backward(C& tp, std::span<T> dx) {
  if (tp.size() > 1) tp.all_reduce(std::span<const T>(dx), dx, comm::reduce_op::sum);
}

/// g: in forward the partial outputs of the ranks are summed; identity in backward.
template <comm::communicator C, class T>
inline void reduce_from_tensor_parallel_forward(C& tp, std::span<T> y) {
  if (tp.size() > 1) tp.all_reduce(std::span<const T>(y), y, comm::reduce_op::sum);
}

/// dst [rows, cols] += src (row-major, contiguous): a rank's summed part of dx into a
/// gradient the caller may already hold (residual branches add).
template <class T>
inline void add_into(tensor_view<T, host, 2> dst, std::span<const T> src) {
  const index_t cols = dst.extent(1);
  for (index_t r = 0; r < dst.extent(0); ++r)
    for (index_t c = 0; c < cols; ++c) dst(r, c) += src[static_cast<std::size_t>(r * cols + c)];
}

/// The tensor group's reductions read and write the layers' buffers: over device memory a
/// group of several ranks needs a communicator that reads it (nccl_comm), which the layers do
/// not take yet, so a device runs tp = 1 (refused with a loom::error rather than a host
/// communicator handed device pointers).
template <class D, comm::communicator C>
inline void require_one_rank_on(const C& tp, const char* who) {
  LOOM_CHECK((std::is_same_v<D, host> || tp.size() == 1), who, ": on ", D::name,
             " a tensor-parallel group of one rank for now, got tp=", tp.size());
}

/// Where a layer's backward writes its input gradient: on one rank straight into dx; on
/// several into a part taken from ws, which finish_input_grad sums over the group and then
/// adds (or writes) into dx. So a one-rank layer pays nothing for being tensor-parallel.
template <comm::communicator C, class T, class D>
inline tensor_view<T, D, 2> input_grad_target(const C& tp, view_on<T, D, 2> dx, workspace<T, D>& ws) {
  require_one_rank_on<D>(tp, "nn::tp::input_grad_target");
  if (tp.size() == 1) return dx;
  auto part = ws.take(static_cast<std::size_t>(dx.numel()));
  return make_view<D>(part.data(), dx.extent(0), dx.extent(1));
}
/// Whether the layer's own backward should add into input_grad_target's view (only when it
/// is dx itself and the caller asked to accumulate).
template <comm::communicator C>
inline bool input_grad_accumulates(const C& tp, bool accumulate) {
  return tp.size() == 1 && accumulate;
}
/// f in backward: the parts of the group summed, then dx += (or =) the sum. Nothing on one rank.
template <comm::communicator C, class T, class D = host>
inline void finish_input_grad(C& tp, tensor_view<T, D, 2> part, view_on<T, D, 2> dx, bool accumulate,
                              const device_context<D>& ctx = host_context()) {
  if (part.data() == dx.data()) return;
  const std::span<T> sum(part.data(), static_cast<std::size_t>(part.numel()));
  copy_to_tensor_parallel_backward(tp, sum);
  if constexpr (std::is_same_v<D, host>) {
    if (!accumulate)
      for (index_t r = 0; r < dx.extent(0); ++r)
        for (index_t c = 0; c < dx.extent(1); ++c) dx(r, c) = T(0);
    add_into(dx, std::span<const T>(sum));
  } else {
    LOOM_CHECK(dx.stride(0) == dx.extent(1) && dx.stride(1) == 1, "nn::tp::finish_input_grad: dx on ", D::name,
               " must be contiguous (strides ", dx.stride(0), ", ", dx.stride(1), ")");
    const auto flat = make_view<D>(dx.data(), dx.numel());
    if (!accumulate) ctx.fill(flat, T(0));
    ctx.add(flat, make_view<D>(as_const(sum).data(), dx.numel()));
  }
}

}  // namespace loom::nn::tp
