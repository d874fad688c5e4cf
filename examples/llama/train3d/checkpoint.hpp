#pragma once
// The mesh trainer's sharded checkpoints: loom::checkpoint (include/loom/checkpoint/
// sharded.hpp) over the trainer's model chunks and ZeRO engines. The manifest also records
// the mesh and stage it was saved at, the seed, the lr schedule's position (the step), the
// data cursor (micro-batches consumed: step x micro-batches per step) and the loss scaler's
// state. A resume needs the same seed and micro-batches per step (else its data would not
// continue the saved run's); the mesh and ZeRO stage may differ.

#include "train3d.hpp"

#include <loom/checkpoint/sharded.hpp>

#include <string>
#include <vector>

namespace llama3d {

namespace detail {
template <class P, class T, class C>
auto checkpoint_chunks(trainer<P, T, C>& t) {
  LOOM_CHECK(!t.options().lora, "llama3d: sharded checkpoints of a LoRA run are not supported (its engine holds the "
             "adapters, not the model); write the adapters as a PEFT folder (export_lora_peft, llama-train --export-lora)");
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
  const std::int64_t G = std::int64_t(o.mesh.dp) * o.micro_batches;  // micro-batches a step takes
  const nlohmann::json meta = {{"world", t.mesh().world().size()},
                               {"mesh", {{"dp", o.mesh.dp}, {"tp", o.mesh.tp}, {"pp", o.mesh.pp}}},
                               {"zero_stage", o.zero_stage},
                               {"seed", o.seed},
                               {"lr_step", t.steps()},
                               {"data", {{"micro_batches_per_step", G}, {"cursor", t.steps() * G}}},
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
  // the run continues the saved one only with its data order: the same seed (the data's and
  // the model's RNG) and the same micro-batches per step (micro-batch g of step t is batch
  // t G + g); a different mesh or stage is fine
  const auto& o = t.options();
  const auto& m = ck.manifest();
  const std::string what = "checkpoint '" + ck.dir() + "'";
  if (m.contains("seed"))
    LOOM_CHECK(m["seed"].is_number_unsigned() && m["seed"].get<std::uint64_t>() == o.seed, what, ": saved with seed ",
               loom::data::quote_json(m["seed"]), ", this run has seed=", o.seed, " (its data order would differ; pass that seed)");
  if (m.contains("data") && m["data"].is_object() && m["data"].contains("micro_batches_per_step")) {
    const std::int64_t saved = loom::data::json_integer(m["data"]["micro_batches_per_step"], what + ": data.micro_batches_per_step", 1, INT64_MAX);
    const std::int64_t now = std::int64_t(o.mesh.dp) * o.micro_batches;
    LOOM_CHECK(saved == now, what, ": saved with ", saved, " micro-batches per step (dp x micro-batches), this run takes ", now,
               " (dp=", o.mesh.dp, ", micro_batches=", o.micro_batches, "): the data cursor would not continue the saved run");
  }
  const auto chunks = detail::checkpoint_chunks(t);
  loom::checkpoint::load(ck, std::span(std::as_const(chunks)));
  loom::checkpoint::restore_scaler(ck, t.loss_scaler());
  t.restore(ck.step());
}

}  // namespace llama3d
