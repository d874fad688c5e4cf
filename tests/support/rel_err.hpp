#pragma once
// The parity tests' measure of a result against a reference (PyTorch's, or a one-rank run's).
#include <algorithm>
#include <cmath>
#include <cstddef>

namespace loom::test {

/// max |a - b| / max |b| over n elements (max |a - b| when b is all zero).
template <class A, class B>
double rel_err(const A* a, const B* b, std::size_t n) {
  double diff = 0, ref = 0;
  for (std::size_t i = 0; i < n; ++i) {
    diff = std::max(diff, std::abs(double(a[i]) - double(b[i])));
    ref = std::max(ref, std::abs(double(b[i])));
  }
  return ref > 0 ? diff / ref : diff;
}

/// max |a - b| over n elements.
template <class A, class B>
double max_abs_diff(const A* a, const B* b, std::size_t n) {
  double diff = 0;
  for (std::size_t i = 0; i < n; ++i) diff = std::max(diff, std::abs(double(a[i]) - double(b[i])));
  return diff;
}

}  // namespace loom::test
