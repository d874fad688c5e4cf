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
/// emulator's array under tests/ops/cuda/emulation.hpp, which runs kernels on the CPU).
/// LOOM_LAUNCH(kernel, grid, block, smem, stream)(args...) is
/// kernel<<<grid, block, smem, stream>>>(args...) on a GPU; under the emulator (g++, no GPU)
/// the emulated runtime's launch, which makes the runtime's checks and runs the grid on fibers
/// (tests/ops/cuda/emulated_runtime/cuda_runtime_api.h). Every launch goes through it, so the
/// launch code the GPU runs is the launch code the CPU CI tests.
/// LOOM_KERNEL void name(...) { ... }: a kernel that is not a template, defined in a header.
/// Every translation unit that includes the header gets its own copy (internal linkage):
/// nvcc ignores `inline` on a __global__ function, so two units' external copies would collide
/// when linked into one program. Under the emulator, an inline function.
#if defined(LOOM_CUDA_EMULATION)
#define LOOM_KERNEL inline
#else
#define LOOM_KERNEL static __global__
#endif

#if defined(LOOM_CUDA_EMULATION)
#define LOOM_DYNAMIC_SHARED_FLOATS(name) float* name = ::loom::emulation::dynamic_shared_floats()
#define LOOM_LAUNCH(kernel, grid, block, smem, stream) \
  ::loom::emulation::launch([&](auto... loom_args) { kernel(loom_args...); }, grid, block, smem)
#else
#define LOOM_DYNAMIC_SHARED_FLOATS(name) extern __shared__ float name[]
#define LOOM_LAUNCH(kernel, grid, block, smem, stream) kernel<<<grid, block, smem, stream>>>
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
