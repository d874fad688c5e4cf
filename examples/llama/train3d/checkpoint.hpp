#pragma once
// The mesh trainer's sharded checkpoints: loom::checkpoint (include/loom/checkpoint/
// sharded.hpp) over the trainer's model chunks and ZeRO engines. The manifest also records
// the mesh and stage it was saved at, the seed, the lr schedule's position (the step), the
// data cursor (micro-batches consumed: step x micro-batches per step) and the loss scaler's
// state. A resume needs the same seed and micro-batches per step (else its data would not
// continue the saved run's); the mesh and ZeRO stage may differ.
// A LoRA run's checkpoint holds its training state: the adapters' engine (fp32 master and Adam
// moments of every factor, by their lora_full_layout names) and, where a schedule unfreezes
// base tensors, the base engines' (by the model's names); the manifest's "lora" records r,
// alpha, the scaling rule, the targets and the base's kind, which a resume must share. The
// frozen base is not training state: a resumed run takes it as the saved run did
// (init_from_hf before load_checkpoint; llama-train --init-from with --resume).

#include "train3d.hpp"

#include <loom/checkpoint/sharded.hpp>
#include <loom/data/json_input.hpp>

#include <algorithm>
#include <functional>
#include <map>
#include <span>
#include <string>
#include <vector>

namespace llama3d {

namespace detail {
// Each chunk's engines with the shards that name their layout: the model's engine, or under
// LoRA the adapters' engine and, where a schedule trains the chunk's base, the base engine.
template <class P, class T, class C>
auto checkpoint_chunks(trainer<P, T, C>& t) {
  using engine_t = std::remove_reference_t<decltype(t.engine(0))>;
  std::vector<loom::checkpoint::chunk<engine_t>> out;
  for (int c = 0; c < t.chunks(); ++c) {
    if (!t.options().lora) {
      out.push_back({&t.model(c).shards(), &t.engine(c)});
      continue;
    }
    out.push_back({&t.lora(c)->shards(), &t.engine(c)});
    if (auto* b = t.base_engine(c)) out.push_back({&t.model(c).shards(), b});
  }
  return out;
}

inline void add_shapes(loom::checkpoint::tensor_shapes& s, const loom::nn::param_layout& layout,
                       const std::function<bool(const std::string&)>& keep = {}) {
  for (const auto& e : layout.entries())
    if (!keep || keep(e.name)) s[e.name] = std::vector<std::int64_t>(e.shape.begin(), e.shape.end());
}

// The checkpoint's tensors: the model's (full_layout); under LoRA the adapters'
// (lora_full_layout) and the base tensors of every chunk whose base is in an engine on some
// rank (a schedule trains part of it): the frozen rest is no training state, it comes from
// where the run took it (init_from_hf, or the seed's init). Collective over the world (LoRA).
template <class P, class T, class C>
loom::checkpoint::tensor_shapes tensor_shapes(trainer<P, T, C>& t) {
  const llama::config& cfg = t.model().cfg();
  loom::checkpoint::tensor_shapes s;
  const auto full = full_layout(cfg);
  if (!t.options().lora) {
    add_shapes(s, full);
    return s;
  }
  add_shapes(s, lora_full_layout(*t.options().lora, cfg));
  std::map<std::string, std::size_t> index;
  for (const auto& e : full.entries()) index.emplace(e.name, index.size());
  std::vector<double> held(index.size(), 0.0);
  for (int c = 0; c < t.chunks(); ++c)
    if (t.base_engine(c))
      for (const auto& sh : t.model(c).shards()) held[index.at(sh.name)] = 1.0;
  t.mesh().world().all_reduce(std::span<const double>(held), std::span<double>(held), loom::comm::reduce_op::sum);
  add_shapes(s, full, [&](const std::string& n) { return held[index.at(n)] > 0; });
  return s;
}

// A LoRA run's settings as the manifest records them: a resume must have the same.
inline nlohmann::json lora_json(const train_options& o) {
  const auto& l = *o.lora;
  std::vector<std::string> targets = l.target_modules;
  std::sort(targets.begin(), targets.end());
  return {{"r", l.r}, {"lora_alpha", l.lora_alpha}, {"use_rslora", l.use_rslora}, {"target_modules", targets},
          {"lora_base", to_string(o.lora_base)}};
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
  nlohmann::json m = meta;
  if (o.lora) m["lora"] = detail::lora_json(o);
  const auto chunks = detail::checkpoint_chunks(t);
  return loom::checkpoint::save(t.mesh().world(), root, t.steps(), std::span(std::as_const(chunks)), detail::tensor_shapes(t),
                                m, {keep_last});
}

/// Loads a checkpoint saved by save_checkpoint on any mesh and ZeRO stage into `t` (the same
/// model), so that the next step continues the saved run. Collective over the world.
template <class P, class T, class C>
void load_checkpoint(trainer<P, T, C>& t, const std::string& path) {
  const loom::checkpoint::reader ck(path);
  {
    // a LoRA run's state is its adapters': the same r, alpha, scaling rule, targets and base
    // (the manifest's values quoted bounded: they are outside bytes)
    const auto& mf = ck.manifest();
    const std::string what = "checkpoint '" + ck.dir() + "'";
    const bool saved_lora = mf.contains("lora");
    LOOM_CHECK(saved_lora == t.options().lora.has_value(), what, saved_lora ? ": was saved by a LoRA run (its state is "
               "adapters: \"lora\" " + loom::data::quote_json(mf["lora"]) + "); this run has no LoRA adapters"
               : ": was saved by a run without LoRA; this run has LoRA adapters (a full checkpoint is a base: --init-from "
                 "takes an HF folder, llama-train --export-hf writes one)");
    if (saved_lora) {
      const nlohmann::json& saved = mf["lora"];
      const nlohmann::json want = detail::lora_json(t.options());  // named: items() does not keep a temporary alive
      for (const auto& [k, v] : want.items()) {
        const bool has = saved.is_object() && saved.contains(k);
        LOOM_CHECK(has && saved[k] == v, what, ": its LoRA adapters have ", k, "=",
                   has ? loom::data::quote_json(saved[k]) : std::string("(none)"), ", this run's have ", k, "=", v.dump());
      }
    }
  }
  ck.check_model(detail::tensor_shapes(t));
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
  if (t.options().lora) t.lora_capture_base();  // merged: a base engine's loaded values are the next W0
}

}  // namespace llama3d
