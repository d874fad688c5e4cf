#pragma once
// Fill and element-type cast on a CUDA device. Mirror of ops/host/fill.hpp. Grid-stride loops;
// the launch is asynchronous on `stream` and checked for launch errors.

#include <loom/core/cuda/error.hpp>
#include <loom/core/device.hpp>
#include <loom/core/dtype.hpp>
#include <loom/core/tensor_view.hpp>
#include <loom/ops/cuda/launch.hpp>

#include <cuda_runtime.h>

namespace loom::ops {
namespace kernels {

template <class T>
__global__ void fill(T* __restrict__ p, index_t n, T value) {
  for (index_t i = blockIdx.x * static_cast<index_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<index_t>(blockDim.x) * gridDim.x)
    p[i] = value;
}

template <class Out, class In>
__global__ void cast(const In* __restrict__ s, Out* __restrict__ d, index_t n) {
  for (index_t i = blockIdx.x * static_cast<index_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<index_t>(blockDim.x) * gridDim.x) {
    if constexpr ((sizeof(In) == 2 && floating_element<In>) || (sizeof(Out) == 2 && floating_element<Out>))
      d[i] = Out(static_cast<float>(s[i]));
    else
      d[i] = static_cast<Out>(s[i]);
  }
}

}  // namespace kernels

template <class T>
void fill(cuda, tensor_view<T, cuda, 1> x, T value, cudaStream_t stream = nullptr) {
  LOOM_CHECK(x.is_contiguous(), "ops::fill: view must be contiguous (stride=", x.stride(0), ")");
  if (x.numel() == 0) return;
  LOOM_LAUNCH(kernels::fill, kernels::grid_for(x.numel(), 256), 256, 0, stream)(x.data(), x.numel(), value);
  LOOM_CUDA_CHECK(cudaGetLastError());
}

template <element Out, element In>
void cast(cuda, tensor_view<const In, cuda, 1> in, tensor_view<Out, cuda, 1> out, cudaStream_t stream = nullptr) {
  LOOM_CHECK(in.numel() == out.numel(), "ops::cast: input has ", in.numel(), " elements, output has ", out.numel());
  LOOM_CHECK(in.is_contiguous() && out.is_contiguous(), "ops::cast: views must be contiguous");
  if (in.numel() == 0) return;
  LOOM_LAUNCH(kernels::cast, kernels::grid_for(in.numel(), 256), 256, 0, stream)(in.data(), out.data(), in.numel());
  LOOM_CUDA_CHECK(cudaGetLastError());
}

}  // namespace loom::ops
