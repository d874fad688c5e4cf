#pragma once
// AdamW on one span of fp32 master weights: the step each ZeRO rank runs on its shard.
//
// Elementwise, so a shard steps exactly as the same elements of the whole model would:
// that is what makes a sharded run reproduce the single-rank one. Decoupled weight decay
// and bias correction as torch.optim.AdamW:
//   w *= 1 - lr*wd;  m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2
//   w -= lr/(1-b1^t) * m / (sqrt(v)/sqrt(1-b2^t) + eps)
// Gradients may be stored in any floating element type; `grad_scale` multiplies them
// first (1/N turns a sum over N ranks into a mean; 1/loss_scale unscales fp16). The update
// itself is loom::optim's (torch.optim.AdamW's arithmetic); this adapter converts the
// gradient to fp32 in fixed-size chunks on the stack, so a step allocates nothing.

#include <loom/core/dtype.hpp>
#include <loom/core/error.hpp>
#include <loom/optim/adamw.hpp>

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>

namespace loom::zero {

using adamw_config = optim::adamw_options;

/// One AdamW step t (1-based) over master[n] with gradients grad[n] and moments m[n], v[n].
template <floating_element G>
inline void adamw_step(std::span<float> master, std::span<const G> grad, std::span<float> m, std::span<float> v,
                       const adamw_config& c, std::int64_t t, float grad_scale = 1.f) {
  LOOM_CHECK(grad.size() == master.size() && m.size() == master.size() && v.size() == master.size(),
             "adamw_step: sizes differ: master=", master.size(), " grad=", grad.size(), " m=", m.size(), " v=", v.size());
  LOOM_CHECK(t >= 1, "adamw_step: step t must be >= 1, got t=", t);
  if constexpr (std::same_as<G, float>)
    if (grad_scale == 1.f) {
      optim::adamw_update(master, grad, m, v, c.lr, c.beta1, c.beta2, c.eps, c.weight_decay, t);
      return;
    }
  constexpr std::size_t chunk = 2048;
  float g[chunk];
  for (std::size_t b = 0; b < master.size(); b += chunk) {
    const std::size_t n = std::min(chunk, master.size() - b);
    for (std::size_t i = 0; i < n; ++i) g[i] = static_cast<float>(grad[b + i]) * grad_scale;
    optim::adamw_update(master.subspan(b, n), std::span<const float>(g, n), m.subspan(b, n), v.subspan(b, n), c.lr,
                        c.beta1, c.beta2, c.eps, c.weight_decay, t);
  }
}

}  // namespace loom::zero
