#pragma once
// What the GPU tests (kernels_test.cu, fill_test.cu; on a device and through the emulated
// runtime) share: host vectors to device buffers and back, and views of device buffers.
#include <loom/core/buffer.hpp>
#include <loom/core/cuda/error.hpp>
#include <loom/core/cuda/memory.hpp>
#include <loom/core/tensor_view.hpp>

#include <cuda_runtime.h>

#include <vector>

namespace loom::testing {

/// A device copy of a host vector.
template <class T>
loom::buffer<T, loom::cuda> upload(const std::vector<T>& v) {
  loom::buffer<T, loom::cuda> d(v.size());
  LOOM_CUDA_CHECK(cudaMemcpy(d.data(), v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

/// A host copy of a device buffer, after the device's work so far.
template <class T>
std::vector<T> download(const loom::buffer<T, loom::cuda>& d) {
  std::vector<T> v(d.size());
  LOOM_CUDA_CHECK(cudaDeviceSynchronize());
  LOOM_CUDA_CHECK(cudaMemcpy(v.data(), d.data(), v.size() * sizeof(T), cudaMemcpyDeviceToHost));
  return v;
}

/// Const and mutable row-major views of a device buffer with extents e...
template <class T, class... I>
auto cview(const loom::buffer<T, loom::cuda>& b, I... e) {
  return loom::tensor_view<const T, loom::cuda, sizeof...(I)>(b.data(), loom::extents<sizeof...(I)>{loom::index_t(e)...});
}
template <class T, class... I>
auto mview(loom::buffer<T, loom::cuda>& b, I... e) {
  return loom::tensor_view<T, loom::cuda, sizeof...(I)>(b.data(), loom::extents<sizeof...(I)>{loom::index_t(e)...});
}

}  // namespace loom::testing
