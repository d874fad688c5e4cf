#pragma once
// zero::any_engine: the engine's phases behind one interface for a ZeRO stage chosen at run
// time (ds_config.json's zero_optimization.stage).
//
// Why: zero::engine is typed on its stage so that each stage keeps only the buffers it needs
// and branches at compile time; a trainer reads the stage from a file. A driver that runs the
// layers itself (a pipeline stage, engine.hpp's "phases") calls a few phases per layer and
// per step, so one virtual call each costs nothing measurable, and the trainer is written
// once instead of once per stage.

#include <loom/comm/communicator.hpp>
#include <loom/zero/engine.hpp>
#include <loom/zero/stage.hpp>

#include <cstddef>
#include <functional>
#include <memory>
#include <span>
#include <utility>
#include <vector>

namespace loom::zero {

template <floating_element T, comm::communicator C, floating_element G = T>
class any_engine {
 public:
  virtual ~any_engine() = default;
  virtual int stage() const noexcept = 0;
  virtual const flat_layout& layout() const noexcept = 0;
  virtual void acquire_layer(std::size_t l) = 0;
  virtual void release_layer(std::size_t l) = 0;
  virtual std::span<T> parameter(std::size_t p) = 0;
  /// Stages 0-2: the whole parameter buffer [padded_total] (always resident); stage 3: empty.
  virtual std::span<T> resident_parameters() noexcept = 0;
  virtual void set_gather_trace(std::vector<sched::trace_step> trace) = 0;
  virtual std::span<G> accumulation() = 0;
  virtual void reduce_accumulated() = 0;
  virtual void for_each_gradient_slice(const std::function<void(std::size_t, std::span<const G>)>& fn) const = 0;
  virtual void apply(float scale) = 0;
  virtual void set_lr(float lr) = 0;
  virtual void set_groups(std::vector<group_range> ranges, std::size_t groups) = 0;
  virtual void set_group(std::size_t g, const adamw_config& c, bool trainable) = 0;
  virtual std::int64_t group_steps(std::size_t g) const = 0;
  virtual void set_group_steps(std::size_t g, std::int64_t steps) = 0;
  virtual std::vector<float> gather_master() = 0;
  virtual void for_each_state_slice(
      const std::function<void(std::size_t, std::span<float>, std::span<float>, std::span<float>)>& fn) = 0;
  virtual void restore(std::int64_t steps) = 0;
  virtual std::int64_t steps_taken() const noexcept = 0;
  virtual state_bytes bytes() const noexcept = 0;
  virtual std::size_t gather_arena_numel() const noexcept = 0;
};

namespace detail {
template <stage_policy S, floating_element T, comm::communicator C, floating_element G>
class engine_of final : public any_engine<T, C, G> {
 public:
  template <class... A>
  explicit engine_of(A&&... a) : e_(std::forward<A>(a)...) {}
  int stage() const noexcept override { return S::level; }
  const flat_layout& layout() const noexcept override { return e_.layout(); }
  void acquire_layer(std::size_t l) override { e_.acquire_layer(l); }
  void release_layer(std::size_t l) override { e_.release_layer(l); }
  std::span<T> parameter(std::size_t p) override { return e_.parameter(p); }
  std::span<T> resident_parameters() noexcept override { return e_.resident_parameters(); }
  void set_gather_trace(std::vector<sched::trace_step> trace) override { e_.set_gather_trace(std::move(trace)); }
  std::span<G> accumulation() override { return e_.accumulation(); }
  void reduce_accumulated() override { e_.reduce_accumulated(); }
  void for_each_gradient_slice(const std::function<void(std::size_t, std::span<const G>)>& fn) const override {
    e_.for_each_gradient_slice(fn);
  }
  void apply(float scale) override { e_.apply(scale); }
  void set_lr(float lr) override { e_.set_lr(lr); }
  void set_groups(std::vector<group_range> ranges, std::size_t groups) override { e_.set_groups(std::move(ranges), groups); }
  void set_group(std::size_t g, const adamw_config& c, bool trainable) override { e_.set_group(g, c, trainable); }
  std::int64_t group_steps(std::size_t g) const override { return e_.group_steps(g); }
  void set_group_steps(std::size_t g, std::int64_t steps) override { e_.set_group_steps(g, steps); }
  std::vector<float> gather_master() override { return e_.gather_master(); }
  void for_each_state_slice(
      const std::function<void(std::size_t, std::span<float>, std::span<float>, std::span<float>)>& fn) override {
    e_.for_each_state_slice(fn);
  }
  void restore(std::int64_t steps) override { e_.restore(steps); }
  std::int64_t steps_taken() const noexcept override { return e_.steps_taken(); }
  state_bytes bytes() const noexcept override { return e_.bytes(); }
  std::size_t gather_arena_numel() const noexcept override { return e_.gather_arena_numel(); }

 private:
  engine<S, T, C, G> e_;
};
}  // namespace detail

/// The engine for ZeRO stage `level` (0-3; anything else is a loom::error naming it), built
/// with engine's constructor arguments.
template <floating_element T, comm::communicator C, floating_element G = T>
std::unique_ptr<any_engine<T, C, G>> make_engine(int level, C& comm, flat_layout layout, const engine_options& opt,
                                                 engine_resources res, const typename engine<stage0, T, C, G>::init_fn& init,
                                                 std::vector<sched::trace_step> gather_trace = {}) {
  return dispatch_stage(level, [&]<class S>(S) -> std::unique_ptr<any_engine<T, C, G>> {
    return std::make_unique<detail::engine_of<S, T, C, G>>(comm, std::move(layout), opt, res, init, std::move(gather_trace));
  });
}

}  // namespace loom::zero
