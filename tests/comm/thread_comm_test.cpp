// thread_comm and run_ranks: the collective matrix on 1..8 thread ranks against the naive
// reference of collective_suite.hpp; split; point-to-point matching; async overlap; and the
// no-hang guarantees (a throwing rank, a returning rank, mismatched calls, timeouts); and
// any_comm over thread ranks (the same matrix, split, a throwing rank).
#include "collective_suite.hpp"

#include <loom/comm/any_comm.hpp>
#include <loom/comm/thread_comm.hpp>

#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <string>
#include <vector>

using loom::comm::reduce_op;
using loom::comm::run_ranks;
using loom::comm::thread_comm;

namespace {

// Runs the suite on n ranks and reports every rank's failures from the test thread.
void suite_on(int n, bool big) {
  std::vector<loom_test::failures> f(static_cast<std::size_t>(n));
  run_ranks(n, [&](thread_comm& c) { f[static_cast<std::size_t>(c.rank())] = loom_test::run_suite(c, big); });
  for (int r = 0; r < n; ++r) CHECK_MESSAGE(f[static_cast<std::size_t>(r)].list.empty(), loom_test::join(f[static_cast<std::size_t>(r)]));
}

bool contains(const std::string& s, const std::string& what) { return s.find(what) != std::string::npos; }

}  // namespace

TEST_CASE("thread_comm: every op x type x size on 1..8 ranks matches the naive reference") {
  for (int n = 1; n <= 8; ++n) {
    CAPTURE(n);
    suite_on(n, n == 3 || n == 8);  // the 2^20+3 matrix on an odd and the largest group
  }
}

TEST_CASE("thread_comm: a default-constructed communicator is one rank") {
  thread_comm c;
  CHECK(c.rank() == 0);
  CHECK(c.size() == 1);
  auto f = loom_test::run_suite(c, false);
  CHECK_MESSAGE(f.list.empty(), loom_test::join(f));
}

TEST_CASE("thread_comm: split groups by color, orders by key, and the groups work independently") {
  constexpr int n = 6;
  std::vector<int> ranks(n), sizes(n), sums(n);
  run_ranks(n, [&](thread_comm& c) {
    const int color = c.rank() % 2;
    const int key = -c.rank();  // reverse order inside each group
    thread_comm sub = c.split(color, key);
    const auto r = static_cast<std::size_t>(c.rank());
    ranks[r] = sub.rank();
    sizes[r] = sub.size();
    int v = c.rank();
    sub.all_reduce(std::span<int>(&v, 1));
    sums[r] = v;
  });
  // naive: color 0 = {0,2,4}, color 1 = {1,3,5}; key -rank -> the highest world rank is rank 0
  for (int w = 0; w < n; ++w) {
    CAPTURE(w);
    CHECK(sizes[static_cast<std::size_t>(w)] == 3);
    CHECK(ranks[static_cast<std::size_t>(w)] == (n - 1 - w) / 2);
    CHECK(sums[static_cast<std::size_t>(w)] == (w % 2 == 0 ? 0 + 2 + 4 : 1 + 3 + 5));
  }
}

TEST_CASE("thread_comm: recv matches by source and tag in send order; buffered sends cannot deadlock") {
  run_ranks(3, [](thread_comm& c) {
    if (c.rank() == 0) {
      for (int k = 0; k < 5; ++k) {
        const float v = static_cast<float>(k);
        c.send(std::span<const float>(&v, 1), 2, k % 2);
      }
    } else if (c.rank() == 1) {
      const double d = 42.0;
      c.send(std::span<const double>(&d, 1), 2, 0);
    } else {
      double d = 0;
      c.recv(std::span<double>(&d, 1), 1, 0);
      CHECK(d == 42.0);
      std::vector<float> odd(2), even(3);
      for (auto& x : odd) c.recv(std::span<float>(&x, 1), 0, 1);
      for (auto& x : even) c.recv(std::span<float>(&x, 1), 0, 0);
      CHECK(odd == std::vector<float>{1, 3});
      CHECK(even == std::vector<float>{0, 2, 4});
    }
    // both ranks of a pair send before receiving
    if (c.rank() < 2) {
      std::vector<int> mine(100, c.rank()), theirs(100, -1);
      c.send(std::span<const int>(mine), 1 - c.rank(), 7);
      c.recv(std::span<int>(theirs), 1 - c.rank(), 7);
      CHECK(theirs == std::vector<int>(100, 1 - c.rank()));
    }
  });
}

TEST_CASE("thread_comm: a recv whose count differs from the send throws on both sides") {
  std::atomic<int> errors{0};
  run_ranks(2, [&](thread_comm& c) {
    std::vector<float> buf(c.rank() == 0 ? 4 : 5);
    try {
      if (c.rank() == 0) {
        c.barrier();  // the recv is posted first
        c.send(std::span<const float>(buf), 1, 0);
      } else {
        auto w = c.recv_async(std::span<float>(buf), 0, 0);
        c.barrier();
        w.wait();
      }
    } catch (const loom::error& e) {
      CHECK(contains(e.what(), "sent count=4"));
      CHECK(contains(e.what(), "recv count=5"));
      ++errors;
    }
  });
  CHECK(errors == 2);
}

TEST_CASE("thread_comm: async work is not done until every rank joined, and overlaps the caller") {
  std::atomic<bool> tested{false};
  run_ranks(2, [&](thread_comm& c) {
    std::vector<float> v(1000, static_cast<float>(c.rank() + 1));
    if (c.rank() == 0) {
      auto w = c.all_reduce_async(std::span<const float>(v), std::span<float>(v));
      CHECK_FALSE(w.test());  // rank 1 has not called yet
      tested = true;
      w.wait();
      CHECK(w.done());
    } else {
      while (!tested) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      c.all_reduce(std::span<float>(v));
    }
    CHECK(v[999] == 3.0f);
  });
}

TEST_CASE("thread_comm: several async collectives in flight complete in issue order") {
  run_ranks(4, [](thread_comm& c) {
    std::vector<std::vector<int>> bufs(8, std::vector<int>(33));
    std::vector<loom::comm::work> ws;
    for (std::size_t k = 0; k < bufs.size(); ++k) {
      for (auto& x : bufs[k]) x = c.rank() * static_cast<int>(k);
      ws.push_back(c.all_reduce_async(std::span<const int>(bufs[k]), std::span<int>(bufs[k])));
    }
    for (auto& w : ws) w.wait();
    for (std::size_t k = 0; k < bufs.size(); ++k) CHECK(bufs[k][32] == 6 * static_cast<int>(k));
  });
}

TEST_CASE("any_comm over thread ranks: the collective matrix, split groups and the backend behind it") {
  for (int n = 1; n <= 4; ++n) {
    CAPTURE(n);
    std::vector<loom_test::failures> f(static_cast<std::size_t>(2 * n));
    std::vector<int> sub_ranks(static_cast<std::size_t>(n)), sub_sums(static_cast<std::size_t>(n));
    std::vector<int> borrowed(static_cast<std::size_t>(n)), owned(static_cast<std::size_t>(n));
    run_ranks(n, [&](thread_comm& tc) {
      const auto r = static_cast<std::size_t>(tc.rank());
      loom::comm::any_comm c(std::ref(tc));
      borrowed[r] = c.target<thread_comm>() == &tc && c.target<loom::comm::any_comm>() == nullptr;
      f[r] = loom_test::run_suite(c, false);  // any_comm adds no element loop: the small matrix (the sanitizers run this case)
      // split by parity, reversed keys: an any_comm owning thread_comm's own subgroup
      loom::comm::any_comm sub = c.split(tc.rank() % 2, -tc.rank());
      owned[r] = sub.target<thread_comm>() != nullptr && sub.target<thread_comm>() != &tc;
      sub_ranks[r] = sub.rank();
      int v = tc.rank();
      sub.all_reduce(std::span<int>(&v, 1));
      sub_sums[r] = v;
      f[static_cast<std::size_t>(n) + r] = loom_test::run_suite(sub, false);
    });
    for (int w = 0; w < n; ++w) {
      CAPTURE(w);
      const auto u = static_cast<std::size_t>(w);
      CHECK_MESSAGE(f[u].list.empty(), loom_test::join(f[u]));
      CHECK_MESSAGE(f[static_cast<std::size_t>(n) + u].list.empty(), loom_test::join(f[static_cast<std::size_t>(n) + u]));
      CHECK(borrowed[u] == 1);
      CHECK(owned[u] == 1);
      // naive: the ranks of w's parity, the highest first
      int members_above = 0, sum = 0;
      for (int q = w % 2; q < n; q += 2) {
        sum += q;
        members_above += q > w;
      }
      CHECK(sub_ranks[u] == members_above);
      CHECK(sub_sums[u] == sum);
    }
  }
}

TEST_CASE("any_comm over thread ranks: a throwing rank fails the others' collectives; bad arguments are refused by name") {
  std::atomic<int> loom_errors{0};
  CHECK_THROWS_WITH_AS(run_ranks(3,
                                 [&](thread_comm& tc) {
                                   loom::comm::any_comm c(std::move(tc));  // owned
                                   std::vector<float> v(5, 1.f);
                                   if (c.rank() == 1) throw std::runtime_error("rank one broke");
                                   try {
                                     c.all_reduce(std::span<float>(v));
                                   } catch (const loom::error& e) {
                                     if (contains(e.what(), "rank 1 failed: rank one broke")) ++loom_errors;
                                     throw;
                                   }
                                 }),
                       "rank one broke", std::runtime_error);
  CHECK(loom_errors == 2);
  loom::comm::any_comm c{thread_comm{}};
  std::vector<float> in(3), out(4);
  CHECK_THROWS_WITH_AS(c.all_gather(std::span<const float>(in), std::span<float>(out)),
                       doctest::Contains("all_gather: out.size()=4 must be in.size() (3) x size (1)"), loom::error);
  CHECK_THROWS_WITH_AS(c.broadcast(std::span<float>(out), 2), doctest::Contains("broadcast: root=2"), loom::error);
}

TEST_CASE("thread_comm fault: a rank that throws makes every other rank's collective throw, and run_ranks rethrows it") {
  std::atomic<int> loom_errors{0};
  try {
    run_ranks(8, [&](thread_comm& c) {
      std::vector<float> v(10, 1.0f);
      c.all_reduce(std::span<float>(v));
      if (c.rank() == 5) throw std::runtime_error("rank five broke");
      try {
        c.all_reduce(std::span<float>(v));  // rank 5 never arrives
      } catch (const loom::error& e) {
        CHECK(contains(e.what(), "rank 5 failed: rank five broke"));
        ++loom_errors;
        throw;
      }
    });
    FAIL("run_ranks did not rethrow");
  } catch (const std::runtime_error& e) {
    CHECK(std::string(e.what()) == "rank five broke");
  }
  CHECK(loom_errors == 7);
}

TEST_CASE("thread_comm fault: async work and recv pending on a failed world throw") {
  std::atomic<int> loom_errors{0};
  CHECK_THROWS_WITH_AS(run_ranks(3,
                                 [&](thread_comm& c) {
                                   if (c.rank() == 0) throw loom::error("rank zero gives up");
                                   std::vector<float> v(15);
                                   try {
                                     if (c.rank() == 1) {
                                       auto w = c.all_gather_async(std::span<const float>(v.data(), 5), std::span<float>(v));
                                       w.wait();
                                     } else {
                                       c.recv(std::span<float>(v), 0, 3);
                                     }
                                   } catch (const loom::error& e) {
                                     if (contains(e.what(), "rank 0 failed: rank zero gives up")) ++loom_errors;
                                     throw;
                                   }
                                 }),
                       "rank zero gives up", loom::error);
  CHECK(loom_errors == 2);
}

TEST_CASE("thread_comm fault: a rank that returns while others wait makes them throw") {
  std::atomic<int> loom_errors{0};
  CHECK_THROWS_AS(run_ranks(4,
                            [&](thread_comm& c) {
                              if (c.rank() == 3) return;  // skips the barrier
                              try {
                                c.barrier();
                              } catch (const loom::error& e) {
                                if (contains(e.what(), "rank 3 of the group returned")) ++loom_errors;
                                throw;
                              }
                            }),
                  loom::error);
  CHECK(loom_errors == 3);
}

TEST_CASE("thread_comm fault: mismatched counts and ops throw on every rank naming each rank's call") {
  std::vector<std::string> msgs(3);
  run_ranks(3, [&](thread_comm& c) {
    std::vector<float> v(static_cast<std::size_t>(4 + (c.rank() == 1)));
    try {
      c.all_reduce(std::span<float>(v));
    } catch (const loom::error& e) {
      msgs[static_cast<std::size_t>(c.rank())] = e.what();
    }
    // the group is still usable after a mismatch
    std::vector<float> w(3, 1.0f);
    c.all_reduce(std::span<float>(w));
    CHECK(w[2] == 3.0f);
    // different operations
    try {
      if (c.rank() == 2)
        c.broadcast(std::span<float>(w), 0);
      else
        c.all_reduce(std::span<float>(w), reduce_op::max);
      FAIL("no throw");
    } catch (const loom::error& e) {
      const std::string m = e.what();
      CHECK(contains(m, "rank 0 called all_reduce(count=3, float32, max)"));
      CHECK(contains(m, "rank 2 called broadcast(count=3, float32, root=0)"));
    }
  });
  for (const auto& m : msgs) {
    CHECK(contains(m, "rank 0 called all_reduce(count=4, float32, sum)"));
    CHECK(contains(m, "rank 1 called all_reduce(count=5, float32, sum)"));
  }
}

TEST_CASE("thread_comm fault: in checked mode a timeout bounds the wait for a peer stuck elsewhere") {
  loom::comm::checked_scope scope(true, std::chrono::milliseconds(200));
  std::atomic<int> timeouts{0};
  CHECK_THROWS_AS(run_ranks(2,
                            [&](thread_comm& c) {
                              try {
                                float x = 0;
                                if (c.rank() == 0)
                                  c.barrier();
                                else
                                  c.recv(std::span<float>(&x, 1), 0, 9);  // waits for a message never sent
                              } catch (const loom::error& e) {
                                if (contains(e.what(), "timed out")) ++timeouts;
                                throw;
                              }
                            }),
                  loom::error);
  CHECK(timeouts == 2);
}

TEST_CASE("thread_comm: bad arguments are refused by name") {
  thread_comm c;
  std::vector<float> a(3), b(4);
  CHECK_THROWS_WITH_AS(c.all_gather(std::span<const float>(a), std::span<float>(b)), doctest::Contains("out.size()=4"), loom::error);
  CHECK_THROWS_WITH_AS(c.broadcast(std::span<float>(a), 1), doctest::Contains("root=1"), loom::error);
  CHECK_THROWS_WITH_AS(c.send(std::span<float>(a), 2), doctest::Contains("peer=2"), loom::error);
  CHECK_THROWS_WITH_AS(c.split(-1, 0), doctest::Contains("color=-1"), loom::error);
  CHECK_THROWS_WITH_AS(run_ranks(0, [](thread_comm&) {}), doctest::Contains("n=0"), loom::error);
}

TEST_CASE("thread_comm fault: a rank that throws with async work still queued does not hang its peers") {
  for (const bool use_split : {false, true}) {
    CAPTURE(use_split);
    CHECK_THROWS_WITH_AS(run_ranks(2,
                                   [&](thread_comm& c) {
                                     std::vector<float> v(4, 1.0f);
                                     thread_comm sub = use_split ? c.split(0, 0) : thread_comm();
                                     thread_comm& target = use_split ? sub : c;
                                     if (c.rank() == 0) {
                                       auto w = target.all_reduce_async(std::span<const float>(v), std::span<float>(v));
                                       throw std::runtime_error("boom with work queued");
                                     }
                                     float x = 0;
                                     c.recv(std::span<float>(&x, 1), 0, 1);  // never sent: must fail, not hang
                                   }),
                         "boom with work queued", std::runtime_error);
  }
}
