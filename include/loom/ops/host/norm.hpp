#pragma once
// RMSNorm (LLaMA) and LayerNorm (GPT) over the last dimension, forward and backward.
//
//   rmsnorm:   y = x * rstd * w,               rstd = 1 / sqrt(mean(x^2) + eps)
//   layernorm: y = (x - mean) * rstd * w + b,  rstd = 1 / sqrt(var(x) + eps)  (biased var)
//
// The per-element math of both is ops/math/norm.hpp's (RMSNorm's shared with ops/cuda/norm.cuh).
// Forward saves the per-row statistics (rstd, and mean for LayerNorm) so backward does not
// recompute them. Backward ADDS into dx and into the parameter gradients (the convention of
// every backward in ops/host: gradients accumulate, callers zero them once). Weights may be
// stored in 16 bits; statistics and gradients are in the compute type T.

#include <loom/ops/host/common.hpp>
#include <loom/ops/math/norm.hpp>

#include <cmath>

namespace loom::ops {

/// x, y: [rows, dim]; w: [dim]; rstd: [rows] (saved for backward).
template <compute_type T, param_type P>
inline void rmsnorm_forward(host, in_view<T, 2> x, tensor_view<P, host, 1> w, tensor_view<T, host, 2> y,
                            tensor_view<T, host, 1> rstd, T eps) {
  const index_t n = x.extent(0), d = x.extent(1);
  detail::require_contiguous(x, "ops::rmsnorm_forward", "x");
  detail::require_shape(y, x.shape(), "ops::rmsnorm_forward", "y");
  detail::require_contiguous(y, "ops::rmsnorm_forward", "y");
  detail::require_shape(w, extents<1>{d}, "ops::rmsnorm_forward", "w");
  detail::require_shape(rstd, extents<1>{n}, "ops::rmsnorm_forward", "rstd");
  LOOM_CHECK(eps > T(0), "ops::rmsnorm_forward: eps must be > 0, got eps=", eps);
  const P* wp = w.data();
  detail::parallel_rows(n, detail::rows_grain(d), [&](index_t r0, index_t r1) {
    for (index_t r = r0; r < r1; ++r) {
      const T* xr = x.data() + r * d;
      T* yr = y.data() + r * d;
      T ss = 0;
      LOOM_SIMD_SUM(ss)
      for (index_t i = 0; i < d; ++i) ss += xr[i] * xr[i];
      const T s = math::rmsnorm_rstd(ss, T(d), eps);
      rstd(r) = s;
      LOOM_SIMD
      for (index_t i = 0; i < d; ++i) yr[i] = math::rmsnorm_y(xr[i], s, load<T>(wp[i]));
    }
  });
}

/// dx += d/dx, dw += d/dw of rmsnorm; shapes as in forward. An empty dw: the weight is
/// frozen, only dx is computed.
template <compute_type T, param_type P>
inline void rmsnorm_backward(host, in_view<T, 2> dy, in_view<T, 2> x, tensor_view<P, host, 1> w, in_view<T, 1> rstd,
                             tensor_view<T, host, 2> dx, tensor_view<T, host, 1> dw) {
  const index_t n = x.extent(0), d = x.extent(1);
  for (auto* v : {&dy, &x}) detail::require_contiguous(*v, "ops::rmsnorm_backward", "dy/x");
  detail::require_shape(dy, x.shape(), "ops::rmsnorm_backward", "dy");
  detail::require_shape(dx, x.shape(), "ops::rmsnorm_backward", "dx");
  detail::require_contiguous(dx, "ops::rmsnorm_backward", "dx");
  detail::require_shape(w, extents<1>{d}, "ops::rmsnorm_backward", "w");
  if (!dw.empty()) detail::require_shape(dw, extents<1>{d}, "ops::rmsnorm_backward", "dw");
  detail::require_shape(rstd, extents<1>{n}, "ops::rmsnorm_backward", "rstd");
  const P* wp = w.data();
  T* dwp = dw.data();
  // dx: rows in parallel. dw: columns in parallel, each summed over the rows in row order (the
  // order a single thread uses), so the result does not depend on the thread count.
  detail::parallel_rows(n, detail::rows_grain(d), [&](index_t r0, index_t r1) {
    const P* const wl = wp;  // see detail::parallel_rows: a local, not the captured pointer
    for (index_t r = r0; r < r1; ++r) {
      const T* xr = x.data() + r * d;
      const T* dyr = dy.data() + r * d;
      T* dxr = dx.data() + r * d;
      const T s = rstd(r);
      T dot = 0;  // sum_i dy_i w_i x_i
      LOOM_SIMD_SUM(dot)
      for (index_t i = 0; i < d; ++i) dot += math::rmsnorm_dot_term(dyr[i], load<T>(wl[i]), xr[i]);
      const T c = math::rmsnorm_dx_coeff(dot, s, T(d));
      LOOM_SIMD
      for (index_t i = 0; i < d; ++i) dxr[i] += math::rmsnorm_dx(dyr[i], load<T>(wl[i]), xr[i], s, c);
    }
  });
  if (dw.empty()) return;
  detail::parallel_rows(d, std::max<index_t>(16, detail::rows_grain(n)), [&](index_t c0, index_t c1) {
    T* const dwl = dwp;
    for (index_t r = 0; r < n; ++r) {
      const T* xr = x.data() + r * d;
      const T* dyr = dy.data() + r * d;
      const T s = rstd(r);
      LOOM_SIMD
      for (index_t i = c0; i < c1; ++i) dwl[i] += math::rmsnorm_dw(dyr[i], xr[i], s);
    }
  });
}

/// x, y: [rows, dim]; w, b: [dim]; mean, rstd: [rows] (saved for backward).
template <compute_type T, param_type P>
inline void layernorm_forward(host, in_view<T, 2> x, tensor_view<P, host, 1> w, tensor_view<P, host, 1> b,
                              tensor_view<T, host, 2> y, tensor_view<T, host, 1> mean, tensor_view<T, host, 1> rstd,
                              T eps) {
  const index_t n = x.extent(0), d = x.extent(1);
  detail::require_contiguous(x, "ops::layernorm_forward", "x");
  detail::require_shape(y, x.shape(), "ops::layernorm_forward", "y");
  detail::require_contiguous(y, "ops::layernorm_forward", "y");
  detail::require_shape(w, extents<1>{d}, "ops::layernorm_forward", "w");
  detail::require_shape(b, extents<1>{d}, "ops::layernorm_forward", "b");
  detail::require_shape(mean, extents<1>{n}, "ops::layernorm_forward", "mean");
  detail::require_shape(rstd, extents<1>{n}, "ops::layernorm_forward", "rstd");
  LOOM_CHECK(eps > T(0), "ops::layernorm_forward: eps must be > 0, got eps=", eps);
  const P *wp = w.data(), *bp = b.data();
  for (index_t r = 0; r < n; ++r) {
    const T* xr = x.data() + r * d;
    T* yr = y.data() + r * d;
    T sum = 0;
    LOOM_SIMD_SUM(sum)
    for (index_t i = 0; i < d; ++i) sum += xr[i];
    const T m = sum / T(d);
    T var = 0;
    LOOM_SIMD_SUM(var)
    for (index_t i = 0; i < d; ++i) var += (xr[i] - m) * (xr[i] - m);
    const T s = math::rmsnorm_rstd(var, T(d), eps);
    mean(r) = m;
    rstd(r) = s;
    LOOM_SIMD
    for (index_t i = 0; i < d; ++i) yr[i] = math::layernorm_y(xr[i], m, s, load<T>(wp[i]), load<T>(bp[i]));
  }
}

/// dx += d/dx, dw += d/dw, db += d/db of layernorm; shapes as in forward. dw and db both
/// empty: the weight and bias are frozen, only dx is computed.
template <compute_type T, param_type P>
inline void layernorm_backward(host, in_view<T, 2> dy, in_view<T, 2> x, tensor_view<P, host, 1> w, in_view<T, 1> mean,
                               in_view<T, 1> rstd, tensor_view<T, host, 2> dx, tensor_view<T, host, 1> dw,
                               tensor_view<T, host, 1> db) {
  const index_t n = x.extent(0), d = x.extent(1);
  for (auto* v : {&dy, &x}) detail::require_contiguous(*v, "ops::layernorm_backward", "dy/x");
  detail::require_shape(dy, x.shape(), "ops::layernorm_backward", "dy");
  detail::require_shape(dx, x.shape(), "ops::layernorm_backward", "dx");
  detail::require_contiguous(dx, "ops::layernorm_backward", "dx");
  detail::require_shape(w, extents<1>{d}, "ops::layernorm_backward", "w");
  const bool frozen = dw.empty() && db.empty();
  if (!frozen) {
    detail::require_shape(dw, extents<1>{d}, "ops::layernorm_backward", "dw");
    detail::require_shape(db, extents<1>{d}, "ops::layernorm_backward", "db");
  }
  detail::require_shape(mean, extents<1>{n}, "ops::layernorm_backward", "mean");
  detail::require_shape(rstd, extents<1>{n}, "ops::layernorm_backward", "rstd");
  const P* wp = w.data();
  T *dwp = dw.data(), *dbp = db.data();
  for (index_t r = 0; r < n; ++r) {
    const T* xr = x.data() + r * d;
    const T* dyr = dy.data() + r * d;
    T* dxr = dx.data() + r * d;
    const T m = mean(r), s = rstd(r);
    T g_sum = 0, gx_sum = 0;  // sums of g = dy*w and g * xhat
    LOOM_SIMD_SUM(g_sum)
    for (index_t i = 0; i < d; ++i) g_sum += dyr[i] * load<T>(wp[i]);
    LOOM_SIMD_SUM(gx_sum)
    for (index_t i = 0; i < d; ++i) gx_sum += dyr[i] * load<T>(wp[i]) * (xr[i] - m) * s;
    const T g_mean = g_sum / T(d), gx_mean = gx_sum / T(d);
    LOOM_SIMD
    for (index_t i = 0; i < d; ++i) dxr[i] += math::layernorm_dx(dyr[i], load<T>(wp[i]), (xr[i] - m) * s, s, g_mean, gx_mean);
    if (frozen) continue;
    LOOM_SIMD
    for (index_t i = 0; i < d; ++i) {
      dwp[i] += dyr[i] * ((xr[i] - m) * s);
      dbp[i] += dyr[i];
    }
  }
}

}  // namespace loom::ops
