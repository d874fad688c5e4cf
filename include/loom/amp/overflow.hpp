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
// gradient shard. detect_overflow() scans locally, then asks an `overflow_agreement` — any
// callable bool(bool) — for the global answer. `local_overflow` is the 1-rank identity;
// `comm_overflow<C>` all-reduces with max over any loom communicator.

#include <loom/comm/communicator.hpp>
#include <loom/core/dtype.hpp>
#include <loom/core/float16.hpp>

#include <concepts>
#include <cstdint>
#include <cstring>
#include <span>
#include <type_traits>

namespace loom::amp {

/// Requires: A is callable with this rank's overflow flag and returns the flag all ranks agree on.
template <class A>
concept overflow_agreement = std::invocable<A&, bool> && std::convertible_to<std::invoke_result_t<A&, bool>, bool>;

/// One rank: the local answer is the answer.
struct local_overflow {
  bool operator()(bool local) const noexcept { return local; }
};

/// Any rank overflowed -> every rank sees overflow (all-reduce max of a 0/1 flag).
template <comm::communicator C>
struct comm_overflow {
  C* comm;
  bool operator()(bool local) const {
    float flag = local ? 1.f : 0.f;
    comm->all_reduce(std::span<const float>(&flag, 1), std::span<float>(&flag, 1), comm::reduce_op::max);
    return flag > 0.f;
  }
};

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

/// Scans this rank's gradients, then returns what all ranks agree on (see overflow_agreement).
template <floating_element T, overflow_agreement A = local_overflow>
inline bool detect_overflow(std::span<const T> grads, A&& agree = {}) {
  return static_cast<bool>(agree(has_nonfinite(grads)));
}

}  // namespace loom::amp
