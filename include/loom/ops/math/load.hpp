#pragma once
// A stored parameter (float, double, half, bfloat16) converted to the compute type, on the
// host and in CUDA kernels: every kernel computes in float or double while weights may be
// stored in 16 bits, and one function keeps that conversion in one place.

#include <loom/core/config.hpp>
#include <loom/core/dtype.hpp>

#include <type_traits>

namespace loom::ops {

/// A stored parameter converted to the compute type (16-bit types go through float).
template <compute_type T, class P>
LOOM_HOST_DEVICE inline T load(P p) noexcept {
  if constexpr (std::is_same_v<std::remove_cv_t<P>, half> || std::is_same_v<std::remove_cv_t<P>, bfloat16>)
    return static_cast<T>(static_cast<float>(p));
  else
    return static_cast<T>(p);
}

}  // namespace loom::ops
