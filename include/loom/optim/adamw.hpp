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
// with the bias corrections computed in double once per step (ops/math/adamw.hpp, the one
// element update host and GPU share). Compilers do not vectorise std::sqrt unless
// -fno-math-errno is on the command line (each call keeps a libm fallback for errno), which a
// header cannot impose, so the x86 path runs that element function on SSE vectors: the same
// IEEE operations in the same order, 4 lanes at a time, bit-identical to the scalar tail.

#include <loom/core/buffer.hpp>
#include <loom/core/error.hpp>
#include <loom/core/memory.hpp>
#include <loom/ops/math/adamw.hpp>  // the element update, shared with optim/cuda/adamw.cuh

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
  const ops::math::adamw_coefficients k = ops::math::make_adamw_coefficients(lr, beta1, beta2, eps, weight_decay, t);
  float* __restrict p = params.data();
  const float* __restrict g = grads.data();
  float* __restrict m = exp_avg.data();
  float* __restrict v = exp_avg_sq.data();
  std::size_t i = 0;
#if defined(__SSE2__) && (defined(__GNUC__) || defined(__clang__)) && !defined(__CUDA_ARCH__)
  // (not in nvcc's device pass, which cannot instantiate the element function on __m128)
  // four lanes at a time through the same element function (__m128 has GCC's vector operators)
  struct sse_lanes {
    static __m128 splat(float x) noexcept { return _mm_set1_ps(x); }
    static __m128 sqrt(__m128 x) noexcept { return _mm_sqrt_ps(x); }
  };
  for (; i + 4 <= n; i += 4) {
    __m128 pi = _mm_loadu_ps(p + i), mi = _mm_loadu_ps(m + i), vi = _mm_loadu_ps(v + i);
    ops::math::adamw_element<__m128, sse_lanes>(pi, mi, vi, _mm_loadu_ps(g + i), k);
    _mm_storeu_ps(m + i, mi);
    _mm_storeu_ps(v + i, vi);
    _mm_storeu_ps(p + i, pi);
  }
#endif
  for (; i < n; ++i) ops::math::adamw_element(p[i], m[i], v[i], g[i], k);
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
