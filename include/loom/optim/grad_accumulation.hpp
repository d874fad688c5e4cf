#pragma once
// Gradient accumulation: several micro-batches per optimizer step.
//
// Why: the global batch (train_batch_size) is micro_batch x accumulation_steps x dp; memory
// only has to hold one micro-batch's activations. As DeepSpeed does, each micro-batch's loss
// is scaled by 1 / accumulation_steps, so the accumulated gradient is the mean over the
// global batch, and the optimizer steps at the boundary (every accumulation_steps-th
// micro-batch). `accumulate` widens and adds a micro-batch's gradients (any floating type,
// e.g. bfloat16 model gradients) into the fp32 gradient buffer with a scale folded in.

#include <loom/core/dtype.hpp>
#include <loom/core/error.hpp>

#include <cstddef>
#include <cstdint>
#include <span>

namespace loom::optim {

/// acc[i] += float(g[i]) * scale.
template <floating_element T>
inline void accumulate(std::span<float> acc, std::span<const T> g, float scale = 1.f) {
  LOOM_CHECK(acc.size() == g.size(), "accumulate: sizes differ, acc.size()=", acc.size(), " g.size()=", g.size());
  const std::size_t n = acc.size();
  for (std::size_t i = 0; i < n; ++i) acc[i] += static_cast<float>(g[i]) * scale;
}

/// Counts micro-batches and says when the optimizer steps.
class grad_accumulation {
 public:
  explicit grad_accumulation(int steps = 1) : steps_(steps) {
    LOOM_CHECK(steps >= 1, "gradient_accumulation_steps must be >= 1, got gradient_accumulation_steps=", steps);
  }
  int steps() const noexcept { return steps_; }
  /// The factor applied to each micro-batch's loss (1 / steps).
  float loss_scale() const noexcept { return 1.f / static_cast<float>(steps_); }
  /// Index of the current micro-batch within the step, 0 .. steps-1.
  int micro_step() const noexcept { return micro_; }
  bool is_first() const noexcept { return micro_ == 0; }
  /// True when the current micro-batch is the last of the step (the optimizer steps after it).
  bool is_boundary() const noexcept { return micro_ == steps_ - 1; }
  /// Moves to the next micro-batch.
  void advance() noexcept { micro_ = (micro_ + 1) % steps_; }

 private:
  int steps_;
  int micro_ = 0;
};

}  // namespace loom::optim
