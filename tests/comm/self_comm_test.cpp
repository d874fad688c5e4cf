// self_comm: the one-rank group passes the collective matrix of collective_suite.hpp (naive
// reference in double, every op x type x size, async forms included), splits into itself,
// and refuses point-to-point and a foreign broadcast root by name.
#include "collective_suite.hpp"

#include <loom/comm/self_comm.hpp>

#include <doctest/doctest.h>

#include <vector>

TEST_CASE("self_comm: every op x type x size matches the naive reference of one rank") {
  loom::comm::self_comm c;
  CHECK(c.rank() == 0);
  CHECK(c.size() == 1);
  auto f = loom_test::run_suite(c, true);
  CHECK_MESSAGE(f.list.empty(), loom_test::join(f));
  auto g = c.split(3, 7);
  f = loom_test::run_suite(g, false);
  CHECK_MESSAGE(f.list.empty(), loom_test::join(f));
}

TEST_CASE("self_comm: a send to itself is received by tag in order; another peer, an unmatched recv and another root are loom::errors") {
  loom::comm::self_comm c;
  std::vector<float> v(4, 1.f), a{1, 2, 3, 4}, b{5, 6, 7, 8}, got(4);
  c.send(std::span<const float>(a), 0, 1);
  c.send(std::span<const float>(b), 0, 1);
  c.recv(std::span<float>(got), 0, 1);
  CHECK(got == a);  // first sent, first received
  c.recv(std::span<float>(got), 0, 1);
  CHECK(got == b);
  CHECK_THROWS_WITH_AS(c.send(std::span<const float>(v), 1, 0), doctest::Contains("peer=1"), loom::error);
  CHECK_THROWS_WITH_AS(c.recv(std::span<float>(v), 0, 9), doctest::Contains("tag=9"), loom::error);  // would hang
  auto w = c.recv_async(std::span<float>(v), 0, 5);
  CHECK_FALSE(w.test());
  CHECK_THROWS_WITH_AS(w.wait(), doctest::Contains("no send"), loom::error);
  std::vector<double> d(4);
  c.send(std::span<const float>(a), 0, 3);
  CHECK_THROWS_WITH_AS(c.recv(std::span<double>(d), 0, 3), doctest::Contains("matching send"), loom::error);
  CHECK_THROWS_WITH_AS(c.broadcast(std::span<float>(v), 1), doctest::Contains("root=1"), loom::error);
  c.broadcast(std::span<float>(v), 0);
  CHECK(v[3] == 1.f);
}
