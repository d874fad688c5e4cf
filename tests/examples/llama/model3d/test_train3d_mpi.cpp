// The 3D trainer under mpirun (-np 4: meshes (2,2,1) and (1,2,2); -np 8: (2,2,2)), every
// ZeRO stage and the three schedules, against the (1,1,1) run computed in each process.
#include "train3d_suite.hpp"

#include <loom/comm/mpi_comm.hpp>

using namespace train3d_suite;

TEST_CASE("3D training on MPI ranks reproduces the (1,1,1) run") {
  loom::comm::mpi_comm world = loom::comm::mpi_comm::world();
  const int n = world.size();
  std::vector<loom::comm::mesh_shape> meshes;
  if (n == 4) meshes = {{2, 2, 1}, {1, 2, 2}};
  if (n == 8) meshes = {{2, 2, 2}};
  REQUIRE(!meshes.empty());
  const int m = 2;
  for (auto mesh : meshes) {
    const run_result base = run({1, 1, 1}, 0, "1f1b", m * mesh.dp, false);
    for (int zero = 0; zero <= 3; ++zero)
      for (const char* sched : {"gpipe", "1f1b"}) {
        if (mesh.pp == 1 && std::string(sched) == "gpipe") continue;
        CAPTURE(mesh.dp);
        CAPTURE(mesh.tp);
        CAPTURE(mesh.pp);
        CAPTURE(zero);
        CAPTURE(sched);
        compare(run_rank(world, options(mesh, zero, sched, m), false), base);
      }
    if (mesh.pp > 1) {  // interleaved 1F1B, 2 chunks per stage, on a 4-layer model
      const run_result base4 = run({1, 1, 1}, 0, "1f1b", m * mesh.dp, false, 4);
      for (int zero : {3}) {
        auto o = options(mesh, zero, "interleaved", m);
        o.chunks = 2;
        CAPTURE(zero);
        compare(run_rank(world, o, false, 4), base4);
      }
    }
  }
}
