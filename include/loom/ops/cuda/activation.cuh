#pragma once
// SwiGLU and GeLU forward and backward on a CUDA device. Mirror of ops/host/activation.hpp; the
// element math is ops/math/activation.hpp's (the functions the host kernels call). Grid-stride
// loops, asynchronous on `stream`.

#include <loom/core/device.hpp>
#include <loom/core/dtype.hpp>
#include <loom/core/tensor_view.hpp>
#include <loom/ops/cuda/launch.hpp>
#include <loom/ops/math/activation.hpp>

#include <loom/core/cuda/error.hpp>
#include <loom/ops/checks.hpp>

#include <cuda_runtime.h>

namespace loom::ops {
namespace kernels {

template <class T>
__global__ void swiglu_forward(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ out, index_t n) {
  for (index_t i = blockIdx.x * static_cast<index_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<index_t>(blockDim.x) * gridDim.x)
    out[i] = math::swiglu(a[i], b[i]);
}

template <class T>
__global__ void swiglu_backward(const T* __restrict__ dout, const T* __restrict__ a, const T* __restrict__ b,
                                T* __restrict__ da, T* __restrict__ db, index_t n, bool accumulate) {
  for (index_t i = blockIdx.x * static_cast<index_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<index_t>(blockDim.x) * gridDim.x) {
    const auto g = math::swiglu_grad(dout[i], a[i], b[i]);
    da[i] = accumulate ? da[i] + g.da : g.da;
    db[i] = accumulate ? db[i] + g.db : g.db;
  }
}

template <class T>
__global__ void gelu_forward(const T* __restrict__ x, T* __restrict__ y, index_t n, gelu_approx approx) {
  for (index_t i = blockIdx.x * static_cast<index_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<index_t>(blockDim.x) * gridDim.x)
    y[i] = approx == gelu_approx::none ? math::gelu_erf(x[i]) : math::gelu_tanh(x[i]);
}

template <class T>
__global__ void gelu_backward(const T* __restrict__ dy, const T* __restrict__ x, T* __restrict__ dx, index_t n,
                              gelu_approx approx) {
  for (index_t i = blockIdx.x * static_cast<index_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<index_t>(blockDim.x) * gridDim.x)
    dx[i] += approx == gelu_approx::none ? math::gelu_erf_grad(dy[i], x[i]) : math::gelu_tanh_grad(dy[i], x[i]);
}

}  // namespace kernels

/// out = silu(a) * b over device vectors of one length.
template <compute_type T>
void swiglu_forward(cuda, device_in_view<T, 1> a, device_in_view<T, 1> b, tensor_view<T, cuda, 1> out,
                    cudaStream_t stream = nullptr) {
  const index_t n = a.numel();
  detail::require_same_length("ops::swiglu_forward(cuda)", n, a, b, out);
  if (n == 0) return;
  LOOM_LAUNCH(kernels::swiglu_forward, kernels::grid_for(n, kernels::elementwise_block),
              kernels::elementwise_block, 0, stream)(
      a.data(), b.data(), out.data(), n);
  LOOM_CUDA_CHECK(cudaGetLastError());
}

/// da += dout * b * silu'(a), db += dout * silu(a)   (da = ..., db = ... when !accumulate)
template <compute_type T>
void swiglu_backward(cuda, device_in_view<T, 1> dout, device_in_view<T, 1> a, device_in_view<T, 1> b,
                     tensor_view<T, cuda, 1> da, tensor_view<T, cuda, 1> db,
                     bool accumulate = true, cudaStream_t stream = nullptr) {
  const index_t n = a.numel();
  detail::require_same_length("ops::swiglu_backward(cuda)", n, dout, a, b, da, db);
  if (n == 0) return;
  LOOM_LAUNCH(kernels::swiglu_backward, kernels::grid_for(n, kernels::elementwise_block),
              kernels::elementwise_block, 0, stream)(
      dout.data(), a.data(), b.data(), da.data(), db.data(), n, accumulate);
  LOOM_CUDA_CHECK(cudaGetLastError());
}

/// y = gelu(x) (erf form, or the tanh approximation)
template <compute_type T>
void gelu_forward(cuda, device_in_view<T, 1> x, tensor_view<T, cuda, 1> y, gelu_approx approx = gelu_approx::none,
                  cudaStream_t stream = nullptr) {
  const index_t n = x.numel();
  detail::require_same_length("ops::gelu_forward(cuda)", n, x, y);
  if (n == 0) return;
  LOOM_LAUNCH(kernels::gelu_forward, kernels::grid_for(n, kernels::elementwise_block),
              kernels::elementwise_block, 0, stream)(
      x.data(), y.data(), n, approx);
  LOOM_CUDA_CHECK(cudaGetLastError());
}

/// dx += dy * gelu'(x)
template <compute_type T>
void gelu_backward(cuda, device_in_view<T, 1> dy, device_in_view<T, 1> x, tensor_view<T, cuda, 1> dx,
                   gelu_approx approx = gelu_approx::none, cudaStream_t stream = nullptr) {
  const index_t n = x.numel();
  detail::require_same_length("ops::gelu_backward(cuda)", n, dy, x, dx);
  if (n == 0) return;
  LOOM_LAUNCH(kernels::gelu_backward, kernels::grid_for(n, kernels::elementwise_block),
              kernels::elementwise_block, 0, stream)(
      dy.data(), x.data(), dx.data(), n, approx);
  LOOM_CUDA_CHECK(cudaGetLastError());
}

}  // namespace loom::ops
