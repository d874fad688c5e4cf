#pragma once
// The per-candidate and per-draw math of token sampling (kv/sampler.hpp on the host,
// kv/cuda/sampler.cuh on the GPU), so both pick the same token from the same logits:
//
//   repetition penalty (HF/CTRL): a logit of a token already seen, l > 0 ? l / p : l * p
//   candidate order: higher logit first, equal logits by lower token id (a total order, so
//                    the result does not depend on the sort)
//   weight of a kept candidate: e^((l - max) / temperature), in double (sums of many small
//                    probabilities)
//   draw over the kept candidates in order: with top_p < 1 the smallest prefix whose mass
//                    reaches top_p (at least one); then the first whose cumulative weight
//                    exceeds u * total (u uniform in [0, 1)), or the last (u rounded up to the
//                    total). Sums run in candidate order, one after another: the same bits on
//                    both backends. Sorting and the row's maximum are per backend.

#include <loom/core/config.hpp>

#include <cmath>
#include <cstdint>

namespace loom::ops::math {

LOOM_HOST_DEVICE inline float repetition_penalized(float logit, float penalty) {
  return logit > 0.f ? logit / penalty : logit * penalty;
}

/// Whether candidate (logit a, id ia) comes before (b, ib).
LOOM_HOST_DEVICE inline bool sampled_before(float a, std::int32_t ia, float b, std::int32_t ib) {
  return a > b || (a == b && ia < ib);
}

/// Unnormalised probability of a kept candidate; `max` is the first candidate's logit.
LOOM_HOST_DEVICE inline double sampling_weight(float logit, double max, float temperature) {
  return std::exp((static_cast<double>(logit) - max) / temperature);
}

/// The position, in [0, keep), of the candidate drawn by u in [0, 1) from `weight` [keep]
/// (candidate order), after the top-p cut.
LOOM_HOST_DEVICE inline std::int32_t draw_candidate(const double* weight, std::int32_t keep, float top_p, float u) {
  double sum = 0;
  for (std::int32_t i = 0; i < keep; ++i) sum += weight[i];
  if (top_p < 1.f) {
    double cum = 0;
    std::int32_t n = 0;
    while (n < keep) {
      cum += weight[n++] / sum;
      if (cum >= static_cast<double>(top_p)) break;
    }
    keep = n;
    sum = 0;
    for (std::int32_t i = 0; i < keep; ++i) sum += weight[i];
  }
  const double target = static_cast<double>(u) * sum;
  double cum = 0;
  for (std::int32_t i = 0; i < keep; ++i) {
    cum += weight[i];
    if (target < cum) return i;
  }
  return keep - 1;
}

}  // namespace loom::ops::math
