#pragma once
// DeepSpeed-style ds_config.json: parse, check every key, resolve "auto" and the batch sizes.
//
// Why strict: a DeepSpeed user's config is a contract. A key loom does not implement must
// not be silently ignored (the user would believe ZeRO-Offload or a schedule is on when it
// is not), so every unknown or unsupported key is an error that names the key and lists the
// supported ones; `allow_unknown` downgrades unknown keys to warnings (returned in
// ds_config::warnings, for the program to print). Values of the wrong type or out of range
// are errors naming the key and the value. Every number is range-checked for its key (no
// silent narrowing: 1e300 is not an inf learning rate, 2^32 + 64 is not an int 64), and
// messages quote input values bounded (data/json_input.hpp), since a config file may be
// arbitrarily large or deep.
//
// Two phases, as in DeepSpeed + HF Trainer:
//   parse_ds_config(json)      -> ds_config with "auto" values marked (maybe_auto::is_auto)
//   resolve_ds_config(cfg, ctx) fills them from the program's context (world size, hidden
//                              size, steps, lr, precision flag) and applies DeepSpeed's batch
//                              rule: train_batch_size = micro_batch * grad_accum * world.
// The "auto" rules are HF's: reduce_bucket_size = h^2, stage3_prefetch_bucket_size =
// 0.9 h^2, stage3_param_persistence_threshold = 10 h; optimizer/scheduler values from the
// command line. Batch keys given as "auto" count as not given and are derived.
//
// Keys (see docs/training.md for the semantics of each and what loom does with it):
//   train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps,
//   gradient_clipping, steps_per_print, wall_clock_breakdown, communication_data_type,
//   fp16 {enabled, loss_scale, initial_scale_power, loss_scale_window, hysteresis,
//         consecutive_hysteresis, min_loss_scale}, bf16 | bfloat16 {enabled},
//   zero_optimization {stage, offload_optimizer {device, pin_memory, nvme_path},
//         offload_param {device, pin_memory}, overlap_comm, contiguous_gradients,
//         reduce_scatter, reduce_bucket_size, allgather_bucket_size, sub_group_size,
//         stage3_prefetch_bucket_size, stage3_param_persistence_threshold,
//         stage3_max_live_parameters, stage3_max_reuse_distance,
//         stage3_gather_16bit_weights_on_model_save},
//   optimizer {type: AdamW, params {lr, betas, eps, weight_decay}},
//   scheduler {type: WarmupLR | WarmupDecayLR | WarmupCosineLR, params {...}},
//   activation_checkpointing {partition_activations, cpu_checkpointing,
//         contiguous_memory_optimization, number_checkpoints,
//         synchronize_checkpoint_boundary, profile}.

#include <loom/core/dtype.hpp>
#include <loom/core/error.hpp>
#include <loom/data/input.hpp>
#include <loom/data/json_input.hpp>
#include <loom/optim/adamw.hpp>
#include <loom/optim/lr_schedule.hpp>
#include <loom/optim/param_groups.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <initializer_list>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace loom::io {

/// A value that may be "auto" in the file until resolve_ds_config() fills it.
template <class T>
struct maybe_auto {
  T value{};
  bool is_auto = false;
};

enum class offload_device { none, cpu, nvme };

struct ds_offload {
  offload_device device = offload_device::none;
  bool pin_memory = false;
  std::string nvme_path;
};

struct ds_fp16 {
  maybe_auto<bool> enabled;
  float loss_scale = 0.f;  ///< 0: dynamic
  int initial_scale_power = 16;
  std::int64_t loss_scale_window = 1000;
  int hysteresis = 2;
  bool consecutive_hysteresis = false;
  float min_loss_scale = 1.f;
};

struct ds_zero {
  int stage = 0;
  ds_offload offload_optimizer, offload_param;
  std::optional<bool> overlap_comm;  ///< unset: DeepSpeed's default (true for stage 3)
  bool contiguous_gradients = true;
  bool reduce_scatter = true;
  maybe_auto<std::int64_t> reduce_bucket_size{500000000};
  std::int64_t allgather_bucket_size = 500000000;
  std::int64_t sub_group_size = 1000000000;
  maybe_auto<std::int64_t> stage3_prefetch_bucket_size{50000000};
  maybe_auto<std::int64_t> stage3_param_persistence_threshold{100000};
  std::int64_t stage3_max_live_parameters = 1000000000;
  std::int64_t stage3_max_reuse_distance = 1000000000;
  bool stage3_gather_16bit_weights_on_model_save = false;
  bool overlap() const noexcept { return overlap_comm.value_or(stage == 3); }
};

struct ds_optimizer {
  maybe_auto<float> lr{1e-3f};
  maybe_auto<float> beta1{0.9f}, beta2{0.999f};  ///< betas; auto applies to both
  maybe_auto<float> eps{1e-8f};
  maybe_auto<float> weight_decay{0.01f};
  optim::adamw_options adamw() const { return {lr.value, beta1.value, beta2.value, eps.value, weight_decay.value}; }
};

enum class ds_scheduler_type { none, warmup_lr, warmup_decay_lr, warmup_cosine_lr };

struct ds_scheduler {
  ds_scheduler_type type = ds_scheduler_type::none;
  maybe_auto<std::int64_t> total_num_steps{0};
  maybe_auto<std::int64_t> warmup_num_steps{1000};
  maybe_auto<float> warmup_min_lr{0.f};
  maybe_auto<float> warmup_max_lr{1e-3f};
  float warmup_min_ratio = 0.f;
  float cos_min_ratio = 1e-4f;
  optim::warmup_type warmup = optim::warmup_type::log;
};

struct ds_activation_checkpointing {
  bool enabled = false;  ///< the section is present
  bool partition_activations = false;
  bool cpu_checkpointing = false;
  bool contiguous_memory_optimization = false;
  std::int64_t number_checkpoints = 0;
  bool synchronize_checkpoint_boundary = false;
  bool profile = false;
};

struct ds_config {
  // batch: as given (unset or "auto" = derive), then resolved
  std::optional<std::int64_t> train_batch_size_given, micro_batch_given, grad_accum_given;
  bool micro_batch_auto = false, grad_accum_auto = false;
  std::int64_t train_batch_size = 0, train_micro_batch_size_per_gpu = 0, gradient_accumulation_steps = 0;
  maybe_auto<float> gradient_clipping{0.f};  ///< 0: no clipping
  std::int64_t steps_per_print = 10;
  bool wall_clock_breakdown = false;
  std::optional<dtype> communication_data_type;  ///< unset: the parameters' type
  ds_fp16 fp16;
  maybe_auto<bool> bf16;
  ds_zero zero;
  bool has_optimizer = false;
  ds_optimizer optimizer;
  ds_scheduler scheduler;
  ds_activation_checkpointing activation_checkpointing;
  /// loom's keys "param_groups" and "progressive_unfreezing" (DeepSpeed takes groups from the
  /// Python model; a C++ program needs them in the config), checked by optim::check
  optim::param_groups groups;
  std::vector<std::string> warnings;  ///< unknown keys when allow_unknown
  bool resolved = false;

  /// The training precision the config asks for: f16, bf16 or f32.
  dtype precision() const noexcept { return fp16.enabled.value ? dtype::f16 : bf16.value ? dtype::bf16 : dtype::f32; }
  /// The learning-rate schedule (a constant optimizer lr without a scheduler section).
  optim::any_lr_schedule lr_schedule() const {
    const auto& s = scheduler;
    switch (s.type) {
      case ds_scheduler_type::none: return {optim::constant_lr{optimizer.lr.value}};
      case ds_scheduler_type::warmup_lr:
        return {optim::warmup_lr{s.warmup_min_lr.value, s.warmup_max_lr.value, s.warmup_num_steps.value, s.warmup}};
      case ds_scheduler_type::warmup_decay_lr:
        return {optim::warmup_decay_lr{s.total_num_steps.value, s.warmup_min_lr.value, s.warmup_max_lr.value,
                                       s.warmup_num_steps.value, s.warmup}};
      case ds_scheduler_type::warmup_cosine_lr:
        return {optim::warmup_cosine_lr{optimizer.lr.value, s.total_num_steps.value, s.warmup_min_ratio, s.warmup_num_steps.value,
                                        s.cos_min_ratio, s.warmup}};
    }
    return {};
  }
};

struct ds_parse_options {
  bool allow_unknown = false;  ///< unknown keys become warnings instead of errors
};

/// What "auto" values and the batch rule are resolved from.
struct ds_context {
  int world_size = 1;                   ///< data-parallel ranks
  std::int64_t hidden_size = 0;         ///< model dim, for the ZeRO bucket "auto" rules (0: unknown)
  std::int64_t total_steps = 0;         ///< --steps, for scheduler total_num_steps
  std::int64_t warmup_steps = 0;        ///< for scheduler warmup_num_steps
  float lr = 1e-3f;                     ///< --lr
  float weight_decay = 0.01f;
  float beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f;
  float gradient_clipping = 1.f;
  dtype precision = dtype::f32;         ///< --precision, for fp16/bf16 "enabled": "auto"
  std::optional<std::int64_t> micro_batch = std::nullopt;  ///< --batch, for train_micro_batch_size_per_gpu: "auto"
  std::optional<std::int64_t> grad_accum = std::nullopt;   ///< --grad-accum, for gradient_accumulation_steps: "auto"
};

namespace detail {

using data::quote_input;
using data::quote_json;

inline constexpr std::int64_t int64_max = std::numeric_limits<std::int64_t>::max();
inline constexpr double float_max = std::numeric_limits<float>::max();

inline std::string join_keys(std::initializer_list<std::string_view> keys) {
  std::string s;
  for (auto k : keys) s += (s.empty() ? "" : ", ") + std::string(k);
  return s;
}

/// A JSON object of the config with its dotted path, key checks and typed getters.
class ds_section {
 public:
  ds_section(const nlohmann::json& j, std::string path, std::vector<std::string>& warnings, bool allow_unknown)
      : j_(j), path_(std::move(path)), warnings_(warnings), allow_unknown_(allow_unknown) {
    LOOM_CHECK(j.is_object(), "ds_config: ", name(), " must be an object, got ", quote_json(j));
  }
  std::string key_path(std::string_view key) const { return path_.empty() ? std::string(key) : path_ + "." + std::string(key); }
  std::string name() const { return path_.empty() ? std::string("the top level") : "\"" + path_ + "\""; }

  /// Every key must be supported; `refused` lists keys DeepSpeed has but loom refuses, with a reason.
  void check_keys(std::initializer_list<std::string_view> supported,
                  std::initializer_list<std::pair<std::string_view, std::string_view>> refused = {}) const {
    for (auto it = j_.begin(); it != j_.end(); ++it) {
      const std::string& k = it.key();
      if (std::find(supported.begin(), supported.end(), k) != supported.end()) continue;
      for (auto [rk, why] : refused)
        LOOM_CHECK(k != rk, "ds_config: unsupported key \"", key_path(k), "\": ", why, ". Supported keys in ", name(), ": ",
                   join_keys(supported));
      // an unknown key is input: quoted bounded
      const std::string msg = "ds_config: unknown key " + quote_input(key_path(k)) + "; supported keys in " + name() + ": " + join_keys(supported);
      LOOM_CHECK(allow_unknown_, msg, " (allow_unknown / --allow-unknown makes this a warning)");
      warnings_.push_back(msg + " (ignored)");
    }
  }
  bool has(std::string_view k) const { return j_.contains(k); }
  bool is_auto(std::string_view k) const { return has(k) && j_.at(std::string(k)).is_string() && j_.at(std::string(k)) == "auto"; }
  const nlohmann::json& at(std::string_view k) const { return j_.at(std::string(k)); }
  ds_section child(std::string_view k) const { return ds_section(at(k), key_path(k), warnings_, allow_unknown_); }

  /// The key as the messages name it: ds_config: "zero_optimization.stage".
  std::string field(std::string_view k) const { return "ds_config: \"" + key_path(k) + "\""; }

  // The typed getters: every value read from the file goes through one of these, which check
  // its type and its range [min, max] (the key's sensible range within the C++ type's).
  void get(std::string_view k, bool& out) const {
    if (!has(k)) return;
    no_auto(k);
    const auto& v = at(k);
    LOOM_CHECK(v.is_boolean(), field(k), " must be true or false, got ", quote_json(v));
    out = v.get<bool>();
  }
  /// Integral floating values are accepted: DeepSpeed configs write large counts as 1e9.
  void get(std::string_view k, std::int64_t& out, std::int64_t min = 0, std::int64_t max = int64_max) const {
    if (!has(k)) return;
    no_auto(k);
    out = data::json_integer(at(k), field(k), min, max);
  }
  void get(std::string_view k, int& out, int min = 0, int max = std::numeric_limits<int>::max()) const {
    if (!has(k)) return;
    no_auto(k);
    out = static_cast<int>(data::json_integer(at(k), field(k), min, max));
  }
  void get(std::string_view k, float& out, double min = 0.0, double max = float_max) const {
    if (!has(k)) return;
    no_auto(k);
    out = data::json_real<float>(at(k), field(k), min, max);
  }
  void get(std::string_view k, std::string& out) const {
    if (!has(k)) return;
    const auto& v = at(k);
    LOOM_CHECK(v.is_string(), field(k), " must be a string, got ", quote_json(v));
    out = v.get<std::string>();
  }
  template <class T, class... Range>
  void get(std::string_view k, maybe_auto<T>& out, Range... range) const {
    if (is_auto(k)) {
      out.is_auto = true;
      return;
    }
    get(k, out.value, range...);
  }
  /// A key that may not be "auto" (no rule to resolve it); the plain getters check this.
  std::vector<std::string>& warnings() const { return warnings_; }
  bool allow_unknown() const { return allow_unknown_; }
  void no_auto(std::string_view k) const {
    LOOM_CHECK(!is_auto(k), "ds_config: \"", key_path(k), "\" cannot be \"auto\" (loom has no rule to resolve it); give a value");
  }

 private:
  const nlohmann::json& j_;
  std::string path_;
  std::vector<std::string>& warnings_;
  bool allow_unknown_;
};

inline std::string lower(std::string s) {
  for (auto& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

inline ds_offload parse_offload(const ds_section& s, bool allow_nvme) {
  s.check_keys({"device", "pin_memory", "nvme_path"},
               {{"buffer_count", "loom's nvme offload maps one file; no buffer pool to size"},
                {"buffer_size", "loom's nvme offload maps one file; no buffer pool to size"},
                {"max_in_cpu", "parameter offload keeps all parameters in host memory"},
                {"fast_init", "not implemented"},
                {"ratio", "partial offload is not implemented"}});
  ds_offload o;
  std::string dev = "none";
  s.get("device", dev);
  if (dev == "none") o.device = offload_device::none;
  else if (dev == "cpu") o.device = offload_device::cpu;
  else if (dev == "nvme" && allow_nvme) o.device = offload_device::nvme;
  else
    LOOM_THROW("ds_config: \"", s.key_path("device"), "\" must be ", allow_nvme ? "\"none\", \"cpu\" or \"nvme\"" : "\"none\" or \"cpu\"",
               ", got ", quote_input(dev));
  s.get("pin_memory", o.pin_memory);
  s.get("nvme_path", o.nvme_path);
  LOOM_CHECK(o.device != offload_device::nvme || !o.nvme_path.empty(), "ds_config: \"", s.key_path("device"),
             "\" is \"nvme\" but \"", s.key_path("nvme_path"), "\" is not given");
  return o;
}

}  // namespace detail

namespace detail {
// Sensible ranges of the keys, beyond which a value is a typo or garbage, not a setting:
/// batch sizes and accumulation steps: their product with the world size must fit 64 bits
inline constexpr std::int64_t max_batch = std::numeric_limits<std::int32_t>::max();
/// learning rates and weight decay: AdamW moves a weight by about lr per step, so no model
/// trains above this (1e3 written for 1e-3 is refused, not run)
inline constexpr double max_rate = 10.0;
/// loss scales: any finite float (a static scale near FLT_MAX is how a test forces every
/// step to overflow; the dynamic scale starts at 2^initial_scale_power <= 2^127)
inline constexpr double max_loss_scale = 3.4028234663852886e38;  // FLT_MAX
}  // namespace detail

namespace detail {
/// A bounded list of short strings (group names, name patterns): input, so counted and quoted.
inline std::vector<std::string> string_list(const nlohmann::json& v, const std::string& field) {
  LOOM_CHECK(v.is_array() && v.size() <= 256, field, " must be an array of at most 256 strings, got ", quote_json(v));
  std::vector<std::string> out;
  for (const auto& e : v) {
    LOOM_CHECK(e.is_string() && e.get_ref<const std::string&>().size() <= 256, field, " must hold strings of at most 256 characters, got ",
               quote_json(e));
    out.push_back(e.get<std::string>());
  }
  return out;
}

/// "param_groups": [{"name", "params": [globs], "layers": [first, last], "lr", "weight_decay"}],
/// "progressive_unfreezing": [{"until": fraction, "trainable": [group names]}].
inline void parse_param_groups(const ds_section& top, optim::param_groups& g) {
  auto objects = [&](std::string_view key, auto&& each) {
    if (!top.has(key)) return;
    const auto& a = top.at(key);
    LOOM_CHECK(a.is_array() && a.size() <= 256, top.field(key), " must be an array of at most 256 objects, got ", quote_json(a));
    for (std::size_t i = 0; i < a.size(); ++i) each(ds_section(a[i], std::string(key) + "[" + std::to_string(i) + "]", top.warnings(), top.allow_unknown()));
  };
  objects("param_groups", [&](const ds_section& s) {
    s.check_keys({"name", "params", "layers", "lr", "weight_decay"});
    optim::param_group x;
    LOOM_CHECK(s.has("name"), s.field("name"), " is required");
    s.get("name", x.name);
    if (s.has("params")) x.patterns = string_list(s.at("params"), s.field("params"));
    if (s.has("layers")) {
      const auto& l = s.at("layers");
      LOOM_CHECK(l.is_array() && l.size() == 2, s.field("layers"), " must be [first, last) (null for the end), got ", quote_json(l));
      constexpr std::int64_t lim = std::numeric_limits<std::int32_t>::max();
      x.first_layer = l[0].is_null() ? 0 : data::json_integer(l[0], s.field("layers") + "[0]", -lim, lim);
      if (!l[1].is_null()) x.last_layer = data::json_integer(l[1], s.field("layers") + "[1]", -lim, lim);
    }
    if (s.has("lr")) s.get("lr", x.lr.emplace(), 0.0, max_rate);
    if (s.has("weight_decay")) s.get("weight_decay", x.weight_decay.emplace(), 0.0, max_rate);
    g.groups.push_back(std::move(x));
  });
  objects("progressive_unfreezing", [&](const ds_section& s) {
    s.check_keys({"until", "trainable"});
    optim::unfreeze_phase ph;
    LOOM_CHECK(s.has("until") && s.has("trainable"), "ds_config: ", s.name(), " needs \"until\" and \"trainable\"");
    ph.until = data::json_real<double>(s.at("until"), s.field("until"), 0.0, 1.0);
    ph.trainable = string_list(s.at("trainable"), s.field("trainable"));
    g.phases.push_back(std::move(ph));
  });
  if (!g.groups.empty() || !g.phases.empty()) {
    try {
      optim::check(g);
    } catch (const loom::error& e) {
      throw loom::error(std::string("ds_config: ") + e.what());
    }
  }
}
}  // namespace detail

/// Parses and checks a config; "auto" values stay marked until resolve_ds_config().
inline ds_config parse_ds_config(const nlohmann::json& j, const ds_parse_options& po = {}) {
  ds_config c;
  detail::ds_section top(j, "", c.warnings, po.allow_unknown);
  top.check_keys({"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping",
                  "steps_per_print", "wall_clock_breakdown", "communication_data_type", "fp16", "bf16", "bfloat16",
                  "zero_optimization", "optimizer", "scheduler", "activation_checkpointing", "param_groups",
                  "progressive_unfreezing"},
                 {{"amp", "NVIDIA apex AMP is not available; use \"fp16\" or \"bf16\""},
                  {"fp16_master_weights_and_grads", "loom keeps fp32 master weights and gradients"},
                  {"prescale_gradients", "not implemented (gradients are averaged after the reduction)"},
                  {"gradient_predivide_factor", "not implemented (gradients are averaged after the reduction)"},
                  {"sparse_gradients", "not implemented"},
                  {"zero_allow_untested_optimizer", "only AdamW is supported"},
                  {"flops_profiler", "not implemented; llama-train prints model FLOP/s per step"},
                  {"tensorboard", "not implemented"},
                  {"wandb", "not implemented"},
                  {"compression_training", "not implemented"},
                  {"pipeline", "pipeline parallelism is configured with --pp, not in ds_config"}});

  for (auto [key, slot] : {std::pair<std::string_view, std::optional<std::int64_t>*>{"train_batch_size", &c.train_batch_size_given},
                           {"train_micro_batch_size_per_gpu", &c.micro_batch_given},
                           {"gradient_accumulation_steps", &c.grad_accum_given}}) {
    if (!top.has(key)) continue;
    if (top.is_auto(key)) {
      c.micro_batch_auto |= key == "train_micro_batch_size_per_gpu";
      c.grad_accum_auto |= key == "gradient_accumulation_steps";
      continue;
    }
    std::int64_t v = 0;
    top.get(key, v, 1, detail::max_batch);
    *slot = v;
  }
  top.get("gradient_clipping", c.gradient_clipping, 0.0);
  top.get("steps_per_print", c.steps_per_print, 1);
  top.get("wall_clock_breakdown", c.wall_clock_breakdown);
  if (top.has("communication_data_type") && !top.at("communication_data_type").is_null()) {
    std::string t;
    top.get("communication_data_type", t);
    // parse_dtype's own message would quote the value unbounded: only its float names reach it
    constexpr std::string_view names[] = {"fp32", "float32", "float", "fp16", "float16", "half", "bf16", "bfloat16"};
    LOOM_CHECK(std::find(std::begin(names), std::end(names), t) != std::end(names),
               "ds_config: \"communication_data_type\" must be fp32, fp16 or bf16, got ", detail::quote_input(t));
    c.communication_data_type = parse_dtype(t);
  }

  if (top.has("fp16")) {
    auto s = top.child("fp16");
    s.check_keys({"enabled", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "consecutive_hysteresis",
                  "min_loss_scale"},
                 {{"auto_cast", "loom casts explicitly (fp16 parameters, fp32 master weights); auto_cast is not implemented"}});
    s.get("enabled", c.fp16.enabled);
    s.get("loss_scale", c.fp16.loss_scale, 0.0, detail::max_loss_scale);
    s.get("initial_scale_power", c.fp16.initial_scale_power, 0, 127);
    s.get("loss_scale_window", c.fp16.loss_scale_window, 1);
    s.get("hysteresis", c.fp16.hysteresis, 1);
    s.get("consecutive_hysteresis", c.fp16.consecutive_hysteresis);
    s.get("min_loss_scale", c.fp16.min_loss_scale, 0.0, detail::max_loss_scale);
    LOOM_CHECK(c.fp16.min_loss_scale > 0.f, "ds_config: \"fp16.min_loss_scale\" must be > 0, got ", c.fp16.min_loss_scale);
  }
  for (auto key : {"bf16", "bfloat16"}) {
    if (!top.has(key)) continue;
    LOOM_CHECK(!(top.has("bf16") && top.has("bfloat16")), "ds_config: give \"bf16\" or its alias \"bfloat16\", not both");
    auto s = top.child(key);
    s.check_keys({"enabled"}, {{"immediate_grad_update", "not implemented"}, {"check_grad_overflow", "not implemented"}});
    s.get("enabled", c.bf16);
  }
  LOOM_CHECK(!(c.fp16.enabled.value && c.bf16.value), "ds_config: \"fp16.enabled\" and \"bf16.enabled\" are both true; choose one");

  if (top.has("zero_optimization")) {
    auto s = top.child("zero_optimization");
    s.check_keys({"stage", "offload_optimizer", "offload_param", "overlap_comm", "contiguous_gradients", "reduce_scatter",
                  "reduce_bucket_size", "allgather_bucket_size", "sub_group_size", "stage3_prefetch_bucket_size",
                  "stage3_param_persistence_threshold", "stage3_max_live_parameters", "stage3_max_reuse_distance",
                  "stage3_gather_16bit_weights_on_model_save"},
                 {{"cpu_offload", "deprecated by DeepSpeed; use \"offload_optimizer\": {\"device\": \"cpu\"}"},
                  {"cpu_offload_params", "deprecated by DeepSpeed; use \"offload_param\""},
                  {"allgather_partitions", "loom always all-gathers partitions"},
                  {"round_robin_gradients", "not implemented"},
                  {"zero_hpz_partition_size", "ZeRO++ hierarchical partitioning is not implemented"},
                  {"zero_quantized_weights", "ZeRO++ quantized weights are not implemented"},
                  {"zero_quantized_gradients", "ZeRO++ quantized gradients are not implemented"},
                  {"elastic_checkpoint", "not implemented"},
                  {"load_from_fp32_weights", "not implemented"},
                  {"ignore_unused_parameters", "not implemented"},
                  {"legacy_stage1", "not implemented"},
                  {"mics_shard_size", "MiCS is not implemented"}});
    auto& z = c.zero;
    s.get("stage", z.stage, 0);
    LOOM_CHECK(z.stage <= 3, "ds_config: \"zero_optimization.stage\" must be 0, 1, 2 or 3, got ", z.stage);
    if (s.has("offload_optimizer")) z.offload_optimizer = detail::parse_offload(s.child("offload_optimizer"), true);
    if (s.has("offload_param")) z.offload_param = detail::parse_offload(s.child("offload_param"), false);
    LOOM_CHECK(z.offload_optimizer.device == offload_device::none || z.stage >= 1,
               "ds_config: \"zero_optimization.offload_optimizer\" needs stage 1, 2 or 3, got stage ", z.stage);
    LOOM_CHECK(z.offload_param.device == offload_device::none || z.stage == 3,
               "ds_config: \"zero_optimization.offload_param\" needs stage 3, got stage ", z.stage);
    if (s.has("overlap_comm")) {
      bool b = false;
      s.get("overlap_comm", b);
      z.overlap_comm = b;
    }
    s.get("contiguous_gradients", z.contiguous_gradients);
    s.get("reduce_scatter", z.reduce_scatter);
    s.get("reduce_bucket_size", z.reduce_bucket_size, 1);
    s.get("allgather_bucket_size", z.allgather_bucket_size, 1);
    s.get("sub_group_size", z.sub_group_size, 1);
    s.get("stage3_prefetch_bucket_size", z.stage3_prefetch_bucket_size, 0);
    s.get("stage3_param_persistence_threshold", z.stage3_param_persistence_threshold, 0);
    s.get("stage3_max_live_parameters", z.stage3_max_live_parameters, 0);
    s.get("stage3_max_reuse_distance", z.stage3_max_reuse_distance, 0);
    s.get("stage3_gather_16bit_weights_on_model_save", z.stage3_gather_16bit_weights_on_model_save);
  }

  if (top.has("optimizer")) {
    auto s = top.child("optimizer");
    s.check_keys({"type", "params"});
    std::string type;
    s.get("type", type);
    LOOM_CHECK(detail::lower(type) == "adamw", "ds_config: \"optimizer.type\" ", detail::quote_input(type),
               " is not supported; supported optimizer types: AdamW");
    c.has_optimizer = true;
    if (s.has("params")) {
      auto p = s.child("params");
      p.check_keys({"lr", "betas", "eps", "weight_decay"},
                   {{"torch_adam", "loom's AdamW is its own host/CUDA kernel"},
                    {"adam_w_mode", "AdamW always decouples weight decay (adam_w_mode = true)"},
                    {"bias_correction", "bias correction is always on"},
                    {"amsgrad", "AMSGrad is not implemented"}});
      auto& o = c.optimizer;
      p.get("lr", o.lr, 0.0, detail::max_rate);
      p.get("eps", o.eps, 0.0, 1.0);  // added to sqrt(v): above 1 it would dominate every update
      p.get("weight_decay", o.weight_decay, 0.0, detail::max_rate);
      if (p.is_auto("betas")) {
        o.beta1.is_auto = o.beta2.is_auto = true;
      } else if (p.has("betas")) {
        const auto& b = p.at("betas");
        LOOM_CHECK(b.is_array() && b.size() == 2, "ds_config: \"optimizer.params.betas\" must be [beta1, beta2], got ", detail::quote_json(b));
        for (int i : {0, 1}) {
          const std::string field = "ds_config: \"optimizer.params.betas[" + std::to_string(i) + "]\"";
          const float beta = data::json_real<float>(b[static_cast<std::size_t>(i)], field, 0.0, 1.0);
          LOOM_CHECK(beta < 1.f, field, " must be in [0, 1), got ", detail::quote_json(b[static_cast<std::size_t>(i)]));
          (i == 0 ? o.beta1 : o.beta2).value = beta;
        }
      }
    }
  }

  if (top.has("scheduler")) {
    auto s = top.child("scheduler");
    s.check_keys({"type", "params"});
    std::string type;
    s.get("type", type);
    auto& sc = c.scheduler;
    if (type == "WarmupLR") sc.type = ds_scheduler_type::warmup_lr;
    else if (type == "WarmupDecayLR") sc.type = ds_scheduler_type::warmup_decay_lr;
    else if (type == "WarmupCosineLR") sc.type = ds_scheduler_type::warmup_cosine_lr;
    else LOOM_THROW("ds_config: \"scheduler.type\" ", detail::quote_input(type), " is not supported; supported: WarmupLR, WarmupDecayLR, WarmupCosineLR");
    if (s.has("params")) {
      auto p = s.child("params");
      std::string wt = "log";
      if (sc.type == ds_scheduler_type::warmup_cosine_lr) {
        p.check_keys({"total_num_steps", "warmup_min_ratio", "warmup_num_steps", "cos_min_ratio", "warmup_type", "last_batch_iteration"});
        p.get("warmup_min_ratio", sc.warmup_min_ratio, 0.0, 1.0);
        p.get("cos_min_ratio", sc.cos_min_ratio, 0.0, 1.0);
      } else {
        if (sc.type == ds_scheduler_type::warmup_lr)
          p.check_keys({"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "last_batch_iteration"});
        else
          p.check_keys({"total_num_steps", "warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "last_batch_iteration"});
        p.get("warmup_min_lr", sc.warmup_min_lr, 0.0, detail::max_rate);
        p.get("warmup_max_lr", sc.warmup_max_lr, 0.0, detail::max_rate);
      }
      p.get("total_num_steps", sc.total_num_steps, 1);
      p.get("warmup_num_steps", sc.warmup_num_steps, 0);
      p.get("warmup_type", wt);
      LOOM_CHECK(wt == "log" || wt == "linear", "ds_config: \"scheduler.params.warmup_type\" must be \"log\" or \"linear\", got warmup_type=",
                 detail::quote_input(wt));
      sc.warmup = optim::parse_warmup_type(wt);
      if (p.has("last_batch_iteration")) {
        const auto& v = p.at("last_batch_iteration");  // unsigned 2^64 - 1 would read as int64 -1
        LOOM_CHECK(v.is_number_integer() && !v.is_number_unsigned() && v.get<std::int64_t>() == -1,
                   "ds_config: \"scheduler.params.last_batch_iteration\" other than -1 is not supported (resume restores it from the "
                   "checkpoint), got ", detail::quote_json(v));
      }
    }
  }

  if (top.has("activation_checkpointing")) {
    auto s = top.child("activation_checkpointing");
    s.check_keys({"partition_activations", "cpu_checkpointing", "contiguous_memory_optimization", "number_checkpoints",
                  "synchronize_checkpoint_boundary", "profile"});
    auto& a = c.activation_checkpointing;
    a.enabled = true;
    s.get("partition_activations", a.partition_activations);
    s.get("cpu_checkpointing", a.cpu_checkpointing);
    s.get("contiguous_memory_optimization", a.contiguous_memory_optimization);
    s.get("number_checkpoints", a.number_checkpoints, 0);
    s.get("synchronize_checkpoint_boundary", a.synchronize_checkpoint_boundary);
    s.get("profile", a.profile);
    LOOM_CHECK(!a.contiguous_memory_optimization, "ds_config: unsupported value \"activation_checkpointing.contiguous_memory_optimization\": true "
               "(loom's checkpoints are ordinary buffers from the memory resource); set it to false");
  }
  detail::parse_param_groups(top, c.groups);
  return c;
}

/// Parses a file; errors carry the path.
inline ds_config load_ds_config(const std::string& path, const ds_parse_options& po = {}) {
  std::ifstream f(path);
  LOOM_CHECK(f.good(), "ds_config: cannot open path='", path, "'");
  const nlohmann::json j = data::parse_json_input(f, "ds_config: path='" + path + "'");
  try {
    return parse_ds_config(j, po);
  } catch (const loom::error& e) {
    throw loom::error(path + ": " + e.what());
  }
}

/// Fills "auto" values from the context and applies DeepSpeed's batch-size rule.
inline void resolve_ds_config(ds_config& c, const ds_context& ctx) {
  LOOM_CHECK(ctx.world_size >= 1, "ds_config: world_size must be >= 1, got world_size=", ctx.world_size);
  const std::int64_t W = ctx.world_size;
  // -- batch (DeepSpeed's _set_batch_related_parameters + _batch_assertion)
  auto tb = c.train_batch_size_given, mb = c.micro_batch_given, ga = c.grad_accum_given;
  // "auto" takes the program's value when it has one; otherwise the key counts as not given
  if (c.micro_batch_auto && ctx.micro_batch) mb = ctx.micro_batch;
  if (c.grad_accum_auto && ctx.grad_accum) ga = ctx.grad_accum;
  LOOM_CHECK((!tb || *tb > 0) && (!mb || *mb > 0) && (!ga || *ga > 0),
             "ds_config: batch sizes out of range: train_batch_size, train_micro_batch_size_per_gpu and "
             "gradient_accumulation_steps must be > 0");
  std::int64_t T = 0, M = 0, G = 0;
  // a caller may set the fields directly, past what parsing allows: products are checked
  const auto mul = [](std::int64_t a, std::int64_t b) {
    std::int64_t r = 0;
    LOOM_CHECK(!__builtin_mul_overflow(a, b, &r), "ds_config: batch sizes out of range: ", a, " x ", b, " overflows");
    return r;
  };
  if (tb && mb && ga) T = *tb, M = *mb, G = *ga;
  else if (tb && mb) T = *tb, M = *mb, G = T / M / W;
  else if (tb && ga) T = *tb, G = *ga, M = T / W / G;
  else if (mb && ga) M = *mb, G = *ga, T = mul(mul(M, G), W);
  else if (tb) T = *tb, G = 1, M = T / W;
  else if (mb) M = *mb, G = 1, T = mul(M, W);
  else LOOM_THROW("ds_config: either \"train_batch_size\" or \"train_micro_batch_size_per_gpu\" must be given");
  // M, G and T are each at most max_batch once parsed, but a caller may set the fields directly
  std::int64_t MG = 0, MGW = 0;
  LOOM_CHECK(M > 0 && G > 0 && !__builtin_mul_overflow(M, G, &MG) && !__builtin_mul_overflow(MG, W, &MGW),
             "ds_config: batch sizes out of range: train_micro_batch_size_per_gpu=", M, " gradient_accumulation_steps=", G,
             " data-parallel size=", W);
  LOOM_CHECK(T == MGW, "ds_config: batch sizes are inconsistent: train_batch_size=", T,
             " must equal train_micro_batch_size_per_gpu (", M, ") * gradient_accumulation_steps (", G, ") * data-parallel size (", W,
             ") = ", MGW);
  c.train_batch_size = T, c.train_micro_batch_size_per_gpu = M, c.gradient_accumulation_steps = G;

  // -- precision
  if (c.fp16.enabled.is_auto) c.fp16.enabled = {ctx.precision == dtype::f16, false};
  if (c.bf16.is_auto) c.bf16 = {ctx.precision == dtype::bf16, false};
  LOOM_CHECK(!(c.fp16.enabled.value && c.bf16.value), "ds_config: \"fp16.enabled\" and \"bf16.enabled\" are both true; choose one");
  if (c.gradient_clipping.is_auto) c.gradient_clipping = {ctx.gradient_clipping, false};

  // -- ZeRO buckets (HF's rules)
  auto need_hidden = [&](const char* key) {
    LOOM_CHECK(ctx.hidden_size > 0, "ds_config: \"zero_optimization.", key, "\" is \"auto\" but the model's hidden size is unknown");
  };
  const std::int64_t h = ctx.hidden_size;
  if (c.zero.reduce_bucket_size.is_auto) need_hidden("reduce_bucket_size"), c.zero.reduce_bucket_size = {h * h, false};
  if (c.zero.stage3_prefetch_bucket_size.is_auto)
    need_hidden("stage3_prefetch_bucket_size"), c.zero.stage3_prefetch_bucket_size = {static_cast<std::int64_t>(0.9 * double(h * h)), false};
  if (c.zero.stage3_param_persistence_threshold.is_auto)
    need_hidden("stage3_param_persistence_threshold"), c.zero.stage3_param_persistence_threshold = {10 * h, false};

  // -- optimizer / scheduler
  auto& o = c.optimizer;
  if (o.lr.is_auto) o.lr = {ctx.lr, false};
  if (o.beta1.is_auto) o.beta1 = {ctx.beta1, false}, o.beta2 = {ctx.beta2, false};
  if (o.eps.is_auto) o.eps = {ctx.eps, false};
  if (o.weight_decay.is_auto) o.weight_decay = {ctx.weight_decay, false};
  if (!c.has_optimizer) o.lr.value = ctx.lr;
  optim::check_adamw_options(o.adamw());
  auto& s = c.scheduler;
  if (s.total_num_steps.is_auto) {
    LOOM_CHECK(ctx.total_steps > 0, "ds_config: \"scheduler.params.total_num_steps\" is \"auto\" but the number of steps is unknown");
    s.total_num_steps = {ctx.total_steps, false};
  }
  if (s.warmup_num_steps.is_auto) s.warmup_num_steps = {ctx.warmup_steps, false};
  if (s.warmup_min_lr.is_auto) s.warmup_min_lr = {0.f, false};
  if (s.warmup_max_lr.is_auto) s.warmup_max_lr = {o.lr.value, false};
  std::visit([](const auto& sch) { optim::check_schedule(sch); }, c.lr_schedule().schedule);
  c.resolved = true;
}

}  // namespace loom::io
