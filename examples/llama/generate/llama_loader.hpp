#pragma once
// The decoder for inference as the checkpoint readers give it: the one llama::config and the
// fp32 parameters in the single-rank model's flat layout (llama3d::full_layout, Meta's
// names), filled tensor by tensor by name from the formats loom::io reads:
//  - llama2.c (legacy or version 1): Meta names, adjacent-pair RoPE;
//  - HF safetensors (one file, or shards in a folder, listed by model.safetensors.index.json
//    when there is one) + config.json, by its model_type:
//      llama:   HF names, half-split RoPE (HF stores q/k rows permuted for it, so no
//               un-permuting is needed);
//      chatglm: ChatGLM2/3 (transformer.encoder.layers.N...): query_key_value and
//               dense_h_to_4h are the decoder's fused wqkv and w13 as they are (the same rows
//               [Q | K | V] and [gate | up]), rotary on the first half of each head in
//               interleaved pairs; ChatGLM-6B v1 is refused, naming what the decoder lacks;
// and the tokenizer that comes with llama2.c models. `load_checkpoint` picks the format from
// the path: a folder or *.safetensors file is HF, anything else llama2.c. `export_hf` writes
// a trained model back as an HF folder of its model_type. `hf_folder` opens an HF folder for
// range reads (headers first, then any slice of any tensor): the mesh trainer's
// llama3d::init_from_hf reads through it only what each rank owns.

#include <llama/model/config.hpp>
#include <llama/model3d/llama3d.hpp>

#include <loom/checkpoint/sharded.hpp>
#include <loom/core/buffer.hpp>
#include <loom/core/random.hpp>
#include <loom/io/llama2c.hpp>
#include <loom/io/safetensors.hpp>
#include <loom/io/tensor_map.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace llama {

/// A model for the engine: its config and parameters, one flat buffer of full_layout(cfg).
struct flat_weights {
  config cfg;
  loom::nn::param_layout layout;  // llama3d::full_layout(cfg)
  loom::buffer<float> params;     // [layout.size()]

  /// The tensor called `name` (Meta's names), for readers and tests.
  std::span<const float> tensor(const std::string& name) const {
    const auto& e = layout.find(name);
    return params.span().subspan(e.offset, e.numel);
  }

  /// Every tensor of full_layout(c) from `source(name, shape)`, which names a missing or
  /// misshapen tensor in a loom::error; padding stays zero.
  static flat_weights fill(const config& c, const std::function<std::span<const float>(const loom::nn::param_info&)>& source) {
    flat_weights w{c, llama3d::full_layout(c), {}};
    w.params = loom::buffer<float>(w.layout.size());
    std::fill(w.params.begin(), w.params.end(), 0.f);
    for (const auto& e : w.layout.entries()) {
      const auto t = source(e);
      std::copy(t.begin(), t.end(), w.params.begin() + static_cast<std::ptrdiff_t>(e.offset));
    }
    return w;
  }

  /// Random weights (normal, scaled by 1/sqrt(fan-in), the embedding by 1; biases by 0.1; norms
  /// uniform in [0.8, 1.2]) for tests and benchmarks: a model whose tokens depend on the context.
  static flat_weights random(const config& c, std::uint64_t seed) {
    const loom::counter_rng rng(seed);
    loom::buffer<float> t;
    return fill(c, [&](const loom::nn::param_info& e) {
      t = loom::buffer<float>(e.numel);
      if (e.name.ends_with("norm.weight")) rng.fill_uniform(t.span(), e.offset, 0.8f, 1.2f);
      else if (e.shape.size() == 1) rng.fill_normal(t.span(), e.offset, 0.f, 0.1f);  // a bias (ChatGLM's q/k/v) has no fan-in
      else rng.fill_normal(t.span(), e.offset, 0.f, e.name == "tok_embeddings.weight" ? 1.f : 1.f / std::sqrt(float(e.shape[1])));
      return std::span<const float>(t.span());
    });
  }
};

namespace detail {
using name_pair = std::pair<const char*, const char*>;
/// A family's name of a tensor of the layout: `top` maps whole names, `layer` the part after
/// "layers.<l>." (which becomes `layers` + "<l>.").
inline std::string rename_in(const std::string& meta, std::span<const name_pair> top, const std::string& layers,
                             std::span<const name_pair> layer, const char* family) {
  for (auto [m, h] : top)
    if (meta == m) return h;
  if (meta.starts_with("layers.")) {
    const auto dot = meta.find('.', 7);  // "layers.<l>.<rest>"
    for (auto [m, h] : layer)
      if (dot != std::string::npos && meta.compare(dot + 1, std::string::npos, m) == 0)
        return layers + meta.substr(7, dot - 6) + h;
  }
  LOOM_THROW("llama loader: no ", family, " name for parameter '", meta, "'");
}

/// HF LLaMA's name of a tensor of the layout.
inline std::string hf_name(const std::string& meta) {
  static constexpr name_pair top[] = {
      {"tok_embeddings.weight", "model.embed_tokens.weight"}, {"norm.weight", "model.norm.weight"}, {"output.weight", "lm_head.weight"}};
  static constexpr name_pair layer[] = {
      {"attention_norm.weight", "input_layernorm.weight"}, {"attention.wq.weight", "self_attn.q_proj.weight"},
      {"attention.wk.weight", "self_attn.k_proj.weight"},  {"attention.wv.weight", "self_attn.v_proj.weight"},
      {"attention.wo.weight", "self_attn.o_proj.weight"},  {"ffn_norm.weight", "post_attention_layernorm.weight"},
      {"feed_forward.w1.weight", "mlp.gate_proj.weight"},   {"feed_forward.w2.weight", "mlp.down_proj.weight"},
      {"feed_forward.w3.weight", "mlp.up_proj.weight"}};
  return rename_in(meta, top, "model.layers.", layer, "HF LLaMA");
}

/// HF ChatGLM2/3's name of a tensor of the (fused) layout.
inline std::string chatglm_name(const std::string& meta) {
  static constexpr name_pair top[] = {{"tok_embeddings.weight", "transformer.embedding.word_embeddings.weight"},
                                      {"norm.weight", "transformer.encoder.final_layernorm.weight"},
                                      {"output.weight", "transformer.output_layer.weight"}};
  static constexpr name_pair layer[] = {{"attention_norm.weight", "input_layernorm.weight"},
                                        {"attention.wqkv.weight", "self_attention.query_key_value.weight"},
                                        {"attention.wqkv.bias", "self_attention.query_key_value.bias"},
                                        {"attention.wo.weight", "self_attention.dense.weight"},
                                        {"ffn_norm.weight", "post_attention_layernorm.weight"},
                                        {"feed_forward.w13.weight", "mlp.dense_h_to_4h.weight"},
                                        {"feed_forward.w2.weight", "mlp.dense_4h_to_h.weight"}};
  return rename_in(meta, top, "transformer.encoder.layers.", layer, "HF ChatGLM");
}

/// A checkpoint's tensors and the file each came from (for messages).
struct named_tensors {
  loom::io::tensor_map tensors;
  std::map<std::string, std::string> file;

  void add(const std::filesystem::path& f) {
    for (auto& [name, t] : loom::io::read_safetensors(f.string())) {
      LOOM_CHECK(!tensors.contains(name), "tensor '", name, "' is in both '", file[name], "' and '", f.string(), "'");
      file[name] = f.string();
      tensors.emplace(name, std::move(t));
    }
  }
};

/// The shard files of HF folder `p` and the tensors each holds as its
/// model.safetensors.index.json lists them (each file must exist), or, without an index, every
/// *.safetensors in it (tensors unlisted: empty).
inline std::map<std::string, std::vector<std::string>> hf_shard_files(const std::filesystem::path& p) {
  namespace fs = std::filesystem;
  std::map<std::string, std::vector<std::string>> shards;  // file -> its tensors
  const fs::path index = p / "model.safetensors.index.json";
  if (fs::exists(index)) {
    const std::string what = "'" + index.string() + "'";
    const auto j = loom::data::parse_json_input(loom::io::detail::read_file_bytes(index.string()), what);
    LOOM_CHECK(j.is_object() && j.contains("weight_map") && j["weight_map"].is_object(), what,
               ": no \"weight_map\" object");
    for (const auto& [name, f] : j["weight_map"].items()) {
      LOOM_CHECK(f.is_string(), what, ": weight_map[\"", name.substr(0, 128), "\"] is not a file name");
      const auto file = f.get<std::string>();
      LOOM_CHECK(!file.empty() && file.find('/') == std::string::npos && file != "." && file != "..", what,
                 ": weight_map[\"", name.substr(0, 128), "\"] = \"", file.substr(0, 128), "\" is not a file of the folder");
      shards[file].push_back(name);
    }
    for (const auto& [file, names] : shards)
      LOOM_CHECK(fs::is_regular_file(p / file), "shard '", (p / file).string(), "' (tensor '", names.front().substr(0, 128),
                 "' in ", what, ") is missing");
    return shards;
  }
  for (auto& e : fs::directory_iterator(p))
    if (e.path().extension() == ".safetensors") shards[e.path().filename().string()];
  LOOM_CHECK(!shards.empty(), "no .safetensors file in '", p.string(), "'");
  return shards;
}

/// The tensors of an HF checkpoint: one .safetensors file, or a folder's shards (hf_shard_files;
/// each must hold the tensors the index places in it).
inline named_tensors read_hf_tensors(const std::filesystem::path& p) {
  namespace fs = std::filesystem;
  named_tensors out;
  if (!fs::is_directory(p)) {
    out.add(p);
    return out;
  }
  for (const auto& [file, names] : hf_shard_files(p)) {
    out.add(p / file);
    for (const auto& n : names)
      LOOM_CHECK(out.tensors.contains(n) && out.file[n] == (p / file).string(), "'",
                 (p / "model.safetensors.index.json").string(), "' places tensor '", n.substr(0, 128), "' in '",
                 (p / file).string(), "', which does not hold it");
  }
  return out;
}

/// The parameters of config c from a checkpoint's tensors m (`rename`: a layout name -> the
/// checkpoint's). A missing tensor is a loom::error naming it and the checkpoint (`where`), a
/// misshapen one naming it, its file (`files`, when known) and both shapes.
inline flat_weights from_tensors(const config& c, const loom::io::tensor_map& m,
                                 std::string (*rename)(const std::string&) = nullptr, const std::string& where = "",
                                 const std::map<std::string, std::string>* files = nullptr) {
  return flat_weights::fill(c, [&](const loom::nn::param_info& e) {
    const std::string name = rename ? rename(e.name) : e.name;
    const auto it = m.find(name);
    LOOM_CHECK(it != m.end(), "tensor '", name, "' is missing from the checkpoint '", where, "'");
    if (!std::equal(it->second.shape.begin(), it->second.shape.end(), e.shape.begin(), e.shape.end())) {
      const auto str = [](const auto& shape) {
        std::string r;
        for (auto x : shape) r.append(r.empty() ? "" : ",").append(std::to_string(x));
        return r;
      };
      LOOM_THROW("tensor '", name, "' in '", files ? files->at(name) : where, "' has shape [", str(it->second.shape),
                 "], its config gives [", str(e.shape), "]");
    }
    return std::span<const float>(it->second.data.data(), e.numel);
  });
}
inline flat_weights from_tensors(const config& c, const named_tensors& m, const std::string& where,
                                 std::string (*rename)(const std::string&) = nullptr) {
  return from_tensors(c, m.tensors, rename, where, &m.file);
}

/// ChatGLM2/3's config.json (`j`, read from `path`) as the decoder's config; ChatGLM-6B v1 and
/// variants the decoder does not run are refused, naming the key.
inline config chatglm_config(const nlohmann::json& j, const std::string& path) {
  const std::string what = "config '" + path + "'";
  LOOM_CHECK(!j.contains("position_encoding_2d") && !j.contains("inner_hidden_size") && j.contains("padded_vocab_size"), what,
             ": ChatGLM-6B v1 (position_encoding_2d, no padded_vocab_size) is not supported: the decoder has no GLM 2D "
             "positions, bidirectional context mask, GeLU MLP, LayerNorm with bias, nor post-norm residuals scaled by "
             "sqrt(2 layers); ChatGLM2/3 are");
  const auto integer = [&](const char* key, std::int64_t max, std::optional<std::int64_t> fallback = std::nullopt) {
    LOOM_CHECK(j.contains(key) || fallback, what, ": missing \"", key, "\"");
    if (!j.contains(key)) return static_cast<index_t>(*fallback);
    return static_cast<index_t>(loom::data::json_integer(j[key], what + ": \"" + key + "\"", 1, max));
  };
  const auto flag = [&](const char* key, bool fallback) {
    if (!j.contains(key)) return fallback;
    LOOM_CHECK(j[key].is_boolean(), what, ": \"", key, "\" must be true or false, got ", loom::data::quote_json(j[key]));
    return j[key].get<bool>();
  };
  const auto real = [&](const char* key, double min, double max, double fallback) {
    return j.contains(key) ? loom::data::json_real<double>(j[key], what + ": \"" + key + "\"", min, max) : fallback;
  };
  // the settings ChatGLM2/3 ship with; another value is a model the decoder does not run
  for (auto [key, want] : {std::pair{"rmsnorm", true}, std::pair{"post_layer_norm", true}, std::pair{"add_bias_linear", false},
                           std::pair{"apply_residual_connection_post_layernorm", false}})
    LOOM_CHECK(flag(key, want) == want, what, ": \"", key, "\" = ", want ? "false" : "true",
               " is not supported (the decoder runs ", want ? "true" : "false", ")");
  config c = config::chatglm();
  c.n_layers = integer("num_layers", 1 << 14);
  c.dim = integer("hidden_size", 1 << 20);
  c.hidden_dim = integer("ffn_hidden_size", 1 << 22);
  c.n_heads = integer("num_attention_heads", 1 << 16);
  c.n_kv_heads = flag("multi_query_attention", false) ? integer("multi_query_group_num", 1 << 16) : c.n_heads;
  c.vocab = integer("padded_vocab_size", 1 << 26);
  c.seq_len = integer("seq_length", 1 << 30, 2048);
  c.norm_eps = real("layernorm_epsilon", 0.0, 1.0, 1e-5);
  c.rope_theta = 10000.0 * real("rope_ratio", 1e-6, 1e8, 1.0);
  c.qkv_bias = flag("add_qkv_bias", false);
  LOOM_CHECK(!flag("tie_word_embeddings", false), what, ": \"tie_word_embeddings\" = true is not supported (ChatGLM's output_layer is its own)");
  LOOM_CHECK(c.dim % c.n_heads == 0, what, ": hidden_size=", c.dim, " is not divisible by num_attention_heads=", c.n_heads);
  LOOM_CHECK(integer("kv_channels", 1 << 16, c.dim / c.n_heads) == c.dim / c.n_heads, what,
             ": kv_channels must be hidden_size / num_attention_heads (", c.dim / c.n_heads, ")");
  LOOM_CHECK(c.n_heads % c.n_kv_heads == 0, what, ": num_attention_heads=", c.n_heads,
             " is not divisible by multi_query_group_num=", c.n_kv_heads);
  LOOM_CHECK(c.head_dim() % 4 == 0, what, ": the head dimension (", c.head_dim(),
             ") must be a multiple of 4: ChatGLM rotates its first half in pairs");
  c.validate();
  return c;
}

/// The HF family a config.json names: its model_type (llama, chatglm), or, without one, its
/// architectures (ChatGLM*, Llama*; another is refused), else llama.
inline std::string hf_family(const nlohmann::json& j, const std::string& path) {
  if (j.contains("model_type")) {
    LOOM_CHECK(j["model_type"].is_string(), "config '", path, "': \"model_type\" must be a string, got ",
               loom::data::quote_json(j["model_type"]));
    const auto t = j["model_type"].get<std::string>();
    LOOM_CHECK(t == "llama" || t == "chatglm", "config '", path, "': model_type \"", t.substr(0, 64),
               "\" is not an architecture loom reads (llama, chatglm)");
    return t;
  }
  if (j.contains("architectures") && j["architectures"].is_array() && !j["architectures"].empty()) {
    for (const auto& a : j["architectures"]) {
      if (a.is_string() && a.get<std::string>().starts_with("ChatGLM")) return "chatglm";
      if (a.is_string() && a.get<std::string>().starts_with("Llama")) return "llama";
    }
    LOOM_THROW("config '", path, "': architectures ", loom::data::quote_json(j["architectures"]).substr(0, 128),
               " names no architecture loom reads (Llama*, ChatGLM*) and there is no model_type");
  }
  return "llama";
}
}  // namespace detail

/// llama2.c checkpoint -> weights.
inline flat_weights load_llama2c(const std::string& path) {
  auto ck = loom::io::read_llama2c(path);
  const auto& k = ck.config;
  config c;
  c.dim = k.dim, c.hidden_dim = k.hidden_dim, c.n_layers = k.n_layers, c.n_heads = k.n_heads;
  c.n_kv_heads = k.n_kv_heads, c.vocab = k.vocab_size, c.seq_len = k.seq_len;
  c.norm_eps = 1e-5, c.rope = loom::ops::rope_style::interleaved, c.tied_output = k.shared_classifier;
  return detail::from_tensors(c, ck.tensors, nullptr, path);
}

namespace detail {
/// config.json of an HF folder (`dir`): the JSON object, and its path for messages.
inline std::pair<nlohmann::json, std::string> read_hf_config_json(const std::filesystem::path& dir) {
  const std::string config_path = (dir / "config.json").string();
  auto j = loom::data::parse_json_input(loom::io::detail::read_file_bytes(config_path), "config '" + config_path + "'");
  LOOM_CHECK(j.is_object(), "config '", config_path, "': not a JSON object");
  return {std::move(j), config_path};
}

/// The decoder's config from config.json `j` (read from `config_path`) of family
/// hf_family(j): ChatGLM2/3's keys, or HF LLaMA's with half-split rotary (the q/k rows HF
/// stores are permuted for it) and the output tied when the config says so or the weights
/// have no lm_head (`has_lm_head`).
inline config hf_config(const nlohmann::json& j, const std::string& config_path, bool has_lm_head) {
  if (hf_family(j, config_path) == "chatglm") return chatglm_config(j, config_path);
  const auto hc = loom::io::read_hf_llama_config(config_path);
  config c;
  c.dim = hc.hidden_size, c.hidden_dim = hc.intermediate_size, c.n_layers = hc.num_hidden_layers;
  c.n_heads = hc.num_attention_heads, c.n_kv_heads = hc.num_key_value_heads, c.vocab = hc.vocab_size;
  c.seq_len = hc.max_position_embeddings, c.norm_eps = hc.rms_norm_eps, c.rope_theta = hc.rope_theta;
  c.rope = loom::ops::rope_style::half_split;
  c.tied_output = hc.tie_word_embeddings || !has_lm_head;
  return c;
}
}  // namespace detail

/// HF LLaMA or ChatGLM2/3 (config.json's model_type): `path` is a folder with config.json and
/// its safetensors (model.safetensors.index.json's shards, or every *.safetensors), or one
/// .safetensors file with config.json next to it.
inline flat_weights load_hf_safetensors(const std::string& path) {
  namespace fs = std::filesystem;
  const fs::path p(path);
  const auto [j, config_path] = detail::read_hf_config_json(fs::is_directory(p) ? p : p.parent_path());
  if (detail::hf_family(j, config_path) == "chatglm") {
    const config c = detail::chatglm_config(j, config_path);  // before the tensors: a v1 model is refused unread
    return detail::from_tensors(c, detail::read_hf_tensors(p), path, detail::chatglm_name);
  }
  const detail::named_tensors m = detail::read_hf_tensors(p);
  return detail::from_tensors(detail::hf_config(j, config_path, m.tensors.contains("lm_head.weight")), m, path,
                              detail::hf_name);
}

/// An HF folder (LLaMA or ChatGLM2/3) opened for range reads: config.json and every shard's
/// header, no tensor data. Each read touches only the bytes of the elements it asks for, and
/// is counted (bytes_read), so a caller that reads slices can show that it read no more.
class hf_folder {
 public:
  explicit hf_folder(const std::string& folder) : dir_(folder) {
    namespace fs = std::filesystem;
    LOOM_CHECK(fs::is_directory(dir_), "HF folder '", folder, "' is not a directory");
    auto [j, config_path] = detail::read_hf_config_json(dir_);
    config_path_ = config_path;
    family_ = detail::hf_family(j, config_path_);  // an unknown model_type is refused before any shard is opened
    const bool indexed = fs::exists(dir_ / "model.safetensors.index.json");
    for (const auto& [file, names] : detail::hf_shard_files(dir_)) {
      files_.push_back(loom::io::read_safetensors_index((dir_ / file).string()));
      const auto& ix = files_.back();
      file_bytes_ += fs::file_size(ix.path);
      header_bytes_ += ix.data_start;
      for (const auto& n : names)
        LOOM_CHECK(ix.tensors.contains(n), "'", (dir_ / "model.safetensors.index.json").string(), "' places tensor '",
                   n.substr(0, 128), "' in '", ix.path, "', which does not hold it");
      for (const auto& [n, e] : ix.tensors) {
        if (indexed && std::find(names.begin(), names.end(), n) == names.end()) continue;  // the index decides
        LOOM_CHECK(where_.emplace(n, files_.size() - 1).second, "tensor '", n.substr(0, 128), "' is in both '",
                   files_[where_[n]].path, "' and '", ix.path, "'");
      }
    }
    cfg_ = detail::hf_config(j, config_path_, where_.contains("lm_head.weight"));
  }

  const config& cfg() const noexcept { return cfg_; }
  /// llama or chatglm (config.json's model_type).
  const std::string& family() const noexcept { return family_; }
  std::string path() const { return dir_.string(); }
  const std::string& config_path() const noexcept { return config_path_; }
  /// The folder's name of a tensor of the layout (Meta's name).
  std::string name_of(const std::string& meta) const {
    return family_ == "chatglm" ? detail::chatglm_name(meta) : detail::hf_name(meta);
  }
  /// HF tensor `name`'s header entry, or nullptr when no shard holds it.
  const loom::io::safetensors_entry* find(const std::string& name) const {
    const auto it = where_.find(name);
    return it == where_.end() ? nullptr : &files_[it->second].tensors.at(name);
  }
  /// The file that holds HF tensor `name` (find(name) != nullptr).
  const std::string& file_of(const std::string& name) const { return files_[where_.at(name)].path; }
  /// Elements [first, first + out.size()) of HF tensor `name` (row-major), widened to float.
  void read(const std::string& name, std::uint64_t first, std::span<float> out) const {
    const auto it = where_.find(name);
    LOOM_CHECK(it != where_.end(), "HF folder '", dir_.string(), "': no tensor '", name.substr(0, 128), "'");
    const auto& ix = files_[it->second];
    loom::io::read_safetensors_range(ix, name, first, out);
    bytes_read_ += out.size() * loom::io::detail::dtype_size(ix.tensors.at(name).dtype);
  }
  /// Tensor data bytes read so far; the headers' bytes (read once each, by the constructor);
  /// the shard files' sizes.
  std::uint64_t bytes_read() const noexcept { return bytes_read_; }
  std::uint64_t header_bytes() const noexcept { return header_bytes_; }
  std::uint64_t file_bytes() const noexcept { return file_bytes_; }

 private:
  std::filesystem::path dir_;
  std::string config_path_, family_;
  config cfg_;
  std::vector<loom::io::safetensors_index> files_;
  std::map<std::string, std::size_t> where_;  // HF name -> files_ index
  mutable std::uint64_t bytes_read_ = 0;
  std::uint64_t header_bytes_ = 0, file_bytes_ = 0;
};

/// The decoder's config that HF folder `folder`'s config.json describes (LLaMA: half-split
/// rotary, as HF stores q/k; ChatGLM2/3), e.g. to build a trainer for llama3d::init_from_hf.
inline config config_from_hf(const std::string& folder) { return hf_folder(folder).cfg(); }

inline flat_weights load_checkpoint(const std::string& path) {
  namespace fs = std::filesystem;
  LOOM_CHECK(fs::exists(path), "checkpoint '", path, "' does not exist");
  if (fs::is_directory(path) || fs::path(path).extension() == ".safetensors") return load_hf_safetensors(path);
  return load_llama2c(path);
}

namespace detail {
inline const char* torch_dtype(const std::string& dtype) {
  return dtype == "F32" ? "float32" : dtype == "F16" ? "float16" : "bfloat16";
}
/// config.json of an HF ChatGLM2/3 folder for config c (the keys chatglm_config reads, and
/// the fixed settings of the family).
inline nlohmann::json chatglm_config_json(const config& c, const std::string& dtype) {
  return {{"architectures", {"ChatGLMModel"}},
          {"model_type", "chatglm"},
          {"num_layers", c.n_layers},
          {"hidden_size", c.dim},
          {"ffn_hidden_size", c.hidden_dim},
          {"num_attention_heads", c.n_heads},
          {"kv_channels", c.head_dim()},
          {"multi_query_attention", c.n_kv_heads != c.n_heads},
          {"multi_query_group_num", c.n_kv_heads},
          {"padded_vocab_size", c.vocab},
          {"seq_length", c.seq_len},
          {"layernorm_epsilon", c.norm_eps},
          {"rope_ratio", c.rope_theta / 10000.0},
          {"rmsnorm", true},
          {"post_layer_norm", true},
          {"add_bias_linear", false},
          {"add_qkv_bias", c.qkv_bias},
          {"apply_residual_connection_post_layernorm", false},
          {"apply_query_key_layer_scaling", true},
          {"attention_softmax_in_fp32", true},
          {"fp32_residual_connection", false},
          {"original_rope", true},
          {"tie_word_embeddings", false},
          {"torch_dtype", torch_dtype(dtype)}};
}
}  // namespace detail

/// Writes sharded checkpoint `ckpt` (of a model with config `c`) as a Hugging Face folder of
/// c.model_type: config.json, the family's tensor names, safetensors shards cut at
/// `max_shard_bytes` with model.safetensors.index.json, one tensor in memory at a time.
/// llama: HF runs rotary on the two halves of a head; a model trained with adjacent pairs
/// (Meta's, llama2.c's) gets its q and k rows permuted so that HF computes the same attention
/// (what HF's own converter does). chatglm: the fused tensors are ChatGLM's as they are.
/// load_hf_safetensors reads the folder back.
inline int export_hf(const std::string& ckpt, const std::string& out_dir, const config& c,
                     std::uint64_t max_shard_bytes = std::uint64_t{5} << 30, const std::string& dtype = "F32") {
  c.validate();
  loom::checkpoint::folder_options o;
  o.max_shard_bytes = max_shard_bytes;
  o.dtype = dtype;
  if (c.model_type == "chatglm") {
    LOOM_CHECK(!c.tied_output, "llama::export_hf: a ChatGLM has its own output_layer; this config has tied_output=true");
    o.rename = detail::chatglm_name;
    o.config_json = detail::chatglm_config_json(c, dtype).dump(2) + "\n";
    return loom::checkpoint::export_folder(ckpt, out_dir, o);
  }
  LOOM_CHECK(!c.fused_qkv && !c.fused_gate_up && !c.qkv_bias && c.partial_rotary_factor == 1.0,
             "llama::export_hf: an HF LLaMA has separate q/k/v and gate/up projections without biases and rotates whole "
             "heads; this config has fused_qkv=", c.fused_qkv, ", fused_gate_up=", c.fused_gate_up, ", qkv_bias=", c.qkv_bias,
             ", partial_rotary_factor=", c.partial_rotary_factor);
  o.rename = detail::hf_name;
  if (c.rope == loom::ops::rope_style::interleaved)
    o.transform = [&c](const std::string& name, std::span<float> t) {
      if (!name.ends_with("attention.wq.weight") && !name.ends_with("attention.wk.weight")) return;
      // row h*hd + 2i + p (pair i, component p) goes to h*hd + p*hd/2 + i
      const auto hd = static_cast<std::size_t>(c.head_dim()), cols = static_cast<std::size_t>(c.dim);
      const std::vector<float> in(t.begin(), t.end());
      for (std::size_t row = 0; row < t.size() / cols; ++row) {
        const std::size_t h = row / hd, i = (row % hd) / 2, p = row % 2;
        std::copy_n(in.begin() + static_cast<std::ptrdiff_t>(row * cols), cols,
                    t.begin() + static_cast<std::ptrdiff_t>((h * hd + p * hd / 2 + i) * cols));
      }
    };
  const nlohmann::json cfg = {{"architectures", {"LlamaForCausalLM"}},
                              {"model_type", "llama"},
                              {"hidden_act", "silu"},
                              {"hidden_size", c.dim},
                              {"intermediate_size", c.hidden_dim},
                              {"num_hidden_layers", c.n_layers},
                              {"num_attention_heads", c.n_heads},
                              {"num_key_value_heads", c.n_kv_heads},
                              {"vocab_size", c.vocab},
                              {"max_position_embeddings", c.seq_len},
                              {"rms_norm_eps", c.norm_eps},
                              {"rope_theta", c.rope_theta},
                              {"tie_word_embeddings", c.tied_output},
                              {"torch_dtype", detail::torch_dtype(dtype)}};
  o.config_json = cfg.dump(2) + "\n";
  return loom::checkpoint::export_folder(ckpt, out_dir, o);
}

}  // namespace llama
