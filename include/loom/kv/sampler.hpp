#pragma once
// Token samplers: greedy, temperature, top-k, top-p (nucleus), repetition penalty, per-request
// seed.
//
// Why the random draw is keyed by (request seed, token position): the uniform number used to
// pick token p of a request is counter_rng(seed).uniform(p), a pure function of the two. A
// request therefore samples the same text whether it ran alone, in a batch of 32, or was
// preempted and recomputed half-way, which a stateful per-request generator cannot promise
// once batches are reordered. Order of the transformations (as HF transformers): repetition
// penalty on the raw logits, temperature, top-k, top-p, then inverse-CDF draw over the kept
// tokens sorted by probability (ties broken by token id, so the result is deterministic).
// The sampler owns its scratch and reuses it: no allocation per token after the first.

#include <loom/core/config.hpp>
#include <loom/core/error.hpp>
#include <loom/core/random.hpp>
#include <loom/kv/block_allocator.hpp>
#include <loom/ops/math/sampling.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <span>
#include <vector>

namespace loom::kv {

struct sampling_params {
  float temperature = 0.f;         ///< 0: greedy (argmax)
  std::int32_t top_k = 0;          ///< keep the k most likely tokens; 0: all
  float top_p = 1.f;               ///< keep the smallest set whose probability reaches top_p; 1: all
  float repetition_penalty = 1.f;  ///< > 1 discourages tokens already in prompt or output (HF/CTRL rule)
  std::uint64_t seed = 0;          ///< the draw for token position p is counter_rng(seed).uniform(p)

  void validate() const {
    LOOM_CHECK(std::isfinite(temperature) && temperature >= 0.f, "sampling_params: temperature must be >= 0, got ",
               temperature);
    LOOM_CHECK(top_k >= 0, "sampling_params: top_k must be >= 0, got ", top_k);
    LOOM_CHECK(top_p > 0.f && top_p <= 1.f, "sampling_params: top_p must be in (0, 1], got ", top_p);
    LOOM_CHECK(std::isfinite(repetition_penalty) && repetition_penalty > 0.f,
               "sampling_params: repetition_penalty must be > 0, got ", repetition_penalty);
  }
  LOOM_HOST_DEVICE bool greedy() const noexcept { return temperature == 0.f; }
};

/// Stream of counter_rng used for sampling draws (keeps them apart from weight-init streams).
inline constexpr std::uint64_t sampling_stream = 0x73616D706C65ull;  // "sample"

class sampler {
 public:
  /// Picks the token at sequence position `position` from `logits` [vocab] (modified in
  /// place). `history` holds the prompt and the tokens generated so far (for the penalty).
  token_id sample(std::span<float> logits, const sampling_params& p, std::span<const token_id> history,
                  std::int64_t position) {
    const auto vocab = static_cast<std::int32_t>(logits.size());
    LOOM_CHECK(vocab > 0, "sampler::sample: empty logits");
    if (p.repetition_penalty != 1.f) apply_repetition_penalty(logits, p.repetition_penalty, history);
    if (p.greedy()) return argmax(logits);

    // Candidates in order (ops/math/sampling.hpp): highest logit first, ties by token id.
    idx_.resize(static_cast<std::size_t>(vocab));
    std::iota(idx_.begin(), idx_.end(), 0);
    auto by_logit = [&](token_id a, token_id b) {
      return ops::math::sampled_before(logits[static_cast<std::size_t>(a)], a, logits[static_cast<std::size_t>(b)], b);
    };
    std::int32_t keep = vocab;
    if (p.top_k > 0 && p.top_k < vocab) {
      keep = p.top_k;
      std::partial_sort(idx_.begin(), idx_.begin() + keep, idx_.end(), by_logit);
    } else {
      std::sort(idx_.begin(), idx_.end(), by_logit);
    }
    // Weights of the kept candidates at the given temperature, then the top-p cut and the
    // draw over them (the GPU sampler's arithmetic too).
    prob_.resize(static_cast<std::size_t>(keep));
    const double mx = logits[static_cast<std::size_t>(idx_[0])];
    for (std::int32_t i = 0; i < keep; ++i)
      prob_[static_cast<std::size_t>(i)] =
          ops::math::sampling_weight(logits[static_cast<std::size_t>(idx_[static_cast<std::size_t>(i)])], mx, p.temperature);
    const float u = counter_rng(p.seed, sampling_stream).uniform(static_cast<std::uint64_t>(position));
    return idx_[static_cast<std::size_t>(ops::math::draw_candidate(prob_.data(), keep, p.top_p, u))];
  }

  /// Index of the largest logit (the lowest index among equal ones).
  static token_id argmax(std::span<const float> logits) {
    return static_cast<token_id>(std::max_element(logits.begin(), logits.end()) - logits.begin());
  }

 private:
  void apply_repetition_penalty(std::span<float> logits, float penalty, std::span<const token_id> history) {
    seen_.assign(logits.size(), 0);
    for (token_id t : history) {
      LOOM_CHECK(t >= 0 && static_cast<std::size_t>(t) < logits.size(), "sampler: history token ", t,
                 " outside the vocabulary of ", logits.size());
      auto& s = seen_[static_cast<std::size_t>(t)];
      if (s) continue;
      s = 1;
      float& l = logits[static_cast<std::size_t>(t)];
      l = ops::math::repetition_penalized(l, penalty);
    }
  }

  std::vector<token_id> idx_;
  std::vector<double> prob_;
  std::vector<std::uint8_t> seen_;
};

}  // namespace loom::kv
