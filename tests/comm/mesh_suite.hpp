#pragma once
// Mesh checks written over `communicator C`, for thread ranks and MPI: coordinates and the
// membership of every group against the naive rank formula (nested loops over pp, dp, tp
// counting up, tp innermost: Megatron's order), written here independently of mesh.hpp.

#include "collective_suite.hpp"

#include <loom/comm/mesh.hpp>

#include <vector>

namespace loom_test {

struct naive_mesh {
  int dp, tp, pp;
  // rank of (d, t, p) by enumeration order
  int rank(int d, int t, int p) const {
    int r = 0;
    for (int pi = 0; pi < pp; ++pi)
      for (int di = 0; di < dp; ++di)
        for (int ti = 0; ti < tp; ++ti, ++r)
          if (pi == p && di == d && ti == t) return r;
    return -1;
  }
};

/// Gathers the world ranks of group g in group order.
template <loom::comm::communicator C>
std::vector<int> members(C& g, int world_rank) {
  std::vector<int> all(static_cast<std::size_t>(g.size()));
  g.all_gather(std::span<const int>(&world_rank, 1), std::span<int>(all));
  return all;
}

template <loom::comm::communicator C>
failures check_mesh(C& world, int dp, int tp, int pp) {
  failures f;
  const naive_mesh nm{dp, tp, pp};
  loom::comm::mesh<C> m(world, dp, tp, pp);
  const auto c = m.coord();
  const int me = world.rank();
  if (nm.rank(c.dp, c.tp, c.pp) != me) f.add("rank ", me, ": coord ", c, " maps back to ", nm.rank(c.dp, c.tp, c.pp));
  std::vector<int> tp_want, dp_want, pp_want, mp_want;
  for (int t = 0; t < tp; ++t) tp_want.push_back(nm.rank(c.dp, t, c.pp));
  for (int d = 0; d < dp; ++d) dp_want.push_back(nm.rank(d, c.tp, c.pp));
  for (int p = 0; p < pp; ++p) pp_want.push_back(nm.rank(c.dp, c.tp, p));
  for (int p = 0; p < pp; ++p)
    for (int t = 0; t < tp; ++t) mp_want.push_back(nm.rank(c.dp, t, p));
  if (members(m.tp(), me) != tp_want) f.add("rank ", me, ": tp group differs from the naive one");
  if (members(m.dp(), me) != dp_want) f.add("rank ", me, ": dp group differs from the naive one");
  if (members(m.pp(), me) != pp_want) f.add("rank ", me, ": pp group differs from the naive one");
  if (members(m.mp(), me) != mp_want) f.add("rank ", me, ": mp group differs from the naive one");
  if (m.tp().rank() != c.tp || m.dp().rank() != c.dp || m.pp().rank() != c.pp)
    f.add("rank ", me, ": group ranks (", m.tp().rank(), ",", m.dp().rank(), ",", m.pp().rank(), ") differ from coord ", c);
  // Groups work together: sum of world ranks over dp equals the naive sum.
  int v = me, want = 0;
  for (int r : dp_want) want += r;
  m.dp().all_reduce(std::span<int>(&v, 1));
  if (v != want) f.add("rank ", me, ": dp all_reduce gave ", v, ", want ", want);
  return f;
}

}  // namespace loom_test
