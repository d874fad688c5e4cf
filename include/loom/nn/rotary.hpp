#pragma once
// Rotary position embedding layer: a precomputed cos/sin table and a convention
// (ops::rope_style::interleaved for Meta/llama2.c checkpoints, half_split for Hugging Face).
// No parameters; forward rotates q or k in place, backward un-rotates their gradients.

#include <loom/nn/context.hpp>
#include <loom/ops/host/rope.hpp>

#include <cstdint>
#include <span>

namespace loom::nn {

template <ops::compute_type T>
class rotary {
 public:
  rotary() = default;
  /// rotary_dim: the leading channels of each head that rotate (0: all of them).
  rotary(index_t max_seq, index_t head_dim, double theta, ops::rope_style style, index_t rotary_dim = 0)
      : table_(max_seq, head_dim, theta, rotary_dim), style_(style) {}

  ops::rope_style style() const noexcept { return style_; }
  index_t max_seq() const noexcept { return table_.max_seq; }

  const ops::rope_table<T>& table() const noexcept { return table_; }

  /// x [batch, seq, heads, head_dim] rotated in place; positions start at pos0. On ctx's
  /// device (a CUDA context keeps a device copy of the table: nn/cuda/context.cuh).
  template <class D>
  void forward(const device_context<D>& ctx, view_on<T, D, 4> x, index_t pos0 = 0) const {
    ctx.rope_forward(x, table_, style_, pos0);
  }
  template <class D>
  void backward(const device_context<D>& ctx, view_on<T, D, 4> dx, index_t pos0 = 0) const {
    ctx.rope_backward(dx, table_, style_, pos0);
  }
  void forward(tensor_view<T, host, 4> x, index_t pos0 = 0) const { forward(host_context(), x, pos0); }
  /// x [tokens, heads, head_dim] rotated in place, token i at positions[i] (a ragged batch of
  /// sequences, as inference runs them).
  void forward(tensor_view<T, host, 3> x, std::span<const std::int64_t> positions) const {
    ops::rope_forward(host{}, x, table_, style_, positions);
  }
  void backward(tensor_view<T, host, 4> dx, index_t pos0 = 0) const { backward(host_context(), dx, pos0); }

 private:
  ops::rope_table<T> table_;
  ops::rope_style style_ = ops::rope_style::interleaved;
};

}  // namespace loom::nn
