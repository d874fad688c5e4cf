#pragma once
// The paged-KV fixture of the CUDA kernels' tests (the GPU test and the emulated one): sequences
// of given lengths in a pool whose pages were handed out of order, their block tables and CSR,
// and each token's (sequence, position) for an append.
#include <loom/kv/block_allocator.hpp>
#include <loom/kv/block_table.hpp>
#include <loom/kv/paged_attention.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace loom::kv::testing {

struct scrambled_pool {
  std::int64_t total = 0, longest = 0;
  std::int32_t num_blocks;
  block_allocator alloc;
  std::vector<block_table> tables;
  paged_kv_csr csr;
  std::vector<std::int32_t> bidx;  // token i goes to sequence bidx[i] at position pos[i]
  std::vector<std::int64_t> pos;

  scrambled_pool(std::int32_t block_size, const std::vector<std::int64_t>& kv_lens)
      : num_blocks(blocks_for(block_size, kv_lens)), alloc(num_blocks, block_size), tables(kv_lens.size()) {
    std::vector<block_id> hold;
    for (int i = 0; i < 7; ++i) hold.push_back(alloc.allocate());
    for (int i = 0; i < 7; i += 2) alloc.release(hold[std::size_t(i)]);  // pages out of order
    csr.block_size = block_size;
    csr.clear();
    for (std::size_t b = 0; b < kv_lens.size(); ++b) {
      std::vector<block_copy> copies;
      const bool prepared = tables[b].prepare_write(alloc, 0, kv_lens[b], copies);
      REQUIRE(prepared);
      csr.push(tables[b], kv_lens[b]);
      for (std::int64_t p = 0; p < kv_lens[b]; ++p) bidx.push_back(static_cast<std::int32_t>(b)), pos.push_back(p);
      total += kv_lens[b], longest = std::max(longest, kv_lens[b]);
    }
  }

 private:
  static std::int32_t blocks_for(std::int32_t block_size, const std::vector<std::int64_t>& kv_lens) {
    std::int64_t total = 0;
    for (auto n : kv_lens) total += n;
    return static_cast<std::int32_t>(total / block_size + static_cast<std::int64_t>(kv_lens.size()) + 8);
  }
};

}  // namespace loom::kv::testing
