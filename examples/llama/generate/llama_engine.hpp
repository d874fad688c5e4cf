#pragma once
// llama_engine: LLaMA generation over loom's paged KV cache with continuous batching.
//
// One engine step = one scheduler plan: every scheduled token of every sequence (decode
// tokens and prefill chunks together, ragged) goes through the layers as one [tokens, dim]
// activation; per layer the new keys and values are appended to the paged pool
// (append_paged_kv_cache) and attention runs over it (batch_prefill_with_paged_kv_cache,
// which covers decode rows too). Only the last row of each sequence that reaches its end is
// normalised, projected to logits and sampled. All activation buffers are sized once, for the
// scheduler's token budget: the step loop allocates nothing but the scheduler's small vectors.
//
// The engine is single-threaded; llama-serve drives it from one thread and feeds it requests
// from many.

#include "llama_infer_model.hpp"

#include <loom/kv/block_allocator.hpp>
#include <loom/kv/paged_attention.hpp>
#include <loom/kv/paged_kv_cache.hpp>
#include <loom/kv/sampler.hpp>
#include <loom/kv/scheduler.hpp>

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <vector>

namespace llama {

struct engine_config {
  std::int32_t num_blocks = 256;  ///< KV pool size in blocks (all layers)
  std::int32_t block_size = 16;
  loom::kv::scheduler_config scheduler;  ///< max_model_len is capped at the model's max_seq_len
};

template <loom::kv::kv_element KV = float>
class llama_engine {
 public:
  llama_engine(const llama_weights& w, engine_config cfg)
      : w_(&w),
        cfg_(clamp(cfg, w.config)),
        alloc_(cfg_.num_blocks, cfg_.block_size),
        cache_(loom::kv::kv_cache_shape{w.config.n_layers, cfg_.num_blocks, cfg_.block_size, w.config.n_kv_heads,
                                        w.config.head_dim()}),
        sched_(cfg_.scheduler, alloc_),
        rope_(w.config.max_seq_len, w.config.head_dim(), w.config.rope_theta) {
    const auto& c = w.config;
    const auto T = static_cast<std::size_t>(cfg_.scheduler.max_num_batched_tokens);
    const auto S = static_cast<std::size_t>(cfg_.scheduler.max_num_seqs);
    x_ = loom::buffer<float>(T * c.dim);
    xb_ = loom::buffer<float>(T * c.dim);
    q_ = loom::buffer<float>(T * c.dim);
    k_ = loom::buffer<float>(T * c.kv_dim());
    v_ = loom::buffer<float>(T * c.kv_dim());
    att_ = loom::buffer<float>(T * c.dim);
    h1_ = loom::buffer<float>(T * c.hidden_dim);
    h3_ = loom::buffer<float>(T * c.hidden_dim);
    last_ = loom::buffer<float>(S * c.dim);
    logits_ = loom::buffer<float>(S * c.vocab_size);
    raw_logits_ = loom::buffer<float>(S * c.vocab_size);
  }

  const llama_config& model_config() const noexcept { return w_->config; }
  const engine_config& config() const noexcept { return cfg_; }
  loom::kv::scheduler& scheduler() noexcept { return sched_; }
  loom::kv::block_allocator& allocator() noexcept { return alloc_; }
  std::size_t kv_bytes() const noexcept { return cache_.bytes(); }
  std::int64_t tokens_computed() const noexcept { return tokens_computed_; }
  std::int64_t steps() const noexcept { return steps_; }
  /// Logits [vocab] of the i-th sampled sequence of the last step (before sampling changed them).
  std::span<const float> last_logits(std::size_t i) const {
    LOOM_CHECK(i < sampled_.size(), "llama_engine::last_logits: index ", i, " but the last step sampled ",
               sampled_.size(), " sequences");
    return {raw_logits_.data() + i * static_cast<std::size_t>(w_->config.vocab_size),
            static_cast<std::size_t>(w_->config.vocab_size)};
  }

  /// Queues a request (token ids are checked against the vocabulary).
  void add(loom::kv::request r) {
    for (auto t : r.prompt)
      LOOM_CHECK(t >= 0 && t < w_->config.vocab_size, "llama_engine::add: request ", r.id, " has token id ", t,
                 " outside the vocabulary of ", w_->config.vocab_size);
    sched_.add(std::move(r));
  }
  void cancel(std::uint64_t id) { sched_.cancel(id); }
  bool has_work() const noexcept { return sched_.has_work(); }

  /// Runs one scheduler step; returns the tokens produced.
  const std::vector<loom::kv::token_event>& step() {
    const loom::kv::step_plan& plan = sched_.schedule();
    LOOM_CHECK(!plan.empty() || !sched_.has_work(), "llama_engine::step: the scheduler made no progress with ",
               sched_.num_waiting(), " waiting and ", sched_.num_running(), " running sequences");
    for (auto c : plan.copies) cache_.copy_block(c.src, c.dst);
    sampled_.clear();
    if (plan.num_tokens() > 0) {
      forward(plan);
      const auto V = w_->config.vocab_size;
      std::copy(logits_.begin(), logits_.end(), raw_logits_.begin());
      std::int64_t row = 0;
      for (const auto& c : plan.chunks) {
        if (!c.samples) continue;
        std::span<float> l(logits_.data() + row++ * V, static_cast<std::size_t>(V));
        sampled_.push_back(sampler_.sample(l, c.seq->req.sampling, c.seq->tokens,
                                           static_cast<std::int64_t>(c.seq->tokens.size())));
      }
    }
    ++steps_;
    tokens_computed_ += plan.num_tokens();
    return sched_.commit(sampled_);
  }

  /// Runs the given requests to completion; returns each request's generated tokens.
  std::map<std::uint64_t, std::vector<loom::kv::token_id>> generate(std::vector<loom::kv::request> reqs) {
    for (auto& r : reqs) add(std::move(r));
    std::map<std::uint64_t, std::vector<loom::kv::token_id>> out;
    while (has_work())
      for (const auto& e : step()) out[e.id].push_back(e.token);
    sched_.take_finished();
    return out;
  }

 private:
  static engine_config clamp(engine_config cfg, const llama_config& c) {
    c.validate();
    if (cfg.scheduler.max_model_len > c.max_seq_len) cfg.scheduler.max_model_len = c.max_seq_len;
    if (cfg.scheduler.max_num_seqs > cfg.scheduler.max_num_batched_tokens)
      cfg.scheduler.max_num_seqs = cfg.scheduler.max_num_batched_tokens;
    return cfg;
  }

  void forward(const loom::kv::step_plan& plan) {
    using loom::index_t;
    const llama_config& c = w_->config;
    const std::int64_t T = plan.num_tokens(), D = c.dim, KD = c.kv_dim(), H = c.hidden_dim, hd = c.head_dim();
    float* x = x_.data();
    for (std::int64_t t = 0; t < T; ++t) {
      const float* e = w_->tok_embeddings.data() + static_cast<std::int64_t>(plan.token_ids[static_cast<std::size_t>(t)]) * D;
      std::copy(e, e + D, x + t * D);
    }
    for (std::int32_t l = 0; l < c.n_layers; ++l) {
      const layer_weights& L = w_->layers[static_cast<std::size_t>(l)];
      kernels::rmsnorm(x, L.attn_norm.data(), xb_.data(), T, D, c.norm_eps);
      kernels::matmul(xb_.data(), L.wq.data(), q_.data(), T, D, D);
      kernels::matmul(xb_.data(), L.wk.data(), k_.data(), T, D, KD);
      kernels::matmul(xb_.data(), L.wv.data(), v_.data(), T, D, KD);
      for (std::int64_t t = 0; t < T; ++t) {
        const std::int64_t p = plan.positions[static_cast<std::size_t>(t)];
        rope_.apply(q_.data() + t * D, c.n_heads, p, c.rope_interleaved);
        rope_.apply(k_.data() + t * KD, c.n_kv_heads, p, c.rope_interleaved);
      }
      auto layer = cache_.layer(l);
      loom::kv::append_paged_kv_cache(loom::host{}, loom::make_view<loom::host>(static_cast<const float*>(k_.data()), T, c.n_kv_heads, hd),
                                      loom::make_view<loom::host>(static_cast<const float*>(v_.data()), T, c.n_kv_heads, hd),
                                      plan.batch_indices, plan.positions, layer, plan.csr);
      loom::kv::batch_prefill_with_paged_kv_cache(
          loom::host{}, loom::make_view<loom::host>(static_cast<const float*>(q_.data()), T, c.n_heads, hd), plan.qo_indptr,
          layer, plan.csr, loom::make_view<loom::host>(att_.data(), T, c.n_heads, hd));
      kernels::matmul(att_.data(), L.wo.data(), xb_.data(), T, D, D);
      for (std::int64_t i = 0; i < T * D; ++i) x[i] += xb_[static_cast<std::size_t>(i)];
      kernels::rmsnorm(x, L.ffn_norm.data(), xb_.data(), T, D, c.norm_eps);
      kernels::matmul(xb_.data(), L.w1.data(), h1_.data(), T, D, H);
      kernels::matmul(xb_.data(), L.w3.data(), h3_.data(), T, D, H);
      kernels::swiglu(h1_.data(), h3_.data(), T * H);
      kernels::matmul(h1_.data(), L.w2.data(), xb_.data(), T, H, D);
      for (std::int64_t i = 0; i < T * D; ++i) x[i] += xb_[static_cast<std::size_t>(i)];
    }
    // Logits only for the rows that are sampled: the last row of each finishing chunk.
    std::int64_t rows = 0;
    for (std::size_t b = 0; b < plan.chunks.size(); ++b)
      if (plan.chunks[b].samples) {
        const std::int64_t r = plan.qo_indptr[b + 1] - 1;
        std::copy(x + r * D, x + (r + 1) * D, last_.data() + rows++ * D);
      }
    kernels::rmsnorm(last_.data(), w_->norm.data(), last_.data(), rows, D, c.norm_eps);
    kernels::matmul(last_.data(), w_->classifier(), logits_.data(), rows, D, c.vocab_size);
  }

  const llama_weights* w_;
  engine_config cfg_;
  loom::kv::block_allocator alloc_;
  loom::kv::paged_kv_cache<KV> cache_;
  loom::kv::scheduler sched_;
  kernels::rope_table rope_;
  loom::kv::sampler sampler_;
  // Activations for up to max_num_batched_tokens tokens:
  loom::buffer<float> x_, xb_, q_, att_;  // [tokens, dim]
  loom::buffer<float> k_, v_;             // [tokens, kv_dim]
  loom::buffer<float> h1_, h3_;           // [tokens, hidden_dim]
  loom::buffer<float> last_;              // [seqs, dim]
  loom::buffer<float> logits_;            // [seqs, vocab]
  loom::buffer<float> raw_logits_;        // [seqs, vocab] before penalties and temperature
  std::vector<loom::kv::token_id> sampled_;
  std::int64_t tokens_computed_ = 0, steps_ = 0;
};

}  // namespace llama
