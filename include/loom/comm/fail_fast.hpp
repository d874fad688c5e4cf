#pragma once
// How a program's main ends when its run failed, so that under mpirun the job ends too.
//
// Why: MPI_Finalize synchronises the processes (Open MPI waits for every process at a
// fence), so a rank that failed and returns from main through MPI_Finalize waits for peers
// that are stuck, stopped, or waiting for it: the job hangs. MPI_Abort instead makes mpirun
// end every rank at once. With one process, or without MPI, a non-zero exit status is enough.
// Why in comm: it is the other half of the communicators' timeouts (a failed rank must not
// leave the others hanging). The library itself never ends a program: these two functions
// are for a main to call, in its catch, when it decides to.
//
//   int main(int argc, char** argv) {
//     return loom::comm::run_or_fail("llama-train", [&] { ...; return 0; });
//   }

#include <cstdio>
#include <exception>
#include <utility>

#ifdef LOOM_HAS_MPI
#include <mpi.h>
#endif

namespace loom::comm {

/// Prints "<program>: error: <what>" and, under MPI with more than one process, calls
/// MPI_Abort (mpirun then ends every rank; it does not return). Otherwise returns 1, the
/// status for main to return.
inline int fail(const char* program, const char* what) {
  std::fprintf(stderr, "%s: error: %s\n", program, what);
  std::fflush(stderr);
#ifdef LOOM_HAS_MPI
  int init = 0, fin = 0;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  if (init && !fin) {
    int size = 1;
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    if (size > 1) MPI_Abort(MPI_COMM_WORLD, 1);
  }
#endif
  return 1;
}

/// Runs body() (it returns main's exit status); an exception goes to fail().
template <class Body>
int run_or_fail(const char* program, Body&& body) {
  try {
    return std::forward<Body>(body)();
  } catch (const std::exception& e) {
    return fail(program, e.what());
  } catch (...) {
    return fail(program, "unknown exception");
  }
}

}  // namespace loom::comm
