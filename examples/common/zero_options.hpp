#pragma once
// The zero::engine options a resolved ds_config.json asks for: llama-train and llama-train3d
// read the same zero_optimization section the same way.

#include <loom/io/ds_config.hpp>
#include <loom/zero/engine.hpp>

#include <cstddef>

namespace examples {

inline loom::zero::offload_device zero_offload(loom::io::offload_device d) {
  switch (d) {
    case loom::io::offload_device::cpu: return loom::zero::offload_device::cpu;
    case loom::io::offload_device::nvme: return loom::zero::offload_device::nvme;
    default: return loom::zero::offload_device::none;
  }
}

/// The engine options a resolved ds_config asks for.
inline loom::zero::engine_options zero_engine_options(const loom::io::ds_config& c) {
  loom::zero::engine_options e;
  e.adamw = c.optimizer.adamw();
  e.reduce_bucket_numel = static_cast<std::size_t>(c.zero.reduce_bucket_size.value);
  e.overlap_comm = c.zero.overlap();
  e.contiguous_gradients = c.zero.contiguous_gradients;
  e.stage3 = {static_cast<std::size_t>(c.zero.stage3_prefetch_bucket_size.value),
              static_cast<std::size_t>(c.zero.stage3_max_live_parameters),
              static_cast<std::size_t>(c.zero.stage3_param_persistence_threshold.value)};
  e.gradient_clipping = c.gradient_clipping.value;
  e.offload_optimizer = zero_offload(c.zero.offload_optimizer.device);
  e.nvme_path = c.zero.offload_optimizer.nvme_path;
  return e;
}

}  // namespace examples
