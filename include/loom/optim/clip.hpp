#pragma once
// Global-norm gradient clipping (DeepSpeed's gradient_clipping, torch clip_grad_norm_).
//
// Why a reducer hook: the norm is global over all parameters, but with ZeRO each rank holds
// a shard of the gradients (and with tensor parallelism a slice of each). Each rank sums the
// squares of what it owns, a `comm::scalar_reducer<double>` sums those over ranks, and every
// rank scales its own piece by the same factor: `comm::no_reduce` on one rank,
// `comm::scalar_all_reduce<C>` (sum) over a loom communicator.
//
// Rule (torch 1.13 clip_grad_norm_ with max_norm, norm_type 2):
//   norm = sqrt(sum g^2);  coef = max_norm / (norm + 1e-6);  if coef < 1: g *= coef.
// A non-finite norm leaves the gradients alone: overflow is amp's business (skip the step).
// The square sum accumulates in double over eight independent lanes, so it vectorises
// without -ffast-math and does not lose precision on large buffers.

#include <loom/comm/communicator.hpp>
#include <loom/core/error.hpp>

#include <cmath>
#include <concepts>
#include <cstddef>
#include <initializer_list>
#include <span>
#include <type_traits>

namespace loom::optim {

/// Sum of squares of x, in double.
inline double sum_of_squares(std::span<const float> x) noexcept {
  double lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  const std::size_t n = x.size(), n8 = n / 8 * 8;
  const float* p = x.data();
  for (std::size_t i = 0; i < n8; i += 8)
    for (int k = 0; k < 8; ++k) lane[k] += static_cast<double>(p[i + k]) * p[i + k];
  for (std::size_t i = n8; i < n; ++i) lane[0] += static_cast<double>(p[i]) * p[i];
  return ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
}

/// The global 2-norm over this rank's pieces and, through `reduce`, over all ranks.
template <comm::scalar_reducer<double> R = comm::no_reduce>
inline double global_norm(std::initializer_list<std::span<const float>> pieces, R&& reduce = {}) {
  double s = 0;
  for (auto p : pieces) s += sum_of_squares(p);
  return std::sqrt(static_cast<double>(reduce(s)));
}

/// The factor gradients of global norm `norm` are scaled by to reach at most max_norm (torch's
/// rule), or 1: no clipping (a norm within max_norm, or a non-finite norm: amp skips that step).
/// Both backends' clip_by_global_norm (optim/cuda/clip.cuh) scale by it.
inline float clip_factor(double norm, double max_norm) {
  if (!std::isfinite(norm)) return 1.f;
  const double coef = max_norm / (norm + 1e-6);
  return coef < 1.0 ? static_cast<float>(coef) : 1.f;
}

/// Clips this rank's pieces to a global norm of at most max_norm; returns the norm before clipping.
template <comm::scalar_reducer<double> R = comm::no_reduce>
inline double clip_by_global_norm(std::initializer_list<std::span<float>> pieces, double max_norm, R&& reduce = {}) {
  LOOM_CHECK(max_norm > 0, "clip_by_global_norm: max_norm must be > 0, got max_norm=", max_norm);
  double s = 0;
  for (auto p : pieces) s += sum_of_squares(p);
  const double norm = std::sqrt(static_cast<double>(reduce(s)));
  if (const float c = clip_factor(norm, max_norm); c != 1.f)
    for (auto p : pieces)
      for (float& g : p) g *= c;
  return norm;
}

template <comm::scalar_reducer<double> R = comm::no_reduce>
inline double clip_by_global_norm(std::span<float> grads, double max_norm, R&& reduce = {}) {
  return clip_by_global_norm({grads}, max_norm, std::forward<R>(reduce));
}

}  // namespace loom::optim
