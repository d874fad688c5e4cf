// ops::fill / ops::cast on a CUDA device against the host implementation (labelled `gpu`;
// skipped without a device). Also exercises the CUDA memory resources' accounting.
#include <loom/core/buffer.hpp>
#include <loom/core/cuda/memory.hpp>
#include <loom/ops/cuda/fill.cuh>
#include <loom/ops/host/fill.hpp>

#include <doctest/doctest.h>

#include <vector>

TEST_CASE("device fill and cast equal the host versions") {
  loom::cuda_memory_resource dev("dev");
  loom::pinned_host_memory_resource pinned("pinned");
#if defined(LOOM_CUDA_EMULATION)
  const std::size_t n = (1u << 14) + 3;  // on the CPU (fill_emulated_test.cpp): still 65 blocks
#else
  const std::size_t n = (1u << 20) + 3;
#endif
  loom::buffer<float, loom::cuda> x(n, dev);
  loom::buffer<loom::half, loom::cuda> h(n, dev);
  CHECK(dev.current_bytes() == n * 6);
  loom::buffer<float> hx(n, pinned);
  for (std::size_t i = 0; i < n; ++i) hx[i] = static_cast<float>(i % 4099) * 0.731f - 1000.f;
  LOOM_CUDA_CHECK(cudaMemcpy(x.data(), hx.data(), n * sizeof(float), cudaMemcpyHostToDevice));
  loom::ops::cast<loom::half, float>(loom::cuda{}, x.view(), h.view());
  std::vector<loom::half> got(n);
  LOOM_CUDA_CHECK(cudaMemcpy(got.data(), h.data(), n * 2, cudaMemcpyDeviceToHost));
  loom::buffer<loom::half> expect(n);
  loom::ops::cast<loom::half, float>(loom::host{}, hx.view(), expect.view());
  for (std::size_t i = 0; i < n; ++i) REQUIRE(got[i].bits == expect[i].bits);

  loom::ops::fill(loom::cuda{}, x.view(), 3.25f);
  LOOM_CUDA_CHECK(cudaMemcpy(hx.data(), x.data(), n * sizeof(float), cudaMemcpyDeviceToHost));
  for (std::size_t i = 0; i < n; ++i) REQUIRE(hx[i] == 3.25f);
}
