#pragma once
// The loss scaler a resolved ds_config asks for, shared by llama-train and llama-train3d:
// DeepSpeed's dynamic scaler for fp16 with loss_scale 0 (initial 2^initial_scale_power,
// loss_scale_window, hysteresis, min_loss_scale, consecutive_hysteresis), a static one for
// fp16 with loss_scale > 0, and a static scale of 1 for fp32 and bfloat16.
#include <loom/amp/loss_scaler.hpp>
#include <loom/io/ds_config.hpp>

#include <cmath>

namespace examples {

inline loom::amp::any_loss_scaler make_loss_scaler(const loom::io::ds_config& c) {
  if (c.precision() == loom::dtype::f16 && c.fp16.loss_scale == 0.f)
    return loom::amp::dynamic_loss_scaler({.initial_scale = std::ldexp(1.f, c.fp16.initial_scale_power),
                                           .scale_window = c.fp16.loss_scale_window, .hysteresis = c.fp16.hysteresis,
                                           .min_scale = c.fp16.min_loss_scale, .consecutive_hysteresis = c.fp16.consecutive_hysteresis});
  return loom::amp::static_loss_scaler(c.precision() == loom::dtype::f16 ? c.fp16.loss_scale : 1.f);
}

}  // namespace examples
