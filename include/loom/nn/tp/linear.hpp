#pragma once
// Column- and row-parallel linear layers (Megatron-LM), y = x W^T with W: [out, in].
//
//   column_parallel_linear: W split by output rows; rank r holds W[r*out/tp : (r+1)*out/tp, :].
//     x is replicated, y_local [n, out/tp] is this rank's slice of y (no communication in
//     forward; backward sums the ranks' partial dx: f's backward).
//   row_parallel_linear: W split by input columns; rank r holds W[:, r*in/tp : (r+1)*in/tp].
//     x_local [n, in/tp] is this rank's slice of x, y = sum over ranks of x_local W_r^T
//     (g's all-reduce in forward); backward needs no communication.
//
// Both wrap an nn::linear over the local shard (so the math is the single-rank layer's) and
// record their shard in a shard_list (shard.hpp). The standalone forward/backward below
// include the collective; blocks that chain a column- and a row-parallel layer (attention,
// MLP) call local() and place one f and one g around the pair.

#include <loom/comm/communicator.hpp>
#include <loom/nn/linear.hpp>
#include <loom/nn/tp/shard.hpp>
#include <loom/nn/workspace.hpp>

#include <span>
#include <string>

namespace loom::nn::tp {

template <compute_type T>
class column_parallel_linear {
 public:
  column_parallel_linear() = default;
  /// Declares `<name>.weight` [out/tp, in]: rows [rank*out/tp, (rank+1)*out/tp) of the full weight.
  column_parallel_linear(param_layout& layout, const std::string& name, index_t in, index_t out, tp_rank t,
                         shard_list* shards = nullptr)
      : local_(layout, name, in, (t.validate(), split_even(out, t.size, (name + " output features").c_str()))),
        row0_(local_.out_features() * t.rank) {
    record(shards, name + ".weight", local_.weight(), out, in, row0_, 0);
  }
  /// A column-parallel layer over an already declared row shard (tied vocab-parallel output).
  column_parallel_linear(param_slot<2> shared, index_t row0) : local_(shared), row0_(row0) {}

  const linear<T>& local() const noexcept { return local_; }
  index_t in_features() const noexcept { return local_.in_features(); }
  index_t local_out_features() const noexcept { return local_.out_features(); }
  index_t first_output() const noexcept { return row0_; }

  /// y_local [n, out/tp] = x [n, in] W_r^T   (f: identity)
  template <comm::communicator C, ops::param_type P, class D>
  void forward(C&, std::span<P> params, in_view_on<T, D, 2> x, view_on<T, D, 2> y_local, workspace<T, D>& ws) const {
    local_.forward(params, x, y_local, ws);
  }
  /// dW_r += dy_scale dy_local^T x; dx += sum over ranks of dy_scale dy_local W_r (f's
  /// all-reduce; dx = ... when !accumulate; an empty dx is not computed).
  template <comm::communicator C, ops::param_type P, class D>
  void backward(C& tp, std::span<P> params, std::span<T> grads, in_view_on<T, D, 2> x, in_view_on<T, D, 2> dy_local,
                view_on<T, D, 2> dx, workspace<T, D>& ws, bool accumulate = true, T dy_scale = T(1)) const {
    if (dx.empty()) return local_.backward(params, grads, x, dy_local, dx, ws, accumulate, dy_scale);
    const auto target = input_grad_target(tp, dx, ws);
    local_.backward(params, grads, x, dy_local, target, ws, input_grad_accumulates(tp, accumulate), dy_scale);
    finish_input_grad(tp, target, dx, accumulate, ws.context());
  }

 private:
  linear<T> local_;
  index_t row0_ = 0;
};

template <compute_type T>
class row_parallel_linear {
 public:
  row_parallel_linear() = default;
  /// Declares `<name>.weight` [out, in/tp]: columns [rank*in/tp, (rank+1)*in/tp) of the full weight.
  row_parallel_linear(param_layout& layout, const std::string& name, index_t in, index_t out, tp_rank t,
                      shard_list* shards = nullptr)
      : local_(layout, name, (t.validate(), split_even(in, t.size, (name + " input features").c_str())), out),
        col0_(local_.in_features() * t.rank) {
    record(shards, name + ".weight", local_.weight(), out, in, 0, col0_);
  }

  const linear<T>& local() const noexcept { return local_; }
  index_t local_in_features() const noexcept { return local_.in_features(); }
  index_t out_features() const noexcept { return local_.out_features(); }
  index_t first_input() const noexcept { return col0_; }

  /// y [n, out] = sum over ranks of x_local [n, in/tp] W_r^T   (g's all-reduce)
  template <comm::communicator C, ops::param_type P>
  void forward(C& tp, std::span<P> params, in_view<T, 2> x_local, tensor_view<T, host, 2> y, workspace<T>& ws) const {
    LOOM_CHECK(y.is_contiguous(), "nn::tp::row_parallel_linear: y must be contiguous");
    local_.forward(params, x_local, y, ws);
    reduce_from_tensor_parallel_forward(tp, std::span<T>(y.data(), static_cast<std::size_t>(y.numel())));
  }
  /// dW_r += dy^T x_local; dx_local += dy W_r   (g's backward: identity)
  template <comm::communicator C, ops::param_type P>
  void backward(C&, std::span<P> params, std::span<T> grads, in_view<T, 2> x_local, in_view<T, 2> dy,
                tensor_view<T, host, 2> dx_local, workspace<T>& ws) const {
    local_.backward(params, grads, x_local, dy, dx_local, ws);
  }

 private:
  linear<T> local_;
  index_t col0_ = 0;
};

}  // namespace loom::nn::tp
