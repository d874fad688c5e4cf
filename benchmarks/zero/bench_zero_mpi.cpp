// loom-bench-zero-mpi: ZeRO stages 0-3 on MPI processes, `mpirun -np N loom-bench-zero-mpi`
// (see bench_zero.hpp for the columns). Non-blocking collectives are progressed by the
// schedulers' polling between layers.
#include <loom/comm/mpi_comm.hpp>

#include "bench_zero.hpp"

#include <mpi.h>

int main(int argc, char** argv) {
  using namespace loom_bench_zero;
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  int rc = 0;
  {
    args a;
    rc = parse(argc, argv, a);
    if (rc < 0) {
      rc = 0;
      try {
        loom::comm::mpi_comm c = loom::comm::mpi_comm::world();
        if (c.rank() == 0) print_header(a, "MPI processes");
        double stage1_ms = 0;
        for (int s : a.stages)
          loom::zero::dispatch_stage(s, [&](auto st) {
            const result on = measure<decltype(st)>(c, a, true), off = measure<decltype(st)>(c, a, false);
            if (c.rank() == 0) print_row(c.size(), decltype(st)::level, on, off, stage1_ms);
          });
      } catch (const std::exception& e) {
        std::fprintf(stderr, "loom-bench-zero-mpi: error: %s\n", e.what());
        MPI_Abort(MPI_COMM_WORLD, 1);
      }
    }
  }
  MPI_Finalize();
  return rc;
}
