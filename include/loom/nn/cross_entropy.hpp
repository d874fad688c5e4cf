#pragma once
// Cross-entropy loss layer over logits [rows, vocab] with an ignore index (PyTorch's -100 by
// default): mean over counted targets. Keeps the per-row log-sum-exp between forward and
// backward.

#include <loom/core/buffer.hpp>
#include <loom/ops/host/cross_entropy.hpp>

namespace loom::nn {

template <ops::compute_type T>
class cross_entropy {
 public:
  explicit cross_entropy(ops::cross_entropy_options opt = {}) : opt_(opt) {}

  /// Mean loss over targets != ignore_index; a target outside [0, vocab) is a loom::error.
  template <class Tgt>
  T forward(ops::in_view<T, 2> logits, tensor_view<Tgt, host, 1> targets) {
    return ops::cross_entropy_forward(host{}, logits, targets, lse_for(logits.extent(0)), opt_);
  }
  /// forward and dlogits = d(mean loss)/dlogits (dloss = 1) in one pass over the logits
  /// (ops::cross_entropy_forward_backward); backward is then not needed.
  template <class Tgt>
  T forward_backward(ops::in_view<T, 2> logits, tensor_view<Tgt, host, 1> targets, tensor_view<T, host, 2> dlogits) {
    return ops::cross_entropy_forward_backward(host{}, logits, targets, lse_for(logits.extent(0)), dlogits, opt_);
  }
  /// dlogits += dloss * d(mean loss)/dlogits for the logits of the last forward (dlogits = ...
  /// when !accumulate: the caller need not zero it first).
  template <class Tgt>
  void backward(ops::in_view<T, 2> logits, tensor_view<Tgt, host, 1> targets, tensor_view<T, host, 2> dlogits,
                T dloss = T(1), bool accumulate = true) const {
    ops::cross_entropy_backward(host{}, logits, targets, lse(logits.extent(0)), dlogits, dloss, opt_, accumulate);
  }
  const ops::cross_entropy_options& options() const noexcept { return opt_; }

 private:
  /// The saved log-sum-exp of n rows, grown for a forward of more rows than before.
  tensor_view<T, host, 1> lse_for(index_t n) {
    if (lse_.size() < static_cast<std::size_t>(n)) lse_ = buffer<T>(n);
    return make_view(lse_.data(), n);
  }
  tensor_view<const T, host, 1> lse(index_t n) const {
    LOOM_CHECK(static_cast<std::size_t>(n) <= lse_.size(), "nn::cross_entropy: backward for ", n,
               " rows before a forward with as many");
    return make_view(lse_.data(), n);
  }
  ops::cross_entropy_options opt_;
  buffer<T> lse_;
};

}  // namespace loom::nn
