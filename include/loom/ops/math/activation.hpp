#pragma once
// The MLP activations' per-element math (forward and derivative), for the host and the CUDA
// kernels.
//
//   out = silu(a) * b,  silu(a) = a * sigmoid(a)
//   da  = dout * b * sigmoid(a) * (1 + a (1 - sigmoid(a))),  db = dout * silu(a)
//   gelu(x) = x Phi(x) (erf form, PyTorch's default) or its tanh approximation
//
// The forward divides (a / (1 + e^-a)) instead of multiplying by the sigmoid: one rounding
// fewer, and the form the host kernels have always had (their results stay bit for bit).

#include <loom/core/config.hpp>
#include <loom/ops/math/exp.hpp>

#include <cmath>

namespace loom::ops {

enum class gelu_approx { none, tanh };

namespace math {

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

/// gelu(x), erf form: x/2 (1 + erf(x / sqrt 2)).
template <class T>
LOOM_HOST_DEVICE LOOM_FORCE_INLINE T gelu_erf(T x) noexcept {
  return T(0.5) * x * (T(1) + std::erf(x * T(0.70710678118654752440)));
}

/// gelu(x), tanh approximation: x/2 (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
template <class T>
LOOM_HOST_DEVICE LOOM_FORCE_INLINE T gelu_tanh(T x) noexcept {
  const T c = T(0.79788456080286535588), k = T(0.044715);
  return T(0.5) * x * (T(1) + std::tanh(c * (x + k * x * x * x)));
}

/// dy * gelu_erf'(x).
template <class T>
LOOM_HOST_DEVICE LOOM_FORCE_INLINE T gelu_erf_grad(T dy, T x) noexcept {
  const T cdf = T(0.5) * (T(1) + std::erf(x * T(0.70710678118654752440)));
  return dy * (cdf + x * T(0.39894228040143267794) * ops::exp(T(-0.5) * x * x));
}

/// dy * gelu_tanh'(x).
template <class T>
LOOM_HOST_DEVICE LOOM_FORCE_INLINE T gelu_tanh_grad(T dy, T x) noexcept {
  const T c = T(0.79788456080286535588), k = T(0.044715);
  const T x2 = x * x;
  const T th = std::tanh(c * (x + k * x2 * x));
  return dy * (T(0.5) * (T(1) + th) + T(0.5) * x * (T(1) - th * th) * c * (T(1) + T(3) * k * x2));
}

}  // namespace math
}  // namespace loom::ops
