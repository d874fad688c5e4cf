#pragma once
// Test helpers for gradient checks: a random vector, and a central finite-difference check of
// an analytic gradient of a scalar objective (run in double, so tolerances are tight).

#include <doctest/doctest.h>
#include <loom/core/random.hpp>

#include <cmath>
#include <cstdint>
#include <functional>
#include <vector>

namespace loom::test {

inline std::vector<double> random_vector(std::size_t n, std::uint64_t seed, double scale = 1.0) {
  counter_rng rng(seed);
  std::vector<double> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = scale * rng.normal(i);
  return v;
}

/// For every element (or every `step`-th) of x: compares analytic[i] with the central
/// difference of objective() at x[i] +- h. `objective` reads x.
inline void check_gradient(std::vector<double>& x, const std::vector<double>& analytic,
                           const std::function<double()>& objective, const char* what, double tol = 1e-6,
                           std::size_t step = 1, double h = 1e-5) {
  REQUIRE(x.size() == analytic.size());
  for (std::size_t i = 0; i < x.size(); i += step) {
    const double keep = x[i];
    x[i] = keep + h;
    const double up = objective();
    x[i] = keep - h;
    const double down = objective();
    x[i] = keep;
    const double numeric = (up - down) / (2 * h);
    INFO(what, "[", i, "]: analytic ", analytic[i], " numeric ", numeric);
    CHECK(std::abs(analytic[i] - numeric) <= tol * (1.0 + std::abs(numeric)));
  }
}

/// sum_i r[i] * y[i]: the objective whose gradient with respect to y is r.
inline double dot(const std::vector<double>& r, const std::vector<double>& y) {
  double s = 0;
  for (std::size_t i = 0; i < y.size(); ++i) s += r[i] * y[i];
  return s;
}

}  // namespace loom::test
