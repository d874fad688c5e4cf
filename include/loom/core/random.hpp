#pragma once
// Counter-based random numbers: Philox-4x32-10 (Salmon et al., SC'11).
//
// Why counter-based: element i of a parameter gets the value f(seed, stream, i), computed
// without any sequential state. A rank that owns elements [a, b) of a ZeRO shard initialises
// exactly the values a 1-rank run would have there, so sharded and unsharded runs start
// from identical weights, and a GPU kernel can generate element i in thread i.
//
// Mapping: 64-bit element index i -> Philox block i/4, lane i%4; counter = (block lo, block
// hi, stream lo, stream hi), key = (seed lo, seed hi). uniform(i) is in [0, 1) with 24 bits;
// normal(i) is Box-Muller over lane pairs (0,1) and (2,3) of the same block.

#include <loom/core/config.hpp>
#include <loom/core/dtype.hpp>

#include <array>
#include <cmath>
#include <cstdint>
#include <span>

namespace loom {

using philox_counter = std::array<std::uint32_t, 4>;
using philox_key = std::array<std::uint32_t, 2>;

/// One Philox-4x32 block with R rounds (R = 10 is the standard, Crush-resistant choice).
template <int R = 10>
LOOM_HOST_DEVICE constexpr philox_counter philox4x32(philox_counter c, philox_key k) noexcept {
  constexpr std::uint32_t m0 = 0xD2511F53u, m1 = 0xCD9E8D57u;  // multipliers
  constexpr std::uint32_t w0 = 0x9E3779B9u, w1 = 0xBB67AE85u;  // Weyl key increments
  for (int r = 0; r < R; ++r) {
    if (r > 0) k[0] += w0, k[1] += w1;
    const std::uint64_t p0 = static_cast<std::uint64_t>(m0) * c[0];
    const std::uint64_t p1 = static_cast<std::uint64_t>(m1) * c[2];
    const auto hi0 = static_cast<std::uint32_t>(p0 >> 32), lo0 = static_cast<std::uint32_t>(p0);
    const auto hi1 = static_cast<std::uint32_t>(p1 >> 32), lo1 = static_cast<std::uint32_t>(p1);
    c = {hi1 ^ c[1] ^ k[0], lo1, hi0 ^ c[3] ^ k[1], lo0};
  }
  return c;
}

/// A stateless generator: every draw is a pure function of (seed, stream, index).
class counter_rng {
 public:
  LOOM_HOST_DEVICE constexpr explicit counter_rng(std::uint64_t seed, std::uint64_t stream = 0) noexcept
      : seed_(seed), stream_(stream) {}

  LOOM_HOST_DEVICE constexpr std::uint64_t seed() const noexcept { return seed_; }
  LOOM_HOST_DEVICE constexpr std::uint64_t stream() const noexcept { return stream_; }

  /// The four 32-bit words of block b.
  LOOM_HOST_DEVICE constexpr philox_counter block(std::uint64_t b) const noexcept {
    return philox4x32<10>({static_cast<std::uint32_t>(b), static_cast<std::uint32_t>(b >> 32),
                           static_cast<std::uint32_t>(stream_), static_cast<std::uint32_t>(stream_ >> 32)},
                          {static_cast<std::uint32_t>(seed_), static_cast<std::uint32_t>(seed_ >> 32)});
  }
  /// 32 random bits for element i.
  LOOM_HOST_DEVICE constexpr std::uint32_t bits(std::uint64_t i) const noexcept { return block(i >> 2)[i & 3]; }
  /// Uniform in [0, 1) for element i (24 random bits, exact in float).
  LOOM_HOST_DEVICE constexpr float uniform(std::uint64_t i) const noexcept { return to_unit(bits(i)); }
  /// Standard normal for element i.
  float normal(std::uint64_t i) const noexcept {
    const philox_counter w = block(i >> 2);
    const unsigned lane = static_cast<unsigned>(i & 3);
    const unsigned first = lane & ~1u;
    const double u1 = 1.0 - static_cast<double>(to_unit(w[first]));  // (0, 1]: log is finite
    const double u2 = static_cast<double>(to_unit(w[first + 1]));
    const double r = std::sqrt(-2.0 * std::log(u1));
    const double theta = 6.283185307179586476925 * u2;
    return static_cast<float>((lane & 1u) ? r * std::sin(theta) : r * std::cos(theta));
  }

  /// out[k] = lo + (hi - lo) * uniform(offset + k)
  template <floating_element T>
  void fill_uniform(std::span<T> out, std::uint64_t offset, float lo = 0.f, float hi = 1.f) const {
    for (std::size_t k = 0; k < out.size(); ++k) out[k] = T(lo + (hi - lo) * uniform(offset + k));
  }
  /// out[k] = mean + stddev * normal(offset + k)
  template <floating_element T>
  void fill_normal(std::span<T> out, std::uint64_t offset, float mean = 0.f, float stddev = 1.f) const {
    for (std::size_t k = 0; k < out.size(); ++k) out[k] = T(mean + stddev * normal(offset + k));
  }

 private:
  LOOM_HOST_DEVICE static constexpr float to_unit(std::uint32_t b) noexcept {
    return static_cast<float>(b >> 8) * (1.0f / 16777216.0f);
  }
  std::uint64_t seed_;
  std::uint64_t stream_;
};

}  // namespace loom
