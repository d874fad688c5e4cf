#include <loom/amp/master_weights.hpp>

#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <vector>

TEST_CASE("master weights widen exactly, write back rounded, and unscale gradients") {
  const std::size_t n = 257;
  std::vector<loom::bfloat16> model(n);
  for (std::size_t i = 0; i < n; ++i) model[i] = loom::bfloat16(std::sin(0.1f * i) * 3.f);
  loom::host_memory_resource mem("master");
  loom::amp::master_weights<loom::bfloat16> m(std::span<const loom::bfloat16>(model), mem);
  CHECK(mem.current_bytes() >= n * sizeof(float));
  for (std::size_t i = 0; i < n; ++i) REQUIRE(m.span()[i] == static_cast<float>(model[i]));

  // an update below bfloat16's resolution survives in the master copy
  for (auto& w : m.span()) w += 1e-4f;
  std::vector<loom::bfloat16> back(n);
  m.copy_to(std::span<loom::bfloat16>(back));
  for (std::size_t i = 0; i < n; ++i) {
    // oracle: round-to-nearest-even of the float value, by bit manipulation
    std::uint32_t u;
    float f = m.span()[i];
    std::memcpy(&u, &f, 4);
    std::uint16_t expect = static_cast<std::uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    REQUIRE(back[i].bits == expect);
  }
  CHECK(m.span()[5] != static_cast<float>(back[5]));

  std::vector<loom::half> g(n);
  for (std::size_t i = 0; i < n; ++i) g[i] = loom::half(float(i) * 64.f);
  std::vector<float> mg(n);
  loom::amp::unscale_to_master(std::span<const loom::half>(g), std::span<float>(mg), 1.f / 1024.f);
  for (std::size_t i = 0; i < n; ++i) REQUIRE(mg[i] == doctest::Approx(float(i) / 16.f).epsilon(1e-3));
  std::vector<float> wrong(n - 1);
  CHECK_THROWS_WITH_AS(loom::amp::unscale_to_master(std::span<const loom::half>(g), std::span<float>(wrong), 1.f),
                       doctest::Contains("master_grads.size()=256"), loom::error);
}
