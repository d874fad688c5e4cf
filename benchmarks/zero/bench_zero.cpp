// loom-bench-zero: one ZeRO training step of a layered model (tests/zero's toy MLP: L tanh
// layers of width D, explicit per-layer backward) for stages 0-3 and several data-parallel
// sizes on thread ranks. Per configuration it reports, from rank 0:
//   step ms             mean wall time of a training step (overlap_comm on)
//   reduce exposed ms   time backward waited for gradient reductions with overlap on
//   reduce total ms     the same reductions run blocking (overlap off)
//   hidden              1 - exposed / total: the share of reduction time hidden behind backward
//   gather wait ms      stage 3: time spent waiting for parameter all-gathers
//   states KiB          per-rank model states (parameters, gradients, optimizer state)
// Usage: loom-bench-zero [--ranks 2,4] [--stages 0,1,2,3] [--layers 8] [--width 256]
//                        [--batch 16] [--steps 10] [--bucket N]
#include <loom/comm/thread_comm.hpp>
#include <loom/zero/engine.hpp>

#include "support/toy_model.hpp"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

namespace {

struct args {
  std::vector<int> ranks{2, 4}, stages{0, 1, 2, 3};
  std::size_t layers = 8, width = 256, batch = 16, steps = 10, bucket = 0;  // bucket 0: two layers' worth
};

const char* usage =
    "usage: loom-bench-zero [--ranks 2,4] [--stages 0,1,2,3] [--layers L] [--width D] [--batch B per rank] [--steps N]\n"
    "                       [--bucket reduce_bucket_size elements]\n";

std::vector<int> list(const std::string& s) {
  std::vector<int> v;
  std::stringstream ss(s);
  for (std::string x; std::getline(ss, x, ',');) v.push_back(std::stoi(x));
  return v;
}

struct result {
  double step_ms = 0, exposed_ms = 0, total_ms = 0, gather_ms = 0;
  std::size_t states = 0;
};

template <class Stage>
result measure(const args& a, int world, bool overlap) {
  result out;
  loom::zero::engine_options o;
  o.reduce_bucket_numel = a.bucket ? a.bucket : 2 * (a.width * a.width + a.width);
  o.overlap_comm = overlap;
  o.stage3 = {2 * (a.width * a.width + a.width), 4 * (a.width * a.width + a.width), a.width};
  loom::comm::run_ranks(world, [&](loom::comm::thread_comm& c) {
    loom::host_memory_resource states("states"), scratch("scratch"), host("host");
    loom::test::toy_mlp model(a.layers, a.width);
    const std::size_t D = a.width;
    loom::zero::engine<Stage, float, loom::comm::thread_comm> e(
        c, loom::zero::flat_layout(loom::test::toy_mlp::specs(a.layers, D), std::size_t(world)), o, {&states, &scratch, &host},
        [D](std::size_t p, std::size_t first, std::span<float> v) { loom::test::toy_mlp::init(D, p, first, v); });
    const std::size_t warm = 2;
    double t = 0, r0 = 0, g0 = 0;
    for (std::size_t s = 0; s < warm + a.steps; ++s) {
      if (s == warm) {
        c.barrier();
        r0 = e.reducer().wait_seconds();
        g0 = e.gatherer() ? e.gatherer()->wait_seconds() : 0;
      }
      model.set_batch(s, std::size_t(c.rank()) * a.batch, a.batch);
      const auto t0 = std::chrono::steady_clock::now();
      e.train_step(model);
      if (s >= warm) t += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
    if (c.rank() == 0) {
      out.step_ms = 1e3 * t / double(a.steps);
      out.exposed_ms = 1e3 * (e.reducer().wait_seconds() - r0) / double(a.steps);
      out.gather_ms = e.gatherer() ? 1e3 * (e.gatherer()->wait_seconds() - g0) / double(a.steps) : 0;
      out.states = states.current_bytes();
    }
  });
  return out;
}

template <class Stage>
void row(const args& a, int world, double& stage1_ms) {
  const result on = measure<Stage>(a, world, true), off = measure<Stage>(a, world, false);
  const double hidden = off.exposed_ms > 0 ? 1.0 - on.exposed_ms / off.exposed_ms : 0.0;
  if (Stage::level == 1) stage1_ms = on.step_ms;
  char ratio[32] = "";
  if (stage1_ms > 0) std::snprintf(ratio, sizeof ratio, "%.2fx", on.step_ms / stage1_ms);
  std::printf("| %d | %d | %.2f | %.2f | %.2f | %.0f%% | %.2f | %.0f | %s |\n", world, Stage::level, on.step_ms, on.exposed_ms,
              off.exposed_ms, 100.0 * hidden, on.gather_ms, double(on.states) / 1024.0, ratio);
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  args a;
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
  } catch (const std::exception& e) {
    std::fprintf(stderr, "loom-bench-zero: %s\n%s", e.what(), usage);
    return 2;
  }
  std::printf("toy MLP: %zu layers x width %zu (%zu parameters), batch %zu per rank, fp32, thread ranks\n\n", a.layers, a.width,
              a.layers * (a.width * a.width + a.width), a.batch);
  std::printf("| ranks | stage | step ms | reduce exposed ms | reduce blocking ms | hidden | gather wait ms | states KiB/rank | vs stage 1 |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|\n");
  try {
    for (int world : a.ranks) {
      double stage1_ms = 0;
      for (int s : a.stages) loom::zero::dispatch_stage(s, [&](auto st) { row<decltype(st)>(a, world, stage1_ms); });
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "loom-bench-zero: error: %s\n", e.what());
    return 1;
  }
}
