#pragma once
// Bucket planning: group an ordered list of items (layers, parameters) into consecutive
// buckets of at most `capacity` elements.
//
// Why a plan: ZeRO's gradient reduction and parameter all-gather move many small tensors;
// one collective per bucket amortises latency, and the bucket boundaries are fixed by the
// model layout, so they are computed once on the host and then reused every step with no
// allocation. Greedy and order-preserving: items are taken in the given order and a bucket
// is closed when the next item would overflow it; an item larger than the capacity gets a
// bucket of its own (it cannot be split without splitting a tensor). Sizes are element
// counts, as DeepSpeed's reduce_bucket_size and stage3_* sizes are.

#include <loom/core/error.hpp>

#include <cstddef>
#include <span>
#include <vector>

namespace loom::sched {

/// One bucket: items [first, last) of the planned order, `numel` elements in total,
/// starting `offset` elements into the concatenation of all items.
struct bucket {
  std::size_t first = 0;
  std::size_t last = 0;
  std::size_t offset = 0;
  std::size_t numel = 0;
  std::size_t items() const noexcept { return last - first; }
};

struct bucket_plan {
  std::vector<bucket> buckets;
  std::vector<std::size_t> bucket_of;  ///< item index -> bucket index
  std::size_t max_bucket_numel = 0;     ///< the largest bucket (what a staging buffer must hold)
  std::size_t total_numel = 0;
};

/// Plans buckets over `sizes` (element counts, in the order the items become ready).
/// Requires: capacity > 0.
inline bucket_plan plan_buckets(std::span<const std::size_t> sizes, std::size_t capacity) {
  LOOM_CHECK(capacity > 0, "plan_buckets: capacity must be > 0 elements, got capacity=", capacity);
  bucket_plan p;
  p.bucket_of.resize(sizes.size());
  bucket cur;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    if (cur.items() > 0 && cur.numel + sizes[i] > capacity) {
      p.buckets.push_back(cur);
      cur = bucket{i, i, cur.offset + cur.numel, 0};
    }
    cur.last = i + 1;
    cur.numel += sizes[i];
    p.bucket_of[i] = p.buckets.size();
  }
  if (cur.items() > 0) p.buckets.push_back(cur);
  for (const bucket& b : p.buckets) {
    if (b.numel > p.max_bucket_numel) p.max_bucket_numel = b.numel;
    p.total_numel += b.numel;
  }
  return p;
}

}  // namespace loom::sched
