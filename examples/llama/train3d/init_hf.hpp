#pragma once
// Pretrained weights into the mesh trainer: llama3d::init_from_hf(trainer, folder) fills every
// rank's parameters and ZeRO fp32 master from a Hugging Face folder (LLaMA or ChatGLM2/3),
// at any mesh and ZeRO stage, reading on each rank only the bytes of the slices it owns.
//
// Why through loom::checkpoint::load: a sharded checkpoint already distributes a model's
// state over the ranks' owned slices (for_each_state_slice, cut into row pieces of the full
// tensors, replicas included). An HF folder is one more source of that state (`hf_source`):
// it answers read(kind, name, first, out) in the model's (Meta's) names from byte ranges of
// the safetensors shards (llama::hf_folder), the master from the weights and zero Adam
// moments, so there is no second slice distribution to keep in step with the first.
//
// The mapping (the same as llama_loader.hpp's and export_hf's, read in the other direction):
//   LLaMA:   HF names (llama::detail::hf_name). HF stores q_proj/k_proj rows permuted for its
//            half-split rotary; a trainer whose config rotates adjacent pairs (rope
//            interleaved, Meta's convention) reads meta row h*hd + 2i + p from HF row
//            h*hd + p*hd/2 + i (HF's converter's permutation: llama::detail::half_split_row); a half-split trainer
//            (config_from_hf's) reads the rows as they are.
//   ChatGLM: ChatGLM names (llama::detail::chatglm_name); query_key_value (+ bias) is the
//            fused wqkv with rows [Q | K | V], dense_h_to_4h the fused w13 [gate | up], as
//            they are (tensor parallelism cuts Q, K, V and gate, up separately).
// Refused with a loom::error naming the file and the key or tensor: config.json disagreeing
// with the trainer's config (the key and both values), an unknown model_type, a missing
// shard, a missing tensor, a tensor whose shape disagrees with config.json.

#include "checkpoint.hpp"
#include "train3d.hpp"

#include <llama/generate/llama_loader.hpp>

#include <loom/checkpoint/sharded.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <exception>
#include <map>
#include <set>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace llama3d {

/// What init_from_hf read on this rank.
struct hf_read_stats {
  std::uint64_t data_bytes = 0;    ///< tensor bytes read (range reads of the owned slices)
  std::uint64_t header_bytes = 0;  ///< the shards' headers, read once each
  std::uint64_t file_bytes = 0;    ///< the shard files' total size
};

/// Refuses (naming config.json, the key and both values) an HF folder whose config.json
/// describes another model than `mine`, the trainer's. The sequence length is not compared:
/// it shapes no weight, and a fine-tuning run may use a shorter one.
inline void check_hf_config(const llama::hf_folder& f, const llama::config& mine) {
  const llama::config& file = f.cfg();
  const std::string what = "config '" + f.config_path() + "'";
  LOOM_CHECK(file.model_type == mine.model_type, what, ": model_type is \"", file.model_type, "\", the trainer's model is \"",
             mine.model_type, "\"");
  // config.json's keys as the family writes them (llama::detail::hf_config_json), both sides
  const nlohmann::json in_file = llama::detail::hf_config_json(file), in_trainer = llama::detail::hf_config_json(mine);
  for (const auto& [key, v] : in_trainer.items()) {
    if (key == "seq_length" || key == "max_position_embeddings" || !(v.is_number() || v.is_boolean())) continue;
    const auto& u = in_file.at(key);  // reals relatively (LLaMA's eps is read as float), the rest exactly
    const bool same = v.is_number_float() ? std::abs(u.get<double>() - v.get<double>()) <= 1e-6 * std::abs(v.get<double>()) : u == v;
    LOOM_CHECK(same, what, ": \"", key, "\" is ", u.dump(), ", the trainer's model has ", v.dump());
  }
  LOOM_CHECK(file.fused_qkv == mine.fused_qkv && file.fused_gate_up == mine.fused_gate_up && file.qkv_bias == mine.qkv_bias &&
                 file.tied_output == mine.tied_output && file.partial_rotary_factor == mine.partial_rotary_factor,
             what, ": a ", f.family(), " model has fused_qkv=", file.fused_qkv, ", fused_gate_up=", file.fused_gate_up,
             ", add_qkv_bias=", file.qkv_bias, ", tie_word_embeddings=", file.tied_output, ", partial_rotary_factor=",
             file.partial_rotary_factor, "; the trainer's has ", mine.fused_qkv, ", ", mine.fused_gate_up, ", ", mine.qkv_bias,
             ", ", mine.tied_output, ", ", mine.partial_rotary_factor);
  LOOM_CHECK(f.family() != "chatglm" || mine.rope == loom::ops::rope_style::interleaved, what,
             ": ChatGLM rotates interleaved pairs; the trainer's config rotates half-split");
}

/// An HF folder as a loom::checkpoint::state_source in the model's names: the master from
/// the weights (the mapping in the file comment), the Adam moments zero. The constructor
/// checks every tensor of the model against the shards' headers (present, config.json's shape).
class hf_source {
 public:
  hf_source(const llama::hf_folder& f, const llama::config& c) : f_(&f), head_dim_(static_cast<std::size_t>(c.head_dim())) {
    const auto layout = full_layout(c);
    for (const auto& e : layout.entries()) {
      f.check(e);  // present, with config.json's shape
      cols_[e.name] = e.shape.size() == 2 ? static_cast<std::size_t>(e.shape[1]) : 1;
    }
    // LLaMA's q/k rows are stored for half-split rotary (see the file comment)
    if (f.family() == "llama" && c.rope == loom::ops::rope_style::interleaved)
      for (index_t l = 0; l < c.n_layers; ++l)
        for (const char* w : {".attention.wq.weight", ".attention.wk.weight"}) permuted_.insert("layers." + std::to_string(l) + w);
  }

  /// Elements [first, first + out.size()) of tensor `name` (the model's name) of state `kind`.
  void read(int kind, const std::string& name, std::size_t first, std::span<float> out) const {
    if (kind != 0) {  // Adam starts from zero moments
      std::fill(out.begin(), out.end(), 0.f);
      return;
    }
    const std::string hf = f_->name_of(name);
    if (!permuted_.contains(name)) {
      f_->read(hf, first, out);
      return;
    }
    const std::size_t cols = cols_.at(name);
    for (std::size_t at = first, end = first + out.size(); at < end;) {  // row by row
      const std::size_t row = at / cols, col = at % cols, n = std::min(cols - col, end - at);
      f_->read(hf, llama::detail::half_split_row(row, head_dim_) * cols + col, out.subspan(at - first, n));
      at += n;
    }
  }

 private:
  const llama::hf_folder* f_;
  std::size_t head_dim_;
  std::map<std::string, std::size_t> cols_;
  std::set<std::string> permuted_;
};

namespace detail {
/// A LoRA run's frozen base lives in the models' own buffers (no engine, no master): every
/// shard of every chunk, replicas included, read row by row from src; a quantised base's
/// projections are read whole per shard and quantised by their frozen ops. A chunk whose
/// base a schedule unfreezes has it in an engine of its own (trainer::base_engine): it is read
/// into that engine's fp32 master slices, as a run without LoRA is, and the caller refreshes
/// the parameters from there (trainer::restore) -- written into the parameters alone, it would
/// be overwritten by the master's initial values at the first step.
template <class P, class T, class C, class Source>
void read_frozen_base(trainer<P, T, C>& t, const Source& src) {
  std::vector<float> row;
  for (int k = 0; k < t.chunks(); ++k) {
    auto& m = t.model(k);
    if (auto* e = t.base_engine(k)) {
      using engine_t = std::remove_pointer_t<decltype(e)>;
      const loom::checkpoint::chunk<engine_t> ch[1] = {{&m.shards(), e}};
      loom::checkpoint::load(src, std::span<const loom::checkpoint::chunk<engine_t>>(ch));
      continue;
    }
    const std::span<P> p = m.params();
    for (const auto& s : m.shards())
      for (index_t r = 0; r < s.rows; ++r) {
        row.resize(static_cast<std::size_t>(s.cols));
        src.read(0, s.name, static_cast<std::size_t>((s.row0 + r) * s.full_cols + s.col0), std::span<float>(row));
        for (index_t j = 0; j < s.cols; ++j) p[s.local_offset + static_cast<std::size_t>(r * s.cols + j)] = P(row[static_cast<std::size_t>(j)]);
      }
    // a quantised base (lora_base bf16 / nf4): its projections are quantised from what is read
    const auto& fs = m.frozen_shards();
    for (std::size_t i = 0; i < fs.size(); ++i) {
      const auto& s = fs[i];
      std::vector<float> w(static_cast<std::size_t>(s.rows * s.cols));
      for (index_t r = 0; r < s.rows; ++r)
        src.read(0, s.name, static_cast<std::size_t>((s.row0 + r) * s.full_cols + s.col0),
                 std::span<float>(w).subspan(static_cast<std::size_t>(r * s.cols), static_cast<std::size_t>(s.cols)));
      t.set_frozen_weight(k, i, loom::make_view(static_cast<const float*>(w.data()), s.rows, s.cols));
    }
  }
}
}  // namespace detail

/// init_from_hf, and what this rank read.
template <class P, class T, class C>
void init_from_hf(trainer<P, T, C>& t, const std::string& folder, hf_read_stats& stats) {
  // Every rank opens the folder and checks it (the same files: the same verdict on every
  // rank, before any collective); a read that fails on some ranks only is agreed on below.
  const llama::hf_folder f(folder);
  check_hf_config(f, t.model().cfg());
  const hf_source src(f, t.model().cfg());
  std::exception_ptr failed;
  try {
    if (t.options().lora) {
      detail::read_frozen_base(t, src);
    } else {
      const auto chunks = detail::checkpoint_chunks(t);
      loom::checkpoint::load(src, std::span(std::as_const(chunks)));
    }
  } catch (...) {
    failed = std::current_exception();
  }
  double failures = failed ? 1.0 : 0.0;
  auto& world = t.mesh().world();
  world.all_reduce(std::span<const double>(&failures, 1), std::span<double>(&failures, 1), loom::comm::reduce_op::sum);
  if (failed) std::rethrow_exception(failed);
  LOOM_CHECK(failures == 0, "llama3d::init_from_hf: reading '", folder, "' failed on ", failures, " other rank(s)");
  // the parameters from the master (stage 0 gathers it first), step 0; LoRA: the base engines'
  // too (the adapters' engine keeps its values), then the frozen base is W0 where merged
  if (!t.options().lora || t.has_base_engine()) t.restore(0);
  if (t.options().lora) t.lora_capture_base();
  stats = {f.bytes_read(), f.header_bytes(), f.file_bytes()};
}

/// Fills the trainer's parameters and each ZeRO engine's fp32 master from the Hugging Face
/// folder `folder` (config.json + safetensors: one file, or shards listed by
/// model.safetensors.index.json; F32, F16 or BF16), the Adam moments zero and the step 0.
/// Collective over the world; any mesh and ZeRO stage. Each rank reads only the byte ranges
/// of the slices it owns. The trainer's config must describe the folder's model
/// (llama::config_from_hf gives it).
template <class P, class T, class C>
void init_from_hf(trainer<P, T, C>& t, const std::string& folder) {
  hf_read_stats stats;
  init_from_hf(t, folder, stats);
}

/// A LoRA run's model with its adapters merged (PEFT's merge_and_unload): every adapted weight
/// W + scaling B A over the consolidated base (what a schedule trained of it included; a
/// quantised base dequantised), written as a Hugging Face folder of the model's family by world
/// rank 0 (llama::export_hf: HF's names and row order), which serves and loads like any other.
/// Collective over the world; rank 0 holds the whole model in fp32 for the write. Returns the
/// number of safetensors files (0 on other ranks).
template <class P, class T, class C>
int export_merged_hf(trainer<P, T, C>& t, const std::string& out_dir) {
  LOOM_CHECK(t.options().lora, "llama3d::export_merged_hf: this run has no LoRA adapters (save_checkpoint + llama::export_hf)");
  const auto& lc = *t.options().lora;
  const llama::config& c = t.model().cfg();
  std::vector<float> base = t.consolidated_base();
  const std::vector<float> ad = t.consolidated_lora();
  if (t.mesh().world().rank() != 0) return 0;
  const auto full = full_layout(c);
  const auto lo = lora_full(lc, c);  // consolidated_lora's layout: one adapter per full tensor
  for (const auto& it : lo.items()) {
    const auto& w = full.find(it.name + ".weight");
    it.ad.merge(std::span<float>(base).subspan(w.offset, w.numel), loom::nn::param_slot<2>{0, {it.rows, it.cols}},
                lo.layout().unit(std::span<const float>(ad), it.unit), lc.scaling());
  }
  loom::checkpoint::memory_source src;
  for (const auto& e : full.entries())
    src.add(e.name, std::vector<std::int64_t>(e.shape.begin(), e.shape.end()),
            std::span<const float>(base).subspan(e.offset, e.numel));
  return llama::export_hf(src, out_dir, c);
}

}  // namespace llama3d
