// mpi_comm under `mpirun -np 2` and `-np 4`: the collective matrix of collective_suite.hpp
// (unchecked and checked), split, mesh groups, and the fault tests: mismatched counts and
// operations throw on every rank naming each rank's call; a rank that throws instead of
// calling the collective leaves the others with loom::error after the checked-mode timeout,
// and nothing hangs.
#include "mesh_suite.hpp"

#include <loom/comm/any_comm.hpp>
#include <loom/comm/mpi_comm.hpp>

#include <doctest/doctest.h>

#include <chrono>
#include <string>

using loom::comm::mpi_comm;
using loom::comm::reduce_op;

namespace {
bool contains(const std::string& s, const std::string& what) { return s.find(what) != std::string::npos; }
}  // namespace

TEST_CASE("mpi_comm: every op x type x size matches the naive reference (unchecked)") {
  loom::comm::checked_scope scope(false);
  mpi_comm c = mpi_comm::world();
  auto f = loom_test::run_suite(c, true);
  CHECK_MESSAGE(f.list.empty(), loom_test::join(f));
}

TEST_CASE("mpi_comm: the small matrix also passes in checked mode with a timeout") {
  loom::comm::checked_scope scope(true, std::chrono::seconds(60));
  mpi_comm c = mpi_comm::world();
  auto f = loom_test::run_suite(c, false);
  CHECK_MESSAGE(f.list.empty(), loom_test::join(f));
}

TEST_CASE("any_comm over mpi_comm: the small matrix, and a split group of its own") {
  mpi_comm w = mpi_comm::world();
  loom::comm::any_comm c(std::ref(w));
  CHECK(c.target<mpi_comm>() == &w);
  auto f = loom_test::run_suite(c, false);
  CHECK_MESSAGE(f.list.empty(), loom_test::join(f));
  loom::comm::any_comm sub = c.split(w.rank() % 2, -w.rank());
  int members = 0, want_rank = 0, sum = 0;
  for (int r = w.rank() % 2; r < w.size(); r += 2) {
    ++members;
    sum += r;
    want_rank += r > w.rank();
  }
  CHECK(sub.size() == members);
  CHECK(sub.rank() == want_rank);
  int v = w.rank();
  sub.all_reduce(std::span<int>(&v, 1));
  CHECK(v == sum);
}

TEST_CASE("mpi_comm: split by parity, reversed keys") {
  mpi_comm c = mpi_comm::world();
  const int p = c.size(), me = c.rank();
  mpi_comm sub = c.split(me % 2, -me);
  int members = 0, want_rank = 0, sum = 0;
  for (int r = 0; r < p; ++r)
    if (r % 2 == me % 2) {
      ++members;
      sum += r;
      want_rank += r > me;
    }
  CHECK(sub.size() == members);
  CHECK(sub.rank() == want_rank);
  int v = me;
  sub.all_reduce(std::span<int>(&v, 1));
  CHECK(v == sum);
}

TEST_CASE("mpi_comm: mesh coordinates and groups for every shape of the world") {
  mpi_comm c = mpi_comm::world();
  const int p = c.size();
  for (int dp = 1; dp <= p; ++dp)
    for (int tp = 1; tp <= p; ++tp)
      if (p % (dp * tp) == 0) {
        const int pp = p / (dp * tp);
        CAPTURE(dp);
        CAPTURE(tp);
        CAPTURE(pp);
        auto f = loom_test::check_mesh(c, dp, tp, pp);
        CHECK_MESSAGE(f.list.empty(), loom_test::join(f));
      }
}

TEST_CASE("mpi_comm fault: mismatched counts and operations throw on every rank naming each call") {
  loom::comm::checked_scope scope(true);
  mpi_comm c = mpi_comm::world();
  std::vector<float> v(static_cast<std::size_t>(4 + (c.rank() == 1)), 1.0f);
  try {
    c.all_reduce(std::span<float>(v));
    FAIL("no throw");
  } catch (const loom::error& e) {
    CHECK(contains(e.what(), "rank 0 called all_reduce(count=4, float32, sum)"));
    CHECK(contains(e.what(), "rank 1 called all_reduce(count=5, float32, sum)"));
  }
  std::vector<double> w(4, 1.0);  // np <= 4
  try {
    if (c.rank() == 0)
      c.broadcast(std::span<double>(w), 1);
    else
      c.all_gather(std::span<const double>(w.data(), 1), std::span<double>(w.data(), static_cast<std::size_t>(c.size())));
    FAIL("no throw");
  } catch (const loom::error& e) {
    CHECK(contains(e.what(), "rank 0 called broadcast(count=4, float64, root=1)"));
    CHECK(contains(e.what(), "rank 1 called all_gather(count=1, float64)"));
  }
  // the communicator still works after a detected mismatch
  w.assign(4, 1.0);
  c.all_reduce(std::span<double>(w));
  CHECK(w[0] == static_cast<double>(c.size()));
}

TEST_CASE("mpi_comm fault: a rank that throws leaves the others with loom::error after the timeout") {
  loom::comm::checked_scope scope(true, std::chrono::milliseconds(1500));
  mpi_comm c = mpi_comm::world();
  std::vector<float> v(8, 1.0f);
  c.all_reduce(std::span<float>(v));  // all ranks present
  bool got_error = false;
  const auto t0 = std::chrono::steady_clock::now();
  try {
    if (c.rank() == 1) throw loom::error("rank one fails before the collective");
    c.all_reduce(std::span<float>(v));
  } catch (const loom::error& e) {
    got_error = true;
    if (c.rank() != 1) {
      CHECK(contains(e.what(), "timed out after 1500 ms in all_reduce(count=8, float32, sum)"));
      CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(30));
    }
  }
  CHECK(got_error);
  if (c.rank() != 1) {
    CHECK(!c.broken_reason().empty());
    CHECK_THROWS_WITH_AS(c.barrier(), doctest::Contains("broken communicator"), loom::error);
  }
  // every rank meets again on a fresh communicator; rank 1 gets there a whole timeout before
  // the others (they waited for it), so this meeting needs a longer one
  loom::comm::set_timeout(std::chrono::seconds(60));
  mpi_comm fresh = mpi_comm::world();
  fresh.barrier();
}
