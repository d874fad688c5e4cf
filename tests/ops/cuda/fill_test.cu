// ops::fill / ops::cast / ops::add / ops::add_bias / ops::bias_backward on a CUDA device
// against the host implementation (labelled `gpu`; skipped without a device). Also exercises
// the CUDA memory resources' accounting.
#include <loom/core/buffer.hpp>
#include <loom/core/cuda/memory.hpp>
#include <loom/ops/cuda/fill.cuh>
#include <loom/ops/host/fill.hpp>

#include <doctest/doctest.h>

#include "ops/cuda/transfer.hpp"

#include <cmath>
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

using loom::testing::download;
using loom::testing::upload;

TEST_CASE("device add, add_bias and bias_backward equal the host versions (a strided y; shapes checked)") {
  const loom::index_t n = 300, out = 257, ld = 260;  // y's rows 260 apart: 3 columns not the layer's
  std::vector<float> y(static_cast<std::size_t>(n * ld)), b(static_cast<std::size_t>(out)), dy(static_cast<std::size_t>(n * out)),
      db(static_cast<std::size_t>(out));
  for (std::size_t i = 0; i < y.size(); ++i) y[i] = std::sin(0.3f * float(i));
  for (std::size_t i = 0; i < b.size(); ++i) b[i] = 0.1f * float(i % 17) - 0.7f, db[i] = std::cos(float(i));
  for (std::size_t i = 0; i < dy.size(); ++i) dy[i] = std::sin(1.7f * float(i) + 0.2f);
  auto gy = upload(y), gb = upload(b), gdy = upload(dy), gdb = upload(db), gx = upload(dy);
  const loom::tensor_view<float, loom::host, 2> yv(y.data(), loom::extents<2>{n, out}, {ld, 1});
  const loom::tensor_view<float, loom::cuda, 2> gyv(gy.data(), loom::extents<2>{n, out}, {ld, 1});
  loom::ops::add_bias(loom::host{}, yv, loom::make_view(b.data(), out));
  loom::ops::add_bias(loom::cuda{}, gyv, gb.view());
  CHECK(download(gy) == y);  // one add an element: the same bits
  loom::ops::bias_backward(loom::host{}, loom::make_view(dy.data(), n, out), loom::make_view(db.data(), out), 0.5f);
  loom::ops::bias_backward(loom::cuda{}, loom::tensor_view<const float, loom::cuda, 2>(gdy.data(), loom::extents<2>{n, out}),
                           gdb.view(), 0.5f);
  const auto got_db = download(gdb);
  for (std::size_t j = 0; j < db.size(); ++j)  // row order on both; nvcc may fuse each step into an FMA
    REQUIRE(std::abs(got_db[j] - db[j]) <= 1e-5f * (1.f + std::abs(db[j])));
  std::vector<float> x(y.size() / 2, 0.25f), yy(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) yy[i] = float(i) * 0.5f, x[i] = std::cos(float(i));
  auto gyy = upload(yy), gxx = upload(x);
  loom::ops::add(loom::host{}, loom::make_view(yy.data(), loom::index_t(yy.size())), loom::make_view(x.data(), loom::index_t(x.size())));
  loom::ops::add(loom::cuda{}, gyy.view(), gxx.view());
  CHECK(download(gyy) == yy);
  CHECK_THROWS_WITH_AS(loom::ops::add_bias(loom::cuda{}, gyv, gx.view()), doctest::Contains("a bias of 77100 for 257 outputs"),
                       loom::error);
}
