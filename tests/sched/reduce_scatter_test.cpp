// Reduce-scatter scheduler on thread ranks: every mode (all_reduce, reduce_scatter with and
// without contiguous gradients, overlap on/off) against the naive sum of all ranks'
// gradients; buckets launch as soon as their last layer's backward is done.
#include <loom/sched/reduce_scatter_scheduler.hpp>

#include <loom/comm/thread_comm.hpp>

#include <doctest/doctest.h>

#include <vector>

using namespace loom::sched;

namespace {
// gradient of rank r, parameter p, element i (padding stays zero)
float grad_value(std::size_t r, std::size_t p, std::size_t i) { return float((r + 1) * 0.5 + p * 0.25 + i * 0.125); }
}  // namespace

TEST_CASE("reduce_scatter scheduler: sums match the naive reduction in every mode") {
  const std::vector<std::size_t> numel{40, 6, 50, 9, 12, 30, 3};
  const std::vector<std::size_t> layer_of{0, 0, 1, 1, 2, 3, 3};
  for (int world : {1, 2, 4})
    for (reduce_mode mode : {reduce_mode::all_reduce, reduce_mode::reduce_scatter})
      for (bool contiguous : {true, false})
        for (bool overlap : {true, false})
          for (std::size_t bucket_numel : {1, 60, 1000}) {
            const layer_layout lay(numel, layer_of, static_cast<std::size_t>(world));
            // naive oracle: full reduced gradient
            std::vector<float> sum(lay.padded_total(), 0.f);
            for (std::size_t r = 0; r < std::size_t(world); ++r)
              for (std::size_t p = 0; p < lay.params(); ++p)
                for (std::size_t i = 0; i < numel[p]; ++i) sum[lay.offset(p) + i] += grad_value(r, p, i);
            loom::comm::run_ranks(world, [&](loom::comm::thread_comm& c) {
              const std::size_t r = static_cast<std::size_t>(c.rank());
              loom::host_memory_resource scratch("scratch");
              std::vector<float> full(mode == reduce_mode::all_reduce ? lay.padded_total() : 0);
              std::vector<float> shard(mode == reduce_mode::reduce_scatter ? lay.shard_total() : 0);
              reduce_options o{bucket_numel, overlap, contiguous, mode};
              reduce_scatter_scheduler<float, loom::comm::thread_comm> s(c, lay, o, scratch, full, shard);
              for (int iter = 0; iter < 2; ++iter) {
                for (std::size_t l = lay.layers(); l-- > 0;) {
                  std::span<float> g = s.layer_gradients(l);
                  REQUIRE(g.size() == lay.layer_padded_numel(l));
                  for (std::size_t p = lay.layer_begin(l); p < lay.layer_end(l); ++p)
                    for (std::size_t i = 0; i < numel[p]; ++i)
                      g[lay.offset(p) - lay.layer_offset(l) + i] = grad_value(r, p, i);
                  s.layer_done(l);
                }
                s.finish();
                bool ok = true;
                if (mode == reduce_mode::all_reduce) {
                  for (std::size_t i = 0; i < full.size(); ++i) ok = ok && full[i] == sum[i];
                } else {
                  for (std::size_t p = 0; p < lay.params(); ++p)
                    for (std::size_t i = 0; i < lay.shard_numel(p); ++i)
                      ok = ok && shard[lay.shard_offset(p) + i] == sum[lay.offset(p) + r * lay.shard_numel(p) + i];
                }
                INFO("world=", world, " mode=", int(mode), " contiguous=", contiguous, " overlap=", overlap, " bucket=", bucket_numel, " iter=", iter);
                CHECK(ok);
                // buckets launched in backward order, each right after its lowest layer
                const auto& ev = s.events();
                REQUIRE(ev.size() == s.plan().buckets.size());
                for (std::size_t b = 0; b < ev.size(); ++b) {
                  CHECK(ev[b].bucket == b);
                  CHECK(ev[b].after_layer == lay.layers() - s.plan().buckets[b].last);
                }
                if (mode == reduce_mode::all_reduce) std::fill(full.begin(), full.end(), 0.f);
              }
            });
          }
}

TEST_CASE("reduce_scatter scheduler: bucket sizes follow reduce_bucket_size over layers") {
  const std::vector<std::size_t> numel{40, 6, 50, 9, 12, 30, 3};
  const std::vector<std::size_t> layer_of{0, 0, 1, 1, 2, 3, 3};
  loom::comm::run_ranks(2, [&](loom::comm::thread_comm& c) {
    const layer_layout lay(numel, layer_of, 2);  // padded layers: 46, 60, 12, 34
    loom::host_memory_resource scratch("scratch");
    std::vector<float> shard(lay.shard_total());
    reduce_scatter_scheduler<float, loom::comm::thread_comm> s(c, lay, {64, true, true, reduce_mode::reduce_scatter}, scratch,
                                                              {}, shard);
    // backward order 34, 12, 60, 46 -> {34, 12}, {60}, {46}
    REQUIRE(s.plan().buckets.size() == 3);
    CHECK(s.plan().buckets[0].numel == 46);
    CHECK(s.plan().buckets[1].numel == 60);
    CHECK(s.plan().buckets[2].numel == 46);
    // two staging + two packing buffers of the largest bucket
    CHECK(scratch.current_bytes() == 4 * 60 * sizeof(float));
  });
}
