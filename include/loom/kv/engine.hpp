#pragma once
// kv::engine: continuous-batching generation over a paged KV cache, for any model that can
// run a scheduler's plan (paged_model below).
//
// One step = one scheduler plan: copy-on-write block copies, then the model runs every
// scheduled token of every sequence (decode tokens and prefill chunks together, ragged) with
// the cache and gives the logits of the rows that are sampled (the last row of each chunk
// that reaches its sequence's end); each is sampled with its request's parameters, and the
// scheduler commits the tokens. Why apart from any model: the pool, the scheduler, the
// sampler and this loop are the same for every decoder; a model only says how its layers
// run a plan (examples/llama/generate/llama_engine.hpp is one). The engine is
// single-threaded; a server drives it from one thread (loom/serve/http_server.hpp).
//
// A model split over ranks (tensor parallel: each rank holds a slice of the weights and its
// key/value heads of the pool; pipeline stages: each holds its layers and their blocks of the
// pool) says so with group(), the communicator over all its ranks. Every
// rank then builds the same engine (the same pool, so block ids mean the same everywhere);
// rank 0 of the group takes the requests, schedules, samples and broadcasts each step's
// plan (plan_broadcast.hpp) before running it, and the other ranks call follow(), which runs
// the plans it receives until rank 0 calls stop_followers(). Sampling needs the full logit
// rows on rank 0 only; the model must put them there (a tensor group gives them to every
// rank, a pipeline sends them from its last stage).
//
// A failed step of a group (a collective that threw: a peer failed, or timed out) leaves the
// ranks in unknown states, so the engine is broken() afterwards and refuses further steps; a
// server then ends rather than answering every later request with the same error. A leader
// that is idle for long calls keep_alive() (a server's engine loop does), so that its
// followers, waiting for the next plan under the communicator's timeout, do not give up.

#include <loom/comm/timeout.hpp>
#include <loom/core/buffer.hpp>
#include <loom/core/error.hpp>
#include <loom/kv/block_allocator.hpp>
#include <loom/kv/paged_kv_cache.hpp>
#include <loom/kv/plan_broadcast.hpp>
#include <loom/kv/sampler.hpp>
#include <loom/kv/scheduler.hpp>

#include <algorithm>
#include <chrono>
#include <concepts>
#include <cstdint>
#include <map>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

namespace loom::kv {

struct engine_config {
  std::int32_t num_blocks = 256;  ///< KV pool size in blocks (all layers)
  std::int32_t block_size = 16;
  scheduler_config scheduler;  ///< max_model_len is capped at the model's context
  /// A model split into pipeline stages runs each step's sequences as this many
  /// micro-batches (0: one per stage); the model reads it, the engine does not.
  std::int32_t micro_batches = 0;
};

/// What the engine runs.
/// Requires: vocab() (the length of a logit row); max_context() (the longest sequence it runs);
/// kv_shape(num_blocks, block_size) (the pool it attends over); reserve(tokens, seqs) (sizes
/// its buffers once for a plan of that many tokens and sampled rows); forward(plan, cache,
/// logits) (runs the plan's tokens, appending their keys and values to `cache`, and writes the
/// logits of the plan's sampled rows, in chunk order, to `logits` [rows, vocab]; returns rows).
template <class M, class KV>
concept paged_model = requires(M& m, const M& cm, const step_plan& plan, paged_kv_cache<KV>& cache, std::span<float> logits,
                               std::int32_t n) {
  { cm.vocab() } -> std::convertible_to<std::int64_t>;
  { cm.max_context() } -> std::convertible_to<std::int64_t>;
  { cm.kv_shape(n, n) } -> std::same_as<kv_cache_shape>;
  m.reserve(n, n);
  { m.forward(plan, cache, logits) } -> std::convertible_to<std::int64_t>;
};

/// A paged_model whose ranks run every step together.
/// Requires: group() (the communicator over the model's ranks; rank 0 leads).
template <class M>
concept grouped_model = requires(M& m) { requires comm::communicator<std::remove_cvref_t<decltype(m.group())>>; };

template <class Model, kv_element KV = float>
  requires paged_model<Model, KV>
class engine {
 public:
  /// The model is built in place from `model_args`; `cfg`'s context is capped at the model's.
  template <class... ModelArgs>
  explicit engine(engine_config cfg, ModelArgs&&... model_args)
      : model_(std::forward<ModelArgs>(model_args)...),
        cfg_(clamp(cfg, model_.max_context())),
        alloc_(cfg_.num_blocks, cfg_.block_size),
        cache_(model_.kv_shape(cfg_.num_blocks, cfg_.block_size)),
        sched_(cfg_.scheduler, alloc_) {
    model_.reserve(cfg_.scheduler.max_num_batched_tokens, cfg_.scheduler.max_num_seqs);
    const auto S = static_cast<std::size_t>(cfg_.scheduler.max_num_seqs), V = static_cast<std::size_t>(model_.vocab());
    logits_ = buffer<float>(S * V);
    raw_logits_ = buffer<float>(S * V);
  }
  engine(const engine&) = delete;  // the scheduler holds the allocator
  engine& operator=(const engine&) = delete;

  const Model& model() const noexcept { return model_; }
  const engine_config& config() const noexcept { return cfg_; }
  kv::scheduler& scheduler() noexcept { return sched_; }
  block_allocator& allocator() noexcept { return alloc_; }
  std::size_t kv_bytes() const noexcept { return cache_.bytes(); }
  /// Bytes of the step buffers sized once for the token budget: the engine's logit rows and
  /// the model's activations (its workspace_bytes(), when it says).
  std::size_t workspace_bytes() const {
    std::size_t n = logits_.bytes() + raw_logits_.bytes();
    if constexpr (requires { model_.workspace_bytes(); }) n += model_.workspace_bytes();
    return n;
  }
  /// Whether a step of a group failed (the ranks' states are then unknown): no more steps.
  bool broken() const noexcept { return broken_; }
  std::int64_t tokens_computed() const noexcept { return tokens_computed_; }
  std::int64_t steps() const noexcept { return steps_; }
  /// Logits [vocab] of the i-th sampled sequence of the last step (before sampling changed them).
  std::span<const float> last_logits(std::size_t i) const {
    LOOM_CHECK(i < sampled_.size(), "kv::engine::last_logits: index ", i, " but the last step sampled ", sampled_.size(),
               " sequences");
    const auto V = static_cast<std::size_t>(model_.vocab());
    return {raw_logits_.data() + i * V, V};
  }

  /// Queues a request (token ids are checked against the vocabulary, its adapter against the
  /// model's: num_adapters() of a model that serves LoRA adapters, none otherwise).
  void add(request r) {
    check_leader("add");
    std::int32_t adapters = 0;
    if constexpr (requires { model_.num_adapters(); }) adapters = static_cast<std::int32_t>(model_.num_adapters());
    LOOM_CHECK(r.adapter >= 0 && r.adapter <= adapters, "kv::engine::add: request ", r.id, " has adapter=", r.adapter,
               ", the model serves adapters 1..", adapters, " (0: the base)");
    for (auto t : r.prompt)
      LOOM_CHECK(t >= 0 && t < model_.vocab(), "kv::engine::add: request ", r.id, " has token id ", t,
                 " outside the vocabulary of ", model_.vocab());
    sched_.add(std::move(r));
  }
  void cancel(std::uint64_t id) { sched_.cancel(id); }
  bool has_work() const noexcept { return sched_.has_work(); }

  /// Whether this rank schedules and samples: rank 0 of a grouped model's ranks (a model on
  /// one rank always). The other ranks follow().
  bool leader() {
    if constexpr (grouped_model<Model>) return model_.group().rank() == 0;
    return true;
  }

  /// `cfg` as the engine uses it for a model of `context` tokens: max_model_len capped at the
  /// context, max_num_seqs at the token budget (a memory plan sizes the buffers the same way).
  static engine_config clamp(engine_config cfg, std::int64_t context) {
    if (cfg.scheduler.max_model_len > context) cfg.scheduler.max_model_len = static_cast<std::int32_t>(context);
    if (cfg.scheduler.max_num_seqs > cfg.scheduler.max_num_batched_tokens)
      cfg.scheduler.max_num_seqs = cfg.scheduler.max_num_batched_tokens;
    return cfg;
  }

  /// Runs one scheduler step; returns the tokens produced. The leader only.
  const std::vector<token_event>& step() {
    check_leader("step");
    const step_plan& plan = sched_.schedule();
    LOOM_CHECK(!plan.empty() || !sched_.has_work(), "kv::engine::step: the scheduler made no progress with ",
               sched_.num_waiting(), " waiting and ", sched_.num_running(), " running sequences");
    const std::int64_t rows = grouped([&] {
      if constexpr (grouped_model<Model>)
        if (model_.group().size() > 1) broadcast_plan(model_.group(), plan, wire_), last_sent_ = clock::now();
      return run(plan);
    });
    const std::int64_t V = model_.vocab();
    sampled_.clear();
    std::copy_n(logits_.data(), rows * V, raw_logits_.data());
    std::int64_t row = 0;
    for (const auto& c : plan.chunks) {
      if (!c.samples) continue;
      std::span<float> l(logits_.data() + row++ * V, static_cast<std::size_t>(V));
      sampled_.push_back(sampler_.sample(l, c.seq->req.sampling, c.seq->tokens, static_cast<std::int64_t>(c.seq->tokens.size())));
    }
    return sched_.commit(sampled_);
  }

  /// Ranks other than the leader: runs the leader's plans, one per step() there, until the
  /// leader calls stop_followers().
  void follow()
    requires grouped_model<Model>
  {
    LOOM_CHECK(!leader(), "kv::engine::follow: rank 0 of the model's group leads (it calls step()); only the others follow");
    while (receive_plan(model_.group(), received_, wire_)) run(received_);
  }
  /// The leader: the followers' follow() returns (after the last step, before the group ends).
  void stop_followers()
    requires grouped_model<Model>
  {
    check_leader("stop_followers");
    if (model_.group().size() > 1 && !broken_) broadcast_stop(model_.group());
  }
  /// The leader, while it has no step to run: tells the followers it is alive when a quarter
  /// of the communicator's timeout has passed since the last message (nothing when the
  /// timeout is off, or the group is one rank).
  void keep_alive()
    requires grouped_model<Model>
  {
    check_leader("keep_alive");
    const auto limit = comm::timeout();
    if (model_.group().size() == 1 || limit.count() == 0 || clock::now() - last_sent_ < limit / 4) return;
    grouped([&] { return broadcast_idle(model_.group()), 0; });
    last_sent_ = clock::now();
  }

  /// Runs the given requests to completion; returns each request's generated tokens.
  std::map<std::uint64_t, std::vector<token_id>> generate(std::vector<request> reqs) {
    for (auto& r : reqs) add(std::move(r));
    std::map<std::uint64_t, std::vector<token_id>> out;
    while (has_work())
      for (const auto& e : step()) out[e.id].push_back(e.token);
    sched_.take_finished();
    return out;
  }

 private:
  // The plan's block copies, then its tokens through the model; returns the sampled rows.
  std::int64_t run(const step_plan& plan) {
    for (auto c : plan.copies) cache_.copy_block(c.src, c.dst);
    ++steps_;
    tokens_computed_ += plan.num_tokens();
    return plan.num_tokens() > 0 ? model_.forward(plan, cache_, logits_.span()) : 0;
  }
  // f(): a step, with its collectives when the model spans ranks; a failure there marks the
  // engine broken (one rank's failed step only fails the step: its requests are cancelled).
  template <class F>
  auto grouped(F f) {
    LOOM_CHECK(!broken_, "kv::engine: a step of the model's group failed earlier; the ranks' caches are in unknown states");
    try {
      return f();
    } catch (...) {
      if constexpr (grouped_model<Model>) broken_ = model_.group().size() > 1;
      throw;
    }
  }
  void check_leader(const char* what) {
    LOOM_CHECK(leader(), "kv::engine::", what, ": this rank follows rank 0's plans (follow()); requests and steps go to rank 0");
  }

  Model model_;
  engine_config cfg_;
  block_allocator alloc_;
  paged_kv_cache<KV> cache_;
  kv::scheduler sched_;
  sampler sampler_;
  buffer<float> logits_;      // [seqs, vocab]
  buffer<float> raw_logits_;  // [seqs, vocab] before penalties and temperature
  std::vector<token_id> sampled_;
  std::int64_t tokens_computed_ = 0, steps_ = 0;
  using clock = std::chrono::steady_clock;
  clock::time_point last_sent_ = clock::now();  // the leader's last message to its followers
  bool broken_ = false;
  std::vector<std::uint8_t> wire_;  // a grouped model's plan as bytes
  step_plan received_;              // followers: the leader's plan of this step
};

}  // namespace loom::kv
