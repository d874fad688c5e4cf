#pragma once
// Overflow detection for mixed-precision training: is any gradient inf or NaN?
//
// Why a bit test instead of std::isfinite: the scan runs over every gradient every step, so
// it must vectorise. A value is non-finite exactly when its exponent bits are all ones, for
// float, half and bfloat16 alike; OR-ing that test over a span has no branch and the
// compiler turns it into SIMD compares.
//
// Why a hook for agreement: with data parallelism (ZeRO, 3D) every rank must take the same
// decision (skip the step or not, halve the scale or not), yet each rank only sees its own
// gradient shard. detect_overflow() scans locally, then asks a `comm::scalar_reducer<bool>`
// for the global answer: `comm::no_reduce` on one rank, `comm::scalar_all_reduce<C>` (any
// rank's flag) over a loom communicator.

#include <loom/comm/communicator.hpp>
#include <loom/core/dtype.hpp>
#include <loom/core/float16.hpp>

#include <concepts>
#include <cstdint>
#include <cstring>
#include <span>
#include <type_traits>

namespace loom::amp {

namespace detail {
template <class T> struct exponent_mask;
template <> struct exponent_mask<float> { using bits = std::uint32_t; static constexpr bits value = 0x7f800000u; };
template <> struct exponent_mask<double> { using bits = std::uint64_t; static constexpr bits value = 0x7ff0000000000000ull; };
template <> struct exponent_mask<half> { using bits = std::uint16_t; static constexpr bits value = 0x7c00u; };
template <> struct exponent_mask<bfloat16> { using bits = std::uint16_t; static constexpr bits value = 0x7f80u; };
}  // namespace detail

/// True when any element of x is +-inf or NaN (this rank only).
template <floating_element T>
inline bool has_nonfinite(std::span<const T> x) noexcept {
  using M = detail::exponent_mask<std::remove_cv_t<T>>;
  using B = typename M::bits;
  static_assert(sizeof(B) == sizeof(T));
  unsigned bad = 0;
  const std::size_t n = x.size();
  const T* p = x.data();
  for (std::size_t i = 0; i < n; ++i) {
    B b;
    std::memcpy(&b, p + i, sizeof(B));
    bad |= static_cast<unsigned>((b & M::value) == M::value);
  }
  return bad != 0;
}

/// Scans this rank's gradients, then returns what all ranks agree on (see the file comment).
template <floating_element T, comm::scalar_reducer<bool> A = comm::no_reduce>
inline bool detect_overflow(std::span<const T> grads, A&& agree = {}) {
  return static_cast<bool>(agree(has_nonfinite(grads)));
}

}  // namespace loom::amp
