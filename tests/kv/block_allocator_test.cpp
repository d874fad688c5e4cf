// Property test of the block allocator and block tables under a randomised workload, against a
// naive model: every sequence keeps its tokens in a plain vector, and a simulated pool holds the
// token stored in each slot. After every operation: each block's reference count equals the
// number of tables that hold it, free + used = all blocks, every sequence reads back its own
// tokens through its table (so copy-on-write isolated writers and prefix hits hold the right
// data), and copies happen exactly when a block held by more than one table is written.
#include <doctest/doctest.h>

#include <loom/core/random.hpp>
#include <loom/kv/block_allocator.hpp>
#include <loom/kv/block_table.hpp>

#include <map>
#include <vector>

using namespace loom::kv;

namespace {

struct sequence {
  block_table table;
  std::vector<token_id> tokens;  // tokens written to the cache, in order
  std::uint64_t last_hash = 0;   // hash of the last registered full block
  std::int32_t registered = 0;   // full blocks registered in the prefix cache
};

struct harness {
  block_allocator alloc;
  std::int32_t bs;
  std::vector<token_id> pool;  // simulated KV: the token held by each slot (-1: garbage)
  std::map<int, sequence> seqs;
  int next_id = 0;
  std::int64_t expected_copies = 0;

  harness(std::int32_t blocks, std::int32_t block_size)
      : alloc(blocks, block_size), bs(block_size), pool(static_cast<std::size_t>(blocks) * block_size, -1) {}

  int holders(block_id b) const {
    int n = 0;
    for (auto& [id, s] : seqs)
      for (block_id x : s.table.blocks()) n += x == b;
    return n;
  }

  void check_invariants() {
    int used = 0;
    for (block_id b = 0; b < alloc.num_blocks(); ++b) {
      const int h = holders(b);
      REQUIRE(alloc.ref_count(b) == h);
      used += h > 0;
    }
    REQUIRE(alloc.num_free() + used == alloc.num_blocks());
    for (auto& [id, s] : seqs) {
      REQUIRE(s.table.num_blocks() == block_table::blocks_for(static_cast<std::int64_t>(s.tokens.size()), bs));
      for (std::size_t p = 0; p < s.tokens.size(); ++p)
        REQUIRE(pool[static_cast<std::size_t>(s.table.slot(static_cast<std::int64_t>(p), bs))] == s.tokens[p]);
    }
    REQUIRE(alloc.num_copies() == expected_copies);
  }

  // Writes `n` more tokens to sequence s (false: out of blocks, nothing written).
  bool append(sequence& s, const std::vector<token_id>& more) {
    const auto from = static_cast<std::int64_t>(s.tokens.size());
    const auto to = from + static_cast<std::int64_t>(more.size());
    // Naive prediction: the block holding `from` is copied iff it exists, is partially
    // filled (from is inside it) and is held by more than one table.
    const bool shared_partial = from % bs != 0 && holders(s.table.blocks()[static_cast<std::size_t>(from / bs)]) > 1;
    std::vector<block_copy> copies;
    const bool ok = s.table.prepare_write(alloc, from, to, copies);
    for (auto c : copies)
      for (int k = 0; k < bs; ++k) pool[static_cast<std::size_t>(c.dst * bs + k)] = pool[static_cast<std::size_t>(c.src * bs + k)];
    REQUIRE(copies.size() == (shared_partial && (ok || !copies.empty()) ? 1u : 0u));
    expected_copies += static_cast<std::int64_t>(copies.size());
    if (!ok) return false;
    for (std::int64_t p = from; p < to; ++p)
      pool[static_cast<std::size_t>(s.table.slot(p, bs))] = more[static_cast<std::size_t>(p - from)];
    s.tokens.insert(s.tokens.end(), more.begin(), more.end());
    // Register newly full blocks in the prefix cache.
    const auto full = static_cast<std::int32_t>(s.tokens.size() / static_cast<std::size_t>(bs));
    for (; s.registered < full; ++s.registered) {
      std::span<const token_id> blk(s.tokens.data() + s.registered * bs, static_cast<std::size_t>(bs));
      s.last_hash = alloc.register_full(s.table.blocks()[static_cast<std::size_t>(s.registered)], s.last_hash, blk);
    }
    return true;
  }

  // A new sequence with `prompt`: reuses cached full blocks, writes the rest.
  void admit(const std::vector<token_id>& prompt) {
    sequence s;
    std::size_t p = 0;
    while (p + static_cast<std::size_t>(bs) <= prompt.size()) {
      std::span<const token_id> blk(prompt.data() + p, static_cast<std::size_t>(bs));
      auto hit = alloc.lookup(s.last_hash, blk);
      if (!hit) break;
      // The hit must hold exactly these tokens (the simulated pool is the oracle).
      for (int k = 0; k < bs; ++k) REQUIRE(pool[static_cast<std::size_t>(*hit * bs + k)] == blk[static_cast<std::size_t>(k)]);
      s.table.push_shared(*hit);
      s.tokens.insert(s.tokens.end(), blk.begin(), blk.end());
      s.last_hash = block_hash(s.last_hash, blk);
      ++s.registered;
      p += static_cast<std::size_t>(bs);
    }
    const int id = next_id++;
    auto& ref = seqs[id] = std::move(s);
    if (!append(ref, std::vector<token_id>(prompt.begin() + static_cast<std::ptrdiff_t>(p), prompt.end()))) {
      ref.table.release(alloc);
      seqs.erase(id);
    }
  }
};

}  // namespace

TEST_CASE("block_allocator: randomised workload against a naive model") {
  for (std::int32_t bs : {1, 4, 16}) {
    harness h(48, bs);
    loom::counter_rng rng(1234 + static_cast<std::uint64_t>(bs));
    std::uint64_t draw = 0;
    auto rnd = [&](int n) { return static_cast<int>(rng.bits(draw++) % static_cast<std::uint32_t>(n)); };
    // A few shared prefixes so that the prefix cache hits.
    std::vector<std::vector<token_id>> prefixes(3);
    for (auto& pf : prefixes)
      for (int k = 0; k < 3 * bs; ++k) pf.push_back(rnd(50));
    for (int step = 0; step < 1500; ++step) {
      const int op = rnd(10);
      if (op < 3 || h.seqs.empty()) {  // admit
        std::vector<token_id> prompt;
        if (rnd(2)) prompt = prefixes[static_cast<std::size_t>(rnd(3))];
        for (int k = 0, n = 1 + rnd(2 * bs + 3); k < n; ++k) prompt.push_back(rnd(50));
        h.admit(prompt);
      } else {
        auto it = h.seqs.begin();
        std::advance(it, rnd(static_cast<int>(h.seqs.size())));
        if (op < 6) {  // decode / chunk
          std::vector<token_id> more;
          for (int k = 0, n = 1 + rnd(bs + 2); k < n; ++k) more.push_back(rnd(50));
          h.append(it->second, more);
        } else if (op < 8) {  // fork (parallel sampling): shares every block
          sequence f;
          f.table = it->second.table.fork(h.alloc);
          f.tokens = it->second.tokens;
          f.last_hash = it->second.last_hash;
          f.registered = it->second.registered;
          h.seqs[h.next_id++] = std::move(f);
        } else {  // finish
          it->second.table.release(h.alloc);
          h.seqs.erase(it);
        }
      }
      h.check_invariants();
    }
    if (bs > 1) CHECK(h.alloc.num_copies() > 0);  // the workload did exercise copy-on-write (bs 1: never partial)
    CHECK(h.alloc.num_hits() > 0);    // and prefix hits
    for (auto& [id, s] : h.seqs) s.table.release(h.alloc);
    h.seqs.clear();
    h.check_invariants();
    CHECK(h.alloc.num_free() == h.alloc.num_blocks());  // nothing leaked
    for (block_id b = 0; b < h.alloc.num_blocks(); ++b) CHECK(h.alloc.ref_count(b) == 0);
  }
}

TEST_CASE("block_allocator: LRU keeps cached prefixes until evicted, least recently used first") {
  block_allocator a(3, 2);
  std::vector<token_id> t0{1, 2}, t1{3, 4};
  block_id b0 = a.allocate(), b1 = a.allocate();
  a.register_full(b0, 0, t0);
  a.register_full(b1, 0, t1);
  a.release(b0);  // parked first: least recently used
  a.release(b1);
  CHECK(a.num_free() == 3);
  CHECK(a.num_cached_free() == 2);
  block_id fresh = a.allocate();  // the never-used block comes before any eviction
  CHECK(fresh == 2);
  block_id evicted = a.allocate();  // evicts b0
  CHECK(evicted == b0);
  CHECK_FALSE(a.lookup(0, t0).has_value());
  auto hit = a.lookup(0, t1);
  REQUIRE(hit.has_value());
  CHECK(*hit == b1);
  CHECK(a.ref_count(b1) == 1);
  CHECK_FALSE(a.try_allocate().has_value());
  CHECK(a.lookup(1, t1) == std::nullopt);  // same tokens after another parent: no hit
}

TEST_CASE("block_allocator: bad input throws loom::error") {
  CHECK_THROWS_AS(block_allocator(0, 16), loom::error);
  CHECK_THROWS_AS(block_allocator(4, 0), loom::error);
  block_allocator a(2, 4);
  CHECK_THROWS_AS(a.release(0), loom::error);  // not in use
  CHECK_THROWS_AS(a.retain(7), loom::error);   // out of range
  block_id b = a.allocate();
  std::vector<token_id> three{1, 2, 3};
  CHECK_THROWS_AS(a.register_full(b, 0, three), loom::error);
  a.allocate();
  CHECK_THROWS_AS(a.allocate(), loom::error);
}

TEST_CASE("paged_kv_csr: indptr, indices and last_page_len") {
  block_allocator a(10, 4);
  block_table t1, t2;
  std::vector<block_copy> copies;
  REQUIRE(t1.prepare_write(a, 0, 9, copies));   // 3 blocks, last holds 1
  REQUIRE(t2.prepare_write(a, 0, 4, copies));   // 1 block, full
  paged_kv_csr csr;
  csr.block_size = 4;
  csr.clear();
  csr.push(t1, 9);
  csr.push(t2, 4);
  CHECK(csr.indptr == std::vector<std::int32_t>{0, 3, 4});
  CHECK(csr.indices == std::vector<std::int32_t>{0, 1, 2, 3});
  CHECK(csr.last_page_len == std::vector<std::int32_t>{1, 4});
  CHECK(csr.kv_len(0) == 9);
  CHECK(csr.kv_len(1) == 4);
  CHECK(t1.slot(8, 4) == 2 * 4 + 0);
}
