#pragma once
// Linear layer y = x W^T (+ b), W: [out, in] (PyTorch's layout), with explicit backward.
//
// Parameters are read from the model's flat parameter buffer through slots; gradients are
// ADDED into the flat gradient buffer (callers zero it once per accumulation window; an empty
// gradient span means every weight and bias is frozen: no dW, no db, dx as always), and
// dx is added into (so residual branches sum without copies), or written with accumulate =
// false (no zero pass over a fresh workspace buffer first). Weights stored in 16 bits are
// widened into the workspace before the GEMM. A linear built from an existing slot shares
// the weight (tied embedding / output projection) and adds its gradient into the same place.
//
// A layer may instead be backed by a frozen_op (set_frozen): a weight it does not hold in the
// flat buffer (QLoRA's quantised base, with a LoRA adapter beside it), or one it does but with
// a LoRA branch the merged weight cannot express (dropout), computes x W^T and dx, and the op
// decides about dW; a bias is still the layer's. Why a hook here rather than a second attention and MLP: the blocks keep one
// data flow, and only the linear step differs.

#include <loom/nn/parameters.hpp>
#include <loom/nn/workspace.hpp>
#include <loom/ops/host/common.hpp>
#include <loom/ops/host/fill.hpp>
#include <loom/ops/host/gemm.hpp>

#include <initializer_list>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace loom::nn {

/// The parameter in slot `s` as compute-type elements: the stored tensor itself when P == T,
/// else a widened copy in the workspace (on the workspace's device).
template <compute_type T, ops::param_type P, std::size_t R, class D>
inline tensor_view<const T, D, R> weights_as(const param_slot<R>& s, std::span<P> params, workspace<T, D>& ws) {
  auto w = s.template in<D>(as_const(params));
  if constexpr (std::is_same_v<std::remove_const_t<P>, T>) {
    return w;
  } else {
    auto tmp = ws.take(s.numel());
    const auto n = static_cast<index_t>(s.numel());
    ws.context().cast(tensor_view<const std::remove_const_t<P>, D, 1>(w.data(), extents<1>{n}),
                      tensor_view<T, D, 1>(tmp.data(), extents<1>{n}));
    return {tmp.data(), s.shape};
  }
}

/// What a frozen linear layer runs instead of its GEMMs: y = x W^T (written) and dx (+)= dy W
/// for a weight W [out, in] that lives outside the flat buffer and does not train (the
/// implementation may add more: a LoRA term, and its adapters' gradients).
template <compute_type T>
struct frozen_op {
  virtual ~frozen_op() = default;
  virtual void forward(in_view<T, 2> x, tensor_view<T, host, 2> y, workspace<T>& ws) const = 0;
  /// dx = dy W (accumulate false) or dx += dy W (true).
  virtual void backward(in_view<T, 2> x, in_view<T, 2> dy, tensor_view<T, host, 2> dx, bool accumulate,
                        workspace<T>& ws) const = 0;
};

template <compute_type T>
class linear {
 public:
  linear() = default;
  /// Declares `<name>.weight` [out, in] (and `<name>.bias` [out]) in the layout.
  linear(param_layout& layout, const std::string& name, index_t in, index_t out, bool bias = false)
      : weight_(layout.add(name + ".weight", extents<2>{out, in})) {
    if (bias) bias_ = layout.add(name + ".bias", extents<1>{out});
  }
  /// A linear layer over an already declared weight [out, in] (weight tying), or over rows
  /// of a fused tensor (with those rows' bias [out], if any).
  explicit linear(param_slot<2> shared_weight, std::optional<param_slot<1>> bias = std::nullopt)
      : weight_(shared_weight), bias_(bias) {}

  index_t in_features() const noexcept { return weight_.shape[1]; }
  index_t out_features() const noexcept { return weight_.shape[0]; }
  const param_slot<2>& weight() const noexcept { return weight_; }
  const std::optional<param_slot<1>>& bias() const noexcept { return bias_; }
  /// From now on `op` computes this layer's x W^T and dx (its weight slot is no longer read);
  /// a bias stays the layer's, read from and its gradient added into the flat buffers as
  /// before; null: the flat buffer again.
  void set_frozen(const frozen_op<T>* op) { frozen_ = op; }
  const frozen_op<T>* frozen() const noexcept { return frozen_; }

  /// y [n, out] = x [n, in] W^T + b   (y is overwritten); on the workspace's device.
  template <ops::param_type P, class D>
  void forward(std::span<P> params, in_view_on<T, D, 2> x, view_on<T, D, 2> y, workspace<T, D>& ws) const {
    forward_all(params, x, {{this, y}}, ws);
  }

  /// dW += dy^T x, db += sum_rows dy, dx += dy W (dx = dy W when !accumulate; skipped when dx
  /// is empty); every term times `dy_scale` when given (the gradient of dy_scale * dy, without
  /// a pass that scales dy).
  template <ops::param_type P, class D>
  void backward(std::span<P> params, std::span<T> grads, in_view_on<T, D, 2> x, in_view_on<T, D, 2> dy,
                view_on<T, D, 2> dx, workspace<T, D>& ws, bool accumulate = true, T dy_scale = T(1)) const {
    backward_all(params, grads, x, {{this, dy}}, dx, ws, accumulate, dy_scale);
  }

  /// A layer and its output (forward_all) or its output's gradient (backward_all), on device D.
  template <class D = host>
  struct output_on {
    const linear* layer;
    tensor_view<T, D, 2> y;
  };
  template <class D = host>
  struct output_grad_on {
    const linear* layer;
    tensor_view<const T, D, 2> dy;
  };
  using output = output_on<>;
  using output_grad = output_grad_on<>;

  /// Several layers reading the same x (q/k/v; w1/w3): y_i = x W_i^T + b_i, the GEMMs as one
  /// ops::gemm_batch (one split over the pool instead of one per layer).
  template <ops::param_type P, class D>
  static void forward_all(std::span<P> params, in_view_on<T, D, 2> x, std::initializer_list<output_on<D>> outs,
                          workspace<T, D>& ws) {
    std::vector<ops::gemm_op<T, D>> g;
    for (const auto& o : outs) {
      o.layer->check(x, "x");
      LOOM_CHECK(o.y.extent(0) == x.extent(0) && o.y.extent(1) == o.layer->out_features(), "nn::linear: output has shape ",
                 ops::detail::str(o.y.shape()), ", expected [", x.extent(0), ", ", o.layer->out_features(), "]");
      if constexpr (std::is_same_v<D, host>) {
        if (o.layer->frozen_) {
          o.layer->frozen_->forward(x, o.y, ws);
          continue;
        }
      } else {
        o.layer->refuse_frozen(D{});
      }
      g.push_back({x, weights_as<T>(o.layer->weight_, params, ws).transpose(0, 1), o.y});
    }
    ws.context().gemm_all(std::span<const ops::gemm_op<T, D>>(g));
    for (const auto& o : outs)
      if (o.layer->bias_) ws.context().add_bias(o.y, weights_as<T>(*o.layer->bias_, params, ws));
  }

  /// Backward of forward_all: dW_i += dy_i^T x, db_i += sum_rows dy_i, and dx += sum_i dy_i W_i
  /// (added in list order; dx = ... when !accumulate; skipped when dx is empty), all GEMMs as
  /// one ops::gemm_batch; every term times dy_scale (as the GEMMs' alpha). Frozen layers
  /// (set_frozen) run their op first: no dW, their dx term written or added before the batch's.
  /// An empty `grads`: no layer's dW or db (the model keeps no gradients), dx only.
  template <ops::param_type P, class D>
  static void backward_all(std::span<P> params, std::span<T> grads, in_view_on<T, D, 2> x,
                           std::initializer_list<output_grad_on<D>> dys, view_on<T, D, 2> dx, workspace<T, D>& ws,
                           bool accumulate = true, T dy_scale = T(1)) {
    std::vector<ops::gemm_op<T, D>> g;
    T dx_beta = accumulate ? T(1) : T(0);  // the first dx product writes when !accumulate, later ones add
    for (const auto& d : dys) {
      d.layer->check(x, "x");
      LOOM_CHECK(d.dy.extent(0) == x.extent(0) && d.dy.extent(1) == d.layer->out_features(), "nn::linear: dy has shape ",
                 ops::detail::str(d.dy.shape()), ", expected [", x.extent(0), ", ", d.layer->out_features(), "]");
      if constexpr (std::is_same_v<D, host>) {
        if (!d.layer->frozen_) continue;
        LOOM_CHECK(dy_scale == T(1), "nn::linear: a frozen layer's backward takes dy_scale 1, got dy_scale=", dy_scale);
        d.layer->frozen_->backward(x, d.dy, dx, std::exchange(dx_beta, T(1)) != T(0), ws);
      } else {
        d.layer->refuse_frozen(D{});
      }
    }
    const bool weight_grads = !grads.empty();
    for (const auto& d : dys) {
      if (d.layer->frozen_) continue;
      if (weight_grads) g.push_back({d.dy.transpose(0, 1), x, d.layer->weight_.template in<D>(grads), dy_scale, T(1)});
      if (!dx.empty())
        g.push_back({d.dy, weights_as<T>(d.layer->weight_, params, ws), dx, dy_scale, std::exchange(dx_beta, T(1))});
    }
    ws.context().gemm_all(std::span<const ops::gemm_op<T, D>>(g));
    for (const auto& d : dys) {
      if (!d.layer->bias_ || !weight_grads) continue;
      ws.context().bias_backward(d.dy, d.layer->bias_->template in<D>(grads), dy_scale);
    }
  }

 private:
  /// A frozen op runs on the host only (its views are host views): on another device a layer
  /// with one is refused rather than computed from a weight slot the op may not fill.
  template <class D>
  void refuse_frozen(D) const {
    LOOM_CHECK(!frozen_, "nn::linear: a frozen op (LoRA/QLoRA base) runs on the host only, not on ", D::name);
  }
  template <class V>
  void check(const V& x, const char* what) const {
    LOOM_CHECK(x.extent(1) == in_features(), "nn::linear: ", what, " has ", x.extent(1), " features, the layer takes ",
               in_features());
  }
  param_slot<2> weight_{};
  std::optional<param_slot<1>> bias_;
  const frozen_op<T>* frozen_ = nullptr;
};

}  // namespace loom::nn
