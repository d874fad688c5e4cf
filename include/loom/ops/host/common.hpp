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

#include <algorithm>
#include <bit>
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

/// A stored parameter converted to the compute type (16-bit types go through float).
template <compute_type T, class P>
inline T load(P p) noexcept {
  if constexpr (std::is_same_v<std::remove_cv_t<P>, half> || std::is_same_v<std::remove_cv_t<P>, bfloat16>)
    return static_cast<T>(static_cast<float>(p));
  else
    return static_cast<T>(p);
}

/// max(a, b) as a LOOM_SIMD_MAX loop must write it: GCC 12 vectorises `b > a ? b : a` under
/// `omp simd reduction(max)` but not std::max(a, b) (`a < b ? b : a`), which left every row
/// maximum (softmax, cross-entropy) scalar. Same result as std::max, NaN b included.
template <class T>
LOOM_FORCE_INLINE T max_simd(T a, T b) noexcept {
  return b > a ? b : a;
}

/// e^x, vectorisable: for float a Cephes-style range reduction and degree-6 polynomial
/// (within 2 ulp of expf on [-87, 88]; clamped there, so very negative x gives ~1e-38, not 0),
/// written with operations compilers vectorise without -ffast-math (libm's expf is not
/// vectorised then). For double: std::exp (finite-difference checks want it exact).
template <compute_type T>
LOOM_FORCE_INLINE T exp(T x) noexcept {
  if constexpr (std::is_same_v<T, double>) {
    return std::exp(x);
  } else {
    x = x < -87.0f ? -87.0f : (x > 88.5f ? 88.5f : x);
    constexpr float round_magic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
    const float n = (x * 1.44269504088896341f + round_magic) - round_magic;
    const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;  // x - n ln2, ln2 split in two
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const float y = p * r * r + r + 1.0f;
    const auto scale = std::bit_cast<float>(static_cast<std::int32_t>((static_cast<std::int32_t>(n) + 127) << 23));
    return y * scale;
  }
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
template <class F>
inline void parallel_rows(index_t n, index_t grain, F&& fn) {
  host_pool().parallel_for(n, grain, [&](int, index_t b, index_t e) { fn(b, e); });
}

/// "[2, 3]": extents as text for error messages (std::array has no operator<< that
/// LOOM_CHECK's message builder can find).
template <std::size_t R>
inline std::string str(const extents<R>& e) {
  std::ostringstream os;
  os << e;
  return os.str();
}

/// Throws unless the view is dense row-major; `what` names the argument.
template <class V>
inline void require_contiguous(const V& v, const char* fn, const char* what) {
  LOOM_CHECK(v.is_contiguous(), fn, ": ", what, " must be contiguous (shape ", str(v.shape()), ", strides ",
             str(v.strides()), ")");
}

template <class V, std::size_t R>
inline void require_shape(const V& v, const extents<R>& want, const char* fn, const char* what) {
  LOOM_CHECK(v.shape() == want, fn, ": ", what, " has shape ", str(v.shape()), ", expected ", str(want));
}

template <class V>
inline void require_length(const V& v, index_t n, const char* fn) {
  require_contiguous(v, fn, "argument");
  LOOM_CHECK(v.numel() == n, fn, ": arguments differ in length: ", v.numel(), " vs ", n);
}
template <class... V>
inline void require_same_length(const char* fn, index_t n, const V&... v) {
  (require_length(v, n, fn), ...);
}

}  // namespace detail
}  // namespace loom::ops
