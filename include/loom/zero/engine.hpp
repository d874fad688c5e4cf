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
// of its own, except on first use what only one way of driving the engine needs: the
// reducer's bucket buffers (backward()) or the accumulation buffer (accumulation(), ZeRO-2/3). Model states come from `resources.states`, so that resource's byte count is
// the per-rank model-state memory the ZeRO formulas predict; bucket and gather buffers come
// from `resources.scratch`.
//
// A model is anything with forward(layer, params) and backward(layer, params, grads) over
// the layers of its flat_layout (concept layered_model); it keeps its own activations.
// backward assigns every element of its gradients (no accumulation).
//
// The same engine also serves as phases for a driver that runs the layers itself, such as
// a pipeline stage that passes several micro-batches through its layers in the order its
// schedule says (examples/llama/train3d):
//   acquire_layer(l) / parameter(p) / release_layer(l)  the layers' parameters, in the order
//             of the gather trace given at construction (ZeRO-3: gathered with the plan's
//             prefetch and live-elements cap; stages 0-2: always resident)
//   accumulation()          a full gradient buffer the driver accumulates micro-batches into
//   reduce_accumulated()    sums it over the ranks: all-reduce (stage 0, 1) or reduce-scatter
//                           into this rank's gradient shard (2, 3)
//   for_each_gradient_slice this rank's slice of the reduced gradient (for a norm across meshes)
//   apply(scale)            AdamW on this rank's master, then the parameters are refreshed
// step() is the norm, the clipping and apply() together.

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
#include <type_traits>
#include <utility>
#include <vector>

namespace loom::zero {

/// Requires: m.forward(l, params) and m.backward(l, params, grads) for each layer l of the
/// model's flat_layout, called forward 0..L-1 then backward L-1..0.
template <class M, class T, class G = T>
concept layered_model = requires(M& m, std::size_t l, const layer_params<const T>& p, const layer_params<G>& g) {
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
  /// With optimizer groups (engine::set_groups): a group's Adam moments are allocated when it
  /// first trains, not before (with nvme offload, in a file of its own created then); false:
  /// all of them up front, as without groups.
  bool lazy_group_state = true;
};

/// Per-rank memory resources. states: parameters, gradients, optimizer state (the
/// accelerator's memory); scratch: buckets, gathered layers and the accumulation buffer;
/// host: offloaded optimizer state. parameters (optional): when given, every parameter byte
/// -- the (sharded) parameters, persistent copies and the stage-3 gather arena -- comes from
/// it, so its peak is the most parameter memory the rank ever held. optimizer (optional):
/// when given, the fp32 master and Adam moments not offloaded come from it instead of states
/// (its bytes are the optimizer state's alone).
struct engine_resources {
  memory_resource* states;
  memory_resource* scratch;
  memory_resource* host;
  memory_resource* parameters = nullptr;
  memory_resource* optimizer = nullptr;
};

/// Model-state bytes this rank holds, by kind (what the ZeRO formulas count).
struct state_bytes {
  std::size_t parameters = 0;  ///< excluding persistent copies
  std::size_t persistent = 0;  ///< stage 3: parameters kept gathered
  std::size_t gradients = 0;
  std::size_t optimizer = 0;   ///< master + moments, wherever they live
};

/// An element range [begin, end) of an engine's full (padded) layout that belongs to optimizer
/// group `group` (engine::set_groups).
struct group_range {
  std::size_t begin = 0, end = 0, group = 0;
};

template <stage_policy Stage, floating_element T, comm::communicator C, floating_element G = T>
class engine {
 public:
  using param_type = T;
  using grad_type = G;
  static constexpr int stage = Stage::level;

  /// init(p, first, out): fill out[k] with element first + k of parameter p (fp32). Called
  /// only for elements this rank owns, so a counter-based RNG gives every dp the same model.
  using init_fn = std::function<void(std::size_t p, std::size_t first, std::span<float> out)>;

  /// gather_trace: the order in which layers are acquired (empty: forward 0..L-1 then
  /// backward L-1..0, what forward()/backward() do).
  engine(C& comm, flat_layout layout, const engine_options& opt, engine_resources res, const init_fn& init,
         std::vector<sched::trace_step> gather_trace = {})
      : comm_(&comm), layout_(std::move(layout)), opt_(opt), res_(res) {
    LOOM_CHECK(res.states && res.scratch && res.host, "zero::engine: every memory resource must be given");
    LOOM_CHECK(static_cast<std::size_t>(comm.size()) == layout_.world(), "zero::engine: communicator has ", comm.size(),
               " ranks but the layout was made for world=", layout_.world());
    LOOM_CHECK(opt.reduce_bucket_numel > 0, "zero::engine: reduce_bucket_numel must be > 0 elements, got ",
               opt.reduce_bucket_numel);  // here, not at the first backward() that makes the reducer
    const auto& sz = layout_.sizes();
    rank_ = static_cast<std::size_t>(comm.rank());
    world_ = sz.world();
    ptrs_.assign(sz.params(), nullptr);
    gptrs_.assign(sz.params(), nullptr);
    works_.resize(sz.params());
    memory_resource& pmr = res.parameters ? *res.parameters : *res.states;

    if constexpr (Stage::shards_parameters::value) {
      params_ = buffer<T>(sz.shard_total(), pmr);
      sched::all_gather_plan plan = make_plan(std::move(gather_trace));
      persistent_ = buffer<T>(plan.persistent_numel, pmr);
      persistent_offset_.assign(sz.params(), 0);
      std::size_t off = 0;
      for (std::size_t p = 0; p < sz.params(); ++p)
        if (plan.persistent[p]) {
          persistent_offset_[p] = off;
          ptrs_[p] = persistent_.data() + off;
          off += sz.padded_numel(p);
        }
      gather_ = std::make_unique<sched::all_gather_scheduler<T, C>>(comm, sz, std::move(plan),
                                                                     res.parameters ? *res.parameters : *res.scratch);
      max_arena_ = gather_->plan().arena_numel;
    } else {
      trace_ = make_plan(std::move(gather_trace)).trace;  // checked like stage 3's, so a bad trace fails on every stage
      params_ = buffer<T>(sz.padded_total(), pmr);
      for (std::size_t p = 0; p < sz.params(); ++p) ptrs_[p] = params_.data() + sz.offset(p);
    }
    grads_ = buffer<G>(Stage::shards_gradients::value ? sz.shard_total() : sz.padded_total(), *res.states);
    state_ = std::make_unique<optimizer_state>(Stage::shards_optimizer::value ? sz.shard_total() : sz.padded_total(),
                                               opt.offload_optimizer, state_resource(), *res.host, opt.nvme_path,
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
  /// The bucketed reduce scheduler of backward(). Made (and its bucket buffers taken from the
  /// scratch resource) on first use, so a driver that only uses accumulation() and
  /// reduce_accumulated() never holds its staging and packing buffers.
  sched::reduce_scatter_scheduler<G, C>& reducer() {
    if (!reduce_) {
      constexpr bool rs = Stage::shards_gradients::value;
      const sched::reduce_options ro{opt_.reduce_bucket_numel, opt_.overlap_comm, opt_.contiguous_gradients,
                                     rs ? sched::reduce_mode::reduce_scatter : sched::reduce_mode::all_reduce};
      reduce_ = std::make_unique<sched::reduce_scatter_scheduler<G, C>>(
          *comm_, layout_.sizes(), ro, *res_.scratch, rs ? std::span<G>{} : grads_.span(), rs ? grads_.span() : std::span<G>{});
    }
    return *reduce_;
  }
  /// Stage 3 only: the all-gather scheduler (for observers and statistics).
  sched::all_gather_scheduler<T, C>* gatherer() noexcept { return gather_.get(); }
  const optimizer_state& optimizer() const noexcept { return *state_; }

  /// Forward through all layers.
  template <layered_model<T, G> M>
  void forward(M& model) {
    for (std::size_t l = 0; l < layout_.layers(); ++l) {
      acquire_layer(l);
      model.forward(l, layer_params<const T>(layout_, l, ptrs_.data()));
      release_layer(l);
    }
  }

  /// Backward through all layers; gradients are reduced (and partitioned) when it returns.
  template <layered_model<T, G> M>
  void backward(M& model) {
    const auto& sz = layout_.sizes();
    auto& reduce = reducer();
    for (std::size_t l = layout_.layers(); l-- > 0;) {
      acquire_layer(l);
      std::span<G> g = reduce.layer_gradients(l);
      for (std::size_t p = sz.layer_begin(l); p < sz.layer_end(l); ++p) gptrs_[p] = g.data() + (sz.offset(p) - sz.layer_offset(l));
      model.backward(l, layer_params<const T>(layout_, l, ptrs_.data()), layer_params<G>(layout_, l, gptrs_.data()));
      release_layer(l);
      reduce.layer_done(l);
      reduce.progress();
    }
    reduce.finish();
  }

  // ---- phases, for a driver that runs the layers itself ---------------------------------
  /// Makes layer l's parameters available; l must be the gather trace's next layer (a
  /// loom::error otherwise, naming both). ZeRO-3 gathers it (or finds it prefetched) and
  /// issues the prefetches its plan lists.
  void acquire_layer(std::size_t l) {
    const auto& trace = this->trace();
    LOOM_CHECK(!in_layer_ && trace[cursor_].layer == l, "zero::engine::acquire_layer: layer ", l, " asked for at step ",
               cursor_, " of the gather trace, which expects layer ", trace[cursor_].layer,
               in_layer_ ? " (and the previous layer is still acquired)" : "");
    in_layer_ = true;
    if constexpr (Stage::shards_parameters::value) gather_->acquire(cursor_, std::span<const T>(params_.span()), ptrs_);
  }
  /// Ends the use of layer l (ZeRO-3: its gathered copy is dropped after its last consecutive use).
  void release_layer(std::size_t l) {
    LOOM_CHECK(in_layer_ && trace()[cursor_].layer == l, "zero::engine::release_layer: layer ", l, " was not acquired");
    in_layer_ = false;
    if constexpr (Stage::shards_parameters::value) {
      gather_->release(cursor_);
      gather_->progress();
    }
    cursor_ = cursor_ + 1 == trace().size() ? 0 : cursor_ + 1;
  }
  /// Parameter p (padded_numel(p) elements, the padding zero) while its layer is acquired;
  /// always, for stages 0-2 and persistent parameters.
  std::span<T> parameter(std::size_t p) {
    LOOM_CHECK(p < layout_.params(), "zero::engine::parameter: p=", p, " out of range (", layout_.params(), " parameters)");
    return {ptrs_[p], layout_.sizes().padded_numel(p)};
  }
  /// Stages 0-2: the whole parameter buffer [padded_total], always resident; stage 3: empty.
  std::span<T> resident_parameters() noexcept {
    if constexpr (Stage::shards_parameters::value) return {};
    else return params_.span();
  }
  /// The order of layer uses the ZeRO-3 plan was made for (one step).
  const std::vector<sched::trace_step>& trace() const noexcept {
    if constexpr (Stage::shards_parameters::value) return gather_->plan().trace;
    else return trace_;
  }
  /// A new order of layer uses (e.g. forward-only evaluation) from the next acquire on;
  /// ZeRO-3 re-plans its gathers. Only between whole traces.
  void set_gather_trace(std::vector<sched::trace_step> trace) {
    LOOM_CHECK(!in_layer_ && cursor_ == 0, "zero::engine::set_gather_trace: called at step ", cursor_,
               " of the current trace; only between traces");
    if constexpr (Stage::shards_parameters::value) {
      memory_resource& mr = res_.parameters ? *res_.parameters : *res_.scratch;
      gather_.reset();  // its arena goes back before the new one is taken
      gather_ = std::make_unique<sched::all_gather_scheduler<T, C>>(*comm_, layout_.sizes(), make_plan(std::move(trace)), mr);
      max_arena_ = std::max(max_arena_, gather_->plan().arena_numel);
    } else {
      trace_ = make_plan(std::move(trace)).trace;
    }
  }

  /// A full gradient buffer [padded_total] in the layout's order, for a driver that adds
  /// several micro-batches' gradients before reducing: stages 0-1 the gradient buffer itself,
  /// stages 2-3 a buffer taken from the scratch resource on first use.
  std::span<G> accumulation() {
    if constexpr (!Stage::shards_gradients::value) {
      return grads_.span();
    } else {
      if (accum_.empty()) accum_ = buffer<G>(layout_.sizes().padded_total(), *res_.scratch);
      return accum_.span();
    }
  }
  /// Sums accumulation() over the ranks: in place (stage 0-1), or each parameter's slices into
  /// this rank's gradient shard (2-3).
  void reduce_accumulated() {
    const auto& sz = layout_.sizes();
    std::span<G> full = accumulation();
    if constexpr (!Stage::shards_gradients::value) {
      comm_->all_reduce(std::span<const G>(full), full, comm::reduce_op::sum);
    } else {
      for (std::size_t p = 0; p < sz.params(); ++p)
        works_[p] = comm_->reduce_scatter_async(std::span<const G>(full.subspan(sz.offset(p), sz.padded_numel(p))),
                                                grads_.span().subspan(sz.shard_offset(p), sz.shard_numel(p)),
                                                comm::reduce_op::sum);
      for (comm::work& w : works_) w.wait();
    }
  }
  /// fn(full_offset, gradients) for this rank's slice of every parameter's reduced gradient,
  /// with its offset in the full (padded) layout: the slices of the ranks partition the
  /// gradient (what a norm summed over ranks counts once), on every stage.
  template <class Fn>
  void for_each_gradient_slice(Fn&& fn) const {
    const auto& sz = layout_.sizes();
    for (std::size_t p = 0; p < sz.params(); ++p) {
      const std::size_t s = sz.shard_numel(p), at = Stage::shards_gradients::value ? sz.shard_offset(p) : sz.offset(p) + rank_ * s;
      fn(sz.offset(p) + rank_ * s, std::span<const G>(grads_.data() + at, s));
    }
  }

  /// AdamW on this rank's master weights with the mean gradient over ranks (times
  /// `grad_scale`, e.g. 1/loss_scale), clipped to gradient_clipping by global norm, then
  /// refreshes the parameters every rank uses. Returns false, and changes nothing, when the
  /// gradient has an inf or NaN on any rank (fp16 overflow: the loss scaler backs off).
  bool step(float grad_scale = 1.f) {
    float scale = grad_scale / static_cast<float>(world_);
    last_norm_ = global_grad_norm(scale);
    if (!std::isfinite(last_norm_)) return false;
    if (opt_.gradient_clipping > 0.f && last_norm_ > opt_.gradient_clipping) scale *= opt_.gradient_clipping / last_norm_;
    apply(scale);
    return true;
  }

  /// AdamW on this rank's master weights with gradient x `scale` (the driver's mean, loss
  /// scale and clipping folded in), then the parameters every rank uses are refreshed.
  /// With optimizer groups (set_groups), each group's elements step with its own settings and
  /// step count, and a frozen group's are not touched.
  void apply(float scale) {
    const auto& sz = layout_.sizes();
    ++step_;
    std::span<float> master = state_->master(), m = state_->exp_avg(), v = state_->exp_avg_sq();
    if (!ranges_.empty()) {
      apply_grouped(scale);
    } else if constexpr (Stage::shards_optimizer::value && !Stage::shards_gradients::value) {
      // stage 1: gradients are full (all-reduced); this rank steps its slice of each parameter
      for (std::size_t p = 0; p < sz.params(); ++p) {
        const std::size_t s = sz.shard_numel(p), so = sz.shard_offset(p);
        adamw_step<G>(master.subspan(so, s), std::span<const G>(grads_.data() + sz.offset(p) + rank_ * s, s),
                      m.subspan(so, s), v.subspan(so, s), opt_.adamw, step_, scale);
      }
    } else {
      adamw_step<G>(master, std::span<const G>(grads_.span()), m, v, opt_.adamw, step_, scale);
    }
    refresh_parameters();
  }

  // ---- optimizer groups (parameter groups, frozen parts) --------------------------------
  /// Element ranges with settings of their own: each group steps with its own AdamW settings
  /// and its own step count t (bias correction from the group's first step, so a group that
  /// starts training late takes a first step of the size a fresh optimizer would), or not at
  /// all while it is frozen: its master, moments and parameters stay bit for bit as they are.
  /// Ranges below a unit's granularity are what lets one layer (one engine entry) hold
  /// tensors of several groups. Elements in no range step with the engine's own settings.
  /// Every group starts trainable with the engine's settings (set_group changes that).
  void set_groups(std::vector<group_range> ranges, std::size_t groups) {
    std::sort(ranges.begin(), ranges.end(), [](const group_range& a, const group_range& b) { return a.begin < b.begin; });
    for (std::size_t i = 0; i < ranges.size(); ++i) {
      LOOM_CHECK(ranges[i].begin < ranges[i].end && ranges[i].end <= layout_.sizes().padded_total() && ranges[i].group < groups,
                 "zero::engine::set_groups: range ", i, " [", ranges[i].begin, ", ", ranges[i].end, ") of group ", ranges[i].group,
                 " is empty, past the layout's ", layout_.sizes().padded_total(), " elements or past groups=", groups);
      LOOM_CHECK(i == 0 || ranges[i - 1].end <= ranges[i].begin, "zero::engine::set_groups: ranges [", ranges[i - 1].begin, ", ",
                 ranges[i - 1].end, ") and [", ranges[i].begin, ", ", ranges[i].end, ") overlap");
    }
    ranges_ = std::move(ranges);
    groups_.assign(groups, group_settings{opt_.adamw, true, 0});
    moments_.clear();
    if (!opt_.lazy_group_state) return;
    // Lazy moments: the state keeps the master only, and each group (the last: elements in no
    // range, which always train) its m and v in a buffer of its own, allocated at the first
    // apply() that trains it -- so a frozen group costs no optimizer memory until it unfreezes.
    LOOM_CHECK(step_ == 0, "zero::engine::set_groups: optimizer groups are set before the first step (", step_,
               " steps taken): the moments move into per-group buffers");
    moments_.resize(groups + 1);
    for_each_piece([&](std::size_t, std::size_t, std::size_t n, std::size_t g, std::size_t) { moments_[g].n += n; });
    auto master = std::make_unique<optimizer_state>(state_->size(), opt_.offload_optimizer, state_resource(), *res_.host,
                                                    opt_.nvme_path, static_cast<int>(rank_), false);
    std::ranges::copy(state_->master(), master->master().begin());
    state_ = std::move(master);
    allocate_moments(groups);
  }
  /// Group g's AdamW settings and whether it trains at the next apply().
  void set_group(std::size_t g, const adamw_config& c, bool trainable) {
    LOOM_CHECK(g < groups_.size(), "zero::engine::set_group: group ", g, " out of range (", groups_.size(), " groups)");
    LOOM_CHECK(std::isfinite(c.lr) && c.lr >= 0.f, "zero::engine::set_group: group ", g, " lr must be finite and >= 0, got ", c.lr);
    groups_[g].adamw = c, groups_[g].trainable = trainable;
  }
  /// Steps group g has taken (its AdamW t); after a restore, set by the driver.
  std::int64_t group_steps(std::size_t g) const { return groups_.at(g).steps; }
  void set_group_steps(std::size_t g, std::int64_t steps) { groups_.at(g).steps = steps; }

  /// fn(full_offset, master, exp_avg, exp_avg_sq) for this rank's slice of every parameter's
  /// fp32 optimizer state (stage 0: the slice of the whole copy it would own at stage 1), so
  /// the ranks' slices partition the state: what a sharded checkpoint saves and loads.
  /// With lazy group moments (engine_options::lazy_group_state) the moments are lent as one
  /// flat copy for the call (a group not yet allocated reads zeros, what allocation gives) and
  /// taken back after it; a group whose moments come back nonzero is allocated then.
  template <class Fn>
  void for_each_state_slice(Fn&& fn) {
    const auto& sz = layout_.sizes();
    std::span<float> master = state_->master();
    with_flat_moments([&](std::span<float> m, std::span<float> v) {
      for (std::size_t p = 0; p < sz.params(); ++p) {
        const std::size_t s = sz.shard_numel(p), at = Stage::shards_optimizer::value ? sz.shard_offset(p) : sz.offset(p) + rank_ * s;
        fn(sz.offset(p) + rank_ * s, master.subspan(at, s), m.subspan(at, s), v.subspan(at, s));
      }
    });
  }
  /// After the state slices were loaded (on every rank): `steps` AdamW steps taken, the
  /// parameters recomputed from the master. Stage 0 first gathers the whole master (every
  /// rank loaded only its slice). Collective.
  void restore(std::int64_t steps) {
    LOOM_CHECK(steps >= 0, "zero::engine::restore: steps must be >= 0, got steps=", steps);
    if constexpr (!Stage::shards_optimizer::value) {
      const auto& sz = layout_.sizes();
      with_flat_moments([&](std::span<float> m, std::span<float> v) {
        for (std::span<float> x : {state_->master(), m, v}) {
          std::vector<float> slice;
          for (std::size_t p = 0; p < sz.params(); ++p) {
            const std::size_t s = sz.shard_numel(p);
            slice.assign(x.begin() + static_cast<std::ptrdiff_t>(sz.offset(p) + rank_ * s),
                         x.begin() + static_cast<std::ptrdiff_t>(sz.offset(p) + (rank_ + 1) * s));
            comm_->all_gather(std::span<const float>(slice), x.subspan(sz.offset(p), sz.padded_numel(p)));
          }
        }
      });
    }
    step_ = steps;
    refresh_parameters();
  }

  /// Learning rate of the next step (a schedule sets it every step).
  void set_lr(float lr) {
    LOOM_CHECK(std::isfinite(lr) && lr >= 0.f, "zero::engine::set_lr: lr must be finite and >= 0, got lr=", lr);
    opt_.adamw.lr = lr;
  }

  /// Global L2 norm of the (scaled, mean) gradient computed by the last step().
  float last_grad_norm() const noexcept { return last_norm_; }

  /// forward + backward + step.
  template <layered_model<T, G> M>
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
    std::size_t optimizer = state_->bytes();
    for (const auto& gm : moments_) optimizer += gm.mv.bytes();
    return {params_.bytes(), persistent_.bytes(), grads_.bytes(), optimizer};
  }
  /// Stage 3: elements of the largest gather arena this engine has held (over the gather
  /// traces it was given; each plan keeps its live elements <= the unit in use + the prefetch
  /// window, and <= stage3_max_live_parameters); 0 for stages 0-2.
  std::size_t gather_arena_numel() const noexcept { return max_arena_; }

 private:
  // L2 norm over all ranks of scale * gradient; each rank sums the part it steps.
  float global_grad_norm(float scale) {
    const auto& sz = layout_.sizes();
    double local = 0;
    auto add = [&](const G* g, std::size_t n) {
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

  // Where this rank's refreshed slice of parameter p is cast before it is all-gathered: a
  // buffer that is free now -- stage 3: the parameter shard itself; stage 1-2: the gradients
  // (stage 1: this rank's slice of the full buffer; stage 2: the shard) when they have the
  // parameters' type, else a buffer of its own.
  T* send_slice(std::size_t p) {
    const auto& sz = layout_.sizes();
    const std::size_t s = sz.shard_numel(p), so = sz.shard_offset(p);
    if constexpr (Stage::shards_parameters::value) {
      return params_.data() + so;
    } else if constexpr (!std::is_same_v<T, G>) {
      if (send_.empty()) send_ = buffer<T>(sz.shard_total(), *res_.scratch);
      return send_.data() + so;
    } else {
      return Stage::shards_gradients::value ? grads_.data() + so : grads_.data() + sz.offset(p) + rank_ * s;
    }
  }

  sched::all_gather_plan make_plan(std::vector<sched::trace_step> trace) const {
    return trace.empty() ? sched::plan_all_gather(layout_.sizes(), opt_.stage3)
                         : sched::plan_all_gather(layout_.sizes(), std::move(trace), opt_.stage3);
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
        T* send = send_slice(p);
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

  // apply() with groups: this rank's slice of each parameter (stage 0: all of it) cut at the
  // group ranges; a piece steps with its group's settings and t, or not at all.
  void apply_grouped(float scale) {
    std::span<float> master = state_->master();
    for (std::size_t g = 0; g < groups_.size(); ++g) {
      if (!groups_[g].trainable) continue;
      ++groups_[g].steps;
      if (!moments_.empty()) allocate_moments(g);
    }
    for_each_piece([&](std::size_t mo, std::size_t go, std::size_t n, std::size_t g, std::size_t local) {
      const bool none = g == groups_.size();  // in no range: the engine's settings and t
      if (!none && !groups_[g].trainable) return;
      const auto [m, v] = moments_of(mo, g, local, n);
      adamw_step<G>(master.subspan(mo, n), std::span<const G>(grads_.data() + go, n), m, v, none ? opt_.adamw : groups_[g].adamw,
                    none ? step_ : groups_[g].steps, scale);
    });
  }
  // fn(master offset, gradient offset, n, group, offset in the group's moments) for each piece
  // of this rank's state: its slice of each parameter (stage 0: all of it) cut at the group
  // ranges; group = groups_.size() for elements in no range. Always in the same order, so a
  // group's pieces lie one after the other in its moments.
  template <class Fn>
  void for_each_piece(Fn&& fn) const {
    const auto& sz = layout_.sizes();
    std::vector<std::size_t> local(groups_.size() + 1, 0);
    const auto piece = [&](std::size_t mo, std::size_t go, std::size_t n, std::size_t g) {
      fn(mo, go, n, g, local[g]);
      local[g] += n;
    };
    for (std::size_t p = 0; p < sz.params(); ++p) {
      const std::size_t s = sz.shard_numel(p);
      // [fb, fe) in full coordinates; where element fb is in the master and in the gradients
      const std::size_t fb = Stage::shards_optimizer::value ? sz.offset(p) + rank_ * s : sz.offset(p);
      const std::size_t fe = fb + (Stage::shards_optimizer::value ? s : sz.padded_numel(p));
      const std::size_t mb = Stage::shards_optimizer::value ? sz.shard_offset(p) : fb;
      const std::size_t gb = Stage::shards_gradients::value ? sz.shard_offset(p) : fb;
      auto r = std::lower_bound(ranges_.begin(), ranges_.end(), fb, [](const group_range& x, std::size_t at) { return x.end <= at; });
      for (std::size_t at = fb; at < fe;) {
        if (r == ranges_.end() || r->begin >= fe) {  // the rest is in no range
          piece(mb + (at - fb), gb + (at - fb), fe - at, groups_.size());
          break;
        }
        if (at < r->begin) {  // a gap before the next range
          piece(mb + (at - fb), gb + (at - fb), r->begin - at, groups_.size());
          at = r->begin;
        }
        const std::size_t end = std::min(r->end, fe);
        piece(mb + (at - fb), gb + (at - fb), end - at, r->group);
        at = end;
        if (end == r->end) ++r;
      }
    }
  }
  // The moments (m, v) of a piece: in the state, or in its group's buffer (lazy).
  std::pair<std::span<float>, std::span<float>> moments_of(std::size_t mo, std::size_t g, std::size_t local, std::size_t n) {
    if (moments_.empty()) return {state_->exp_avg().subspan(mo, n), state_->exp_avg_sq().subspan(mo, n)};
    const std::span<float> mv = moments_[g].mv.span();
    return {mv.subspan(local, n), mv.subspan(moments_[g].n + local, n)};
  }
  memory_resource& state_resource() const noexcept { return res_.optimizer ? *res_.optimizer : *res_.states; }
  // Group g's moments, zero, where the state would hold them (host with cpu offload, a file
  // of its own with nvme offload, which reads zeros as created).
  void allocate_moments(std::size_t g) {
    group_moments& gm = moments_[g];
    if (gm.allocated) return;
    gm.mv = state_store(2 * gm.n, opt_.offload_optimizer, state_resource(), *res_.host, opt_.nvme_path, static_cast<int>(rank_));
    if (opt_.offload_optimizer != offload_device::nvme) std::ranges::fill(gm.mv.span(), 0.f);
    gm.allocated = true;
  }
  // fn(m, v) over flat [state size] moments: the state's own, or (lazy) a copy of the groups'
  // (zeros where not allocated) written back after fn, allocating a group that came back nonzero.
  template <class Fn>
  void with_flat_moments(Fn&& fn) {
    if (moments_.empty()) return fn(state_->exp_avg(), state_->exp_avg_sq());
    std::vector<float> m(state_->size(), 0.f), v(state_->size(), 0.f);
    for_each_piece([&](std::size_t mo, std::size_t, std::size_t n, std::size_t g, std::size_t local) {
      if (!moments_[g].allocated) return;
      const auto [gm, gv] = moments_of(mo, g, local, n);
      std::ranges::copy(gm, m.begin() + static_cast<std::ptrdiff_t>(mo));
      std::ranges::copy(gv, v.begin() + static_cast<std::ptrdiff_t>(mo));
    });
    fn(std::span<float>(m), std::span<float>(v));
    for_each_piece([&](std::size_t mo, std::size_t, std::size_t n, std::size_t g, std::size_t) {
      for (std::size_t i = mo; i < mo + n && !moments_[g].allocated; ++i)
        if (m[i] != 0.f || v[i] != 0.f) allocate_moments(g);
    });
    for_each_piece([&](std::size_t mo, std::size_t, std::size_t n, std::size_t g, std::size_t local) {
      if (!moments_[g].allocated) return;
      const auto [gm, gv] = moments_of(mo, g, local, n);
      std::copy_n(m.begin() + static_cast<std::ptrdiff_t>(mo), n, gm.begin());
      std::copy_n(v.begin() + static_cast<std::ptrdiff_t>(mo), n, gv.begin());
    });
  }

  struct group_moments {
    state_store mv;  // [2 n]: m, then v
    std::size_t n = 0;
    bool allocated = false;
  };
  struct group_settings {
    adamw_config adamw;
    bool trainable = true;
    std::int64_t steps = 0;
  };

  C* comm_;
  flat_layout layout_;
  engine_options opt_;
  engine_resources res_;
  std::size_t rank_ = 0, world_ = 1;
  std::int64_t step_ = 0;
  float last_norm_ = 0.f;
  buffer<T> params_;      // stage 0-2: [padded_total] full; stage 3: [shard_total]
  buffer<T> persistent_;  // stage 3: gathered copies of small parameters
  buffer<G> grads_;       // stage 0-1: [padded_total] full; stage 2-3: [shard_total]
  buffer<G> accum_;       // stage 2-3: [padded_total] for drivers that accumulate micro-batches
  buffer<T> send_;        // stage 1-2: [shard_total] this rank's refreshed slices
  std::vector<sched::trace_step> trace_;  // stage 0-2: the gather trace (stage 3: the plan's)
  std::size_t cursor_ = 0;                // the trace step of the next acquire_layer
  std::size_t max_arena_ = 0;             // stage 3: the largest gather arena so far
  bool in_layer_ = false;
  std::unique_ptr<optimizer_state> state_;
  std::unique_ptr<sched::all_gather_scheduler<T, C>> gather_;
  std::unique_ptr<sched::reduce_scatter_scheduler<G, C>> reduce_;
  std::vector<std::size_t> persistent_offset_;
  std::vector<T*> ptrs_;   // [params]: where each parameter is now
  std::vector<G*> gptrs_;  // [params]: where backward writes each gradient
  std::vector<comm::work> works_;
  std::vector<group_range> ranges_;     // sorted, disjoint (set_groups)
  std::vector<group_settings> groups_;
  std::vector<group_moments> moments_;  // lazy group moments: [groups + 1] (the last: no range); empty: in state_
};

}  // namespace loom::zero
