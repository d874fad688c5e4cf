#pragma once
// Hugging Face config.json of the decoder families loom reads and writes: which family a
// folder holds (model_type, or its architectures), ChatGLM2/3's keys (hf_chatglm_config; HF
// LLaMA's are hf_llama_config in safetensors.hpp), and ChatGLM's config.json for a folder loom
// writes.
//
// Why checked here: config.json is outside bytes that size every allocation after it. Each
// number is range-checked naming the file and the key; a ChatGLM variant whose layers differ
// from ChatGLM2/3's (ChatGLM-6B v1, post-norm, biased linears, LayerNorm) is refused naming
// what differs, before any tensor is read, rather than loaded into the wrong layers.

#include <loom/core/error.hpp>
#include <loom/data/json_input.hpp>
#include <loom/io/safetensors.hpp>

#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <utility>

namespace loom::io {

/// config.json of folder `dir`: the JSON object, and its path for messages.
inline std::pair<nlohmann::json, std::string> read_hf_config_json(const std::filesystem::path& dir) {
  const std::string path = (dir / "config.json").string();
  auto j = data::parse_json_input(detail::read_file_bytes(path), "config '" + path + "'");
  LOOM_CHECK(j.is_object(), "config '", path, "': not a JSON object");
  return {std::move(j), path};
}

/// The family config.json `j` (read from `path`) names: its model_type (llama, chatglm), or,
/// without one, its architectures (ChatGLM*, Llama*; another is refused), else llama.
inline std::string hf_model_type(const nlohmann::json& j, const std::string& path) {
  if (j.contains("model_type")) {
    LOOM_CHECK(j["model_type"].is_string(), "config '", path, "': \"model_type\" must be a string, got ",
               data::quote_json(j["model_type"]));
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
    LOOM_THROW("config '", path, "': architectures ", data::quote_json(j["architectures"]).substr(0, 128),
               " names no architecture loom reads (Llama*, ChatGLM*) and there is no model_type");
  }
  return "llama";
}

/// ChatGLM2/3's config.json keys (THUDM's ChatGLMConfig). multi_query_group_num is the
/// number of key/value heads (num_attention_heads without multi_query_attention).
struct hf_chatglm_config {
  std::int32_t num_layers = 0, hidden_size = 0, ffn_hidden_size = 0, num_attention_heads = 0,
               multi_query_group_num = 0, padded_vocab_size = 0, seq_length = 2048;
  double layernorm_epsilon = 1e-5, rope_ratio = 1.0;
  bool add_qkv_bias = false;
  std::int32_t head_dim() const { return hidden_size / num_attention_heads; }
};

/// ChatGLM2/3's config.json `j` (read from `path`); ChatGLM-6B v1 and settings ChatGLM2/3 do
/// not ship with are refused, naming the key.
inline hf_chatglm_config read_hf_chatglm_config(const nlohmann::json& j, const std::string& path) {
  const std::string what = "config '" + path + "'";
  LOOM_CHECK(!j.contains("position_encoding_2d") && !j.contains("inner_hidden_size") && j.contains("padded_vocab_size"), what,
             ": ChatGLM-6B v1 (position_encoding_2d, no padded_vocab_size) is not supported: the decoder has no GLM 2D "
             "positions, bidirectional context mask, GeLU MLP, LayerNorm with bias, nor post-norm residuals scaled by "
             "sqrt(2 layers); ChatGLM2/3 are");
  const auto integer = [&](const char* key, std::int64_t max, std::optional<std::int64_t> fallback = std::nullopt) {
    LOOM_CHECK(j.contains(key) || fallback, what, ": missing \"", key, "\"");
    if (!j.contains(key)) return static_cast<std::int32_t>(*fallback);
    return static_cast<std::int32_t>(data::json_integer(j[key], what + ": \"" + key + "\"", 1, max));
  };
  const auto flag = [&](const char* key, bool fallback) {
    if (!j.contains(key)) return fallback;
    LOOM_CHECK(j[key].is_boolean(), what, ": \"", key, "\" must be true or false, got ", data::quote_json(j[key]));
    return j[key].get<bool>();
  };
  const auto real = [&](const char* key, double min, double max, double fallback) {
    return j.contains(key) ? data::json_real<double>(j[key], what + ": \"" + key + "\"", min, max) : fallback;
  };
  // the settings ChatGLM2/3 ship with; another value is a model the decoder does not run
  for (auto [key, want] : {std::pair{"rmsnorm", true}, std::pair{"post_layer_norm", true}, std::pair{"add_bias_linear", false},
                           std::pair{"apply_residual_connection_post_layernorm", false}})
    LOOM_CHECK(flag(key, want) == want, what, ": \"", key, "\" = ", want ? "false" : "true",
               " is not supported (the decoder runs ", want ? "true" : "false", ")");
  hf_chatglm_config c;
  c.num_layers = integer("num_layers", 1 << 14);
  c.hidden_size = integer("hidden_size", 1 << 20);
  c.ffn_hidden_size = integer("ffn_hidden_size", 1 << 22);
  c.num_attention_heads = integer("num_attention_heads", 1 << 16);
  c.multi_query_group_num = flag("multi_query_attention", false) ? integer("multi_query_group_num", 1 << 16) : c.num_attention_heads;
  c.padded_vocab_size = integer("padded_vocab_size", 1 << 26);
  c.seq_length = integer("seq_length", 1 << 30, 2048);
  c.layernorm_epsilon = real("layernorm_epsilon", 0.0, 1.0, 1e-5);
  c.rope_ratio = real("rope_ratio", 1e-6, 1e8, 1.0);
  c.add_qkv_bias = flag("add_qkv_bias", false);
  LOOM_CHECK(!flag("tie_word_embeddings", false), what, ": \"tie_word_embeddings\" = true is not supported (ChatGLM's output_layer is its own)");
  LOOM_CHECK(c.hidden_size % c.num_attention_heads == 0, what, ": hidden_size=", c.hidden_size,
             " is not divisible by num_attention_heads=", c.num_attention_heads);
  LOOM_CHECK(integer("kv_channels", 1 << 16, c.head_dim()) == c.head_dim(), what,
             ": kv_channels must be hidden_size / num_attention_heads (", c.head_dim(), ")");
  LOOM_CHECK(c.num_attention_heads % c.multi_query_group_num == 0, what, ": num_attention_heads=", c.num_attention_heads,
             " is not divisible by multi_query_group_num=", c.multi_query_group_num);
  LOOM_CHECK(c.head_dim() % 4 == 0, what, ": the head dimension (", c.head_dim(),
             ") must be a multiple of 4: ChatGLM rotates its first half in pairs");
  return c;
}

/// PyTorch's name of a safetensors dtype (F32, F16, BF16), config.json's torch_dtype.
inline const char* hf_torch_dtype(const std::string& dtype) {
  return dtype == "F32" ? "float32" : dtype == "F16" ? "float16" : "bfloat16";
}

/// config.json of an HF ChatGLM2/3 folder (the keys read_hf_chatglm_config reads, and the
/// fixed settings of the family) whose tensors are stored as `dtype`.
inline nlohmann::json hf_chatglm_config_json(const hf_chatglm_config& c, const std::string& dtype) {
  return {{"architectures", {"ChatGLMModel"}},
          {"model_type", "chatglm"},
          {"num_layers", c.num_layers},
          {"hidden_size", c.hidden_size},
          {"ffn_hidden_size", c.ffn_hidden_size},
          {"num_attention_heads", c.num_attention_heads},
          {"kv_channels", c.head_dim()},
          {"multi_query_attention", c.multi_query_group_num != c.num_attention_heads},
          {"multi_query_group_num", c.multi_query_group_num},
          {"padded_vocab_size", c.padded_vocab_size},
          {"seq_length", c.seq_length},
          {"layernorm_epsilon", c.layernorm_epsilon},
          {"rope_ratio", c.rope_ratio},
          {"rmsnorm", true},
          {"post_layer_norm", true},
          {"add_bias_linear", false},
          {"add_qkv_bias", c.add_qkv_bias},
          {"apply_residual_connection_post_layernorm", false},
          {"apply_query_key_layer_scaling", true},
          {"attention_softmax_in_fp32", true},
          {"fp32_residual_connection", false},
          {"original_rope", true},
          {"tie_word_embeddings", false},
          {"torch_dtype", hf_torch_dtype(dtype)}};
}

}  // namespace loom::io
