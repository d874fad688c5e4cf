#pragma once
// Shared pieces of the host kernels: the compute-type concept, loading stored parameters
// (float, double, half, bfloat16) into the compute type, shape checks, and the SIMD pragma.
//
// Why: every kernel in ops/host computes in T = float (training) or double (finite-difference
// gradient checks) while parameters may be stored in 16 bits. One load function keeps that
// conversion in one place. Elementwise loops are written plainly and marked with
// `#pragma omp simd` (honoured through -fopenmp-simd, which loom::blas adds) so reductions
// vectorise without -ffast-math. Row-wise and elementwise kernels split their rows over
// host_pool() with parallel_rows (contiguous parts, each row computed exactly as on one
// thread, so results do not depend on the thread count).

#include <loom/core/device.hpp>
#include <loom/core/dtype.hpp>
#include <loom/core/error.hpp>
#include <loom/core/tensor_view.hpp>
#include <loom/core/thread_pool.hpp>
#include <loom/ops/math/exp.hpp>   // ops::exp, shared with the CUDA kernels
#include <loom/ops/math/load.hpp>  // ops::load, likewise
#include <loom/ops/checks.hpp>     // argument checks, likewise

#include <algorithm>
#include <cmath>
#include <concepts>
#include <cstdint>
#include <sstream>
#include <string>
#include <type_traits>

#define LOOM_SIMD _Pragma("omp simd")
#define LOOM_SIMD_SUM(var) _Pragma(LOOM_SIMD_STR(omp simd reduction(+ : var)))
#define LOOM_SIMD_MAX(var) _Pragma(LOOM_SIMD_STR(omp simd reduction(max : var)))
#define LOOM_SIMD_STR(x) #x

namespace loom::ops {

// The element concepts live in core/dtype.hpp; the kernels name them as ops:: too.
using loom::compute_type;
using loom::param_type;

/// An input view of compute-type elements; T is deduced from the outputs, so a mutable
/// view passes where a const one is expected.
template <class T, std::size_t R>
using in_view = tensor_view<const std::type_identity_t<T>, host, R>;

/// max(a, b) as a LOOM_SIMD_MAX loop must write it: GCC 12 vectorises `b > a ? b : a` under
/// `omp simd reduction(max)` but not std::max(a, b) (`a < b ? b : a`), which left every row
/// maximum (softmax, cross-entropy) scalar. Same result as std::max, NaN b included.
template <class T>
LOOM_FORCE_INLINE T max_simd(T a, T b) noexcept {
  return b > a ? b : a;
}

namespace detail {

/// The largest of x[0..n) (n >= 1), vectorised (the one row-maximum loop of softmax and both
/// cross-entropies, so the max_simd form lives in one place).
template <compute_type T>
LOOM_FORCE_INLINE T row_max(const T* x, index_t n) noexcept {
  T m = x[0];
  LOOM_SIMD_MAX(m)
  for (index_t i = 1; i < n; ++i) m = max_simd(m, x[i]);
  return m;
}

/// sum_i exp(x[i] - m) over x[0..n), vectorised.
template <compute_type T>
LOOM_FORCE_INLINE T row_exp_sum(const T* x, index_t n, T m) noexcept {
  T s = 0;
  LOOM_SIMD_SUM(s)
  for (index_t i = 0; i < n; ++i) s += ops::exp(x[i] - m);
  return s;
}

/// Elements of work a pool part gets at least: below that the pool's wake-up (a few
/// microseconds) costs more than it saves. The grain of a flat elementwise loop.
inline constexpr index_t min_part_elements = 32768;
/// Rows per part for rows of `row_elems` elements (at least min_part_elements per part).
inline index_t rows_grain(index_t row_elems) {
  return std::max<index_t>(1, min_part_elements / std::max<index_t>(row_elems, 1));
}

/// fn(begin, end) over the rows [0, n) on host_pool(), parts of at least `grain` rows.
/// A lambda given here captures by reference, so a pointer it names from the enclosing
/// function is read through the closure; inside an `omp simd` reduction loop GCC 12 reloaded
/// such a pointer every iteration and gathered through it (rmsnorm_backward ran 2.5-3x slower,
/// docs/benchmarks.md). Copy pointers the loops index into locals at the top of fn.
template <class F>
inline void parallel_rows(index_t n, index_t grain, F&& fn) {
  host_pool().parallel_for(n, grain, [&](int, index_t b, index_t e) { fn(b, e); });
}

}  // namespace detail
}  // namespace loom::ops
