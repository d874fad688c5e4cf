#pragma once
// One rank's whole llama-train run (train.hpp): the mesh trainer with parameters stored as P
// over communicator C. Included only by the translation units that instantiate it
// (train_rank.cpp), so the trainer is compiled once per build.
//
// What it adds to llama3d::trainer is the program's side: the ds_config's options, the data
// (include/loom/data/batches.hpp: micro-batch g of step t is batch t G + g of the whole data
// set, whatever the mesh, so the loss curve does not depend on it), the lr schedule,
// evaluation, sharded checkpoints (save / resume / export), and the progress lines.

#include "train.hpp"

#include <loom/comm/fault_inject.hpp>
#include <llama/generate/llama_loader.hpp>
#include <llama/train3d/checkpoint.hpp>
#include <llama/train3d/init_hf.hpp>
#include <llama/train3d/lora_peft.hpp>
#include <tokenizer_file.hpp>

#include <loom/comm/communicator.hpp>
#include <loom/data/batches.hpp>
#include <loom/zero/ds_config.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

namespace llama_train {

/// The mesh trainer's options for the program's options and their resolved ds_config.
inline llama3d::train_options trainer_options(const options& o, const loom::io::ds_config& c) {
  const loom::zero::engine_options e = loom::zero::engine_options_from(c);
  llama3d::train_options t;
  t.mesh = o.mesh;
  t.zero_stage = c.zero.stage;
  t.schedule = o.schedule;
  t.chunks = o.chunks;
  t.micro_batches = static_cast<int>(c.gradient_accumulation_steps);
  t.micro_batch_size = static_cast<loom::index_t>(c.train_micro_batch_size_per_gpu);
  t.seq = o.model.seq_len;
  t.adamw = e.adamw;
  t.gradient_clipping = e.gradient_clipping;
  t.stage3 = e.stage3;
  t.offload_optimizer = e.offload_optimizer;
  t.nvme_path = e.nvme_path;
  t.seed = o.seed;
  t.checkpointing = o.checkpointing || c.activation_checkpointing.enabled;
  t.loss_scaler = loom::zero::loss_scaler_from(c);
  t.lora = o.lora;
  t.lora_base = llama3d::parse_lora_base(o.lora_base);
  t.lora_merged = o.lora_merged;
  t.groups = c.groups;
  t.total_steps = o.steps;
  t.group_name = [model = o.model](const std::string& n) { return group_name(model, n); };
  return t;
}

inline bool counting_data(const std::vector<std::string>& data) { return data.size() == 1 && data[0] == "counting"; }

/// The batches of one data set: a loader over files, or the counting stream (a held-out one
/// for evaluation: step indices training never reaches).
class batch_source {
 public:
  batch_source(const std::vector<std::string>& files, const options& o, const llama3d::train_options& to, bool held_out,
               const loom::data::chat_encoding& chat)
      : seed_(o.seed), rows_(to.micro_batch_size), seq_(to.seq), vocab_(o.model.vocab), G_(to.mesh.dp * to.micro_batches),
        offset_(held_out ? std::int64_t(1) << 40 : 0) {
    if (!counting_data(files)) loader_.emplace(loom::data::make_batch_loader(files, vocab_, seq_, rows_, seed_, 0, 1, chat));
  }
  void operator()(std::int64_t step, int g, std::span<std::int32_t> tok, std::span<std::int32_t> tgt) {
    if (!loader_) return llama3d::counting_batch(seed_, offset_ + step, g, rows_, seq_, vocab_, tok, tgt);
    loom::data::global_micro_batch(*loader_, step, g, G_, batch_);
    std::copy(batch_.tokens.begin(), batch_.tokens.end(), tok.begin());
    std::copy(batch_.targets.begin(), batch_.targets.end(), tgt.begin());
  }

 private:
  std::uint64_t seed_;
  loom::index_t rows_, seq_, vocab_;
  int G_;
  std::int64_t offset_;
  std::optional<loom::data::batch_loader> loader_;
  loom::data::token_batch batch_;
};

/// The tokenizer goes with an exported model, as HF tooling expects it beside the weights: the
/// --init-from folder's tokenizer files (tokenizer.model, tokenizer_config.json,
/// tokenization_*.py, special_tokens_map.json), else --tokenizer's .model file. A folder
/// without a tokenizer_config.json gets one naming the chat template the model was tuned with
/// and its special tokens (how ChatGLM3's folder tells itself from ChatGLM2's, which share
/// model_type and tokenizer.model; llama-serve reads it to choose the template).
inline void copy_tokenizer(const options& o, const std::string& out_dir) {
  namespace fs = std::filesystem;
  const auto copy = [&](const fs::path& from, const std::string& name) {
    fs::copy_file(from, fs::path(out_dir) / name, fs::copy_options::overwrite_existing);
  };
  if (!o.init_from.empty()) {
    for (const auto& e : fs::directory_iterator(o.init_from)) {
      const std::string name = e.path().filename().string();
      if (e.is_regular_file() && (name.starts_with("tokeniz") || name == "special_tokens_map.json")) copy(e.path(), name);
    }
  } else if (o.tokenizer.ends_with(".model")) {
    copy(o.tokenizer, "tokenizer.model");
  }
  const fs::path config = fs::path(out_dir) / "tokenizer_config.json";
  if (o.chat_template.empty() || fs::exists(config)) return;
  nlohmann::json j = {{"chat_template_name", o.chat_template}};
#if LOOM_HAS_SENTENCEPIECE  // ChatGLM's special tokens come with its SentencePiece tokenizer
  if (o.chat_template == "chatglm2" || o.chat_template == "chatglm3") {
    j["tokenizer_class"] = "ChatGLMTokenizer";
    j["additional_special_tokens"] =
        o.chat_template == "chatglm3" ? loom::data::chatglm3_special_tokens() : loom::data::chatglm2_special_tokens();
  }
#endif
  std::ofstream(config) << j.dump(2) << "\n";
}

template <class C>
double max_over_ranks(C& comm, double x) {
  comm.all_reduce(std::span<const double>(&x, 1), std::span<double>(&x, 1), loom::comm::reduce_op::max);
  return x;
}

/// Rank 0 prints the mesh, then one line per rank: its coordinates, layers and memory.
template <class P, class C>
void print_ranks(C& comm, llama3d::trainer<P, float, C>& t, const options& o, const loom::io::ds_config& c,
                 loom::memory_resource& mem, std::ostream* log) {
  const auto& to = t.options();
  const int world = comm.size();
  if (log) {
    const bool offload = c.zero.offload_optimizer.device == loom::io::offload_device::cpu ||
                         c.zero.offload_param.device == loom::io::offload_device::cpu;
    char buf[512];
    std::snprintf(buf, sizeof buf,
                  "llama-train: mesh dp=%d x tp=%d x pp=%d (%d %s rank%s), ZeRO-%d, schedule %s, m=%d micro-batches of [%lld, %lld], "
                  "model dim=%lld layers=%lld heads=%lld/%lld vocab=%lld, parameters %s%s",
                  to.mesh.dp, to.mesh.tp, to.mesh.pp, world, mpi_launch_size() > 1 ? "MPI" : "thread", world == 1 ? "" : "s",
                  to.zero_stage, to.schedule.c_str(), to.micro_batches, (long long)to.micro_batch_size, (long long)to.seq,
                  (long long)o.model.dim, (long long)o.model.n_layers, (long long)o.model.n_heads, (long long)o.model.n_kv_heads,
                  (long long)o.model.vocab, std::string(loom::dtype_name(c.precision())).c_str(),
                  offload ? " (offload to cpu: the host backend keeps these states in host memory already)" : "");
    *log << buf << "\n";
  }
  // [dp, tp, pp, embedding?, head?, params, grads, optimizer, memory, (first, last) per chunk]
  const auto coord = t.mesh().coord();
  const auto b = t.bytes();
  std::vector<double> mine = {double(coord.dp), double(coord.tp), double(coord.pp), double(t.model().first_stage()),
                              double(t.model(t.chunks() - 1).last_stage()), double(b.parameters), double(b.gradients),
                              double(b.optimizer), double(mem.current_bytes()), double(t.frozen_base_bytes())};
  for (int k = 0; k < t.chunks(); ++k) mine.push_back(double(t.model(k).layers().first)), mine.push_back(double(t.model(k).layers().last));
  std::vector<double> all(mine.size() * std::size_t(world));
  comm.all_gather(std::span<const double>(mine), std::span<double>(all));
  if (!log) return;
  for (int r = 0; r < world; ++r) {
    const double* v = all.data() + std::size_t(r) * mine.size();
    std::string layers;
    for (int k = 0; k < t.chunks(); ++k)
      layers += (k ? " [" : "[") + std::to_string(std::int64_t(v[10 + 2 * k])) + ", " + std::to_string(std::int64_t(v[11 + 2 * k])) + ")";
    char buf[512];
    std::snprintf(buf, sizeof buf,
                  "  rank %d (dp=%d, tp=%d, pp=%d): layers %s%s%s, model states %.1f KiB (params %.1f, grads %.1f, optimizer %.1f), "
                  "memory in use %.1f KiB",
                  r, int(v[0]), int(v[1]), int(v[2]), layers.c_str(), v[3] != 0 ? " +embedding" : "", v[4] != 0 ? " +norm+output" : "",
                  (v[5] + v[6] + v[7]) / 1024.0, v[5] / 1024.0, v[6] / 1024.0, v[7] / 1024.0, (v[8] + v[9]) / 1024.0);
    *log << buf;
    if (v[9] != 0) {
      std::snprintf(buf, sizeof buf, " (of which the %s frozen base's projections %.1f KiB)", to_string(to.lora_base), v[9] / 1024.0);
      *log << buf;
    }
    *log << "\n";
  }
  log->flush();
}

template <class P, loom::comm::communicator C>
train_result run_rank(C& comm, const options& o, const loom::io::ds_config& c, std::ostream* log) {
  const int rank = comm.rank();
  if (rank != 0) log = nullptr;
  loom::host_memory_resource mem("llama-train rank " + std::to_string(rank)), params("parameters");
  const llama3d::train_options to = trainer_options(o, c);
  llama3d::trainer<P, float, C> t(comm, o.model, to, mem, &params);
  print_ranks(comm, t, o, c, mem, log);

  // chat records: the tokenizer and the template (ChatGLM's special tokens for its templates)
  std::optional<loom::data::any_tokenizer> tokenizer;
  loom::data::chat_encoding chat;
  if (!o.chat_template.empty()) chat.chat_template.kind = loom::data::parse_chat_template(o.chat_template);
  chat.max_source_length = static_cast<std::size_t>(o.max_source_length);
  if (!o.tokenizer.empty()) {
    const std::string specials = o.chat_template == "chatglm2" || o.chat_template == "chatglm3" ? o.chat_template : "none";
    tokenizer.emplace(examples::open_tokenizer(o.tokenizer, o.tokenizer.ends_with(".model") ? specials : "none", o.model.vocab));
    chat.tokenizer = &*tokenizer;
  }
  batch_source data(o.data, o, to, false, chat);
  std::optional<batch_source> eval;
  if (o.eval_every > 0) eval.emplace(o.eval_data.empty() ? o.data : o.eval_data, o, to, o.eval_data.empty(), chat);
  const auto sched = c.lr_schedule();

  train_result res;
  res.parameter_count = static_cast<std::int64_t>(llama3d::full_layout(o.model).parameter_count());
  // a resumed run continues its checkpoint instead; a LoRA run's checkpoint holds no frozen base
  if (!o.init_from.empty() && (o.resume.empty() || o.lora)) {
    llama3d::init_from_hf(t, o.init_from);
    if (log) *log << "initialised from the Hugging Face folder " << o.init_from << "\n";
  }
  if (!o.lora_from.empty()) {
    llama3d::import_lora_peft(t, o.lora_from);
    if (log) *log << "LoRA adapters from the PEFT folder " << o.lora_from << "\n";
  }
  if (!o.resume.empty()) {
    llama3d::load_checkpoint(t, o.resume);
    if (log) *log << "resumed from " << loom::checkpoint::resolve(o.resume) << " at step " << t.steps() << "\n";
  }
  LOOM_CHECK(o.steps >= t.steps(), "llama-train: --steps ", o.steps, " is below the resumed checkpoint's step ", t.steps());
  if (log) *log << "parameters " << res.parameter_count << std::endl;
  const auto save = [&] {
    res.checkpoint = llama3d::save_checkpoint(t, o.save, o.keep_last);
    if (log) *log << "saved checkpoint " << res.checkpoint << " at step " << t.steps() << std::endl;
  };
  const double tokens = double(to.mesh.dp) * to.micro_batches * double(to.micro_batch_size * to.seq);
  std::vector<bool> training;  // the groups that trained at the last step
  for (std::int64_t s = t.steps() + 1; s <= o.steps; ++s) {
    if (loom::comm::inject_fault(rank, s - 1)) return res;  // test hook (LOOM_FAULT_INJECT)
    const float lr = sched.lr(t.steps());                   // a skipped step does not advance the schedule (DeepSpeed)
    t.set_lr(lr);
    if (t.options().grouped() && log) {  // at each phase change: which groups train from here
      const auto on = t.trainable_now();
      if (on != training) {
        std::string names, frozen;
        for (std::size_t g = 0; g < on.size(); ++g) (on[g] ? names : frozen) += " " + t.groups().groups[g].name;
        *log << "step " << s << "/" << o.steps << ": training groups" << (names.empty() ? " (none)" : names)
             << (frozen.empty() ? "" : "; frozen" + frozen) << std::endl;
        training = on;
      }
    }
    const auto st = t.step(std::ref(data));
    step_record r;
    r.step = s, r.loss = st.loss, r.lr = lr, r.scale = st.loss_scale, r.skipped = st.skipped, r.grad_norm = st.grad_norm;
    r.seconds = max_over_ranks(comm, st.seconds);
    r.tokens_per_s = tokens / r.seconds;
    r.flops_per_s = tokens * o.model.flops_per_token(to.seq) / r.seconds;
    r.mem_bytes = std::size_t(max_over_ranks(comm, double(mem.current_bytes() + params.current_bytes() + t.frozen_base_bytes())));
    r.peak_bytes = std::size_t(max_over_ranks(comm, double(mem.peak_bytes() + params.peak_bytes() + t.frozen_base_bytes())));
    if (log && (s % o.print_every == 0 || s == o.steps)) *log << progress_line(r, o.steps, c.precision() == loom::dtype::f16) << std::endl;
    if (eval && (s % o.eval_every == 0 || s == o.steps)) {
      double loss = 0;
      for (int k = 0; k < o.eval_batches; ++k) loss += t.evaluate(std::ref(*eval), k) / o.eval_batches;
      r.eval_loss = loss;
      char buf[128];
      std::snprintf(buf, sizeof buf, "eval after step %lld: loss %.4f  perplexity %.3f", (long long)s, loss, std::exp(loss));
      if (log) *log << buf << std::endl;
    }
    res.steps.push_back(r);
    if (!o.save.empty() && o.save_every > 0 && s % o.save_every == 0 && s != o.steps) save();
  }
  if (log && res.steps.size() > 1) {  // the first step pays for allocations and cold caches
    double sec = 0, tok = 0, fl = 0;
    for (std::size_t i = 1; i < res.steps.size(); ++i) {
      const auto& r = res.steps[i];
      sec += r.seconds, tok += r.tokens_per_s * r.seconds, fl += r.flops_per_s * r.seconds;
    }
    char buf[160];
    std::snprintf(buf, sizeof buf, "mean over steps 2-%zu: %.0f tok/s, %.3f GFLOP/s, %.1f ms/step", res.steps.size(), tok / sec,
                  fl / sec * 1e-9, 1e3 * sec / static_cast<double>(res.steps.size() - 1));
    *log << buf << std::endl;
  }
  if (!o.save.empty()) save();
  if (!o.export_hf.empty() && o.lora) {  // collective: the base with the adapters merged, written by rank 0
    const int files = llama3d::export_merged_hf(t, o.export_hf);
    if (rank == 0) copy_tokenizer(o, o.export_hf);
    if (log)
      *log << "exported the model with its LoRA adapters merged as the HF folder " << o.export_hf << " (" << files
           << " safetensors file" << (files == 1 ? "" : "s") << ")" << std::endl;
  } else if (!o.export_hf.empty() && rank == 0) {  // streamed from the checkpoint just written, one tensor at a time
    const int files = llama::export_hf(res.checkpoint, o.export_hf, o.model);
    copy_tokenizer(o, o.export_hf);
    if (log)
      *log << "exported " << res.checkpoint << " as the HF folder " << o.export_hf << " (" << files << " safetensors file"
           << (files == 1 ? "" : "s") << ")" << std::endl;
  }
  if (!o.export_lora.empty()) {  // collective: every rank's adapters, written by rank 0
    llama3d::export_lora_peft(t, o.export_lora, o.init_from);
    if (log) *log << "exported the LoRA adapters as the PEFT folder " << o.export_lora << std::endl;
  }
  res.params = o.lora ? t.consolidated_lora() : t.consolidated_master();
  res.parameter_peak_bytes = params.peak_bytes();
  res.parameter_full_bytes = t.model().size() * sizeof(P);
  const auto& L = t.model().layout();
  for (std::size_t u = 0; u < L.units(); ++u)
    res.largest_unit_bytes = std::max(res.largest_unit_bytes, (L.unit_end(u) - L.unit_begin(u)) * sizeof(P));
  if (log) {
    const auto b = t.bytes();
    *log << "zero stage " << to.zero_stage << " x " << to.mesh.dp << " data-parallel ranks: per-rank states " << b.parameters
         << " B params + " << b.persistent << " B persistent + " << b.gradients << " B grads + " << b.optimizer << " B optimizer ("
         << (to.offload_optimizer == loom::zero::offload_device::none ? "on device" : "offloaded") << "); peak parameter memory "
         << params.peak_bytes() << " B of " << t.model().size() * sizeof(P) << " B unpartitioned" << std::endl;
  }
  return res;
}

}  // namespace llama_train
