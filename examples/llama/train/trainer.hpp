#pragma once
// The single-rank LLaMA trainer behind `llama-train`, assembled from loom parts:
//   io::ds_config     what to do (batch, precision, optimizer, schedule, clipping)
//   data::token_loader   (tokens, targets) batches from memory-mapped shards
//   llama::model<P>      forward/backward, parameters stored as P (float, bfloat16, half)
//   amp                  loss scaler, overflow detection, fp32 master weights (P != float)
//   optim                AdamW on the fp32 master buffer, lr schedule, global-norm clipping,
//                        gradient accumulation
//
// One optimizer step:
//   zero grads; for each of G micro-batches: loss = forward; backward(scale / G)
//   overflow = any non-finite gradient    -> scaler.update(overflow) decides
//   applied:  g *= 1/scale; clip to gradient_clipping; AdamW on the master weights with
//             lr = schedule(iteration); round master -> model parameters; iteration += 1
//   skipped:  nothing changes but the scaler (DeepSpeed: the schedule does not advance)
// The scale used to unscale is the one applied in this step's backward (captured before the
// scaler's update, which may grow it at a window boundary).
//
// Checkpoints hold everything the next step depends on — parameters, fp32 master weights,
// Adam moments and step count, scaler state, the data position, the iteration — so a
// resumed run repeats an uninterrupted one bit for bit (tests/examples/llama/train).
// Several ranks or a ZeRO stage run zero_trainer.hpp instead (run.hpp chooses).

#include <common/batches.hpp>
#include <common/loss_scaler.hpp>
#include <llama/model/llama.hpp>
#include <loom/amp/loss_scaler.hpp>
#include <loom/amp/master_weights.hpp>
#include <loom/amp/overflow.hpp>
#include <loom/core/dtype.hpp>
#include <loom/core/error.hpp>
#include <loom/core/memory.hpp>
#include <loom/data/chat_jsonl.hpp>
#include <loom/data/token_loader.hpp>
#include <loom/io/ds_config.hpp>
#include <loom/optim/adamw.hpp>
#include <loom/optim/clip.hpp>
#include <loom/optim/lr_schedule.hpp>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <type_traits>
#include <variant>
#include <vector>

namespace llama_train {

struct options {
  std::string config_path;    ///< ds_config.json ("" = defaults below)
  bool allow_unknown = false;
  llama::config model{.dim = 64, .n_layers = 2, .n_heads = 4, .n_kv_heads = 2, .hidden_dim = 192, .vocab = 256, .seq_len = 64};
  std::int64_t steps = 50;    ///< total optimizer steps (a resumed run continues up to it)
  std::vector<std::string> data;
  std::string save, resume;
  std::optional<loom::dtype> precision;  ///< --precision; the config's fp16/bf16 win, "auto" takes this
  std::uint64_t seed = 1234;
  float lr = 1e-3f;
  std::int64_t warmup = 0;
  float weight_decay = 0.01f;
  float clip = 1.f;            ///< for gradient_clipping "auto"
  std::int64_t batch = 8;      ///< micro batch without a config
  std::int64_t grad_accum = 1;
  std::int64_t print_every = 1;
  int ranks = 1;               ///< data-parallel thread ranks; > 1 or ZeRO stage > 0 runs zero_trainer.hpp
  bool checkpointing = false;  ///< also on when the config has activation_checkpointing
};

struct step_record {
  std::int64_t step = 0;  ///< 1-based
  double loss = 0;        ///< mean over the step's micro-batches
  float lr = 0, scale = 1;
  bool skipped = false;
  double grad_norm = 0;
  double seconds = 0, tokens_per_s = 0, flops_per_s = 0;
  std::size_t mem_bytes = 0, peak_bytes = 0;
};

struct train_result {
  std::vector<step_record> steps;
  std::vector<float> params;  ///< final model parameters, widened to float
  std::int64_t parameter_count = 0;
  /// Several ranks / ZeRO (rank 0): the most parameter memory the rank held (its share of
  /// the parameters plus what ZeRO-3 gathered at once), and the unpartitioned model's bytes.
  std::size_t parameter_peak_bytes = 0, parameter_full_bytes = 0;
  std::size_t largest_unit_bytes = 0;  ///< the largest piece ZeRO-3 gathers (a decoder block, the embedding)
};

/// The resolved ds_config for these options (defaults when no --config).
inline loom::io::ds_config resolve_config(const options& o) {
  loom::io::ds_config c = o.config_path.empty() ? loom::io::parse_ds_config(nlohmann::json::object())
                                                : loom::io::load_ds_config(o.config_path, {o.allow_unknown});
  if (o.config_path.empty()) c.micro_batch_given = o.batch, c.grad_accum_given = o.grad_accum;
  loom::io::ds_context ctx{.world_size = o.ranks, .hidden_size = o.model.dim, .total_steps = o.steps, .warmup_steps = o.warmup, .lr = o.lr,
                           .weight_decay = o.weight_decay, .gradient_clipping = o.clip,
                           .precision = o.precision.value_or(loom::dtype::f32), .micro_batch = o.batch, .grad_accum = o.grad_accum};
  loom::io::resolve_ds_config(c, ctx);
  LOOM_CHECK(!o.precision || c.precision() == *o.precision || o.config_path.empty(), "llama-train: --precision ",
             loom::dtype_name(*o.precision), " contradicts the config's ", loom::dtype_name(c.precision()), " (", o.config_path, ")");
  if (o.config_path.empty() && o.precision) {
    c.fp16.enabled.value = *o.precision == loom::dtype::f16;
    c.bf16.value = *o.precision == loom::dtype::bf16;
  }
  return c;
}

using loom::amp::any_loss_scaler;
using examples::make_loss_scaler;

namespace detail {

constexpr char ckpt_magic[8] = {'L', 'O', 'O', 'M', 'L', 'T', 'R', 'N'};
constexpr std::uint32_t ckpt_version = 1;

struct ckpt_header {
  char magic[8];
  std::uint32_t version;
  std::uint32_t precision;  // loom::dtype
  std::int64_t dim, n_layers, n_heads, n_kv_heads, hidden_dim, vocab, seq_len, tied;
  std::uint64_t n_params;
  std::int64_t step, iteration, adam_t;
  std::int64_t loader_epoch, loader_batch;
  float scale;
  std::int32_t hysteresis_left;
  std::int64_t scaler_iteration, last_overflow_iteration, skipped_steps;
};

template <class T>
void write_span(std::ofstream& f, std::span<const T> s) {
  f.write(reinterpret_cast<const char*>(s.data()), static_cast<std::streamsize>(s.size_bytes()));
}
template <class T>
void read_span(std::ifstream& f, std::span<T> s, const std::string& path, const char* what) {
  f.read(reinterpret_cast<char*>(s.data()), static_cast<std::streamsize>(s.size_bytes()));
  LOOM_CHECK(f.gcount() == static_cast<std::streamsize>(s.size_bytes()), "checkpoint path='", path, "' is truncated in ", what);
}

}  // namespace detail

template <class P>
class trainer {
 public:
  trainer(const options& o, const loom::io::ds_config& c, std::ostream* log)
      : o_(o), c_(c), log_(log), mem_("llama-train"), model_(o.model, mem_), G_(c.gradient_accumulation_steps),
        micro_(c.train_micro_batch_size_per_gpu),
        loader_(make_loader(o, micro_)),
        opt_(model_.parameter_count(), c.optimizer.adamw(), mem_), sched_(c.lr_schedule()) {
    model_.init(o.seed);
    model_.set_checkpointing(o.checkpointing || c.activation_checkpointing.enabled);
    if constexpr (!std::is_same_v<P, float>) master_ = loom::amp::master_weights<P>(std::span<const P>(model_.params()), mem_);
    scaler_ = make_loss_scaler(c);
  }

  std::int64_t step_count() const noexcept { return step_; }
  llama::model<P>& model() noexcept { return model_; }

  step_record step() {
    const auto t0 = std::chrono::steady_clock::now();
    const float scale = current_scale();
    model_.zero_grad();
    double loss = 0;
    for (std::int64_t m = 0; m < G_; ++m) {
      std::visit([&](auto& l) { l.next(batch_); }, loader_);
      const loom::extents<2> shape{static_cast<loom::index_t>(batch_.batch), static_cast<loom::index_t>(batch_.seq_len)};
      loss += model_.forward({batch_.tokens.data(), shape}, {batch_.targets.data(), shape}) / static_cast<double>(G_);
      model_.backward(scale / static_cast<float>(G_));
    }
    auto g = model_.grads();
    const bool overflow = loom::amp::detect_overflow(std::span<const float>(g));
    const bool apply = std::visit([&](auto& s) { return s.update(overflow); }, scaler_);
    step_record r{.step = ++step_, .loss = loss, .lr = sched_.lr(iteration_), .scale = scale, .skipped = !apply};
    if (apply) {
      const float inv = 1.f / scale;
      if (inv != 1.f)
        for (float& x : g) x *= inv;
      r.grad_norm = c_.gradient_clipping.value > 0 ? loom::optim::clip_by_global_norm(g, c_.gradient_clipping.value)
                                                   : loom::optim::global_norm({std::span<const float>(g)});
      if constexpr (std::is_same_v<P, float>) {
        opt_.step(model_.params(), g, r.lr);
      } else {
        opt_.step(master_.span(), g, r.lr);
        master_.copy_to(model_.params());
      }
      ++iteration_;
    }
    r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const double tokens = static_cast<double>(G_ * micro_ * o_.model.seq_len);
    r.tokens_per_s = tokens / r.seconds;
    r.flops_per_s = tokens * model_.flops_per_token(o_.model.seq_len) / r.seconds;
    r.mem_bytes = mem_.current_bytes(), r.peak_bytes = mem_.peak_bytes();
    return r;
  }

  void save(const std::string& path) const {
    const std::string tmp = path + ".tmp";
    {
      std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
      LOOM_CHECK(f.good(), "llama-train: cannot write checkpoint path='", path, "'");
      const auto h = header();
      f.write(reinterpret_cast<const char*>(&h), sizeof h);
      detail::write_span(f, model_.params());
      if constexpr (!std::is_same_v<P, float>) detail::write_span(f, master_.span());
      detail::write_span(f, opt_.exp_avg());
      detail::write_span(f, opt_.exp_avg_sq());
      LOOM_CHECK(f.good(), "llama-train: writing checkpoint path='", path, "' failed");
    }
    std::rename(tmp.c_str(), path.c_str());  // a crash mid-write never leaves a torn checkpoint
  }

  void load(const std::string& path) {
    std::ifstream f(path, std::ios::binary);
    LOOM_CHECK(f.good(), "llama-train: cannot open checkpoint path='", path, "'");
    detail::ckpt_header h{};
    f.read(reinterpret_cast<char*>(&h), sizeof h);
    LOOM_CHECK(f.gcount() == sizeof h && std::memcmp(h.magic, detail::ckpt_magic, 8) == 0, "llama-train: path='", path,
               "' is not a llama-train checkpoint");
    LOOM_CHECK(h.version == detail::ckpt_version, "llama-train: checkpoint path='", path, "' has version ", h.version, ", expected ",
               detail::ckpt_version);
    const auto mine = header();
    auto same = [&](const char* what, auto a, auto b) {
      LOOM_CHECK(a == b, "llama-train: checkpoint path='", path, "' has ", what, "=", a, " but this run has ", what, "=", b);
    };
    same("precision", loom::dtype_name(static_cast<loom::dtype>(h.precision)), loom::dtype_name(static_cast<loom::dtype>(mine.precision)));
    same("dim", h.dim, mine.dim), same("n_layers", h.n_layers, mine.n_layers), same("n_heads", h.n_heads, mine.n_heads);
    same("n_kv_heads", h.n_kv_heads, mine.n_kv_heads), same("hidden_dim", h.hidden_dim, mine.hidden_dim);
    same("vocab", h.vocab, mine.vocab), same("seq_len", h.seq_len, mine.seq_len), same("tied_output", h.tied, mine.tied);
    same("n_params", h.n_params, mine.n_params);
    detail::read_span(f, model_.params(), path, "parameters");
    if constexpr (!std::is_same_v<P, float>) detail::read_span(f, master_.span(), path, "master weights");
    detail::read_span(f, opt_.exp_avg(), path, "exp_avg");
    detail::read_span(f, opt_.exp_avg_sq(), path, "exp_avg_sq");
    step_ = h.step, iteration_ = h.iteration;
    opt_.set_step_count(h.adam_t);
    std::visit([&](auto& l) { l.set_state({h.loader_epoch, h.loader_batch}); }, loader_);
    if (auto* d = std::get_if<loom::amp::dynamic_loss_scaler>(&scaler_))
      d->set_state({h.scale, h.scaler_iteration, h.last_overflow_iteration, h.hysteresis_left, h.skipped_steps});
  }

  std::vector<float> params_as_float() const {
    std::vector<float> v(model_.params().size());  // the flat buffer, as the mesh trainer's consolidated_master
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(model_.params()[i]);
    return v;
  }

 private:
  static examples::batch_loader make_loader(const options& o, std::int64_t micro) {
    return examples::make_batch_loader(o.data, o.model.vocab, o.model.seq_len, micro, o.seed);
  }
  float current_scale() const {
    return std::visit([](const auto& s) { return s.scale(); }, scaler_);
  }
  detail::ckpt_header header() const {
    detail::ckpt_header h{};
    std::memcpy(h.magic, detail::ckpt_magic, 8);
    h.version = detail::ckpt_version;
    h.precision = static_cast<std::uint32_t>(loom::dtype_of<P>);
    const auto& m = o_.model;
    h.dim = m.dim, h.n_layers = m.n_layers, h.n_heads = m.n_heads, h.n_kv_heads = m.n_kv_heads, h.hidden_dim = m.hidden_dim;
    h.vocab = m.vocab, h.seq_len = m.seq_len, h.tied = m.tied_output;
    h.n_params = model_.parameter_count();
    h.step = step_, h.iteration = iteration_, h.adam_t = opt_.step_count();
    const auto ls = std::visit([](const auto& l) { return l.state(); }, loader_);
    h.loader_epoch = ls.epoch, h.loader_batch = ls.batch_in_epoch;
    h.scale = current_scale();
    if (const auto* d = std::get_if<loom::amp::dynamic_loss_scaler>(&scaler_)) {
      const auto& s = d->state();
      h.hysteresis_left = s.hysteresis_left, h.scaler_iteration = s.iteration, h.last_overflow_iteration = s.last_overflow_iteration,
      h.skipped_steps = s.skipped_steps;
    }
    return h;
  }

  options o_;
  loom::io::ds_config c_;
  std::ostream* log_;
  loom::host_memory_resource mem_;
  llama::model<P> model_;
  std::int64_t G_, micro_;
  examples::batch_loader loader_;
  loom::data::token_batch batch_;
  loom::optim::adamw opt_;
  loom::amp::master_weights<P> master_;
  loom::optim::any_lr_schedule sched_;
  std::variant<loom::amp::static_loss_scaler, loom::amp::dynamic_loss_scaler> scaler_;
  std::int64_t step_ = 0, iteration_ = 0;
};

/// "step 12/50 | loss 2.3456 | lr 1.00e-03 | 12345 tok/s | 1.23 GFLOP/s | mem 12.3 MiB (peak 14.5)"
inline std::string progress_line(const step_record& r, std::int64_t total, bool show_scale) {
  char buf[256];
  int n = std::snprintf(buf, sizeof buf, "step %lld/%lld | loss %.4f | lr %.3e | %.0f tok/s | %.3f GFLOP/s | mem %.1f MiB (peak %.1f)",
                        static_cast<long long>(r.step), static_cast<long long>(total), r.loss, static_cast<double>(r.lr), r.tokens_per_s,
                        r.flops_per_s * 1e-9, static_cast<double>(r.mem_bytes) / 1048576.0, static_cast<double>(r.peak_bytes) / 1048576.0);
  if (show_scale && n > 0 && n < static_cast<int>(sizeof buf))
    std::snprintf(buf + n, sizeof buf - static_cast<std::size_t>(n), " | scale %g%s", static_cast<double>(r.scale),
                  r.skipped ? " (overflow: step skipped)" : "");
  return buf;
}

}  // namespace llama_train
