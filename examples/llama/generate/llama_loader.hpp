#pragma once
// The decoder for inference as the checkpoint readers give it: the one llama::config and the
// fp32 parameters in the single-rank model's flat layout (llama3d::full_layout, Meta's
// names), filled tensor by tensor by name from the formats loom::io reads:
//  - llama2.c (legacy or version 1): Meta names, adjacent-pair RoPE;
//  - HF safetensors (one file or shards in a folder) + config.json: HF names, half-split RoPE
//    (HF stores q/k rows permuted for it, so no un-permuting is needed);
// and the tokenizer that comes with llama2.c models. `load_checkpoint` picks the format from
// the path: a folder or *.safetensors file is HF, anything else llama2.c.

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
#include <filesystem>
#include <functional>
#include <string>
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

  /// Random weights (normal, scaled by 1/sqrt(fan-in), the embedding by 1; norms uniform in
  /// [0.8, 1.2]) for tests and benchmarks: a model whose tokens depend on the context.
  static flat_weights random(const config& c, std::uint64_t seed) {
    const loom::counter_rng rng(seed);
    loom::buffer<float> t;
    return fill(c, [&](const loom::nn::param_info& e) {
      t = loom::buffer<float>(e.numel);
      if (e.name.ends_with("norm.weight")) rng.fill_uniform(t.span(), e.offset, 0.8f, 1.2f);
      else rng.fill_normal(t.span(), e.offset, 0.f, e.name == "tok_embeddings.weight" ? 1.f : 1.f / std::sqrt(float(e.shape[1])));
      return std::span<const float>(t.span());
    });
  }
};

namespace detail {
/// HF's name of a Meta-named tensor of the layout.
inline std::string hf_name(const std::string& meta) {
  static const std::pair<const char*, const char*> layer[] = {
      {"attention_norm.weight", "input_layernorm.weight"}, {"attention.wq.weight", "self_attn.q_proj.weight"},
      {"attention.wk.weight", "self_attn.k_proj.weight"},  {"attention.wv.weight", "self_attn.v_proj.weight"},
      {"attention.wo.weight", "self_attn.o_proj.weight"},  {"ffn_norm.weight", "post_attention_layernorm.weight"},
      {"feed_forward.w1.weight", "mlp.gate_proj.weight"},   {"feed_forward.w2.weight", "mlp.down_proj.weight"},
      {"feed_forward.w3.weight", "mlp.up_proj.weight"}};
  if (meta == "tok_embeddings.weight") return "model.embed_tokens.weight";
  if (meta == "norm.weight") return "model.norm.weight";
  if (meta == "output.weight") return "lm_head.weight";
  const auto dot = meta.find('.', 7);  // "layers.<l>.<rest>"
  for (auto [m, h] : layer)
    if (meta.compare(dot + 1, std::string::npos, m) == 0) return "model." + meta.substr(0, dot + 1) + h;
  LOOM_THROW("llama loader: no HF name for parameter '", meta, "'");
}

/// The parameters of config c from named tensors (`rename`: a layout name -> the checkpoint's).
inline flat_weights from_tensors(const config& c, const loom::io::tensor_map& m,
                                 std::string (*rename)(const std::string&) = nullptr) {
  return flat_weights::fill(c, [&](const loom::nn::param_info& e) {
    const auto& t = loom::io::require_tensor(m, rename ? rename(e.name) : e.name,
                                             std::vector<std::int64_t>(e.shape.begin(), e.shape.end()));
    return std::span<const float>(t.data.data(), e.numel);
  });
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
  return detail::from_tensors(c, ck.tensors);
}

/// HF LLaMA: `path` is a folder with config.json and *.safetensors, or one .safetensors file
/// with config.json next to it.
inline flat_weights load_hf_safetensors(const std::string& path) {
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
  config c;
  c.dim = hc.hidden_size, c.hidden_dim = hc.intermediate_size, c.n_layers = hc.num_hidden_layers;
  c.n_heads = hc.num_attention_heads, c.n_kv_heads = hc.num_key_value_heads, c.vocab = hc.vocab_size;
  c.seq_len = hc.max_position_embeddings, c.norm_eps = hc.rms_norm_eps, c.rope_theta = hc.rope_theta;
  c.rope = loom::ops::rope_style::half_split;
  c.tied_output = hc.tie_word_embeddings || !m.contains("lm_head.weight");
  return detail::from_tensors(c, m, detail::hf_name);
}

inline flat_weights load_checkpoint(const std::string& path) {
  namespace fs = std::filesystem;
  LOOM_CHECK(fs::exists(path), "checkpoint '", path, "' does not exist");
  if (fs::is_directory(path) || fs::path(path).extension() == ".safetensors") return load_hf_safetensors(path);
  return load_llama2c(path);
}

/// Writes sharded checkpoint `ckpt` (of a model with config `c`) as a Hugging Face LLaMA
/// folder: config.json, HF's tensor names, safetensors shards cut at `max_shard_bytes` with
/// model.safetensors.index.json, one tensor in memory at a time. HF runs rotary on the two
/// halves of a head; a model trained with adjacent pairs (Meta's, llama2.c's) gets its q and k
/// rows permuted so that HF computes the same attention (what HF's own converter does).
/// load_hf_safetensors reads the folder back.
inline int export_hf(const std::string& ckpt, const std::string& out_dir, const config& c,
                     std::uint64_t max_shard_bytes = std::uint64_t{5} << 30, const std::string& dtype = "F32") {
  loom::checkpoint::folder_options o;
  o.max_shard_bytes = max_shard_bytes;
  o.dtype = dtype;
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
                              {"torch_dtype", dtype == "F32" ? "float32" : dtype == "F16" ? "float16" : "bfloat16"}};
  o.config_json = cfg.dump(2) + "\n";
  return loom::checkpoint::export_folder(ckpt, out_dir, o);
}

}  // namespace llama
