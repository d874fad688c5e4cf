#pragma once
// AdamW on one span of fp32 master weights: the step each ZeRO rank runs on its shard.
//
// Elementwise, so a shard steps exactly as the same elements of the whole model would:
// that is what makes a sharded run reproduce the single-rank one. Decoupled weight decay
// and bias correction as torch.optim.AdamW:
//   w *= 1 - lr*wd;  m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2
//   w -= lr/(1-b1^t) * m / (sqrt(v)/sqrt(1-b2^t) + eps)
// Gradients may be stored in any floating element type; `grad_scale` multiplies them
// first (1/N turns a sum over N ranks into a mean; 1/loss_scale unscales fp16).
// (Kept local to zero/ until loom::optim's AdamW is available on this branch.)

#include <loom/core/dtype.hpp>
#include <loom/core/error.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>

namespace loom::zero {

struct adamw_config {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.01f;
};

/// One AdamW step t (1-based) over master[n] with gradients grad[n] and moments m[n], v[n].
template <floating_element G>
inline void adamw_step(std::span<float> master, std::span<const G> grad, std::span<float> m, std::span<float> v,
                       const adamw_config& c, std::int64_t t, float grad_scale = 1.f) {
  LOOM_CHECK(grad.size() == master.size() && m.size() == master.size() && v.size() == master.size(),
             "adamw_step: sizes differ: master=", master.size(), " grad=", grad.size(), " m=", m.size(), " v=", v.size());
  LOOM_CHECK(t >= 1, "adamw_step: step t must be >= 1, got t=", t);
  const double bc1 = 1.0 - std::pow(double(c.beta1), double(t));
  const double bc2 = 1.0 - std::pow(double(c.beta2), double(t));
  const float step = static_cast<float>(c.lr / bc1);
  const float inv_sqrt_bc2 = static_cast<float>(1.0 / std::sqrt(bc2));
  const float decay = 1.f - c.lr * c.weight_decay;
  for (std::size_t i = 0; i < master.size(); ++i) {
    const float g = static_cast<float>(grad[i]) * grad_scale;
    m[i] = c.beta1 * m[i] + (1.f - c.beta1) * g;
    v[i] = c.beta2 * v[i] + (1.f - c.beta2) * g * g;
    master[i] = master[i] * decay - step * m[i] / (std::sqrt(v[i]) * inv_sqrt_bc2 + c.eps);
  }
}

}  // namespace loom::zero
