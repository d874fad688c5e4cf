#pragma once
// Activation checkpointing for a stack of blocks: keep every block's activations, or keep
// only the block inputs and recompute a block's activations right before its backward.
//
// Why a helper: the choice changes where activations live (n sets vs one shared set) but
// not the order of forward and backward calls. A model asks `for_forward(i)` for the set
// block i fills, and `for_backward(i, recompute)` for the set its backward reads; with
// checkpointing the latter first calls `recompute(set)` (the block's forward on its saved
// input). Memory: n sets -> 1 set, at the price of one more forward per block.

#include <loom/core/error.hpp>
#include <loom/core/tensor_view.hpp>

#include <utility>
#include <vector>

namespace loom::nn {

template <class Acts>
class block_activations {
 public:
  block_activations() = default;
  /// make(): builds one activation set.
  template <class Make>
  block_activations(index_t n_blocks, bool checkpoint, Make&& make) : n_(n_blocks), checkpoint_(checkpoint) {
    LOOM_CHECK(n_blocks >= 0, "block_activations: n_blocks must be >= 0, got n_blocks=", n_blocks);
    const index_t sets = checkpoint ? (n_blocks > 0 ? 1 : 0) : n_blocks;
    for (index_t i = 0; i < sets; ++i) sets_.push_back(make());
  }

  bool checkpointing() const noexcept { return checkpoint_; }
  index_t blocks() const noexcept { return n_; }
  /// Sets actually held (1 with checkpointing).
  std::size_t sets() const noexcept { return sets_.size(); }

  Acts& for_forward(index_t i) { return sets_[index(i)]; }
  /// The activations of block i for its backward; recompute(acts) refills them first when
  /// checkpointing.
  template <class Recompute>
  Acts& for_backward(index_t i, Recompute&& recompute) {
    Acts& a = sets_[index(i)];
    if (checkpoint_) std::forward<Recompute>(recompute)(a);
    return a;
  }

 private:
  std::size_t index(index_t i) const {
    LOOM_CHECK(0 <= i && i < n_, "block_activations: block ", i, " out of range [0, ", n_, ")");
    return checkpoint_ ? 0 : static_cast<std::size_t>(i);
  }
  index_t n_ = 0;
  bool checkpoint_ = false;
  std::vector<Acts> sets_;
};

}  // namespace loom::nn
