#pragma once
// block_allocator: the bookkeeping half of a paged KV cache (vLLM's block manager).
//
// Why it is written this way: the KV pool is allocated once (kv/paged_kv_cache.hpp); this class
// only hands out block ids, so it runs identically for a host pool and a CUDA pool and never
// allocates memory per step. Each block has a reference count: sequences that share a prefix
// hold the same block, and a write to a block whose count is above one must first copy it
// (copy-on-write: `prepare_write` returns the block to write into and which block to copy from).
//
// Prefix cache: a full block can be registered under hash(parent hash, its tokens). When its
// last reference goes, such a block is not returned to the free list but parked at the tail of
// an LRU list, still holding its keys and values; a later sequence with the same prefix takes
// it back (`lookup`). When the free list is empty, `allocate` evicts the least recently used
// parked block. The block's tokens and parent hash are stored and compared on lookup, so a
// hash collision can never hand a sequence the wrong keys.

#include <loom/core/error.hpp>

#include <algorithm>
#include <cstdint>
#include <list>
#include <optional>
#include <span>
#include <unordered_map>
#include <vector>

namespace loom::kv {

using block_id = std::int32_t;
using token_id = std::int32_t;

/// Hash of a full block: combines the hash of the block before it (0 for the first) with the
/// block's tokens (splitmix64 finaliser over each word; position-dependent).
inline std::uint64_t block_hash(std::uint64_t parent, std::span<const token_id> tokens) noexcept {
  auto mix = [](std::uint64_t z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  };
  std::uint64_t h = mix(parent ^ 0x6C6F6F6D6B76ull);
  for (token_id t : tokens) h = mix(h ^ static_cast<std::uint32_t>(t));
  return h;
}

/// Result of prepare_write: write into `block`; if `copy_from` is set, first copy that block's
/// keys and values into `block` (the caller owns the data, the allocator only the ids).
struct write_target {
  block_id block = -1;
  std::optional<block_id> copy_from;
};

class block_allocator {
 public:
  /// `num_blocks` blocks of `block_size` token slots each.
  explicit block_allocator(std::int32_t num_blocks, std::int32_t block_size = 16)
      : block_size_(block_size), meta_(static_cast<std::size_t>(num_blocks > 0 ? num_blocks : 0)) {
    LOOM_CHECK(num_blocks > 0, "block_allocator: num_blocks must be > 0, got num_blocks=", num_blocks);
    LOOM_CHECK(block_size > 0, "block_allocator: block_size must be > 0, got block_size=", block_size);
    free_.reserve(meta_.size());
    for (block_id b = num_blocks; b-- > 0;) free_.push_back(b);  // pop_back hands out 0, 1, 2, ...
  }

  std::int32_t num_blocks() const noexcept { return static_cast<std::int32_t>(meta_.size()); }
  std::int32_t block_size() const noexcept { return block_size_; }
  /// Blocks that `allocate` can hand out now: never used or freed, plus parked cached blocks.
  std::int32_t num_free() const noexcept { return static_cast<std::int32_t>(free_.size() + lru_.size()); }
  /// Parked blocks (reference count 0, still holding a cached prefix).
  std::int32_t num_cached_free() const noexcept { return static_cast<std::int32_t>(lru_.size()); }
  std::int32_t ref_count(block_id b) const { return meta_[check(b)].refs; }
  bool is_cached(block_id b) const { return meta_[check(b)].cached; }
  /// Number of block copies made by prepare_write so far.
  std::int64_t num_copies() const noexcept { return copies_; }
  /// Number of prefix-cache hits (blocks reused through lookup) so far.
  std::int64_t num_hits() const noexcept { return hits_; }

  /// A fresh block with reference count 1, or nullopt when none is free (no parked block left
  /// to evict either).
  std::optional<block_id> try_allocate() {
    block_id b;
    if (!free_.empty()) {
      b = free_.back();
      free_.pop_back();
    } else if (!lru_.empty()) {
      b = lru_.front();  // least recently used parked block: evict its cached prefix
      lru_.pop_front();
      uncache(b);
    } else {
      return std::nullopt;
    }
    meta_[b].refs = 1;
    return b;
  }
  block_id allocate() {
    auto b = try_allocate();
    LOOM_CHECK(b.has_value(), "block_allocator: out of blocks (num_blocks=", num_blocks(), ")");
    return *b;
  }

  /// One more reference to a block that is in use (sharing it, e.g. forking a sequence).
  void retain(block_id b) {
    LOOM_CHECK(meta_[check(b)].refs > 0, "block_allocator::retain: block ", b, " is not in use");
    ++meta_[b].refs;
  }

  /// Drops one reference; at zero the block goes to the LRU if it is cached, else to the free list.
  void release(block_id b) {
    meta& m = meta_[check(b)];
    LOOM_CHECK(m.refs > 0, "block_allocator::release: block ", b, " is not in use (double free)");
    if (--m.refs > 0) return;
    if (m.cached) {
      m.lru_pos = lru_.insert(lru_.end(), b);
    } else {
      free_.push_back(b);
    }
  }

  /// Where to write token slots of block `b` (held by the caller): `b` itself if no one else
  /// holds it, else a fresh block to which `b` must be copied first (b loses one reference).
  /// A block that is written stops being a cached prefix. Returns nullopt if a copy is needed
  /// and no block is free.
  std::optional<write_target> try_prepare_write(block_id b) {
    meta& m = meta_[check(b)];
    LOOM_CHECK(m.refs > 0, "block_allocator::prepare_write: block ", b, " is not in use");
    if (m.refs == 1) {
      if (m.cached) uncache(b);
      return write_target{b, std::nullopt};
    }
    auto fresh = try_allocate();
    if (!fresh) return std::nullopt;
    --meta_[b].refs;  // still > 0: the other holders keep it
    ++copies_;
    return write_target{*fresh, b};
  }
  write_target prepare_write(block_id b) {
    auto t = try_prepare_write(b);
    LOOM_CHECK(t.has_value(), "block_allocator: out of blocks for copy-on-write of block ", b);
    return *t;
  }

  /// Registers the full block `b` as holding `tokens` (block_size of them) after the prefix
  /// whose last block hash is `parent`. Returns the block's hash. If an equal block is already
  /// registered, `b` stays unregistered (both hold the same values; the first one is kept).
  std::uint64_t register_full(block_id b, std::uint64_t parent, std::span<const token_id> tokens) {
    meta& m = meta_[check(b)];
    LOOM_CHECK(m.refs > 0, "block_allocator::register_full: block ", b, " is not in use");
    LOOM_CHECK(static_cast<std::int32_t>(tokens.size()) == block_size_, "block_allocator::register_full: got ",
               tokens.size(), " tokens for a block of block_size=", block_size_);
    const std::uint64_t h = block_hash(parent, tokens);
    if (m.cached) return m.hash;
    if (index_.contains(h)) return h;
    m.cached = true;
    m.hash = h;
    m.parent = parent;
    m.tokens.assign(tokens.begin(), tokens.end());
    index_.emplace(h, b);
    return h;
  }

  /// The cached block holding `tokens` after `parent`, with one more reference (taken back
  /// from the LRU if it was parked), or nullopt.
  std::optional<block_id> lookup(std::uint64_t parent, std::span<const token_id> tokens) {
    if (static_cast<std::int32_t>(tokens.size()) != block_size_) return std::nullopt;
    auto it = index_.find(block_hash(parent, tokens));
    if (it == index_.end()) return std::nullopt;
    meta& m = meta_[it->second];
    if (m.parent != parent || !std::equal(m.tokens.begin(), m.tokens.end(), tokens.begin())) return std::nullopt;
    if (m.refs == 0) lru_.erase(m.lru_pos);
    ++m.refs;
    ++hits_;
    return it->second;
  }

  /// Forgets every cached prefix (parked blocks return to the free list).
  void clear_cache() {
    for (block_id b : lru_) {
      uncache(b);
      free_.push_back(b);
    }
    lru_.clear();
    for (auto& m : meta_)
      if (m.cached) m.cached = false, m.tokens.clear();
    index_.clear();
  }

 private:
  struct meta {
    std::int32_t refs = 0;
    bool cached = false;
    std::uint64_t hash = 0, parent = 0;
    std::vector<token_id> tokens;  // kept to verify lookups (no false hits on hash collisions)
    std::list<block_id>::iterator lru_pos;
  };
  std::size_t check(block_id b) const {
    LOOM_CHECK(b >= 0 && b < num_blocks(), "block_allocator: block id ", b, " out of range [0, ", num_blocks(), ")");
    return static_cast<std::size_t>(b);
  }
  void uncache(block_id b) {
    meta& m = meta_[b];
    auto it = index_.find(m.hash);
    if (it != index_.end() && it->second == b) index_.erase(it);
    m.cached = false;
    m.tokens.clear();
  }

  std::int32_t block_size_;
  std::vector<meta> meta_;
  std::vector<block_id> free_;  // stack of blocks holding nothing reusable
  std::list<block_id> lru_;     // parked cached blocks, least recently used first
  std::unordered_map<std::uint64_t, block_id> index_;
  std::int64_t copies_ = 0, hits_ = 0;
};

}  // namespace loom::kv
