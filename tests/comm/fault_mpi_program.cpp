// The fault matrix under mpirun (docs/reliability.md): rank 1 of the job fails as argv[1]
// says (throw | return | stop: SIGSTOP itself | kill: SIGKILL itself) at the place argv[2]
// says (collective: while the others are inside an all_reduce | between: between two
// collectives | send: in a pipeline 0 -> 1 -> 2 -> ..., before receiving the activation its
// neighbour sends it). The other ranks must end with loom::error naming the operation
// within the timeout (LOOM_COMM_TIMEOUT), and the job must end: the main goes through
// loom::comm::run_or_fail, which calls MPI_Abort when a rank failed. fault_run.sh runs it with
// a hard time limit and checks what the survivors printed.
#include <loom/comm/fail_fast.hpp>

#include <loom/comm/mpi_comm.hpp>

#include <mpi.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  const std::string kind = argc > 1 ? argv[1] : "", where = argc > 2 ? argv[2] : "";
  const int status = loom::comm::run_or_fail("comm_fault_mpi", [&] {
    LOOM_CHECK(kind == "throw" || kind == "return" || kind == "stop" || kind == "kill", "comm_fault_mpi: kind=\"", kind,
               "\" (argv[1]) is not throw, return, stop or kill");
    LOOM_CHECK(where == "collective" || where == "between" || where == "send", "comm_fault_mpi: where=\"", where,
               "\" (argv[2]) is not collective, between or send");
    auto c = loom::comm::mpi_comm::world();
    const int r = c.rank(), p = c.size();
    LOOM_CHECK(p >= 3, "comm_fault_mpi: needs at least 3 ranks, got ", p);
    // Returns true when the rank is to return early.
    const auto fault = [&] {
      std::fprintf(stderr, "comm_fault_mpi: rank 1 fails (%s, %s)\n", kind.c_str(), where.c_str());
      std::fflush(stderr);
      if (kind == "throw") throw loom::error("injected fault on rank 1 (" + where + ")");
      if (kind == "stop") std::raise(SIGSTOP);
      if (kind == "kill") std::raise(SIGKILL);
      return kind == "return";
    };
    std::vector<float> v(8, 1.0f);
    c.all_reduce(std::span<float>(v));  // every rank present
    if (where == "collective") {
      // The others are inside the all_reduce when rank 1 fails. A stopped or killed rank 1
      // has issued its part; one that throws or returns has not (a dropped handle would
      // complete the collective: work's contract), so it never takes part.
      if (r == 1) {
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
        loom::comm::work issued;
        if (kind == "stop" || kind == "kill") issued = c.all_reduce_async(std::span<const float>(v), std::span<float>(v));
        if (fault()) return 0;
      }
      c.all_reduce(std::span<float>(v));
    } else if (where == "between") {
      if (r == 1 && fault()) return 0;
      c.barrier();
    } else {
      // 1 MiB activations: past the eager limit, so a send waits for its receiver. Ranks past
      // the failed one's neighbour wait longer, so that its neighbours report first (each
      // rank can only name the peer it waits for).
      if (r > 2) loom::comm::set_timeout(loom::comm::timeout() * 2);
      std::vector<float> a(std::size_t(1) << 18, float(r));
      if (r == 1 && fault()) return 0;
      if (r > 0) c.recv(std::span<float>(a), r - 1, 7);
      if (r + 1 < p) c.send(std::span<const float>(a), r + 1, 7);
      c.barrier();
    }
    return 0;
  });
  MPI_Finalize();
  return status;
}
