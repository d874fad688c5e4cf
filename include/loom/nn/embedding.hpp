#pragma once
// Token embedding layer: `<name>.weight` [vocab, dim]; forward gathers rows, backward adds
// into the gathered rows' gradients. The slot is exposed so an output projection can share
// it (tied weights).

#include <loom/nn/context.hpp>
#include <loom/nn/parameters.hpp>
#include <loom/ops/host/embedding.hpp>

#include <cstdint>
#include <span>
#include <string>

namespace loom::nn {

template <ops::compute_type T>
class embedding {
 public:
  embedding() = default;
  embedding(param_layout& layout, const std::string& name, index_t vocab, index_t dim)
      : weight_(layout.add(name + ".weight", extents<2>{vocab, dim})) {}

  index_t vocab() const noexcept { return weight_.shape[0]; }
  index_t dim() const noexcept { return weight_.shape[1]; }
  const param_slot<2>& weight() const noexcept { return weight_; }

  /// out [n, dim] = table[tokens]; a token outside [0, vocab) is a loom::error naming it. On
  /// ctx's device (without one: the host).
  template <ops::param_type P, class Token, class D>
  void forward(const device_context<D>& ctx, std::span<P> params, view_on<Token, D, 1> tokens, view_on<T, D, 2> out) const {
    ctx.embedding_forward(tokens, weight_.template in<D>(as_const(params)), out);
  }
  template <ops::param_type P, class Token>
  void forward(std::span<P> params, tensor_view<Token, host, 1> tokens, tensor_view<T, host, 2> out) const {
    forward(host_context(), params, tokens, out);
  }
  /// dtable[tokens] += dout; grads empty: the table is frozen, nothing to do
  template <class Token, class D>
  void backward(const device_context<D>& ctx, std::span<T> grads, view_on<Token, D, 1> tokens, in_view_on<T, D, 2> dout) const {
    if (grads.empty()) return;
    ctx.embedding_backward(tokens, dout, weight_.template in<D>(grads));
  }
  template <class Token>
  void backward(std::span<T> grads, tensor_view<Token, host, 1> tokens, in_view<T, 2> dout) const {
    backward(host_context(), grads, tokens, dout);
  }

 private:
  param_slot<2> weight_{};
};

}  // namespace loom::nn
