#pragma once
// Loading llama_weights from the checkpoint formats loom::io reads:
//  - llama2.c (legacy or version 1): Meta names, adjacent-pair RoPE;
//  - HF safetensors (one file or shards in a folder) + config.json: HF names, half-split RoPE
//    (HF stores q/k rows permuted for it, so no un-permuting is needed);
// and the tokenizer that comes with llama2.c models. `load_checkpoint` picks the format from
// the path: a folder or *.safetensors file is HF, anything else llama2.c.

#include "llama_infer_model.hpp"

#include <loom/io/llama2c.hpp>
#include <loom/io/safetensors.hpp>
#include <loom/io/tensor_map.hpp>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

namespace llama {

namespace detail {
inline void take(const loom::io::tensor_map& m, const std::string& name, std::vector<std::int64_t> shape,
                 loom::buffer<float>& dst) {
  const auto& t = loom::io::require_tensor(m, name, shape);
  std::memcpy(dst.data(), t.data.data(), dst.size() * sizeof(float));
}

// Tensor names of one checkpoint family; layer names follow "<layer_prefix><l>.".
struct name_scheme {
  const char *embed, *norm, *output, *layer_prefix;
  const char *attn_norm, *wq, *wk, *wv, *wo, *ffn_norm, *w1, *w2, *w3;
};
inline constexpr name_scheme meta_names{"tok_embeddings.weight", "norm.weight", "output.weight", "layers.",
                                        "attention_norm.weight", "attention.wq.weight", "attention.wk.weight",
                                        "attention.wv.weight", "attention.wo.weight", "ffn_norm.weight",
                                        "feed_forward.w1.weight", "feed_forward.w2.weight", "feed_forward.w3.weight"};
inline constexpr name_scheme hf_names{"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
                                      "model.layers.", "input_layernorm.weight", "self_attn.q_proj.weight",
                                      "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
                                      "post_attention_layernorm.weight", "mlp.gate_proj.weight",
                                      "mlp.down_proj.weight", "mlp.up_proj.weight"};

inline llama_weights from_tensors(const llama_config& c, const loom::io::tensor_map& m, const name_scheme& n) {
  llama_weights w = llama_weights::allocate(c);
  const std::int64_t D = c.dim, H = c.hidden_dim, V = c.vocab_size, KD = c.kv_dim();
  take(m, n.embed, {V, D}, w.tok_embeddings);
  for (int l = 0; l < c.n_layers; ++l) {
    const std::string p = n.layer_prefix + std::to_string(l) + ".";
    auto& L = w.layers[static_cast<std::size_t>(l)];
    take(m, p + n.attn_norm, {D}, L.attn_norm);
    take(m, p + n.wq, {D, D}, L.wq);
    take(m, p + n.wk, {KD, D}, L.wk);
    take(m, p + n.wv, {KD, D}, L.wv);
    take(m, p + n.wo, {D, D}, L.wo);
    take(m, p + n.ffn_norm, {D}, L.ffn_norm);
    take(m, p + n.w1, {H, D}, L.w1);
    take(m, p + n.w2, {D, H}, L.w2);
    take(m, p + n.w3, {H, D}, L.w3);
  }
  take(m, n.norm, {D}, w.norm);
  if (!c.shared_classifier) take(m, n.output, {V, D}, w.output);
  return w;
}
}  // namespace detail

/// llama2.c checkpoint -> weights.
inline llama_weights load_llama2c(const std::string& path) {
  auto ck = loom::io::read_llama2c(path);
  const auto& k = ck.config;
  llama_config c;
  c.dim = k.dim, c.hidden_dim = k.hidden_dim, c.n_layers = k.n_layers, c.n_heads = k.n_heads;
  c.n_kv_heads = k.n_kv_heads, c.vocab_size = k.vocab_size, c.max_seq_len = k.seq_len;
  c.norm_eps = 1e-5f, c.rope_interleaved = true, c.shared_classifier = k.shared_classifier;
  return detail::from_tensors(c, ck.tensors, detail::meta_names);
}

/// HF LLaMA: `path` is a folder with config.json and *.safetensors, or one .safetensors file
/// with config.json next to it.
inline llama_weights load_hf_safetensors(const std::string& path) {
  namespace fs = std::filesystem;
  const fs::path p(path);
  const fs::path dir = fs::is_directory(p) ? p : p.parent_path();
  std::vector<fs::path> files;
  if (fs::is_directory(p)) {
    for (auto& e : fs::directory_iterator(p))
      if (e.path().extension() == ".safetensors") files.push_back(e.path());
    std::sort(files.begin(), files.end());
  } else {
    files.push_back(p);
  }
  LOOM_CHECK(!files.empty(), "load_hf_safetensors: no .safetensors file in '", path, "'");
  const auto hc = loom::io::read_hf_llama_config((dir / "config.json").string());
  loom::io::tensor_map m;
  for (auto& f : files) m.merge(loom::io::read_safetensors(f.string()));
  llama_config c;
  c.dim = hc.hidden_size, c.hidden_dim = hc.intermediate_size, c.n_layers = hc.num_hidden_layers;
  c.n_heads = hc.num_attention_heads, c.n_kv_heads = hc.num_key_value_heads, c.vocab_size = hc.vocab_size;
  c.max_seq_len = hc.max_position_embeddings, c.norm_eps = hc.rms_norm_eps, c.rope_theta = hc.rope_theta;
  c.rope_interleaved = false;
  c.shared_classifier = hc.tie_word_embeddings || !m.contains("lm_head.weight");
  return detail::from_tensors(c, m, detail::hf_names);
}

inline llama_weights load_checkpoint(const std::string& path) {
  namespace fs = std::filesystem;
  LOOM_CHECK(fs::exists(path), "checkpoint '", path, "' does not exist");
  if (fs::is_directory(path) || fs::path(path).extension() == ".safetensors") return load_hf_safetensors(path);
  return load_llama2c(path);
}

}  // namespace llama
