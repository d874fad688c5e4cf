#pragma once
// LoRA adapters in PEFT's own folder layout, so a PEFT user loads what loom trained and the
// other way round:
//   adapter_config.json        peft_type "LORA", r, lora_alpha, lora_dropout, use_rslora,
//                              target_modules, bias "none", task_type, base_model_name_or_path
//   adapter_model.safetensors  per adapted module `<path>.lora_A.weight` [r, in] and
//                              `<path>.lora_B.weight` [out, r], with PEFT's module paths:
//     LLaMA    base_model.model.model.layers.{i}.self_attn.{q,k,v,o}_proj
//              base_model.model.model.layers.{i}.mlp.{gate,up,down}_proj
//     ChatGLM  base_model.model.transformer.encoder.layers.{i}.self_attention.{query_key_value,dense}
//              base_model.model.transformer.encoder.layers.{i}.mlp.{dense_h_to_4h,dense_4h_to_h}
//
// Rotary layout: an HF LLaMA stores q_proj / k_proj rows for half-split rotary. A model
// trained with interleaved pairs (Meta's convention) has its base q/k rows permuted on HF
// export; B's rows index the same outputs, so they take the same permutation
// (interleaved_to_half_split_rows) and A, which indexes inputs, none. Import applies the
// inverse. ChatGLM rotates interleaved pairs in HF too: nothing is permuted.
//
// Reading is checked against the base before anything is used: a module the base does not
// have, a missing factor, a shape that disagrees with the base layer or with r, a config
// whose fields are out of range - each a loom::error naming the file, the tensor or key and
// the value.

#include <loom/core/error.hpp>
#include <loom/data/json_input.hpp>
#include <loom/io/safetensors.hpp>
#include <loom/io/tensor_map.hpp>
#include <loom/lora/config.hpp>

#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace loom::lora {

/// Whether `module` is one of `family`'s ("llama" or "chatglm") linear layers.
inline bool family_has(std::string_view family, std::string_view module) {
  const auto begin = known_modules.begin(), split = begin + 7;  // LLaMA's seven, then ChatGLM's four
  if (family == "llama") return std::find(begin, split, module) != split;
  if (family == "chatglm") return std::find(split, known_modules.end(), module) != known_modules.end();
  LOOM_THROW("lora: unknown model family '", std::string(family.substr(0, 64)), "' (llama or chatglm)");
}

/// PEFT's path of module `module` of layer `layer` (without the .lora_A/B.weight suffix).
inline std::string peft_module_path(std::string_view family, index_t layer, std::string_view module) {
  LOOM_CHECK(family_has(family, module), "lora: target module '", std::string(module), "' is not a layer of a ",
             std::string(family), " model");
  const std::string l = std::to_string(layer) + ".", m(module);
  if (family == "llama") {
    const bool attn = m == "q_proj" || m == "k_proj" || m == "v_proj" || m == "o_proj";
    return "base_model.model.model.layers." + l + (attn ? "self_attn." : "mlp.") + m;
  }
  const bool attn = m == "query_key_value" || m == "dense";
  return "base_model.model.transformer.encoder.layers." + l + (attn ? "self_attention." : "mlp.") + m;
}
/// `<module path>.lora_A.weight` (factor 'A') or `.lora_B.weight` ('B').
inline std::string peft_tensor_name(std::string_view family, index_t layer, std::string_view module, char factor) {
  LOOM_CHECK(factor == 'A' || factor == 'B', "lora: factor must be 'A' or 'B', got '", factor, "'");
  return peft_module_path(family, layer, module) + ".lora_" + factor + ".weight";
}

/// The rows of t ([rows, cols], rows a multiple of head_dim) of each head from interleaved
/// pairs (row 2i + p of a head) to half-split order (row p * head_dim / 2 + i), or back with
/// inverse. What an HF LLaMA export does to q/k rows, applied to B.
inline void interleaved_to_half_split_rows(std::span<float> t, index_t cols, index_t head_dim, bool inverse = false) {
  LOOM_CHECK(cols > 0 && head_dim > 0 && head_dim % 2 == 0, "lora: head_dim must be even and > 0, got head_dim=", head_dim);
  const auto c = static_cast<std::size_t>(cols), hd = static_cast<std::size_t>(head_dim);
  LOOM_CHECK(t.size() % (c * hd) == 0, "lora: a tensor of ", t.size(), " elements is not whole heads of ", head_dim,
             " rows of ", cols);
  const std::vector<float> in(t.begin(), t.end());
  for (std::size_t row = 0; row < t.size() / c; ++row) {
    const std::size_t h = row / hd, i = (row % hd) / 2, p = row % 2, other = h * hd + p * hd / 2 + i;
    const std::size_t from = inverse ? other : row, to = inverse ? row : other;
    std::copy_n(in.begin() + static_cast<std::ptrdiff_t>(from * c), c, t.begin() + static_cast<std::ptrdiff_t>(to * c));
  }
}

/// adapter_config.json's content for `c` (PEFT's keys; bias "none", task_type CAUSAL_LM).
inline nlohmann::json adapter_config_json(const config& c, const std::string& base_model_name_or_path = "") {
  c.validate();
  return {{"peft_type", "LORA"},
          {"task_type", "CAUSAL_LM"},
          {"base_model_name_or_path", base_model_name_or_path},
          {"r", c.r},
          {"lora_alpha", c.lora_alpha},
          {"lora_dropout", c.lora_dropout},
          {"use_rslora", c.use_rslora},
          {"target_modules", c.target_modules},
          {"bias", "none"},
          {"fan_in_fan_out", false},
          {"inference_mode", true},
          {"init_lora_weights", true}};
}

/// The largest rank an adapter_config.json may state: far above any layer's width, so it only
/// stops a count no model could match before it reaches an allocation.
inline constexpr std::int64_t max_rank = std::int64_t{1} << 24;

/// The config an adapter_config.json describes; refuses (naming `what` and the key) a non-LoRA
/// peft_type, a bias other than "none", a missing or mistyped key, values validate() refuses.
inline config config_from_adapter_json(const nlohmann::json& j, const std::string& what) {
  LOOM_CHECK(j.is_object(), what, ": not a JSON object");
  auto get = [&](const char* key) -> const nlohmann::json& {
    LOOM_CHECK(j.contains(key), what, ": key '", key, "' is missing");
    return j.at(key);
  };
  const auto& type = get("peft_type");
  LOOM_CHECK(type.is_string() && type.get<std::string>() == "LORA", what, ": peft_type is ", loom::data::quote_json(type),
             ", loom reads \"LORA\" adapters");
  if (j.contains("bias"))
    LOOM_CHECK(j["bias"] == "none", what, ": bias is ", loom::data::quote_json(j["bias"]), ", loom's adapters train no biases (\"none\")");
  config c;
  // Range-checked as read: a number the JSON holds as unsigned or as a float is never wrapped
  // or narrowed into a different value (r = 2^64 - 1 is not r = -1).
  c.r = loom::data::json_integer(get("r"), what + ": r", 1, max_rank);
  constexpr double big = std::numeric_limits<double>::max();
  c.lora_alpha = loom::data::json_real<double>(get("lora_alpha"), what + ": lora_alpha", -big, big);
  if (j.contains("lora_dropout")) c.lora_dropout = loom::data::json_real<double>(j["lora_dropout"], what + ": lora_dropout", 0.0, 1.0);
  if (j.contains("use_rslora")) {
    LOOM_CHECK(j["use_rslora"].is_boolean(), what, ": use_rslora is ", loom::data::quote_json(j["use_rslora"]), ", expected true or false");
    c.use_rslora = j["use_rslora"].get<bool>();
  }
  const auto& t = get("target_modules");
  LOOM_CHECK(t.is_array() || t.is_string(), what, ": target_modules is ", loom::data::quote_json(t),
             ", expected a list of module names");
  c.target_modules.clear();
  if (t.is_string()) c.target_modules.push_back(t.get<std::string>());
  for (const auto& m : t.is_array() ? t : nlohmann::json::array()) {
    LOOM_CHECK(m.is_string(), what, ": target_modules holds ", loom::data::quote_json(m), ", expected module names");
    c.target_modules.push_back(m.get<std::string>());
  }
  try {
    c.validate();
  } catch (const error& e) {
    LOOM_THROW(what, ": ", e.what());
  }
  return c;
}

/// The base layer an adapted module wraps: its weight's shape [out, in].
struct module_shape {
  index_t in = 0, out = 0;
};

/// Refuses an adapter (tensors by PEFT's names) that does not fit the base: every layer in
/// [0, n_layers) and every target module needs lora_A [r, in] and lora_B [out, r] with the
/// base's shape for it (`shapes`, by module name); any other tensor is refused too.
inline void check_adapter(const config& c, const io::tensor_map& tensors, std::string_view family, index_t n_layers,
                          const std::map<std::string, module_shape>& shapes, const std::string& what) {
  c.validate();
  std::set<std::string> expected;
  for (const std::string& m : c.target_modules) {
    LOOM_CHECK(family_has(family, m), what, ": target module '", m, "' is not a layer of the ", std::string(family),
               " base model");
    const auto s = shapes.find(m);
    LOOM_CHECK(s != shapes.end(), what, ": target module '", m, "' has no base layer shape");
    for (index_t l = 0; l < n_layers; ++l)
      for (const char f : {'A', 'B'}) {
        const std::string name = peft_tensor_name(family, l, m, f);
        const auto it = tensors.find(name);
        LOOM_CHECK(it != tensors.end(), what, ": tensor '", name, "' is missing (target module '", m, "')");
        const std::vector<std::int64_t> want = f == 'A' ? std::vector<std::int64_t>{c.r, s->second.in}
                                                        : std::vector<std::int64_t>{s->second.out, c.r};
        LOOM_CHECK(it->second.shape == want, what, ": tensor '", name, "' has shape ", nlohmann::json(it->second.shape).dump(),
                   ", the base model with r=", c.r, " needs ", nlohmann::json(want).dump());
        expected.insert(name);
      }
  }
  for (const auto& [name, t] : tensors)
    LOOM_CHECK(expected.contains(name), what, ": tensor '", name.substr(0, 200),
               "' matches no target module of the base model (target_modules ", loom::data::quote_json(nlohmann::json(c.target_modules)), ")");
}

/// Writes `dir`/adapter_config.json and `dir`/adapter_model.safetensors (F32 unless dtype
/// says F16 / BF16). `tensors` are already in PEFT's names and layout.
inline void save_peft(const std::string& dir, const config& c, const io::tensor_map& tensors,
                      const std::string& base_model_name_or_path = "", const std::string& dtype = "F32") {
  namespace fs = std::filesystem;
  const nlohmann::json j = adapter_config_json(c, base_model_name_or_path);
  fs::create_directories(dir);
  std::ofstream f(fs::path(dir) / "adapter_config.json");
  LOOM_CHECK(f.good(), "lora::save_peft: cannot create '", (fs::path(dir) / "adapter_config.json").string(), "'");
  f << j.dump(2) << "\n";
  f.close();
  LOOM_CHECK(f.good(), "lora::save_peft: writing '", (fs::path(dir) / "adapter_config.json").string(), "' failed");
  io::write_safetensors((fs::path(dir) / "adapter_model.safetensors").string(), tensors, dtype, {{"format", "pt"}});
}

/// A PEFT adapter folder read back: its config and its tensors (by PEFT's names, as float).
struct peft_adapter {
  config cfg;
  io::tensor_map tensors;
};
inline peft_adapter load_peft(const std::string& dir) {
  namespace fs = std::filesystem;
  const std::string cfg_path = (fs::path(dir) / "adapter_config.json").string();
  const std::vector<char> bytes = io::detail::read_file_bytes(cfg_path);
  const nlohmann::json j = data::parse_json_input(std::string_view(bytes.data(), bytes.size()), "'" + cfg_path + "'");
  peft_adapter a{config_from_adapter_json(j, "'" + cfg_path + "'"), {}};
  a.tensors = io::read_safetensors((fs::path(dir) / "adapter_model.safetensors").string());
  return a;
}

}  // namespace loom::lora
