// loom-demo: what the README's first command ends in. For now it exercises the core on one
// machine and says what it did; it grows into train -> checkpoint -> serve as loom does.
#include <loom/core.hpp>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <deque>
#include <string>
#include <vector>

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      std::printf("usage: loom-demo\n  Runs loom's demo on this machine and prints what it did.\n");
      return 0;
    }
    std::fprintf(stderr, "loom-demo: unknown argument '%s'\nusage: loom-demo [--help]\n", argv[i]);
    return 2;
  }
  try {
    std::printf("loom %d.%d.%d demo\n", LOOM_VERSION_MAJOR, LOOM_VERSION_MINOR, LOOM_VERSION_PATCH);

    // 1. A parameter initialised with the counter-based RNG, once whole and once in 4 shards.
    const std::size_t n = 1 << 20;
    const int ranks = 4;
    loom::counter_rng rng(2024);
    std::deque<loom::host_memory_resource> mem;  // one resource per rank: per-rank byte accounting
    for (int r = 0; r < ranks; ++r) mem.emplace_back("rank" + std::to_string(r));
    loom::host_memory_resource whole_mem("unsharded");
    loom::buffer<float> whole(n, whole_mem);
    auto t0 = std::chrono::steady_clock::now();
    rng.fill_normal(whole.span(), 0, 0.f, 0.02f);
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::size_t mismatches = 0;
    const std::size_t shard = (n + ranks - 1) / ranks;
    for (int r = 0; r < ranks; ++r) {
      loom::buffer<float> part(shard, mem[r]);
      rng.fill_normal(part.span(), r * shard, 0.f, 0.02f);
      for (std::size_t k = 0; k < shard && r * shard + k < n; ++k) mismatches += part[k] != whole[r * shard + k];
      std::printf("  rank %d owns elements [%zu, %zu): %zu bytes (peak %zu)\n", r, r * shard, (r + 1) * shard,
                  mem[r].current_bytes(), mem[r].peak_bytes());
    }
    std::printf("initialised %zu parameters with Philox-4x32-10 in %.1f ms (%.0f M/s); sharded init mismatches: %zu\n",
                n, secs * 1e3, n / secs / 1e6, mismatches);

    // 2. Storage in 16-bit types.
    loom::buffer<loom::bfloat16> b16(n);
    loom::buffer<loom::half> f16(n);
    double err_b = 0, err_h = 0;
    for (std::size_t i = 0; i < n; ++i) {
      b16[i] = whole[i], f16[i] = whole[i];
      err_b = std::max(err_b, std::abs(double(b16[i]) - whole[i]) / std::max(1e-6, std::abs(double(whole[i]))));
      if (std::abs(whole[i]) >= 6.2e-5f)  // half's normal range; below it precision is absolute
        err_h = std::max(err_h, std::abs(double(f16[i]) - whole[i]) / std::max(1e-6, std::abs(double(whole[i]))));
    }
    std::printf("stored as bfloat16 / float16: max relative error %.2e / %.2e (bounds 2^-8 / 2^-11 for normals)\n",
                err_b, err_h);

    // 3. Views: a [layers, rows, cols] flat buffer sliced per layer as ZeRO does.
    auto w = whole.view(16, 256, 256);  // [layers, rows, cols]
    auto layer3 = w[3].slice(0, 0, 128);
    std::printf("view: layer 3, rows [0,128): shape [%lld, %lld], contiguous=%s\n",
                static_cast<long long>(layer3.extent(0)), static_cast<long long>(layer3.extent(1)),
                layer3.is_contiguous() ? "yes" : "no");

    // 4. Bad input is an error with a message, not a crash.
    try {
      (void)w.slice(0, 0, 17);
    } catch (const loom::error& e) {
      std::printf("bad slice refused: %s\n", e.what());
    }
    return mismatches == 0 ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "loom-demo: %s\n", e.what());
    return 1;
  }
}
