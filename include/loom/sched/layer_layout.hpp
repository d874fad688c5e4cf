#pragma once
// layer_layout: the shape of a partitioned model as the schedulers see it.
//
// A model is an ordered list of parameters grouped into consecutive layers. For ZeRO every
// parameter is padded to a multiple of the data-parallel size `world`, so a parameter is
// split into `world` equal contiguous slices and rank r owns slice r of every parameter.
// Two coordinate systems follow:
//   full   offset(p)        the padded parameters concatenated, layer after layer
//   shard  shard_offset(p)  = offset(p) / world, rank r's slices concatenated
// A padded parameter is already "rank-major" ([world, shard] row-major), which is exactly
// what all_gather produces and reduce_scatter consumes, so one parameter moves with one
// collective and no copy. The schedulers only need sizes, so this type carries no names or
// shapes (zero::flat_layout adds those on top).

#include <loom/core/error.hpp>

#include <cstddef>
#include <span>
#include <vector>

namespace loom::sched {

/// Requires: world >= 1; every layer has at least one parameter.
class layer_layout {
 public:
  layer_layout() = default;
  /// numel[p]: unpadded element count of parameter p; layer_of[p]: its layer (0, 0, 1, 1, 1, 2, ...:
  /// non-decreasing, starting at 0, no layer skipped).
  layer_layout(std::span<const std::size_t> numel, std::span<const std::size_t> layer_of, std::size_t world)
      : world_(world) {
    LOOM_CHECK(world >= 1, "layer_layout: world (data-parallel size) must be >= 1, got world=", world);
    LOOM_CHECK(numel.size() == layer_of.size(), "layer_layout: numel has ", numel.size(),
               " entries but layer_of has ", layer_of.size());
    LOOM_CHECK(!numel.empty(), "layer_layout: a model needs at least one parameter");
    numel_.assign(numel.begin(), numel.end());
    offset_.resize(numel.size() + 1, 0);
    for (std::size_t p = 0; p < numel.size(); ++p) {
      const std::size_t padded = (numel[p] + world - 1) / world * world;
      offset_[p + 1] = offset_[p] + padded;
      const std::size_t expect_prev = p == 0 ? 0 : layer_of[p - 1];
      LOOM_CHECK(p == 0 ? layer_of[p] == 0 : (layer_of[p] == expect_prev || layer_of[p] == expect_prev + 1),
                 "layer_layout: layer_of must start at 0 and grow by at most 1 per parameter; parameter ", p,
                 " has layer_of=", layer_of[p], " after ", expect_prev);
      if (p == 0 || layer_of[p] != layer_of[p - 1]) layer_first_.push_back(p);
    }
    layer_first_.push_back(numel.size());
  }

  std::size_t world() const noexcept { return world_; }
  std::size_t params() const noexcept { return numel_.size(); }
  std::size_t layers() const noexcept { return layer_first_.size() - 1; }

  std::size_t numel(std::size_t p) const noexcept { return numel_[p]; }
  std::size_t padded_numel(std::size_t p) const noexcept { return offset_[p + 1] - offset_[p]; }
  std::size_t shard_numel(std::size_t p) const noexcept { return padded_numel(p) / world_; }
  std::size_t offset(std::size_t p) const noexcept { return offset_[p]; }
  std::size_t shard_offset(std::size_t p) const noexcept { return offset_[p] / world_; }

  /// Parameters of layer l are [layer_begin(l), layer_end(l)).
  std::size_t layer_begin(std::size_t l) const noexcept { return layer_first_[l]; }
  std::size_t layer_end(std::size_t l) const noexcept { return layer_first_[l + 1]; }
  std::size_t layer_offset(std::size_t l) const noexcept { return offset_[layer_first_[l]]; }
  std::size_t layer_padded_numel(std::size_t l) const noexcept {
    return offset_[layer_first_[l + 1]] - offset_[layer_first_[l]];
  }

  std::size_t total_numel() const noexcept {
    std::size_t n = 0;
    for (std::size_t x : numel_) n += x;
    return n;
  }
  std::size_t padded_total() const noexcept { return offset_.back(); }
  std::size_t shard_total() const noexcept { return offset_.back() / world_; }

 private:
  std::size_t world_ = 1;
  std::vector<std::size_t> numel_;
  std::vector<std::size_t> offset_;       // [params + 1]
  std::vector<std::size_t> layer_first_;  // [layers + 1]
};

}  // namespace loom::sched
