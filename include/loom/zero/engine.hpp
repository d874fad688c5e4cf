#pragma once
// zero::engine: data-parallel training of a layered model with ZeRO stage 0, 1, 2 or 3.
//
// The engine owns the model states of one rank -- parameters (T: float, half, bfloat16),
// gradients (T), fp32 master weights and Adam moments -- partitioned as the stage policy
// says (stage.hpp), and drives the model layer by layer:
//   forward   stage 3: the all-gather scheduler makes each layer's parameters available
//             (prefetching the next ones) and releases them after use
//   backward  gradients go to the reduce-scatter scheduler, which reduces each bucket as
//             soon as it is complete (all-reduce for stage 0/1, reduce-scatter for 2/3)
//   step      AdamW on this rank's fp32 master (a shard for stage >= 1, in memory, in host
//             memory or in a memory-mapped file: optimizer_state.hpp), then the parameters
//             are refreshed: cast (stage 0), all-gathered (1, 2), or cast into the shard and
//             persistent parameters re-gathered (3).
// Everything is sized and planned in the constructor; a training step allocates nothing
// of its own. Model states come from `resources.states`, so that resource's byte count is
// the per-rank model-state memory the ZeRO formulas predict; bucket and gather buffers come
// from `resources.scratch`.
//
// A model is anything with forward(layer, params) and backward(layer, params, grads) over
// the layers of its flat_layout (concept layered_model); it keeps its own activations.
// backward assigns every element of its gradients (no accumulation).

#include <loom/comm/communicator.hpp>
#include <loom/core/buffer.hpp>
#include <loom/core/dtype.hpp>
#include <loom/core/error.hpp>
#include <loom/core/memory.hpp>
#include <loom/sched/all_gather_plan.hpp>
#include <loom/sched/all_gather_scheduler.hpp>
#include <loom/sched/reduce_scatter_scheduler.hpp>
#include <loom/zero/adamw.hpp>
#include <loom/zero/flat_layout.hpp>
#include <loom/zero/optimizer_state.hpp>
#include <loom/zero/stage.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace loom::zero {

/// Requires: m.forward(l, params) and m.backward(l, params, grads) for each layer l of the
/// model's flat_layout, called forward 0..L-1 then backward L-1..0.
template <class M, class T>
concept layered_model = requires(M& m, std::size_t l, const layer_params<const T>& p, const layer_params<T>& g) {
  m.forward(l, p);
  m.backward(l, p, g);
};

struct engine_options {
  adamw_config adamw;
  std::size_t reduce_bucket_numel = 500'000'000;  ///< reduce_bucket_size (elements)
  bool overlap_comm = true;
  bool contiguous_gradients = true;
  sched::all_gather_options stage3;               ///< stage3_prefetch_bucket_size, _max_live_parameters, _param_persistence_threshold
  float gradient_clipping = 0.f;                  ///< max global gradient norm; 0: off
  offload_device offload_optimizer = offload_device::none;
  std::string nvme_path;                          ///< offload_optimizer.nvme_path
};

/// Per-rank memory resources. states: parameters, gradients, optimizer state (the
/// accelerator's memory); scratch: buckets and gathered layers; host: offloaded optimizer state.
struct engine_resources {
  memory_resource* states;
  memory_resource* scratch;
  memory_resource* host;
};

/// Model-state bytes this rank holds, by kind (what the ZeRO formulas count).
struct state_bytes {
  std::size_t parameters = 0;  ///< excluding persistent copies
  std::size_t persistent = 0;  ///< stage 3: parameters kept gathered
  std::size_t gradients = 0;
  std::size_t optimizer = 0;   ///< master + moments, wherever they live
};

template <stage_policy Stage, floating_element T, comm::communicator C>
class engine {
 public:
  /// init(p, first, out): fill out[k] with element first + k of parameter p (fp32). Called
  /// only for elements this rank owns, so a counter-based RNG gives every dp the same model.
  using init_fn = std::function<void(std::size_t p, std::size_t first, std::span<float> out)>;

  engine(C& comm, flat_layout layout, const engine_options& opt, engine_resources res, const init_fn& init)
      : comm_(&comm), layout_(std::move(layout)), opt_(opt), res_(res) {
    LOOM_CHECK(res.states && res.scratch && res.host, "zero::engine: every memory resource must be given");
    LOOM_CHECK(static_cast<std::size_t>(comm.size()) == layout_.world(), "zero::engine: communicator has ", comm.size(),
               " ranks but the layout was made for world=", layout_.world());
    const auto& sz = layout_.sizes();
    rank_ = static_cast<std::size_t>(comm.rank());
    world_ = sz.world();
    ptrs_.assign(sz.params(), nullptr);
    gptrs_.assign(sz.params(), nullptr);
    works_.resize(sz.params());

    if constexpr (Stage::shards_parameters::value) {
      params_ = buffer<T>(sz.shard_total(), *res.states);
      sched::all_gather_plan plan = sched::plan_all_gather(sz, opt.stage3);
      persistent_ = buffer<T>(plan.persistent_numel, *res.states);
      persistent_offset_.assign(sz.params(), 0);
      std::size_t off = 0;
      for (std::size_t p = 0; p < sz.params(); ++p)
        if (plan.persistent[p]) {
          persistent_offset_[p] = off;
          ptrs_[p] = persistent_.data() + off;
          off += sz.padded_numel(p);
        }
      gather_ = std::make_unique<sched::all_gather_scheduler<T, C>>(comm, sz, std::move(plan), *res.scratch);
    } else {
      params_ = buffer<T>(sz.padded_total(), *res.states);
      for (std::size_t p = 0; p < sz.params(); ++p) ptrs_[p] = params_.data() + sz.offset(p);
    }
    grads_ = buffer<T>(Stage::shards_gradients::value ? sz.shard_total() : sz.padded_total(), *res.states);
    sched::reduce_options ro{opt.reduce_bucket_numel, opt.overlap_comm, opt.contiguous_gradients,
                             Stage::shards_gradients::value ? sched::reduce_mode::reduce_scatter
                                                            : sched::reduce_mode::all_reduce};
    reduce_ = std::make_unique<sched::reduce_scatter_scheduler<T, C>>(
        comm, sz, ro, *res.scratch, Stage::shards_gradients::value ? std::span<T>{} : grads_.span(),
        Stage::shards_gradients::value ? grads_.span() : std::span<T>{});
    state_ = std::make_unique<optimizer_state>(Stage::shards_optimizer::value ? sz.shard_total() : sz.padded_total(),
                                               opt.offload_optimizer, *res.states, *res.host, opt.nvme_path,
                                               static_cast<int>(rank_));
    // fp32 master from init(): the whole model (stage 0) or this rank's slices
    std::span<float> master = state_->master();
    for (std::size_t p = 0; p < sz.params(); ++p) {
      if constexpr (Stage::shards_optimizer::value) {
        const std::size_t s = sz.shard_numel(p), b = rank_ * s, e = std::min(sz.numel(p), b + s);
        if (b < e) init(p, b, master.subspan(sz.shard_offset(p), e - b));
      } else {
        init(p, 0, master.subspan(sz.offset(p), sz.numel(p)));
      }
    }
    refresh_parameters();
  }
  engine(const engine&) = delete;
  engine& operator=(const engine&) = delete;

  const flat_layout& layout() const noexcept { return layout_; }
  C& communicator() noexcept { return *comm_; }
  std::int64_t steps_taken() const noexcept { return step_; }
  const sched::reduce_scatter_scheduler<T, C>& reducer() const noexcept { return *reduce_; }
  /// Stage 3 only: the all-gather scheduler (for observers and statistics).
  sched::all_gather_scheduler<T, C>* gatherer() noexcept { return gather_.get(); }
  const optimizer_state& optimizer() const noexcept { return *state_; }

  /// Forward through all layers.
  template <layered_model<T> M>
  void forward(M& model) {
    for (std::size_t l = 0; l < layout_.layers(); ++l) {
      acquire(l);
      model.forward(l, layer_params<const T>(layout_, l, ptrs_.data()));
      release(l);
      if constexpr (Stage::shards_parameters::value) gather_->progress();
    }
  }

  /// Backward through all layers; gradients are reduced (and partitioned) when it returns.
  template <layered_model<T> M>
  void backward(M& model) {
    const std::size_t L = layout_.layers();
    const auto& sz = layout_.sizes();
    for (std::size_t t = L; t < 2 * L; ++t) {
      const std::size_t l = 2 * L - 1 - t;
      acquire(t);
      std::span<T> g = reduce_->layer_gradients(l);
      for (std::size_t p = sz.layer_begin(l); p < sz.layer_end(l); ++p) gptrs_[p] = g.data() + (sz.offset(p) - sz.layer_offset(l));
      model.backward(l, layer_params<const T>(layout_, l, ptrs_.data()), layer_params<T>(layout_, l, gptrs_.data()));
      release(t);
      reduce_->layer_done(l);
      reduce_->progress();
      if constexpr (Stage::shards_parameters::value) gather_->progress();
    }
    reduce_->finish();
  }

  /// AdamW on this rank's master weights with the mean gradient over ranks (times
  /// `grad_scale`, e.g. 1/loss_scale), clipped to gradient_clipping by global norm, then
  /// refreshes the parameters every rank uses. Returns false, and changes nothing, when the
  /// gradient has an inf or NaN on any rank (fp16 overflow: the loss scaler backs off).
  bool step(float grad_scale = 1.f) {
    const auto& sz = layout_.sizes();
    float scale = grad_scale / static_cast<float>(world_);
    last_norm_ = global_grad_norm(scale);
    if (!std::isfinite(last_norm_)) return false;
    if (opt_.gradient_clipping > 0.f && last_norm_ > opt_.gradient_clipping) scale *= opt_.gradient_clipping / last_norm_;
    ++step_;
    std::span<float> master = state_->master(), m = state_->exp_avg(), v = state_->exp_avg_sq();
    if constexpr (Stage::shards_optimizer::value && !Stage::shards_gradients::value) {
      // stage 1: gradients are full (all-reduced); this rank steps its slice of each parameter
      for (std::size_t p = 0; p < sz.params(); ++p) {
        const std::size_t s = sz.shard_numel(p), so = sz.shard_offset(p);
        adamw_step<T>(master.subspan(so, s), std::span<const T>(grads_.data() + sz.offset(p) + rank_ * s, s),
                      m.subspan(so, s), v.subspan(so, s), opt_.adamw, step_, scale);
      }
    } else {
      adamw_step<T>(master, std::span<const T>(grads_.span()), m, v, opt_.adamw, step_, scale);
    }
    refresh_parameters();
    return true;
  }

  /// Learning rate of the next step (a schedule sets it every step).
  void set_lr(float lr) {
    LOOM_CHECK(std::isfinite(lr) && lr >= 0.f, "zero::engine::set_lr: lr must be finite and >= 0, got lr=", lr);
    opt_.adamw.lr = lr;
  }

  /// Global L2 norm of the (scaled, mean) gradient computed by the last step().
  float last_grad_norm() const noexcept { return last_norm_; }

  /// forward + backward + step.
  template <layered_model<T> M>
  void train_step(M& model) {
    forward(model);
    backward(model);
    step();
  }

  /// The fp32 master weights of the whole model, unpadded, parameter after parameter
  /// [layout.sizes().total_numel()], on every rank (collective for stage >= 1).
  std::vector<float> gather_master() {
    const auto& sz = layout_.sizes();
    std::vector<float> out;
    out.reserve(sz.total_numel());
    std::span<float> master = state_->master();
    if constexpr (Stage::shards_optimizer::value) {
      std::vector<float> full(sz.padded_total());
      for (std::size_t p = 0; p < sz.params(); ++p)
        comm_->all_gather(std::span<const float>(master.subspan(sz.shard_offset(p), sz.shard_numel(p))),
                          std::span<float>(full).subspan(sz.offset(p), sz.padded_numel(p)));
      for (std::size_t p = 0; p < sz.params(); ++p)
        out.insert(out.end(), full.begin() + sz.offset(p), full.begin() + sz.offset(p) + sz.numel(p));
    } else {
      for (std::size_t p = 0; p < sz.params(); ++p)
        out.insert(out.end(), master.begin() + sz.offset(p), master.begin() + sz.offset(p) + sz.numel(p));
    }
    return out;
  }

  /// Model-state bytes of this rank by kind.
  state_bytes bytes() const noexcept {
    return {params_.bytes(), persistent_.bytes(), grads_.bytes(), 3 * state_->size() * sizeof(float)};
  }

 private:
  // L2 norm over all ranks of scale * gradient; each rank sums the part it steps.
  float global_grad_norm(float scale) {
    const auto& sz = layout_.sizes();
    double local = 0;
    auto add = [&](const T* g, std::size_t n) {
      for (std::size_t i = 0; i < n; ++i) {
        const double x = static_cast<double>(static_cast<float>(g[i]));
        local += x * x;
      }
    };
    if constexpr (Stage::shards_optimizer::value && !Stage::shards_gradients::value) {
      for (std::size_t p = 0; p < sz.params(); ++p) add(grads_.data() + sz.offset(p) + rank_ * sz.shard_numel(p), sz.shard_numel(p));
    } else {
      add(grads_.data(), grads_.size());
    }
    float sum = static_cast<float>(local);
    if constexpr (Stage::shards_optimizer::value)
      comm_->all_reduce(std::span<const float>(&sum, 1), std::span<float>(&sum, 1), comm::reduce_op::sum);
    return std::sqrt(sum) * scale;
  }

  void acquire(std::size_t t) {
    if constexpr (Stage::shards_parameters::value) gather_->acquire(t, std::span<const T>(params_.span()), ptrs_);
  }
  void release(std::size_t t) {
    if constexpr (Stage::shards_parameters::value) gather_->release(t);
  }

  // Parameters every rank computes with, from the (updated) fp32 master.
  void refresh_parameters() {
    const auto& sz = layout_.sizes();
    std::span<const float> master = state_->master();
    if constexpr (!Stage::shards_optimizer::value) {
      std::copy(master.begin(), master.end(), params_.begin());  // stage 0: full master
      return;
    } else {
      // this rank's slices, cast to T, into a send buffer that is free now: the gradients
      // (stage 1: this rank's slices of the full buffer; stage 2: the shard) or, for
      // stage 3, the parameter shard itself.
      for (std::size_t p = 0; p < sz.params(); ++p) {
        const std::size_t s = sz.shard_numel(p), so = sz.shard_offset(p);
        T* send = Stage::shards_parameters::value ? params_.data() + so
                  : Stage::shards_gradients::value ? grads_.data() + so
                                                   : grads_.data() + sz.offset(p) + rank_ * s;
        std::copy_n(master.begin() + so, s, send);
        if constexpr (Stage::shards_parameters::value) {
          if (gather_->plan().persistent[p])
            works_[p] = comm_->all_gather_async(std::span<const T>(send, s),
                                                std::span<T>(persistent_.data() + persistent_offset_[p], s * world_));
        } else {
          works_[p] = comm_->all_gather_async(std::span<const T>(send, s),
                                              std::span<T>(params_.data() + sz.offset(p), s * world_));
        }
      }
      for (comm::work& w : works_) w.wait();
    }
  }

  C* comm_;
  flat_layout layout_;
  engine_options opt_;
  engine_resources res_;
  std::size_t rank_ = 0, world_ = 1;
  std::int64_t step_ = 0;
  float last_norm_ = 0.f;
  buffer<T> params_;      // stage 0-2: [padded_total] full; stage 3: [shard_total]
  buffer<T> persistent_;  // stage 3: gathered copies of small parameters
  buffer<T> grads_;       // stage 0-1: [padded_total] full; stage 2-3: [shard_total]
  std::unique_ptr<optimizer_state> state_;
  std::unique_ptr<sched::all_gather_scheduler<T, C>> gather_;
  std::unique_ptr<sched::reduce_scatter_scheduler<T, C>> reduce_;
  std::vector<std::size_t> persistent_offset_;
  std::vector<T*> ptrs_, gptrs_;  // [params]: where each parameter / its gradient is now
  std::vector<comm::work> works_;
};

}  // namespace loom::zero
