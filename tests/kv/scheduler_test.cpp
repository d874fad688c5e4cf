// Continuous-batching scheduler against a sequential reference, with a fake model whose
// "keys and values" are the token ids themselves, stored in a simulated paged pool: each step
// writes the scheduled tokens into their slots, then each sampling sequence reads its whole
// context back through the CSR block table and derives its next-token logits from what it
// read. Wrong block tables, bad prefix hits or a botched recompute after preemption change
// what is read, hence the output, which must equal that of running every request alone.
// Per-step invariants: token budget, sequence cap, decodes before prefills, FCFS admission,
// reference counts equal to the holders, and every block free at the end.
// kv::engine (the same loop over a real paged_kv_cache) with the same fake model as its
// paged_model: the same outputs as each request alone.
#include <doctest/doctest.h>

#include <loom/core/random.hpp>
#include <loom/kv/engine.hpp>
#include <loom/kv/scheduler.hpp>

#include <map>
#include <set>
#include <vector>

using namespace loom::kv;

namespace {

constexpr int vocab = 32;

// Logits of the next token given the whole context (a deterministic function of it).
std::vector<float> fake_logits(std::span<const token_id> ctx) {
  std::uint64_t h = 0;
  for (token_id t : ctx) h = block_hash(h, std::span<const token_id>(&t, 1));
  std::vector<float> l(vocab);
  loom::counter_rng rng(h);
  for (int v = 0; v < vocab; ++v) l[static_cast<std::size_t>(v)] = 4.f * rng.uniform(static_cast<std::uint64_t>(v)) - 2.f;
  return l;
}

// What a request produces when run alone, token by token.
std::vector<token_id> reference(const request& r, std::int32_t max_model_len) {
  sampler smp;
  std::vector<token_id> ctx = r.prompt, out;
  while (true) {
    auto l = fake_logits(ctx);
    const token_id t = smp.sample(l, r.sampling, ctx, static_cast<std::int64_t>(ctx.size()));
    ctx.push_back(t);
    out.push_back(t);
    if (std::find(r.stop_tokens.begin(), r.stop_tokens.end(), t) != r.stop_tokens.end()) break;
    if (static_cast<std::int32_t>(out.size()) >= r.max_new_tokens || static_cast<std::int32_t>(ctx.size()) >= max_model_len)
      break;
  }
  return out;
}

struct run_result {
  std::map<std::uint64_t, std::vector<token_id>> outputs;
  std::int64_t preemptions = 0, hits = 0, steps = 0, chunked = 0;
};

run_result run(const scheduler_config& cfg, std::int32_t num_blocks, std::int32_t bs, const std::vector<request>& reqs,
               int arrive_every) {
  block_allocator alloc(num_blocks, bs);
  scheduler sch(cfg, alloc);
  std::vector<token_id> pool(static_cast<std::size_t>(num_blocks * bs), -1);
  sampler smp;
  run_result res;
  std::set<std::uint64_t> admitted;
  std::size_t next = 0;
  for (int step = 0; step < 100000 && (next < reqs.size() || sch.has_work()); ++step) {
    // Requests arrive over time.
    if (step % arrive_every == 0)
      for (int k = 0; k < 3 && next < reqs.size(); ++k) sch.add(reqs[next++]);
    const step_plan& plan = sch.schedule();
    REQUIRE(plan.num_tokens() <= cfg.max_num_batched_tokens);
    REQUIRE(static_cast<std::int32_t>(plan.chunks.size()) <= cfg.max_num_seqs);
    bool seen_prefill = false;
    for (auto& c : plan.chunks) {
      if (c.is_decode()) REQUIRE_FALSE(seen_prefill);  // decodes first
      else seen_prefill = true;
      if (!c.is_decode() && !c.samples) ++res.chunked;
      if (c.start == 0 || !admitted.contains(c.seq->req.id)) {
        // FCFS: every earlier request was admitted before this one.
        for (std::uint64_t id = 0; id < c.seq->req.id; ++id) REQUIRE(admitted.contains(id));
        admitted.insert(c.seq->req.id);
      }
    }
    for (auto cp : plan.copies)
      for (int k = 0; k < bs; ++k) pool[static_cast<std::size_t>(cp.dst * bs + k)] = pool[static_cast<std::size_t>(cp.src * bs + k)];
    // "append_paged_kv_cache": write this step's tokens into their slots through the CSR.
    for (std::size_t i = 0; i < plan.token_ids.size(); ++i) {
      const auto b = plan.batch_indices[i];
      const auto p = plan.positions[i];
      const auto page = plan.csr.indices[static_cast<std::size_t>(plan.csr.indptr[static_cast<std::size_t>(b)] + p / bs)];
      pool[static_cast<std::size_t>(page * bs + p % bs)] = plan.token_ids[i];
    }
    // "attention": each sampling sequence reads its context back from the pool.
    std::vector<token_id> sampled;
    for (std::size_t b = 0; b < plan.chunks.size(); ++b) {
      const auto& c = plan.chunks[b];
      if (!c.samples) continue;
      std::vector<token_id> ctx;
      const auto n = plan.csr.kv_len(static_cast<std::int32_t>(b));
      for (std::int64_t p = 0; p < n; ++p) {
        const auto page = plan.csr.indices[static_cast<std::size_t>(plan.csr.indptr[b] + p / bs)];
        ctx.push_back(pool[static_cast<std::size_t>(page * bs + p % bs)]);
      }
      auto l = fake_logits(ctx);
      sampled.push_back(smp.sample(l, c.seq->req.sampling, c.seq->tokens, static_cast<std::int64_t>(c.seq->tokens.size())));
    }
    for (auto& e : sch.commit(sampled)) res.outputs[e.id].push_back(e.token);
    // Reference counts equal the number of live tables holding each block.
    std::vector<int> holders(static_cast<std::size_t>(num_blocks), 0);
    for (auto& r : reqs)
      if (auto* s = sch.find(r.id))
        for (block_id blk : s->table.blocks()) ++holders[static_cast<std::size_t>(blk)];
    int used = 0;
    for (block_id blk = 0; blk < num_blocks; ++blk) {
      REQUIRE(alloc.ref_count(blk) == holders[static_cast<std::size_t>(blk)]);
      used += holders[static_cast<std::size_t>(blk)] > 0;
    }
    REQUIRE(alloc.num_free() == num_blocks - used);  // finished sequences released theirs
    ++res.steps;
  }
  REQUIRE_FALSE(sch.has_work());
  CHECK(alloc.num_free() == num_blocks);
  res.preemptions = sch.num_preemptions();
  res.hits = alloc.num_hits();
  return res;
}

std::vector<request> workload(int n, bool sample, std::uint64_t seed) {
  loom::counter_rng rng(seed);
  std::uint64_t k = 0;
  auto rnd = [&](int m) { return static_cast<int>(rng.bits(k++) % static_cast<std::uint32_t>(m)); };
  std::vector<token_id> shared;
  for (int i = 0; i < 24; ++i) shared.push_back(rnd(vocab));
  std::vector<request> reqs;
  for (int i = 0; i < n; ++i) {
    request r;
    r.id = static_cast<std::uint64_t>(i);
    if (i % 2) r.prompt = shared;
    for (int j = 0, m = 1 + rnd(60); j < m; ++j) r.prompt.push_back(rnd(vocab));
    r.max_new_tokens = 1 + rnd(40);
    if (sample) {
      r.sampling.temperature = 0.8f;
      r.sampling.top_k = i % 3 == 0 ? 8 : 0;
      r.sampling.top_p = i % 4 == 0 ? 0.9f : 1.f;
      r.sampling.repetition_penalty = i % 5 == 0 ? 1.3f : 1.f;
      r.sampling.seed = 1000 + static_cast<std::uint64_t>(i);
    }
    if (i % 7 == 0) r.stop_tokens = {3, 4};
    reqs.push_back(r);
  }
  return reqs;
}

// The fake model as kv::engine's model: its "key" of a token is the token id, written into the
// engine's pool (one layer, one head of size 1) and read back through the block table.
struct fake_paged_model {
  std::int64_t context = 96;
  std::int64_t vocab() const { return ::vocab; }
  std::int64_t max_context() const { return context; }
  kv_cache_shape kv_shape(std::int32_t num_blocks, std::int32_t block_size) const { return {1, num_blocks, block_size, 1, 1}; }
  void reserve(std::int32_t, std::int32_t) {}
  std::int64_t forward(const step_plan& plan, paged_kv_cache<float>& cache, std::span<float> logits) {
    auto pool = cache.layer(0);  // [num_blocks, 2, block_size, 1, 1]
    const std::int64_t bs = pool.shape()[2];
    const auto slot = [&](std::int32_t b, std::int64_t p) -> float& {
      const auto page = plan.csr.indices[static_cast<std::size_t>(plan.csr.indptr[static_cast<std::size_t>(b)] + p / bs)];
      return pool(page, 0, p % bs, 0, 0);
    };
    for (std::size_t i = 0; i < plan.token_ids.size(); ++i) slot(plan.batch_indices[i], plan.positions[i]) = float(plan.token_ids[i]);
    std::int64_t rows = 0;
    for (std::size_t b = 0; b < plan.chunks.size(); ++b) {
      if (!plan.chunks[b].samples) continue;
      std::vector<token_id> ctx;
      for (std::int64_t p = 0, n = plan.csr.kv_len(static_cast<std::int32_t>(b)); p < n; ++p)
        ctx.push_back(static_cast<token_id>(slot(static_cast<std::int32_t>(b), p)));
      const auto l = fake_logits(ctx);
      std::copy(l.begin(), l.end(), logits.begin() + rows++ * ::vocab);
    }
    return rows;
  }
};
static_assert(paged_model<fake_paged_model, float>);

}  // namespace

TEST_CASE("kv::engine: outputs equal running each request alone, through its pool, with preemption and prefix hits") {
  auto reqs = workload(40, true, 31);
  engine_config cfg;
  cfg.num_blocks = 40;
  cfg.block_size = 4;
  cfg.scheduler.max_num_batched_tokens = 32;
  cfg.scheduler.max_num_seqs = 16;
  cfg.scheduler.max_model_len = 1000;  // capped at the model's context (96)
  engine<fake_paged_model> eng(cfg);
  CHECK(eng.config().scheduler.max_model_len == 96);
  auto out = eng.generate(reqs);
  for (auto& r : reqs) {
    CAPTURE(r.id);
    CHECK(out[r.id] == reference(r, 96));
  }
  CHECK(eng.scheduler().num_preemptions() > 0);
  CHECK(eng.allocator().num_hits() > 0);
  CHECK(eng.allocator().num_free() == cfg.num_blocks);
  request bad;
  bad.id = 99;
  bad.prompt = {1, vocab};
  CHECK_THROWS_WITH_AS(eng.add(bad), doctest::Contains("token id 32 outside the vocabulary of 32"), loom::error);
}

TEST_CASE("scheduler: outputs equal running each request alone (greedy and seeded sampling)") {
  for (bool sample : {false, true}) {
    auto reqs = workload(40, sample, sample ? 11 : 12);
    scheduler_config cfg;
    cfg.max_num_batched_tokens = 32;
    cfg.max_num_seqs = 16;
    cfg.max_model_len = 96;
    // A small pool forces preemptions; prefix caching shares the common 24-token prefix.
    auto res = run(cfg, 40, 4, reqs, 2);
    for (auto& r : reqs) {
      CAPTURE(r.id);
      CHECK(res.outputs[r.id] == reference(r, cfg.max_model_len));
    }
    CHECK(res.preemptions > 0);
    CHECK(res.hits > 0);
    CHECK(res.chunked > 0);
  }
}

TEST_CASE("scheduler: same outputs with a large pool, no chunking, no prefix cache") {
  auto reqs = workload(30, true, 21);
  scheduler_config cfg;
  cfg.max_num_batched_tokens = 128;
  cfg.max_model_len = 96;
  cfg.enable_chunked_prefill = false;
  cfg.enable_prefix_caching = false;
  auto res = run(cfg, 1000, 16, reqs, 1);
  for (auto& r : reqs) CHECK(res.outputs[r.id] == reference(r, cfg.max_model_len));
  CHECK(res.preemptions == 0);
  CHECK(res.hits == 0);
}

TEST_CASE("scheduler: requests that can never run are rejected") {
  block_allocator alloc(4, 4);
  scheduler_config cfg;
  cfg.max_model_len = 64;
  scheduler sch(cfg, alloc);
  request r;
  r.id = 1;
  CHECK_THROWS_AS(sch.add(r), loom::error);  // empty prompt
  r.prompt.assign(64, 1);
  CHECK_THROWS_AS(sch.add(r), loom::error);  // prompt reaches max_model_len
  r.prompt.assign(10, 1);
  r.max_new_tokens = 20;
  CHECK_THROWS_AS(sch.add(r), loom::error);  // 30 tokens need 8 blocks of 4, the pool has 4
  r.max_new_tokens = 4;
  r.sampling.top_p = 2.f;
  CHECK_THROWS_AS(sch.add(r), loom::error);
  r.sampling.top_p = 1.f;
  {
    scheduler_config nc = cfg;
    nc.enable_chunked_prefill = false;
    nc.max_num_batched_tokens = 12;
    block_allocator a2(64, 4);
    scheduler s2(nc, a2);
    CHECK_THROWS_AS(s2.add(r), loom::error);  // 10 + 4 tokens could not be recomputed in one step
  }
  sch.add(r);
  CHECK_THROWS_AS(sch.add(r), loom::error);  // duplicate id
  sch.cancel(1);
  CHECK_FALSE(sch.has_work());
  CHECK(alloc.num_free() == 4);
}

TEST_CASE("scheduler: the prefix cache keeps LoRA adapters apart") {
  // A sequence's keys and values depend on its adapter: equal prompts under different adapters
  // must not share blocks, equal prompts under the same adapter must.
  block_allocator alloc(32, 4);
  scheduler sch(scheduler_config{}, alloc);
  auto run_alone = [&](std::uint64_t id, std::int32_t adapter) {
    request r;
    r.id = id, r.adapter = adapter, r.max_new_tokens = 2;
    for (int i = 0; i < 13; ++i) r.prompt.push_back(1 + i);  // three full blocks, one token left to compute
    sch.add(r);
    std::int64_t cached = -1;
    while (sch.has_work()) {
      const auto& plan = sch.schedule();
      if (cached < 0) cached = sch.find(id)->num_cached_tokens;
      std::vector<token_id> sampled;
      for (const auto& c : plan.chunks)
        if (c.samples) sampled.push_back(3);
      sch.commit(sampled);
    }
    sch.take_finished();
    return cached;
  };
  CHECK(run_alone(1, 0) == 0);
  CHECK(run_alone(2, 1) == 0);   // adapter 1: the base's blocks are not its
  CHECK(run_alone(3, 2) == 0);
  CHECK(run_alone(4, 1) == 12);  // adapter 1 again: its own three blocks
  CHECK(run_alone(5, 0) == 12);  // the base: its own, as without adapters
  CHECK(prefix_root(request{}) == 0);
}
