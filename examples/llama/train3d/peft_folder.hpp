#pragma once
// The decoder's LoRA tensors and PEFT's adapter folder (lora/peft.hpp): which PEFT tensor is
// loom's `layers.{i}.<tensor>.lora_{A,B}.weight` (<tensor> the decoder's, e.g. attention.wq),
// in which row order B of q/k is stored, and the one checked reader of a folder against a
// base model, which the trainer's import (lora_peft.hpp) and the server's adapters
// (examples/llama/generate/llama_lora.hpp) both use.
//
// Names go through the config's target module that adapts <tensor> (lora_target_of).
// Rotary rows: a LLaMA trained with interleaved pairs is exported to HF with its q/k rows
// permuted to half-split order (llama::export_hf); B of q_proj / k_proj indexes the same rows
// and takes the same permutation on export, its inverse on reading. ChatGLM: none.

#include "lora3d.hpp"

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

/// A PEFT folder read against a base model: its config, and every factor by loom's name
/// (`layers.{i}.<tensor>.lora_{A,B}.weight`, full [r, in] / [out, r]) in the base's row order.
struct lora_folder {
  loom::lora::config cfg;
  std::map<std::string, std::vector<float>> tensors;
};

/// Reads the PEFT folder `dir` for a base of config `c`. Refuses, with a loom::error naming the
/// folder and the key, module or tensor: a config PEFT's fields do not allow (r <= 0, an
/// unknown target module, ...), a target module this model does not have, a missing factor, a
/// shape that disagrees with the base layer or r, a tensor no target module explains.
inline lora_folder read_lora_peft(const std::string& dir, const llama::config& c) {
  const std::string what = "PEFT adapter '" + dir + "'";
  const loom::lora::peft_adapter a = loom::lora::load_peft(dir);
  // The layout of the factors for this base; dropout does not change it (and the trainer's
  // refusal of dropout is not the reader's business).
  loom::lora::config shape_cfg = a.cfg;
  shape_cfg.lora_dropout = 0.0;
  loom::nn::param_layout full;
  try {
    for (const std::string& m : a.cfg.target_modules) (void)lora_target_of(c, m);
    full = lora_full_layout(shape_cfg, c);
  } catch (const loom::error& e) {
    LOOM_THROW(what, ": ", e.what());
  }
  std::map<std::string, loom::lora::module_shape> shapes;
  for (const std::string& m : a.cfg.target_modules) {
    const std::string t = "layers.0." + lora_target_of(c, m).tensor;
    shapes[m] = {full.find(t + ".lora_A.weight").shape[1], full.find(t + ".lora_B.weight").shape[0]};
  }
  loom::lora::check_adapter(a.cfg, a.tensors, c.model_type, c.n_layers, shapes, what);
  lora_folder out{a.cfg, {}};
  for (const auto& e : full.entries()) {
    const auto& src = a.tensors.at(detail::peft_name_of(c, a.cfg, e.name)).data;
    std::vector<float> v(src.begin(), src.end());
    if (detail::peft_rows_permuted(c, e.name))
      loom::lora::interleaved_to_half_split_rows(std::span<float>(v), a.cfg.r, c.head_dim(), /*inverse=*/true);
    out.tensors[e.name] = std::move(v);
  }
  return out;
}

}  // namespace llama3d
