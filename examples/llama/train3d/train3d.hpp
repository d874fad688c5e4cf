#pragma once
// 3D-parallel LLaMA training: data x tensor x pipeline parallel, ZeRO stage 0-3 over the
// data-parallel group of every (tp, pp) coordinate. One `trainer` per rank; all ranks of the
// world construct theirs together (the mesh is a collective).
//
// ZeRO is the library's zero::engine (through zero::any_engine, the stage read at run time),
// one per model chunk, over the chunk's data-parallel group. Its layout has one entry per
// unit of the stage model (the embedding, each block, the head; llama3d.hpp), so stage 3
// gathers a unit at a time inside the pipeline stage, with the engine's prefetch and its
// stage3_max_live_parameters cap, in the order the pipeline schedule uses the units (the
// gather trace is made from the schedule's ops before the first step).
//
// A step, on every rank:
//   1. Run the pipeline schedule (GPipe, 1F1B or interleaved, pipeline/schedule.hpp) with
//      pipeline::executor over the pp group: it proves the schedule, owns the tensors that
//      cross stage boundaries and sends/receives them; this trainer's stage_adapter runs the
//      forward / backward passes of the stage model. Each micro-batch's loss is scaled by 1/m.
//      The layers read their parameters from the engine (stages 0-2: its resident buffer;
//      stage 3: acquire / release of each unit) and add their gradients into the engine's
//      accumulation buffer.
//   2. Tied embeddings with pp > 1: the first and last stage add each other's gradient of
//      their tok_embeddings shard, so both copies take the same update.
//   3. The engine reduces the gradients over dp: all-reduce (stage 0, 1) or reduce-scatter
//      into this rank's slices (2, 3).
//   4. Global gradient norm over all three dimensions: each rank sums the squares of the
//      elements it owns (its dp slices, canonical copies only: tp-replicated norms and GQA
//      replicas and the tied copy count once), one all-reduce over the world. A non-finite
//      norm (fp16 overflow) is therefore seen by every rank: every rank skips the step and
//      feeds the same overflow flag to its loss scaler (train_options::loss_scaler: backward
//      runs with dloss = scale / m, the update divides by the scale), so the scalers agree.
//   5. The engine's apply(): AdamW on its fp32 master (the whole model for stage 0, this
//      rank's slices for 1-3), then parameters refreshed (cast, all-gathered over dp, or
//      cast into the shard for stage 3).
//
// Data: the global batch of a step is dp * m micro-batches [micro_batch, seq]; data-parallel
// rank d runs micro-batches d*m .. d*m+m-1, so the loss curve does not depend on the mesh.
//
// LoRA (train_options::lora): the base is frozen (unless parameter groups below unfreeze it)
// and the engine holds the adapters only (lora3d.hpp): every ZeRO stage partitions their gradients, optimizer state (and, stage 3,
// parameters) over dp; the base stays in the model's own buffers, replicated over dp, with no
// optimizer state, and its untouched copy W0 of each adapted weight is kept aside. A step
// merges (W_eff = W0 + scaling B A, the adapters acquired unit by unit in the engine's trace),
// runs the schedule, turns the adapted weights' gradients into the adapters' (the trace's
// backward half), then reduces, clips and applies as above. docs/lora.md.
//
// Parameter groups (train_options::groups): every tensor of a chunk (LoRA: every adapter
// factor) is an element range of its engine's layout with the group group_of() gives its name
// (train_options::group_name). Before each step the schedule's trainable_at(step, total_steps)
// says which groups train; the engine steps each range with its group's AdamW settings and
// step count and skips a frozen group's (zero::engine::set_groups), on each rank its own
// slices, so ZeRO holds. A group's lr follows the run's schedule: at a step where the
// schedule gives lr(t) for the configured lr0, the group steps with lr_g * lr(t) / lr0 (its
// rate replaces lr0 and keeps warmup and decay); its weight_decay replaces the run's. A
// group's Adam step count starts when it first trains (bias correction per group: its first
// update has the size of a fresh optimizer's). Its moments are allocated then too, not before
// (train_options::lazy_group_state, zero::engine::set_groups: the engine keeps every element's
// fp32 master and each group's moments in a buffer of its own), and a base that never trains
// is kept out of the engine altogether by LoRA. Frozen groups are left out of the
// gradient norm (clipping sees what trains).
// Under LoRA, a chunk whose schedule never trains a base tensor keeps its base out of any
// engine (the LoRA-only memory). One whose schedule does gets a second engine over its base
// (chunk_state::base): the model reads the base from that engine's resident buffer and writes
// the base's gradient into its accumulation buffer, both engines reduce, count in the norm and
// apply. Under ZeRO-3 that engine keeps no resident copy: the model reads each unit through
// trained_base_source, which gathers it as engine_source does and points the unit's frozen
// ops (the adapted projections) at the gathered unit for the use (frozen_projection::use_unit).
// lora_merged needs the resident copy there (ZeRO 0-2). init_from_hf reads such a base into
// the base engine's master (read_frozen_base), which every step's refresh starts from.
// A quantised base (train_options::lora_base bf16 / nf4, QLoRA): the blocks' projections are
// not in the model's flat buffer at all; each rank quantises its own shards once (from the
// initialised or HF values) into a frozen_projection behind the layer, which computes
// y = x deq(W)^T + s (x A^T) B^T and its backward unmerged. A step copies the adapters out of
// the engine (unit by unit, the same trace as merging), the passes add the adapters' gradients
// straight into the engine's accumulation buffer, and afterwards the replicated factor's
// gradient is summed over the tensor group. Nothing of the base trains (no unfreezing).
// Under ZeRO-3 the quantised base is partitioned over dp as ZeRO-3 partitions parameters: each
// rank keeps 1/dp of every projection's packed bytes, and the model reads its units through a
// param_source (base_source) that all-gathers a block's bytes around each use of the block,
// forward, backward and recompute, with the library's all-gather plan and scheduler over the
// passes' order of blocks (partitioned_base.hpp). ZeRO 0-2 keep it whole on every rank.
// An fp32 base runs unmerged the same way: a frozen_projection over each adapted layer's own
// slot in the model's buffer (no W0 copy; dW only when an engine trains the base). With LoRA
// dropout each pass of a micro-batch first sets the context the ops draw their masks from
// (step, the micro-batch's first token in the global batch: lora_dropout_at), so the masks do
// not depend on the mesh and a recompute under checkpointing draws the forward's; evaluation:
// none. Unmerged, nothing in the stage model's flat buffer trains unless a base engine does:
// the model is built without a gradient buffer (stage_model's gradients = false) and its
// layers compute input gradients only -- no weight, bias, norm or embedding gradient.
// train_options::lora_merged (fp32, no dropout; the tests' oracle) merges W0 + scaling B A into
// the weights each step instead and keeps a gradient buffer of the base's size: its adapted
// part is the G the adapters' gradients are made from; with no base engine only the
// projections write into it (stage_model::set_projection_grads_only); with one, the refreshed
// base becomes the next step's W0. docs/lora.md, "No gradient for a frozen base".

#include "lora3d.hpp"
#include "partitioned_base.hpp"

#include <llama/model3d/llama3d.hpp>

#include <loom/amp/loss_scaler.hpp>
#include <loom/comm/communicator.hpp>
#include <loom/comm/mesh.hpp>
#include <loom/core/buffer.hpp>
#include <loom/core/memory.hpp>
#include <loom/optim/param_groups.hpp>
#include <loom/pipeline/executor.hpp>
#include <loom/pipeline/schedule.hpp>
#include <loom/sched/all_gather_plan.hpp>
#include <loom/zero/adamw.hpp>
#include <loom/zero/any_engine.hpp>
#include <loom/zero/flat_layout.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace llama3d {

struct train_options {
  loom::comm::mesh_shape mesh{};
  int zero_stage = 0;
  std::string schedule = "1f1b";  ///< gpipe | 1f1b | interleaved
  int chunks = 1;                 ///< model chunks per stage (interleaved: v >= 1, m a multiple of pp)
  int micro_batches = 2;          ///< m, per data-parallel rank and step
  index_t micro_batch_size = 1;
  index_t seq = 16;
  loom::zero::adamw_config adamw{};
  float gradient_clipping = 0.f;  ///< max global norm; 0: off
  /// ZeRO-3's stage3_prefetch_bucket_size, _max_live_parameters, _param_persistence_threshold
  /// (elements; a unit of at most the threshold stays gathered)
  loom::sched::all_gather_options stage3{};
  /// offload_optimizer: fp32 master and Adam moments in host memory (cpu: on the host
  /// backend, where they are already) or in a memory-mapped file under nvme_path (nvme)
  loom::zero::offload_device offload_optimizer = loom::zero::offload_device::none;
  std::string nvme_path;
  std::uint64_t seed = 1234;
  /// Activation checkpointing: each micro-batch in flight keeps its block inputs and one
  /// block's activations, recomputed block by block in backward (ds_config's
  /// activation_checkpointing.enabled).
  bool checkpointing = false;
  /// 1 (none: fp32, bfloat16), or ds_config's fp16 section (loom::zero::loss_scaler_from)
  loom::amp::any_loss_scaler loss_scaler{loom::amp::static_loss_scaler(1.f)};
  /// LoRA adapters on a frozen base (PEFT's fields, lora3d.hpp)
  std::optional<loom::lora::config> lora;
  /// LoRA: how the base's projections are held (lora3d.hpp): fp32, or quantised, bf16 or nf4
  /// (QLoRA: dequantised inside the GEMMs); every one run unmerged, y = x W^T + s (x A^T) B^T.
  /// `nf4` is the format (block_size must divide every projection shard's row length).
  llama3d::lora_base lora_base = llama3d::lora_base::fp32;
  /// LoRA on an fp32 base without dropout: merge W0 + s B A into the projections each step and
  /// make the adapters' gradients from the weights' gradient G instead (lora3d.hpp, "merged").
  /// The same results by other arithmetic; the tests' oracle of the unmerged path. It holds a
  /// gradient buffer of the base's size and W0 and computes every projection's dW, so it is
  /// about twice the memory and 1.6-1.9x the step time (docs/benchmarks.md): not a default.
  bool lora_merged = false;
  loom::quant::nf4_options nf4{.block_size = 64, .double_quant = true, .absmax_block_size = 256};
  /// Parameter groups and progressive unfreezing (optim/param_groups.hpp; see "Parameter
  /// groups" below). No groups and no phases: one group, every parameter trains every step.
  loom::optim::param_groups groups;
  /// Groups: a group's Adam moments allocated at the first step that trains it (true), or all
  /// up front (false; the results are the same bit for bit -- the moments start at zero either
  /// way -- so this only trades memory before unfreezing; zero::engine_options).
  bool lazy_group_state = true;
  /// The run's optimizer steps: the unfreezing phases are fractions of it (needed with phases).
  std::int64_t total_steps = 0;
  /// The name a group's globs match for a tensor of loom's name (layers.3.attention.wq.weight,
  /// layers.3.attention.wq.lora_A.weight); unset: loom's name. llama-train gives HF's / PEFT's.
  std::function<std::string(const std::string&)> group_name;

  void validate() const {
    LOOM_CHECK(zero_stage >= 0 && zero_stage <= 3, "llama3d: zero_stage must be 0, 1, 2 or 3, got zero_stage=", zero_stage);
    LOOM_CHECK(schedule == "gpipe" || schedule == "1f1b" || schedule == "interleaved", "llama3d: schedule '", schedule,
               "' is not supported (gpipe, 1f1b, interleaved)");
    LOOM_CHECK(chunks >= 1, "llama3d: chunks must be >= 1, got chunks=", chunks);
    LOOM_CHECK(micro_batches >= 1, "llama3d: micro_batches must be >= 1, got ", micro_batches);
    LOOM_CHECK(micro_batch_size >= 1 && seq >= 1, "llama3d: micro_batch_size=", micro_batch_size, " seq=", seq);
    LOOM_CHECK(gradient_clipping >= 0.f, "llama3d: gradient_clipping must be >= 0, got ", gradient_clipping);
    if (lora_merged) {
      LOOM_CHECK(lora, "llama3d: lora_merged needs LoRA adapters, got lora=none");
      LOOM_CHECK(lora_base == lora_base::fp32 && lora->lora_dropout == 0.0, "llama3d: lora_merged needs LoRA on an fp32 "
                 "base without dropout, got lora_base=", to_string(lora_base), " lora_dropout=", lora->lora_dropout);
    }
    LOOM_CHECK(groups.phases.empty() || total_steps >= 1, "llama3d: progressive_unfreezing needs total_steps >= 1 (the run's "
               "length the phases are fractions of), got total_steps=", total_steps);
  }
  /// Whether the optimizer is split by parameter groups.
  bool grouped() const noexcept { return !groups.groups.empty() || !groups.phases.empty(); }
};

/// The synthetic corpus of the tests and the demo: each row counts with a stride from a
/// random start (learnable); row r of global micro-batch g at step t depends on (seed, t, g, r).
inline void counting_batch(std::uint64_t seed, std::int64_t step, int g, index_t rows, index_t seq, index_t vocab,
                           std::span<std::int32_t> tokens, std::span<std::int32_t> targets) {
  const loom::counter_rng rng(seed);
  for (index_t r = 0; r < rows; ++r) {
    const std::uint64_t key = (static_cast<std::uint64_t>(step) * 1000003u + static_cast<std::uint64_t>(g)) * 1009u +
                              static_cast<std::uint64_t>(r);
    const auto start = static_cast<index_t>(rng.uniform(2 * key) * float(vocab));
    const index_t stride = 1 + static_cast<index_t>(rng.uniform(2 * key + 1) * 3.f);
    for (index_t i = 0; i < seq; ++i) {
      tokens[static_cast<std::size_t>(r * seq + i)] = static_cast<std::int32_t>((start + i * stride) % vocab);
      targets[static_cast<std::size_t>(r * seq + i)] = static_cast<std::int32_t>((start + (i + 1) * stride) % vocab);
    }
  }
}

/// Where a step's time went on this rank.
struct step_stats {
  double loss = 0;        ///< mean over the global batch (the same on every rank)
  double grad_norm = 0;   ///< global norm before clipping
  bool skipped = false;   ///< non-finite gradient: no update on any rank
  float loss_scale = 1.f; ///< the scale this step's backward ran with
  double seconds = 0;
  double busy_seconds = 0;  ///< forward + backward compute of this stage (bubble = 1 - busy / pipeline time)
  double pipeline_seconds = 0;
};

template <loom::ops::param_type P, loom::ops::compute_type T, loom::comm::communicator C>
class trainer {
  using engine_t = loom::zero::any_engine<P, C, T>;
  // ZeRO-3: the stage model's layers read each unit through the engine.
  struct engine_source final : param_source<P> {
    engine_t* engine = nullptr;
    std::span<P> acquire(std::size_t unit) override {
      engine->acquire_layer(unit);
      return engine->parameter(unit);
    }
    void release(std::size_t unit) override { engine->release_layer(unit); }
  };
  struct counted_range {
    std::size_t offset, numel, group;
  };
  struct chunk_state;
  // ZeRO-3 with a quantised base: every unit from the model's own buffers, and around each use
  // of a block its projections' packed bytes gathered over dp (partitioned_base), the frozen
  // ops pointed at them for the use.
  struct base_source final : param_source<P> {
    chunk_state* ck = nullptr;
    std::span<P> acquire(std::size_t unit) override {
      if (const std::ptrdiff_t b = ck->unit_block[unit]; b >= 0) {
        ck->qbase->acquire(static_cast<std::size_t>(b));
        for (const std::size_t p : ck->block_projections[static_cast<std::size_t>(b)])
          ck->projections[p]->use_bytes(ck->qbase->bytes(p));
      }
      return ck->model->layout().unit(ck->model->params(), unit);
    }
    void release(std::size_t unit) override {
      if (const std::ptrdiff_t b = ck->unit_block[unit]; b >= 0) {
        for (const std::size_t p : ck->block_projections[static_cast<std::size_t>(b)]) ck->projections[p]->use_bytes({});
        ck->qbase->release(static_cast<std::size_t>(b));
      }
    }
  };
  // LoRA whose schedule trains the fp32 base under ZeRO-3: each unit from the base engine
  // (gathered, as engine_source), the unit's frozen ops pointed at it for the use.
  struct trained_base_source final : param_source<P> {
    chunk_state* ck = nullptr;
    std::span<P> acquire(std::size_t unit) override {
      ck->base->acquire_layer(unit);
      const std::span<P> p = ck->base->parameter(unit);
      for (const std::size_t k : ck->unit_projections[unit])
        ck->projections[k]->use_unit(p, ck->model->layout().unit_begin(unit));
      return p;
    }
    void release(std::size_t unit) override {
      for (const std::size_t k : ck->unit_projections[unit]) ck->projections[k]->use_unit({}, 0);
      ck->base->release_layer(unit);
    }
  };
  // One model chunk of this rank (virtual stage chunk * pp + stage) with its ZeRO engine.
  struct chunk_state {
    std::unique_ptr<stage_model<P, T, C>> model;
    std::unique_ptr<engine_t> zero;
    engine_source source;
    std::vector<loom::sched::trace_step> train_trace;
    std::vector<counted_range> counted;  // canonical ranges: the norm
    std::unique_ptr<stage_lora<P, T>> lora;  // LoRA: the adapters (the engine's layout) ...
    loom::buffer<P> frozen;                  // ... and the adapted base weights as they were (W0)
    // unmerged adapters: one frozen op per projection shard (a quantised base: every projection,
    // model.frozen_shards() order; an fp32 base with dropout: the adapted layers), the
    // adapters' step copy they read and where their gradients go
    std::vector<std::unique_ptr<frozen_projection<P, T>>> projections;
    loom::buffer<P> live;
    typename frozen_projection<P, T>::adapter_state live_state;
    bool unmerged() const noexcept { return !projections.empty(); }
    // ZeRO-3 with a quantised base: the projections' bytes partitioned over dp, gathered block
    // by block in the passes' order (base_trace) through qsource; each unit's block (-1: none)
    // and each block's partitioned projections
    std::unique_ptr<partitioned_base<C>> qbase;
    std::vector<loom::sched::trace_step> base_trace;
    base_source qsource;
    std::vector<std::ptrdiff_t> unit_block;
    std::vector<std::vector<std::size_t>> block_projections;
    // LoRA whose schedule unfreezes base tensors: the base in an engine of its own too; under
    // ZeRO-3 the model reads it through bsource, each unit's frozen ops (unit_projections)
    // pointed at the gathered unit
    std::unique_ptr<engine_t> base;
    std::vector<counted_range> base_counted;
    std::vector<loom::sched::trace_step> base_train_trace;
    trained_base_source bsource;
    std::vector<std::vector<std::size_t>> unit_projections;
    // (engine, its canonical ranges) of each engine of the chunk
    std::vector<std::pair<engine_t*, const std::vector<counted_range>*>> engines() {
      std::vector<std::pair<engine_t*, const std::vector<counted_range>*>> e{{zero.get(), &counted}};
      if (base) e.push_back({base.get(), &base_counted});
      return e;
    }
  };

 public:
  using batch_fn = std::function<void(std::int64_t step, int global_mb, std::span<std::int32_t> tokens,
                                      std::span<std::int32_t> targets)>;

  /// mr: every allocation of this rank. param_mr (optional): the parameters alone -- the
  /// engine's parameter buffer or shard, persistent copies and stage-3 gather arena -- so its
  /// peak is the most parameter memory the rank held. optimizer_mr (optional): the optimizer
  /// state alone (fp32 master and Adam moments, not offloaded).
  trainer(C& world, const llama::config& cfg, const train_options& opt, loom::memory_resource& mr,
          loom::memory_resource* param_mr = nullptr, loom::memory_resource* optimizer_mr = nullptr)
      : opt_((opt.validate(), opt)), mesh_(world, opt.mesh), mr_(&mr), optimizer_mr_(optimizer_mr), sched_(make_schedule(cfg, opt)),
        exec_(sched_, mesh_.pp(), static_cast<std::size_t>(opt.micro_batch_size * opt.seq * cfg.dim), mr),
        dp_(static_cast<std::size_t>(opt.mesh.dp)), rank_(static_cast<std::size_t>(mesh_.coord().dp)),
        tokens_(static_cast<std::size_t>(opt.micro_batch_size * opt.seq), mr),
        targets_(static_cast<std::size_t>(opt.micro_batch_size * opt.seq), mr), base_lr_(opt.adamw.lr), n_layers_(cfg.n_layers) {
    if (opt.grouped()) loom::optim::check(opt_.groups);  // appends `base`
    const int p = opt.mesh.pp, v = sched_.chunks;
    loom::zero::engine_options eo;
    eo.adamw = opt.adamw;
    eo.stage3 = opt.stage3;
    eo.offload_optimizer = opt.offload_optimizer;
    eo.nvme_path = opt.nvme_path;
    eo.lazy_group_state = opt.lazy_group_state;
    // LoRA run unmerged (a quantised base, or dropout): nothing in the model's flat buffer
    // trains -- the adapters' gradients go to their engine -- so the model keeps no gradient
    // buffer; a schedule that unfreezes base tensors gives it the base engine's (use_storage)
    const bool unmerged_lora = opt.lora && !opt.lora_merged;
    for (int c = 0; c < v; ++c) {
      auto ck = std::make_unique<chunk_state>();
      ck->model = std::make_unique<stage_model<P, T, C>>(cfg, mesh_.tp(), c * p + mesh_.coord().pp, p * v, mr, dp_,
                                                         opt.lora && opt.lora_base != lora_base::fp32, !unmerged_lora);
      auto& m = *ck->model;
      m.set_checkpointing(opt.checkpointing);
      m.init(opt.seed);  // the counter-RNG model, whole, in the model's own buffer; the engine takes its fp32 master from it
      if (opt.lora) {
        chunks_.push_back(make_lora_chunk(std::move(ck), cfg, eo, param_mr));
        continue;
      }
      ck->train_trace = trace_of(sched_, c, m, false);
      ck->zero = make_base_engine(m, eo, param_mr, ck->train_trace);
      if (opt.zero_stage == 3) {
        ck->source.engine = ck->zero.get();
        m.set_param_source(&ck->source);
      }
      use_groups(*ck->zero, ck->counted, m.shards());
      chunks_.push_back(std::move(ck));
    }
  }

  const loom::comm::mesh<C>& mesh() const noexcept { return mesh_; }
  loom::comm::mesh<C>& mesh() noexcept { return mesh_; }
  /// Model chunk c of this rank (virtual stage c * pp + stage); one chunk unless interleaved.
  stage_model<P, T, C>& model(int c = 0) noexcept { return *chunks_[static_cast<std::size_t>(c)]->model; }
  int chunks() const noexcept { return static_cast<int>(chunks_.size()); }
  const loom::pipeline::schedule& schedule() const noexcept { return sched_; }
  std::int64_t steps() const noexcept { return step_; }
  /// Mean loss over the dp x m micro-batches `data` gives for batch number `index` (called as
  /// data(index, global_mb, tokens, targets)), forward only: no gradients, no update, the
  /// parameters as the last step left them. The pipeline runs pipeline::forward_only; ZeRO-3
  /// gathers each chunk's parameters for the pass and drops them after, as a step does.
  double evaluate(const batch_fn& data, std::int64_t index = 0) {
    data_ = data;
    if (!eval_exec_)
      eval_exec_ = std::make_unique<loom::pipeline::executor<T, C>>(
          loom::pipeline::forward_only(opt_.mesh.pp, opt_.micro_batches, sched_.chunks), mesh_.pp(),
          static_cast<std::size_t>(opt_.micro_batch_size * opt_.seq * model().cfg().dim), *mr_);
    for (std::size_t c = 0; c < chunks_.size(); ++c) {
      auto& ck = *chunks_[c];
      const auto forward = trace_of(eval_exec_->plan_schedule(), static_cast<int>(c), *ck.model, true);
      ck.zero->set_gather_trace(ck.lora ? lora_trace(*ck.lora, false) : forward);
      if (ck.base) ck.base->set_gather_trace(forward);
      if (ck.qbase) ck.qbase->set_trace(block_trace(ck, forward));
    }
    lora_merge();
    stage_adapter run{this, index, 0.0, 0.0, true};
    eval_exec_->run(run);
    for (auto& ck : chunks_) {
      ck->zero->set_gather_trace(ck->train_trace);
      if (ck->base) ck->base->set_gather_trace(ck->base_train_trace);
      if (ck->qbase) ck->qbase->set_trace(ck->base_trace);
    }
    return global_loss(run.loss);
  }

  /// The parameter groups as checked (with `base`); empty without groups.
  const loom::optim::param_groups& groups() const noexcept { return opt_.groups; }
  /// Which groups train at the next step (trainable_at at steps()); one flag per group.
  std::vector<bool> trainable_now() const { return trainable_at(step_); }
  /// The group of the tensor (or LoRA factor) of loom's name `name`.
  std::size_t group_of(const std::string& name) const {
    return loom::optim::group_of(opt_.groups, opt_.group_name ? opt_.group_name(name) : name, n_layers_);
  }

  /// The learning rate of the next step (a schedule sets it before each step).
  void set_lr(float lr) {
    opt_.adamw.lr = lr;
    for (auto& ck : chunks_)
      for (auto [e, counted] : ck->engines()) e->set_lr(lr);
  }
  /// The loss scaler (its state goes into checkpoints).
  loom::amp::any_loss_scaler& loss_scaler() noexcept { return opt_.loss_scaler; }
  const train_options& options() const noexcept { return opt_; }
  /// After a checkpoint's state was loaded into the engines: `steps` optimizer steps were
  /// taken (the engines' AdamW step and the schedule's position). Collective.
  void restore(std::int64_t steps) {
    LOOM_CHECK(steps >= 0, "llama3d::trainer::restore: steps must be >= 0, got steps=", steps);
    for (auto& ck : chunks_)
      for (auto [e, counted] : ck->engines()) e->restore(steps);
    step_ = steps;
    // each group's AdamW t: the steps the schedule let it train before `steps`
    for (std::size_t g = 0; opt_.grouped() && g < opt_.groups.groups.size(); ++g) {
      std::int64_t t = 0;
      for (std::int64_t s = 0; s < steps; ++s) t += trainable_at(s)[g] ? 1 : 0;
      for (auto& ck : chunks_)
        for (auto [e, counted] : ck->engines()) e->set_group_steps(g, t);
    }
  }
  /// The ZeRO engine of model chunk c (its layout has one entry per unit of the chunk).
  engine_t& engine(int c = 0) noexcept { return *chunks_[static_cast<std::size_t>(c)]->zero; }
  /// LoRA whose schedule trains base tensors of chunk c: the engine over that chunk's base
  /// (the model's layout, as engine() without LoRA); null otherwise.
  engine_t* base_engine(int c = 0) noexcept { return chunks_[static_cast<std::size_t>(c)]->base.get(); }
  /// Whether any chunk of this rank has a base engine.
  bool has_base_engine() const noexcept {
    return std::ranges::any_of(chunks_, [](const auto& ck) { return ck->base != nullptr; });
  }

  /// One optimizer step over dp * m micro-batches from `data`.
  step_stats step(const batch_fn& data) {
    using clock = std::chrono::steady_clock;
    data_ = data;
    const auto t0 = clock::now();
    step_stats st;
    auto& pp = mesh_.pp();
    const float loss_scale = loom::amp::scale_of(opt_.loss_scaler);
    st.loss_scale = loss_scale;
    for (auto& ck : chunks_) {
      ck->model->zero_grad();  // the engine's accumulation buffer (merged LoRA: the model's own; unmerged: none)
      if (ck->lora && ck->unmerged()) std::ranges::fill(ck->zero->accumulation(), T(0));  // the passes add the adapters' gradients
    }
    const std::vector<bool> on = opt_.grouped() ? trainable_now() : std::vector<bool>{};
    for (std::size_t g = 0; g < on.size(); ++g) {
      const auto& x = opt_.groups.groups[g];
      loom::zero::adamw_config c = opt_.adamw;
      if (x.lr) c.lr = *x.lr * (base_lr_ > 0.f ? opt_.adamw.lr / base_lr_ : 1.f);
      if (x.weight_decay) c.weight_decay = *x.weight_decay;
      for (auto& ck : chunks_)
        for (auto [e, counted] : ck->engines()) e->set_group(g, c, on[g]);
    }
    lora_merge();
    // 1. the pipeline schedule, run by the executor through the stage adapter
    const auto tp0 = clock::now();
    stage_adapter run{this, step_, 0.0, 0.0};
    exec_.run(run);
    st.pipeline_seconds = seconds(tp0, clock::now());
    st.busy_seconds = run.busy;
    double sq = 0;
    for (auto& ck : chunks_) {
      auto& md = *ck->model;
      // 2. tied embedding copies (virtual stage 0 on pp rank 0, the last one on pp rank p-1);
      // LoRA: the adapters' gradients from the adapted weights' (the frozen base needs none)
      if (ck->lora) lora_backward(*ck);
      if (std::span<T> gs = md.tied_grad(); !gs.empty() && (!ck->lora || ck->base)) {
        loom::buffer<T> other(gs.size(), *mr_);
        const int peer = md.first_stage() ? opt_.mesh.pp - 1 : 0;
        constexpr int to_last = 32766, to_first = 32767;  // the executor's transfers are all matched by now
        if (md.first_stage()) pp.send(std::span<const T>(gs), peer, to_last), pp.recv(other.span(), peer, to_first);
        else pp.recv(other.span(), peer, to_last), pp.send(std::span<const T>(gs), peer, to_first);
        for (std::size_t i = 0; i < gs.size(); ++i) gs[i] += other[i];
      }
      // 3. gradients over dp, 4. the squares this rank counts in the global norm
      for (auto [e, counted] : ck->engines()) {
        e->reduce_accumulated();
        e->for_each_gradient_slice([&](std::size_t lo, std::span<const T> g) {
          for (const auto& [off, n, grp] : *counted) {
            if (!on.empty() && !on[grp]) continue;
            const std::size_t b0 = std::max(off, lo), b1 = std::min(off + n, lo + g.size());
            for (std::size_t i = b0; i < b1; ++i) sq += double(g[i - lo]) * double(g[i - lo]);
          }
        });
      }
    }
    float scale = 1.f / (static_cast<float>(dp_) * loss_scale);  // gradients sum over dp and carry the loss scale
    mesh_.world().all_reduce(std::span<const double>(&sq, 1), std::span<double>(&sq, 1), loom::comm::reduce_op::sum);
    st.grad_norm = std::sqrt(sq) * scale;
    st.loss = global_loss(run.loss);
    // every rank saw the same norm, so every scaler takes the same decision (and one at its
    // minimum scale throws the same loom::error on every rank)
    const bool apply = loom::amp::update(opt_.loss_scaler, !std::isfinite(st.grad_norm));
    if (!apply) {
      st.skipped = true;  // parameters and master are unchanged
      st.seconds = seconds(t0, clock::now());
      return st;
    }
    if (opt_.gradient_clipping > 0.f && st.grad_norm > opt_.gradient_clipping)
      scale *= static_cast<float>(opt_.gradient_clipping / st.grad_norm);
    // 5. AdamW on the master, then the parameters are refreshed
    ++step_;
    for (auto& ck : chunks_) {
      for (auto [e, counted] : ck->engines()) e->apply(scale);
      // LoRA with a trained base: the refreshed base is the next step's W0
      if (ck->base && !ck->unmerged()) ck->lora->capture(std::span<const P>(ck->model->params()), ck->frozen.span());
    }
    st.seconds = seconds(t0, clock::now());
    return st;
  }

  /// The fp32 master weights in the single-rank layout (llama::model's flat buffer), on
  /// every rank; collective over the world.
  std::vector<float> consolidated_master() {
    LOOM_CHECK(!opt_.lora, "llama3d::trainer::consolidated_master: a LoRA run's engine holds the adapters "
               "(consolidated_lora()); the frozen base is base_params()");
    const auto full = full_layout(chunks_.front()->model->cfg());
    return consolidate(full.size(), [&](chunk_state& ck) -> const tp::shard_list& { return ck.model->shards(); },
                       [&](chunk_state& ck, const std::string& n) { return ck.model->full_offset(n); });
  }

  /// LoRA: the adapters' fp32 master in the single-rank adapter layout (lora_full_layout),
  /// on every rank; collective over the world.
  std::vector<float> consolidated_lora() {
    LOOM_CHECK(opt_.lora, "llama3d::trainer::consolidated_lora: this run has no LoRA adapters");
    const auto full = lora_full_layout(*opt_.lora, chunks_.front()->model->cfg());
    return consolidate(full.size(), [&](chunk_state& ck) -> const tp::shard_list& { return ck.lora->shards(); },
                       [&](chunk_state&, const std::string& n) { return full.find(n).offset; });
  }

  /// LoRA: the base in the single-rank layout (full_layout), fp32, on every rank: the frozen
  /// base (W0; a quantised one dequantised) with what a schedule trained of it; collective over
  /// the world.
  std::vector<float> consolidated_base() {
    LOOM_CHECK(opt_.lora, "llama3d::trainer::consolidated_base: this run has no LoRA adapters (consolidated_master())");
    const auto full = full_layout(chunks_.front()->model->cfg());
    std::vector<float> out(full.size(), 0.f);
    const auto offset_of = [&](const std::string& n) { return full.find(n).offset; };
    for (std::size_t c = 0; c < chunks_.size(); ++c) {
      auto& ck = *chunks_[c];
      const std::vector<P> local = base_params(static_cast<int>(c));  // collective over dp (ZeRO-3 base engine)
      store_canonical(ck.model->shards(), std::span<const P>(local), out, offset_of);
      const auto& fs = ck.model->frozen_shards();  // a quantised base's projections
      for (std::size_t k = 0; k < fs.size(); ++k) {
        const std::vector<float> v = frozen_values(k, static_cast<int>(c));  // collective over dp when partitioned
        tp::shard_desc one = fs[k];
        one.local_offset = 0;
        store_canonical(tp::shard_list{one}, std::span<const float>(v), out, offset_of);
      }
    }
    mesh_.world().all_reduce(std::span<const float>(out), std::span<float>(out), loom::comm::reduce_op::sum);
    return out;
  }

  /// LoRA: the adapters of model chunk c (null without LoRA).
  const stage_lora<P, T>* lora(int c = 0) const noexcept { return chunks_[static_cast<std::size_t>(c)]->lora.get(); }
  /// LoRA: after the models' base parameters were written (a pretrained base read in), keep
  /// them as the frozen W0 (the next step merges the adapters into them).
  void lora_capture_base() {
    for (auto& ck : chunks_)
      if (ck->lora && !ck->unmerged()) ck->lora->capture(std::span<const P>(ck->model->params()), ck->frozen.span());
  }
  /// Quantised LoRA base: projection shard k of model chunk c's frozen_shards() re-quantised
  /// from fp32 values [rows, cols] (a pretrained base read in).
  void set_frozen_weight(int c, std::size_t k, loom::tensor_view<const float, loom::host, 2> w) {
    auto& ck = *chunks_[static_cast<std::size_t>(c)];
    LOOM_CHECK(k < ck.projections.size(), "llama3d::trainer::set_frozen_weight: projection ", k, " of ",
               ck.projections.size(), " (lora_base=", to_string(opt_.lora_base), ")");
    auto& p = *ck.projections[k];
    if (p.holds_weight()) return p.set_weight(w);
    LOOM_CHECK(w.extent(0) == p.rows() && w.extent(1) == p.cols(), "llama3d::trainer::set_frozen_weight: a [", w.extent(0), ", ",
               w.extent(1), "] weight for projection ", k, " of [", p.rows(), ", ", p.cols(), "]");
    std::vector<std::uint8_t> packed(frozen_projection<P, T>::packed_bytes(opt_.lora_base, p.rows(), p.cols(), opt_.nf4));
    frozen_projection<P, T>::pack(opt_.lora_base, w, opt_.nf4, packed);
    ck.qbase->store(k, packed);  // this rank's slice of it
  }
  /// Quantised LoRA base: projection shard k of chunk c (its frozen op).
  const frozen_projection<P, T>& frozen_weight(std::size_t k, int c = 0) const {
    return *chunks_[static_cast<std::size_t>(c)]->projections.at(k);
  }
  /// Quantised LoRA base: projection shard k of chunk c dequantised whole; collective over dp
  /// when the base is partitioned (ZeRO-3: its bytes gathered for the call).
  std::vector<float> frozen_values(std::size_t k, int c = 0) {
    auto& ck = *chunks_[static_cast<std::size_t>(c)];
    auto& p = *ck.projections.at(k);
    if (p.holds_weight()) return p.dequantized();
    LOOM_CHECK(ck.qbase, "llama3d::trainer::frozen_values: projection ", k, " is not quantised (lora_base=",
               to_string(opt_.lora_base), ")");
    const std::vector<std::uint8_t> packed = ck.qbase->gather(k);
    p.use_bytes(packed);
    std::vector<float> v = p.dequantized();
    p.use_bytes({});
    return v;
  }
  /// The partitioned quantised base of chunk c (ZeRO-3 with lora_base bf16 / nf4; null otherwise).
  const partitioned_base<C>* frozen_partition(int c = 0) const noexcept { return chunks_[static_cast<std::size_t>(c)]->qbase.get(); }
  /// Bytes this rank's quantised projections hold, measured by their memory resource (0 for
  /// an fp32 base, which is in the model's buffer): each projection held whole, or, partitioned
  /// (ZeRO-3), this rank's slices and the gather arena.
  std::size_t frozen_base_bytes() const noexcept { return base_mr_.current_bytes(); }

  /// LoRA: this rank's base parameters as frozen (the model's buffer with each adapted weight
  /// back at W0) of model chunk c. A base trained under ZeRO-3 is in no resident buffer: its
  /// engine's fp32 master, gathered (the parameters are its cast), so the call is collective
  /// over dp there.
  std::vector<P> base_params(int c = 0) {
    chunk_state& ck = *chunks_[static_cast<std::size_t>(c)];
    if (ck.base && ck.model->params().empty()) {
      const std::vector<float> master = ck.base->gather_master();
      std::vector<P> out(ck.model->size(), P(0.f));
      for (std::size_t i = 0; i < std::min(out.size(), master.size()); ++i) out[i] = static_cast<P>(master[i]);
      return out;
    }
    std::vector<P> out(ck.model->params().begin(), ck.model->params().end());
    if (ck.lora && !ck.unmerged())
      for (const auto& it : ck.lora->items())
        std::copy_n(ck.frozen.begin() + static_cast<std::ptrdiff_t>(it.frozen_offset), it.rows * it.cols,
                    out.begin() + static_cast<std::ptrdiff_t>(it.base_offset));
    return out;
  }

 private:
  // The canonical copies of `shards` (replica 0, on dp rank 0: dp replicas and replicated
  // tensor-parallel shards hold the same values) from `local` into `out` at full offsets, so a
  // sum over the world afterwards has each element from exactly one rank.
  template <class E, class OffsetOf>
  void store_canonical(const tp::shard_list& shards, std::span<const E> local, std::vector<float>& out,
                       OffsetOf offset_of) const {
    tp::shard_list canon;
    for (const auto& s : shards)
      if (s.replica == 0 && mesh_.coord().dp == 0) canon.push_back(s);
    tp::store_shards(canon, local, std::span<float>(out), offset_of);
  }

  // Each chunk's engine master gathered over dp, its canonical shards (dp rank 0, replica 0)
  // stored at full offsets, summed over the world (every element written by one rank).
  template <class ShardsOf, class OffsetOf>
  std::vector<float> consolidate(std::size_t size, ShardsOf shards_of, OffsetOf offset_of) {
    std::vector<float> out(size, 0.f);
    for (auto& ck : chunks_) {
      const std::vector<float> local = ck->zero->gather_master();  // this chunk's flat buffer, whole (collective over dp)
      store_canonical(shards_of(*ck), std::span<const float>(local), out,
                      [&](const std::string& n) { return offset_of(*ck, n); });
    }
    // every element is written by exactly one rank (dp 0, replica 0); the others hold 0
    mesh_.world().all_reduce(std::span<const float>(out), std::span<float>(out), loom::comm::reduce_op::sum);
    return out;
  }

 public:
  /// Model-state bytes of this rank, summed over its chunks (the engines' accounting).
  loom::zero::state_bytes bytes() const noexcept {
    loom::zero::state_bytes b;
    for (const auto& ck : chunks_)
      for (const auto* z : {ck->zero.get(), ck->base.get()}) {
        if (!z) continue;
        const auto e = z->bytes();
        b.parameters += e.parameters, b.persistent += e.persistent, b.gradients += e.gradients, b.optimizer += e.optimizer;
      }
    return b;
  }

 private:
  // LoRA: chunk ck (its model made and initialised) gets its adapters and an engine over them;
  // the model keeps its own buffers (the frozen base, and, merged, the weights' gradients).
  std::unique_ptr<chunk_state> make_lora_chunk(std::unique_ptr<chunk_state> ck, const llama::config& cfg,
                                               const loom::zero::engine_options& eo, loom::memory_resource* param_mr) {
    auto& m = *ck->model;
    // a schedule that trains base tensors of this chunk: the base goes into an engine (its
    // gradients and optimizer state exist only then), the model reading it from there
    std::string trained;
    for (const auto& sh : m.shards())
      if (trained.empty() && opt_.grouped() && !opt_.groups.phases.empty() && ever_trains(group_of(sh.name))) trained = sh.name;
    if (!trained.empty()) {
      LOOM_CHECK(opt_.zero_stage <= 2 || !opt_.lora_merged, "llama3d: lora_merged with progressive_unfreezing training base "
                 "tensor '", trained, "' (group \"", opt_.groups.groups[group_of(trained)].name, "\") needs ZeRO stage <= 2 "
                 "(the merged path keeps the base's weights resident), got zero_stage=", opt_.zero_stage,
                 "; the unmerged default runs under ZeRO-3");
      ck->base_train_trace = trace_of(sched_, static_cast<int>(chunks_.size()), m, false);
      ck->base = make_base_engine(m, eo, param_mr, ck->base_train_trace);
      use_groups(*ck->base, ck->base_counted, m.shards());
      if (opt_.zero_stage == 3) {
        ck->bsource.ck = ck.get();
        m.set_param_source(&ck->bsource);
      }
    }
    const bool quantised = opt_.lora_base != lora_base::fp32;
    if (quantised) check_quantised_base(cfg, trained);
    ck->lora = std::make_unique<stage_lora<P, T>>(*opt_.lora, cfg, quantised ? m.frozen_layout() : m.layout(),
                                                   quantised ? m.frozen_shards() : m.shards(), m.layers(),
                                                   tp::tp_rank::of(mesh_.tp()), dp_);
    const auto& lo = *ck->lora;
    if (quantised) {
      quantise_base(*ck, static_cast<int>(chunks_.size()));
    } else if (!opt_.lora_merged) {
      unmerge_base(*ck);
    } else {
      ck->frozen = loom::buffer<P>(lo.frozen_size(), *mr_);
      lo.capture(m.params(), ck->frozen.span());
      // merged, no base engine: the adapters' gradients are made from the adapted projections'
      // G alone, so the embedding, norms and head need none
      if (!ck->base) m.set_projection_grads_only(true);
    }
    const auto& L = lo.layout();
    std::vector<P> init(L.size(), P(0.f));
    lo.init(std::span<P>(init), opt_.seed);
    std::vector<loom::zero::param_spec> units;
    for (std::size_t u = 0; u < lo.units(); ++u)
      units.push_back({"lora unit " + std::to_string(u), {static_cast<index_t>(L.unit_end(u) - L.unit_begin(u))}, u});
    ck->train_trace = lora_trace(lo, true);
    ck->zero = loom::zero::make_engine<P, C, T>(
        opt_.zero_stage, mesh_.dp(), loom::zero::flat_layout(std::move(units), dp_), eo, {mr_, mr_, mr_, param_mr, optimizer_mr_},
        [&](std::size_t u, std::size_t first, std::span<float> out) {
          for (std::size_t i = 0; i < out.size(); ++i) out[i] = static_cast<float>(init[L.unit_begin(u) + first + i]);
        },
        ck->train_trace);
    use_groups(*ck->zero, ck->counted, lo.shards());
    if (ck->unmerged())
      ck->live_state = {&lo.layout(), ck->live.span(), ck->zero->accumulation(), static_cast<T>(opt_.lora->scaling()),
                        opt_.lora->lora_dropout, opt_.seed};
    return ck;
  }
  // What a quantised base cannot do, refused naming the option.
  void check_quantised_base(const llama::config& cfg, const std::string& trained) const {
    const char* b = to_string(opt_.lora_base);
    LOOM_CHECK(trained.empty(), "llama3d: lora_base=", b, " is frozen and quantised, but progressive_unfreezing trains base "
               "tensor '", trained, "' (group \"", opt_.groups.groups[trained.empty() ? 0 : group_of(trained)].name,
               "\"); unfreezing the base needs lora_base=fp32");
    LOOM_CHECK((std::is_same_v<T, float>), "llama3d: lora_base=", b, " dequantises into float GEMMs; the compute type here "
               "has ", sizeof(T) * 8, " bits (use float)");
    LOOM_CHECK(opt_.mesh.tp <= cfg.n_kv_heads, "llama3d: lora_base=", b, " with n_kv_heads (", cfg.n_kv_heads,
               ") < tp (", opt_.mesh.tp, "): replicated key/value heads sum weight gradients a frozen base has none of");
  }
  // Each projection shard of chunk ck (chunk index c) quantised from its initial values into a
  // frozen op behind its layer, the targets' adapters attached; the adapters' step copy
  // allocated. ZeRO-3: the packed bytes of each projection above the persistence threshold
  // partitioned over dp (this rank keeps its slice; the op reads the block's gathered copy
  // during each use of the block), the rest held whole by their ops as under ZeRO 0-2.
  void quantise_base(chunk_state& ck, int c) {
    auto& m = *ck.model;
    const auto& fs = m.frozen_shards();
    const bool partition = opt_.zero_stage == 3;
    std::vector<std::size_t> bytes(fs.size(), 0), block(fs.size());
    std::size_t params = 0;
    for (std::size_t k = 0; k < fs.size(); ++k) {
      const auto& s = fs[k];
      block[k] = static_cast<std::size_t>(std::stoll(s.name.substr(std::string("layers.").size())) - m.layers().first);
      if (partition && static_cast<std::size_t>(s.rows * s.cols) > opt_.stage3.persistence_threshold) {
        bytes[k] = frozen_projection<P, T>::packed_bytes(opt_.lora_base, s.rows, s.cols, opt_.nf4);
        params += static_cast<std::size_t>(s.rows * s.cols);
      }
    }
    if (partition)
      ck.qbase = std::make_unique<partitioned_base<C>>(mesh_.dp(), std::span<const std::size_t>(bytes), std::span<const std::size_t>(block),
                                                       opt_.stage3, params, base_mr_);
    std::vector<float> w;
    std::vector<std::uint8_t> packed;
    for (std::size_t k = 0; k < fs.size(); ++k) {
      const auto& s = fs[k];
      w.resize(static_cast<std::size_t>(s.rows * s.cols));
      m.init_shard(s, std::span<float>(w), opt_.seed);
      const auto v = loom::make_view(static_cast<const float*>(w.data()), s.rows, s.cols);
      if (bytes[k] == 0) {
        ck.projections.push_back(std::make_unique<frozen_projection<P, T>>(opt_.lora_base, v, opt_.nf4, base_mr_));
        continue;
      }
      ck.projections.push_back(std::make_unique<frozen_projection<P, T>>(opt_.lora_base, s.rows, s.cols, opt_.nf4));
      packed.resize(bytes[k]);
      frozen_projection<P, T>::pack(opt_.lora_base, v, opt_.nf4, packed);
      ck.qbase->store(k, packed);
    }
    if (partition) {
      ck.block_projections.assign(static_cast<std::size_t>(m.layers().layers()), {});
      for (std::size_t k = 0; k < fs.size(); ++k)
        if (bytes[k]) ck.block_projections[block[k]].push_back(k);
      ck.unit_block.assign(m.units(), -1);
      for (index_t l = 0; l < m.layers().layers(); ++l) ck.unit_block[m.unit_of_block(l)] = l;
      ck.base_trace = block_trace(ck, trace_of(sched_, c, m, false));
      ck.qbase->set_trace(ck.base_trace);
      ck.qsource.ck = &ck;
      m.set_param_source(&ck.qsource);
    }
    const auto shard_at = [&](auto&& match) {
      for (std::size_t k = 0; k < fs.size(); ++k)
        if (match(fs[k])) return k;
      LOOM_THROW("llama3d: no projection shard matches");
    };
    m.for_each_frozen_linear([&](std::size_t offset, loom::nn::linear<T>& l) {
      l.set_frozen(ck.projections[shard_at([&](const tp::shard_desc& s) { return s.local_offset == offset; })].get());
    });
    // a fused target (query_key_value, dense_h_to_4h) has a shard per part (q/k/v, gate/up), each
    // its own op: all take the tensor's adapter, each with its rows of B (PEFT's one LoRA per
    // fused module: one A, B over the fused rows)
    for (const auto& it : ck.lora->items())
      for (std::size_t k = 0; k < fs.size(); ++k)
        if (fs[k].name == it.name + ".weight")
          ck.projections[k]->attach(&it.ad, it.unit, &ck.live_state, it.name,
                                    static_cast<index_t>((fs[k].local_offset - it.base_offset) / static_cast<std::size_t>(it.cols)));
    ck.live = loom::buffer<P>(ck.lora->layout().size(), *mr_);
  }
  // An fp32 base run unmerged (every fp32 run but lora_merged's; with lora_dropout > 0 no
  // merged weight could express the mask on the LoRA branch alone): a frozen op over its own
  // weight in the model's buffer behind each adapted layer --
  // each part of a fused tensor (q/k/v, gate/up) its own, with its rows of B -- computing the
  // base term and the adapter's; the base's weight gradient only where an engine trains it.
  void unmerge_base(chunk_state& ck) {
    auto& m = *ck.model;
    const std::span<T> grads = ck.base ? std::span<T>(m.grads()) : std::span<T>{};
    // ZeRO-3 with a base engine: no resident parameters; each op reads its gathered unit
    const bool gathered = ck.base && m.params().empty();
    if (gathered) ck.unit_projections.assign(m.units(), {});
    m.for_each_frozen_linear([&](std::size_t offset, loom::nn::linear<T>& l) {
      for (const auto& it : ck.lora->items()) {
        const auto cols = static_cast<std::size_t>(it.cols);
        if (offset < it.base_offset || offset >= it.base_offset + static_cast<std::size_t>(it.rows) * cols) continue;
        if (gathered) {
          std::size_t u = 0;
          while (m.layout().unit_end(u) <= offset) ++u;
          ck.unit_projections[u].push_back(ck.projections.size());
        }
        ck.projections.push_back(std::make_unique<frozen_projection<P, T>>(std::span<P>(m.params()), grads, offset,
                                                                           l.out_features(), l.in_features()));
        ck.projections.back()->attach(&it.ad, it.unit, &ck.live_state, it.name,
                                      static_cast<index_t>((offset - it.base_offset) / cols));
        l.set_frozen(ck.projections.back().get());
      }
    });
    ck.live = loom::buffer<P>(ck.lora->layout().size(), *mr_);
  }
  // An engine over the stage model's units, its fp32 master from the model's parameters; the
  // model then reads its parameters from it and adds its gradients into it.
  std::unique_ptr<engine_t> make_base_engine(stage_model<P, T, C>& m, const loom::zero::engine_options& eo,
                                             loom::memory_resource* param_mr, std::vector<loom::sched::trace_step> trace) {
    const auto& L = m.layout();
    std::vector<loom::zero::param_spec> units;
    for (std::size_t u = 0; u < m.units(); ++u)
      units.push_back({"unit " + std::to_string(u), {static_cast<index_t>(L.unit_end(u) - L.unit_begin(u))}, u});
    const std::span<const P> init = m.params();
    auto e = loom::zero::make_engine<P, C, T>(
        opt_.zero_stage, mesh_.dp(), loom::zero::flat_layout(std::move(units), dp_), eo, {mr_, mr_, mr_, param_mr, optimizer_mr_},
        [&](std::size_t u, std::size_t first, std::span<float> out) {
          for (std::size_t i = 0; i < out.size(); ++i) out[i] = static_cast<float>(init[L.unit_begin(u) + first + i]);
        },
        std::move(trace));
    m.use_storage(e->resident_parameters(), e->accumulation());
    return e;
  }
  // The chunk's canonical ranges for the norm and, with groups, each tensor's range as its
  // group's in the engine (the shards tile the chunk's tensors in its layout).
  void use_groups(engine_t& zero, std::vector<counted_range>& counted, const tp::shard_list& shards) {
    std::vector<loom::zero::group_range> ranges;
    for (const auto& sh : shards) {
      const auto n = static_cast<std::size_t>(sh.rows * sh.cols);
      const std::size_t g = opt_.grouped() ? group_of(sh.name) : 0;
      if (sh.replica == 0) counted.push_back({sh.local_offset, n, g});
      ranges.push_back({sh.local_offset, sh.local_offset + n, g});
    }
    if (opt_.grouped()) zero.set_groups(std::move(ranges), opt_.groups.groups.size());
  }
  std::vector<bool> trainable_at(std::int64_t step) const {
    return loom::optim::trainable_at(opt_.groups, step, std::max<std::int64_t>(opt_.total_steps, 1));
  }
  bool ever_trains(std::size_t g) const {
    for (const auto& ph : opt_.groups.phases)
      for (const auto& n : ph.trainable)
        if (n == opt_.groups.groups[g].name) return true;
    return false;
  }

  // A LoRA step's use of the adapters' units: merge (forward, in order), then (training) the
  // gradients (backward, in reverse).
  static std::vector<loom::sched::trace_step> lora_trace(const stage_lora<P, T>& lo, bool training) {
    std::vector<loom::sched::trace_step> t;
    for (std::size_t u = 0; u < lo.units(); ++u) t.push_back({u, loom::sched::pass::forward});
    for (std::size_t u = lo.units(); training && u-- > 0;) t.push_back({u, loom::sched::pass::backward});
    return t;
  }
  // W_eff = W0 + scaling B A in every chunk's model (nothing without LoRA).
  // A quantised base instead: the adapters copied into the chunk's step copy the frozen ops read.
  void lora_merge() {
    for (auto& ck : chunks_) {
      if (!ck->lora) continue;
      const auto& L = ck->lora->layout();
      for (std::size_t u = 0; u < ck->lora->units(); ++u) {
        ck->zero->acquire_layer(u);
        if (ck->unmerged()) std::ranges::copy(ck->zero->parameter(u), L.unit(ck->live.span(), u).begin());
        else ck->lora->merge(u, ck->zero->parameter(u), ck->frozen.span(), ck->model->params());
        ck->zero->release_layer(u);
      }
    }
  }
  // The adapters' gradients of chunk ck from its model's weight gradients, into the engine's
  // accumulation buffer (written: zeroed first).
  // A quantised base: the passes added them already (partial over the tensor group for the
  // replicated factor, summed here).
  void lora_backward(chunk_state& ck) {
    std::span<T> acc = ck.zero->accumulation();
    if (!ck.unmerged()) std::fill(acc.begin(), acc.end(), T(0));
    loom::nn::workspace<T> ws(0, *mr_);
    const auto& L = ck.lora->layout();
    for (std::size_t u = ck.lora->units(); u-- > 0;) {
      ck.zero->acquire_layer(u);
      if (!ck.unmerged()) ck.lora->backward(mesh_.tp(), u, ck.zero->parameter(u), L.unit(acc, u), std::span<const T>(ck.model->grads()), ws);
      else
        for (const auto& it : ck.lora->items())
          if (it.unit == u) it.ad.sum_replicated_grad(mesh_.tp(), L.unit(acc, u));
      ck.zero->release_layer(u);
    }
  }

  // A trace of chunk ck's units as its partitioned base's: the blocks' uses (stage block indices).
  static std::vector<loom::sched::trace_step> block_trace(const chunk_state& ck, const std::vector<loom::sched::trace_step>& units) {
    std::vector<loom::sched::trace_step> t;
    for (const auto& st : units)
      if (const std::ptrdiff_t b = ck.unit_block[st.layer]; b >= 0) t.push_back({static_cast<std::size_t>(b), st.phase});
    return t;
  }

  // The order in which chunk c's units are used in one run of schedule s on this stage: each
  // forward / backward op of the chunk reads its units in the model's pass order.
  std::vector<loom::sched::trace_step> trace_of(const loom::pipeline::schedule& s, int c, const stage_model<P, T, C>& m,
                                                bool forward_only) const {
    const auto fwd = m.forward_units(), bwd = m.backward_units();
    std::vector<loom::sched::trace_step> t;
    for (const auto& o : s.ops[static_cast<std::size_t>(mesh_.coord().pp)]) {
      if (o.chunk != c) continue;
      if (o.kind == loom::pipeline::op_kind::forward)
        for (std::size_t u : fwd) t.push_back({u, loom::sched::pass::forward});
      if (o.kind == loom::pipeline::op_kind::backward && !forward_only)
        for (std::size_t u : bwd) t.push_back({u, loom::sched::pass::backward});
    }
    return t;
  }

  static loom::pipeline::schedule make_schedule(const llama::config& cfg, const train_options& o) {
    const int p = o.mesh.pp, m = o.micro_batches;
    LOOM_CHECK(o.schedule == "interleaved" || o.chunks == 1, "llama3d: chunks=", o.chunks,
               " needs --schedule interleaved (", o.schedule, " runs one chunk per stage)");
    LOOM_CHECK(cfg.n_layers >= p * o.chunks, "llama3d: n_layers (", cfg.n_layers, ") must be >= pp x chunks (", p, " x ",
               o.chunks, "): every model chunk needs a layer");
    if (o.schedule == "gpipe") return loom::pipeline::gpipe(p, m);
    if (o.schedule == "1f1b") return loom::pipeline::one_f_one_b(p, m);
    return loom::pipeline::interleaved_one_f_one_b(p, m, o.chunks);
  }

  // What pipeline::executor calls: one pass of micro-batch mb on model chunk c. The executor
  // owns the tensors that cross stage boundaries; the model keeps what stays.
  struct stage_adapter {
    trainer* t;
    std::int64_t step;
    double loss, busy;
    bool eval = false;  ///< forward only: the micro-batch's slot is given back after its forward
    void forward(int mb, int c, std::span<const T> input, std::span<T> output) {
      auto& mdl = t->model(c);
      const index_t b = t->opt_.micro_batch_size, s = t->opt_.seq;
      t->data_(step, t->mesh_.coord().dp * t->opt_.micro_batches + mb, t->tokens_.span(), t->targets_.span());
      t->set_dropout_context(c, step, mb, !eval);
      const auto c0 = std::chrono::steady_clock::now();
      if (!input.empty()) std::copy(input.begin(), input.end(), mdl.input(mb, b, s).begin());
      loss += double(mdl.forward(mb, loom::make_view(static_cast<const std::int32_t*>(t->tokens_.data()), b, s),
                                 loom::make_view(static_cast<const std::int32_t*>(t->targets_.data()), b, s)));
      if (!output.empty()) std::copy_n(mdl.output(mb).begin(), output.size(), output.begin());
      if (eval) mdl.release(mb);
      busy += seconds(c0, std::chrono::steady_clock::now());
    }
    void backward(int mb, int c, std::span<const T>, std::span<const T> grad_output, std::span<T> grad_input) {
      auto& mdl = t->model(c);
      const auto c0 = std::chrono::steady_clock::now();
      if (!grad_output.empty()) std::copy(grad_output.begin(), grad_output.end(), mdl.output_grad(mb).begin());
      t->set_dropout_context(c, step, mb, true);  // a recompute (checkpointing) and the backward draw the forward's masks
      mdl.backward(mb, T(loom::amp::scale_of(t->opt_.loss_scaler)) / T(t->opt_.micro_batches));
      if (!grad_input.empty()) std::copy_n(mdl.input_grad(mb).begin(), grad_input.size(), grad_input.begin());
      mdl.release(mb);
      busy += seconds(c0, std::chrono::steady_clock::now());
    }
  };

  // The LoRA dropout's context for chunk c's next pass: step, and the global micro-batch mb's
  // first token in the step's global batch (lora_dropout_at); training false: no dropout.
  void set_dropout_context(int c, std::int64_t step, int mb, bool training) {
    auto& st = chunks_[static_cast<std::size_t>(c)]->live_state;
    const std::int64_t global_mb = std::int64_t(mesh_.coord().dp) * opt_.micro_batches + mb;
    st.step = step, st.training = training;
    st.first_token = global_mb * opt_.micro_batch_size * opt_.seq;
  }

  /// The mean loss of the global batch from each rank's sum over its micro-batches (the last
  /// virtual stage's tp rank 0 ranks hold it), the same on every rank.
  double global_loss(double local_sum) {
    const bool holds_loss = chunks_.back()->model->last_stage() && mesh_.coord().tp == 0;
    double loss = holds_loss ? local_sum / double(opt_.micro_batches) / double(dp_) : 0.0;
    mesh_.world().all_reduce(std::span<const double>(&loss, 1), std::span<double>(&loss, 1), loom::comm::reduce_op::sum);
    return loss;
  }

  static double seconds(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
    return std::chrono::duration<double>(b - a).count();
  }

  train_options opt_;
  loom::host_memory_resource base_mr_{"frozen base"};  // a quantised LoRA base's projections (declared before chunks_: outlives them)
  loom::comm::mesh<C> mesh_;
  loom::memory_resource* mr_;
  loom::memory_resource* optimizer_mr_;  // optional: the optimizer state's own (tests measure it)
  loom::pipeline::schedule sched_;
  loom::pipeline::executor<T, C> exec_;
  std::unique_ptr<loom::pipeline::executor<T, C>> eval_exec_;  // forward_only, made on the first evaluate()
  batch_fn data_;
  std::size_t dp_, rank_;
  loom::buffer<std::int32_t> tokens_, targets_;
  std::vector<std::unique_ptr<chunk_state>> chunks_;
  std::int64_t step_ = 0;
  float base_lr_;  // the configured lr (the schedule's lr0): a group's lr scales by lr(t) / lr0
  std::int64_t n_layers_;  // the whole model's (group layer ranges count from its end)
};

}  // namespace llama3d

// The trainers llama_train_lib (examples/llama/train) instantiates once: every parameter type
// a run takes (float, bfloat16, half; fp32 compute) over loom::comm::any_comm, the one
// communicator type of every backend (one rank, thread ranks, MPI), so each is compiled once
// rather than once per backend. A unit that links the library sees them declared extern (the
// library's LLAMA3D_EXTERN_TRAINERS) and so does not instantiate them again: the trainer is the
// costliest template to compile, and the program, the demo, the benchmarks and the tests all use
// it. What a unit needs beyond these (the tests' double-precision trainers) it instantiates itself
// (tests/examples/llama/model3d: once, for the group and the MPI test).
#ifdef LLAMA3D_EXTERN_TRAINERS
#include <loom/comm/any_comm.hpp>
#include <loom/core/dtype.hpp>
#define LLAMA3D_TRAINERS(EXTERN)                                               \
  EXTERN template class llama3d::trainer<float, float, loom::comm::any_comm>;          \
  EXTERN template class llama3d::trainer<loom::bfloat16, float, loom::comm::any_comm>; \
  EXTERN template class llama3d::trainer<loom::half, float, loom::comm::any_comm>;
LLAMA3D_TRAINERS(extern)
#endif
