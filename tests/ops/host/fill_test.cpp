// ops::fill / ops::cast on the host against element-by-element conversions.
#include <loom/core/buffer.hpp>
#include <loom/core/thread_pool.hpp>
#include <loom/ops/host/fill.hpp>

#include <doctest/doctest.h>

#include <cstdint>

TEST_CASE("host fill and cast") {
  loom::buffer<float> x(1000);
  loom::ops::fill(loom::host{}, x.view(), 1.5f);
  for (float v : x) REQUIRE(v == 1.5f);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i) * 0.37f - 100.f;
  loom::buffer<loom::bfloat16> b(1000);
  loom::buffer<std::int32_t> n(1000);
  loom::ops::cast<loom::bfloat16, float>(loom::host{}, x.view(), b.view());
  loom::ops::cast<std::int32_t, float>(loom::host{}, x.view(), n.view());
  for (std::size_t i = 0; i < x.size(); ++i) {
    REQUIRE(b[i].bits == loom::bfloat16(x[i]).bits);
    REQUIRE(n[i] == static_cast<std::int32_t>(x[i]));
  }
  loom::buffer<float> y(999);
  CHECK_THROWS_AS((loom::ops::cast<float, float>(loom::host{}, x.view(), y.view())), loom::error);
}

TEST_CASE("host fill split over a 3-thread pool reaches every element and nothing beyond its view") {
  loom::thread_pool pool(3);
  loom::host_pool_scope scope(pool);
  for (loom::index_t n : {1, 65535, 65536 * 3 + 7, 1000003}) {
    loom::buffer<float> x(static_cast<std::size_t>(n) + 2);
    for (auto& v : x) v = -1.f;
    loom::ops::fill(loom::host{}, loom::make_view(x.data() + 1, n), 2.5f);
    std::size_t wrong = 0;
    for (std::size_t i = 0; i < x.size(); ++i) wrong += x[i] != ((i == 0 || i == x.size() - 1) ? -1.f : 2.5f);
    CHECK(wrong == 0);
  }
}
