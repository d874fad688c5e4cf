#pragma once
// all_gather_scheduler: runs an all_gather_plan over a communicator.
//
// acquire(t) makes the parameters of trace step t available (waiting for its gather, issuing
// it first if the plan did not prefetch it) and issues the prefetches the plan lists for t;
// release(t) ends the step. Gathered copies live in one arena allocated at construction
// from the given (per-rank) memory resource, so a step allocates nothing of ours. Each
// parameter is one all_gather_async of its shard slice straight into its place in the arena
// (a padded parameter is rank-major: no copy). Steps must be acquired and released in trace
// order; anything else is a loom::error, as is leaving gathers in flight at destruction
// (the destructor waits for them, so buffers are never freed under a collective).
//
// An optional gather_observer sees every issue / ready / release: the instrumented tests
// check order, prefetch depth and live bytes with it, and benchmarks count wait time.

#include <loom/comm/communicator.hpp>
#include <loom/core/buffer.hpp>
#include <loom/core/dtype.hpp>
#include <loom/core/error.hpp>
#include <loom/core/memory.hpp>
#include <loom/sched/all_gather_plan.hpp>
#include <loom/sched/layer_layout.hpp>

#include <chrono>
#include <cstddef>
#include <span>
#include <vector>

namespace loom::sched {

/// Hooks into the executor; every method has an empty default.
struct gather_observer {
  virtual ~gather_observer() = default;
  virtual void on_issue(std::size_t /*instance*/, const gather_instance&, std::size_t /*step*/) {}
  virtual void on_ready(std::size_t /*instance*/, const gather_instance&, std::size_t /*step*/) {}
  virtual void on_release(std::size_t /*instance*/, const gather_instance&, std::size_t /*step*/) {}
};

template <element T, comm::communicator C>
class all_gather_scheduler {
 public:
  all_gather_scheduler(C& comm, const layer_layout& layout, all_gather_plan plan, memory_resource& scratch)
      : comm_(&comm), layout_(&layout), plan_(std::move(plan)), arena_(plan_.arena_numel, scratch) {
    LOOM_CHECK(static_cast<std::size_t>(comm.size()) == layout.world(), "all_gather_scheduler: communicator size ",
               comm.size(), " differs from the layout's world=", layout.world());
    work_begin_.resize(plan_.instances.size() + 1, 0);
    for (std::size_t k = 0; k < plan_.instances.size(); ++k) {
      const std::size_t l = plan_.instances[k].layer;
      std::size_t n = 0;
      for (std::size_t p = layout.layer_begin(l); p < layout.layer_end(l); ++p) n += plan_.persistent[p] ? 0 : 1;
      work_begin_[k + 1] = work_begin_[k] + n;
    }
    works_.resize(work_begin_.back());
    state_.assign(plan_.instances.size(), state::idle);
  }
  all_gather_scheduler(const all_gather_scheduler&) = delete;
  all_gather_scheduler& operator=(const all_gather_scheduler&) = delete;
  ~all_gather_scheduler() {
    for (comm::work& w : works_) try {
        w.wait();
      } catch (...) {
      }
  }

  const all_gather_plan& plan() const noexcept { return plan_; }
  void set_observer(gather_observer* o) noexcept { observer_ = o; }
  std::size_t steps() const noexcept { return plan_.trace.size(); }
  /// Seconds spent blocked waiting for gathers (the communication compute did not hide).
  double wait_seconds() const noexcept { return wait_seconds_; }
  std::size_t live_instances() const noexcept {
    std::size_t n = 0;
    for (state s : state_) n += (s == state::issued || s == state::ready) ? 1 : 0;
    return n;
  }

  /// Makes step t's layer available: ptrs[p] points at the gathered copy of each of its
  /// non-persistent parameters p (padded_numel(p) elements). `shard` is this rank's
  /// parameter shard [layout.shard_total()].
  void acquire(std::size_t t, std::span<const T> shard, std::span<T*> ptrs) {
    LOOM_CHECK(t == next_step_ && !in_step_, "all_gather_scheduler: acquire(step=", t, ") out of order; expected step ",
               next_step_, in_step_ ? " to be released first" : "");
    LOOM_CHECK(shard.size() == layout_->shard_total(), "all_gather_scheduler: shard has ", shard.size(),
               " elements, layout needs shard_total=", layout_->shard_total());
    LOOM_CHECK(ptrs.size() == layout_->params(), "all_gather_scheduler: ptrs has ", ptrs.size(), " entries, layout has ",
               layout_->params(), " parameters");
    in_step_ = true;
    const std::ptrdiff_t k = plan_.instance_at[t];
    if (k >= 0 && state_[k] == state::idle) issue(static_cast<std::size_t>(k), t, shard);
    if (k >= 0 && state_[k] == state::issued) {
      const auto t0 = std::chrono::steady_clock::now();
      for (std::size_t i = work_begin_[k]; i < work_begin_[k + 1]; ++i) works_[i].wait();
      wait_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      state_[k] = state::ready;
      if (observer_) observer_->on_ready(static_cast<std::size_t>(k), plan_.instances[k], t);
    }
    for (; issued_ < plan_.issued_by[t]; ) issue(issued_, t, shard);
    if (k >= 0) {
      const gather_instance& g = plan_.instances[k];
      for (std::size_t p = layout_->layer_begin(g.layer); p < layout_->layer_end(g.layer); ++p)
        if (!plan_.persistent[p]) ptrs[p] = arena_.data() + g.arena_offset + plan_.local_offset[p];
    }
  }

  /// Polls the gathers in flight (Open MPI progresses non-blocking collectives only inside
  /// MPI calls): call between layers.
  void progress() {
    for (std::size_t k = 0; k < state_.size(); ++k)
      if (state_[k] == state::issued)
        for (std::size_t i = work_begin_[k]; i < work_begin_[k + 1]; ++i) works_[i].test();
  }

  /// Ends step t; releases its gathered copy when this was the copy's last step.
  void release(std::size_t t) {
    LOOM_CHECK(t == next_step_ && in_step_, "all_gather_scheduler: release(step=", t, ") without acquire(step=", t, ")");
    in_step_ = false;
    next_step_ = t + 1 == plan_.trace.size() ? 0 : t + 1;
    const std::ptrdiff_t k = plan_.instance_at[t];
    if (k >= 0 && plan_.instances[k].last_step == t) {
      state_[k] = state::idle;
      if (observer_) observer_->on_release(static_cast<std::size_t>(k), plan_.instances[k], t);
    }
    if (next_step_ == 0) issued_ = 0;  // a new pass starts over
  }

 private:
  enum class state : unsigned char { idle, issued, ready };

  void issue(std::size_t k, std::size_t t, std::span<const T> shard) {
    const gather_instance& g = plan_.instances[k];
    const std::size_t world = layout_->world();
    std::size_t i = work_begin_[k];
    for (std::size_t p = layout_->layer_begin(g.layer); p < layout_->layer_end(g.layer); ++p) {
      if (plan_.persistent[p]) continue;
      const std::size_t s = layout_->shard_numel(p);
      std::span<const T> in = shard.subspan(layout_->shard_offset(p), s);
      std::span<T> out(arena_.data() + g.arena_offset + plan_.local_offset[p], s * world);
      works_[i++] = comm_->all_gather_async(in, out);
    }
    state_[k] = state::issued;
    if (k + 1 > issued_) issued_ = k + 1;
    if (observer_) observer_->on_issue(k, g, t);
  }

  C* comm_;
  const layer_layout* layout_;
  all_gather_plan plan_;
  buffer<T> arena_;                      // [plan.arena_numel]
  std::vector<std::size_t> work_begin_;  // instance -> first work
  std::vector<comm::work> works_;
  std::vector<state> state_;
  gather_observer* observer_ = nullptr;
  std::size_t next_step_ = 0, issued_ = 0;
  bool in_step_ = false;
  double wait_seconds_ = 0;
};

}  // namespace loom::sched
