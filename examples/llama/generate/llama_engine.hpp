#pragma once
// llama_engine: generation with the one decoder (LLaMA, ChatGLM2/3) over loom's paged KV cache
// with continuous batching: loom::kv::engine (the pool, the scheduler, the sampler and the
// step loop) over llama_paged, which runs a plan through the decoder's layers.
//
// One engine step = one scheduler plan: every scheduled token of every sequence (decode
// tokens and prefill chunks together, ragged) goes through the layers as one [tokens, dim]
// activation; per layer the new keys and values are appended to the paged pool
// (append_paged_kv_cache) and attention runs over it (batch_prefill_with_paged_kv_cache,
// which covers decode rows too). Only the last row of each sequence that reaches its end is
// normalised, projected to logits and sampled. All activation buffers are sized once, for the
// scheduler's token budget: the step loop allocates nothing but the scheduler's small vectors.
//
// Layers: the decoder's own (llama3d::stage_layers at the tensor group's size and this rank's
// pipeline stage, built from the one llama::config over the flat parameter buffer the loaders
// fill, or this rank's slice of it): the embedding,
// RMSNorms, nn::attention::forward_cached (q/k/v projections and their biases, rotary at each
// token's position, output projection) with the paged-KV append and attention in place of
// the training attention, nn::swiglu_mlp's forward without kept activations, and the output
// projection; each block runs llama3d::block::forward, the data flow training runs. The GEMMs read weights packed once when the engine is made (the layers' pack()):
// the same bits as the training GEMMs, no per-step copy of the weights, and each row's result
// the same whatever the batch it is computed in (loom's sgemm kernels; on the BLAS path of
// CPUs without AVX2 only within rounding), so paged, batched and one-token runs agree bit for
// bit.
//
// Tensor parallelism (docs/kv.md, "Tensor-parallel engine"): llama_paged<C> on rank r of a
// tensor group C holds the layers at tp = C's size: its slice of the weights (by the layout's
// shards, read from the checkpoint's files or cut from a full flat buffer: a slice_source;
// norms replicated), its query and key/value heads
// (the pool holds n_kv_heads / tp heads), its columns of the MLP and its rows of the
// vocabulary. The layers' own collectives sum the row-parallel outputs and the embedding;
// the output projection gives this rank's vocabulary columns of the logits, and an
// all-gather makes the full rows (every rank the same bits), which rank 0 samples.
// kv::engine broadcasts rank 0's plan each step (group()). At tp = 1 (self_comm, the default)
// the model reads the caller's weights in place and its collectives do nothing.
//
// Pipeline parallelism (docs/kv.md, "Pipeline-parallel engine"): over a (tp, pp) mesh of
// ranks, stage s holds the layers of the decoder's own stage split (llama3d::split_layers, the
// trainer's), the embedding on the first stage, the final norm and output projection on the
// last, each cut over its tensor group as above; its pool holds its layers only. The plan goes
// to every rank of the mesh (group() is the whole mesh); each stage cuts the step's sequences
// into the same micro-batches (kv::split_micro_batches, whole sequences, each a plan of its
// own) and runs them in turn: micro-batch m's rows of the residual stream come from the stage
// before (the first stage embeds them), go through its layers and on to the next stage, which
// works on m while this one takes m + 1. The last stage makes the sampled rows' full logits and
// sends them to rank 0 (first stage, tensor rank 0), which samples. Every row's result is the
// same whatever micro-batch it runs in (the row-independent GEMMs, attention and norms), so
// at tp = 1 a pipeline gives one rank's logits bit for bit.
//
// Memory (docs/kv.md, "Memory plan"): llama_engine::memory_plan(config, engine_config, tp, pp,
// stage) gives what one rank of a stage holds, in bytes, before any weight is read (without a
// stage: the stage that holds the most): its slice of its stage's weights and their packed
// copies (from the same layers and packed layouts the constructor makes), its part of the KV
// pool (its heads of its layers) and the step buffers (sized by the same buffer_sizes as
// reserve(), the attention's and MLP's scratch included, so the workspace never grows after
// it; logit rows only on the last stage).
//
// LoRA adapters (llama_lora.hpp): the model may serve several over its base; a request names
// one (kv::request::adapter, 1-based; 0: the base), and the rows of each adapter present in a
// step get its low-rank term after each projection it targets (the layers' projection hook),
// while the base's GEMMs run once for all rows.

#include "llama_loader.hpp"
#include "llama_lora.hpp"

#include <llama/model3d/llama3d.hpp>

#include <loom/comm/mesh.hpp>
#include <loom/comm/self_comm.hpp>
#include <loom/kv/engine.hpp>
#include <loom/kv/micro_batch.hpp>
#include <loom/kv/paged_attention.hpp>
#include <loom/nn/workspace.hpp>
#include <loom/ops/host/common.hpp>
#include <loom/ops/host/packed_weight.hpp>

#include <algorithm>
#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace llama {

using engine_config = loom::kv::engine_config;

/// What one rank of the engine holds, in bytes.
struct rank_memory {
  std::size_t weights = 0;    ///< its slice of the weights and their packed copies for the GEMMs
  std::size_t kv = 0;         ///< its key/value heads of every block of the pool
  std::size_t workspace = 0;  ///< activations and logit rows, sized once for the token budget
  std::size_t total() const noexcept { return weights + kv + workspace; }
};

/// The decoder as loom::kv::engine's model (kv::paged_model), on one rank of a tensor group C.
template <loom::comm::communicator C = loom::comm::self_comm>
class llama_paged {
 public:
  /// One rank: w must outlive the model (its norms and embedding are read from it on every step).
  /// `adapters` are served as adapters 1, 2, ... (each must fit the base; names unique).
  explicit llama_paged(const flat_weights& w, std::vector<served_adapter> adapters = {})
    requires std::same_as<C, loom::comm::self_comm>
      : llama_paged(w.cfg, self_, nullptr, self_, 0, std::move(adapters)) {
    use(w.params.span(), loom::default_resource<loom::host>());
  }

  /// Rank tp.rank() of a tensor group: this rank's slice of `full` (the whole model in the
  /// single-rank layout; it may go once the model is made) is copied into memory from `mr`,
  /// which also holds the packed weights: everything this rank keeps of the model. Refuses
  /// (loom::error) a model whose heads, key/value heads, hidden units or vocabulary tp does
  /// not divide. LoRA `adapters` only on a group of one (their factors are not split yet).
  llama_paged(const flat_weights& full, C& tp, loom::memory_resource& mr = loom::default_resource<loom::host>(),
              std::vector<served_adapter> adapters = {})
      : llama_paged(full.cfg, tp, slice_from(full), mr, std::move(adapters)) {}
  /// The same from `fill`, which writes this rank's slice of a model of config c (the shards of
  /// its layers): slice_from(checkpoint_reader) reads just those bytes of the files, so that no
  /// rank ever holds the whole model; slice_from(flat_weights) cuts them from a loaded one.
  llama_paged(const llama::config& c, C& tp, const slice_source& fill, loom::memory_resource& mr = loom::default_resource<loom::host>(),
              std::vector<served_adapter> adapters = {})
      : llama_paged(checked_split(c, tp.size()), tp, nullptr, tp, 0, std::move(adapters)) {
    load_slice(fill, mr);
  }

  /// Rank of a (tp, pp) mesh (dp = 1; the mesh must outlive the model): pipeline stage
  /// mesh.coord().pp holds its layers of the decoder's stage split (llama3d::split_layers;
  /// the embedding on the first stage, the final norm and output projection on the last),
  /// and of them this rank's tensor-parallel slice, which `fill` writes into memory from `mr`
  /// as above. A step's sequences run as `micro_batches` micro-batches (0: one per stage). The
  /// model's group (the plan's broadcast) is the whole mesh. Refuses a pp the layers cannot be
  /// split over (every stage needs one), by name.
  llama_paged(const llama::config& c, loom::comm::mesh<C>& mesh, const slice_source& fill, loom::memory_resource& mr,
              std::int32_t micro_batches = 0, std::vector<served_adapter> adapters = {})
      : llama_paged(checked_split(c, mesh.shape().tp, mesh.shape().pp), mesh.tp(), &mesh.pp(), mesh.mp(), micro_batches,
                    std::move(adapters)) {
    LOOM_CHECK(mesh.shape().dp == 1, "llama_engine: a mesh with dp=", mesh.shape().dp,
               "; data-parallel replicas of the engine are engines of their own (dp must be 1)");
    load_slice(fill, mr);
  }
  /// The same, cut from `full` (the whole model in the single-rank layout).
  llama_paged(const flat_weights& full, loom::comm::mesh<C>& mesh, loom::memory_resource& mr, std::int32_t micro_batches = 0,
              std::vector<served_adapter> adapters = {})
      : llama_paged(full.cfg, mesh, slice_from(full), mr, micro_batches, std::move(adapters)) {}
  llama_paged(const llama_paged&) = delete;  // holds a pointer to its own communicator at tp = 1
  llama_paged& operator=(const llama_paged&) = delete;

  const llama::config& config() const noexcept { return cfg_; }
  std::int64_t vocab() const noexcept { return cfg_.vocab; }
  std::int64_t max_context() const noexcept { return cfg_.seq_len; }
  /// The model's ranks (kv::grouped_model): the tensor group, or the whole (tp, pp) mesh;
  /// rank 0 (the first stage's) schedules and samples, the others follow.
  C& group() noexcept { return *group_; }
  /// This rank's pipeline stage and the number of stages (1: the whole decoder).
  int stage() const noexcept { return stage_; }
  int stages() const noexcept { return stages_; }
  /// The LoRA adapters served over the base: adapter i (1-based) of a request is adapters()[i - 1].
  std::size_t num_adapters() const noexcept { return adapters_.size(); }
  const std::vector<served_adapter>& adapters() const noexcept { return adapters_; }
  /// This rank's part of the pool: its key/value heads of its stage's layers.
  loom::kv::kv_cache_shape kv_shape(std::int32_t num_blocks, std::int32_t block_size) const {
    return {static_cast<std::int32_t>(layers_.blocks.size()), num_blocks, block_size,
            static_cast<std::int32_t>(cfg_.n_kv_heads / tp_->size()), static_cast<std::int32_t>(cfg_.head_dim())};
  }
  /// Activation buffers for up to `tokens` tokens and `seqs` sampled rows, sized once (the
  /// layers' scratch too: a step never allocates).
  void reserve(std::int32_t tokens, std::int32_t seqs) {
    const buffer_sizes n(cfg_, tp_->size(), tokens, seqs, last_stage());
    x_ = loom::buffer<float>(n.stream);
    xb_ = loom::buffer<float>(n.stream);
    h_ = loom::buffer<float>(n.stream);
    rstd_ = loom::buffer<float>(n.rstd);
    last_ = loom::buffer<float>(n.last);
    local_logits_ = loom::buffer<float>(n.local_logits);
    gathered_ = loom::buffer<float>(n.gathered);
    ws_ = loom::nn::workspace<float>(n.scratch);
    index_t rank = 0;
    for (const auto& a : adapters_) rank = std::max(rank, a.rank());
    if (!adapters_.empty()) lora_.reserve(tokens, std::max<index_t>(cfg_.dim, cfg_.hidden_dim), rank);
  }

  /// Bytes of the buffers reserve() made (the LoRA rows' scratch not counted).
  std::size_t workspace_bytes() const {
    return x_.bytes() + xb_.bytes() + h_.bytes() + rstd_.bytes() + last_.bytes() + local_logits_.bytes() + gathered_.bytes() +
           ws_.capacity() * sizeof(float);
  }
  /// What a rank of stage `stage` of pp, in a tensor group of tp, keeps of config c's weights,
  /// in bytes (each rank of a stage the same): its slice of the flat buffer (the layout's
  /// alignment padding included) and the packed copies of its projections, as the
  /// constructors allocate them from their `mr`.
  static std::size_t weight_bytes(const llama::config& c, int tp, int pp = 1, int stage = 0) {
    const llama3d::stage_layers<float> L = stage_of(checked_split(c, tp, pp), loom::nn::tp::tp_rank{0, tp}, pp, stage);
    std::size_t n = L.layout.size() * sizeof(float);
    for (const auto& b : L.blocks) n += b.attention.packed_bytes() + b.feed_forward.packed_bytes();
    if (stage != pp - 1) return n;
    const auto& out = L.output.local();
    return n + loom::ops::packed_weight::bytes_for(out.out_features(), out.in_features());
  }
  /// Bytes of what reserve(tokens, seqs) makes on a rank of a group of tp (`last`: on the
  /// last pipeline stage, the only one that makes logits).
  static std::size_t workspace_bytes(const llama::config& c, int tp, std::int32_t tokens, std::int32_t seqs, bool last = true) {
    const buffer_sizes n(c, tp, tokens, seqs, last);
    return sizeof(float) * (3 * n.stream + n.rstd + n.last + n.local_logits + n.gathered + n.scratch);
  }

  /// The plan's tokens through the layers; the logits of the sampled rows into `logits` (on
  /// every rank of a single stage; of a pipeline, on rank 0 of the first stage and on the
  /// last stage). Returns how many rows were sampled.
  template <class KV>
  std::int64_t forward(const loom::kv::step_plan& plan, loom::kv::paged_kv_cache<KV>& cache, std::span<float> logits) {
    if (stages_ == 1) {
      run_stage(plan, 0, cache);
      return head(plan, 0, logits);
    }
    // Pipeline: micro-batch m comes from the stage before (or the embedding), goes through
    // this stage's layers and on to the next stage (or the head) while this stage takes m + 1.
    // Each micro-batch keeps its own rows of the step's residual stream (they start at its
    // first token), so a send reads rows nothing writes again in this step.
    loom::kv::split_micro_batches(plan, micro_batches_ > 0 ? micro_batches_ : stages_, bounds_);
    const auto D = static_cast<std::size_t>(cfg_.dim), V = static_cast<std::size_t>(cfg_.vocab);
    std::int64_t rows = 0;
    for (std::size_t m = 0; m + 1 < bounds_.size(); ++m) {
      loom::kv::slice_plan(plan, bounds_[m], bounds_[m + 1], micro_);
      const loom::index_t t0 = plan.qo_indptr[static_cast<std::size_t>(bounds_[m])];
      const std::span<float> rows_m(x_.data() + static_cast<std::size_t>(t0) * D, static_cast<std::size_t>(micro_.num_tokens()) * D);
      const int tag = static_cast<int>(m);
      if (!first_stage()) pp_->recv(rows_m, stage_ - 1, tag);
      run_stage(micro_, t0, cache);
      if (!last_stage()) sends_.push_back(pp_->send_async(std::span<const float>(rows_m), stage_ + 1, tag));
      else rows += head(micro_, t0, logits.subspan(static_cast<std::size_t>(rows) * V));
    }
    // The sampled rows' full logits go from the last stage to the first, where rank 0 samples
    // them (tensor rank 0 of each end: the other tensor ranks of the first stage do not
    // sample, and every tensor rank of the last stage has the same rows). One message per
    // step: rank 0 has no use for part of them before its own last micro-batch is done. The
    // pair (last stage, first stage) carries nothing else, so any tag is its own.
    if (tp_->rank() == 0) {
      const std::int64_t sampled = std::count_if(plan.chunks.begin(), plan.chunks.end(), [](const auto& c) { return c.samples; });
      const auto all = logits.subspan(0, static_cast<std::size_t>(sampled) * V);
      if (sampled > 0 && last_stage()) sends_.push_back(pp_->send_async(std::span<const float>(all), 0, 0));
      if (sampled > 0 && first_stage()) pp_->recv(all, stages_ - 1, 0);
      rows = sampled;
    }
    for (auto& w : sends_) w.wait();
    sends_.clear();
    return rows;
  }

 private:
  struct packed_block {
    loom::nn::attention<float>::packed attention;
    loom::nn::swiglu_mlp<float>::packed mlp;
  };
  // Elements of each step buffer for `tokens` tokens and `seqs` sampled rows on a rank of tp
  // (`last`: of the last pipeline stage, which alone makes logits).
  struct buffer_sizes {
    buffer_sizes(const llama::config& c, int tp, std::int32_t tokens, std::int32_t seqs, bool last) {
      const auto T = static_cast<std::size_t>(tokens), S = static_cast<std::size_t>(seqs);
      const auto D = static_cast<std::size_t>(c.dim), V = static_cast<std::size_t>(c.vocab), t = static_cast<std::size_t>(tp);
      stream = T * D, rstd = T;
      if (last) this->last = S * D;
      if (last && tp > 1) local_logits = S * (V / t), gathered = S * V;  // this rank's vocabulary columns, and every rank's
      // The layers' scratch (nn::workspace rounds each take to 16 floats): attention's q, k, v
      // and output of this rank's heads, or the MLP's gate and up of its hidden units; the
      // arena is reset between them, so the larger.
      const auto r16 = [](std::size_t n) { return (n + 15) / 16 * 16; };
      const auto hd = static_cast<std::size_t>(c.head_dim()), h = static_cast<std::size_t>(c.n_heads) / t,
                 kv = static_cast<std::size_t>(c.n_kv_heads) / t, f = static_cast<std::size_t>(c.hidden_dim) / t;
      scratch = std::max(2 * r16(T * h * hd) + 2 * r16(T * kv * hd), 2 * r16(T * f));
    }
    std::size_t stream = 0, rstd = 0, last = 0, local_logits = 0, gathered = 0, scratch = 0;
  };
  // Every constructor: this rank's layers (of stage pp->rank() of pp->size(); the whole
  // decoder without a pipeline group), then use() their weights.
  llama_paged(const llama::config& c, C& tp, C* pp, C& group, std::int32_t micro_batches, std::vector<served_adapter> adapters)
      : cfg_((c.validate(), c)), tp_(&tp), pp_(pp), group_(&group), stage_(pp ? pp->rank() : 0), stages_(pp ? pp->size() : 1),
        micro_batches_(micro_batches), layers_(stage_of(c, loom::nn::tp::tp_rank::of(tp), stages_, stage_)),
        adapters_(std::move(adapters)) {
    LOOM_CHECK(micro_batches >= 0, "llama_engine: micro_batches must be >= 0 (0: one per pipeline stage), got ", micro_batches);
    LOOM_CHECK(adapters_.empty() || group.size() == 1, "llama_engine: LoRA adapters over a split base (tp=", tp.size(),
               ", pp=", stages_, ") are not supported yet; serve them at tp=1, pp=1");
  }
  // Layers [first, last) of `stage` of `stages` (llama3d's split), for tensor rank t.
  static llama3d::stage_layers<float> stage_of(const llama::config& c, loom::nn::tp::tp_rank t, int stages, int stage) {
    return {c, t, llama3d::split_layers(c.n_layers, stages, stage), stage == 0, stage == stages - 1};
  }
  bool first_stage() const noexcept { return stage_ == 0; }
  bool last_stage() const noexcept { return stage_ == stages_ - 1; }
  // This rank's slice (its stage's layers, its tensor shards), written by `fill` into memory from `mr`.
  void load_slice(const slice_source& fill, loom::memory_resource& mr) {
    slice_ = loom::buffer<float>(layers_.layout.size(), mr);
    std::fill(slice_.begin(), slice_.end(), 0.f);  // the layout's alignment padding
    fill(layers_.shards, slice_.span());
    use(slice_.span(), mr);
  }
  // The plan's tokens through this stage's layers, in place on the residual stream's rows
  // from `t0` (the first stage embeds the tokens there first).
  template <class KV>
  void run_stage(const loom::kv::step_plan& plan, loom::index_t t0, loom::kv::paged_kv_cache<KV>& cache) {
    using loom::host;
    using loom::index_t;
    using loom::make_view;
    const index_t T = plan.num_tokens(), D = cfg_.dim;
    const std::span<const std::int64_t> positions(plan.positions.data(), static_cast<std::size_t>(T));
    float* const stream = x_.data() + t0 * D;
    auto x = make_view(stream, T, D), xb = make_view(xb_.data(), T, D), h = make_view(h_.data(), T, D);
    const auto cx = make_view(static_cast<const float*>(stream), T, D);
    auto rstd = make_view(rstd_.data(), T);
    if (first_stage())
      layers_.tok_embeddings.forward(*tp_, unit(layers_.embedding_unit), make_view(plan.token_ids.data(), T), x);
    if (!adapters_.empty()) lora_.plan(plan);
    for (std::size_t l = 0; l < layers_.blocks.size(); ++l) {
      const auto& b = layers_.blocks[l];
      const auto p = unit(layers_.first_block_unit + l);
      auto layer = cache.layer(static_cast<std::int32_t>(l));
      // The attention over the paged pool: this step's keys and values appended, then each
      // query row attends over its sequence so far (decode rows and prefill chunks alike).
      auto paged = [&](auto q, auto k, auto v, auto out) {
        loom::kv::append_paged_kv_cache(host{}, k, v, plan.batch_indices, plan.positions, layer, plan.csr);
        loom::kv::batch_prefill_with_paged_kv_cache(host{}, q, plan.qo_indptr, layer, plan.csr, out);
      };
      // each adapter's rows of this step get its low-rank term after each projection
      auto lora = [&](loom::nn::projection which, auto in, auto out) {
        if (!lora_.empty()) lora_.apply(adapters_, l, which, in, out);
      };
      // the training block's data flow; nothing is kept, so the residual stream is updated in place
      b.forward(p, {cx, xb, rstd, h, xb, rstd, x},
                [&](auto xn, auto y) {
                  ws_.reset();
                  b.attention.forward_cached(*tp_, packed_[l].attention, xn, positions, paged, y, ws_, lora);
                },
                [&](auto xn, auto y) {
                  ws_.reset();
                  b.feed_forward.forward(*tp_, packed_[l].mlp, xn, y, ws_, lora);
                });
    }
  }
  // The last stage's head: the final norm and output projection of the plan's sampled rows
  // (the last row of each finishing chunk; the residual stream's rows from `t0`), full logit
  // rows into `logits`. Returns the rows.
  std::int64_t head(const loom::kv::step_plan& plan, loom::index_t t0, std::span<float> logits) {
    using loom::host;
    using loom::index_t;
    using loom::make_view;
    namespace ops = loom::ops;
    const index_t D = cfg_.dim;
    index_t rows = 0;
    for (std::size_t b = 0; b < plan.chunks.size(); ++b)
      if (plan.chunks[b].samples) {
        const index_t r = t0 + plan.qo_indptr[b + 1] - 1;
        std::copy_n(x_.data() + r * D, D, last_.data() + rows++ * D);
      }
    if (rows == 0) return 0;
    auto xf = make_view(xb_.data(), rows, D);
    layers_.norm.forward(unit(layers_.head_unit), make_view(static_cast<const float*>(last_.data()), rows, D), xf,
                         make_view(rstd_.data(), rows));
    const auto xf_rows = make_view(static_cast<const float*>(xb_.data()), rows, D);
    if (tp_->size() == 1) {
      ops::gemm(host{}, xf_rows, classifier_, make_view(logits.data(), rows, cfg_.vocab));
      return rows;
    }
    // The vocabulary-parallel head: this rank's columns [rows, vocab/tp], gathered from every
    // rank as [tp, rows, vocab/tp] and laid out as full rows [rows, vocab].
    const index_t Vl = layers_.output.local_out_features();
    const auto local = local_logits_.span().subspan(0, static_cast<std::size_t>(rows * Vl));
    ops::gemm(host{}, xf_rows, classifier_, make_view(local.data(), rows, Vl));
    const auto all = gathered_.span().subspan(0, local.size() * static_cast<std::size_t>(tp_->size()));
    tp_->all_gather(std::span<const float>(local), all);
    for (int k = 0; k < tp_->size(); ++k)
      for (index_t r = 0; r < rows; ++r)
        std::copy_n(all.data() + (k * rows + r) * Vl, Vl, logits.data() + r * cfg_.vocab + k * Vl);
    return rows;
  }
  // The layers read `params` (in their layout); the projections are packed from it into `mr`.
  void use(std::span<const float> params, loom::memory_resource& mr) {
    LOOM_CHECK(params.size() == layers_.layout.size(), "llama_engine: the weights hold ", params.size(),
               " parameters, the layout of their config ", layers_.layout.size());
    params_ = params;
    pack(mr);
  }
  static const llama::config& checked_split(const llama::config& c, int tp, int pp = 1) {
    llama3d::check_tensor_split(c, tp);
    llama3d::split_layers(c.n_layers, pp, 0);  // refuses pp < 1 or more stages than layers
    LOOM_CHECK(c.n_kv_heads % tp == 0, "llama_engine: n_kv_heads (", c.n_kv_heads, ") must be divisible by tp (", tp,
               "): each rank's KV cache holds its own key/value heads");
    return c;
  }
  // The blocks' projections and the output projection packed once for the GEMMs, from `mr`.
  void pack(loom::memory_resource& mr) {
    for (std::size_t l = 0; l < layers_.blocks.size(); ++l) {
      const auto& b = layers_.blocks[l];
      const auto p = unit(layers_.first_block_unit + l);
      packed_.push_back({b.attention.pack(p, mr), b.feed_forward.pack(p, mr)});
    }
    if (last_stage())
      classifier_ = loom::ops::packed_weight(layers_.output.local().weight().in(unit(layers_.output_unit)),
                                             loom::ops::host_sgemm_kernel(), mr);
    check_adapters();
  }
  std::span<const float> unit(std::size_t u) const { return layers_.layout.unit(params_, u); }
  // Every adapter's factors against the base's packed weights: [r, in] and [out, r] of the
  // projection they adapt (an adapter made for another base is refused naming it).
  void check_adapters() const {
    using loom::nn::projection;
    for (std::size_t i = 0; i < adapters_.size(); ++i) {
      const served_adapter& a = adapters_[i];
      for (std::size_t j = 0; j < i; ++j)
        LOOM_CHECK(adapters_[j].name() != a.name(), "llama_engine: two adapters are called '", a.name(), "'");
      LOOM_CHECK(a.layers() == cfg_.n_layers, "llama_engine: adapter '", a.name(), "' has ", a.layers(),
                 " layers, the base ", cfg_.n_layers);
      for (std::size_t l = 0; l < packed_.size(); ++l) {
        const auto& at = packed_[l].attention;
        const auto& ff = packed_[l].mlp;
        const std::array<const loom::ops::packed_weight*, loom::nn::num_projections> base{&at.wq, &at.wk, &at.wv, &at.wo,
                                                                                           &ff.w1, &ff.w3, &ff.w2};
        for (int p = 0; p < loom::nn::num_projections; ++p) {
          const auto* lr = a.find(l, static_cast<projection>(p));
          if (!lr) continue;
          const auto& w = *base[static_cast<std::size_t>(p)];
          LOOM_CHECK(lr->a.in_features() == w.in_features() && lr->b.out_features() == w.out_features() &&
                         lr->a.out_features() == a.rank() && lr->b.in_features() == a.rank(),
                     "llama_engine: adapter '", a.name(), "' has ", projection_name(static_cast<projection>(p)), " of layer ",
                     l, " as A [", lr->a.out_features(), ", ", lr->a.in_features(), "], B [", lr->b.out_features(), ", ",
                     lr->b.in_features(), "] with r=", a.rank(), "; the base's weight is [", w.out_features(), ", ",
                     w.in_features(), "]");
        }
      }
    }
  }

  llama::config cfg_;
  loom::comm::self_comm self_;           // the group at tp = 1
  C* tp_;                                // this stage's tensor group
  C* pp_;                                // this rank's pipeline group (same tensor rank, every stage); null: one stage
  C* group_;                             // every rank of the model: the plan's broadcast
  int stage_, stages_;
  std::int32_t micro_batches_;           // 0: one per stage
  llama3d::stage_layers<float> layers_;  // this rank's layers of the decoder (its stage)
  loom::buffer<float> slice_;            // the tensor-group constructor: this rank's slice of the weights
  std::span<const float> params_;        // the layers' flat buffer: the caller's (one rank) or slice_
  std::vector<packed_block> packed_;  // the blocks' weights, packed once for the GEMMs
  loom::ops::packed_weight classifier_;
  loom::nn::workspace<float> ws_;  // a layer's q, k, v, attention output / MLP hidden units
  // Activations for up to max_num_batched_tokens tokens:
  loom::buffer<float> x_, xb_, h_;  // [tokens, dim]: residual stream, a branch's input, the stream after attention
  loom::buffer<float> rstd_;        // [tokens]
  loom::buffer<float> last_;        // last stage: [seqs, dim], the sampled rows
  loom::buffer<float> local_logits_;  // tp > 1: [seqs, vocab/tp], this rank's columns
  loom::buffer<float> gathered_;      // tp > 1: [tp, seqs, vocab/tp]
  std::vector<served_adapter> adapters_;  // LoRA adapters 1, 2, ... over the base
  lora_batch lora_;                       // this step's rows by adapter
  // Pipeline stages:
  std::vector<std::int32_t> bounds_;  // this step's micro-batches as chunk ranges
  loom::kv::step_plan micro_;         // the micro-batch being run, as a plan of its own
  std::vector<loom::comm::work> sends_;  // this step's sends in flight (they read x_ and the logits)
};

template <loom::kv::kv_element KV = float, loom::comm::communicator C = loom::comm::self_comm>
class llama_engine : public loom::kv::engine<llama_paged<C>, KV> {
 public:
  /// w must outlive the engine. `adapters`: LoRA adapters served over w, as adapters 1, 2, ...
  llama_engine(const flat_weights& w, engine_config cfg, std::vector<served_adapter> adapters = {})
    requires std::same_as<C, loom::comm::self_comm>
      : loom::kv::engine<llama_paged<C>, KV>(cfg, w, std::move(adapters)) {}
  /// Rank tp.rank() of a tensor-parallel engine: every rank of `tp` makes it with the same
  /// weights and config; rank 0 takes the requests and steps (generate), the others call
  /// follow() until rank 0 calls stop_followers(). `mr`: this rank's weight memory.
  /// `adapters`: LoRA adapters, on a group of one only.
  llama_engine(const flat_weights& full, C& tp, engine_config cfg, loom::memory_resource& mr = loom::default_resource<loom::host>(),
               std::vector<served_adapter> adapters = {})
      : loom::kv::engine<llama_paged<C>, KV>(cfg, full, tp, mr, std::move(adapters)) {}
  /// Rank tp.rank() of a tensor-parallel engine of config c whose slice `fill` writes (e.g.
  /// slice_from(checkpoint_reader(path)): each rank reads only its bytes of the files).
  llama_engine(const llama::config& c, C& tp, const slice_source& fill, engine_config cfg,
               loom::memory_resource& mr = loom::default_resource<loom::host>(), std::vector<served_adapter> adapters = {})
      : loom::kv::engine<llama_paged<C>, KV>(cfg, c, tp, fill, mr, std::move(adapters)) {}
  /// Rank of a (tp, pp) mesh (dp = 1; it must outlive the engine): every rank of the mesh
  /// makes it with the same config and a `fill` of the same weights; its stage's layers and
  /// its tensor slice of them go into `mr`. Rank 0 of the mesh (the first stage's) takes the
  /// requests and steps; every other rank calls follow(). A step's sequences flow through
  /// the stages as cfg.micro_batches micro-batches (0: one per stage).
  llama_engine(const llama::config& c, loom::comm::mesh<C>& mesh, const slice_source& fill, engine_config cfg,
               loom::memory_resource& mr = loom::default_resource<loom::host>(), std::vector<served_adapter> adapters = {})
      : loom::kv::engine<llama_paged<C>, KV>(cfg, c, mesh, fill, mr, cfg.micro_batches, std::move(adapters)) {}
  /// The same, cut from `full`.
  llama_engine(const flat_weights& full, loom::comm::mesh<C>& mesh, engine_config cfg,
               loom::memory_resource& mr = loom::default_resource<loom::host>(), std::vector<served_adapter> adapters = {})
      : loom::kv::engine<llama_paged<C>, KV>(cfg, full, mesh, mr, cfg.micro_batches, std::move(adapters)) {}
  /// What a rank of stage `stage` of pp, in a tensor group of tp, holds for config c under
  /// engine config ec, computed before any weight is read (memory_plan(...).total() against a
  /// rank's memory decides whether a model fits). Refuses a split tp or pp cannot make, as
  /// the constructors do.
  static rank_memory memory_plan(const llama::config& c, engine_config ec, int tp, int pp, int stage) {
    LOOM_CHECK(tp >= 1, "llama_engine: tp must be >= 1, got ", tp);
    const auto layers = llama3d::split_layers(c.n_layers, pp, stage).layers();
    ec = loom::kv::engine<llama_paged<C>, KV>::clamp(ec, c.seq_len);
    const auto S = ec.scheduler.max_num_seqs, T = ec.scheduler.max_num_batched_tokens;
    rank_memory m;
    m.weights = llama_paged<C>::weight_bytes(c, tp, pp, stage);
    m.kv = static_cast<std::size_t>(ec.num_blocks) * static_cast<std::size_t>(layers) *
           static_cast<std::size_t>(loom::kv::kv_cache_shape{1, 1, ec.block_size, static_cast<std::int32_t>(c.n_kv_heads / tp),
                                                             static_cast<std::int32_t>(c.head_dim())}
                                        .block_elems()) *
           sizeof(KV);
    m.workspace = llama_paged<C>::workspace_bytes(c, tp, T, S, stage == pp - 1) +
                  2 * static_cast<std::size_t>(S) * static_cast<std::size_t>(c.vocab) * sizeof(float);
    return m;
  }
  /// What each rank of a (tp, pp) mesh must be able to hold: the plan of the stage that needs
  /// the most (memory_plan(...).total() against a rank's memory decides whether a model fits).
  static rank_memory memory_plan(const llama::config& c, const engine_config& ec, int tp, int pp = 1) {
    rank_memory most = memory_plan(c, ec, tp, pp, 0);
    for (int s = 1; s < pp; ++s)
      if (const rank_memory m = memory_plan(c, ec, tp, pp, s); m.total() > most.total()) most = m;
    return most;
  }
  /// The smallest tp (dividing what the split needs) whose ranks each fit in `limit` bytes
  /// with pp stages, trying up to n_heads ranks; 0 when none does.
  static int smallest_tp(const llama::config& c, const engine_config& ec, std::size_t limit, int pp = 1) {
    for (int tp = 1; tp <= c.n_heads; ++tp) {
      if (c.n_heads % tp || c.n_kv_heads % tp) continue;
      try {
        if (memory_plan(c, ec, tp, pp).total() <= limit) return tp;
      } catch (const loom::error&) {  // a split tp cannot make (hidden units, vocabulary)
      }
    }
    return 0;
  }
  const llama::config& model_config() const noexcept { return this->model().config(); }
  /// The adapters' names, in adapter order (what a request's `model` field names).
  std::vector<std::string> adapter_names() const {
    std::vector<std::string> n;
    for (const auto& a : this->model().adapters()) n.push_back(a.name());
    return n;
  }
};

}  // namespace llama
