#pragma once
// One segment of a run with a sharded checkpoint at either end, on any communicator: the
// checkpoint tests on thread ranks and under mpirun share it.
#include "train3d_suite.hpp"

#include <llama/train3d/checkpoint.hpp>

#include <string>

namespace train3d_suite {

inline constexpr int half_steps = steps / 2;

/// This rank's part of steps [first, last) of a run on `mesh` / `zero`: loads `resume` first
/// (if not empty), saves to `save` at the end (if not empty; the directory into *saved_dir on
/// rank 0). The global batch is 4 micro-batches on every mesh. Losses of those steps and the
/// final consolidated master, on every rank.
template <loom::comm::communicator C>
run_result segment_rank(C& world, loom::comm::mesh_shape mesh, int zero, int first, int last, const std::string& resume,
                        const std::string& save, std::string* saved_dir = nullptr) {
  const auto o = options(mesh, zero, "1f1b", 4 / mesh.dp);
  const auto cfg = tiny(false);
  llama3d::trainer<double, double, C> t(world, cfg, o, loom::default_resource<loom::host>());
  if (!resume.empty()) llama3d::load_checkpoint(t, resume);
  CHECK(t.steps() == first);
  run_result r;
  for (int s = first; s < last; ++s) {
    const auto st = t.step([&](std::int64_t step, int g, std::span<std::int32_t> tok, std::span<std::int32_t> tgt) {
      llama3d::counting_batch(7, step, g, o.micro_batch_size, o.seq, cfg.vocab, tok, tgt);
    });
    r.losses.push_back(st.loss);
  }
  if (!save.empty()) {
    const std::string dir = llama3d::save_checkpoint(t, save);
    if (saved_dir && world.rank() == 0) *saved_dir = dir;
  }
  r.master = t.consolidated_master();
  return r;
}

}  // namespace train3d_suite
