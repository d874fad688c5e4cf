#pragma once
// Tensor-parallel SwiGLU MLP: y = W2 (silu(W1 x) * W3 x) with the hidden dimension split.
// W1 and W3 are column-parallel (rows [r*F/tp, (r+1)*F/tp)), W2 row-parallel (the same
// columns), so each rank runs the single-rank swiglu_mlp over its F/tp hidden units and the
// partial outputs are summed (g); in backward the partial dx are summed (f).

#include <loom/comm/communicator.hpp>
#include <loom/nn/mlp.hpp>
#include <loom/nn/tp/shard.hpp>
#include <loom/nn/workspace.hpp>

#include <string>

namespace loom::nn::tp {

template <compute_type T>
class parallel_swiglu_mlp {
 public:
  using activations = typename swiglu_mlp<T>::activations;

  parallel_swiglu_mlp() = default;
  parallel_swiglu_mlp(param_layout& layout, const std::string& name, index_t dim, index_t hidden_dim, tp_rank t,
                      shard_list* shards = nullptr)
      : local_(layout, name, dim, (t.validate(), split_even(hidden_dim, t.size, (name + " hidden_dim").c_str()))) {
    const index_t f = local_.hidden_dim(), f0 = f * t.rank;
    // swiglu_mlp declares w1 [f, dim], w2 [dim, f], w3 [f, dim] in this order
    const auto& e = layout.entries();
    const std::size_t k = e.size() - 3;
    auto slot = [&](std::size_t i) { return param_slot<2>{e[i].offset, extents<2>{e[i].shape[0], e[i].shape[1]}}; };
    record(shards, name + ".w1.weight", slot(k), hidden_dim, dim, f0, 0);
    record(shards, name + ".w2.weight", slot(k + 1), dim, hidden_dim, 0, f0);
    record(shards, name + ".w3.weight", slot(k + 2), hidden_dim, dim, f0, 0);
  }

  index_t dim() const noexcept { return local_.dim(); }
  index_t local_hidden_dim() const noexcept { return local_.hidden_dim(); }
  activations make_activations(index_t rows, memory_resource& mr = default_resource<host>()) const {
    return local_.make_activations(rows, mr);
  }

  /// y [rows, dim] = mlp(x) summed over the tensor group; y overwritten, contiguous.
  template <comm::communicator C, ops::param_type P>
  void forward(C& tp, std::span<P> params, in_view<T, 2> x, activations& a, tensor_view<T, host, 2> y,
               workspace<T>& ws) const {
    local_.forward(params, x, a, y, ws);
    reduce_from_tensor_parallel_forward(tp, std::span<T>(y.data(), static_cast<std::size_t>(y.numel())));
  }

  /// dx += d/dx (summed over the group); this rank's shard gradients added.
  template <comm::communicator C, ops::param_type P>
  void backward(C& tp, std::span<P> params, std::span<T> grads, in_view<T, 2> x, const activations& a, in_view<T, 2> dy,
                tensor_view<T, host, 2> dx, workspace<T>& ws) const {
    const auto nd = static_cast<std::size_t>(x.numel());
    auto part = ws.take(nd);  // written by the local backward
    local_.backward(params, grads, x, a, dy, make_view(part.data(), x.extent(0), x.extent(1)), ws, /*accumulate=*/false);
    copy_to_tensor_parallel_backward(tp, part.subspan(0, nd));
    add_into(dx, std::span<const T>(part.data(), nd));
  }

 private:
  swiglu_mlp<T> local_;
};

}  // namespace loom::nn::tp
