#pragma once
// Vocab-parallel cross-entropy (Megatron-LM): the logits stay split by vocabulary, rank r
// holding columns [first, first + V/tp) of the [n, V] logits; no rank ever holds a full row.
//
//   forward   m_i   = max over ranks of the local row max            (all-reduce max, [n])
//             s_i   = sum over ranks of sum_j exp(l_ij - m_i)        (all-reduce sum, [n])
//             z_i   = the target's logit, from the rank that owns it  (summed with s_i)
//             loss  = mean over counted rows of (m_i + log s_i - z_i)
//   backward  dlogits_local += (exp(l_ij - lse_i) - [j == target_i]) * dloss / count
//
// Rows are split over host_pool() and each row's loops vectorise (ops::detail::row_max,
// row_exp_sum); every row is computed by one thread in one order, so results do not depend
// on the pool.
// Targets (replicated on every rank) equal to ignore_index (-100) are skipped; other targets
// outside [0, V) are a loom::error. The per-row log-sum-exp is kept for backward ([n]); the
// communication is 3n numbers per forward, independent of the vocabulary. The element math
// (log-sum-exp, the gradient element) is ops/math/softmax.hpp's, as in ops::cross_entropy.

#include <loom/comm/communicator.hpp>
#include <loom/core/buffer.hpp>
#include <loom/core/memory.hpp>
#include <loom/nn/tp/shard.hpp>
#include <loom/ops/host/cross_entropy.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace loom::nn::tp {

template <compute_type T>
class vocab_parallel_cross_entropy {
 public:
  /// vocab: the full vocabulary; first: the first column this rank holds.
  vocab_parallel_cross_entropy(index_t vocab, index_t first, ops::cross_entropy_options opt = {},
                               memory_resource& mr = default_resource<host>())
      : vocab_(vocab), first_(first), opt_(opt), mr_(&mr) {}

  /// Mean loss; logits_local [n, V/tp], targets [n] (the same on every rank of the group).
  template <comm::communicator C, class Tgt>
  T forward(C& tp, in_view<T, 2> logits_local, tensor_view<Tgt, host, 1> targets) {
    const index_t n = logits_local.extent(0), vl = logits_local.extent(1);
    LOOM_CHECK(targets.extent(0) == n, "nn::tp::vocab_parallel_cross_entropy: ", targets.extent(0), " targets for ", n,
               " rows of logits");
    LOOM_CHECK(first_ + vl <= vocab_, "nn::tp::vocab_parallel_cross_entropy: columns [", first_, ", ", first_ + vl,
               ") exceed the vocabulary ", vocab_);
    ops::detail::require_contiguous(logits_local, "nn::tp::vocab_parallel_cross_entropy", "logits_local");
    count_ = ops::detail::count_targets(targets, vocab_, opt_.ignore_index, "nn::tp::vocab_parallel_cross_entropy");
    if (lse_.size() < static_cast<std::size_t>(n)) lse_ = buffer<T>(n, *mr_), red_ = buffer<T>(2 * n, *mr_);
    const T* lp = logits_local.data();  // contiguous: row i at lp + i * vl
    ops::detail::parallel_rows(n, ops::detail::rows_grain(vl), [&](index_t r0, index_t r1) {
      for (index_t i = r0; i < r1; ++i)
        lse_[i] = vl > 0 ? ops::detail::row_max(lp + i * vl, vl) : -std::numeric_limits<T>::infinity();
    });
    tp.all_reduce(std::span<const T>(lse_.data(), n), std::span<T>(lse_.data(), n), comm::reduce_op::max);
    ops::detail::parallel_rows(n, ops::detail::rows_grain(vl), [&](index_t r0, index_t r1) {
      for (index_t i = r0; i < r1; ++i) {
        const T* x = lp + i * vl;
        red_[2 * i] = ops::detail::row_exp_sum(x, vl, lse_[i]);
        const auto t = static_cast<std::int64_t>(targets(i));
        red_[2 * i + 1] = (t != opt_.ignore_index && t >= first_ && t < first_ + vl) ? x[t - first_] : T(0);
      }
    });
    tp.all_reduce(std::span<const T>(red_.data(), 2 * n), std::span<T>(red_.data(), 2 * n), comm::reduce_op::sum);
    double loss = 0;
    for (index_t i = 0; i < n; ++i) {
      lse_[i] = T(ops::math::log_sum_exp(double(lse_[i]), double(red_[2 * i])));
      if (static_cast<std::int64_t>(targets(i)) != opt_.ignore_index) loss += double(lse_[i]) - double(red_[2 * i + 1]);
    }
    rows_ = n;
    return count_ ? T(loss / double(count_)) : T(0);
  }

  /// forward, and dlogits_local = d(mean loss)/dlogits_local (dloss = 1) for the same logits.
  /// On one rank holding the whole vocabulary this is ops::cross_entropy_forward_backward: the
  /// gradient is made row by row while the row is in cache (one exp per logit, not two).
  template <comm::communicator C, class Tgt>
  T forward_backward(C& tp, in_view<T, 2> logits_local, tensor_view<Tgt, host, 1> targets,
                     tensor_view<T, host, 2> dlogits_local) {
    const index_t n = logits_local.extent(0), vl = logits_local.extent(1);
    if (tp.size() == 1 && first_ == 0 && vl == vocab_) {
      if (lse_.size() < static_cast<std::size_t>(n)) lse_ = buffer<T>(n, *mr_), red_ = buffer<T>(2 * n, *mr_);
      count_ = ops::detail::count_targets(targets, vocab_, opt_.ignore_index, "nn::tp::vocab_parallel_cross_entropy");
      rows_ = n;
      return ops::cross_entropy_forward_backward(host{}, logits_local, targets, make_view(lse_.data(), n), dlogits_local,
                                                 opt_);
    }
    const T loss = forward(tp, logits_local, targets);
    ops::detail::require_contiguous(dlogits_local, "nn::tp::vocab_parallel_cross_entropy::forward_backward", "dlogits_local");
    std::fill_n(dlogits_local.data(), dlogits_local.numel(), T(0));
    backward(logits_local, targets, dlogits_local);
    return loss;
  }

  /// dlogits_local += dloss * d(mean loss)/dlogits_local for the logits of the last forward.
  template <class Tgt>
  void backward(in_view<T, 2> logits_local, tensor_view<Tgt, host, 1> targets, tensor_view<T, host, 2> dlogits_local,
                T dloss = T(1)) const {
    const index_t n = logits_local.extent(0), vl = logits_local.extent(1);
    LOOM_CHECK(n == rows_, "nn::tp::vocab_parallel_cross_entropy: backward for ", n, " rows after a forward of ", rows_);
    const char* fn = "nn::tp::vocab_parallel_cross_entropy::backward";
    ops::detail::require_contiguous(logits_local, fn, "logits_local");
    ops::detail::require_contiguous(dlogits_local, fn, "dlogits_local");
    ops::detail::require_shape(dlogits_local, logits_local.shape(), fn, "dlogits_local");
    if (count_ == 0) return;
    const T scale = dloss / T(count_);
    const T* lp = logits_local.data();
    T* gp = dlogits_local.data();
    ops::detail::parallel_rows(n, ops::detail::rows_grain(vl), [&](index_t r0, index_t r1) {
      for (index_t i = r0; i < r1; ++i) {
        const auto t = static_cast<std::int64_t>(targets(i));
        if (t == opt_.ignore_index) continue;
        const T* x = lp + i * vl;
        T* g = gp + i * vl;
        const T l = lse_[i];
        LOOM_SIMD
        for (index_t j = 0; j < vl; ++j) g[j] += ops::math::cross_entropy_grad(x[j], l, scale);
        if (t >= first_ && t < first_ + vl) g[t - first_] -= scale;
      }
    });
  }

 private:
  index_t vocab_, first_;
  ops::cross_entropy_options opt_;
  memory_resource* mr_;
  buffer<T> lse_, red_;  // [n], [n, 2]: (sum exp, target logit)
  index_t count_ = 0, rows_ = 0;
};

}  // namespace loom::nn::tp
