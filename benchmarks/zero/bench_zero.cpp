// loom-bench-zero: ZeRO stages 0-3 on thread ranks (see bench_zero.hpp for the columns).
#include <loom/comm/thread_comm.hpp>

#include "bench_zero.hpp"

int main(int argc, char** argv) {
  using namespace loom_bench_zero;
  args a;
  if (const int rc = parse(argc, argv, a); rc >= 0) return rc;
  print_header(a, "thread ranks");
  try {
    for (int world : a.ranks) {
      double stage1_ms = 0;
      for (int s : a.stages)
        loom::zero::dispatch_stage(s, [&](auto st) {
          result on, off;
          loom::comm::run_ranks(world, [&](loom::comm::thread_comm& c) {
            const result r1 = measure<decltype(st)>(c, a, true), r2 = measure<decltype(st)>(c, a, false);
            if (c.rank() == 0) on = r1, off = r2;
          });
          print_row(world, decltype(st)::level, on, off, stage1_ms);
        });
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "loom-bench-zero: error: %s\n", e.what());
    return 1;
  }
}
