#pragma once
// Fused AdamW on a CUDA device over flat fp32 buffers (a whole master buffer or one rank's
// shard of it), one pass that reads p, g, m, v and writes p, m, v. Mirror of optim/adamw.hpp's
// adamw_update: the per-step scalars come from the same make_adamw_coefficients (bias
// corrections in double on the host) and every element goes through the same
// ops::math::adamw_element the host step runs, so the host tests test this arithmetic.

#include <loom/core/device.hpp>
#include <loom/core/tensor_view.hpp>
#include <loom/ops/cuda/launch.hpp>
#include <loom/ops/math/adamw.hpp>

#include <cmath>
#include <cstdint>

#include <loom/core/cuda/error.hpp>
#include <loom/core/error.hpp>
#include <loom/ops/checks.hpp>
#include <cuda_runtime.h>

namespace loom::optim {
namespace kernels {

LOOM_KERNEL void adamw(float* __restrict__ p, const float* __restrict__ g, float* __restrict__ m, float* __restrict__ v,
                      index_t n, ops::math::adamw_coefficients k) {
  for (index_t i = blockIdx.x * static_cast<index_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<index_t>(blockDim.x) * gridDim.x) {
    float pi = p[i], mi = m[i], vi = v[i];
    ops::math::adamw_element(pi, mi, vi, g[i], k);
    p[i] = pi;
    m[i] = mi;
    v[i] = vi;
  }
}

}  // namespace kernels

/// One AdamW update of step number t (1-based) on matching device vectors of parameters,
/// gradients and moments; asynchronous on `stream`.
inline void adamw_update(cuda, tensor_view<float, cuda, 1> params, tensor_view<const float, cuda, 1> grads,
                         tensor_view<float, cuda, 1> exp_avg, tensor_view<float, cuda, 1> exp_avg_sq, float lr,
                         float beta1, float beta2, float eps, float weight_decay, std::int64_t t,
                         cudaStream_t stream = nullptr) {
  const index_t n = params.numel();
  ops::detail::require_same_length("optim::adamw_update(cuda)", n, params, grads, exp_avg, exp_avg_sq);
  LOOM_CHECK(t >= 1, "adamw(cuda): step number must be >= 1, got t=", t);
  if (n == 0) return;
  const auto k = ops::math::make_adamw_coefficients(lr, beta1, beta2, eps, weight_decay, t);
  LOOM_LAUNCH(kernels::adamw, ops::kernels::grid_for(n, ops::kernels::elementwise_block),
              ops::kernels::elementwise_block, 0, stream)(
      params.data(), grads.data(), exp_avg.data(), exp_avg_sq.data(), n, k);
  LOOM_CUDA_CHECK(cudaGetLastError());
}

}  // namespace loom::optim
