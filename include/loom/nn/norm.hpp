#pragma once
// RMSNorm and LayerNorm layers over the last dimension. The per-row statistics forward
// computes are the caller's to keep (they are part of a block's saved activations, dropped
// and recomputed under activation checkpointing). An empty `grads` in backward means the
// weights are frozen (a model that keeps no gradient buffer): only dx is computed.

#include <loom/nn/context.hpp>
#include <loom/nn/parameters.hpp>
#include <loom/ops/host/norm.hpp>

#include <span>
#include <string>

namespace loom::nn {

template <ops::compute_type T>
class rmsnorm {
 public:
  rmsnorm() = default;
  /// Declares `<name>.weight` [dim].
  rmsnorm(param_layout& layout, const std::string& name, index_t dim, T eps)
      : weight_(layout.add(name + ".weight", extents<1>{dim})), eps_(eps) {}

  index_t dim() const noexcept { return weight_.shape[0]; }
  const param_slot<1>& weight() const noexcept { return weight_; }

  /// y [n, dim] = rmsnorm(x); rstd [n] saved for backward. On ctx's device (nn/context.hpp;
  /// without one: the host).
  template <ops::param_type P, class D>
  void forward(const device_context<D>& ctx, std::span<P> params, in_view_on<T, D, 2> x, view_on<T, D, 2> y,
               view_on<T, D, 1> rstd) const {
    ctx.rmsnorm_forward(x, weight_.template in<D>(params), y, rstd, eps_);
  }
  template <ops::param_type P>
  void forward(std::span<P> params, in_view<T, 2> x, tensor_view<T, host, 2> y, tensor_view<T, host, 1> rstd) const {
    forward(host_context(), params, x, y, rstd);
  }
  /// dx += ..., dweight += ... (grads empty: frozen, dx only)
  template <ops::param_type P, class D>
  void backward(const device_context<D>& ctx, std::span<P> params, std::span<T> grads, in_view_on<T, D, 2> dy,
                in_view_on<T, D, 2> x, in_view_on<T, D, 1> rstd, view_on<T, D, 2> dx) const {
    ctx.rmsnorm_backward(dy, x, weight_.template in<D>(params), rstd, dx,
                         grads.empty() ? tensor_view<T, D, 1>{} : weight_.template in<D>(grads));
  }
  template <ops::param_type P>
  void backward(std::span<P> params, std::span<T> grads, in_view<T, 2> dy, in_view<T, 2> x, in_view<T, 1> rstd,
                tensor_view<T, host, 2> dx) const {
    backward(host_context(), params, grads, dy, x, rstd, dx);
  }

 private:
  param_slot<1> weight_{};
  T eps_ = T(1e-5);
};

template <ops::compute_type T>
class layernorm {
 public:
  layernorm() = default;
  /// Declares `<name>.weight` and `<name>.bias` [dim].
  layernorm(param_layout& layout, const std::string& name, index_t dim, T eps)
      : weight_(layout.add(name + ".weight", extents<1>{dim})), bias_(layout.add(name + ".bias", extents<1>{dim})),
        eps_(eps) {}

  index_t dim() const noexcept { return weight_.shape[0]; }

  /// y = layernorm(x); mean, rstd [n] saved for backward.
  template <ops::param_type P>
  void forward(std::span<P> params, in_view<T, 2> x, tensor_view<T, host, 2> y, tensor_view<T, host, 1> mean,
               tensor_view<T, host, 1> rstd) const {
    ops::layernorm_forward(host{}, x, weight_.in(params), bias_.in(params), y, mean, rstd, eps_);
  }
  template <ops::param_type P>
  void backward(std::span<P> params, std::span<T> grads, in_view<T, 2> dy, in_view<T, 2> x, in_view<T, 1> mean,
                in_view<T, 1> rstd, tensor_view<T, host, 2> dx) const {
    const bool frozen = grads.empty();
    ops::layernorm_backward(host{}, dy, x, weight_.in(params), mean, rstd, dx,
                            frozen ? tensor_view<T, host, 1>{} : weight_.in(grads),
                            frozen ? tensor_view<T, host, 1>{} : bias_.in(grads));
  }

 private:
  param_slot<1> weight_{}, bias_{};
  T eps_ = T(1e-5);
};

}  // namespace loom::nn
