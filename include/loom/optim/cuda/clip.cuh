#pragma once
// Global-norm gradient clipping on a CUDA device: optim/clip.hpp's rule (torch's
// clip_grad_norm_, norm type 2) over this rank's device pieces, the sum of squares in double
// (ops::sum_of_squares(cuda): fixed grid, no atomics, so every run gives the same bits), the
// pieces' sums added on the host in piece order and passed through the same scalar reducer
// as on the host (`comm::no_reduce` on one rank), the factor optim::clip_factor, the pieces
// scaled on the device. Returns the norm before clipping, which waits for the stream: the
// step needs it on the host (the loss scaler's overflow test, the log).

#include <loom/comm/communicator.hpp>
#include <loom/core/buffer.hpp>
#include <loom/core/cuda/error.hpp>
#include <loom/core/cuda/memory.hpp>
#include <loom/core/device.hpp>
#include <loom/core/error.hpp>
#include <loom/core/tensor_view.hpp>
#include <loom/ops/cuda/launch.hpp>
#include <loom/ops/cuda/reduce.cuh>
#include <loom/optim/clip.hpp>

#include <cuda_runtime.h>

#include <cmath>
#include <initializer_list>
#include <utility>
#include <vector>

namespace loom::optim {
namespace kernels {

LOOM_KERNEL void scale(float* __restrict__ p, index_t n, float c) {
  for (index_t i = blockIdx.x * static_cast<index_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<index_t>(blockDim.x) * gridDim.x)
    p[i] *= c;
}

}  // namespace kernels

/// Device scratch of global_norm / clip_by_global_norm(cuda).
struct clip_workspace {
  buffer<double, cuda> sums;
  buffer<int, cuda> nonfinite;
  std::vector<double> host_sums;
  explicit clip_workspace(memory_resource& r = default_resource<cuda>())
      : sums(static_cast<std::size_t>(ops::sum_of_squares_workspace), r), nonfinite(1, r) {}
};

/// The global 2-norm over this rank's device pieces and, through `reduce`, over all ranks.
template <comm::scalar_reducer<double> R = comm::no_reduce>
double global_norm(cuda, std::initializer_list<tensor_view<float, cuda, 1>> pieces, clip_workspace& ws, R&& reduce = {},
                   cudaStream_t stream = nullptr) {
  ws.host_sums.assign(pieces.size(), 0.0);
  std::size_t i = 0;
  for (const auto& p : pieces) {
    ops::sum_of_squares(cuda{}, p, tensor_view<double, cuda, 1>(ws.sums.data(), extents<1>{ops::sum_of_squares_workspace}),
                        tensor_view<int, cuda, 1>(ws.nonfinite.data(), extents<1>{1}), stream);
    LOOM_CUDA_CHECK(cudaMemcpyAsync(&ws.host_sums[i++], ws.sums.data(), sizeof(double), cudaMemcpyDeviceToHost, stream));
  }
  LOOM_CUDA_CHECK(cudaStreamSynchronize(stream));
  double s = 0;
  for (double v : ws.host_sums) s += v;
  return std::sqrt(static_cast<double>(reduce(s)));
}

/// Clips this rank's device pieces to a global norm of at most max_norm; returns the norm
/// before clipping (a non-finite norm leaves the pieces alone).
template <comm::scalar_reducer<double> R = comm::no_reduce>
double clip_by_global_norm(cuda, std::initializer_list<tensor_view<float, cuda, 1>> pieces, double max_norm,
                           clip_workspace& ws, R&& reduce = {}, cudaStream_t stream = nullptr) {
  LOOM_CHECK(max_norm > 0, "clip_by_global_norm(cuda): max_norm must be > 0, got max_norm=", max_norm);
  for (const auto& p : pieces) LOOM_CHECK(p.is_contiguous(), "clip_by_global_norm(cuda): pieces must be contiguous");
  const double norm = global_norm(cuda{}, pieces, ws, std::forward<R>(reduce), stream);
  if (const float c = clip_factor(norm, max_norm); c != 1.f)
    for (const auto& p : pieces) {
      if (p.numel() == 0) continue;
      LOOM_LAUNCH(kernels::scale, ops::kernels::grid_for(p.numel(), ops::kernels::elementwise_block),
                  ops::kernels::elementwise_block, 0, stream)(p.data(), p.numel(), c);
      LOOM_CUDA_CHECK(cudaGetLastError());
    }
  return norm;
}

}  // namespace loom::optim
