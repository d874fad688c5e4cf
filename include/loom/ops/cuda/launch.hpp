#pragma once
// Launch shapes shared by loom's CUDA kernels (plain C++: no kernel here, so g++ compiles it).
//
// Elementwise kernels are grid-stride loops over a grid capped at grid_cap blocks: enough
// blocks to fill any current GPU, few enough that each thread does several elements. Row
// kernels (norms, cross-entropy) give one block of row_block threads to a row and reduce its
// statistics with a CUB block reduction.

#include <loom/core/tensor_view.hpp>

#include <algorithm>

namespace loom::ops::kernels {

inline constexpr unsigned elementwise_block = 256;
inline constexpr unsigned row_block = 256;
inline constexpr index_t grid_cap = 65535;

/// Blocks for n elements at `block` threads each, at least 1, at most grid_cap.
inline unsigned grid_for(index_t n, unsigned block) {
  const index_t g = (n + block - 1) / block;
  return static_cast<unsigned>(std::clamp<index_t>(g, 1, grid_cap));
}

}  // namespace loom::ops::kernels
