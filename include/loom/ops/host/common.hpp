#pragma once
// Shared pieces of the host kernels: the compute-type concept, loading stored parameters
// (float, double, half, bfloat16) into the compute type, shape checks, and the SIMD pragma.
//
// Why: every kernel in ops/host computes in T = float (training) or double (finite-difference
// gradient checks) while parameters may be stored in 16 bits. One load function keeps that
// conversion in one place. Elementwise loops are written plainly and marked with
// `#pragma omp simd` (honoured through -fopenmp-simd, which loom::blas adds) so reductions
// vectorise without -ffast-math.

#include <loom/core/device.hpp>
#include <loom/core/dtype.hpp>
#include <loom/core/error.hpp>
#include <loom/core/tensor_view.hpp>

#include <concepts>
#include <sstream>
#include <string>
#include <type_traits>

#define LOOM_SIMD _Pragma("omp simd")
#define LOOM_SIMD_SUM(var) _Pragma(LOOM_SIMD_STR(omp simd reduction(+ : var)))
#define LOOM_SIMD_STR(x) #x

namespace loom::ops {

/// Requires: T is a type the host kernels compute in (float, or double for gradient checks).
template <class T>
concept compute_type = std::same_as<T, float> || std::same_as<T, double>;

/// Requires: P is a type parameters may be stored in (float, double, half, bfloat16).
template <class P>
concept param_type = floating_element<P>;

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

namespace detail {

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
  LOOM_CHECK(v.is_contiguous(), fn, ": ", what, " must be contiguous (shape ", str(v.shape()), ", strides ", str(v.strides()), ")");
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
