// ops::fill / ops::cast on the host against element-by-element conversions.
#include <loom/core/buffer.hpp>
#include <loom/core/thread_pool.hpp>
#include <loom/ops/host/fill.hpp>

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <vector>

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

TEST_CASE("host add_bias and bias_backward against a double loop; a strided y and mismatched shapes") {
  const loom::index_t n = 37, out = 19, ld = 23;  // y's rows 23 apart: only 19 columns are the layer's
  std::vector<float> y(static_cast<std::size_t>(n * ld)), b(static_cast<std::size_t>(out)), dy(static_cast<std::size_t>(n * out)),
      db(static_cast<std::size_t>(out));
  for (std::size_t i = 0; i < y.size(); ++i) y[i] = std::sin(0.3f * float(i));
  for (std::size_t i = 0; i < b.size(); ++i) b[i] = 0.1f * float(i) - 0.7f, db[i] = std::cos(float(i));
  for (std::size_t i = 0; i < dy.size(); ++i) dy[i] = std::sin(1.7f * float(i) + 0.2f);
  const auto y0 = y, db0 = db;
  const loom::tensor_view<float, loom::host, 2> yv(y.data(), loom::extents<2>{n, out}, {ld, 1});
  loom::ops::add_bias(loom::host{}, yv, loom::make_view(b.data(), out));
  loom::ops::bias_backward(loom::host{}, loom::make_view(dy.data(), n, out), loom::make_view(db.data(), out), 0.5f);
  for (loom::index_t r = 0; r < n; ++r)
    for (loom::index_t j = 0; j < ld; ++j) {
      const auto i = std::size_t(r * ld + j);
      CHECK(y[i] == (j < out ? y0[i] + b[std::size_t(j)] : y0[i]));  // one add: exact; the gap untouched
    }
  for (loom::index_t j = 0; j < out; ++j) {
    double want = db0[std::size_t(j)];
    for (loom::index_t r = 0; r < n; ++r) want += 0.5 * double(dy[std::size_t(r * out + j)]);
    CHECK(db[std::size_t(j)] == doctest::Approx(want).epsilon(1e-5));
  }
  CHECK_THROWS_WITH_AS(loom::ops::add_bias(loom::host{}, yv, loom::make_view(b.data(), out - 1)),
                       doctest::Contains("a bias of 18 for 19 outputs"), loom::error);
  CHECK_THROWS_WITH_AS(loom::ops::bias_backward(loom::host{}, loom::make_view(dy.data(), n, out), loom::make_view(db.data(), 3)),
                       doctest::Contains("a bias of 3 for 19 outputs"), loom::error);
}
