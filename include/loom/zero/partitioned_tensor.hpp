#pragma once
// partitioned_tensor: one tensor split across the ranks of a communicator.
//
// The ZeRO building block in its simplest form: numel elements padded to a multiple of the
// world size N; rank r owns the contiguous slice [r*s, (r+1)*s), s = padded/N, allocated
// from the rank's memory resource (so a test can see each rank hold 1/N of it). gather()
// all-gathers the whole tensor into a scratch buffer that is released when the returned
// buffer goes out of scope -- "gather, use, release". The engine applies the same scheme
// to every parameter of a model at once (flat_layout); this type is for a single tensor
// (an embedding, a checkpoint shard, a test).

#include <loom/comm/communicator.hpp>
#include <loom/core/buffer.hpp>
#include <loom/core/dtype.hpp>
#include <loom/core/error.hpp>
#include <loom/core/memory.hpp>

#include <algorithm>
#include <cstddef>
#include <span>

namespace loom::zero {

template <element T, comm::communicator C>
class partitioned_tensor {
 public:
  partitioned_tensor(C& comm, std::size_t numel, memory_resource& resource)
      : comm_(&comm), numel_(numel), world_(static_cast<std::size_t>(comm.size())),
        shard_((numel + world_ - 1) / world_, resource) {}

  std::size_t numel() const noexcept { return numel_; }
  std::size_t padded_numel() const noexcept { return shard_.size() * world_; }
  std::size_t shard_numel() const noexcept { return shard_.size(); }
  /// First element of the full tensor that this rank owns.
  std::size_t shard_begin() const noexcept { return static_cast<std::size_t>(comm_->rank()) * shard_.size(); }
  std::span<T> shard() noexcept { return shard_.span(); }
  std::span<const T> shard() const noexcept { return shard_.span(); }

  /// Keeps this rank's slice of a full tensor [numel] (padding is zero).
  void scatter_from(std::span<const T> full) {
    LOOM_CHECK(full.size() == numel_, "partitioned_tensor::scatter_from: full has ", full.size(), " elements, tensor has numel=",
               numel_);
    const std::size_t b = shard_begin(), e = std::min(numel_, b + shard_.size());
    std::fill(shard_.begin(), shard_.end(), T{});
    if (b < e) std::copy(full.begin() + b, full.begin() + e, shard_.begin());
  }

  /// All-gathers the tensor into out[padded_numel()] (its first numel() elements are the tensor).
  comm::work gather_async(std::span<T> out) {
    LOOM_CHECK(out.size() == padded_numel(), "partitioned_tensor::gather: out has ", out.size(),
               " elements, needs padded_numel=", padded_numel());
    return comm_->all_gather_async(std::span<const T>(shard_.span()), out);
  }
  /// Gathers into a scratch buffer [padded_numel()] from `scratch`, freed when it is dropped.
  buffer<T> gather(memory_resource& scratch) {
    buffer<T> out(padded_numel(), scratch);
    gather_async(out.span()).wait();
    return out;
  }

 private:
  C* comm_;
  std::size_t numel_, world_;
  buffer<T> shard_;  // [padded / world]
};

}  // namespace loom::zero
