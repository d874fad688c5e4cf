// thread_pool: every index in exactly one part, parts as documented, exceptions reach the
// caller, nested and concurrent calls run serially instead of deadlocking, bad sizes are
// errors naming the value.
#include <loom/core/thread_pool.hpp>

#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

using loom::index_t;

TEST_CASE("parallel_for: every index once, parts [p n / P, (p + 1) n / P) with P = clamp(n / grain, 1, size)") {
  for (int threads = 1; threads <= 5; ++threads) {
    // workers that block at once, and workers that poll before blocking (the default)
    const auto spin = threads % 2 ? std::chrono::microseconds(0) : loom::thread_pool::default_spin;
    loom::thread_pool pool(threads, spin);
    CHECK(pool.size() == threads);
    for (index_t n : {0, 1, 2, 3, 7, 100, 1001})
      for (index_t grain : {1, 3, 50}) {
        std::vector<std::atomic<int>> seen(static_cast<std::size_t>(n));
        const int parts = n > 0 ? pool.parts(n, grain) : 0;
        const int want = n > 0 ? static_cast<int>(std::max<index_t>(1, std::min<index_t>(n / grain, threads))) : 0;
        CHECK(parts == want);
        std::vector<std::atomic<int>> part_calls(static_cast<std::size_t>(threads));
        pool.parallel_for(n, grain, [&](int p, index_t b, index_t e) {
          // the documented range of part p (parts == 1 also when the pool ran serially)
          CHECK(b == n * p / parts);
          CHECK(e == n * (p + 1) / parts);
          ++part_calls[static_cast<std::size_t>(p)];
          for (index_t i = b; i < e; ++i) ++seen[static_cast<std::size_t>(i)];
        });
        for (auto& s : seen) CHECK(s == 1);
        for (int p = 0; p < threads; ++p) CHECK(part_calls[static_cast<std::size_t>(p)] == (p < parts ? 1 : 0));
      }
  }
}

TEST_CASE("parallel_for: the parts really run on different threads, and the caller is one of them") {
  loom::thread_pool pool(3);
  std::vector<std::thread::id> ids(3);
  std::atomic<int> arrived{0};
  pool.parallel_for(3, 1, [&](int p, index_t, index_t) {
    ids[static_cast<std::size_t>(p)] = std::this_thread::get_id();
    ++arrived;
    while (arrived < 3) std::this_thread::yield();  // only finishes if all three run at once
  });
  CHECK(ids[0] == std::this_thread::get_id());
  CHECK(ids[1] != ids[0]);
  CHECK(ids[2] != ids[0]);
  CHECK(ids[1] != ids[2]);
}

TEST_CASE("an exception in a part reaches the caller after all parts ended; the pool stays usable") {
  loom::thread_pool pool(4);
  std::atomic<int> finished{0};
  for (int round = 0; round < 20; ++round) {
    finished = 0;
    try {
      pool.parallel_for(4, 1, [&](int p, index_t, index_t) {
        if (p == round % 4) throw std::runtime_error("part " + std::to_string(p));
        ++finished;
      });
      FAIL("no exception");
    } catch (const std::runtime_error& e) {
      CHECK(std::string(e.what()) == "part " + std::to_string(round % 4));
    }
    CHECK(finished == 3);
  }
  std::atomic<index_t> sum{0};
  pool.parallel_for(100, 1, [&](int, index_t b, index_t e) {
    for (index_t i = b; i < e; ++i) sum += i;
  });
  CHECK(sum == 4950);
}

TEST_CASE("nested calls and concurrent callers run serially instead of deadlocking") {
  loom::thread_pool pool(2);
  std::atomic<index_t> total{0};
  pool.parallel_for(8, 1, [&](int, index_t b, index_t e) {
    for (index_t i = b; i < e; ++i)
      pool.parallel_for(10, 1, [&](int p, index_t bb, index_t ee) {
        CHECK(p == 0);  // inside a part: serial, one part
        total += ee - bb;
      });
  });
  CHECK(total == 80);

  std::atomic<long> sum{0};
  std::vector<std::thread> callers;
  for (int t = 0; t < 6; ++t)
    callers.emplace_back([&] {
      for (int r = 0; r < 200; ++r)
        pool.parallel_for(64, 1, [&](int, index_t b, index_t e) {
          for (index_t i = b; i < e; ++i) sum += i;
        });
    });
  for (auto& c : callers) c.join();
  CHECK(sum == 6L * 200 * (63 * 64 / 2));
}

TEST_CASE("host_pool_scope swaps the pool host_pool() returns, and restores it") {
  loom::thread_pool three(3);
  loom::thread_pool& before = loom::host_pool();
  {
    loom::host_pool_scope scope(three);
    CHECK(&loom::host_pool() == &three);
    loom::thread_pool one(1);
    {
      loom::host_pool_scope inner(one);
      CHECK(&loom::host_pool() == &one);
    }
    CHECK(&loom::host_pool() == &three);
  }
  CHECK(&loom::host_pool() == &before);
}

TEST_CASE("pool sizes: bad thread counts are loom::errors naming the value") {
  CHECK_THROWS_WITH_AS(loom::thread_pool(0), doctest::Contains("threads=0"), loom::error);
  CHECK_THROWS_WITH_AS(loom::thread_pool(65536), doctest::Contains("threads=65536"), loom::error);
  ::setenv("LOOM_NUM_THREADS", "3", 1);
  CHECK(loom::detail::host_pool_threads() == 3);
  ::setenv("LOOM_NUM_THREADS", "two", 1);
  CHECK_THROWS_WITH_AS(loom::detail::host_pool_threads(), doctest::Contains("LOOM_NUM_THREADS='two'"), loom::error);
  ::setenv("LOOM_NUM_THREADS", "0", 1);
  CHECK_THROWS_AS(loom::detail::host_pool_threads(), loom::error);
  ::unsetenv("LOOM_NUM_THREADS");
  ::setenv("OPENBLAS_NUM_THREADS", "2", 1);
  CHECK(loom::detail::host_pool_threads() == 2);
  CHECK_THROWS_WITH_AS(loom::thread_pool(2, std::chrono::microseconds(-1)), doctest::Contains("spin=-1"), loom::error);
  ::unsetenv("LOOM_POOL_SPIN_US");
  CHECK(loom::detail::host_pool_spin() == loom::thread_pool::default_spin);
  ::setenv("LOOM_POOL_SPIN_US", "0", 1);
  CHECK(loom::detail::host_pool_spin() == std::chrono::microseconds(0));
  ::setenv("LOOM_POOL_SPIN_US", "-5", 1);
  CHECK_THROWS_WITH_AS(loom::detail::host_pool_spin(), doctest::Contains("LOOM_POOL_SPIN_US='-5'"), loom::error);
  ::unsetenv("LOOM_POOL_SPIN_US");
}

TEST_CASE("workers that slept (no polling, or a pause longer than the poll) wake up and take parts") {
  for (const auto spin : {std::chrono::microseconds(0), std::chrono::microseconds(50)}) {
    loom::thread_pool pool(3, spin);
    for (int round = 0; round < 30; ++round) {
      if (round % 10 == 0) std::this_thread::sleep_for(std::chrono::milliseconds(2));  // let the workers block
      std::vector<std::atomic<int>> seen(300);
      std::vector<std::thread::id> ids(3);
      std::atomic<int> arrived{0};
      pool.parallel_for(300, 1, [&](int p, index_t b, index_t e) {
        ids[static_cast<std::size_t>(p)] = std::this_thread::get_id();
        for (index_t i = b; i < e; ++i) ++seen[static_cast<std::size_t>(i)];
        // each part waits (10 s at most, no hang) for all three to have started: only the
        // sleeping workers can bring the count to 3
        ++arrived;
        const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
        while (arrived < 3 && std::chrono::steady_clock::now() < until) std::this_thread::yield();
      });
      for (auto& x : seen) CHECK(x == 1);
      CHECK(arrived == 3);
      CHECK(ids[0] == std::this_thread::get_id());
      CHECK(ids[1] != ids[0]);
      CHECK(ids[2] != ids[1]);
      CHECK(ids[2] != ids[0]);
    }
  }
}

TEST_CASE("a part whose worker is late is claimed by the caller: the join does not wait for a sleeper") {
  // Workers block at once (spin 0), so each call has to wake the worker through the kernel
  // (microseconds); the caller finishes its empty part 0 long before and takes part 1 itself.
  // With parts assigned to fixed threads, part 1 would always run on the worker.
  loom::thread_pool pool(2, std::chrono::microseconds(0));
  int on_caller = 0;
  for (int round = 0; round < 50; ++round) {
    std::this_thread::sleep_for(std::chrono::microseconds(200));  // the worker blocks again
    std::thread::id id1;
    std::vector<std::atomic<int>> seen(2);
    pool.parallel_for(2, 1, [&](int p, index_t b, index_t e) {
      if (p == 1) id1 = std::this_thread::get_id();
      for (index_t i = b; i < e; ++i) ++seen[static_cast<std::size_t>(i)];
    });
    for (auto& x : seen) CHECK(x == 1);
    on_caller += id1 == std::this_thread::get_id();
  }
  CHECK(on_caller > 0);
}

TEST_CASE("parallel_for takes a const callable") {
  loom::thread_pool pool(2);
  std::vector<std::atomic<int>> seen(10);
  const auto mark = [&](int, index_t b, index_t e) {
    for (index_t i = b; i < e; ++i) ++seen[static_cast<std::size_t>(i)];
  };
  pool.parallel_for(10, 1, mark);
  for (auto& s : seen) CHECK(s == 1);
}
