#pragma once
// Launch shapes shared by loom's CUDA kernels, and their input-view type (plain C++: no
// kernel here, so g++ compiles it).
//
// Elementwise kernels are grid-stride loops over a grid capped at grid_cap blocks: enough
// blocks to fill any current GPU, few enough that each thread does several elements. Row
// kernels (norms, cross-entropy) give one block of row_block threads to a row and reduce its
// statistics with a CUB block reduction.

#include <loom/core/device.hpp>
#include <loom/core/tensor_view.hpp>

#include <algorithm>
#include <cstddef>
#include <type_traits>

/// Declares `float* name`: the block's dynamic shared memory (`extern __shared__` on a GPU; the
/// emulator's array under tests/ops/cuda/emulation.hpp, which runs kernels on host threads).
#if defined(LOOM_CUDA_EMULATION)
#define LOOM_DYNAMIC_SHARED_FLOATS(name) float* name = ::loom::emulation::dynamic_shared_floats()
#else
#define LOOM_DYNAMIC_SHARED_FLOATS(name) extern __shared__ float name[]
#endif

namespace loom::ops {

/// An input view of device elements; T is deduced from the outputs, so a mutable view passes
/// where a const one is expected (ops/host's in_view, for the cuda tag).
template <class T, std::size_t R>
using device_in_view = tensor_view<const std::type_identity_t<T>, cuda, R>;

namespace kernels {

inline constexpr unsigned elementwise_block = 256;
inline constexpr unsigned row_block = 256;
inline constexpr index_t grid_cap = 65535;

/// Blocks for n elements at `block` threads each, at least 1, at most grid_cap.
inline unsigned grid_for(index_t n, unsigned block) {
  const index_t g = (n + block - 1) / block;
  return static_cast<unsigned>(std::clamp<index_t>(g, 1, grid_cap));
}

}  // namespace kernels
}  // namespace loom::ops
