#pragma once
// One AdamW step (Loshchilov & Hutter, PyTorch's torch.optim.AdamW semantics) over flat,
// contiguous parameter / gradient / moment views: the optimizer works on whole flat buffers
// or on a ZeRO rank's slice of them, never per tensor.
//
//   g = grad * grad_scale                 (grad_scale = 1 / loss_scale for mixed precision)
//   p = p * (1 - lr * weight_decay)       (decoupled weight decay)
//   m = b1 m + (1 - b1) g ;  v = b2 v + (1 - b2) g^2
//   p -= lr * (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)
//
// With 16-bit parameters the update runs on fp32 master weights and the parameter is the
// master rounded to its type.

#include <loom/ops/host/common.hpp>

#include <cmath>

namespace loom::ops {

struct adamw_hparams {
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.0;
};

namespace detail {
inline void check_adamw(const adamw_hparams& h, long step) {
  LOOM_CHECK(step >= 1, "ops::adamw_step: step counts from 1, got step=", step);
  LOOM_CHECK(h.beta1 >= 0 && h.beta1 < 1, "ops::adamw_step: beta1 must be in [0, 1), got beta1=", h.beta1);
  LOOM_CHECK(h.beta2 >= 0 && h.beta2 < 1, "ops::adamw_step: beta2 must be in [0, 1), got beta2=", h.beta2);
  LOOM_CHECK(h.eps > 0, "ops::adamw_step: eps must be > 0, got eps=", h.eps);
  LOOM_CHECK(h.lr >= 0, "ops::adamw_step: lr must be >= 0, got lr=", h.lr);
}
}  // namespace detail

/// fp32 (or fp64) parameters updated in place. All views have the same length.
template <compute_type T, class G>
inline void adamw_step(host, tensor_view<T, host, 1> params, tensor_view<G, host, 1> grads,
                       tensor_view<T, host, 1> m, tensor_view<T, host, 1> v, const adamw_hparams& h, long step,
                       T grad_scale = T(1)) {
  detail::check_adamw(h, step);
  const index_t n = params.numel();
  detail::require_same_length("ops::adamw_step", n, params, grads, m, v);
  const T b1 = T(h.beta1), b2 = T(h.beta2), eps = T(h.eps), lr = T(h.lr);
  const T decay = T(1) - T(h.lr * h.weight_decay);
  const T c1 = T(1) / T(1 - std::pow(h.beta1, double(step))), c2 = T(1) / T(1 - std::pow(h.beta2, double(step)));
  T *p = params.data(), *mp = m.data(), *vp = v.data();
  const G* gp = grads.data();
  LOOM_SIMD
  for (index_t i = 0; i < n; ++i) {
    const T g = load<T>(gp[i]) * grad_scale;
    mp[i] = b1 * mp[i] + (T(1) - b1) * g;
    vp[i] = b2 * vp[i] + (T(1) - b2) * g * g;
    p[i] = p[i] * decay - lr * (mp[i] * c1) / (std::sqrt(vp[i] * c2) + eps);
  }
}

/// 16-bit (or any) parameters with fp32 master weights: master is updated, params = P(master).
template <param_type P, class G>
inline void adamw_step(host, tensor_view<P, host, 1> params, tensor_view<float, host, 1> master,
                       tensor_view<G, host, 1> grads, tensor_view<float, host, 1> m, tensor_view<float, host, 1> v,
                       const adamw_hparams& h, long step, float grad_scale = 1.f) {
  detail::require_same_length("ops::adamw_step", master.numel(), params);
  adamw_step(host{}, master, grads, m, v, h, step, grad_scale);
  P* p = params.data();
  const float* src = master.data();
  for (index_t i = 0, n = master.numel(); i < n; ++i) p[i] = P(src[i]);
}

}  // namespace loom::ops
