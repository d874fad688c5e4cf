#pragma once
// Whether a program was started by mpirun, and MPI for the length of its run: llama-train,
// llama-generate and llama-serve are the same binaries on thread ranks and on mpirun's
// processes (`mpirun -np N prog ...`, or across hosts `mpirun --hostfile hosts -np N prog ...`
// with DeepSpeed-style lines `worker-1 slots=4`, which Open MPI reads as they are).
//
// Why from the environment: a program must choose its ranks before it touches MPI (a binary
// linked with MPI but started without mpirun runs on threads), and Open MPI's and PMI
// launchers say who started it in their variables.

#include <cstdlib>
#include <initializer_list>

#ifdef LOOM_HAS_MPI
#include <mpi.h>
#endif

namespace examples {

/// Number of processes when started by mpirun (Open MPI's or a PMI launcher's environment), else 0.
inline int mpi_launch_size() {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE"})
    if (const char* s = std::getenv(v)) return std::atoi(s);
  return 0;
}

/// This process's rank when started by mpirun, else 0.
inline int mpi_launch_rank() {
  for (const char* v : {"OMPI_COMM_WORLD_RANK", "PMI_RANK"})
    if (const char* s = std::getenv(v)) return std::atoi(s);
  return 0;
}

#ifdef LOOM_HAS_MPI
/// MPI initialised for this scope (MPI_THREAD_MULTIPLE: a server's threads and a progress
/// thread may call it), unless it already was; finalised at its end by the one that
/// initialised it. A failed run does not reach the end: loom::comm::fail aborts the job.
class mpi_session {
 public:
  mpi_session() {
    MPI_Initialized(&was_);
    if (!was_) {
      int provided = 0;
      MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
    }
  }
  ~mpi_session() {
    if (!was_) MPI_Finalize();
  }
  mpi_session(const mpi_session&) = delete;
  mpi_session& operator=(const mpi_session&) = delete;

 private:
  int was_ = 0;
};
#endif

}  // namespace examples
