#pragma once
// Attention's mask, for the host kernels and the CUDA kernels: which keys a query position
// sees. One definition, so the GPU's attention hides exactly the keys the host's does.

#include <loom/core/config.hpp>
#include <loom/core/tensor_view.hpp>

namespace loom::ops {

/// Causal, with an optional prefix-LM part (`prefix` > 0): the first `prefix` positions attend
/// to each other in both directions, later ones causally to everything before them.
struct attention_mask {
  index_t prefix = 0;  ///< positions [0, prefix) see each other bidirectionally; 0: purely causal
  /// How many keys (a prefix of the row) query position t of a length-`seq` sequence sees.
  LOOM_HOST_DEVICE constexpr index_t visible(index_t t, index_t seq) const noexcept {
    return t < prefix ? (prefix < seq ? prefix : seq) : t + 1;
  }
  /// The first query position that sees key j (visible() never decreases with t).
  LOOM_HOST_DEVICE constexpr index_t first_seeing(index_t j) const noexcept { return j < prefix ? 0 : j; }
};

}  // namespace loom::ops
