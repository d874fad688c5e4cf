#pragma once
// RoPE's per-pair math, for the host and the CUDA kernels: which two channels of a head form
// pair i in each convention, and the rotation of a pair by an angle given as (cos, sin).
//
//   interleaved (Meta's llama, llama2.c): pair i is channels (2i, 2i + 1)
//   half_split  (Hugging Face):           pair i is channels (i, i + rotary_dim / 2)
//   (a, b) -> (a cos - b sin, a sin + b cos); sin negated rotates back (backward)
//
// Partial rotary: pairs are taken within the first rotary_dim channels of the head; the
// others are not touched by either backend.

#include <loom/core/config.hpp>

#include <cstdint>

namespace loom::ops {

enum class rope_style { interleaved, half_split };

namespace math {

/// Channel offsets (within a head) of rotation pair i; half = rotary_dim / 2.
struct rope_pair {
  std::int64_t lo, hi;
};
LOOM_HOST_DEVICE LOOM_FORCE_INLINE rope_pair rope_pair_of(rope_style style, std::int64_t i, std::int64_t half) noexcept {
  return style == rope_style::interleaved ? rope_pair{2 * i, 2 * i + 1} : rope_pair{i, i + half};
}

/// Rotates (a, b) in place by the angle whose cosine is c and sine is s.
template <class T>
LOOM_HOST_DEVICE LOOM_FORCE_INLINE void rope_rotate(T& a, T& b, T c, T s) noexcept {
  const T a0 = a, b0 = b;
  a = a0 * c - b0 * s;
  b = a0 * s + b0 * c;
}

}  // namespace math
}  // namespace loom::ops
