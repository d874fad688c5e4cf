// Global-norm clipping and gradient accumulation against closed forms and naive sums.
#include <loom/optim/clip.hpp>
#include <loom/optim/grad_accumulation.hpp>

#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <loom/core/float16.hpp>
#include <vector>

TEST_CASE("clip_by_global_norm: closed form 3-4-5") {
  std::vector<float> a{3.f}, b{4.f};
  double norm = loom::optim::clip_by_global_norm({std::span<float>(a), std::span<float>(b)}, 1.0);
  CHECK(norm == doctest::Approx(5.0));
  CHECK(a[0] == doctest::Approx(3.0 / (5.0 + 1e-6)));
  CHECK(b[0] == doctest::Approx(4.0 / (5.0 + 1e-6)));
  // below the threshold: untouched, bit for bit
  std::vector<float> c{0.3f, 0.4f};
  CHECK(loom::optim::clip_by_global_norm(std::span<float>(c), 1.0) == doctest::Approx(0.5));
  CHECK(c[0] == 0.3f);
  CHECK(c[1] == 0.4f);
  CHECK_THROWS_WITH_AS(loom::optim::clip_by_global_norm(std::span<float>(c), 0.0), doctest::Contains("max_norm=0"), loom::error);
}

TEST_CASE("global norm over shards with a reducer equals the norm of the whole (naive long double)") {
  const std::size_t n = 10007;
  std::vector<float> g(n);
  long double ref = 0;
  for (std::size_t i = 0; i < n; ++i) {
    g[i] = std::cos(0.013f * i) * (1.f + (i % 13));
    ref += static_cast<long double>(g[i]) * g[i];
  }
  const double ref_norm = std::sqrt(static_cast<double>(ref));
  CHECK(loom::optim::global_norm({std::span<const float>(g)}) == doctest::Approx(ref_norm).epsilon(1e-12));
  // three "ranks" own uneven shards; the reducer adds the other ranks' partial sums
  std::span<const float> all(g);
  auto s0 = all.subspan(0, 3000), s1 = all.subspan(3000, 5000), s2 = all.subspan(8000);
  double p1 = loom::optim::sum_of_squares(s1), p2 = loom::optim::sum_of_squares(s2);
  auto reducer = [&](double mine) { return mine + p1 + p2; };
  CHECK(loom::optim::global_norm({s0}, reducer) == doctest::Approx(ref_norm).epsilon(1e-12));
  // clipping a shard scales it by the global coefficient
  std::vector<float> shard(g.begin(), g.begin() + 3000);
  loom::optim::clip_by_global_norm(std::span<float>(shard), 1.0, reducer);
  const float coef = static_cast<float>(1.0 / (ref_norm + 1e-6));
  for (std::size_t i = 0; i < shard.size(); ++i) REQUIRE(shard[i] == doctest::Approx(g[i] * coef).epsilon(1e-6));
}

TEST_CASE("a non-finite norm leaves gradients alone (amp skips that step)") {
  std::vector<float> g{1.f, std::numeric_limits<float>::infinity(), 2.f};
  CHECK(std::isinf(loom::optim::clip_by_global_norm(std::span<float>(g), 1.0)));
  CHECK(g[0] == 1.f);
}

TEST_CASE("accumulating micro-batch gradients with 1/steps gives their mean") {
  loom::optim::grad_accumulation acc(4);
  std::vector<float> sum(5, 0.f);
  std::vector<std::vector<loom::bfloat16>> micro(4, std::vector<loom::bfloat16>(5));
  for (int m = 0; m < 4; ++m)
    for (int i = 0; i < 5; ++i) micro[m][i] = loom::bfloat16(float(m * 5 + i) * 0.25f);
  int boundaries = 0;
  for (int m = 0; m < 4; ++m) {
    CHECK(acc.micro_step() == m);
    loom::optim::accumulate(std::span<float>(sum), std::span<const loom::bfloat16>(micro[m]), acc.loss_scale());
    boundaries += acc.is_boundary();
    acc.advance();
  }
  CHECK(boundaries == 1);
  CHECK(acc.is_first());
  for (int i = 0; i < 5; ++i) {
    double mean = 0;
    for (int m = 0; m < 4; ++m) mean += static_cast<float>(micro[m][i]) / 4.0;
    CHECK(sum[i] == doctest::Approx(mean));
  }
  CHECK_THROWS_WITH_AS(loom::optim::grad_accumulation(0), doctest::Contains("gradient_accumulation_steps=0"), loom::error);
}
