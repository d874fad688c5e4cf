#include <loom/amp/overflow.hpp>

#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <vector>

namespace {
template <class T>
void check_type() {
  const float specials[] = {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                            std::numeric_limits<float>::quiet_NaN()};
  for (std::size_t n : {1u, 7u, 64u, 1001u}) {
    std::vector<T> x(n);
    for (std::size_t i = 0; i < n; ++i) x[i] = T(static_cast<float>(i) * 0.37f - 3.f);
    CHECK_FALSE(loom::amp::has_nonfinite(std::span<const T>(x)));
    for (std::size_t pos : {std::size_t(0), n / 2, n - 1})
      for (float sp : specials) {
        auto y = x;
        y[pos] = T(sp);
        // the oracle: std::isfinite on the widened value
        bool expect = false;
        for (auto v : y) expect |= !std::isfinite(static_cast<float>(v));
        CHECK(loom::amp::has_nonfinite(std::span<const T>(y)) == expect);
        CHECK(expect);
      }
  }
}
}  // namespace

TEST_CASE("has_nonfinite finds inf and NaN anywhere, for every floating element type") {
  check_type<float>();
  check_type<double>();
  check_type<loom::half>();
  check_type<loom::bfloat16>();
  // large finite values are not overflow
  std::vector<loom::half> h{loom::half(65504.f), loom::half(-65504.f)};
  CHECK_FALSE(loom::amp::has_nonfinite(std::span<const loom::half>(h)));
  // narrowing overflow to half is
  h[0] = loom::half(70000.f);
  CHECK(loom::amp::has_nonfinite(std::span<const loom::half>(h)));
}

TEST_CASE("detect_overflow asks the agreement hook for the global answer") {
  std::vector<float> clean(16, 1.f);
  int calls = 0;
  bool seen_local = true;
  // a stand-in for another rank that overflowed: global = local OR remote
  auto other_rank_overflowed = [&](bool local) {
    ++calls;
    seen_local = local;
    return local || true;
  };
  CHECK(loom::amp::detect_overflow(std::span<const float>(clean), other_rank_overflowed));
  CHECK(calls == 1);
  CHECK(seen_local == false);
  CHECK_FALSE(loom::amp::detect_overflow(std::span<const float>(clean)));
}
