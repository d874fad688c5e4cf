#pragma once
// The mesh trainer's sharded checkpoints: loom::checkpoint (include/loom/checkpoint/
// sharded.hpp) over the trainer's model chunks and ZeRO engines. The manifest also records
// the mesh and stage it was saved at and the loss scaler's state; the step is the optimizer
// steps taken, which is also the data cursor and the lr schedule's position.

#include "train3d.hpp"

#include <loom/checkpoint/sharded.hpp>

#include <string>
#include <vector>

namespace llama3d {

namespace detail {
template <class P, class T, class C>
auto checkpoint_chunks(trainer<P, T, C>& t) {
  using engine_t = std::remove_reference_t<decltype(t.engine(0))>;
  std::vector<loom::checkpoint::chunk<engine_t>> out;
  for (int c = 0; c < t.chunks(); ++c) out.push_back({&t.model(c).shards(), &t.engine(c)});
  return out;
}

inline loom::checkpoint::tensor_shapes tensor_shapes(const llama::config& cfg) {
  loom::checkpoint::tensor_shapes s;
  const auto layout = full_layout(cfg);
  for (const auto& e : layout.entries()) s[e.name] = std::vector<std::int64_t>(e.shape.begin(), e.shape.end());
  return s;
}
}  // namespace detail

/// Writes the trainer's state to <root>/step-<steps()>; keeps the newest `keep_last` (0: all).
/// Collective over the world; returns the checkpoint's directory.
template <class P, class T, class C>
std::string save_checkpoint(trainer<P, T, C>& t, const std::string& root, int keep_last = 0) {
  const auto& o = t.options();
  const nlohmann::json meta = {{"world", t.mesh().world().size()},
                               {"mesh", {{"dp", o.mesh.dp}, {"tp", o.mesh.tp}, {"pp", o.mesh.pp}}},
                               {"zero_stage", o.zero_stage},
                               {"loss_scaler", loom::checkpoint::scaler_json(t.loss_scaler())}};
  const auto chunks = detail::checkpoint_chunks(t);
  return loom::checkpoint::save(t.mesh().world(), root, t.steps(), std::span(std::as_const(chunks)),
                                detail::tensor_shapes(t.model().cfg()), meta, {keep_last});
}

/// Loads a checkpoint saved by save_checkpoint on any mesh and ZeRO stage into `t` (the same
/// model), so that the next step continues the saved run. Collective over the world.
template <class P, class T, class C>
void load_checkpoint(trainer<P, T, C>& t, const std::string& path) {
  const loom::checkpoint::reader ck(path);
  ck.check_model(detail::tensor_shapes(t.model().cfg()));
  const auto chunks = detail::checkpoint_chunks(t);
  loom::checkpoint::load(ck, std::span(std::as_const(chunks)));
  loom::checkpoint::restore_scaler(ck, t.loss_scaler());
  t.restore(ck.step());
}

}  // namespace llama3d
