#pragma once
// Fill, element-type cast and in-place add on the host. Mirror of ops/cuda/fill.cuh (same names, overloaded
// on the device tag). Casts go through float for the 16-bit types (round to nearest even).
// A fill of more than 64K elements is split over host_pool(): the per-step zeroing of
// gradients and workspace buffers would otherwise leave the other pool threads idle.

#include <loom/core/device.hpp>
#include <loom/core/dtype.hpp>
#include <loom/core/error.hpp>
#include <loom/core/tensor_view.hpp>
#include <loom/ops/host/common.hpp>

#include <algorithm>

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
void add(host, tensor_view<T, host, 1> y, tensor_view<const T, host, 1> x) {
  LOOM_CHECK(y.numel() == x.numel(), "ops::add: y has ", y.numel(), " elements, x has ", x.numel());
  LOOM_CHECK(y.is_contiguous() && x.is_contiguous(), "ops::add: views must be contiguous");
  T* LOOM_RESTRICT yp = y.data();
  const T* LOOM_RESTRICT xp = x.data();
  detail::parallel_rows(y.numel(), detail::min_part_elements, [&](index_t b, index_t e) {
    LOOM_SIMD
    for (index_t i = b; i < e; ++i) yp[i] += xp[i];
  });
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
