#pragma once
// What a resolved DeepSpeed ds_config.json (io::ds_config) asks of the ZeRO engine and the
// loss scaler, so that every trainer reads the zero_optimization and fp16 sections the same
// way:
//  - engine_options_from: the optimizer, reduce buckets, overlap, the stage-3 prefetch and
//    live-parameter limits, clipping, optimizer offload;
//  - loss_scaler_from: DeepSpeed's dynamic scaler for fp16 with loss_scale 0 (initial
//    2^initial_scale_power, loss_scale_window, hysteresis, min_loss_scale,
//    consecutive_hysteresis), a static one for fp16 with loss_scale > 0, and a static scale
//    of 1 for fp32 and bfloat16.

#include <loom/amp/loss_scaler.hpp>
#include <loom/io/ds_config.hpp>
#include <loom/zero/engine.hpp>

#include <cmath>
#include <cstddef>

namespace loom::zero {

inline offload_device offload_from(io::offload_device d) {
  switch (d) {
    case io::offload_device::cpu: return offload_device::cpu;
    case io::offload_device::nvme: return offload_device::nvme;
    default: return offload_device::none;
  }
}

/// The engine options a resolved ds_config asks for.
inline engine_options engine_options_from(const io::ds_config& c) {
  engine_options e;
  e.adamw = c.optimizer.adamw();
  e.reduce_bucket_numel = static_cast<std::size_t>(c.zero.reduce_bucket_size.value);
  e.overlap_comm = c.zero.overlap();
  e.contiguous_gradients = c.zero.contiguous_gradients;
  e.stage3 = {static_cast<std::size_t>(c.zero.stage3_prefetch_bucket_size.value),
              static_cast<std::size_t>(c.zero.stage3_max_live_parameters),
              static_cast<std::size_t>(c.zero.stage3_param_persistence_threshold.value)};
  e.gradient_clipping = c.gradient_clipping.value;
  e.offload_optimizer = offload_from(c.zero.offload_optimizer.device);
  e.nvme_path = c.zero.offload_optimizer.nvme_path;
  return e;
}

/// The loss scaler a resolved ds_config asks for (see the file comment).
inline amp::any_loss_scaler loss_scaler_from(const io::ds_config& c) {
  if (c.precision() == dtype::f16 && c.fp16.loss_scale == 0.f)
    return amp::dynamic_loss_scaler({.initial_scale = std::ldexp(1.f, c.fp16.initial_scale_power),
                                     .scale_window = c.fp16.loss_scale_window, .hysteresis = c.fp16.hysteresis,
                                     .min_scale = c.fp16.min_loss_scale, .consecutive_hysteresis = c.fp16.consecutive_hysteresis});
  return amp::static_loss_scaler(c.precision() == dtype::f16 ? c.fp16.loss_scale : 1.f);
}

}  // namespace loom::zero
