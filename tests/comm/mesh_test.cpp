// mesh on thread ranks: coordinates and groups of (dp, tp, pp) = (2,2,1), (1,2,2), (2,1,2),
// (2,2,2) (and a few more) against the naive enumeration of mesh_suite.hpp; the same through
// comm::timed, whose clock must count the time a rank waits in its collectives.
#include "mesh_suite.hpp"

#include <loom/comm/thread_comm.hpp>
#include <loom/comm/timed.hpp>

#include <chrono>
#include <thread>

#include <doctest/doctest.h>

using loom::comm::run_ranks;
using loom::comm::thread_comm;

TEST_CASE("mesh: coordinates and groups follow Megatron's order") {
  const int shapes[][3] = {{2, 2, 1}, {1, 2, 2}, {2, 1, 2}, {2, 2, 2}, {3, 2, 1}, {1, 1, 3}, {1, 1, 1}};
  for (const auto& s : shapes) {
    const int n = s[0] * s[1] * s[2];
    CAPTURE(s[0]);
    CAPTURE(s[1]);
    CAPTURE(s[2]);
    std::vector<loom_test::failures> f(static_cast<std::size_t>(n));
    run_ranks(n, [&](thread_comm& c) { f[static_cast<std::size_t>(c.rank())] = loom_test::check_mesh(c, s[0], s[1], s[2]); });
    for (const auto& x : f) CHECK_MESSAGE(x.list.empty(), loom_test::join(x));
  }
}

TEST_CASE("mesh: the rank formula and its inverse agree, stage neighbours") {
  const loom::comm::mesh_shape s{3, 2, 4};
  for (int r = 0; r < s.size(); ++r) CHECK(loom::comm::mesh_rank(s, loom::comm::mesh_coords(s, r)) == r);
  CHECK(loom::comm::mesh_coords(s, 7) == loom::comm::mesh_coord{0, 1, 1});  // 7 = 1*6 + 0*2 + 1
  run_ranks(4, [](thread_comm& c) {
    loom::comm::mesh<thread_comm> m(c, 1, 1, 4);
    CHECK(m.prev_stage() == (c.rank() == 0 ? -1 : c.rank() - 1));
    CHECK(m.next_stage() == (c.rank() == 3 ? -1 : c.rank() + 1));
    CHECK(m.first_stage() == (c.rank() == 0));
    CHECK(m.last_stage() == (c.rank() == 3));
  });
}

TEST_CASE("mesh: a shape that does not fit the world is refused by name") {
  CHECK_THROWS_WITH_AS(run_ranks(4, [](thread_comm& c) { loom::comm::mesh<thread_comm> m(c, 2, 3, 1); }),
                       doctest::Contains("must equal the world size 4"), loom::error);
  CHECK_THROWS_WITH_AS(run_ranks(1, [](thread_comm& c) { loom::comm::mesh<thread_comm> m(c, 0, 1, 1); }),
                       doctest::Contains("dp=0"), loom::error);
}

// comm::timed: the same results through the wrapper (the mesh's groups are split from it),
// and the time a rank waits inside a collective is counted: rank 0 enters an all_reduce
// that rank 1 joins 100 ms later, so rank 0's clock holds at least those 100 ms, and no
// clock more than the rank's whole run.
TEST_CASE("comm::timed: the mesh's groups through it; waiting in collectives and on async handles is counted") {
  static_assert(loom::comm::communicator<loom::comm::timed<thread_comm>>);
  std::vector<loom_test::failures> f(8);
  run_ranks(8, [&](thread_comm& c) {
    loom::comm::timed<thread_comm> t(c.split(0, c.rank()));
    f[static_cast<std::size_t>(c.rank())] = loom_test::check_mesh(t, 2, 2, 2);
    CHECK(t.clock().calls() > 0);
  });
  for (const auto& x : f) CHECK_MESSAGE(x.list.empty(), loom_test::join(x));

  using namespace std::chrono;
  double waited[2] = {0, 0}, whole[2] = {0, 0};
  std::uint64_t calls[2] = {0, 0};
  run_ranks(2, [&](thread_comm& c) {
    loom::comm::timed<thread_comm> t(c.split(0, c.rank()));
    const auto t0 = steady_clock::now();
    if (c.rank() == 1) std::this_thread::sleep_for(milliseconds(100));
    float x = float(c.rank() + 1);
    t.all_reduce(std::span<const float>(&x, 1), std::span<float>(&x, 1), loom::comm::reduce_op::sum);
    CHECK(x == 3.f);
    // an async one: rank 0 starts it, then waits on the handle for rank 1, 100 ms late again
    if (c.rank() == 1) std::this_thread::sleep_for(milliseconds(100));
    float y = float(c.rank() + 1), z[2] = {0, 0};
    loom::comm::work w = t.all_gather_async(std::span<const float>(&y, 1), std::span<float>(z, 2));
    w.wait();
    CHECK((z[0] == 1.f && z[1] == 2.f));
    const std::size_t r = static_cast<std::size_t>(c.rank());
    waited[r] = t.clock().seconds();
    calls[r] = t.clock().calls();
    whole[r] = duration<double>(steady_clock::now() - t0).count();
  });
  CHECK(waited[0] >= 0.2);
  CHECK(waited[0] <= whole[0]);
  CHECK(waited[1] <= whole[1]);
  CHECK(calls[0] == 2);
  CHECK(calls[1] == 2);
}
