// The executor under mpirun (-np 2 and 4): the pipeline group is MPI_COMM_WORLD, every rank
// one stage; the toy model's loss and each rank's weight gradients equal the one-process
// reference under GPipe, 1F1B and interleaved 1F1B (tests/pipeline/executor_suite.hpp).
#include "executor_suite.hpp"

#include <loom/comm/mpi_comm.hpp>

#include <doctest/doctest.h>

#include <string>

TEST_CASE("every schedule reproduces the one-process loss and gradients on MPI ranks") {
  loom::comm::mpi_comm world = loom::comm::mpi_comm::world();
  const int p = world.size();
  for (const std::string kind : {"gpipe", "1f1b", "interleaved"})
    for (int m : {p, 3 * p}) {
      const toy::sizes z{.p = p, .m = m, .v = kind == "interleaved" ? 2 : 1, .rows = 2, .d = 4};
      CAPTURE(kind);
      CAPTURE(m);
      toy::check(toy::run_rank(world, kind, z, /*steps=*/2), 2);
    }
}

TEST_CASE("large activations go through MPI's rendezvous protocol without deadlock") {
  // 32 KiB per transfer is past Open MPI's shared-memory eager limit (4 KiB): a send waits for
  // its receiver.
  loom::comm::mpi_comm world = loom::comm::mpi_comm::world();
  const int p = world.size();
  toy::sizes z{.p = p, .m = 2 * p, .v = 2, .rows = 1024, .d = 8};
  // dW sums 1024 * m rows in float: allow 1e-3 relative (a wrong tensor would be off by O(1)).
  toy::check(toy::run_rank(world, "interleaved", z), 1, 1e-3);
}
