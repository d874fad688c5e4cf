#pragma once
// A LoRA run's adapters as a PEFT folder (adapter_config.json + adapter_model.safetensors by
// PEFT's names, lora/peft.hpp), and a PEFT folder into a LoRA run, at any mesh and ZeRO stage.
//
// Names: loom's `layers.{i}.<tensor>.lora_{A,B}.weight` (<tensor> the decoder's, e.g.
// attention.wq) <-> PEFT's `base_model.model.<family's module path>.lora_{A,B}.weight`
// through the config's target module that adapts <tensor> (lora_target_of).
// Rotary rows: a LLaMA trained with interleaved pairs is exported to HF with its q/k rows
// permuted to half-split order (llama::export_hf); B of q_proj / k_proj indexes the same rows
// and takes the same permutation here (and its inverse on import). ChatGLM: none.
// Import reads the folder on every rank, checks it against the trainer's adapters (config
// fields, every tensor's presence and shape, nothing extra: loom::error naming the folder and
// the tensor or field) and loads each rank's owned slices of the fp32 master the way a
// sharded checkpoint is loaded (loom::checkpoint::load), Adam moments zero.

#include "train3d.hpp"

#include <loom/checkpoint/sharded.hpp>
#include <loom/lora/peft.hpp>

#include <map>
#include <string>
#include <vector>

namespace llama3d {

namespace detail {
/// (layer, decoder tensor, factor 'A' / 'B') of a loom LoRA tensor name.
struct lora_name {
  index_t layer = 0;
  std::string tensor;
  char factor = 'A';
};
inline lora_name parse_lora_name(const std::string& n) {
  const std::size_t dot = n.find('.', 7), suffix = n.rfind(".lora_");
  LOOM_CHECK(n.starts_with("layers.") && dot != std::string::npos && suffix != std::string::npos && suffix > dot,
             "lora: '", n, "' is not a LoRA tensor name");
  return {std::stoll(n.substr(7, dot - 7)), n.substr(dot + 1, suffix - dot - 1), n[suffix + 6]};
}
/// PEFT's name of loom LoRA tensor `n`.
inline std::string peft_name_of(const llama::config& c, const loom::lora::config& lc, const std::string& n) {
  const lora_name p = parse_lora_name(n);
  for (const std::string& m : lc.target_modules)
    if (lora_target_of(c, m).tensor == p.tensor) return loom::lora::peft_tensor_name(c.model_type, p.layer, m, p.factor);
  LOOM_THROW("lora: no target module adapts '", p.tensor, "'");
}
/// Whether B of tensor `n` is stored in HF's half-split row order (LLaMA q/k trained interleaved).
inline bool peft_rows_permuted(const llama::config& c, const std::string& n) {
  const lora_name p = parse_lora_name(n);
  return c.model_type == "llama" && c.rope == loom::ops::rope_style::interleaved && p.factor == 'B' &&
         (p.tensor == "attention.wq" || p.tensor == "attention.wk");
}
}  // namespace detail

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
  const loom::lora::peft_adapter a = loom::lora::load_peft(dir);
  LOOM_CHECK(a.cfg.r == lc.r && a.cfg.lora_alpha == lc.lora_alpha && a.cfg.use_rslora == lc.use_rslora, what, ": r=", a.cfg.r,
             " lora_alpha=", a.cfg.lora_alpha, " use_rslora=", a.cfg.use_rslora, ", this run has r=", lc.r,
             " lora_alpha=", lc.lora_alpha, " use_rslora=", lc.use_rslora);
  const auto full = lora_full_layout(lc, c);
  std::map<std::string, loom::lora::module_shape> shapes;
  for (const std::string& m : lc.target_modules) {
    const auto& A = full.find("layers.0." + lora_target_of(c, m).tensor + ".lora_A.weight");
    const auto& B = full.find("layers.0." + lora_target_of(c, m).tensor + ".lora_B.weight");
    shapes[m] = {A.shape[1], B.shape[0]};
  }
  auto fc = a.cfg;
  LOOM_CHECK(std::is_permutation(fc.target_modules.begin(), fc.target_modules.end(), lc.target_modules.begin(),
                                 lc.target_modules.end()),
             what, ": target_modules ", nlohmann::json(fc.target_modules).dump(), ", this run adapts ",
             nlohmann::json(lc.target_modules).dump());
  loom::lora::check_adapter(fc, a.tensors, c.model_type, c.n_layers, shapes, what);
  std::map<std::string, std::vector<float>> mine;  // loom names, loom's row order
  for (const auto& e : full.entries()) {
    const auto& src = a.tensors.at(detail::peft_name_of(c, lc, e.name)).data;
    std::vector<float> v(src.begin(), src.end());
    if (detail::peft_rows_permuted(c, e.name))
      loom::lora::interleaved_to_half_split_rows(std::span<float>(v), lc.r, c.head_dim(), /*inverse=*/true);
    mine[e.name] = std::move(v);
  }
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
