#pragma once
// e^x as the kernels of both backends compute it.
//
// Why one polynomial on host and device: the host needs an exp that vectorises without
// -ffast-math (libm's expf is a call, which stops the loop from vectorising), and the GPU runs
// the same operations, so the host kernels and their tests check the arithmetic the CUDA
// kernels do (only FMA contraction, which nvcc applies, can round differently). For float: a
// Cephes-style range reduction and a degree-6 polynomial, within 2 ulp of expf on [-87, 88];
// x is clamped to [-87, 88.5], so very negative x gives ~1e-38, not 0, x from ~88.38 gives
// +inf (expf overflows above 88.72), and NaN gives NaN. For double: the library's exp
// (finite-difference checks want it exact).
//
// Why the clamp is an integer min on x's bits and not `x < lo ? lo : x`: with a float
// compare, GCC's partial redundancy elimination folds the whole polynomial to a constant on
// the clamped path, so the loop body becomes a branch around the polynomial; if-converting
// that back would execute float operations the source guards, which -ftrapping-math (GCC's
// default) forbids, and every loop calling exp stayed scalar. An integer min has no path to
// fold. As int32, a negative float's bits grow with its magnitude and a positive one's too, so
// min(bits, bits(-87)) clamps the negative side and min(bits, bits(88.5)) the positive one;
// NaN's bits are left alone.

#include <loom/core/config.hpp>

#include <bit>
#include <cmath>
#include <cstdint>
#include <type_traits>

namespace loom::ops {

template <class T>
LOOM_HOST_DEVICE LOOM_FORCE_INLINE T exp(T x) noexcept {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>, "ops::exp: float or double");
  if constexpr (std::is_same_v<T, double>) {
    return std::exp(x);
  } else {
#if defined(__CUDA_ARCH__)
    const std::int32_t xi = __float_as_int(x);
#else
    const auto xi = std::bit_cast<std::int32_t>(x);
#endif
    constexpr auto lo_bits = static_cast<std::int32_t>(0xC2AE0000u), hi_bits = static_cast<std::int32_t>(0x42B10000u);
#if !defined(__CUDA_ARCH__)
    static_assert(std::bit_cast<float>(lo_bits) == -87.0f && std::bit_cast<float>(hi_bits) == 88.5f);
#endif
    const bool nan = (xi & 0x7fffffff) > 0x7f800000;  // left as it is, so NaN in gives NaN out
    const std::int32_t lim = nan ? 0x7fffffff : (xi < 0 ? lo_bits : hi_bits);
    const std::int32_t ci = xi < lim ? xi : lim;
#if defined(__CUDA_ARCH__)
    const float xc = __int_as_float(ci);
#else
    const float xc = std::bit_cast<float>(ci);
#endif
    constexpr float round_magic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
    const float n = (xc * 1.44269504088896341f + round_magic) - round_magic;
    const float r = (xc - n * 0.693359375f) + n * 2.12194440e-4f;  // x - n ln2, ln2 split in two
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const float y = p * r * r + r + 1.0f;
    const auto bits = static_cast<std::int32_t>((static_cast<std::int32_t>(n) + 127) << 23);
#if defined(__CUDA_ARCH__)
    return y * __int_as_float(bits);
#else
    return y * std::bit_cast<float>(bits);
#endif
  }
}

}  // namespace loom::ops
