#pragma once
// Rotary position embeddings on a CUDA device, in place on [batch, seq, heads, head_dim].
// Mirror of ops/host/rope.hpp; which channels pair up (interleaved or half_split, partial
// rotary) and the rotation itself are ops/math/rope.hpp's, the functions the host kernel calls.
//
// The cos/sin table is the host's rope_table copied to the device once ([max_seq, rotary_dim/2]
// each; rotary_dim is twice the table's width): the angles are then the same numbers on both
// backends. One thread per rotation pair; backward rotates by the negative angle.

#include <loom/core/device.hpp>
#include <loom/core/dtype.hpp>
#include <loom/core/tensor_view.hpp>
#include <loom/ops/cuda/launch.hpp>
#include <loom/ops/math/rope.hpp>

#include <loom/core/cuda/error.hpp>
#include <loom/ops/checks.hpp>
#include <cuda_runtime.h>

namespace loom::ops {
namespace kernels {

template <class T>
__global__ void rope(T* __restrict__ x, const T* __restrict__ cos, const T* __restrict__ sin, index_t seq,
                     index_t heads, index_t hd, index_t half, index_t pos0, rope_style style, T sign, index_t n_pairs) {
  for (index_t k = blockIdx.x * static_cast<index_t>(blockDim.x) + threadIdx.x; k < n_pairs;
       k += static_cast<index_t>(blockDim.x) * gridDim.x) {
    const index_t i = k % half, head = k / half;  // head: (token, head) flattened
    const index_t pos = pos0 + (head / heads) % seq;
    const auto pr = math::rope_pair_of(style, i, half);
    T* v = x + head * hd;
    math::rope_rotate(v[pr.lo], v[pr.hi], cos[pos * half + i], sign * sin[pos * half + i]);
  }
}

}  // namespace kernels

namespace detail {
template <compute_type T>
void rope_rotate(tensor_view<T, cuda, 4> x, device_in_view<T, 2> cos, device_in_view<T, 2> sin,
                 rope_style style, index_t pos0, T sign, cudaStream_t stream, const char* fn) {
  const index_t b = x.extent(0), s = x.extent(1), h = x.extent(2), hd = x.extent(3), half = cos.extent(1);
  require_contiguous(x, fn, "x");
  require_contiguous(cos, fn, "cos");
  require_shape(sin, cos.shape(), fn, "sin");
  require_contiguous(sin, fn, "sin");
  LOOM_CHECK(half > 0 && 2 * half <= hd, fn, ": the table rotates rotary_dim=", 2 * half, " channels, head_dim=", hd);
  LOOM_CHECK(pos0 >= 0 && pos0 + s <= cos.extent(0), fn, ": positions [", pos0, ", ", pos0 + s,
             ") exceed the table's max_seq=", cos.extent(0));
  const index_t n_pairs = b * s * h * half;
  if (n_pairs == 0) return;
  LOOM_LAUNCH(kernels::rope, kernels::grid_for(n_pairs, kernels::elementwise_block),
              kernels::elementwise_block, 0, stream)(
      x.data(), cos.data(), sin.data(), s, h, hd, half, pos0, style, sign, n_pairs);
  LOOM_CUDA_CHECK(cudaGetLastError());
}
}  // namespace detail

/// Rotates x [batch, seq, heads, head_dim] in place; token t has position pos0 + t.
/// cos, sin: [max_seq, rotary_dim / 2] on the device (a host rope_table's, copied).
template <compute_type T>
void rope_forward(cuda, tensor_view<T, cuda, 4> x, device_in_view<T, 2> cos, device_in_view<T, 2> sin,
                  rope_style style, index_t pos0 = 0, cudaStream_t stream = nullptr) {
  detail::rope_rotate(x, cos, sin, style, pos0, T(1), stream, "ops::rope_forward(cuda)");
}

/// Turns dL/d(rotated x) into dL/dx in place (the inverse rotation).
template <compute_type T>
void rope_backward(cuda, tensor_view<T, cuda, 4> dx, device_in_view<T, 2> cos,
                   device_in_view<T, 2> sin, rope_style style, index_t pos0 = 0, cudaStream_t stream = nullptr) {
  detail::rope_rotate(dx, cos, sin, style, pos0, T(-1), stream, "ops::rope_backward(cuda)");
}

}  // namespace loom::ops
