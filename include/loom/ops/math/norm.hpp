#pragma once
// RMSNorm's and LayerNorm's per-element math, given the row statistics, for the host and the
// CUDA kernels.
//
//   rmsnorm forward:  rstd = 1 / sqrt(sum x^2 / d + eps);  y = x * rstd * w
//   rmsnorm backward: c = (sum dy w x) * rstd^3 / d;  dx = dy w rstd - x c;  dw = dy x rstd
//   layernorm forward:  rstd = 1 / sqrt(sum (x - mean)^2 / d + eps);  y = (x - mean) rstd w + b
//   layernorm backward: xhat = (x - mean) rstd;  dx = rstd (dy w - mean(dy w) - xhat mean(dy w xhat));
//                       dw = dy xhat;  db = dy
//
// Why split this way: the row sums are reductions, which each backend does its own way (a
// vectorised loop per row on the host, a CUB block reduction on the GPU); everything else is
// these functions, so the host tests test the arithmetic the GPU runs. Each expression keeps
// the order of operations the host kernels have always used (their results are bit for bit
// what they were).

#include <loom/core/config.hpp>

#include <cmath>

namespace loom::ops::math {

/// 1 / sqrt(mean square + eps) from a row's sum of squares over d elements.
template <class T>
LOOM_HOST_DEVICE LOOM_FORCE_INLINE T rmsnorm_rstd(T sum_sq, T d, T eps) noexcept {
  return T(1) / std::sqrt(sum_sq / d + eps);
}

/// One output element: x * rstd * w.
template <class T>
LOOM_HOST_DEVICE LOOM_FORCE_INLINE T rmsnorm_y(T x, T rstd, T w) noexcept {
  return x * rstd * w;
}

/// One term of the row sum backward needs: dy * w * x.
template <class T>
LOOM_HOST_DEVICE LOOM_FORCE_INLINE T rmsnorm_dot_term(T dy, T w, T x) noexcept {
  return dy * w * x;
}

/// The row's coefficient of x in dx, from dot = sum dy w x.
template <class T>
LOOM_HOST_DEVICE LOOM_FORCE_INLINE T rmsnorm_dx_coeff(T dot, T rstd, T d) noexcept {
  return dot * rstd * rstd * rstd / d;
}

/// One element of dx: dy * w * rstd - x * c (c from rmsnorm_dx_coeff).
template <class T>
LOOM_HOST_DEVICE LOOM_FORCE_INLINE T rmsnorm_dx(T dy, T w, T x, T rstd, T c) noexcept {
  return dy * w * rstd - x * c;
}

/// One row's contribution to dw: dy * x * rstd.
template <class T>
LOOM_HOST_DEVICE LOOM_FORCE_INLINE T rmsnorm_dw(T dy, T x, T rstd) noexcept {
  return dy * x * rstd;
}

/// One LayerNorm output element: (x - mean) * rstd * w + b. The rstd is rmsnorm_rstd of the
/// row's sum of squared deviations (the same formula).
template <class T>
LOOM_HOST_DEVICE LOOM_FORCE_INLINE T layernorm_y(T x, T mean, T rstd, T w, T b) noexcept {
  return (x - mean) * rstd * w + b;
}

/// One element of LayerNorm's dx from the row means of dy w (g_mean) and dy w xhat (gx_mean).
/// (The terms of those sums stay in the host kernel for now: written as a function call, Clang
/// vectorises the `omp simd` reduction in another order, and LayerNorm has no CUDA kernel yet.)
template <class T>
LOOM_HOST_DEVICE LOOM_FORCE_INLINE T layernorm_dx(T dy, T w, T xhat, T rstd, T g_mean, T gx_mean) noexcept {
  return rstd * (dy * w - g_mean - xhat * gx_mean);
}

}  // namespace loom::ops::math
