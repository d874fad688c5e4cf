#pragma once
// Reductions on a CUDA device: the block-wide sum and maximum the row kernels (norm.cuh,
// cross_entropy.cuh) make their row statistics with, and the global squared norm of a flat
// buffer together with its overflow flag (what optim/clip.hpp's sum_of_squares and
// amp/overflow.hpp's has_nonfinite compute on the host), for clipping and loss scaling.
//
// Why CUB: its block reduction is the tuned building block (warp shuffles, then one shared
// step); the per-element math around it is shared with the host (ops/math). The squared norm
// runs in two launches over a fixed grid (each block's partial sum into the workspace, then
// one block adds the partials in block order) instead of atomics: the same input gives the
// same bits on every run, which the host's order-fixed sum also guarantees.

#include <loom/core/device.hpp>
#include <loom/core/dtype.hpp>
#include <loom/core/tensor_view.hpp>
#include <loom/ops/cuda/launch.hpp>
#include <loom/ops/math/load.hpp>

#include <cmath>
#include <type_traits>

#include <loom/core/cuda/error.hpp>
#include <loom/ops/checks.hpp>
#include <cuda_runtime.h>
#if !defined(LOOM_CUDA_EMULATION)  // CUB is the GPU's; the emulator has its own block reduction
#include <cub/block/block_reduce.cuh>
#endif

namespace loom::ops {
namespace kernels {

/// The reduction over a block of row_block threads of each thread's `v`, returned to every
/// thread. Each call site has its own shared storage (a __shared__ in a template instance is
/// one per kernel), and the leading barrier lets a kernel call it twice in a row.
#if !defined(LOOM_CUDA_EMULATION)
template <class T, class Op>
__device__ T block_all_reduce(T v, Op op) {
  using reduce = cub::BlockReduce<T, row_block>;
  __shared__ typename reduce::TempStorage temp;
  __shared__ T total;
  __syncthreads();
  const T r = reduce(temp).Reduce(v, op);
  if (threadIdx.x == 0) total = r;
  __syncthreads();
  return total;
}
#else
// Under the emulator (tests/ops/cuda/emulation.hpp), without CUB: thread 0 combines every
// thread's value in thread order (CUB's tree adds in another order: results agree to rounding).
template <class T, class Op>
__device__ T block_all_reduce(T v, Op op) {
  __shared__ T part[row_block];
  __shared__ T total;
  __syncthreads();
  part[threadIdx.x] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
    T r = part[0];
    for (unsigned i = 1; i < row_block; ++i) r = op(r, part[i]);
    total = r;
  }
  __syncthreads();
  return total;
}
#endif
struct sum_op {
  template <class T>
  __device__ T operator()(T a, T b) const {
    return a + b;
  }
};
struct max_op {
  template <class T>
  __device__ T operator()(T a, T b) const {
    return b > a ? b : a;
  }
};
template <class T>
__device__ T block_sum(T v) {
  return block_all_reduce(v, sum_op{});
}
template <class T>
__device__ T block_max(T v) {
  return block_all_reduce(v, max_op{});
}

/// Blocks of the squared-norm reduction (a fixed grid: the partials' order does not depend on
/// the input size).
inline constexpr unsigned norm_blocks = 240;

template <class T>
__global__ void __launch_bounds__(row_block) sum_of_squares_partials(const T* __restrict__ x, index_t n, double* partial,
                                                                     int* nonfinite) {
  double s = 0;
  bool bad = false;
  for (index_t i = blockIdx.x * static_cast<index_t>(row_block) + threadIdx.x; i < n;
       i += static_cast<index_t>(row_block) * gridDim.x) {
    const float v = static_cast<float>(x[i]);
    bad |= !isfinite(v);
    s += double(v) * double(v);
  }
  const double total = block_sum(s);
  const int any_bad = block_sum(bad ? 1 : 0);
  if (threadIdx.x == 0) {
    partial[blockIdx.x] = total;
    if (any_bad) *nonfinite = 1;
  }
}

LOOM_KERNEL void __launch_bounds__(row_block) sum_partials(const double* __restrict__ partial, unsigned count, double* out) {
  double s = 0;
  for (unsigned i = threadIdx.x; i < count; i += row_block) s += partial[i];
  const double total = block_sum(s);
  if (threadIdx.x == 0) *out = total;
}

}  // namespace kernels

/// Device scratch of sum_of_squares: the result, then one partial per block.
inline constexpr index_t sum_of_squares_workspace = 1 + kernels::norm_blocks;

/// sum x^2 over a device vector (accumulated in double) into workspace(0), and nonfinite(0) = 1
/// when any element is +-inf or NaN (nonfinite is not cleared: several buffers can share the
/// flag; zero it before the first). workspace: [sum_of_squares_workspace] doubles on the device.
template <class T>
  requires floating_element<std::remove_const_t<T>>
void sum_of_squares(cuda, tensor_view<T, cuda, 1> x, tensor_view<double, cuda, 1> workspace,
                    tensor_view<int, cuda, 1> nonfinite, cudaStream_t stream = nullptr) {
  const char* fn = "ops::sum_of_squares(cuda)";
  detail::require_contiguous(x, fn, "x");
  detail::require_contiguous(workspace, fn, "workspace");
  LOOM_CHECK(workspace.numel() >= sum_of_squares_workspace, fn, ": workspace has ", workspace.numel(),
             " doubles, needs sum_of_squares_workspace=", sum_of_squares_workspace);
  LOOM_CHECK(nonfinite.numel() >= 1, fn, ": nonfinite must hold one int, has ", nonfinite.numel());
  LOOM_LAUNCH(kernels::sum_of_squares_partials, kernels::norm_blocks, kernels::row_block, 0, stream)(
      x.data(), x.numel(), workspace.data() + 1, nonfinite.data());
  LOOM_CUDA_CHECK(cudaGetLastError());
  LOOM_LAUNCH(kernels::sum_partials, 1,
              kernels::row_block, 0, stream)(workspace.data() + 1, kernels::norm_blocks, workspace.data());
  LOOM_CUDA_CHECK(cudaGetLastError());
}

}  // namespace loom::ops
