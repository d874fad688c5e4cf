// Memory resources: byte accounting (current, peak, live allocations) against a hand-kept
// ledger, limits, alignment, and concurrent use from several threads.
#include <loom/core/buffer.hpp>
#include <loom/core/memory.hpp>

#include <doctest/doctest.h>

#include <cstdint>
#include <random>
#include <string>
#include <thread>
#include <vector>

TEST_CASE("current and peak bytes follow a random allocation sequence") {
  loom::host_memory_resource r("test");
  std::mt19937 gen(7);
  struct block {
    void* p;
    std::size_t n;
  };
  std::vector<block> live;
  std::size_t current = 0, peak = 0, count = 0;
  for (int step = 0; step < 2000; ++step) {
    if (live.empty() || gen() % 3 != 0) {
      const std::size_t n = 1 + gen() % 5000;
      void* p = r.allocate(n);
      REQUIRE(reinterpret_cast<std::uintptr_t>(p) % loom::default_alignment == 0);
      live.push_back({p, n});
      current += n, ++count;
      peak = std::max(peak, current);
    } else {
      const std::size_t i = gen() % live.size();
      r.deallocate(live[i].p, live[i].n);
      current -= live[i].n;
      live.erase(live.begin() + static_cast<long>(i));
    }
    REQUIRE(r.current_bytes() == current);
    REQUIRE(r.peak_bytes() == peak);
  }
  CHECK(r.stats().allocations == count);
  CHECK(r.stats().live_allocations == live.size());
  for (auto& b : live) r.deallocate(b.p, b.n);
  CHECK(r.current_bytes() == 0);
  CHECK(r.peak_bytes() == peak);
  r.reset_peak();
  CHECK(r.peak_bytes() == 0);
}

TEST_CASE("buffers account through their resource and release on destruction") {
  loom::host_memory_resource r;
  {
    loom::buffer<double> a(100, r);
    CHECK(r.current_bytes() == 800);
    loom::buffer<double> b = std::move(a);
    CHECK(r.current_bytes() == 800);
    CHECK(a.empty());
    loom::buffer<float> c(10, r);
    CHECK(r.current_bytes() == 840);
    c.release();
    CHECK(r.current_bytes() == 800);
  }
  CHECK(r.current_bytes() == 0);
  CHECK(r.peak_bytes() == 840);
}

TEST_CASE("limits and bad arguments throw loom::error naming the value") {
  loom::host_memory_resource r("limited");
  r.set_limit(1000);
  void* p = r.allocate(600);
  try {
    (void)r.allocate(500);
    FAIL("expected loom::error");
  } catch (const loom::error& e) {
    const std::string m = e.what();
    CHECK(m.find("bytes=500") != std::string::npos);
    CHECK(m.find("limited") != std::string::npos);
  }
  CHECK(r.current_bytes() == 600);  // the failed request left no trace
  r.deallocate(p, 600);
  try {
    (void)r.allocate(64, 48);
    FAIL("expected loom::error");
  } catch (const loom::error& e) {
    CHECK(std::string(e.what()).find("alignment=48") != std::string::npos);
  }
  CHECK(r.allocate(0) == nullptr);
  void* big = r.allocate(256, 256);
  CHECK(reinterpret_cast<std::uintptr_t>(big) % 256 == 0);
  r.deallocate(big, 256, 256);
}

TEST_CASE("blocks of 4 MiB and more are 2 MiB-aligned (huge pages), smaller ones as asked; accounting unchanged") {
  REQUIRE(loom::detail::host_hugepages());  // CTest leaves LOOM_HUGEPAGES unset: on
  loom::host_memory_resource r("big");
  const std::size_t mib = std::size_t(1) << 20;
  struct block {
    std::size_t bytes, alignment, want;
  };
  for (const block b : {block{5 * mib, 64, 2 * mib}, block{4 * mib, 64, 2 * mib}, block{4 * mib - 64, 64, 64},
                        block{mib, 256, 256}, block{8 * mib, 4 * mib, 4 * mib}}) {
    CAPTURE(b.bytes);
    CAPTURE(b.alignment);
    CHECK(loom::host_memory_resource::block_alignment(b.bytes, b.alignment) == b.want);
    auto* p = static_cast<unsigned char*>(r.allocate(b.bytes, b.alignment));
    CHECK(reinterpret_cast<std::uintptr_t>(p) % b.want == 0);
    CHECK(r.current_bytes() == b.bytes);
    for (std::size_t i = 0; i < b.bytes; i += 4096) p[i] = static_cast<unsigned char>(i >> 12);  // every page writable
    p[b.bytes - 1] = 7;
    std::size_t bad = 0;
    for (std::size_t i = 0; i < b.bytes - 1; i += 4096) bad += p[i] != static_cast<unsigned char>(i >> 12);
    CHECK(bad == 0);
    r.deallocate(p, b.bytes, b.alignment);  // with the same (bytes, alignment): the same real alignment
    CHECK(r.current_bytes() == 0);
  }
  CHECK(loom::detail::parse_hugepages(nullptr));
  CHECK(loom::detail::parse_hugepages("1"));
  CHECK_FALSE(loom::detail::parse_hugepages("0"));
  CHECK_THROWS_WITH_AS(loom::detail::parse_hugepages("yes"), doctest::Contains("LOOM_HUGEPAGES='yes'"), loom::error);
}

TEST_CASE("accounting is exact under concurrent use") {
  loom::host_memory_resource r;
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t)
    threads.emplace_back([&r, t] {
      for (int i = 0; i < 2000; ++i) {
        loom::buffer<char> b(static_cast<std::size_t>(1 + (i * 7 + t) % 300), r);
        b[0] = 1;
      }
    });
  for (auto& th : threads) th.join();
  CHECK(r.current_bytes() == 0);
  CHECK(r.stats().allocations == 16000);
  CHECK(r.stats().live_allocations == 0);
  CHECK(r.peak_bytes() <= 8 * 300);
}
