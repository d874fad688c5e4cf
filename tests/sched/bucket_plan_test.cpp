#include <loom/sched/bucket_plan.hpp>
#include <loom/sched/layer_layout.hpp>

#include <doctest/doctest.h>

#include <vector>

using namespace loom::sched;

TEST_CASE("plan_buckets: greedy, order-preserving, oversize items alone") {
  const std::vector<std::size_t> sizes{30, 30, 50, 200, 10, 10};
  const bucket_plan p = plan_buckets(sizes, 100);
  // hand-computed: {30,30} (next 50 would make 110), {50}, {200} alone, {10,10}
  REQUIRE(p.buckets.size() == 4);
  CHECK(p.buckets[0].first == 0); CHECK(p.buckets[0].last == 2); CHECK(p.buckets[0].numel == 60);
  CHECK(p.buckets[1].first == 2); CHECK(p.buckets[1].last == 3); CHECK(p.buckets[1].offset == 60);
  CHECK(p.buckets[2].numel == 200); CHECK(p.buckets[2].offset == 110);
  CHECK(p.buckets[3].first == 4); CHECK(p.buckets[3].last == 6); CHECK(p.buckets[3].numel == 20);
  CHECK(p.max_bucket_numel == 200);
  CHECK(p.total_numel == 330);
  const std::vector<std::size_t> expect_of{0, 0, 1, 2, 3, 3};
  CHECK(p.bucket_of == expect_of);
}

TEST_CASE("plan_buckets: every item in exactly one bucket, buckets tile the order") {
  std::vector<std::size_t> sizes;
  for (std::size_t i = 0; i < 37; ++i) sizes.push_back(1 + (i * 7919) % 53);
  for (std::size_t cap : {1, 5, 53, 64, 100, 10000}) {
    const bucket_plan p = plan_buckets(sizes, cap);
    std::size_t next = 0, off = 0;
    for (const bucket& b : p.buckets) {
      CHECK(b.first == next);
      CHECK(b.offset == off);
      std::size_t n = 0;
      for (std::size_t i = b.first; i < b.last; ++i) n += sizes[i];
      CHECK(b.numel == n);
      CHECK((b.items() == 1 || b.numel <= cap));
      next = b.last;
      off += b.numel;
    }
    CHECK(next == sizes.size());
  }
}

TEST_CASE("plan_buckets: zero capacity is an error naming it") {
  const std::vector<std::size_t> sizes{1};
  CHECK_THROWS_WITH_AS(plan_buckets(sizes, 0), doctest::Contains("capacity=0"), loom::error);
}

TEST_CASE("layer_layout: padding to the world size, shard offsets, layers") {
  const std::vector<std::size_t> numel{10, 3, 8, 1};
  const std::vector<std::size_t> layer{0, 0, 1, 2};
  const layer_layout lay(numel, layer, 4);
  CHECK(lay.padded_numel(0) == 12); CHECK(lay.padded_numel(1) == 4);
  CHECK(lay.padded_numel(2) == 8); CHECK(lay.padded_numel(3) == 4);
  CHECK(lay.offset(2) == 16); CHECK(lay.shard_offset(2) == 4); CHECK(lay.shard_numel(0) == 3);
  CHECK(lay.padded_total() == 28); CHECK(lay.shard_total() == 7); CHECK(lay.total_numel() == 22);
  CHECK(lay.layers() == 3);
  CHECK(lay.layer_begin(0) == 0); CHECK(lay.layer_end(0) == 2);
  CHECK(lay.layer_offset(1) == 16); CHECK(lay.layer_padded_numel(0) == 16);
  const std::vector<std::size_t> bad_layer{0, 2, 2, 3};
  CHECK_THROWS_WITH_AS(layer_layout(numel, bad_layer, 4), doctest::Contains("layer_of=2"), loom::error);
  CHECK_THROWS_WITH_AS(layer_layout(numel, layer, 0), doctest::Contains("world=0"), loom::error);
}
