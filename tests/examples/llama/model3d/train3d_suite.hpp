#pragma once
// Shared by the thread-rank and MPI tests of the 3D trainer: a tiny LLaMA, 20 steps of
// training on one rank of any communicator, and the comparison with the (1,1,1) run.
#include <llama/train3d/train3d.hpp>

#include <loom/comm/any_comm.hpp>
#include <loom/comm/thread_comm.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <functional>
#include <cmath>
#include <string>
#include <vector>

namespace train3d_suite {

/// loom::comm::run_ranks with each thread rank's communicator erased (any_comm): the tests'
/// trainers and stage models are over any_comm on every backend, as the program's are, so the
/// trainer test group instantiates each once, and the float trainers are llama_train_lib's.
template <class F>
void run_ranks(int n, F&& f) {
  loom::comm::run_ranks(n, [&](loom::comm::thread_comm& ranks) {
    loom::comm::any_comm world(std::ref(ranks));
    f(world);
  });
}

inline llama::config tiny(bool tied, loom::index_t layers = 2) {
  llama::config c;
  c.dim = 16, c.n_layers = layers, c.n_heads = 4, c.n_kv_heads = 2, c.hidden_dim = 32, c.vocab = 32, c.seq_len = 8;
  c.tied_output = tied;
  return c;
}

struct run_result {
  std::vector<double> losses;
  std::vector<float> master;
};

constexpr int steps = 20;

inline llama3d::train_options options(loom::comm::mesh_shape mesh, int zero, const std::string& schedule, int m) {
  llama3d::train_options o;
  o.mesh = mesh;
  o.zero_stage = zero;
  o.schedule = schedule;
  o.micro_batches = m;
  o.micro_batch_size = 2;
  o.seq = 8;
  o.adamw.lr = 3e-3f;
  o.gradient_clipping = 0.5f;  // active in the first steps: the norm spans all three dimensions
  // ZeRO-3 gathers every unit (none is small enough to stay gathered) and prefetches one
  // unit ahead at most, so the tests run the gather / prefetch / release path itself
  o.stage3.persistence_threshold = 0;
  o.stage3.prefetch_numel = 4096;
  return o;
}

/// This rank's part of a run over `world` (whose size is the mesh's); the result on every rank.
template <loom::comm::communicator C>
run_result run_rank(C& world, const llama3d::train_options& o, bool tied, loom::index_t layers = 2) {
  const auto cfg = tiny(tied, layers);
  llama3d::trainer<double, double, C> t(world, cfg, o, loom::default_resource<loom::host>());
  run_result out;
  for (int s = 0; s < steps; ++s) {
    auto st = t.step([&](std::int64_t step, int g, std::span<std::int32_t> tok, std::span<std::int32_t> tgt) {
      llama3d::counting_batch(7, step, g, o.micro_batch_size, o.seq, cfg.vocab, tok, tgt);
    });
    out.losses.push_back(st.loss);
  }
  out.master = t.consolidated_master();
  return out;
}

/// A whole run on thread ranks.
inline run_result run(loom::comm::mesh_shape mesh, int zero, const std::string& schedule, int m, bool tied,
                      loom::index_t layers = 2, int chunks = 1) {
  run_result out;
  auto o = options(mesh, zero, schedule, m);
  o.chunks = chunks;
  train3d_suite::run_ranks(mesh.size(), [&](loom::comm::any_comm& world) {
    auto r = run_rank(world, o, tied, layers);
    if (world.rank() == 0) out = r;
  });
  return out;
}

inline void compare(const run_result& got, const run_result& want) {
  REQUIRE(got.losses.size() == want.losses.size());
  double worst = 0;
  for (std::size_t i = 0; i < want.losses.size(); ++i)
    worst = std::max(worst, std::abs(got.losses[i] - want.losses[i]) / std::abs(want.losses[i]));
  CHECK(worst < 1e-5);
  REQUIRE(got.master.size() == want.master.size());
  double pw = 0;
  for (std::size_t i = 0; i < want.master.size(); ++i)
    pw = std::max(pw, double(std::abs(got.master[i] - want.master[i])) / std::max(1.0, double(std::abs(want.master[i]))));
  CHECK(pw < 1e-5);
}

}  // namespace train3d_suite
