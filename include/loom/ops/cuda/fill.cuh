#pragma once
// Fill, element-type cast, in-place add and a layer's bias (added to every row; its gradient,
// the column sums) on a CUDA device. Mirror of ops/host/fill.hpp. Grid-stride loops; the
// launch is asynchronous on `stream` and checked for launch errors. The bias gradient adds a
// column's rows in row order, as the host does, so the two differ only where nvcc contracts
// scale * dy + db into one FMA.

#include <loom/core/cuda/error.hpp>
#include <loom/core/device.hpp>
#include <loom/core/dtype.hpp>
#include <loom/core/tensor_view.hpp>
#include <loom/ops/cuda/launch.hpp>

#include <cuda_runtime.h>

#include <type_traits>

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

template <class T>
__global__ void add(T* __restrict__ y, const T* __restrict__ x, index_t n) {
  for (index_t i = blockIdx.x * static_cast<index_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<index_t>(blockDim.x) * gridDim.x)
    y[i] += x[i];
}

template <class T>
__global__ void add_bias(T* __restrict__ y, const T* __restrict__ b, index_t rows, index_t cols, index_t ld) {
  for (index_t i = blockIdx.x * static_cast<index_t>(blockDim.x) + threadIdx.x; i < rows * cols;
       i += static_cast<index_t>(blockDim.x) * gridDim.x) {
    const index_t r = i / cols, j = i % cols;
    y[r * ld + j] += b[j];
  }
}

/// Thread j adds column j of dy, row after row.
template <class T>
__global__ void bias_backward(const T* __restrict__ dy, T* __restrict__ db, index_t rows, index_t cols, index_t ld,
                              T scale) {
  for (index_t j = blockIdx.x * static_cast<index_t>(blockDim.x) + threadIdx.x; j < cols;
       j += static_cast<index_t>(blockDim.x) * gridDim.x) {
    T acc = db[j];
    for (index_t r = 0; r < rows; ++r) acc += scale * dy[r * ld + j];
    db[j] = acc;
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

/// y[i] += x[i] over contiguous views of one length.
template <compute_type T>
void add(cuda, tensor_view<T, cuda, 1> y, device_in_view<T, 1> x, cudaStream_t stream = nullptr) {
  LOOM_CHECK(y.numel() == x.numel(), "ops::add: y has ", y.numel(), " elements, x has ", x.numel());
  LOOM_CHECK(y.is_contiguous() && x.is_contiguous(), "ops::add: views must be contiguous");
  if (y.numel() == 0) return;
  LOOM_LAUNCH(kernels::add, kernels::grid_for(y.numel(), 256), 256, 0, stream)(y.data(), x.data(), y.numel());
  LOOM_CUDA_CHECK(cudaGetLastError());
}

/// y [n, out] += b [out] on every row (y's rows contiguous).
template <compute_type T>
void add_bias(cuda, tensor_view<T, cuda, 2> y, device_in_view<T, 1> b, cudaStream_t stream = nullptr) {
  LOOM_CHECK(b.extent(0) == y.extent(1), "ops::add_bias: a bias of ", b.extent(0), " for ", y.extent(1), " outputs");
  LOOM_CHECK(y.stride(1) == 1 && b.is_contiguous(), "ops::add_bias: y's rows and b must be contiguous");
  if (y.numel() == 0) return;
  LOOM_LAUNCH(kernels::add_bias, kernels::grid_for(y.numel(), 256), 256, 0, stream)(y.data(), b.data(), y.extent(0),
                                                                                   y.extent(1), y.stride(0));
  LOOM_CUDA_CHECK(cudaGetLastError());
}

/// db [out] += scale * sum over rows of dy [n, out], each column's rows in row order.
template <compute_type T>
void bias_backward(cuda, device_in_view<T, 2> dy, tensor_view<T, cuda, 1> db, std::type_identity_t<T> scale = T(1),
                   cudaStream_t stream = nullptr) {
  LOOM_CHECK(db.extent(0) == dy.extent(1), "ops::bias_backward: a bias of ", db.extent(0), " for ", dy.extent(1),
             " outputs");
  LOOM_CHECK(dy.stride(1) == 1 && db.is_contiguous(), "ops::bias_backward: dy's rows and db must be contiguous");
  if (db.numel() == 0) return;
  LOOM_LAUNCH(kernels::bias_backward, kernels::grid_for(db.numel(), 256), 256, 0, stream)(
      dy.data(), db.data(), dy.extent(0), dy.extent(1), dy.stride(0), scale);
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
