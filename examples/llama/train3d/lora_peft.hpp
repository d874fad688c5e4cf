#pragma once
// A LoRA run's adapters as a PEFT folder (adapter_config.json + adapter_model.safetensors by
// PEFT's names, lora/peft.hpp), and a PEFT folder into a LoRA run, at any mesh and ZeRO stage.
//
// Names and the q/k row order of B: peft_folder.hpp, whose reader import uses.
// Import reads the folder on every rank (read_lora_peft: every tensor's presence and shape,
// nothing extra, loom::error naming the folder and the tensor or field), checks its config
// against the trainer's adapters and loads each rank's owned slices of the fp32 master the way a
// sharded checkpoint is loaded (loom::checkpoint::load), Adam moments zero.

#include "peft_folder.hpp"
#include "train3d.hpp"

#include <loom/checkpoint/sharded.hpp>

#include <map>
#include <string>
#include <vector>

namespace llama3d {

/// Writes the run's adapters (consolidated fp32 master) as a PEFT folder in `dir` (world rank
/// 0 writes). Collective over the world.
template <class P, class T, class C>
void export_lora_peft(trainer<P, T, C>& t, const std::string& dir, const std::string& base_model_name_or_path = "") {
  LOOM_CHECK(t.options().lora, "llama3d::export_lora_peft: this run has no LoRA adapters");
  const auto& lc = *t.options().lora;
  const llama::config& c = t.model().cfg();
  const std::vector<float> all = t.consolidated_lora();
  if (t.mesh().world().rank() != 0) return;
  loom::io::tensor_map out;
  const auto full = lora_full_layout(lc, c);
  for (const auto& e : full.entries()) {
    loom::io::named_tensor nt{std::vector<std::int64_t>(e.shape.begin(), e.shape.end()), loom::buffer<float>(e.numel)};
    std::copy_n(all.begin() + static_cast<std::ptrdiff_t>(e.offset), e.numel, nt.data.begin());
    if (detail::peft_rows_permuted(c, e.name)) loom::lora::interleaved_to_half_split_rows(nt.data.span(), lc.r, c.head_dim());
    out[detail::peft_name_of(c, lc, e.name)] = std::move(nt);
  }
  loom::lora::save_peft(dir, lc, out, base_model_name_or_path);
}

/// Loads the PEFT folder `dir` into the run's adapters (fp32 master and parameters; Adam
/// moments zero). Its config must be the run's (r, lora_alpha, use_rslora, target_modules).
/// Collective over the world.
template <class P, class T, class C>
void import_lora_peft(trainer<P, T, C>& t, const std::string& dir) {
  LOOM_CHECK(t.options().lora, "llama3d::import_lora_peft: this run has no LoRA adapters");
  const auto& lc = *t.options().lora;
  const llama::config& c = t.model().cfg();
  const std::string what = "PEFT adapter '" + dir + "'";
  const lora_folder a = read_lora_peft(dir, c);
  LOOM_CHECK(a.cfg.r == lc.r && a.cfg.lora_alpha == lc.lora_alpha && a.cfg.use_rslora == lc.use_rslora, what, ": r=", a.cfg.r,
             " lora_alpha=", a.cfg.lora_alpha, " use_rslora=", a.cfg.use_rslora, ", this run has r=", lc.r,
             " lora_alpha=", lc.lora_alpha, " use_rslora=", lc.use_rslora);
  LOOM_CHECK(std::is_permutation(a.cfg.target_modules.begin(), a.cfg.target_modules.end(), lc.target_modules.begin(),
                                 lc.target_modules.end()),
             what, ": target_modules ", nlohmann::json(a.cfg.target_modules).dump(), ", this run adapts ",
             nlohmann::json(lc.target_modules).dump());
  const std::map<std::string, std::vector<float>>& mine = a.tensors;  // loom names, loom's row order
  struct source {
    const std::map<std::string, std::vector<float>>* t;
    void read(int kind, const std::string& name, std::size_t first, std::span<float> out) const {
      if (kind != 0) return std::fill(out.begin(), out.end(), 0.f);  // Adam starts from zero moments
      const auto& v = t->at(name);
      std::copy_n(v.begin() + static_cast<std::ptrdiff_t>(first), out.size(), out.begin());
    }
  } src{&mine};
  using engine_t = std::remove_reference_t<decltype(t.engine(0))>;
  std::vector<loom::checkpoint::chunk<engine_t>> chunks;
  for (int k = 0; k < t.chunks(); ++k) chunks.push_back({&t.lora(k)->shards(), &t.engine(k)});
  loom::checkpoint::load(src, std::span(std::as_const(chunks)));
  t.restore(t.steps());  // the parameters from the master
}

}  // namespace llama3d
