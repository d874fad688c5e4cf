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
//      norm (fp16 overflow) is therefore seen by every rank and every rank skips the step.
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
#include <span>
#include <string>
#include <vector>

namespace llama3d {

struct train_options {
  loom::comm::mesh_shape mesh{};
  int zero_stage = 0;
  std::string schedule = "1f1b";  ///< gpipe | 1f1b
  int micro_batches = 2;          ///< m, per data-parallel rank and step
  index_t micro_batch_size = 1;
  index_t seq = 16;
  loom::zero::adamw_config adamw{};
  float gradient_clipping = 0.f;  ///< max global norm; 0: off
  std::uint64_t seed = 1234;

  void validate() const {
    LOOM_CHECK(zero_stage >= 0 && zero_stage <= 3, "llama3d: zero_stage must be 0, 1, 2 or 3, got zero_stage=", zero_stage);
    LOOM_CHECK(schedule == "gpipe" || schedule == "1f1b", "llama3d: schedule '", schedule,
               "' is not supported (gpipe, 1f1b; interleaved needs several model chunks per stage)");
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
  double seconds = 0;
  double busy_seconds = 0;  ///< forward + backward compute of this stage (bubble = 1 - busy / pipeline time)
  double pipeline_seconds = 0;
};

template <class P, loom::ops::compute_type T, loom::comm::communicator C>
class trainer {
 public:
  using batch_fn = std::function<void(std::int64_t step, int global_mb, std::span<std::int32_t> tokens,
                                      std::span<std::int32_t> targets)>;

  trainer(C& world, const llama::config& cfg, const train_options& opt, loom::memory_resource& mr)
      : opt_((opt.validate(), opt)), mesh_(world, opt.mesh), mr_(&mr),
        model_(cfg, mesh_.tp(), mesh_.coord().pp, opt.mesh.pp, mr, static_cast<std::size_t>(opt.mesh.dp)),
        sched_(opt.schedule == "gpipe" ? loom::pipeline::gpipe(opt.mesh.pp, opt.micro_batches)
                                       : loom::pipeline::one_f_one_b(opt.mesh.pp, opt.micro_batches)),
        exec_(sched_, mesh_.pp(), static_cast<std::size_t>(opt.micro_batch_size * opt.seq * cfg.dim), mr),
        dp_(static_cast<std::size_t>(opt.mesh.dp)), rank_(static_cast<std::size_t>(mesh_.coord().dp)),
        shard_(model_.size() / dp_),
        state_(opt.zero_stage >= 1 ? shard_ : model_.size(), loom::zero::offload_device::none, mr, mr),
        tokens_(static_cast<std::size_t>(opt.micro_batch_size * opt.seq), mr),
        targets_(static_cast<std::size_t>(opt.micro_batch_size * opt.seq), mr) {
    // fp32 master from the counter RNG (the model's init), then the ZeRO layout
    model_.init(opt.seed);
    auto master = state_.master();
    auto p = model_.params();
    const std::size_t first = opt.zero_stage >= 1 ? rank_ * shard_ : 0;
    for (std::size_t i = 0; i < master.size(); ++i) master[i] = static_cast<float>(p[first + i]);
    std::fill(state_.exp_avg().begin(), state_.exp_avg().end(), 0.f);
    std::fill(state_.exp_avg_sq().begin(), state_.exp_avg_sq().end(), 0.f);
    if (opt.zero_stage >= 2) grad_shard_ = loom::buffer<T>(shard_, mr);
    if (opt.zero_stage == 3) {
      param_shard_ = loom::buffer<P>(shard_, mr);
      std::copy_n(p.begin() + static_cast<std::ptrdiff_t>(first), shard_, param_shard_.begin());
      model_.drop_params();
    }
    if (opt.zero_stage >= 2) model_.drop_grads();
    // elements whose gradient this rank counts in the global norm: canonical shards in its slice
    for (const auto& s : model_.shards())
      if (s.replica == 0) counted_.push_back({s.local_offset, static_cast<std::size_t>(s.rows * s.cols)});
    send_ = loom::buffer<P>(shard_, mr);
  }

  const loom::comm::mesh<C>& mesh() const noexcept { return mesh_; }
  loom::comm::mesh<C>& mesh() noexcept { return mesh_; }
  stage_model<P, T, C>& model() noexcept { return model_; }
  const loom::pipeline::schedule& schedule() const noexcept { return sched_; }
  std::int64_t steps() const noexcept { return step_; }
  /// The learning rate of the next step (a schedule sets it before each step).
  void set_lr(float lr) { opt_.adamw.lr = lr; }

  /// One optimizer step over dp * m micro-batches from `data`.
  step_stats step(const batch_fn& data) {
    data_ = data;
    using clock = std::chrono::steady_clock;
    const auto t0 = clock::now();
    step_stats st;
    auto& pp = mesh_.pp();
    auto& dp = mesh_.dp();
    const int m = opt_.micro_batches;
    if (opt_.zero_stage == 3) {  // 1. gather this stage's parameters
      model_.ensure_params();
      dp.all_gather(std::span<const P>(param_shard_.span()), model_.params());
    }
    model_.ensure_grads();
    model_.zero_grad();
    // 2. the pipeline schedule, run by the executor through the stage adapter
    const auto tp0 = clock::now();
    stage_adapter run{this, step_, 0.0, 0.0};
    exec_.run(run);
    const double local_loss = run.loss, busy = run.busy;
    st.pipeline_seconds = seconds(tp0, clock::now());
    st.busy_seconds = busy;
    if (opt_.zero_stage == 3) model_.drop_params();
    // 3. tied embedding copies
    if (auto tied = model_.tied_copy()) {
      auto g = tied->in(model_.grads());
      std::span<T> gs(g.data(), tied->numel());
      tie_buf_ = loom::buffer<T>(gs.size(), *mr_);
      const int peer = model_.first_stage() ? opt_.mesh.pp - 1 : 0;
      constexpr int to_last = 32766, to_first = 32767;  // the executor's transfers are all matched by now
      if (model_.first_stage()) pp.send(std::span<const T>(gs), peer, to_last), pp.recv(tie_buf_.span(), peer, to_first);
      else pp.recv(tie_buf_.span(), peer, to_last), pp.send(std::span<const T>(gs), peer, to_first);
      for (std::size_t i = 0; i < gs.size(); ++i) gs[i] += tie_buf_[i];
      tie_buf_.release();
    }
    // 4. gradients over dp
    std::span<T> grad;  // the part this rank steps
    if (opt_.zero_stage >= 2) {
      dp.reduce_scatter(std::span<const T>(model_.grads()), grad_shard_.span(), loom::comm::reduce_op::sum);
      model_.drop_grads();
      grad = grad_shard_.span();
    } else {
      dp.all_reduce(std::span<const T>(model_.grads()), model_.grads(), loom::comm::reduce_op::sum);
      grad = opt_.zero_stage == 1 ? model_.grads().subspan(rank_ * shard_, shard_) : model_.grads();
    }
    // 5. global norm over dp x tp x pp
    float scale = 1.f / static_cast<float>(dp_);
    double sq = 0;
    const std::size_t lo = rank_ * shard_, hi = lo + shard_, base = opt_.zero_stage >= 1 ? lo : 0;
    for (const auto& [off, n] : counted_) {
      const std::size_t b0 = std::max(off, lo), b1 = std::min(off + n, hi);
      for (std::size_t i = b0; i < b1; ++i) sq += double(grad[i - base]) * double(grad[i - base]);
    }
    mesh_.world().all_reduce(std::span<const double>(&sq, 1), std::span<double>(&sq, 1), loom::comm::reduce_op::sum);
    st.grad_norm = std::sqrt(sq) * scale;
    // the loss of the global batch (last stage, tp rank 0 holds it)
    double loss = (model_.last_stage() && mesh_.coord().tp == 0) ? local_loss / double(m) / double(dp_) : 0.0;
    mesh_.world().all_reduce(std::span<const double>(&loss, 1), std::span<double>(&loss, 1), loom::comm::reduce_op::sum);
    st.loss = loss;
    if (!std::isfinite(st.grad_norm)) {
      st.skipped = true;  // every rank saw the same norm; parameters and master are unchanged
      st.seconds = seconds(t0, clock::now());
      return st;
    }
    if (opt_.gradient_clipping > 0.f && st.grad_norm > opt_.gradient_clipping)
      scale *= static_cast<float>(opt_.gradient_clipping / st.grad_norm);
    // 6. AdamW on the master, then refresh the parameters
    ++step_;
    loom::zero::adamw_step<T>(state_.master(), std::span<const T>(grad), state_.exp_avg(), state_.exp_avg_sq(),
                              opt_.adamw, step_, scale);
    auto master = state_.master();
    if (opt_.zero_stage == 0) {
      auto p = model_.params();
      for (std::size_t i = 0; i < p.size(); ++i) p[i] = static_cast<P>(master[i]);
    } else if (opt_.zero_stage == 3) {
      for (std::size_t i = 0; i < shard_; ++i) param_shard_[i] = static_cast<P>(master[i]);
    } else {
      for (std::size_t i = 0; i < shard_; ++i) send_[i] = static_cast<P>(master[i]);
      dp.all_gather(std::span<const P>(send_.span()), model_.params());
    }
    st.seconds = seconds(t0, clock::now());
    return st;
  }

  /// The fp32 master weights in the single-rank layout (llama::model's flat buffer), on
  /// every rank; collective over the world.
  std::vector<float> consolidated_master() {
    auto& dp = mesh_.dp();
    loom::buffer<float> full_local(model_.size(), *mr_);
    auto master = state_.master();
    if (opt_.zero_stage >= 1) dp.all_gather(std::span<const float>(master), full_local.span());
    else std::copy(master.begin(), master.end(), full_local.begin());
    const auto full = full_layout(model_.cfg());
    std::vector<float> out(full.size(), 0.f);
    tp::shard_list canon;
    for (const auto& s : model_.shards())
      if (s.replica == 0 && mesh_.coord().dp == 0) canon.push_back(s);
    tp::store_shards(canon, std::span<const float>(full_local.span()), std::span<float>(out),
                     [&](const std::string& n) { return model_.full_offset(n); });
    // every element is written by exactly one rank (dp 0, replica 0); the others hold 0
    mesh_.world().all_reduce(std::span<const float>(out), std::span<float>(out), loom::comm::reduce_op::sum);
    return out;
  }

  /// Model-state bytes of this rank: parameters, gradients, optimizer (what ZeRO divides).
  struct state_bytes {
    std::size_t parameters, gradients, optimizer;
  };
  state_bytes bytes() const noexcept {
    const std::size_t n = model_.size();
    const std::size_t params = opt_.zero_stage == 3 ? shard_ * sizeof(P) : n * sizeof(P);
    const std::size_t grads = opt_.zero_stage >= 2 ? shard_ * sizeof(T) : n * sizeof(T);
    return {params, grads, 3 * (opt_.zero_stage >= 1 ? shard_ : n) * sizeof(float)};
  }

 private:
  // What pipeline::executor calls: one pass of micro-batch mb on this stage (one chunk). The
  // executor owns the tensors that cross stage boundaries; the model keeps what stays.
  struct stage_adapter {
    trainer* t;
    std::int64_t step;
    double loss, busy;
    void forward(int mb, int, std::span<const T> input, std::span<T> output) {
      auto& mdl = t->model_;
      const index_t b = t->opt_.micro_batch_size, s = t->opt_.seq;
      t->data_(step, t->mesh_.coord().dp * t->opt_.micro_batches + mb, t->tokens_.span(), t->targets_.span());
      const auto c0 = std::chrono::steady_clock::now();
      if (!input.empty()) std::copy(input.begin(), input.end(), mdl.input(mb, b, s).begin());
      loss += double(mdl.forward(mb, loom::make_view(static_cast<const std::int32_t*>(t->tokens_.data()), b, s),
                                 loom::make_view(static_cast<const std::int32_t*>(t->targets_.data()), b, s)));
      if (!output.empty()) std::copy_n(mdl.output(mb).begin(), output.size(), output.begin());
      busy += seconds(c0, std::chrono::steady_clock::now());
    }
    void backward(int mb, int, std::span<const T>, std::span<const T> grad_output, std::span<T> grad_input) {
      auto& mdl = t->model_;
      const auto c0 = std::chrono::steady_clock::now();
      if (!grad_output.empty()) std::copy(grad_output.begin(), grad_output.end(), mdl.output_grad(mb).begin());
      mdl.backward(mb, T(1) / T(t->opt_.micro_batches));
      if (!grad_input.empty()) std::copy_n(mdl.input_grad(mb).begin(), grad_input.size(), grad_input.begin());
      mdl.release(mb);
      busy += seconds(c0, std::chrono::steady_clock::now());
    }
  };

  static double seconds(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
    return std::chrono::duration<double>(b - a).count();
  }

  train_options opt_;
  loom::comm::mesh<C> mesh_;
  loom::memory_resource* mr_;
  stage_model<P, T, C> model_;
  loom::pipeline::schedule sched_;
  loom::pipeline::executor<T, C> exec_;
  batch_fn data_;
  std::size_t dp_, rank_, shard_;
  loom::zero::optimizer_state state_;
  loom::buffer<std::int32_t> tokens_, targets_;
  loom::buffer<T> grad_shard_, tie_buf_;
  loom::buffer<P> param_shard_, send_;
  std::vector<std::pair<std::size_t, std::size_t>> counted_;
  std::int64_t step_ = 0;
};

}  // namespace llama3d
