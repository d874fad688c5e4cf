#pragma once
// 16-bit floating-point storage types usable on the host (and in CUDA kernels).
//
// Why our own: host code must not include cuda_fp16.h, yet ZeRO shards, checkpoints and the
// CPU backend store parameters as IEEE half and bfloat16. Both types are a uint16_t with
// conversions; arithmetic happens in float (they convert implicitly), as in mixed-precision
// training. Conversion from float rounds to nearest, ties to even, with NaN kept NaN (quiet),
// infinities kept, overflow to infinity and subnormals rounded exactly. The conversions are
// pure integer arithmetic so they do not depend on the floating-point environment.

#include <loom/core/config.hpp>

#include <cstdint>

namespace loom {
namespace detail {

LOOM_HOST_DEVICE constexpr std::uint32_t float_bits(float f) noexcept { return __builtin_bit_cast(std::uint32_t, f); }
LOOM_HOST_DEVICE constexpr float bits_float(std::uint32_t u) noexcept { return __builtin_bit_cast(float, u); }

/// float -> IEEE binary16 bits, round to nearest even.
LOOM_HOST_DEVICE constexpr std::uint16_t float_to_half_bits(float f) noexcept {
  const std::uint32_t x = float_bits(f);
  const std::uint32_t sign = (x >> 16) & 0x8000u;
  const std::uint32_t mag = x & 0x7fffffffu;
  if (mag > 0x7f800000u)  // NaN: quiet it, keep the top payload bits
    return static_cast<std::uint16_t>(sign | 0x7e00u | ((mag >> 13) & 0x3ffu));
  if (mag >= 0x477ff000u)  // >= 65520 (midpoint of 65504 and 2^16) or inf -> inf
    return static_cast<std::uint16_t>(sign | 0x7c00u);
  if (mag >= 0x38800000u) {  // normal half: rebias the exponent (127 -> 15), round 13 bits
    const std::uint32_t odd = (mag >> 13) & 1u;
    const std::uint32_t rounded = mag - (112u << 23) + 0xfffu + odd;
    return static_cast<std::uint16_t>(sign | (rounded >> 13));
  }
  // Subnormal half (or zero): value = m * 2^(e-150); in units of 2^-24 that is m >> (126 - e).
  const std::uint32_t e = mag >> 23;
  const std::uint32_t shift = 126u - e;  // >= 14 here
  if (e == 0 || shift > 24u) return static_cast<std::uint16_t>(sign);
  const std::uint32_t m = (mag & 0x7fffffu) | 0x800000u;
  std::uint32_t r = m >> shift;
  const std::uint32_t rem = m & ((1u << shift) - 1u);
  const std::uint32_t halfway = 1u << (shift - 1u);
  if (rem > halfway || (rem == halfway && (r & 1u))) ++r;  // may carry into the smallest normal
  return static_cast<std::uint16_t>(sign | r);
}

/// IEEE binary16 bits -> float (exact).
LOOM_HOST_DEVICE constexpr float half_bits_to_float(std::uint16_t h) noexcept {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t exp = (h >> 10) & 0x1fu;
  const std::uint32_t mant = h & 0x3ffu;
  if (exp == 0x1fu) return bits_float(sign | 0x7f800000u | (mant << 13));
  if (exp == 0) {
    const float v = static_cast<float>(mant) * 5.9604644775390625e-8f;  // mant * 2^-24, exact
    return (sign != 0u) ? -v : v;
  }
  return bits_float(sign | ((exp + 112u) << 23) | (mant << 13));
}

/// float -> bfloat16 bits, round to nearest even; NaN stays a (quiet) NaN.
LOOM_HOST_DEVICE constexpr std::uint16_t float_to_bfloat16_bits(float f) noexcept {
  const std::uint32_t x = float_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((x >> 16) | 0x0040u);
  const std::uint32_t odd = (x >> 16) & 1u;
  return static_cast<std::uint16_t>((x + 0x7fffu + odd) >> 16);
}

LOOM_HOST_DEVICE constexpr float bfloat16_bits_to_float(std::uint16_t b) noexcept {
  return bits_float(static_cast<std::uint32_t>(b) << 16);
}

}  // namespace detail

/// IEEE 754 binary16 (1 sign, 5 exponent, 10 mantissa bits). Converts implicitly to and from float.
struct half {
  std::uint16_t bits = 0;

  half() = default;
  LOOM_HOST_DEVICE constexpr half(float f) noexcept : bits(detail::float_to_half_bits(f)) {}  // NOLINT: implicit by design
  LOOM_HOST_DEVICE constexpr operator float() const noexcept { return detail::half_bits_to_float(bits); }
  LOOM_HOST_DEVICE static constexpr half from_bits(std::uint16_t b) noexcept {
    half h;
    h.bits = b;
    return h;
  }
};

/// bfloat16 (1 sign, 8 exponent, 7 mantissa bits): the top half of a float.
struct bfloat16 {
  std::uint16_t bits = 0;

  bfloat16() = default;
  LOOM_HOST_DEVICE constexpr bfloat16(float f) noexcept : bits(detail::float_to_bfloat16_bits(f)) {}  // NOLINT
  LOOM_HOST_DEVICE constexpr operator float() const noexcept { return detail::bfloat16_bits_to_float(bits); }
  LOOM_HOST_DEVICE static constexpr bfloat16 from_bits(std::uint16_t b) noexcept {
    bfloat16 h;
    h.bits = b;
    return h;
  }
};

static_assert(sizeof(half) == 2 && alignof(half) == 2);
static_assert(sizeof(bfloat16) == 2 && alignof(bfloat16) == 2);

}  // namespace loom
