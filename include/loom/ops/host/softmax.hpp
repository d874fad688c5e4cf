#pragma once
// Row softmax, forward and backward; numerically stable (subtract the row maximum).
//
// (Attention's masked softmax runs down the columns of a transposed tile instead:
// ops/host/attention.hpp, detail::softmax_columns.)

#include <loom/ops/host/common.hpp>
#include <loom/ops/math/softmax.hpp>

#include <algorithm>
#include <cmath>

namespace loom::ops {
namespace detail {
/// y[0..n) = softmax(x[0..n)); x and y may alias.
template <compute_type T>
inline void softmax_row(const T* x, T* y, index_t n) {
  const T mx = row_max(x, n);
  T sum = 0;
  LOOM_SIMD_SUM(sum)
  for (index_t i = 0; i < n; ++i) {
    y[i] = ops::exp(x[i] - mx);
    sum += y[i];
  }
  const T inv = T(1) / sum;
  LOOM_SIMD
  for (index_t i = 0; i < n; ++i) y[i] *= inv;
}
/// dx[0..n) += y * (dy - <dy, y>)
template <compute_type T>
inline void softmax_row_backward(const T* y, const T* dy, T* dx, index_t n) {
  T dot = 0;
  LOOM_SIMD_SUM(dot)
  for (index_t i = 0; i < n; ++i) dot += dy[i] * y[i];
  LOOM_SIMD
  for (index_t i = 0; i < n; ++i) dx[i] += math::softmax_backward(y[i], dy[i], dot);
}
}  // namespace detail

/// y = softmax(x) over the last dimension; x, y: [rows, cols] (may be the same view).
template <compute_type T>
inline void softmax_forward(host, in_view<T, 2> x, tensor_view<T, host, 2> y) {
  detail::require_contiguous(x, "ops::softmax_forward", "x");
  detail::require_contiguous(y, "ops::softmax_forward", "y");
  detail::require_shape(y, x.shape(), "ops::softmax_forward", "y");
  const index_t n = x.extent(0), d = x.extent(1);
  if (d == 0) return;
  for (index_t r = 0; r < n; ++r) detail::softmax_row(x.data() + r * d, y.data() + r * d, d);
}

/// dx += softmax backward given the forward output y and dL/dy; all [rows, cols].
template <compute_type T>
inline void softmax_backward(host, in_view<T, 2> y, in_view<T, 2> dy,
                             tensor_view<T, host, 2> dx) {
  for (auto* v : {&y, &dy}) detail::require_contiguous(*v, "ops::softmax_backward", "y/dy");
  detail::require_contiguous(dx, "ops::softmax_backward", "dx");
  detail::require_shape(dy, y.shape(), "ops::softmax_backward", "dy");
  detail::require_shape(dx, y.shape(), "ops::softmax_backward", "dx");
  const index_t n = y.extent(0), d = y.extent(1);
  for (index_t r = 0; r < n; ++r)
    detail::softmax_row_backward(y.data() + r * d, dy.data() + r * d, dx.data() + r * d, d);
}

}  // namespace loom::ops
