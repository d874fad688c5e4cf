#pragma once
// block_table: the blocks of one sequence, in order, and their export in FlashInfer's CSR form.
//
// Why: attention kernels see a batch of sequences as three integer arrays (FlashInfer's
// paged_kv_t): indptr [batch + 1] (where each sequence's block list starts in indices),
// indices [total blocks] (block ids), last_page_len [batch] (tokens used in each sequence's
// last block, 1..block_size). The scheduler builds them once per step on the host; the
// kernels then run without any lookup structures. Token position p of a sequence lives in
// slot p % block_size of block blocks[p / block_size].

#include <loom/core/error.hpp>
#include <loom/kv/block_allocator.hpp>

#include <cstdint>
#include <span>
#include <utility>
#include <vector>

namespace loom::kv {

/// A copy the caller must make before writing: keys and values of block `src` into `dst`.
struct block_copy {
  block_id src = -1, dst = -1;
};

class block_table {
 public:
  const std::vector<block_id>& blocks() const noexcept { return blocks_; }
  std::int32_t num_blocks() const noexcept { return static_cast<std::int32_t>(blocks_.size()); }
  bool empty() const noexcept { return blocks_.empty(); }

  /// Blocks needed to hold `tokens` token slots.
  static std::int32_t blocks_for(std::int64_t tokens, std::int32_t block_size) noexcept {
    return static_cast<std::int32_t>((tokens + block_size - 1) / block_size);
  }

  /// Appends a block already holding the next block_size tokens (a prefix-cache hit).
  void push_shared(block_id b) { blocks_.push_back(b); }

  /// Makes positions [from, to) writable: allocates missing blocks and copies shared ones
  /// (copy-on-write; the copies to make are appended to `copies`, and must be made even when
  /// false is returned). Returns false, with no block added, if the allocator ran out.
  bool prepare_write(block_allocator& alloc, std::int64_t from, std::int64_t to, std::vector<block_copy>& copies) {
    LOOM_CHECK(0 <= from && from <= to, "block_table::prepare_write: bad range [", from, ", ", to, ")");
    if (from == to) return true;
    const std::int32_t bs = alloc.block_size();
    LOOM_CHECK(from <= static_cast<std::int64_t>(blocks_.size()) * bs, "block_table::prepare_write: position from=",
               from, " leaves a gap after ", blocks_.size(), " blocks");
    const std::int32_t need = blocks_for(to, bs);
    // Blocks that exist and are written now may be shared: copy them first.
    for (std::int32_t i = static_cast<std::int32_t>(from / bs); i < num_blocks() && i < need; ++i) {
      auto t = alloc.try_prepare_write(blocks_[i]);
      if (!t) return false;
      if (t->copy_from) copies.push_back({*t->copy_from, t->block});
      blocks_[i] = t->block;
    }
    const std::size_t old_size = blocks_.size();
    while (num_blocks() < need) {
      auto b = alloc.try_allocate();
      if (!b) {
        for (std::size_t i = old_size; i < blocks_.size(); ++i) alloc.release(blocks_[i]);
        blocks_.resize(old_size);
        return false;
      }
      blocks_.push_back(*b);
    }
    return true;
  }

  /// Another table sharing all blocks of this one (reference counts +1): a forked sequence.
  block_table fork(block_allocator& alloc) const {
    for (block_id b : blocks_) alloc.retain(b);
    block_table t;
    t.blocks_ = blocks_;
    return t;
  }

  /// Drops all blocks (the last block first, so that the prefix is evicted last from the LRU).
  void release(block_allocator& alloc) {
    for (std::size_t i = blocks_.size(); i-- > 0;) alloc.release(blocks_[i]);
    blocks_.clear();
  }

  /// Global slot index (block * block_size + offset) of token position p.
  std::int64_t slot(std::int64_t p, std::int32_t block_size) const {
    const std::int64_t i = p / block_size;
    LOOM_CHECK(p >= 0 && i < static_cast<std::int64_t>(blocks_.size()), "block_table::slot: position p=", p,
               " beyond ", blocks_.size(), " blocks");
    return static_cast<std::int64_t>(blocks_[static_cast<std::size_t>(i)]) * block_size + p % block_size;
  }

 private:
  std::vector<block_id> blocks_;
};

/// FlashInfer's paged-KV description of a batch (CSR over block ids).
struct paged_kv_csr {
  std::vector<std::int32_t> indptr;         // [batch + 1]
  std::vector<std::int32_t> indices;        // [indptr.back()] block ids
  std::vector<std::int32_t> last_page_len;  // [batch] in 1..block_size
  std::int32_t block_size = 16;

  std::int32_t batch() const noexcept { return static_cast<std::int32_t>(last_page_len.size()); }
  /// Tokens of sequence i held in the cache.
  std::int64_t kv_len(std::int32_t i) const {
    const std::int32_t pages = indptr[i + 1] - indptr[i];
    return pages == 0 ? 0 : static_cast<std::int64_t>(pages - 1) * block_size + last_page_len[i];
  }
  void clear() {
    indptr.assign(1, 0);
    indices.clear();
    last_page_len.clear();
  }
  /// Appends a sequence whose first kv_len tokens are in `table`.
  void push(const block_table& table, std::int64_t kv_len) {
    if (indptr.empty()) indptr.push_back(0);
    const std::int32_t pages = block_table::blocks_for(kv_len, block_size);
    LOOM_CHECK(kv_len > 0 && pages <= table.num_blocks(), "paged_kv_csr::push: kv_len=", kv_len, " needs ", pages,
               " blocks, table has ", table.num_blocks());
    indices.insert(indices.end(), table.blocks().begin(), table.blocks().begin() + pages);
    indptr.push_back(static_cast<std::int32_t>(indices.size()));
    last_page_len.push_back(static_cast<std::int32_t>(kv_len - static_cast<std::int64_t>(pages - 1) * block_size));
  }
};

}  // namespace loom::kv
