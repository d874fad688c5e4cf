// mesh on thread ranks: coordinates and groups of (dp, tp, pp) = (2,2,1), (1,2,2), (2,1,2),
// (2,2,2) (and a few more) against the naive enumeration of mesh_suite.hpp.
#include "mesh_suite.hpp"

#include <loom/comm/thread_comm.hpp>

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
