#pragma once
// AdamW (Loshchilov & Hutter: decoupled weight decay) on spans of fp32 master weights.
//
// Why spans: the optimizer step is where ZeRO saves memory. Stage 1-3 keep Adam's two fp32
// moments only for the rank's own shard of the flat master buffer, so the step must work on
// any contiguous piece [offset, offset + n) of it: `adamw::update(offset, params, grads, ...)`
// touches moments [offset, offset + n) only. A plain one-rank trainer calls step() on the
// whole buffer; parameter groups (no decay on norms) are several update() calls with their
// own weight decay between one begin_step() and the next.
//
// The arithmetic follows torch.optim.AdamW (the reference users compare against), in this
// order, element by element:
//   p *= 1 - lr * wd
//   m  = b1 * m + (1 - b1) * g
//   v  = b2 * v + (1 - b2) * g * g
//   p -= (lr / (1 - b1^t)) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
// with the bias corrections computed in double once per step. Compilers do not vectorise
// std::sqrt unless -fno-math-errno is on the command line (each call keeps a libm fallback
// for errno), which a header cannot impose, so the x86 path uses SSE directly: the same
// IEEE operations in the same order, 4 lanes at a time, bit-identical to the scalar tail.

#include <loom/core/buffer.hpp>
#include <loom/core/error.hpp>
#include <loom/core/memory.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>

#if defined(__SSE2__)
#include <immintrin.h>
#endif

namespace loom::optim {

struct adamw_options {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.01f;
};

inline void check_adamw_options(const adamw_options& o) {
  LOOM_CHECK(std::isfinite(o.lr) && o.lr >= 0.f, "adamw: lr must be finite and >= 0, got lr=", o.lr);
  LOOM_CHECK(o.beta1 >= 0.f && o.beta1 < 1.f, "adamw: beta1 must be in [0, 1), got beta1=", o.beta1);
  LOOM_CHECK(o.beta2 >= 0.f && o.beta2 < 1.f, "adamw: beta2 must be in [0, 1), got beta2=", o.beta2);
  LOOM_CHECK(o.eps > 0.f, "adamw: eps must be > 0, got eps=", o.eps);
  LOOM_CHECK(o.weight_decay >= 0.f, "adamw: weight_decay must be >= 0, got weight_decay=", o.weight_decay);
}

/// One AdamW update of step number t (1-based) on matching spans of parameters, gradients and moments.
inline void adamw_update(std::span<float> params, std::span<const float> grads, std::span<float> exp_avg,
                         std::span<float> exp_avg_sq, float lr, float beta1, float beta2, float eps, float weight_decay,
                         std::int64_t t) {
  const std::size_t n = params.size();
  LOOM_CHECK(grads.size() == n && exp_avg.size() == n && exp_avg_sq.size() == n, "adamw: span sizes differ, params=", n,
             " grads=", grads.size(), " exp_avg=", exp_avg.size(), " exp_avg_sq=", exp_avg_sq.size());
  LOOM_CHECK(t >= 1, "adamw: step number must be >= 1, got t=", t);
  const double bc1 = 1.0 - std::pow(static_cast<double>(beta1), static_cast<double>(t));
  const double bc2 = 1.0 - std::pow(static_cast<double>(beta2), static_cast<double>(t));
  const float step_size = static_cast<float>(lr / bc1);
  const float bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  const float decay = 1.f - lr * weight_decay;
  const float one_minus_b1 = 1.f - beta1, one_minus_b2 = 1.f - beta2;
  float* __restrict p = params.data();
  const float* __restrict g = grads.data();
  float* __restrict m = exp_avg.data();
  float* __restrict v = exp_avg_sq.data();
  std::size_t i = 0;
#if defined(__SSE2__)
  {
    const __m128 b1 = _mm_set1_ps(beta1), b2 = _mm_set1_ps(beta2), omb1 = _mm_set1_ps(one_minus_b1),
                 omb2 = _mm_set1_ps(one_minus_b2), dec = _mm_set1_ps(decay), ss = _mm_set1_ps(step_size),
                 bc2s = _mm_set1_ps(bc2_sqrt), e = _mm_set1_ps(eps);
    for (; i + 4 <= n; i += 4) {
      const __m128 gi = _mm_loadu_ps(g + i);
      const __m128 pi = _mm_mul_ps(_mm_loadu_ps(p + i), dec);
      const __m128 mi = _mm_add_ps(_mm_mul_ps(_mm_loadu_ps(m + i), b1), _mm_mul_ps(gi, omb1));
      const __m128 vi = _mm_add_ps(_mm_mul_ps(_mm_loadu_ps(v + i), b2), _mm_mul_ps(_mm_mul_ps(gi, gi), omb2));
      _mm_storeu_ps(m + i, mi);
      _mm_storeu_ps(v + i, vi);
      const __m128 denom = _mm_add_ps(_mm_div_ps(_mm_sqrt_ps(vi), bc2s), e);
      _mm_storeu_ps(p + i, _mm_sub_ps(pi, _mm_mul_ps(ss, _mm_div_ps(mi, denom))));
    }
  }
#endif
  for (; i < n; ++i) {
    const float gi = g[i];
    const float pi = p[i] * decay;
    const float mi = m[i] * beta1 + gi * one_minus_b1;
    const float vi = v[i] * beta2 + gi * gi * one_minus_b2;
    m[i] = mi;
    v[i] = vi;
    p[i] = pi - step_size * (mi / (std::sqrt(vi) / bc2_sqrt + eps));
  }
}

/// AdamW with moments for a flat buffer (or one rank's shard of it) of n fp32 elements.
class adamw {
 public:
  adamw() = default;
  adamw(std::size_t n, adamw_options o, memory_resource& resource = default_resource<host>())
      : o_(o), exp_avg_(n, resource), exp_avg_sq_(n, resource) {
    check_adamw_options(o);
  }

  const adamw_options& options() const noexcept { return o_; }
  std::size_t size() const noexcept { return exp_avg_.size(); }
  /// Number of steps taken (t of the last step; 0 before the first).
  std::int64_t step_count() const noexcept { return t_; }
  void set_step_count(std::int64_t t) {
    LOOM_CHECK(t >= 0, "adamw: step count must be >= 0, got t=", t);
    t_ = t;
  }
  std::span<float> exp_avg() noexcept { return exp_avg_.span(); }
  std::span<float> exp_avg_sq() noexcept { return exp_avg_sq_.span(); }
  std::span<const float> exp_avg() const noexcept { return exp_avg_.span(); }
  std::span<const float> exp_avg_sq() const noexcept { return exp_avg_sq_.span(); }

  /// Starts step t + 1; follow with update() calls for each piece of the buffer.
  void begin_step() noexcept { ++t_; }
  /// Updates elements [offset, offset + params.size()) with this step's lr and a group's weight decay.
  void update(std::size_t offset, std::span<float> params, std::span<const float> grads, float lr, float weight_decay) {
    LOOM_CHECK(offset <= size() && params.size() <= size() - offset, "adamw: range [offset=", offset, ", +", params.size(),
               ") outside the optimizer's ", size(), " elements");
    LOOM_CHECK(t_ >= 1, "adamw: update() before begin_step()");
    adamw_update(params, grads, exp_avg().subspan(offset, params.size()), exp_avg_sq().subspan(offset, params.size()), lr,
                 o_.beta1, o_.beta2, o_.eps, weight_decay, t_);
  }
  /// One whole step on all elements with the configured weight decay.
  void step(std::span<float> params, std::span<const float> grads, float lr) {
    LOOM_CHECK(params.size() == size(), "adamw: params.size()=", params.size(), " but the optimizer holds ", size(), " elements");
    begin_step();
    update(0, params, grads, lr, o_.weight_decay);
  }

 private:
  adamw_options o_;
  buffer<float> exp_avg_, exp_avg_sq_;
  std::int64_t t_ = 0;
};

}  // namespace loom::optim
