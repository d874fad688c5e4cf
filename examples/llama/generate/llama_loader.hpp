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
// range reads (headers first, then any slice of any tensor): load_hf_safetensors reads every
// tensor through it, the mesh trainer's llama3d::init_from_hf only what each rank owns.
// What is not this model's lives in loom::io: the shards and their index
// (io/safetensors_folder.hpp), config.json's family and ChatGLM's keys (io/hf_config.hpp);
// here is the mapping of names and configs onto the one decoder.

#include <llama/model/config.hpp>
#include <llama/model3d/llama3d.hpp>

#include <loom/checkpoint/sharded.hpp>
#include <loom/core/buffer.hpp>
#include <loom/core/random.hpp>
#include <loom/io/hf_config.hpp>
#include <loom/io/llama2c.hpp>
#include <loom/io/safetensors.hpp>
#include <loom/io/safetensors_folder.hpp>
#include <loom/io/tensor_map.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
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

/// A tensor's shape as messages write it: [a,b].
inline std::string shape_string(std::span<const std::int64_t> shape) {
  std::string r;
  for (auto x : shape) r.append(r.empty() ? "" : ",").append(std::to_string(x));
  return "[" + r + "]";
}

/// The parameters of config c from a checkpoint's tensors m (`rename`: a layout name -> the
/// checkpoint's). A missing tensor is a loom::error naming it and the checkpoint (`where`), a
/// misshapen one naming it and both shapes.
inline flat_weights from_tensors(const config& c, const loom::io::tensor_map& m,
                                 std::string (*rename)(const std::string&) = nullptr, const std::string& where = "") {
  return flat_weights::fill(c, [&](const loom::nn::param_info& e) {
    const std::string name = rename ? rename(e.name) : e.name;
    const auto it = m.find(name);
    LOOM_CHECK(it != m.end(), "tensor '", name, "' is missing from the checkpoint '", where, "'");
    LOOM_CHECK(std::ranges::equal(it->second.shape, e.shape), "tensor '", name, "' in '", where, "' has shape ",
               shape_string(it->second.shape), ", its config gives ", shape_string(e.shape));
    return std::span<const float>(it->second.data.data(), e.numel);
  });
}

/// ChatGLM2/3's config.json (`j`, read from `path`: loom::io::read_hf_chatglm_config) as the
/// decoder's config.
inline config chatglm_config(const nlohmann::json& j, const std::string& path) {
  const auto h = loom::io::read_hf_chatglm_config(j, path);
  config c = config::chatglm();
  c.n_layers = h.num_layers, c.dim = h.hidden_size, c.hidden_dim = h.ffn_hidden_size, c.n_heads = h.num_attention_heads;
  c.n_kv_heads = h.multi_query_group_num, c.vocab = h.padded_vocab_size, c.seq_len = h.seq_length;
  c.norm_eps = h.layernorm_epsilon, c.rope_theta = 10000.0 * h.rope_ratio, c.qkv_bias = h.add_qkv_bias;
  c.validate();
  return c;
}
/// The inverse: config c as ChatGLM's config.json keys (loom::io::hf_chatglm_config_json writes them).
inline loom::io::hf_chatglm_config chatglm_hf_config(const config& c) {
  const auto i32 = [](auto v) { return static_cast<std::int32_t>(v); };
  return {i32(c.n_layers), i32(c.dim),     i32(c.hidden_dim), i32(c.n_heads), i32(c.n_kv_heads),
          i32(c.vocab),    i32(c.seq_len), c.norm_eps,        c.rope_theta / 10000.0, c.qkv_bias};
}
/// config.json for config c, as its family (c.model_type) writes it: export_hf writes it, and
/// llama3d::init_from_hf compares a folder's with its trainer's key by key.
inline nlohmann::json hf_config_json(const config& c, const std::string& dtype = "F32") {
  if (c.model_type == "chatglm") return loom::io::hf_chatglm_config_json(chatglm_hf_config(c), dtype);
  return {{"architectures", {"LlamaForCausalLM"}},
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
          {"torch_dtype", loom::io::hf_torch_dtype(dtype)}};
}
/// HF's row of Meta's q/k row `row` (head dimension hd): HF rotates the two halves of a head
/// where Meta rotates adjacent pairs, so row h*hd + 2i + p (pair i, component p) is stored at
/// h*hd + p*hd/2 + i (HF's converter's permutation).
inline std::size_t half_split_row(std::size_t row, std::size_t hd) {
  const std::size_t j = row % hd;
  return row - j + (j % 2) * (hd / 2) + j / 2;
}

}  // namespace detail

namespace detail {
/// The decoder's config of a llama2.c header: adjacent-pair rotary, as Meta's and llama2.c's.
inline config llama2c_config(const loom::io::llama2c_config& k) {
  config c;
  c.dim = k.dim, c.hidden_dim = k.hidden_dim, c.n_layers = k.n_layers, c.n_heads = k.n_heads;
  c.n_kv_heads = k.n_kv_heads, c.vocab = k.vocab_size, c.seq_len = k.seq_len;
  c.norm_eps = 1e-5, c.rope = loom::ops::rope_style::interleaved, c.tied_output = k.shared_classifier;
  return c;
}
}  // namespace detail

/// llama2.c checkpoint -> weights.
inline flat_weights load_llama2c(const std::string& path) {
  auto ck = loom::io::read_llama2c(path);
  return detail::from_tensors(detail::llama2c_config(ck.config), ck.tensors, nullptr, path);
}

namespace detail {
/// The decoder's config from HF LLaMA's config.json (`config_path`): half-split rotary (the
/// q/k rows HF stores are permuted for it) and the output tied when the config says so or the
/// weights have no lm_head (`has_lm_head`).
inline config llama_hf_config(const std::string& config_path, bool has_lm_head) {
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

/// An HF checkpoint (LLaMA or ChatGLM2/3, config.json's model_type) opened for range reads:
/// config.json, then every shard's header (loom::io::safetensors_folder), no tensor data.
/// `path` is a folder with config.json and its safetensors (model.safetensors.index.json's
/// shards, or every *.safetensors), or one .safetensors file with config.json next to it.
/// load_hf_safetensors reads every tensor through it; llama3d::init_from_hf the slices a rank owns.
class hf_folder {
 public:
  explicit hf_folder(const std::string& path) : hf_folder(path, loom::io::read_hf_config_json(config_dir(path))) {}

  const config& cfg() const noexcept { return cfg_; }
  /// llama or chatglm (config.json's model_type).
  const std::string& family() const noexcept { return family_; }
  const std::string& path() const noexcept { return tensors_.path(); }
  const std::string& config_path() const noexcept { return config_path_; }
  /// The folder's name of a tensor of the layout (Meta's name).
  std::string name_of(const std::string& meta) const {
    return family_ == "chatglm" ? detail::chatglm_name(meta) : detail::hf_name(meta);
  }
  /// The folder's tensor for parameter `e` of the layout; a loom::error names it when no shard
  /// holds it, or its file and both shapes when config.json gives another shape.
  const loom::io::safetensors_entry& check(const loom::nn::param_info& e) const {
    const std::string hf = name_of(e.name);
    const auto* t = tensors_.find(hf);
    LOOM_CHECK(t, "tensor '", hf, "' is missing from the checkpoint '", path(), "' (no shard holds it)");
    LOOM_CHECK(std::ranges::equal(t->shape, e.shape), "tensor '", hf, "' in '", tensors_.file_of(hf), "' has shape ",
               detail::shape_string(t->shape), ", its config gives ", detail::shape_string(e.shape), " ('", config_path_, "')");
    return *t;
  }
  /// Elements [first, first + out.size()) of HF tensor `name` (row-major), widened to float.
  void read(const std::string& name, std::uint64_t first, std::span<float> out) const { tensors_.read(name, first, out); }
  /// Tensor data bytes read so far; the headers' bytes; the shard files' sizes.
  std::uint64_t bytes_read() const noexcept { return tensors_.bytes_read(); }
  std::uint64_t header_bytes() const noexcept { return tensors_.header_bytes(); }
  std::uint64_t file_bytes() const noexcept { return tensors_.file_bytes(); }

 private:
  static std::filesystem::path config_dir(const std::string& path) {
    const std::filesystem::path p(path);
    LOOM_CHECK(std::filesystem::exists(p), "HF folder '", path, "' does not exist");
    return std::filesystem::is_directory(p) ? p : p.parent_path();
  }
  // The family and a ChatGLM config before any shard is opened: an unknown model_type or a
  // ChatGLM-6B v1 is refused unread. LLaMA's tied output depends on whether there is an lm_head.
  hf_folder(const std::string& path, const std::pair<nlohmann::json, std::string>& j)
      : config_path_(j.second),
        family_(loom::io::hf_model_type(j.first, config_path_)),
        cfg_(family_ == "chatglm" ? detail::chatglm_config(j.first, config_path_) : config{}),
        tensors_(path) {
    if (family_ == "llama") cfg_ = detail::llama_hf_config(config_path_, tensors_.find("lm_head.weight") != nullptr);
  }

  std::string config_path_, family_;
  config cfg_;
  loom::io::safetensors_folder tensors_;
};

/// HF LLaMA or ChatGLM2/3 (hf_folder's `path`): every tensor of the model, read whole.
inline flat_weights load_hf_safetensors(const std::string& path) {
  const hf_folder f(path);
  loom::buffer<float> t;
  return flat_weights::fill(f.cfg(), [&](const loom::nn::param_info& e) {
    f.check(e);
    t = loom::buffer<float>(e.numel);
    f.read(f.name_of(e.name), 0, t.span());
    return std::span<const float>(t.span());
  });
}

/// The decoder's config that HF folder `folder`'s config.json describes (LLaMA: half-split
/// rotary, as HF stores q/k; ChatGLM2/3), e.g. to build a trainer for llama3d::init_from_hf.
inline config config_from_hf(const std::string& folder) { return hf_folder(folder).cfg(); }

namespace detail {
/// Whether `path` (which must exist) is an HF checkpoint (a folder or a .safetensors file)
/// rather than a llama2.c file.
inline bool is_hf_checkpoint(const std::string& path) {
  namespace fs = std::filesystem;
  LOOM_CHECK(fs::exists(path), "checkpoint '", path, "' does not exist");
  return fs::is_directory(path) || fs::path(path).extension() == ".safetensors";
}
}  // namespace detail

inline flat_weights load_checkpoint(const std::string& path) {
  return detail::is_hf_checkpoint(path) ? load_hf_safetensors(path) : load_llama2c(path);
}

/// The config load_checkpoint(path) gives, from what precedes the tensors only (config.json
/// and the shards' headers; a llama2.c header), e.g. for a memory plan before loading.
inline config checkpoint_config(const std::string& path) {
  return detail::is_hf_checkpoint(path) ? config_from_hf(path) : detail::llama2c_config(loom::io::read_llama2c_config(path));
}

/// A checkpoint of load_checkpoint's formats opened for range reads of the layout's tensors
/// (Meta's names): the config and every tensor's presence and shape checked from what precedes
/// the data (config.json and the shards' headers; a llama2.c header), then any elements of any
/// tensor, each read at one pread of its bytes. A rank of a tensor group reads its slice
/// through it (slice_from), never the whole model.
class checkpoint_reader {
 public:
  explicit checkpoint_reader(const std::string& path) : path_(path) {
    if (detail::is_hf_checkpoint(path)) {
      hf_.emplace(path);
      cfg_ = hf_->cfg();
      const auto layout = llama3d::full_layout(cfg_);
      for (const auto& e : layout.entries()) hf_->check(e);
      return;
    }
    l2c_.emplace(path);
    cfg_ = detail::llama2c_config(l2c_->config());
    const auto layout = llama3d::full_layout(cfg_);
    for (const auto& e : layout.entries()) {
      const auto* t = l2c_->find(e.name);
      LOOM_CHECK(t, "tensor '", e.name, "' is missing from the checkpoint '", path, "'");
      LOOM_CHECK(std::ranges::equal(t->shape, e.shape), "tensor '", e.name, "' in '", path, "' has shape ",
                 detail::shape_string(t->shape), ", its config gives ", detail::shape_string(e.shape));
    }
  }
  const config& cfg() const noexcept { return cfg_; }
  const std::string& path() const noexcept { return path_; }
  /// Elements [first, first + out.size()) of the layout's tensor `name` (row-major), as float.
  void read(const std::string& name, std::uint64_t first, std::span<float> out) const {
    if (hf_) hf_->read(hf_->name_of(name), first, out);
    else l2c_->read(name, first, out);
  }
  /// Tensor data bytes read so far (the file's element type: 2 per value of a BF16 folder).
  std::uint64_t bytes_read() const noexcept { return hf_ ? hf_->bytes_read() : l2c_->bytes_read(); }

 private:
  std::string path_;
  config cfg_;
  std::optional<hf_folder> hf_;
  std::optional<loom::io::llama2c_file> l2c_;
};

/// Fills a rank's slice: the shards of its layers (who holds what of each full tensor) and
/// its flat buffer in their layout (zeroed). llama_paged's slice constructor calls it with its
/// own shards, so the description of the split is the layers' one.
using slice_source = std::function<void(const loom::nn::tp::shard_list&, std::span<float>)>;

/// A slice_source cutting every shard from `full` (which must outlive it), the whole model in
/// the single-rank layout.
inline slice_source slice_from(const flat_weights& full) {
  LOOM_CHECK(full.params.size() == full.layout.size(), "llama_engine: the weights hold ", full.params.size(),
             " parameters, the layout of their config ", full.layout.size());
  return [&full](const loom::nn::tp::shard_list& shards, std::span<float> slice) {
    loom::nn::tp::load_shards(shards, full.params.span(), slice, [&](const std::string& name) { return full.layout.find(name).offset; });
  };
}

/// A slice_source reading every row of every shard from checkpoint `r` (which must outlive it).
inline slice_source slice_from(const checkpoint_reader& r) {
  return [&r](const loom::nn::tp::shard_list& shards, std::span<float> slice) {
    loom::nn::tp::read_shards(shards, slice,
                              [&](const std::string& name, std::size_t first, std::span<float> out) { r.read(name, first, out); });
  };
}

namespace detail {
// What an HF folder of c's family can hold, refused naming the field (before any file is read).
inline void check_export_config(const config& c) {
  c.validate();
  if (c.model_type == "chatglm") {
    LOOM_CHECK(!c.tied_output, "llama::export_hf: a ChatGLM has its own output_layer; this config has tied_output=true");
    return;
  }
  LOOM_CHECK(!c.fused_qkv && !c.fused_gate_up && !c.qkv_bias && c.partial_rotary_factor == 1.0,
             "llama::export_hf: an HF LLaMA has separate q/k/v and gate/up projections without biases and rotates whole "
             "heads; this config has fused_qkv=", c.fused_qkv, ", fused_gate_up=", c.fused_gate_up, ", qkv_bias=", c.qkv_bias,
             ", partial_rotary_factor=", c.partial_rotary_factor);
}
}  // namespace detail

/// Writes the weights of `ckpt` (of a model with config `c`; any source of whole weights under
/// the model's names: a checkpoint `reader`, or a loom::checkpoint::memory_source such as a
/// LoRA run's merged model, llama3d::export_merged_hf) as a Hugging Face folder of
/// c.model_type: config.json, the family's tensor names, safetensors shards cut at
/// `max_shard_bytes` with model.safetensors.index.json, one tensor in memory at a time.
/// llama: HF runs rotary on the two halves of a head; a model trained with adjacent pairs
/// (Meta's, llama2.c's) gets its q and k rows permuted so that HF computes the same attention
/// (what HF's own converter does). chatglm: the fused tensors are ChatGLM's as they are.
/// load_hf_safetensors reads the folder back.
template <class Source>
  requires(!std::convertible_to<const Source&, std::string>)
int export_hf(const Source& ckpt, const std::string& out_dir, const config& c,
              std::uint64_t max_shard_bytes = std::uint64_t{5} << 30, const std::string& dtype = "F32") {
  detail::check_export_config(c);
  loom::checkpoint::folder_options o;
  o.max_shard_bytes = max_shard_bytes;
  o.dtype = dtype;
  if (c.model_type == "chatglm") {
    o.rename = detail::chatglm_name;
    o.config_json = detail::hf_config_json(c, dtype).dump(2) + "\n";
    return loom::checkpoint::export_folder(ckpt, out_dir, o);
  }
  o.rename = detail::hf_name;
  if (c.rope == loom::ops::rope_style::interleaved)
    o.transform = [&c](const std::string& name, std::span<float> t) {
      if (!name.ends_with("attention.wq.weight") && !name.ends_with("attention.wk.weight")) return;
      const auto hd = static_cast<std::size_t>(c.head_dim()), cols = static_cast<std::size_t>(c.dim);
      const std::vector<float> in(t.begin(), t.end());
      for (std::size_t row = 0; row < t.size() / cols; ++row)
        std::copy_n(in.begin() + static_cast<std::ptrdiff_t>(row * cols), cols,
                    t.begin() + static_cast<std::ptrdiff_t>(detail::half_split_row(row, hd) * cols));
    };
  o.config_json = detail::hf_config_json(c, dtype).dump(2) + "\n";
  return loom::checkpoint::export_folder(ckpt, out_dir, o);
}

/// The same from the sharded checkpoint at path `ckpt`.
inline int export_hf(const std::string& ckpt, const std::string& out_dir, const config& c,
                     std::uint64_t max_shard_bytes = std::uint64_t{5} << 30, const std::string& dtype = "F32") {
  detail::check_export_config(c);  // a bad config is named before the checkpoint is opened
  const loom::checkpoint::reader r(ckpt);
  return export_hf(r, out_dir, c, max_shard_bytes, dtype);
}

}  // namespace llama
