#pragma once
// Continuous-batching scheduler (vLLM's): which tokens of which sequences the model computes
// in the next step, and in which KV blocks they go.
//
// Policy, per step, under a token budget (max_num_batched_tokens) and a sequence cap:
//  1. running sequences in decode (one token each) first: decode latency is what users see;
//  2. running sequences still in prefill continue with a chunk of their prompt;
//  3. waiting requests are admitted first-come-first-served (a later request never overtakes
//     an earlier one), each with a chunk that fits the budget (chunked prefill), after
//     reusing any full blocks of their prompt found in the prefix cache.
// When a running sequence needs a block and none is free, the most recently admitted running
// sequence that has not been scheduled this step is preempted by recompute: its blocks are
// released and it goes back to the head of the waiting queue with prompt + generated tokens
// as its new prompt. Since the model is deterministic and the sampler draws by (seed,
// position), it later produces exactly what it would have. Finished sequences release their
// blocks in commit(), at once.
//
// Plan, then run: schedule() returns a step_plan with everything a model step needs as flat
// arrays (token ids, positions, batch indices, qo_indptr, the paged-KV CSR, copy-on-write
// copies). The model runs it and commit() takes one sampled token per sequence whose chunk
// reached the end of its tokens.

#include <loom/core/error.hpp>
#include <loom/kv/block_allocator.hpp>
#include <loom/kv/block_table.hpp>
#include <loom/kv/sampler.hpp>

#include <algorithm>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace loom::kv {

struct scheduler_config {
  std::int32_t max_num_batched_tokens = 512;  ///< token budget of one step
  std::int32_t max_num_seqs = 256;            ///< sequences in one step
  std::int32_t max_model_len = 2048;          ///< prompt + output tokens of one sequence
  bool enable_chunked_prefill = true;         ///< split prompts over steps; else a prompt must fit one step
  bool enable_prefix_caching = true;
  std::int32_t watermark_blocks = 0;          ///< blocks kept free when admitting (less thrashing)

  void validate() const {
    LOOM_CHECK(max_num_batched_tokens > 0, "scheduler_config: max_num_batched_tokens must be > 0, got ",
               max_num_batched_tokens);
    LOOM_CHECK(max_num_seqs > 0, "scheduler_config: max_num_seqs must be > 0, got ", max_num_seqs);
    LOOM_CHECK(max_model_len > 1, "scheduler_config: max_model_len must be > 1, got ", max_model_len);
    LOOM_CHECK(watermark_blocks >= 0, "scheduler_config: watermark_blocks must be >= 0, got ", watermark_blocks);
  }
};

struct request {
  std::uint64_t id = 0;
  std::vector<token_id> prompt;
  std::int32_t max_new_tokens = 16;
  sampling_params sampling;
  std::vector<token_id> stop_tokens;  ///< generation ends after any of these (it is kept in the output)
  /// The LoRA adapter the sequence runs with (0: the base model). Its keys and values differ
  /// from the base's for the same tokens, so the prefix cache keeps adapters apart.
  std::int32_t adapter = 0;
};

/// The parent hash of a sequence's first prefix-cache block: 0 for the base model, else one
/// that depends on the adapter, so that equal tokens under different adapters never share
/// blocks (the allocator compares the stored parent on lookup, so this holds even when hashes
/// collide).
inline std::uint64_t prefix_root(const request& r) noexcept {
  return r.adapter == 0 ? 0 : block_hash(0x4C6F5241ull, std::span<const token_id>(&r.adapter, 1));
}

enum class finish_reason { none, length, stop, aborted };

inline const char* to_string(finish_reason r) noexcept {
  switch (r) {
    case finish_reason::none: return "none";
    case finish_reason::length: return "length";
    case finish_reason::stop: return "stop";
    case finish_reason::aborted: return "aborted";
  }
  return "?";
}

struct sequence {
  request req;
  std::vector<token_id> tokens;  ///< prompt then generated tokens
  std::int64_t prompt_len = 0;
  std::int64_t num_computed = 0;  ///< tokens whose keys and values are in the cache
  block_table table;
  std::uint64_t last_hash = 0;    ///< prefix hash of the last registered full block
  std::int32_t registered = 0;    ///< full blocks registered in (or taken from) the prefix cache
  std::int32_t num_preemptions = 0;
  std::int64_t num_cached_tokens = 0;  ///< prompt tokens served by the prefix cache at the last admission
  finish_reason finished = finish_reason::none;
  std::int64_t admitted_order = 0;

  std::int64_t num_output() const noexcept { return static_cast<std::int64_t>(tokens.size()) - prompt_len; }
  std::span<const token_id> output() const noexcept {
    return {tokens.data() + prompt_len, tokens.size() - static_cast<std::size_t>(prompt_len)};
  }
};

/// Tokens [start, start + len) of `seq` are computed this step; if `samples`, the step ends at
/// the sequence's last token and the logits of that row give its next token. A model reads
/// only the chunk's own fields (start, len, samples, adapter), never `seq`: that is the
/// scheduler's and the sampler's, and a plan received from another rank has none
/// (plan_broadcast.hpp).
struct scheduled_chunk {
  sequence* seq = nullptr;
  std::int64_t start = 0;
  std::int32_t len = 0;
  bool samples = false;
  std::int32_t adapter = 0;  ///< the request's LoRA adapter (0: the base)
  bool is_decode() const noexcept { return len == 1 && start >= seq->prompt_len; }
};

struct step_plan {
  std::vector<scheduled_chunk> chunks;      // decodes first, then prefill chunks
  std::vector<block_copy> copies;           // make these block copies before the step
  std::vector<token_id> token_ids;          // [num_tokens]
  std::vector<std::int64_t> positions;      // [num_tokens]
  std::vector<std::int32_t> batch_indices;  // [num_tokens] chunk of each token
  std::vector<std::int32_t> qo_indptr;      // [chunks + 1]
  paged_kv_csr csr;                         // kv after this step's tokens are appended
  std::vector<std::uint64_t> preempted;     // request ids preempted while planning
  std::int32_t num_decode = 0;

  std::int32_t num_tokens() const noexcept { return static_cast<std::int32_t>(token_ids.size()); }
  bool empty() const noexcept { return chunks.empty(); }
};

/// A token produced by commit(); `finished` tells whether the sequence ended with it.
struct token_event {
  std::uint64_t id = 0;
  token_id token = 0;
  finish_reason finished = finish_reason::none;
};

class scheduler {
 public:
  scheduler(const scheduler_config& cfg, block_allocator& alloc) : cfg_((cfg.validate(), cfg)), alloc_(&alloc) {}

  const scheduler_config& config() const noexcept { return cfg_; }
  block_allocator& allocator() noexcept { return *alloc_; }

  /// Queues a request (checked now: a request that can never run is an error, not a hang).
  void add(request r) {
    LOOM_CHECK(!r.prompt.empty(), "scheduler::add: request ", r.id, " has an empty prompt");
    LOOM_CHECK(r.max_new_tokens > 0, "scheduler::add: request ", r.id, " has max_new_tokens=", r.max_new_tokens);
    LOOM_CHECK(static_cast<std::int64_t>(r.prompt.size()) < cfg_.max_model_len, "scheduler::add: request ", r.id,
               " has a prompt of ", r.prompt.size(), " tokens, not below max_model_len=", cfg_.max_model_len);
    const std::int64_t longest =
        std::min<std::int64_t>(static_cast<std::int64_t>(r.prompt.size()) + r.max_new_tokens, cfg_.max_model_len);
    // Without chunking, a preempted request recomputes prompt + output in one step: that must fit.
    LOOM_CHECK(cfg_.enable_chunked_prefill || longest <= cfg_.max_num_batched_tokens, "scheduler::add: request ",
               r.id, " may reach ", longest, " tokens, above max_num_batched_tokens=", cfg_.max_num_batched_tokens,
               " (without chunked prefill a recompute after preemption must fit one step)");
    LOOM_CHECK(block_table::blocks_for(longest, alloc_->block_size()) <= alloc_->num_blocks(),
               "scheduler::add: request ", r.id, " may need ", longest, " tokens of KV, more than the pool's ",
               alloc_->num_blocks(), " blocks of ", alloc_->block_size());
    LOOM_CHECK(!seqs_.contains(r.id), "scheduler::add: request id ", r.id, " is already in use");
    r.sampling.validate();
    for (token_id t : r.prompt) LOOM_CHECK(t >= 0, "scheduler::add: request ", r.id, " has negative token id ", t);
    auto s = std::make_unique<sequence>();
    s->tokens = r.prompt;
    s->prompt_len = static_cast<std::int64_t>(r.prompt.size());
    s->req = std::move(r);
    waiting_.push_back(s.get());
    seqs_.emplace(s->req.id, std::move(s));
  }

  /// Ends a request now (e.g. the client went away); its blocks are released.
  void cancel(std::uint64_t id) {
    auto it = seqs_.find(id);
    if (it == seqs_.end()) return;
    sequence* s = it->second.get();
    std::erase(waiting_, s);
    std::erase(running_, s);
    s->table.release(*alloc_);
    s->finished = finish_reason::aborted;
    seqs_.erase(it);
  }

  bool has_work() const noexcept { return !waiting_.empty() || !running_.empty(); }
  std::size_t num_waiting() const noexcept { return waiting_.size(); }
  std::size_t num_running() const noexcept { return running_.size(); }
  std::int64_t num_preemptions() const noexcept { return preemptions_; }
  /// Tokens whose keys and values the running sequences hold in the cache (shared prefix
  /// blocks are counted once per sequence).
  std::int64_t kv_tokens_in_use() const noexcept {
    std::int64_t n = 0;
    for (const sequence* s : running_) n += s->num_computed;
    return n;
  }
  const sequence* find(std::uint64_t id) const {
    auto it = seqs_.find(id);
    return it == seqs_.end() ? nullptr : it->second.get();
  }

  /// Plans the next step.
  const step_plan& schedule() {
    plan_.chunks.clear();
    plan_.copies.clear();
    plan_.preempted.clear();
    std::int32_t budget = cfg_.max_num_batched_tokens;
    std::vector<sequence*>& order = scratch_;
    order.clear();
    // 1 + 2: running sequences, decodes first, each keeping its admission order.
    for (sequence* s : running_)
      if (s->num_computed >= s->prompt_len) order.push_back(s);
    for (sequence* s : running_)
      if (s->num_computed < s->prompt_len) order.push_back(s);
    scheduled_.clear();
    for (sequence* s : order) {
      if (s->finished != finish_reason::none || is_preempted(s)) continue;
      if (budget == 0 || static_cast<std::int32_t>(plan_.chunks.size()) >= cfg_.max_num_seqs) break;
      const std::int32_t len = chunk_len(*s, budget);
      if (len == 0) continue;
      if (!reserve_with_preemption(*s, len)) continue;  // s itself was preempted
      push_chunk(*s, len);
      budget -= len;
    }
    // 3: admission, first come first served.
    while (!waiting_.empty() && budget > 0 && static_cast<std::int32_t>(plan_.chunks.size()) < cfg_.max_num_seqs) {
      sequence* s = waiting_.front();
      if (s->num_computed == 0 && s->table.empty()) use_prefix_cache(*s);
      const std::int32_t len = chunk_len(*s, budget);
      if (len == 0) break;
      const std::int32_t need = block_table::blocks_for(s->num_computed + len, alloc_->block_size()) - s->table.num_blocks();
      const bool idle = running_.empty() && plan_.chunks.empty();
      if ((!idle && alloc_->num_free() - need < cfg_.watermark_blocks) ||
          !s->table.prepare_write(*alloc_, s->num_computed, s->num_computed + len, plan_.copies)) {
        // Give back the prefix hits taken for it: a waiting sequence holds no blocks.
        s->table.release(*alloc_);
        s->num_computed = 0, s->registered = 0, s->last_hash = 0;
        if (idle)
          LOOM_THROW("scheduler: request ", s->req.id, " cannot be admitted into an idle pool of ", alloc_->num_free(),
                     " free blocks");
        break;  // FCFS: nobody overtakes the head of the queue
      }
      waiting_.pop_front();
      s->admitted_order = next_order_++;
      running_.push_back(s);
      push_chunk(*s, len);
      budget -= len;
    }
    build_arrays();
    return plan_;
  }

  /// Applies a finished step: `sampled` holds one token per chunk with `samples` set, in plan
  /// order. Returns the produced tokens; finished sequences have released their blocks.
  const std::vector<token_event>& commit(std::span<const token_id> sampled) {
    events_.clear();
    std::size_t k = 0;
    for (const scheduled_chunk& c : plan_.chunks) {
      sequence& s = *c.seq;
      s.num_computed = c.start + c.len;
      register_full_blocks(s);
      if (!c.samples) continue;
      LOOM_CHECK(k < sampled.size(), "scheduler::commit: got ", sampled.size(), " sampled tokens, the plan needs more");
      const token_id t = sampled[k++];
      s.tokens.push_back(t);
      if (std::find(s.req.stop_tokens.begin(), s.req.stop_tokens.end(), t) != s.req.stop_tokens.end())
        s.finished = finish_reason::stop;
      else if (s.num_output() >= s.req.max_new_tokens || static_cast<std::int64_t>(s.tokens.size()) >= cfg_.max_model_len)
        s.finished = finish_reason::length;
      events_.push_back({s.req.id, t, s.finished});
    }
    LOOM_CHECK(k == sampled.size(), "scheduler::commit: got ", sampled.size(), " sampled tokens, the plan needs ", k);
    for (const scheduled_chunk& c : plan_.chunks) {
      sequence* s = c.seq;
      if (s->finished == finish_reason::none) continue;
      s->table.release(*alloc_);  // at once: the next step can use the blocks
      std::erase(running_, s);
      finished_.push_back(std::move(seqs_.at(s->req.id)));
      seqs_.erase(s->req.id);
    }
    plan_.chunks.clear();
    return events_;
  }

  /// Sequences finished since the last call (they own their tokens).
  std::vector<std::unique_ptr<sequence>> take_finished() { return std::exchange(finished_, {}); }

 private:
  std::int32_t chunk_len(const sequence& s, std::int32_t budget) const {
    const std::int64_t remaining = static_cast<std::int64_t>(s.tokens.size()) - s.num_computed;
    if (remaining <= budget) return static_cast<std::int32_t>(remaining);
    return cfg_.enable_chunked_prefill ? budget : 0;
  }

  bool is_preempted(const sequence* s) const {
    return std::find(running_.begin(), running_.end(), s) == running_.end();
  }

  // Blocks for `len` more tokens of running sequence s, preempting later sequences if needed.
  bool reserve_with_preemption(sequence& s, std::int32_t len) {
    while (!s.table.prepare_write(*alloc_, s.num_computed, s.num_computed + len, plan_.copies)) {
      sequence* victim = nullptr;
      for (auto it = running_.rbegin(); it != running_.rend(); ++it)
        if (*it != &s && std::find(scheduled_.begin(), scheduled_.end(), *it) == scheduled_.end()) {
          victim = *it;
          break;
        }
      preempt(victim ? *victim : s);
      if (!victim) return false;
    }
    return true;
  }

  void preempt(sequence& s) {
    s.table.release(*alloc_);
    s.num_computed = 0;
    s.registered = 0;
    s.last_hash = 0;
    ++s.num_preemptions;
    ++preemptions_;
    std::erase(running_, &s);
    waiting_.push_front(&s);
    plan_.preempted.push_back(s.req.id);
  }

  // Takes the full blocks of s's tokens found in the prefix cache (at least one token is
  // always left to compute, so that the step yields logits).
  void use_prefix_cache(sequence& s) {
    s.num_cached_tokens = 0;
    if (!cfg_.enable_prefix_caching) return;
    s.last_hash = prefix_root(s.req);
    const std::int32_t bs = alloc_->block_size();
    const std::int64_t max_blocks = (static_cast<std::int64_t>(s.tokens.size()) - 1) / bs;
    while (s.registered < max_blocks) {
      std::span<const token_id> blk(s.tokens.data() + static_cast<std::size_t>(s.registered) * bs, static_cast<std::size_t>(bs));
      auto hit = alloc_->lookup(s.last_hash, blk);
      if (!hit) break;
      s.table.push_shared(*hit);
      s.last_hash = block_hash(s.last_hash, blk);
      ++s.registered;
    }
    s.num_computed = static_cast<std::int64_t>(s.registered) * bs;
    s.num_cached_tokens = s.num_computed;
  }

  void register_full_blocks(sequence& s) {
    if (!cfg_.enable_prefix_caching) return;
    const std::int32_t bs = alloc_->block_size();
    const auto full = static_cast<std::int32_t>(s.num_computed / bs);
    if (s.registered == 0) s.last_hash = prefix_root(s.req);
    for (; s.registered < full; ++s.registered) {
      std::span<const token_id> blk(s.tokens.data() + static_cast<std::size_t>(s.registered) * bs, static_cast<std::size_t>(bs));
      s.last_hash = alloc_->register_full(s.table.blocks()[static_cast<std::size_t>(s.registered)], s.last_hash, blk);
    }
  }

  void push_chunk(sequence& s, std::int32_t len) {
    const bool samples = s.num_computed + len == static_cast<std::int64_t>(s.tokens.size());
    plan_.chunks.push_back({&s, s.num_computed, len, samples, s.req.adapter});
    scheduled_.push_back(&s);
  }

  void build_arrays() {
    // A sequence preempted after its chunk was planned cannot happen (victims are unscheduled).
    plan_.token_ids.clear();
    plan_.positions.clear();
    plan_.batch_indices.clear();
    plan_.qo_indptr.assign(1, 0);
    plan_.csr.block_size = alloc_->block_size();
    plan_.csr.clear();
    plan_.num_decode = 0;
    for (std::size_t b = 0; b < plan_.chunks.size(); ++b) {
      const scheduled_chunk& c = plan_.chunks[b];
      plan_.num_decode += c.is_decode();
      for (std::int64_t p = c.start; p < c.start + c.len; ++p) {
        plan_.token_ids.push_back(c.seq->tokens[static_cast<std::size_t>(p)]);
        plan_.positions.push_back(p);
        plan_.batch_indices.push_back(static_cast<std::int32_t>(b));
      }
      plan_.qo_indptr.push_back(plan_.num_tokens());
      plan_.csr.push(c.seq->table, c.start + c.len);
    }
  }

  scheduler_config cfg_;
  block_allocator* alloc_;
  std::map<std::uint64_t, std::unique_ptr<sequence>> seqs_;
  std::deque<sequence*> waiting_;
  std::vector<sequence*> running_;  // admission order
  std::vector<sequence*> scratch_, scheduled_;
  std::vector<std::unique_ptr<sequence>> finished_;
  std::vector<token_event> events_;
  step_plan plan_;
  std::int64_t preemptions_ = 0, next_order_ = 0;
};

}  // namespace loom::kv
