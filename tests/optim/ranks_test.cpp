// The multi-rank hook on thread ranks: comm::scalar_all_reduce makes a sharded global norm equal to the
// one-rank norm, and (as a flag) makes every rank see an overflow that only one rank has.
#include <loom/amp/overflow.hpp>
#include <loom/comm/thread_comm.hpp>
#include <loom/optim/clip.hpp>

#include <doctest/doctest.h>

#include <atomic>
#include <cmath>
#include <limits>
#include <vector>

TEST_CASE("scalar_all_reduce: clipping 4 shards on 4 thread ranks equals clipping the whole buffer on one") {
  const std::size_t n = 4000, shard = n / 4;
  std::vector<float> whole(n);
  for (std::size_t i = 0; i < n; ++i) whole[i] = std::sin(0.01f * i) * 3.f;
  std::vector<float> sharded = whole;
  const double norm1 = loom::optim::clip_by_global_norm(std::span<float>(whole), 1.0);
  std::vector<double> norms(4);
  loom::comm::run_ranks(4, [&](loom::comm::thread_comm& c) {
    auto mine = std::span<float>(sharded).subspan(shard * c.rank(), shard);
    norms[c.rank()] = loom::optim::clip_by_global_norm(mine, 1.0, loom::comm::scalar_all_reduce<loom::comm::thread_comm>{&c});
  });
  for (double x : norms) CHECK(x == doctest::Approx(norm1).epsilon(1e-12));
  for (std::size_t i = 0; i < n; ++i) REQUIRE(sharded[i] == doctest::Approx(whole[i]).epsilon(1e-6));
}

TEST_CASE("scalar_all_reduce as a flag: an inf on rank 2 only makes every rank skip") {
  std::atomic<int> saw{0}, local_bad{0};
  loom::comm::run_ranks(4, [&](loom::comm::thread_comm& c) {
    std::vector<float> g(100, 1.f);
    if (c.rank() == 2) g[17] = std::numeric_limits<float>::infinity();
    local_bad += loom::amp::has_nonfinite(std::span<const float>(g));
    saw += loom::amp::detect_overflow(std::span<const float>(g), loom::comm::scalar_all_reduce<loom::comm::thread_comm>{&c});
  });
  CHECK(local_bad == 1);
  CHECK(saw == 4);
}
