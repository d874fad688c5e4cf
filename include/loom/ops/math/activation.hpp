#pragma once
// SwiGLU's per-element math (forward and derivative), for the host and the CUDA kernels.
//
//   out = silu(a) * b,  silu(a) = a * sigmoid(a)
//   da  = dout * b * sigmoid(a) * (1 + a (1 - sigmoid(a))),  db = dout * silu(a)
//
// The forward divides (a / (1 + e^-a)) instead of multiplying by the sigmoid: one rounding
// fewer, and the form the host kernels have always had (their results stay bit for bit).

#include <loom/core/config.hpp>
#include <loom/ops/math/exp.hpp>

namespace loom::ops::math {

template <class T>
LOOM_HOST_DEVICE LOOM_FORCE_INLINE T sigmoid(T a) noexcept {
  return T(1) / (T(1) + ops::exp(-a));
}

/// silu(a) * b
template <class T>
LOOM_HOST_DEVICE LOOM_FORCE_INLINE T swiglu(T a, T b) noexcept {
  return a / (T(1) + ops::exp(-a)) * b;
}

/// The two input gradients of one element.
template <class T>
struct swiglu_grads {
  T da, db;
};
template <class T>
LOOM_HOST_DEVICE LOOM_FORCE_INLINE swiglu_grads<T> swiglu_grad(T dout, T a, T b) noexcept {
  const T sig = sigmoid(a);
  return {dout * b * sig * (T(1) + a * (T(1) - sig)), dout * a * sig};
}

}  // namespace loom::ops::math
