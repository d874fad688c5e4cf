#pragma once
// RMSNorm forward and backward on a CUDA device. Mirror of ops/host/norm.hpp (same names and
// arguments, the cuda tag and a stream added); the element math is ops/math/norm.hpp's, the
// functions the host kernels call, so the host tests test this arithmetic.
//
// Why this shape: one block of row_block threads per row; each thread sums its strided
// elements and a CUB block reduction makes the row's sum (the only part that differs from the
// host, which sums in vector lanes: results agree to rounding). dw is a reduction over rows:
// one thread per column adds the rows in row order, as the host does, so it is deterministic
// and needs no atomics. Launches are asynchronous on `stream`.

#include <loom/core/device.hpp>
#include <loom/core/dtype.hpp>
#include <loom/core/tensor_view.hpp>
#include <loom/ops/cuda/launch.hpp>
#include <loom/ops/cuda/reduce.cuh>
#include <loom/ops/math/load.hpp>
#include <loom/ops/math/norm.hpp>

#include <type_traits>

#include <loom/core/cuda/error.hpp>
#include <loom/ops/checks.hpp>
#include <cuda_runtime.h>

namespace loom::ops {
namespace kernels {

template <class T, class P>
__global__ void __launch_bounds__(row_block)
    rmsnorm_forward(const T* __restrict__ x, const P* __restrict__ w, T* __restrict__ y, T* __restrict__ rstd,
                    index_t d, T eps) {
  const T* xr = x + blockIdx.x * d;
  T* yr = y + blockIdx.x * d;
  T ss = 0;
  for (index_t i = threadIdx.x; i < d; i += row_block) ss += xr[i] * xr[i];
  const T s = math::rmsnorm_rstd(block_sum(ss), T(d), eps);
  if (threadIdx.x == 0) rstd[blockIdx.x] = s;
  for (index_t i = threadIdx.x; i < d; i += row_block) yr[i] = math::rmsnorm_y(xr[i], s, load<T>(w[i]));
}

template <class T, class P>
__global__ void __launch_bounds__(row_block)
    rmsnorm_backward_dx(const T* __restrict__ dy, const T* __restrict__ x, const P* __restrict__ w,
                        const T* __restrict__ rstd, T* __restrict__ dx, index_t d) {
  const index_t off = blockIdx.x * d;
  const T s = rstd[blockIdx.x];
  T dot = 0;
  for (index_t i = threadIdx.x; i < d; i += row_block) dot += math::rmsnorm_dot_term(dy[off + i], load<T>(w[i]), x[off + i]);
  const T c = math::rmsnorm_dx_coeff(block_sum(dot), s, T(d));
  for (index_t i = threadIdx.x; i < d; i += row_block)
    dx[off + i] += math::rmsnorm_dx(dy[off + i], load<T>(w[i]), x[off + i], s, c);
}

template <class T>
__global__ void rmsnorm_backward_dw(const T* __restrict__ dy, const T* __restrict__ x, const T* __restrict__ rstd,
                                    T* __restrict__ dw, index_t n, index_t d) {
  const index_t i = blockIdx.x * static_cast<index_t>(blockDim.x) + threadIdx.x;
  if (i >= d) return;
  T acc = dw[i];
  for (index_t r = 0; r < n; ++r) acc += math::rmsnorm_dw(dy[r * d + i], x[r * d + i], rstd[r]);
  dw[i] = acc;
}

}  // namespace kernels

/// x, y: [rows, dim]; w: [dim]; rstd: [rows] (saved for backward). All device views.
template <compute_type T, class P>
  requires param_type<std::remove_const_t<P>>
void rmsnorm_forward(cuda, device_in_view<T, 2> x, tensor_view<P, cuda, 1> w, tensor_view<T, cuda, 2> y,
                     tensor_view<T, cuda, 1> rstd, T eps, cudaStream_t stream = nullptr) {
  const char* fn = "ops::rmsnorm_forward(cuda)";
  const index_t n = x.extent(0), d = x.extent(1);
  detail::require_contiguous(x, fn, "x");
  detail::require_shape(y, x.shape(), fn, "y");
  detail::require_contiguous(y, fn, "y");
  detail::require_shape(w, extents<1>{d}, fn, "w");
  detail::require_shape(rstd, extents<1>{n}, fn, "rstd");
  LOOM_CHECK(eps > T(0), fn, ": eps must be > 0, got eps=", eps);
  LOOM_CHECK(n <= kernels::grid_cap, fn, ": rows=", n, " above the supported ", kernels::grid_cap);
  if (n == 0) return;
  LOOM_LAUNCH(kernels::rmsnorm_forward, static_cast<unsigned>(n), kernels::row_block, 0, stream)(
      x.data(), w.data(), y.data(), rstd.data(), d, eps);
  LOOM_CUDA_CHECK(cudaGetLastError());
}

/// dx += d/dx, dw += d/dw of rmsnorm; shapes as in forward. An empty dw: the weight is
/// frozen, only dx is computed.
template <compute_type T, class P>
  requires param_type<std::remove_const_t<P>>
void rmsnorm_backward(cuda, device_in_view<T, 2> dy, device_in_view<T, 2> x, tensor_view<P, cuda, 1> w,
                      device_in_view<T, 1> rstd, tensor_view<T, cuda, 2> dx,
                      tensor_view<T, cuda, 1> dw, cudaStream_t stream = nullptr) {
  const char* fn = "ops::rmsnorm_backward(cuda)";
  const index_t n = x.extent(0), d = x.extent(1);
  detail::require_contiguous(x, fn, "x");
  detail::require_contiguous(dy, fn, "dy");
  detail::require_shape(dy, x.shape(), fn, "dy");
  detail::require_shape(dx, x.shape(), fn, "dx");
  detail::require_contiguous(dx, fn, "dx");
  detail::require_shape(w, extents<1>{d}, fn, "w");
  if (!dw.empty()) detail::require_shape(dw, extents<1>{d}, fn, "dw");
  detail::require_shape(rstd, extents<1>{n}, fn, "rstd");
  LOOM_CHECK(n <= kernels::grid_cap, fn, ": rows=", n, " above the supported ", kernels::grid_cap);
  if (n == 0 || d == 0) return;
  LOOM_LAUNCH(kernels::rmsnorm_backward_dx, static_cast<unsigned>(n), kernels::row_block, 0, stream)(
      dy.data(), x.data(), w.data(), rstd.data(), dx.data(), d);
  LOOM_CUDA_CHECK(cudaGetLastError());
  if (dw.empty()) return;
  LOOM_LAUNCH(kernels::rmsnorm_backward_dw, kernels::grid_for(d, kernels::elementwise_block),
              kernels::elementwise_block, 0, stream)(dy.data(), x.data(), rstd.data(), dw.data(), n, d);
  LOOM_CUDA_CHECK(cudaGetLastError());
}

}  // namespace loom::ops
