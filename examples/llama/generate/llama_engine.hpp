#pragma once
// llama_engine: generation with the one decoder (LLaMA, ChatGLM2/3) over loom's paged KV cache
// with continuous batching.
//
// One engine step = one scheduler plan: every scheduled token of every sequence (decode
// tokens and prefill chunks together, ragged) goes through the layers as one [tokens, dim]
// activation; per layer the new keys and values are appended to the paged pool
// (append_paged_kv_cache) and attention runs over it (batch_prefill_with_paged_kv_cache,
// which covers decode rows too). Only the last row of each sequence that reaches its end is
// normalised, projected to logits and sampled. All activation buffers are sized once, for the
// scheduler's token budget: the step loop allocates nothing but the scheduler's small vectors.
//
// Layers: the decoder's own (llama3d::stage_layers at tp = 1, one pipeline stage, built from
// the one llama::config over the one flat parameter buffer the loaders fill): the embedding,
// RMSNorms, nn::attention::forward_cached (q/k/v projections and their biases, rotary at each
// token's position, output projection) with the paged-KV append and attention in place of
// the training attention, nn::swiglu_mlp's forward without kept activations, and the output
// projection; each block runs llama3d::block::forward, the data flow training runs. The GEMMs read weights packed once when the engine is made (the layers' pack()):
// the same bits as the training GEMMs, no per-step copy of the weights, and each row's result
// the same whatever the batch it is computed in (loom's sgemm kernels; on the BLAS path of
// CPUs without AVX2 only within rounding), so paged, batched and one-token runs agree bit for
// bit.
//
// The engine is single-threaded; llama-serve drives it from one thread and feeds it requests
// from many.

#include "llama_loader.hpp"

#include <llama/model3d/llama3d.hpp>

#include <loom/comm/self_comm.hpp>
#include <loom/kv/block_allocator.hpp>
#include <loom/kv/paged_attention.hpp>
#include <loom/kv/paged_kv_cache.hpp>
#include <loom/kv/sampler.hpp>
#include <loom/kv/scheduler.hpp>
#include <loom/nn/workspace.hpp>
#include <loom/ops/host/common.hpp>
#include <loom/ops/host/packed_weight.hpp>

#include <cstdint>
#include <map>
#include <span>
#include <vector>

namespace llama {

struct engine_config {
  std::int32_t num_blocks = 256;  ///< KV pool size in blocks (all layers)
  std::int32_t block_size = 16;
  loom::kv::scheduler_config scheduler;  ///< max_model_len is capped at the model's seq_len
};

template <loom::kv::kv_element KV = float>
class llama_engine {
 public:
  /// w must outlive the engine (its norms and embedding are read from it on every step).
  llama_engine(const flat_weights& w, engine_config cfg)
      : w_(&w),
        cfg_(clamp(cfg, w.cfg)),
        layers_(w.cfg, {}, llama3d::split_layers(w.cfg.n_layers, 1, 0), true, true),
        alloc_(cfg_.num_blocks, cfg_.block_size),
        cache_(loom::kv::kv_cache_shape{static_cast<std::int32_t>(w.cfg.n_layers), cfg_.num_blocks, cfg_.block_size,
                                        static_cast<std::int32_t>(w.cfg.n_kv_heads),
                                        static_cast<std::int32_t>(w.cfg.head_dim())}),
        sched_(cfg_.scheduler, alloc_) {
    const llama::config& c = w.cfg;
    LOOM_CHECK(w.params.size() == layers_.layout.size(), "llama_engine: the weights hold ", w.params.size(),
               " parameters, the layout of their config ", layers_.layout.size());
    for (std::size_t l = 0; l < layers_.blocks.size(); ++l) {
      const auto& b = layers_.blocks[l];
      const auto p = unit(layers_.first_block_unit + l);
      packed_.push_back({b.attention.pack(p), b.feed_forward.pack(p)});
    }
    classifier_ = loom::ops::packed_weight(layers_.output.local().weight().in(unit(layers_.output_unit)));
    const auto T = static_cast<std::size_t>(cfg_.scheduler.max_num_batched_tokens);
    const auto S = static_cast<std::size_t>(cfg_.scheduler.max_num_seqs);
    const auto D = static_cast<std::size_t>(c.dim), V = static_cast<std::size_t>(c.vocab);
    x_ = loom::buffer<float>(T * D);
    xb_ = loom::buffer<float>(T * D);
    h_ = loom::buffer<float>(T * D);
    rstd_ = loom::buffer<float>(T);
    last_ = loom::buffer<float>(S * D);
    logits_ = loom::buffer<float>(S * V);
    raw_logits_ = loom::buffer<float>(S * V);
  }

  const llama::config& model_config() const noexcept { return w_->cfg; }
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
    const auto V = static_cast<std::size_t>(w_->cfg.vocab);
    return {raw_logits_.data() + i * V, V};
  }

  /// Queues a request (token ids are checked against the vocabulary).
  void add(loom::kv::request r) {
    for (auto t : r.prompt)
      LOOM_CHECK(t >= 0 && t < w_->cfg.vocab, "llama_engine::add: request ", r.id, " has token id ", t,
                 " outside the vocabulary of ", w_->cfg.vocab);
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
      const std::int64_t rows = forward(plan), V = w_->cfg.vocab;
      std::copy_n(logits_.data(), rows * V, raw_logits_.data());
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
  static engine_config clamp(engine_config cfg, const llama::config& c) {
    c.validate();
    if (cfg.scheduler.max_model_len > c.seq_len) cfg.scheduler.max_model_len = static_cast<std::int32_t>(c.seq_len);
    if (cfg.scheduler.max_num_seqs > cfg.scheduler.max_num_batched_tokens)
      cfg.scheduler.max_num_seqs = cfg.scheduler.max_num_batched_tokens;
    return cfg;
  }
  std::span<const float> unit(std::size_t u) const { return layers_.layout.unit(w_->params.span(), u); }

  /// The plan's tokens through the layers; the logits of the sampled rows into logits_.
  /// Returns how many rows were sampled.
  std::int64_t forward(const loom::kv::step_plan& plan) {
    using loom::host;
    using loom::index_t;
    using loom::make_view;
    namespace ops = loom::ops;
    const index_t T = plan.num_tokens(), D = w_->cfg.dim;
    const std::span<const std::int64_t> positions(plan.positions.data(), static_cast<std::size_t>(T));
    auto x = make_view(x_.data(), T, D), xb = make_view(xb_.data(), T, D), h = make_view(h_.data(), T, D);
    const auto cx = make_view(static_cast<const float*>(x_.data()), T, D);
    auto rstd = make_view(rstd_.data(), T);
    layers_.tok_embeddings.forward(self_, unit(layers_.embedding_unit), make_view(plan.token_ids.data(), T), x);
    for (std::size_t l = 0; l < layers_.blocks.size(); ++l) {
      const auto& b = layers_.blocks[l];
      const auto p = unit(layers_.first_block_unit + l);
      auto layer = cache_.layer(static_cast<std::int32_t>(l));
      // The attention over the paged pool: this step's keys and values appended, then each
      // query row attends over its sequence so far (decode rows and prefill chunks alike).
      auto paged = [&](auto q, auto k, auto v, auto out) {
        loom::kv::append_paged_kv_cache(host{}, k, v, plan.batch_indices, plan.positions, layer, plan.csr);
        loom::kv::batch_prefill_with_paged_kv_cache(host{}, q, plan.qo_indptr, layer, plan.csr, out);
      };
      // the training block's data flow; nothing is kept, so the residual stream is updated in place
      b.forward(p, {cx, xb, rstd, h, xb, rstd, x},
                [&](auto xn, auto y) {
                  ws_.reset();
                  b.attention.forward_cached(self_, packed_[l].attention, xn, positions, paged, y, ws_);
                },
                [&](auto xn, auto y) {
                  ws_.reset();
                  b.feed_forward.forward(self_, packed_[l].mlp, xn, y, ws_);
                });
    }
    // Logits only for the rows that are sampled: the last row of each finishing chunk.
    index_t rows = 0;
    for (std::size_t b = 0; b < plan.chunks.size(); ++b)
      if (plan.chunks[b].samples) {
        const index_t r = plan.qo_indptr[b + 1] - 1;
        std::copy_n(x_.data() + r * D, D, last_.data() + rows++ * D);
      }
    if (rows == 0) return 0;
    auto xf = make_view(xb_.data(), rows, D);
    layers_.norm.forward(unit(layers_.head_unit), make_view(static_cast<const float*>(last_.data()), rows, D), xf,
                         make_view(rstd_.data(), rows));
    ops::gemm(host{}, make_view(static_cast<const float*>(xb_.data()), rows, D), classifier_,
              make_view(logits_.data(), rows, w_->cfg.vocab));
    return rows;
  }

  struct packed_block {
    loom::nn::attention<float>::packed attention;
    loom::nn::swiglu_mlp<float>::packed mlp;
  };

  const flat_weights* w_;
  engine_config cfg_;
  llama3d::stage_layers<float> layers_;  // the decoder's layers over w_->params (tp = 1, one stage)
  loom::comm::self_comm self_;
  loom::kv::block_allocator alloc_;
  loom::kv::paged_kv_cache<KV> cache_;
  loom::kv::scheduler sched_;
  std::vector<packed_block> packed_;  // the blocks' weights, packed once for the GEMMs
  loom::ops::packed_weight classifier_;
  loom::kv::sampler sampler_;
  loom::nn::workspace<float> ws_;  // a layer's q, k, v, attention output / MLP hidden units
  // Activations for up to max_num_batched_tokens tokens:
  loom::buffer<float> x_, xb_, h_;  // [tokens, dim]: residual stream, a branch's input, the stream after attention
  loom::buffer<float> rstd_;        // [tokens]
  loom::buffer<float> last_;        // [seqs, dim]: the sampled rows
  loom::buffer<float> logits_;      // [seqs, vocab]
  loom::buffer<float> raw_logits_;  // [seqs, vocab] before penalties and temperature
  std::vector<loom::kv::token_id> sampled_;
  std::int64_t tokens_computed_ = 0, steps_ = 0;
};

}  // namespace llama
