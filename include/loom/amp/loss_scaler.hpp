#pragma once
// Loss scalers for fp16 training: static and dynamic (DeepSpeed's rules and defaults).
//
// Why: half has 5 exponent bits; small gradients underflow to zero unless the loss is
// multiplied by a scale S before backward (gradients are unscaled by 1/S on the fp32 master
// copy). Too large an S overflows to inf; then the step is skipped and S shrinks.
//
// dynamic_loss_scaler follows DeepSpeed's DynamicLossScaler (the rules its documentation
// gives for fp16.loss_scale = 0), with the same defaults: initial scale 2^16, window 1000,
// hysteresis 2, min scale 1, factor 2.
//   on overflow:  if the hysteresis budget is down to 1, scale = max(scale / factor, min)
//                 (an error if the scale already is at the minimum); else spend one unit
//                 of hysteresis. The step is skipped. last_overflow = iteration.
//   on success:   (consecutive_hysteresis: refill the budget) ; if (iteration -
//                 last_overflow) is a multiple of the window: scale *= factor and refill
//                 the budget.
//   iteration += 1 after either.
// The scaler only decides; the caller asks update(overflow) whether to apply the step.
// Both scalers expose their state (for checkpoints: resume must be bit for bit).

#include <loom/core/error.hpp>

#include <algorithm>
#include <cmath>
#include <concepts>
#include <cstdint>
#include <variant>

namespace loom::amp {

/// Requires: S has a current scale and decides, from the agreed overflow flag, whether the step applies.
template <class S>
concept loss_scaler = requires(S& s, const S& cs, bool overflow) {
  { cs.scale() } -> std::convertible_to<float>;
  { s.update(overflow) } -> std::convertible_to<bool>;
};

/// A fixed scale (fp16.loss_scale > 0, or 1 for fp32/bf16). Overflowing steps are still skipped.
class static_loss_scaler {
 public:
  explicit static_loss_scaler(float scale = 1.f) : scale_(scale) {
    LOOM_CHECK(std::isfinite(scale) && scale > 0.f, "static_loss_scaler: scale must be finite and > 0, got scale=", scale);
  }
  float scale() const noexcept { return scale_; }
  /// Returns true when the step should be applied (no overflow).
  bool update(bool overflow) noexcept {
    if (overflow) ++skipped_;
    return !overflow;
  }
  std::int64_t skipped_steps() const noexcept { return skipped_; }

 private:
  float scale_;
  std::int64_t skipped_ = 0;
};

struct dynamic_loss_scaler_options {
  float initial_scale = 65536.f;       ///< fp16.initial_scale_power = 16
  std::int64_t scale_window = 1000;    ///< fp16.loss_scale_window
  int hysteresis = 2;                  ///< fp16.hysteresis (DeepSpeed's delayed_shift)
  float min_scale = 1.f;               ///< fp16.min_loss_scale
  float scale_factor = 2.f;
  bool consecutive_hysteresis = false; ///< fp16.consecutive_hysteresis
  bool raise_error_at_min_scale = true;
};

/// Everything a checkpoint needs to continue the scaler exactly.
struct dynamic_loss_scaler_state {
  float scale = 0.f;
  std::int64_t iteration = 0;
  std::int64_t last_overflow_iteration = -1;
  int hysteresis_left = 0;
  std::int64_t skipped_steps = 0;
};

class dynamic_loss_scaler {
 public:
  explicit dynamic_loss_scaler(dynamic_loss_scaler_options o = {}) : o_(o) {
    LOOM_CHECK(std::isfinite(o.initial_scale) && o.initial_scale > 0.f,
               "dynamic_loss_scaler: initial_scale must be finite and > 0, got initial_scale=", o.initial_scale);
    LOOM_CHECK(o.scale_window >= 1, "dynamic_loss_scaler: scale_window must be >= 1, got scale_window=", o.scale_window);
    LOOM_CHECK(o.hysteresis >= 1, "dynamic_loss_scaler: hysteresis must be >= 1, got hysteresis=", o.hysteresis);
    LOOM_CHECK(o.min_scale > 0.f && o.min_scale <= o.initial_scale, "dynamic_loss_scaler: min_scale must be in (0, initial_scale=",
               o.initial_scale, "], got min_scale=", o.min_scale);
    LOOM_CHECK(o.scale_factor > 1.f, "dynamic_loss_scaler: scale_factor must be > 1, got scale_factor=", o.scale_factor);
    s_.scale = o.initial_scale;
    s_.hysteresis_left = o.hysteresis;
  }

  float scale() const noexcept { return s_.scale; }
  const dynamic_loss_scaler_options& options() const noexcept { return o_; }
  const dynamic_loss_scaler_state& state() const noexcept { return s_; }
  void set_state(const dynamic_loss_scaler_state& s) {
    LOOM_CHECK(std::isfinite(s.scale) && s.scale > 0.f, "dynamic_loss_scaler: state scale must be finite and > 0, got scale=", s.scale);
    LOOM_CHECK(s.hysteresis_left >= 1, "dynamic_loss_scaler: state hysteresis_left must be >= 1, got ", s.hysteresis_left);
    s_ = s;
  }
  std::int64_t skipped_steps() const noexcept { return s_.skipped_steps; }

  /// Feeds the agreed overflow flag of one step; returns true when the step should be applied.
  bool update(bool overflow) {
    if (overflow) {
      if (o_.hysteresis == 1 || s_.hysteresis_left == 1) {
        LOOM_CHECK(!(o_.raise_error_at_min_scale && s_.scale == o_.min_scale),
                   "dynamic_loss_scaler: gradient overflow with the loss scale already at its minimum (min_scale=", o_.min_scale,
                   ", iteration=", s_.iteration, "); the model diverged or fp16 cannot represent it");
        s_.scale = std::max(s_.scale / o_.scale_factor, o_.min_scale);
      } else {
        --s_.hysteresis_left;
      }
      s_.last_overflow_iteration = s_.iteration;
      ++s_.skipped_steps;
    } else {
      if (o_.consecutive_hysteresis) s_.hysteresis_left = o_.hysteresis;
      if ((s_.iteration - s_.last_overflow_iteration) % o_.scale_window == 0) {
        if (!o_.consecutive_hysteresis) s_.hysteresis_left = o_.hysteresis;
        s_.scale *= o_.scale_factor;
      }
    }
    ++s_.iteration;
    return !overflow;
  }

 private:
  dynamic_loss_scaler_options o_;
  dynamic_loss_scaler_state s_;
};

/// Either scaler, chosen at run time (a trainer reading a ds_config: static for fp32, bf16 and
/// fp16 with a fixed loss_scale, dynamic for fp16 with loss_scale 0).
using any_loss_scaler = std::variant<static_loss_scaler, dynamic_loss_scaler>;

/// The scale backward runs with now.
inline float scale_of(const any_loss_scaler& s) noexcept {
  return std::visit([](const auto& x) { return x.scale(); }, s);
}
/// Feeds the agreed overflow flag of one step; true when the step applies (see update()).
inline bool update(any_loss_scaler& s, bool overflow) {
  return std::visit([&](auto& x) { return x.update(overflow); }, s);
}

}  // namespace loom::amp
