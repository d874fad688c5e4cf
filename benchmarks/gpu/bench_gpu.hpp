#pragma once
// What loom-bench-gpu's translation units share (bench_gpu.cu: the kernels; step.cu: the
// decoder's training step): the options, the timing and the table row.

#include <loom/core/buffer.hpp>
#include <loom/core/cuda/error.hpp>
#include <loom/core/tensor_view.hpp>

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

namespace loom_bench_gpu {

using loom::index_t;

struct options {
  bool quick = false;
  std::string only;  // run the rows whose kernel name starts with this (all when empty)
  int reps = 20;
  double peak_tflops = 989, peak_tflops_fp32 = 67, peak_gbs = 4800;
};

/// Median milliseconds of `reps` timed calls of f after 3 untimed ones.
template <class F>
inline double median_ms(int reps, F&& f) {
  cudaEvent_t start, stop;
  LOOM_CUDA_CHECK(cudaEventCreate(&start));
  LOOM_CUDA_CHECK(cudaEventCreate(&stop));
  for (int i = 0; i < 3; ++i) f();
  std::vector<float> ms(static_cast<std::size_t>(reps));
  for (auto& t : ms) {
    LOOM_CUDA_CHECK(cudaEventRecord(start));
    f();
    LOOM_CUDA_CHECK(cudaEventRecord(stop));
    LOOM_CUDA_CHECK(cudaEventSynchronize(stop));
    LOOM_CUDA_CHECK(cudaEventElapsedTime(&t, start, stop));
  }
  LOOM_CUDA_CHECK(cudaEventDestroy(start));
  LOOM_CUDA_CHECK(cudaEventDestroy(stop));
  std::nth_element(ms.begin(), ms.begin() + static_cast<std::ptrdiff_t>(ms.size() / 2), ms.end());
  return ms[ms.size() / 2];
}

/// n elements on the device: zeros for value 0 (outputs), else uniform in [-value, value]
/// (inputs: constant data can run faster than real data, and hides wrong indexing).
template <class T>
inline loom::buffer<T, loom::cuda> filled(std::size_t n, float value) {
  std::vector<T> h(n, T(0.f));
  if (value != 0.f) {
    std::uint64_t x = 0x9e3779b97f4a7c15ull ^ n;
    for (auto& e : h) {
      x ^= x << 13, x ^= x >> 7, x ^= x << 17;  // xorshift64
      e = T(value * (static_cast<float>(x >> 40) * 0x1p-23f - 1.f));
    }
  }
  loom::buffer<T, loom::cuda> d(n);
  LOOM_CUDA_CHECK(cudaMemcpy(d.data(), h.data(), n * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

inline void row(const std::string& what, const std::string& shape, double ms, double rate, const char* unit, double peak) {
  std::printf("| %s | %s | %.3f | %.1f %s | %.0f%% |\n", what.c_str(), shape.c_str(), ms, rate, unit, 100.0 * rate / peak);
}

/// The decoder's training step (step.cu).
void bench_step(const options& o);

}  // namespace loom_bench_gpu
