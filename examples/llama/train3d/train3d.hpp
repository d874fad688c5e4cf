#pragma once
// 3D-parallel LLaMA training: data x tensor x pipeline parallel, ZeRO stage 0-3 over the
// data-parallel group of every (tp, pp) coordinate. One `trainer` per rank; all ranks of the
// world construct theirs together (the mesh is a collective).
//
// A step, on every rank:
//   1. ZeRO-3: all-gather this stage's parameters over dp (they are sharded between steps).
//   2. Run the pipeline schedule (GPipe or 1F1B, pipeline/schedule.hpp) with
//      pipeline::executor over the pp group: it proves the schedule, owns the tensors that
//      cross stage boundaries and sends/receives them; this trainer's stage_adapter runs the
//      forward / backward passes of the stage model. Each micro-batch's loss is scaled by 1/m.
//   3. Tied embeddings with pp > 1: the first and last stage add each other's gradient of
//      their tok_embeddings shard, so both copies take the same update.
//   4. Gradients over dp: all-reduce (stage 0, 1) or reduce-scatter into this rank's slice
//      (stage 2, 3; the full gradient buffer is then dropped until the next step).
//   5. Global gradient norm over all three dimensions: each rank sums the squares of the
//      elements it owns (its dp slice, canonical copies only: tp-replicated norms and GQA
//      replicas and the tied copy count once), one all-reduce over the world. A non-finite
//      norm (fp16 overflow) is therefore seen by every rank: every rank skips the step and
//      feeds the same overflow flag to its loss scaler (train_options::loss_scaler: backward
//      runs with dloss = scale / m, the update divides by the scale), so the scalers agree.
//   6. AdamW (zero/adamw.hpp) on the fp32 master: the whole buffer (stage 0) or this rank's
//      slice (1-3); then parameters are refreshed: cast (0), all-gathered over dp (1, 2), or
//      cast into the shard and the full buffer dropped (3).
// The flat buffers are padded to a multiple of dp, so rank d owns [d*S, (d+1)*S) of every one
// of them. ZeRO-3 here gathers a whole stage at once (the stage's layers are what the
// pipeline keeps live anyway); layer-granular prefetch inside a stage is zero::engine's
// (single stage) and is not used by this trainer.
//
// Data: the global batch of a step is dp * m micro-batches [micro_batch, seq]; data-parallel
// rank d runs micro-batches d*m .. d*m+m-1, so the loss curve does not depend on the mesh.

#include <llama/model3d/llama3d.hpp>

#include <loom/amp/loss_scaler.hpp>
#include <loom/comm/communicator.hpp>
#include <loom/comm/mesh.hpp>
#include <loom/core/buffer.hpp>
#include <loom/core/memory.hpp>
#include <loom/pipeline/executor.hpp>
#include <loom/pipeline/schedule.hpp>
#include <loom/zero/adamw.hpp>
#include <loom/zero/optimizer_state.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
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
  std::uint64_t seed = 1234;
  /// Activation checkpointing: each micro-batch in flight keeps its block inputs and one
  /// block's activations, recomputed block by block in backward (ds_config's
  /// activation_checkpointing.enabled).
  bool checkpointing = false;
  /// 1 (none: fp32, bfloat16), or ds_config's fp16 section (examples::make_loss_scaler)
  loom::amp::any_loss_scaler loss_scaler{loom::amp::static_loss_scaler(1.f)};

  void validate() const {
    LOOM_CHECK(zero_stage >= 0 && zero_stage <= 3, "llama3d: zero_stage must be 0, 1, 2 or 3, got zero_stage=", zero_stage);
    LOOM_CHECK(schedule == "gpipe" || schedule == "1f1b" || schedule == "interleaved", "llama3d: schedule '", schedule,
               "' is not supported (gpipe, 1f1b, interleaved)");
    LOOM_CHECK(chunks >= 1, "llama3d: chunks must be >= 1, got chunks=", chunks);
    LOOM_CHECK(micro_batches >= 1, "llama3d: micro_batches must be >= 1, got ", micro_batches);
    LOOM_CHECK(micro_batch_size >= 1 && seq >= 1, "llama3d: micro_batch_size=", micro_batch_size, " seq=", seq);
    LOOM_CHECK(gradient_clipping >= 0.f, "llama3d: gradient_clipping must be >= 0, got ", gradient_clipping);
  }
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
  // One model chunk of this rank (virtual stage chunk * pp + stage) with its ZeRO state.
  struct chunk_state {
    std::unique_ptr<stage_model<P, T, C>> model;
    std::size_t shard = 0;  // elements of each flat buffer this dp rank owns
    std::unique_ptr<loom::zero::optimizer_state> state;
    loom::buffer<T> grad_shard;   // ZeRO 2, 3
    loom::buffer<P> param_shard;  // ZeRO 3
    loom::buffer<P> send;         // ZeRO 1, 2: this rank's refreshed slice
    std::vector<std::pair<std::size_t, std::size_t>> counted;  // canonical (offset, numel): norm
  };

 public:
  using batch_fn = std::function<void(std::int64_t step, int global_mb, std::span<std::int32_t> tokens,
                                      std::span<std::int32_t> targets)>;

  trainer(C& world, const llama::config& cfg, const train_options& opt, loom::memory_resource& mr)
      : opt_((opt.validate(), opt)), mesh_(world, opt.mesh), mr_(&mr), sched_(make_schedule(cfg, opt)),
        exec_(sched_, mesh_.pp(), static_cast<std::size_t>(opt.micro_batch_size * opt.seq * cfg.dim), mr),
        dp_(static_cast<std::size_t>(opt.mesh.dp)), rank_(static_cast<std::size_t>(mesh_.coord().dp)),
        tokens_(static_cast<std::size_t>(opt.micro_batch_size * opt.seq), mr),
        targets_(static_cast<std::size_t>(opt.micro_batch_size * opt.seq), mr) {
    const int p = opt.mesh.pp, v = sched_.chunks;
    for (int c = 0; c < v; ++c) {
      auto ck = std::make_unique<chunk_state>();
      ck->model = std::make_unique<stage_model<P, T, C>>(cfg, mesh_.tp(), c * p + mesh_.coord().pp, p * v, mr, dp_);
      auto& m = *ck->model;
      m.set_checkpointing(opt.checkpointing);
      ck->shard = m.size() / dp_;
      ck->state = std::make_unique<loom::zero::optimizer_state>(opt.zero_stage >= 1 ? ck->shard : m.size(),
                                                                loom::zero::offload_device::none, mr, mr);
      // fp32 master from the counter RNG (the model's init), then the ZeRO layout
      m.init(opt.seed);
      auto master = ck->state->master();
      auto prm = m.params();
      const std::size_t first = opt.zero_stage >= 1 ? rank_ * ck->shard : 0;
      for (std::size_t i = 0; i < master.size(); ++i) master[i] = static_cast<float>(prm[first + i]);
      std::fill(ck->state->exp_avg().begin(), ck->state->exp_avg().end(), 0.f);
      std::fill(ck->state->exp_avg_sq().begin(), ck->state->exp_avg_sq().end(), 0.f);
      if (opt.zero_stage >= 2) ck->grad_shard = loom::buffer<T>(ck->shard, mr);
      if (opt.zero_stage == 3) {
        ck->param_shard = loom::buffer<P>(ck->shard, mr);
        std::copy_n(prm.begin() + static_cast<std::ptrdiff_t>(first), ck->shard, ck->param_shard.begin());
        m.drop_params();
      }
      if (opt.zero_stage >= 2) m.drop_grads();
      if (opt.zero_stage == 1 || opt.zero_stage == 2) ck->send = loom::buffer<P>(ck->shard, mr);
      for (const auto& sh : m.shards())
        if (sh.replica == 0) ck->counted.push_back({sh.local_offset, static_cast<std::size_t>(sh.rows * sh.cols)});
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
    auto& dp = mesh_.dp();
    for (auto& ck : chunks_)
      if (opt_.zero_stage == 3) {
        ck->model->ensure_params();
        dp.all_gather(std::span<const P>(ck->param_shard.span()), ck->model->params());
      }
    stage_adapter run{this, index, 0.0, 0.0, true};
    eval_exec_->run(run);
    for (auto& ck : chunks_)
      if (opt_.zero_stage == 3) ck->model->drop_params();
    return global_loss(run.loss);
  }

  /// The learning rate of the next step (a schedule sets it before each step).
  void set_lr(float lr) { opt_.adamw.lr = lr; }

  /// One optimizer step over dp * m micro-batches from `data`.
  step_stats step(const batch_fn& data) {
    using clock = std::chrono::steady_clock;
    data_ = data;
    const auto t0 = clock::now();
    step_stats st;
    auto& pp = mesh_.pp();
    auto& dp = mesh_.dp();
    const float loss_scale = loom::amp::scale_of(opt_.loss_scaler);
    st.loss_scale = loss_scale;
    for (auto& ck : chunks_) {
      auto& md = *ck->model;
      if (opt_.zero_stage == 3) {  // 1. gather this chunk's parameters
        md.ensure_params();
        dp.all_gather(std::span<const P>(ck->param_shard.span()), md.params());
      }
      md.ensure_grads();
      md.zero_grad();
    }
    // 2. the pipeline schedule, run by the executor through the stage adapter
    const auto tp0 = clock::now();
    stage_adapter run{this, step_, 0.0, 0.0};
    exec_.run(run);
    st.pipeline_seconds = seconds(tp0, clock::now());
    st.busy_seconds = run.busy;
    for (auto& ck : chunks_) {
      auto& md = *ck->model;
      if (opt_.zero_stage == 3) md.drop_params();
      // 3. tied embedding copies (virtual stage 0 on pp rank 0, the last one on pp rank p-1)
      if (std::span<T> gs = md.tied_grad(); !gs.empty()) {
        loom::buffer<T> other(gs.size(), *mr_);
        const int peer = md.first_stage() ? opt_.mesh.pp - 1 : 0;
        constexpr int to_last = 32766, to_first = 32767;  // the executor's transfers are all matched by now
        if (md.first_stage()) pp.send(std::span<const T>(gs), peer, to_last), pp.recv(other.span(), peer, to_first);
        else pp.recv(other.span(), peer, to_last), pp.send(std::span<const T>(gs), peer, to_first);
        for (std::size_t i = 0; i < gs.size(); ++i) gs[i] += other[i];
      }
    }
    // 4. gradients over dp, 5. the squares this rank counts in the global norm
    std::vector<std::span<T>> grad(chunks_.size());  // the part this rank steps, per chunk
    double sq = 0;
    for (std::size_t c = 0; c < chunks_.size(); ++c) {
      auto& ck = *chunks_[c];
      auto& md = *ck.model;
      if (opt_.zero_stage >= 2) {
        dp.reduce_scatter(std::span<const T>(md.grads()), ck.grad_shard.span(), loom::comm::reduce_op::sum);
        md.drop_grads();
        grad[c] = ck.grad_shard.span();
      } else {
        dp.all_reduce(std::span<const T>(md.grads()), md.grads(), loom::comm::reduce_op::sum);
        grad[c] = opt_.zero_stage == 1 ? md.grads().subspan(rank_ * ck.shard, ck.shard) : md.grads();
      }
      const std::size_t lo = rank_ * ck.shard, hi = lo + ck.shard, base = opt_.zero_stage >= 1 ? lo : 0;
      for (const auto& [off, n] : ck.counted) {
        const std::size_t b0 = std::max(off, lo), b1 = std::min(off + n, hi);
        for (std::size_t i = b0; i < b1; ++i) sq += double(grad[c][i - base]) * double(grad[c][i - base]);
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
    // 6. AdamW on the master, then refresh the parameters
    ++step_;
    for (std::size_t c = 0; c < chunks_.size(); ++c) {
      auto& ck = *chunks_[c];
      auto& md = *ck.model;
      loom::zero::adamw_step<T>(ck.state->master(), std::span<const T>(grad[c]), ck.state->exp_avg(), ck.state->exp_avg_sq(),
                                opt_.adamw, step_, scale);
      auto master = ck.state->master();
      if (opt_.zero_stage == 0) {
        auto prm = md.params();
        for (std::size_t i = 0; i < prm.size(); ++i) prm[i] = static_cast<P>(master[i]);
      } else if (opt_.zero_stage == 3) {
        for (std::size_t i = 0; i < ck.shard; ++i) ck.param_shard[i] = static_cast<P>(master[i]);
      } else {
        for (std::size_t i = 0; i < ck.shard; ++i) ck.send[i] = static_cast<P>(master[i]);
        dp.all_gather(std::span<const P>(ck.send.span()), md.params());
      }
    }
    st.seconds = seconds(t0, clock::now());
    return st;
  }

  /// The fp32 master weights in the single-rank layout (llama::model's flat buffer), on
  /// every rank; collective over the world.
  std::vector<float> consolidated_master() {
    auto& dp = mesh_.dp();
    const auto full = full_layout(chunks_.front()->model->cfg());
    std::vector<float> out(full.size(), 0.f);
    for (auto& ck : chunks_) {
      auto& md = *ck->model;
      loom::buffer<float> full_local(md.size(), *mr_);
      auto master = ck->state->master();
      if (opt_.zero_stage >= 1) dp.all_gather(std::span<const float>(master), full_local.span());
      else std::copy(master.begin(), master.end(), full_local.begin());
      tp::shard_list canon;
      for (const auto& s : md.shards())
        if (s.replica == 0 && mesh_.coord().dp == 0) canon.push_back(s);
      tp::store_shards(canon, std::span<const float>(full_local.span()), std::span<float>(out),
                       [&](const std::string& n) { return md.full_offset(n); });
    }
    // every element is written by exactly one rank (dp 0, replica 0); the others hold 0
    mesh_.world().all_reduce(std::span<const float>(out), std::span<float>(out), loom::comm::reduce_op::sum);
    return out;
  }

  /// Model-state bytes of this rank: parameters, gradients, optimizer (what ZeRO divides).
  struct state_bytes {
    std::size_t parameters = 0, gradients = 0, optimizer = 0;
  };
  state_bytes bytes() const noexcept {
    state_bytes b;
    for (const auto& ck : chunks_) {
      const std::size_t n = ck->model->size(), s = ck->shard;
      b.parameters += opt_.zero_stage == 3 ? s * sizeof(P) : n * sizeof(P);
      b.gradients += opt_.zero_stage >= 2 ? s * sizeof(T) : n * sizeof(T);
      b.optimizer += 3 * (opt_.zero_stage >= 1 ? s : n) * sizeof(float);
    }
    return b;
  }

 private:
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
      mdl.backward(mb, T(loom::amp::scale_of(t->opt_.loss_scaler)) / T(t->opt_.micro_batches));
      if (!grad_input.empty()) std::copy_n(mdl.input_grad(mb).begin(), grad_input.size(), grad_input.begin());
      mdl.release(mb);
      busy += seconds(c0, std::chrono::steady_clock::now());
    }
  };

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
  loom::comm::mesh<C> mesh_;
  loom::memory_resource* mr_;
  loom::pipeline::schedule sched_;
  loom::pipeline::executor<T, C> exec_;
  std::unique_ptr<loom::pipeline::executor<T, C>> eval_exec_;  // forward_only, made on the first evaluate()
  batch_fn data_;
  std::size_t dp_, rank_;
  loom::buffer<std::int32_t> tokens_, targets_;
  std::vector<std::unique_ptr<chunk_state>> chunks_;
  std::int64_t step_ = 0;
};

}  // namespace llama3d
