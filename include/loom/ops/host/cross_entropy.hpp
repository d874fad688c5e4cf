#pragma once
// Softmax cross-entropy over a vocabulary, averaged over the targets that are not ignored.
//
// Forward saves each row's log-sum-exp; backward rebuilds softmax from it (no [rows, vocab]
// probability buffer is kept): dlogits += (softmax(logits) - onehot(target)) * dloss / count,
// or dlogits = ... with accumulate = false (no zero pass over a [rows, vocab] buffer first).
// Targets equal to `ignore_index` (PyTorch's default -100) contribute nothing; other targets
// outside [0, vocab) are a loom::error naming the value. With no counted target the loss is
// 0 and the gradient is 0 (PyTorch returns NaN there). The element math (log-sum-exp, the
// gradient element) is ops/math/softmax.hpp's, shared with ops/cuda/cross_entropy.cuh.

#include <loom/ops/host/common.hpp>
#include <loom/ops/math/softmax.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace loom::ops {

namespace detail {
template <class Tgt>
inline index_t count_targets(tensor_view<Tgt, host, 1> targets, index_t vocab, std::int64_t ignore, const char* fn) {
  index_t count = 0;
  for (index_t i = 0; i < targets.numel(); ++i) {
    const auto t = static_cast<std::int64_t>(targets(i));
    if (t == ignore) continue;
    LOOM_CHECK(t >= 0 && t < vocab, fn, ": target ", t, " at position ", i, " is outside the vocabulary [0, ", vocab,
               ") and is not ignore_index=", ignore);
    ++count;
  }
  return count;
}

/// Forward (and, when dlogits is given, the gradient of the mean loss) row by row.
template <compute_type T, class Tgt>
inline T cross_entropy_rows(in_view<T, 2> logits, tensor_view<Tgt, host, 1> targets, tensor_view<T, host, 1> lse,
                            tensor_view<T, host, 2>* dlogits, cross_entropy_options opt, const char* fn) {
  const index_t n = logits.extent(0), v = logits.extent(1);
  detail::require_contiguous(logits, fn, "logits");
  detail::require_shape(targets, extents<1>{n}, fn, "targets");
  detail::require_shape(lse, extents<1>{n}, fn, "lse");
  if (dlogits) {
    detail::require_contiguous(*dlogits, fn, "dlogits");
    detail::require_shape(*dlogits, logits.shape(), fn, "dlogits");
  }
  LOOM_CHECK(v > 0, fn, ": vocabulary size must be > 0, got vocab=", v);
  const index_t count = detail::count_targets(targets, v, opt.ignore_index, fn);
  const T scale = count ? T(1) / T(count) : T(0);
  detail::parallel_rows(n, detail::rows_grain(v), [&](index_t r0, index_t r1) {
    for (index_t r = r0; r < r1; ++r) {
      const T* x = logits.data() + r * v;
      const T mx = row_max(x, v);
      if (!dlogits) {
        lse(r) = math::log_sum_exp(mx, row_exp_sum(x, v, mx));
        continue;
      }
      T sum = 0;
      T* g = dlogits->data() + r * v;  // exp(x - max) first, scaled to the gradient while the row is in cache
      LOOM_SIMD_SUM(sum)
      for (index_t j = 0; j < v; ++j) {
        g[j] = ops::exp(x[j] - mx);
        sum += g[j];
      }
      lse(r) = math::log_sum_exp(mx, sum);
      const auto t = static_cast<std::int64_t>(targets(r));
      const T f = t == opt.ignore_index ? T(0) : scale / sum;
      LOOM_SIMD
      for (index_t j = 0; j < v; ++j) g[j] *= f;
      if (t != opt.ignore_index) g[t] -= scale;
    }
  });
  double total = 0;  // summed in row order: the same on any number of threads
  for (index_t r = 0; r < n; ++r) {
    const auto t = static_cast<std::int64_t>(targets(r));
    if (t != opt.ignore_index) total += double(lse(r) - logits.data()[r * v + t]);
  }
  return count ? T(total / double(count)) : T(0);
}
}  // namespace detail

/// Mean loss; logits: [rows, vocab]; targets: [rows]; lse: [rows] (saved for backward).
template <compute_type T, class Tgt>
requires std::integral<std::remove_const_t<Tgt>>
inline T cross_entropy_forward(host, in_view<T, 2> logits, tensor_view<Tgt, host, 1> targets,
                               tensor_view<T, host, 1> lse, cross_entropy_options opt = {}) {
  return detail::cross_entropy_rows<T>(logits, targets, lse, nullptr, opt, "ops::cross_entropy_forward");
}

/// Forward and backward in one pass over the logits: the mean loss (lse filled, as
/// cross_entropy_forward) and dlogits = d(mean loss)/dlogits (dloss = 1; written, not added),
/// each row's gradient made while the row is in cache (one exp per logit instead of one in
/// forward and one in backward). A caller with dloss != 1 scales what reads dlogits (the
/// output layer's GEMMs take it as their alpha).
template <compute_type T, class Tgt>
requires std::integral<std::remove_const_t<Tgt>>
inline T cross_entropy_forward_backward(host, in_view<T, 2> logits, tensor_view<Tgt, host, 1> targets,
                                        tensor_view<T, host, 1> lse, tensor_view<T, host, 2> dlogits,
                                        cross_entropy_options opt = {}) {
  return detail::cross_entropy_rows<T>(logits, targets, lse, &dlogits, opt, "ops::cross_entropy_forward_backward");
}

/// dlogits += d(dloss * mean loss)/dlogits (dlogits = ... when !accumulate); shapes as in forward.
template <compute_type T, class Tgt>
requires std::integral<std::remove_const_t<Tgt>>
inline void cross_entropy_backward(host, in_view<T, 2> logits, tensor_view<Tgt, host, 1> targets, in_view<T, 1> lse,
                                   tensor_view<T, host, 2> dlogits, T dloss = T(1), cross_entropy_options opt = {},
                                   bool accumulate = true) {
  const char* fn = "ops::cross_entropy_backward";
  const index_t n = logits.extent(0), v = logits.extent(1);
  detail::require_contiguous(logits, fn, "logits"), detail::require_contiguous(dlogits, fn, "dlogits");
  detail::require_shape(dlogits, logits.shape(), fn, "dlogits");
  detail::require_shape(targets, extents<1>{n}, fn, "targets");
  detail::require_shape(lse, extents<1>{n}, fn, "lse");
  const index_t count = detail::count_targets(targets, v, opt.ignore_index, fn);
  const T scale = count ? dloss / T(count) : T(0);
  detail::parallel_rows(n, detail::rows_grain(v), [&](index_t r0, index_t r1) {
    for (index_t r = r0; r < r1; ++r) {
      const auto t = static_cast<std::int64_t>(targets(r));
      T* g = dlogits.data() + r * v;
      if (t == opt.ignore_index) {
        if (!accumulate) std::fill(g, g + v, T(0));
        continue;
      }
      const T* x = logits.data() + r * v;
      const T l = lse(r);
      if (accumulate) {
        LOOM_SIMD
        for (index_t j = 0; j < v; ++j) g[j] += math::cross_entropy_grad(x[j], l, scale);
      } else {
        LOOM_SIMD
        for (index_t j = 0; j < v; ++j) g[j] = math::cross_entropy_grad(x[j], l, scale);
      }
      g[t] -= scale;
    }
  });
}

}  // namespace loom::ops
