#pragma once
// The per-element math of softmax, cross-entropy and attention's online softmax, for the host
// and the CUDA kernels. Row maxima and sums are reductions, done per backend.
//
//   cross-entropy: lse = max + log(sum e^(x - max));  dlogit_j = scale e^(x_j - lse), and the
//                  target's element then less `scale` (scale = dloss / counted targets)
//   softmax backward: dx_j = y_j (dy_j - sum_k dy_k y_k)
//   online softmax (one key at a time, FlashAttention's running max m and sum l): a score
//                  above m rescales what was accumulated by e^(m_old - m_new)
//   merge of two online-softmax states over disjoint key ranges (split-KV attention): both
//                  rescaled to the larger max, sums and accumulators added

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

/// The factors that merge state (m2, l2) into (m, l): afterwards m = max(m, m2) and l is the
/// sum over both key ranges; an accumulator merges as acc = acc * c1 + acc2 * c2. A state that
/// has seen no key (m = -inf, l = 0) gets factor 0, so an empty range changes nothing and two
/// empty ones stay empty (no e^(-inf - -inf) = NaN).
LOOM_HOST_DEVICE LOOM_FORCE_INLINE void online_softmax_merge(float& m, float& l, float m2, float l2, float& c1,
                                                            float& c2) noexcept {
  const float mx = m2 > m ? m2 : m;
  c1 = l > 0.f ? std::exp(m - mx) : 0.f;
  c2 = l2 > 0.f ? std::exp(m2 - mx) : 0.f;
  l = l * c1 + l2 * c2;
  m = mx;
}

}  // namespace math
}  // namespace loom::ops
