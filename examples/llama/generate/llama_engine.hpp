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
// Kernels: the training model's host kernels (ops::rmsnorm_forward, ops::rope_forward with
// per-token positions, ops::swiglu_forward, ops::add, ops::embedding_forward) and its GEMM
// kernel, with every weight packed once when the engine is made (ops::packed_weight): the
// same bits as the training GEMMs, no per-step copy of the weights, and each row's result the
// same whatever the batch it is computed in (loom's sgemm kernels; on the BLAS path of CPUs
// without AVX2 only within rounding), so paged, batched and one-token runs agree bit for bit.
//
// The engine is single-threaded; llama-serve drives it from one thread and feeds it requests
// from many.

#include "llama_infer_model.hpp"

#include <loom/kv/block_allocator.hpp>
#include <loom/ops/host/activation.hpp>
#include <loom/ops/host/embedding.hpp>
#include <loom/ops/host/fill.hpp>
#include <loom/ops/host/norm.hpp>
#include <loom/ops/host/packed_weight.hpp>
#include <loom/ops/host/rope.hpp>
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
    auto pack = [](const loom::buffer<float>& m, std::int64_t rows, std::int64_t cols) {
      return loom::ops::packed_weight(loom::make_view(m.data(), rows, cols));
    };
    for (const layer_weights& L : w.layers)
      packed_.push_back({pack(L.wq, c.dim, c.dim), pack(L.wk, c.kv_dim(), c.dim), pack(L.wv, c.kv_dim(), c.dim),
                         pack(L.wo, c.dim, c.dim), pack(L.w1, c.hidden_dim, c.dim), pack(L.w2, c.dim, c.hidden_dim),
                         pack(L.w3, c.hidden_dim, c.dim)});
    classifier_ = loom::ops::packed_weight(loom::make_view(w.classifier(), c.vocab_size, c.dim));
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
    hs_ = loom::buffer<float>(T * c.hidden_dim);
    rstd_ = loom::buffer<float>(T);
    last_ = loom::buffer<float>(S * c.dim);
    lastn_ = loom::buffer<float>(S * c.dim);
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
    using loom::host;
    using loom::index_t;
    using loom::make_view;
    namespace ops = loom::ops;
    const llama_config& c = w_->config;
    const index_t T = plan.num_tokens(), D = c.dim, KD = c.kv_dim(), H = c.hidden_dim, hd = c.head_dim();
    const auto style = c.rope_interleaved ? ops::rope_style::interleaved : ops::rope_style::half_split;
    const std::span<const std::int64_t> positions(plan.positions.data(), static_cast<std::size_t>(T));
    const auto cv = [](const loom::buffer<float>& b, index_t rows, index_t cols) {
      return make_view(static_cast<const float*>(b.data()), rows, cols);
    };
    auto x = make_view(x_.data(), T, D), xb = make_view(xb_.data(), T, D);
    auto rstd = make_view(rstd_.data(), T);
    ops::embedding_forward(host{}, make_view(plan.token_ids.data(), T), cv(w_->tok_embeddings, c.vocab_size, D), x);
    for (std::int32_t l = 0; l < c.n_layers; ++l) {
      const layer_weights& L = w_->layers[static_cast<std::size_t>(l)];
      const packed_layer& P = packed_[static_cast<std::size_t>(l)];
      ops::rmsnorm_forward(host{}, cv(x_, T, D), make_view(L.attn_norm.data(), D), xb, rstd, c.norm_eps);
      ops::gemm(host{}, cv(xb_, T, D), P.wq, make_view(q_.data(), T, D));
      ops::gemm(host{}, cv(xb_, T, D), P.wk, make_view(k_.data(), T, KD));
      ops::gemm(host{}, cv(xb_, T, D), P.wv, make_view(v_.data(), T, KD));
      ops::rope_forward(host{}, make_view(q_.data(), T, c.n_heads, hd), rope_, style, positions);
      ops::rope_forward(host{}, make_view(k_.data(), T, c.n_kv_heads, hd), rope_, style, positions);
      auto layer = cache_.layer(l);
      loom::kv::append_paged_kv_cache(host{}, make_view<host>(static_cast<const float*>(k_.data()), T, c.n_kv_heads, hd),
                                      make_view<host>(static_cast<const float*>(v_.data()), T, c.n_kv_heads, hd),
                                      plan.batch_indices, plan.positions, layer, plan.csr);
      loom::kv::batch_prefill_with_paged_kv_cache(host{}, make_view<host>(static_cast<const float*>(q_.data()), T, c.n_heads, hd),
                                                  plan.qo_indptr, layer, plan.csr, make_view<host>(att_.data(), T, c.n_heads, hd));
      ops::gemm(host{}, cv(att_, T, D), P.wo, xb);
      ops::add(host{}, make_view(x_.data(), T * D), make_view(static_cast<const float*>(xb_.data()), T * D));
      ops::rmsnorm_forward(host{}, cv(x_, T, D), make_view(L.ffn_norm.data(), D), xb, rstd, c.norm_eps);
      ops::gemm(host{}, cv(xb_, T, D), P.w1, make_view(h1_.data(), T, H));
      ops::gemm(host{}, cv(xb_, T, D), P.w3, make_view(h3_.data(), T, H));
      ops::swiglu_forward(host{}, make_view(static_cast<const float*>(h1_.data()), T * H),
                          make_view(static_cast<const float*>(h3_.data()), T * H), make_view(hs_.data(), T * H));
      ops::gemm(host{}, cv(hs_, T, H), P.w2, xb);
      ops::add(host{}, make_view(x_.data(), T * D), make_view(static_cast<const float*>(xb_.data()), T * D));
    }
    // Logits only for the rows that are sampled: the last row of each finishing chunk.
    index_t rows = 0;
    for (std::size_t b = 0; b < plan.chunks.size(); ++b)
      if (plan.chunks[b].samples) {
        const index_t r = plan.qo_indptr[b + 1] - 1;
        std::copy(x_.data() + r * D, x_.data() + (r + 1) * D, last_.data() + rows++ * D);
      }
    if (rows == 0) return;
    ops::rmsnorm_forward(host{}, cv(last_, rows, D), make_view(w_->norm.data(), D), make_view(lastn_.data(), rows, D),
                         make_view(rstd_.data(), rows), c.norm_eps);
    ops::gemm(host{}, cv(lastn_, rows, D), classifier_, make_view(logits_.data(), rows, c.vocab_size));
  }

  struct packed_layer {
    loom::ops::packed_weight wq, wk, wv, wo, w1, w2, w3;
  };

  const llama_weights* w_;
  engine_config cfg_;
  loom::kv::block_allocator alloc_;
  loom::kv::paged_kv_cache<KV> cache_;
  loom::kv::scheduler sched_;
  loom::ops::rope_table<float> rope_;
  std::vector<packed_layer> packed_;     // the weights, packed once for the GEMMs
  loom::ops::packed_weight classifier_;
  loom::kv::sampler sampler_;
  // Activations for up to max_num_batched_tokens tokens:
  loom::buffer<float> x_, xb_, q_, att_;  // [tokens, dim]
  loom::buffer<float> k_, v_;             // [tokens, kv_dim]
  loom::buffer<float> h1_, h3_, hs_;      // [tokens, hidden_dim]: gate, up, silu(gate) * up
  loom::buffer<float> rstd_;              // [tokens]
  loom::buffer<float> last_, lastn_;      // [seqs, dim]: the sampled rows, normalised
  loom::buffer<float> logits_;            // [seqs, vocab]
  loom::buffer<float> raw_logits_;        // [seqs, vocab] before penalties and temperature
  std::vector<loom::kv::token_id> sampled_;
  std::int64_t tokens_computed_ = 0, steps_ = 0;
};

}  // namespace llama
