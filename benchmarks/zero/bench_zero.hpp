#pragma once
// Shared by loom-bench-zero (thread ranks) and loom-bench-zero-mpi (mpirun): one ZeRO
// training step of a layered model (examples/zero's toy MLP: L tanh layers of width D, explicit
// per-layer backward) per stage. Per configuration, from rank 0:
//   step ms             median wall time of a training step (overlap_comm on); medians
//                       throughout, as ranks may share cores with other work
//   reduce exposed ms   time backward waited for gradient reductions with overlap on
//   reduce blocking ms  the same reductions run blocking (overlap off)
//   hidden              1 - exposed / blocking: the share of reduction time hidden behind backward
//   gather wait ms      stage 3: time spent waiting for parameter all-gathers
//   states KiB          per-rank model states (parameters, gradients, optimizer state)
// Every step starts with a barrier so skew from the previous step does not leak in.

#include <loom/comm/communicator.hpp>
#include <loom/zero/engine.hpp>

#include <zero/toy_mlp.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace loom_bench_zero {

struct args {
  std::vector<int> ranks{2, 4}, stages{0, 1, 2, 3};
  std::size_t layers = 8, width = 256, batch = 16, steps = 10, bucket = 0;  // bucket 0: two layers' worth
};

inline const char* usage =
    "usage: loom-bench-zero[-mpi] [--ranks 2,4] [--stages 0,1,2,3] [--layers L] [--width D] [--batch B per rank]\n"
    "                             [--steps N] [--bucket reduce_bucket_size elements]\n"
    "  (--ranks: thread ranks; under mpirun the process count is used)\n";

inline std::vector<int> list(const std::string& s) {
  std::vector<int> v;
  std::stringstream ss(s);
  for (std::string x; std::getline(ss, x, ',');) v.push_back(std::stoi(x));
  return v;
}

/// Parses argv into a; returns -1 to go on, else the exit code (0 after --help, 2 on bad input).
inline int parse(int argc, char** argv, args& a) {
  try {
    for (int i = 1; i < argc; ++i) {
      const std::string f = argv[i];
      if (f == "--help" || f == "-h") {
        std::fputs(usage, stdout);
        return 0;
      }
      if (i + 1 >= argc) throw std::runtime_error("flag " + f + " needs a value");
      const std::string v = argv[++i];
      if (f == "--ranks") a.ranks = list(v);
      else if (f == "--stages") a.stages = list(v);
      else if (f == "--layers") a.layers = std::stoul(v);
      else if (f == "--width") a.width = std::stoul(v);
      else if (f == "--batch") a.batch = std::stoul(v);
      else if (f == "--steps") a.steps = std::stoul(v);
      else if (f == "--bucket") a.bucket = std::stoul(v);
      else throw std::runtime_error("unknown argument '" + f + "'");
    }
    for (int s : a.stages)
      if (s < 0 || s > 3) throw std::runtime_error("--stages: stage " + std::to_string(s) + " is not 0..3");
    if (a.steps < 1) throw std::runtime_error("--steps must be >= 1");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "loom-bench-zero: %s\n%s", e.what(), usage);
    return 2;
  }
  return -1;
}

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

struct result {
  double step_ms = 0, exposed_ms = 0, gather_ms = 0;
  std::size_t states = 0;
};

/// One rank's measurement (collective over c); rank 0's numbers are the ones printed.
template <class Stage, loom::comm::communicator C>
result measure(C& c, const args& a, bool overlap) {
  const std::size_t D = a.width, layer = D * D + D;
  loom::zero::engine_options o;
  o.reduce_bucket_numel = a.bucket ? a.bucket : 2 * layer;
  o.overlap_comm = overlap;
  o.stage3 = {2 * layer, 4 * layer, D};
  loom::host_memory_resource states("states"), scratch("scratch"), host("host");
  examples::toy_mlp model(a.layers, D);
  loom::zero::engine<Stage, float, C> e(
      c, loom::zero::flat_layout(examples::toy_mlp::specs(a.layers, D), std::size_t(c.size())), o, {&states, &scratch, &host},
      [D](std::size_t p, std::size_t first, std::span<float> v) { examples::toy_mlp::init(D, p, first, v); });
  const std::size_t warm = 2;
  std::vector<double> step_s, reduce_s, gather_s;  // per measured step
  for (std::size_t s = 0; s < warm + a.steps; ++s) {
    model.set_batch(s, std::size_t(c.rank()) * a.batch, a.batch);
    c.barrier();
    const double r0 = e.reducer().wait_seconds(), g0 = e.gatherer() ? e.gatherer()->wait_seconds() : 0;
    const auto t0 = std::chrono::steady_clock::now();
    e.train_step(model);
    if (s < warm) continue;
    step_s.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    reduce_s.push_back(e.reducer().wait_seconds() - r0);
    gather_s.push_back(e.gatherer() ? e.gatherer()->wait_seconds() - g0 : 0);
  }
  return {1e3 * median(step_s), 1e3 * median(reduce_s), 1e3 * median(gather_s), states.current_bytes()};
}

inline void print_header(const args& a, const char* backend) {
  std::printf("toy MLP: %zu layers x width %zu (%zu parameters), batch %zu per rank, fp32, %s\n\n", a.layers, a.width,
              a.layers * (a.width * a.width + a.width), a.batch, backend);
  std::printf("| ranks | stage | step ms | reduce exposed ms | reduce blocking ms | hidden | gather wait ms | states KiB/rank | vs stage 1 |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|\n");
}

/// Prints one table row; remembers stage 1's step time for the ratio column.
inline void print_row(int world, int level, const result& on, const result& off, double& stage1_ms) {
  const double hidden = off.exposed_ms > 0 ? 1.0 - on.exposed_ms / off.exposed_ms : 0.0;
  if (level == 1) stage1_ms = on.step_ms;
  char ratio[32] = "";
  if (stage1_ms > 0) std::snprintf(ratio, sizeof ratio, "%.2fx", on.step_ms / stage1_ms);
  std::printf("| %d | %d | %.2f | %.2f | %.2f | %.0f%% | %.2f | %.0f | %s |\n", world, level, on.step_ms, on.exposed_ms,
              off.exposed_ms, 100.0 * hidden, on.gather_ms, double(on.states) / 1024.0, ratio);
  std::fflush(stdout);
}

}  // namespace loom_bench_zero
