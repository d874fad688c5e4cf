#pragma once
// Fill, element-type cast, in-place add and a layer's bias (added to every row; its gradient,
// the column sums) on the host. Mirror of ops/cuda/fill.cuh (same names, overloaded on the
// device tag). Casts go through float for the 16-bit types (round to nearest even).
// A fill of more than 64K elements is split over host_pool(): the per-step zeroing of
// gradients and workspace buffers would otherwise leave the other pool threads idle.

#include <loom/core/device.hpp>
#include <loom/core/dtype.hpp>
#include <loom/core/error.hpp>
#include <loom/core/tensor_view.hpp>
#include <loom/ops/host/common.hpp>

#include <algorithm>
#include <type_traits>

namespace loom::ops {

/// x[i] = value for every element of a contiguous view (parts of >= 64K elements on host_pool()).
template <class T>
void fill(host, tensor_view<T, host, 1> x, T value) {
  LOOM_CHECK(x.is_contiguous(), "ops::fill: view must be contiguous (stride=", x.stride(0), ")");
  T* p = x.data();
  detail::parallel_rows(x.numel(), 2 * detail::min_part_elements, [&](index_t b, index_t e) { std::fill(p + b, p + e, value); });
}

/// y[i] += x[i] over contiguous views of one length (the residual adds of a block; parts of
/// >= 32K elements on host_pool(), each element added once, so any thread count gives the
/// same bits).
template <compute_type T>
void add(host, tensor_view<T, host, 1> y, in_view<T, 1> x) {
  LOOM_CHECK(y.numel() == x.numel(), "ops::add: y has ", y.numel(), " elements, x has ", x.numel());
  LOOM_CHECK(y.is_contiguous() && x.is_contiguous(), "ops::add: views must be contiguous");
  T* LOOM_RESTRICT yp = y.data();
  const T* LOOM_RESTRICT xp = x.data();
  detail::parallel_rows(y.numel(), detail::min_part_elements, [&](index_t b, index_t e) {
    LOOM_SIMD
    for (index_t i = b; i < e; ++i) yp[i] += xp[i];
  });
}

/// y [n, out] += b [out] on every row (a linear layer's bias; y's rows contiguous).
template <compute_type T>
void add_bias(host, tensor_view<T, host, 2> y, in_view<T, 1> b) {
  LOOM_CHECK(b.extent(0) == y.extent(1), "ops::add_bias: a bias of ", b.extent(0), " for ", y.extent(1), " outputs");
  LOOM_CHECK(y.stride(1) == 1 && b.is_contiguous(), "ops::add_bias: y's rows and b must be contiguous");
  for (index_t r = 0; r < y.extent(0); ++r) {
    T* LOOM_RESTRICT yr = &y(r, 0);
    const T* LOOM_RESTRICT bp = b.data();
    LOOM_SIMD
    for (index_t j = 0; j < y.extent(1); ++j) yr[j] += bp[j];
  }
}

/// db [out] += scale * sum over rows of dy [n, out], row after row (so each db element adds
/// its column in row order, on either backend).
template <compute_type T>
void bias_backward(host, in_view<T, 2> dy, tensor_view<T, host, 1> db, std::type_identity_t<T> scale = T(1)) {
  LOOM_CHECK(db.extent(0) == dy.extent(1), "ops::bias_backward: a bias of ", db.extent(0), " for ", dy.extent(1),
             " outputs");
  LOOM_CHECK(dy.stride(1) == 1 && db.is_contiguous(), "ops::bias_backward: dy's rows and db must be contiguous");
  T* LOOM_RESTRICT dp = db.data();
  for (index_t r = 0; r < dy.extent(0); ++r) {
    const T* LOOM_RESTRICT gr = &dy(r, 0);
    LOOM_SIMD
    for (index_t j = 0; j < dy.extent(1); ++j) dp[j] += scale * gr[j];
  }
}

/// out[i] = Out(in[i]); the views must have the same length.
template <element Out, element In>
void cast(host, tensor_view<const In, host, 1> in, tensor_view<Out, host, 1> out) {
  LOOM_CHECK(in.numel() == out.numel(), "ops::cast: input has ", in.numel(), " elements, output has ", out.numel());
  LOOM_CHECK(in.is_contiguous() && out.is_contiguous(), "ops::cast: views must be contiguous");
  const In* s = in.data();
  Out* d = out.data();
  for (index_t i = 0, n = in.numel(); i < n; ++i) {
    if constexpr (sizeof(In) == 2 && floating_element<In>)
      d[i] = Out(static_cast<float>(s[i]));
    else if constexpr (sizeof(Out) == 2 && floating_element<Out>)
      d[i] = Out(static_cast<float>(s[i]));
    else
      d[i] = static_cast<Out>(s[i]);
  }
}

}  // namespace loom::ops
