#pragma once
// Elementwise activations of the MLPs, forward and backward: SwiGLU (LLaMA) and GeLU (GPT).
//
//   swiglu(a, b) = silu(a) * b,  silu(a) = a * sigmoid(a)   (a = x W1^T gate, b = x W3^T up)
//   gelu(x)      = x * Phi(x) (erf form, PyTorch's default) or the tanh approximation
//
// Inputs are 1-D contiguous views (any activation flattened); backward adds into the input
// gradients. Loops are plain so the compiler vectorises them. The element math is
// ops/math/activation.hpp's (SwiGLU's shared with ops/cuda/activation.cuh).

#include <loom/ops/host/common.hpp>
#include <loom/ops/math/activation.hpp>

#include <cmath>

namespace loom::ops {

/// out = silu(a) * b
template <compute_type T>
inline void swiglu_forward(host, in_view<T, 1> a, in_view<T, 1> b, tensor_view<T, host, 1> out) {
  const index_t n = a.numel();
  detail::require_same_length("ops::swiglu_forward", n, a, b, out);
  const T *ap = a.data(), *bp = b.data();
  T* op = out.data();
  detail::parallel_rows(n, detail::min_part_elements, [&](index_t i0, index_t i1) {
    LOOM_SIMD
    for (index_t i = i0; i < i1; ++i) op[i] = math::swiglu(ap[i], bp[i]);
  });
}

/// da += dout * b * silu'(a), db += dout * silu(a)   (da = ..., db = ... when !accumulate)
template <compute_type T>
inline void swiglu_backward(host, in_view<T, 1> dout, in_view<T, 1> a, in_view<T, 1> b, tensor_view<T, host, 1> da,
                            tensor_view<T, host, 1> db, bool accumulate = true) {
  const index_t n = a.numel();
  detail::require_same_length("ops::swiglu_backward", n, dout, a, b, da, db);
  const T *dp = dout.data(), *ap = a.data(), *bp = b.data();
  T *dap = da.data(), *dbp = db.data();
  detail::parallel_rows(n, detail::min_part_elements, [&](index_t i0, index_t i1) {
    if (accumulate) {
      LOOM_SIMD
      for (index_t i = i0; i < i1; ++i) {
        const auto gr = math::swiglu_grad(dp[i], ap[i], bp[i]);
        dap[i] += gr.da;
        dbp[i] += gr.db;
      }
    } else {
      LOOM_SIMD
      for (index_t i = i0; i < i1; ++i) {
        const auto gr = math::swiglu_grad(dp[i], ap[i], bp[i]);
        dap[i] = gr.da;
        dbp[i] = gr.db;
      }
    }
  });
}

/// y = gelu(x)
template <compute_type T>
inline void gelu_forward(host, in_view<T, 1> x, tensor_view<T, host, 1> y, gelu_approx approx = gelu_approx::none) {
  const index_t n = x.numel();
  detail::require_same_length("ops::gelu_forward", n, x, y);
  const T* xp = x.data();
  T* yp = y.data();
  if (approx == gelu_approx::none) {
    LOOM_SIMD
    for (index_t i = 0; i < n; ++i) yp[i] = math::gelu_erf(xp[i]);
  } else {
    LOOM_SIMD
    for (index_t i = 0; i < n; ++i) yp[i] = math::gelu_tanh(xp[i]);
  }
}

/// dx += dy * gelu'(x)
template <compute_type T>
inline void gelu_backward(host, in_view<T, 1> dy, in_view<T, 1> x, tensor_view<T, host, 1> dx,
                          gelu_approx approx = gelu_approx::none) {
  const index_t n = x.numel();
  detail::require_same_length("ops::gelu_backward", n, dy, x, dx);
  const T *dyp = dy.data(), *xp = x.data();
  T* dxp = dx.data();
  if (approx == gelu_approx::none) {
    LOOM_SIMD
    for (index_t i = 0; i < n; ++i) dxp[i] += math::gelu_erf_grad(dyp[i], xp[i]);
  } else {
    LOOM_SIMD
    for (index_t i = 0; i < n; ++i) dxp[i] += math::gelu_tanh_grad(dyp[i], xp[i]);
  }
}

}  // namespace loom::ops
