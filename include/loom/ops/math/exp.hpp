#pragma once
// e^x as the kernels of both backends compute it.
//
// Why one polynomial on host and device: the host needs an exp that vectorises without
// -ffast-math (libm's expf is a call, which stops the loop from vectorising), and the GPU runs
// the same operations, so the host kernels and their tests check the arithmetic the CUDA
// kernels do (only FMA contraction, which nvcc applies, can round differently). For float: a
// Cephes-style range reduction and a degree-6 polynomial, within 2 ulp of expf on [-87, 88];
// clamped there, so very negative x gives ~1e-38, not 0. For double: the library's exp
// (finite-difference checks want it exact).

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
    const auto bits = static_cast<std::int32_t>((static_cast<std::int32_t>(n) + 127) << 23);
#if defined(__CUDA_ARCH__)
    return y * __int_as_float(bits);
#else
    return y * std::bit_cast<float>(bits);
#endif
  }
}

}  // namespace loom::ops
