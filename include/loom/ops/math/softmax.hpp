#pragma once
// The per-element math of softmax, cross-entropy and attention's online softmax, for the host
// and the CUDA kernels. Row maxima and sums are reductions, done per backend.
//
//   cross-entropy: lse = max + log(sum e^(x - max));  dlogit_j = scale e^(x_j - lse), and the
//                  target's element then less `scale` (scale = dloss / counted targets)
//   softmax backward: dx_j = y_j (dy_j - sum_k dy_k y_k)
//   online softmax (one key at a time, FlashAttention's running max m and sum l): a score
//                  above m rescales what was accumulated by e^(m_old - m_new)

#include <loom/core/config.hpp>
#include <loom/ops/math/exp.hpp>

#include <cmath>
#include <cstdint>

namespace loom::ops {

/// Options of cross-entropy on either backend: targets equal to ignore_index (PyTorch's
/// default -100) contribute nothing.
struct cross_entropy_options {
  std::int64_t ignore_index = -100;
};

namespace math {

/// log sum_j e^(x_j) from the row maximum and sum_j e^(x_j - max).
template <class T>
LOOM_HOST_DEVICE LOOM_FORCE_INLINE T log_sum_exp(T row_max, T exp_sum) noexcept {
  return row_max + std::log(exp_sum);
}

/// d(loss)/d(logit) before the target correction: scale * softmax(x)_j.
template <class T>
LOOM_HOST_DEVICE LOOM_FORCE_INLINE T cross_entropy_grad(T x, T lse, T scale) noexcept {
  return scale * ops::exp(x - lse);
}

/// One element of softmax backward: y * (dy - <dy, y>).
template <class T>
LOOM_HOST_DEVICE LOOM_FORCE_INLINE T softmax_backward(T y, T dy, T dot) noexcept {
  return y * (dy - dot);
}

/// Adds score s to a running (max m, sum l) and returns p = e^(s - m) for the new m. When s
/// raises the maximum, `rescale` receives e^(m_old - s), the factor for everything accumulated
/// so far (l included, done here), and the function returns true; otherwise it returns false
/// and `rescale` is untouched. The library's exp: attention's reference results are in these
/// terms.
LOOM_HOST_DEVICE LOOM_FORCE_INLINE bool online_softmax_push(float s, float& m, float& l, float& p,
                                                           float& rescale) noexcept {
  bool raised = false;
  if (s > m) {
    rescale = std::exp(m - s);
    l *= rescale;
    m = s;
    raised = true;
  }
  p = std::exp(s - m);
  l += p;
  return raised;
}

}  // namespace math
}  // namespace loom::ops
