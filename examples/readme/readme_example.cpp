#include <loom/core.hpp>
#include <cstdio>

int main() {
  loom::host_memory_resource rank_mem("rank0");        // counts current and peak bytes
  const std::size_t n = 1 << 20, shard = n / 4, rank = 1;
  loom::buffer<float> mine(shard, rank_mem);            // this rank's ZeRO shard
  loom::counter_rng rng(/*seed=*/42);                    // Philox-4x32-10: value i = f(seed, i)
  rng.fill_normal(mine.span(), /*offset=*/rank * shard, 0.f, 0.02f);  // same values as unsharded
  auto w = mine.view(256, 1024);                         // [rows, cols] view, no copy
  loom::buffer<loom::bfloat16> stored(shard, rank_mem);
  for (std::size_t i = 0; i < shard; ++i) stored[i] = mine[i];  // round to nearest even
  std::printf("w(3,7)=%g, %zu bytes in use\n", w(3, 7), rank_mem.current_bytes());
  LOOM_CHECK(w.extent(0) == 256, "rows=", w.extent(0));  // loom::error names the value
}
