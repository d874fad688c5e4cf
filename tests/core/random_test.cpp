// Philox-4x32-10 against the published Random123 known-answer vectors, and the properties
// loom relies on: sharded fills equal the unsharded fill, distribution moments.
#include <loom/core/random.hpp>

#include <doctest/doctest.h>

#include <cmath>
#include <vector>

TEST_CASE("philox4x32-10 known-answer vectors (Random123 kat_vectors)") {
  struct kat {
    loom::philox_counter ctr;
    loom::philox_key key;
    loom::philox_counter expect;
  };
  const kat cases[] = {
      {{0, 0, 0, 0}, {0, 0}, {0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}},
      {{0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff}, {0xffffffff, 0xffffffff}, {0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}},
      {{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}, {0xa4093822, 0x299f31d0}, {0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}},
  };
  for (const auto& k : cases) CHECK(loom::philox4x32<10>(k.ctr, k.key) == k.expect);
  static_assert(loom::philox4x32<10>({0, 0, 0, 0}, {0, 0})[0] == 0x6627e8d5u);
}

TEST_CASE("counter_rng: element i depends only on (seed, stream, i)") {
  const loom::counter_rng rng(1234, 7);
  const std::size_t n = 1003;
  std::vector<float> full(n);
  rng.fill_normal(std::span<float>(full), 0, 0.f, 0.02f);
  // Four uneven shards, as ZeRO would own them.
  const std::size_t cuts[] = {0, 250, 251, 777, n};
  for (int s = 0; s < 4; ++s) {
    std::vector<float> shard(cuts[s + 1] - cuts[s]);
    rng.fill_normal(std::span<float>(shard), cuts[s], 0.f, 0.02f);
    for (std::size_t k = 0; k < shard.size(); ++k) REQUIRE(shard[k] == full[cuts[s] + k]);
  }
  // Different streams and seeds differ.
  CHECK(loom::counter_rng(1234, 8).bits(0) != rng.bits(0));
  CHECK(loom::counter_rng(1235, 7).bits(0) != rng.bits(0));
  // bits(i) is lane i%4 of block i/4.
  CHECK(rng.bits(9) == rng.block(2)[1]);
}

TEST_CASE("counter_rng: uniform in [0,1) and normal moments") {
  const loom::counter_rng rng(42);
  const int n = 400000;
  double su = 0, sn = 0, sn2 = 0, sn4 = 0;
  float umin = 1, umax = 0;
  for (int i = 0; i < n; ++i) {
    const float u = rng.uniform(i);
    umin = std::min(umin, u), umax = std::max(umax, u);
    su += u;
    const double z = rng.normal(i);
    sn += z, sn2 += z * z, sn4 += z * z * z * z;
  }
  CHECK(umin >= 0.f);
  CHECK(umax < 1.f);
  CHECK(su / n == doctest::Approx(0.5).epsilon(0.01));
  CHECK(std::fabs(sn / n) < 0.01);
  CHECK(sn2 / n == doctest::Approx(1.0).epsilon(0.01));
  CHECK(sn4 / n == doctest::Approx(3.0).epsilon(0.03));  // kurtosis of a normal
}
