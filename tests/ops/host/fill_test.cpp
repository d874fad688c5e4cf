// ops::fill / ops::cast on the host against element-by-element conversions.
#include <loom/core/buffer.hpp>
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
