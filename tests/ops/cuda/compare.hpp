#pragma once
// What the CUDA kernels' tests (on a device and emulated) share: random inputs and the
// elementwise comparison with a tolerance.
#include <loom/core/random.hpp>

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace loom::testing {

/// n normal values (mean 0, `scale`) from `seed`, as T.
template <class T = float>
std::vector<T> random_vector(std::size_t n, std::uint64_t seed, float scale = 1.f) {
  std::vector<float> f(n);
  loom::counter_rng(seed).fill_normal(std::span<float>(f), 0, 0.f, scale);
  return std::vector<T>(f.begin(), f.end());
}

/// |got - want| <= atol + rtol |want| everywhere; reports how many elements are not, and the
/// first of them.
template <class A, class B>
void require_close(const std::vector<A>& got, const std::vector<B>& want, double rtol, double atol, const std::string& what) {
  REQUIRE(got.size() == want.size());
  std::size_t bad = 0, first = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double g = static_cast<double>(static_cast<float>(got[i])), w = static_cast<double>(static_cast<float>(want[i]));
    if (!(std::abs(g - w) <= atol + rtol * std::abs(w))) first = bad++ ? first : i;
  }
  INFO(what << ": " << bad << " of " << got.size() << " elements differ; the first, " << first << ", is "
            << (bad ? static_cast<double>(static_cast<float>(got[first])) : 0.0) << " against "
            << (bad ? static_cast<double>(static_cast<float>(want[first])) : 0.0));
  CHECK(bad == 0);
}

}  // namespace loom::testing

// For the tests' own translation units: plain names.
using loom::testing::random_vector;
using loom::testing::require_close;
