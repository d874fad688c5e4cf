#pragma once
// Cross-entropy loss layer over logits [rows, vocab] with an ignore index (PyTorch's -100 by
// default): mean over counted targets. Keeps the per-row log-sum-exp between forward and
// backward.

#include <loom/core/buffer.hpp>
#include <loom/nn/context.hpp>
#include <loom/ops/host/cross_entropy.hpp>

namespace loom::nn {

/// On device D: its log-sum-exp in D's memory, its ops through a context (the host's unless
/// given; a CUDA one must outlive the layer).
template <ops::compute_type T, class D = host>
class cross_entropy {
 public:
  explicit cross_entropy(ops::cross_entropy_options opt = {})
    requires std::same_as<D, host>
      : cross_entropy(host_context(), opt) {}
  explicit cross_entropy(const device_context<D>& ctx, ops::cross_entropy_options opt = {}) : ctx_(&ctx), opt_(opt) {}

  /// Mean loss over targets != ignore_index; a target outside [0, vocab) is a loom::error.
  template <class Tgt>
  T forward(in_view_on<T, D, 2> logits, view_on<Tgt, D, 1> targets) {
    return ctx_->cross_entropy_forward(logits, targets, lse_for(logits.extent(0)), tensor_view<T, D, 2>{}, opt_);
  }
  /// forward and dlogits = d(mean loss)/dlogits (dloss = 1) in one pass over the logits
  /// (ops::cross_entropy_forward_backward); backward is then not needed.
  template <class Tgt>
  T forward_backward(in_view_on<T, D, 2> logits, view_on<Tgt, D, 1> targets, view_on<T, D, 2> dlogits) {
    LOOM_CHECK(!dlogits.empty(), "nn::cross_entropy::forward_backward: dlogits is empty");
    return ctx_->cross_entropy_forward(logits, targets, lse_for(logits.extent(0)), dlogits, opt_);
  }
  /// dlogits += dloss * d(mean loss)/dlogits for the logits of the last forward (dlogits = ...
  /// when !accumulate: the caller need not zero it first).
  template <class Tgt>
  void backward(in_view_on<T, D, 2> logits, view_on<Tgt, D, 1> targets, view_on<T, D, 2> dlogits, T dloss = T(1),
                bool accumulate = true) const {
    ctx_->cross_entropy_backward(logits, targets, lse(logits.extent(0)), dlogits, dloss, opt_, accumulate);
  }
  const ops::cross_entropy_options& options() const noexcept { return opt_; }

 private:
  /// The saved log-sum-exp of n rows, grown for a forward of more rows than before.
  tensor_view<T, D, 1> lse_for(index_t n) {
    if (lse_.size() < static_cast<std::size_t>(n)) lse_ = buffer<T, D>(n);
    return make_view<D>(lse_.data(), n);
  }
  tensor_view<const T, D, 1> lse(index_t n) const {
    LOOM_CHECK(static_cast<std::size_t>(n) <= lse_.size(), "nn::cross_entropy: backward for ", n,
               " rows before a forward with as many");
    return make_view<D>(lse_.data(), n);
  }
  const device_context<D>* ctx_;
  ops::cross_entropy_options opt_;
  buffer<T, D> lse_;
};

}  // namespace loom::nn
