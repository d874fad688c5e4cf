#pragma once
// Learning-rate schedules with DeepSpeed's semantics (WarmupLR, WarmupDecayLR, WarmupCosineLR).
//
// Why DeepSpeed's: users bring a ds_config.json and expect the same curve. Each schedule is
// a pure function lr(iteration) of DeepSpeed's `last_batch_iteration`: 0 for the first
// optimizer step, +1 after every applied step (a step skipped for fp16 overflow does not
// advance it). Pure functions make resume trivial: the checkpoint stores the iteration.
//
//   warmup gamma(i), i < W:  log:    ln(i + 1) / ln(W)        linear: i / W
//   (W = max(2, warmup_num_steps), as DeepSpeed clamps it)
//   WarmupLR:       min_lr + (max_lr - min_lr) * (i < W ? gamma(i) : 1)
//   WarmupDecayLR:  as WarmupLR, but after warmup gamma = max(0, (T - i) / max(1, T - W))
//   WarmupCosineLR: base_lr * ratio(i), ratio = min_ratio + (1 - min_ratio) * gamma(i) during
//                   warmup, then max(0, cos_min + (1 - cos_min) * (1 + cos(pi * k / (T - W))) / 2)
//                   with k = i - W + 1; base_lr is the optimizer's lr.

#include <loom/core/error.hpp>

#include <algorithm>
#include <cmath>
#include <concepts>
#include <cstdint>
#include <numbers>
#include <string_view>
#include <variant>

namespace loom::optim {

/// Requires: S maps DeepSpeed's last_batch_iteration (0-based) to a learning rate.
template <class S>
concept lr_schedule = requires(const S& s, std::int64_t iteration) {
  { s.lr(iteration) } -> std::convertible_to<float>;
};

enum class warmup_type { log, linear };

inline warmup_type parse_warmup_type(std::string_view s) {
  if (s == "log") return warmup_type::log;
  if (s == "linear") return warmup_type::linear;
  LOOM_THROW("warmup_type must be \"log\" or \"linear\", got warmup_type=\"", s, "\"");
}

namespace detail {
inline double warmup_gamma(std::int64_t i, std::int64_t w, warmup_type type) {
  if (type == warmup_type::log) return std::log(static_cast<double>(i + 1)) / std::log(static_cast<double>(w));
  return static_cast<double>(i) / static_cast<double>(w);
}
/// min + (max - min) * gamma, in double as DeepSpeed computes it; 0 before the first step.
inline float between(float min_lr, float max_lr, double gamma, std::int64_t i) {
  if (i < 0) return 0.f;
  return static_cast<float>(min_lr + (static_cast<double>(max_lr) - min_lr) * gamma);
}
}  // namespace detail

/// A fixed learning rate (no "scheduler" in the config).
struct constant_lr {
  float value = 1e-3f;
  float lr(std::int64_t) const noexcept { return value; }
};

/// DeepSpeed WarmupLR: warmup from min to max, then constant.
struct warmup_lr {
  float warmup_min_lr = 0.f;
  float warmup_max_lr = 1e-3f;
  std::int64_t warmup_num_steps = 1000;
  warmup_type type = warmup_type::log;

  std::int64_t warmup_steps() const noexcept { return std::max<std::int64_t>(2, warmup_num_steps); }
  double gamma(std::int64_t i) const {
    return i < warmup_steps() ? detail::warmup_gamma(i, warmup_steps(), type) : 1.0;
  }
  float lr(std::int64_t i) const { return detail::between(warmup_min_lr, warmup_max_lr, gamma(i), i); }
};

/// DeepSpeed WarmupDecayLR: WarmupLR, then linear decay to 0 at total_num_steps.
struct warmup_decay_lr {
  std::int64_t total_num_steps = 0;
  float warmup_min_lr = 0.f;
  float warmup_max_lr = 1e-3f;
  std::int64_t warmup_num_steps = 1000;
  warmup_type type = warmup_type::log;

  std::int64_t warmup_steps() const noexcept { return std::max<std::int64_t>(2, warmup_num_steps); }
  double gamma(std::int64_t i) const {
    const std::int64_t w = warmup_steps();
    if (i < w) return detail::warmup_gamma(i, w, type);
    return std::max(0.0, static_cast<double>(total_num_steps - i) / std::max(1.0, static_cast<double>(total_num_steps - w)));
  }
  float lr(std::int64_t i) const { return detail::between(warmup_min_lr, warmup_max_lr, gamma(i), i); }
};

/// DeepSpeed WarmupCosineLR: ratio of the optimizer's base lr, warmup then cosine to cos_min_ratio.
struct warmup_cosine_lr {
  float base_lr = 1e-3f;  ///< the optimizer's lr
  std::int64_t total_num_steps = 0;
  float warmup_min_ratio = 0.f;
  std::int64_t warmup_num_steps = 1000;
  float cos_min_ratio = 1e-4f;
  warmup_type type = warmup_type::log;

  std::int64_t warmup_steps() const noexcept { return std::max<std::int64_t>(2, warmup_num_steps); }
  double ratio(std::int64_t i) const {
    if (i < 0) return 0.0;
    const std::int64_t w = warmup_steps();
    if (i < w) return warmup_min_ratio + detail::warmup_gamma(i, w, type) * (1.0 - warmup_min_ratio);
    const double k = static_cast<double>(i - w + 1);
    const double total = static_cast<double>(total_num_steps - w);
    const double c = (1.0 + std::cos(std::numbers::pi * k / total)) / 2.0;
    return std::max(0.0, cos_min_ratio + (1.0 - cos_min_ratio) * c);
  }
  float lr(std::int64_t i) const { return static_cast<float>(base_lr * ratio(i)); }
};

/// Any of the schedules above, chosen at run time (from a config).
struct any_lr_schedule {
  std::variant<constant_lr, warmup_lr, warmup_decay_lr, warmup_cosine_lr> schedule = constant_lr{};
  float lr(std::int64_t i) const {
    return std::visit([i](const auto& s) { return s.lr(i); }, schedule);
  }
};

inline void check_schedule(const warmup_cosine_lr& s) {
  LOOM_CHECK(s.total_num_steps > s.warmup_steps(), "WarmupCosineLR: total_num_steps (", s.total_num_steps,
             ") must exceed warmup_num_steps (", s.warmup_steps(), ")");
  LOOM_CHECK(s.warmup_min_ratio >= 0.f && s.warmup_min_ratio <= 1.f, "WarmupCosineLR: warmup_min_ratio must be in [0, 1], got ",
             s.warmup_min_ratio);
  LOOM_CHECK(s.cos_min_ratio >= 0.f && s.cos_min_ratio <= 1.f, "WarmupCosineLR: cos_min_ratio must be in [0, 1], got ",
             s.cos_min_ratio);
}
inline void check_schedule(const warmup_decay_lr& s) {
  LOOM_CHECK(s.total_num_steps >= 1, "WarmupDecayLR: total_num_steps must be >= 1, got total_num_steps=", s.total_num_steps);
  LOOM_CHECK(s.warmup_min_lr >= 0.f && s.warmup_max_lr >= s.warmup_min_lr, "WarmupDecayLR: need 0 <= warmup_min_lr (",
             s.warmup_min_lr, ") <= warmup_max_lr (", s.warmup_max_lr, ")");
}
inline void check_schedule(const warmup_lr& s) {
  LOOM_CHECK(s.warmup_min_lr >= 0.f && s.warmup_max_lr >= s.warmup_min_lr, "WarmupLR: need 0 <= warmup_min_lr (",
             s.warmup_min_lr, ") <= warmup_max_lr (", s.warmup_max_lr, ")");
}
inline void check_schedule(const constant_lr& s) {
  LOOM_CHECK(s.value >= 0.f, "lr must be >= 0, got lr=", s.value);
}

}  // namespace loom::optim
