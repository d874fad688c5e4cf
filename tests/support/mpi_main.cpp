// The doctest main of MPI tests: initialises MPI (MPI_THREAD_MULTIPLE when available), runs
// the test cases on every rank, and fails the whole job when any rank failed. Only rank 0
// prints doctest's summary unless a rank fails. Built with LOOM_TEST_MPI_GPU (MPI + GPU tests)
// it exits 77 (skipped) when there are fewer CUDA devices than ranks.
#include <doctest/doctest.h>
#include <mpi.h>

#ifdef LOOM_TEST_MPI_GPU
#include <loom/core/cuda/error.hpp>

#include <cstdio>
#endif

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
#ifdef LOOM_TEST_MPI_GPU
  // MPI + GPU tests (label gpu) need one device per rank; without them: skipped (77).
  int size = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (loom::cuda_device_count() < size) {
    if (rank == 0) std::printf("%d CUDA devices for %d ranks: skipping GPU test\n", loom::cuda_device_count(), size);
    MPI_Finalize();
    return 77;
  }
#endif
  doctest::Context ctx(argc, argv);
  const int failed = ctx.run() != 0 ? 1 : 0;
  int any_failed = 0;
  MPI_Allreduce(&failed, &any_failed, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return any_failed;
}
