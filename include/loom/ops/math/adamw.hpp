#pragma once
// The AdamW element update (torch.optim.AdamW's order of operations) for the host step and
// the fused CUDA step.
//
//   p *= 1 - lr * wd
//   m  = b1 * m + (1 - b1) * g
//   v  = b2 * v + (1 - b2) * g * g
//   p -= (lr / (1 - b1^t)) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
//
// The per-step scalars are made once (adamw_coefficients, bias corrections in double). The
// element function is a template over the value type so that the host's SSE path runs it on
// four lanes at once (GCC and Clang give __m128 the arithmetic operators; broadcast and sqrt
// come from a Lanes type because std::sqrt does not vectorise under -fmath-errno): the same
// IEEE operations in the same order as the scalar tail and the GPU.

#include <loom/core/config.hpp>

#include <cmath>
#include <cstdint>

namespace loom::ops::math {

/// The scalars of one AdamW step.
struct adamw_coefficients {
  float beta1, beta2, one_minus_b1, one_minus_b2, eps;
  float decay;      ///< 1 - lr * weight_decay
  float step_size;  ///< lr / (1 - beta1^t)
  float bc2_sqrt;   ///< sqrt(1 - beta2^t)
};

/// Step t (1-based) of AdamW with these hyper-parameters.
inline adamw_coefficients make_adamw_coefficients(float lr, float beta1, float beta2, float eps, float weight_decay,
                                                  std::int64_t t) noexcept {
  const double bc1 = 1.0 - std::pow(static_cast<double>(beta1), static_cast<double>(t));
  const double bc2 = 1.0 - std::pow(static_cast<double>(beta2), static_cast<double>(t));
  return {beta1,
          beta2,
          1.f - beta1,
          1.f - beta2,
          eps,
          1.f - lr * weight_decay,
          static_cast<float>(lr / bc1),
          static_cast<float>(std::sqrt(bc2))};
}

/// The scalar value type of adamw_element (host and device): broadcast is the identity.
struct scalar_lanes {
  LOOM_HOST_DEVICE LOOM_FORCE_INLINE static float splat(float x) noexcept { return x; }
  LOOM_HOST_DEVICE LOOM_FORCE_INLINE static float sqrt(float x) noexcept { return std::sqrt(x); }
};

/// One element (or one vector F of lanes, with Lanes::splat and Lanes::sqrt) of the update:
/// p, m, v in place from the gradient g.
template <class F, class Lanes = scalar_lanes>
LOOM_HOST_DEVICE LOOM_FORCE_INLINE void adamw_element(F& p, F& m, F& v, F g, const adamw_coefficients& k) noexcept {
  const F pi = p * Lanes::splat(k.decay);
  const F mi = m * Lanes::splat(k.beta1) + g * Lanes::splat(k.one_minus_b1);
  const F vi = v * Lanes::splat(k.beta2) + g * g * Lanes::splat(k.one_minus_b2);
  m = mi;
  v = vi;
  p = pi - Lanes::splat(k.step_size) * (mi / (Lanes::sqrt(vi) / Lanes::splat(k.bc2_sqrt) + Lanes::splat(k.eps)));
}

}  // namespace loom::ops::math
