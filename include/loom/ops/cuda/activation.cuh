#pragma once
// SwiGLU forward and backward on a CUDA device. Mirror of ops/host/activation.hpp; the element
// math is ops/math/activation.hpp's (the functions the host kernels call). Grid-stride loops,
// asynchronous on `stream`.

#include <loom/core/cuda/error.hpp>
#include <loom/core/device.hpp>
#include <loom/core/dtype.hpp>
#include <loom/core/tensor_view.hpp>
#include <loom/ops/checks.hpp>
#include <loom/ops/cuda/launch.hpp>
#include <loom/ops/math/activation.hpp>

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

}  // namespace kernels

/// out = silu(a) * b over device vectors of one length.
template <compute_type T>
void swiglu_forward(cuda, device_in_view<T, 1> a, device_in_view<T, 1> b, tensor_view<T, cuda, 1> out,
                    cudaStream_t stream = nullptr) {
  const index_t n = a.numel();
  detail::require_same_length("ops::swiglu_forward(cuda)", n, a, b, out);
  if (n == 0) return;
  kernels::swiglu_forward<<<kernels::grid_for(n, kernels::elementwise_block), kernels::elementwise_block, 0, stream>>>(
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
  kernels::swiglu_backward<<<kernels::grid_for(n, kernels::elementwise_block), kernels::elementwise_block, 0, stream>>>(
      dout.data(), a.data(), b.data(), da.data(), db.data(), n, accumulate);
  LOOM_CUDA_CHECK(cudaGetLastError());
}

}  // namespace loom::ops
