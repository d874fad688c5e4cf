#pragma once
// A quantised frozen base (QLoRA: NF4 or bf16) partitioned over the data-parallel group, as
// ZeRO-3 partitions parameters: each dp rank keeps 1/dp of every projection's packed bytes
// (frozen_projection::packed_bytes: NF4 codes + absmax or their double-quantised state, or
// the bf16 values) and a stage block's projections are all-gathered just before the block
// runs, forward or backward, and dropped after.
//
// Why the packed bytes and not values: the gather moves what the rank would otherwise hold
// (about half a byte a parameter for NF4), and the GEMMs read the gathered bytes in place
// (quant::nf4_view), so a partitioned run computes on exactly the bytes a replicated one holds
// and its results are the same bit for bit.
//
// The gathering is the library's ZeRO-3 machinery, not a second scheduler: a
// sched::layer_layout whose layers are the stage's blocks and whose elements are bytes, a
// sched::all_gather_plan over the order the passes use the blocks (prefetch, the live cap,
// release after the last consecutive use), run by sched::all_gather_scheduler into one arena.
// ds_config's stage3 knobs count parameters; here they are turned into bytes at the base's
// bytes per parameter, the live cap bounded by the other ranks' slices. A projection of at most stage3_param_persistence_threshold parameters
// is not partitioned: its frozen_projection keeps it whole (numel 0 here), as ZeRO-3 keeps
// small parameters gathered.

#include <loom/comm/communicator.hpp>
#include <loom/core/buffer.hpp>
#include <loom/core/error.hpp>
#include <loom/core/memory.hpp>
#include <loom/sched/all_gather_plan.hpp>
#include <loom/sched/all_gather_scheduler.hpp>
#include <loom/sched/layer_layout.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace llama3d {

template <loom::comm::communicator C>
class partitioned_base {
 public:
  /// bytes[p]: projection p's packed bytes (0: not partitioned, its op keeps it whole);
  /// block[p]: the stage block it belongs to (0, 0, ..., 1, ...: non-decreasing, none
  /// skipped); params: the partitioned projections' parameters (to turn `stage3`, counted in
  /// parameters, into bytes); mr: this rank's slices and the gather arena.
  partitioned_base(C& dp, std::span<const std::size_t> bytes, std::span<const std::size_t> block,
                   const loom::sched::all_gather_options& stage3, std::size_t params, loom::memory_resource& mr)
      : comm_(&dp), mr_(&mr), layout_(bytes, block, static_cast<std::size_t>(dp.size())), shard_(layout_.shard_total(), mr) {
    std::fill(shard_.begin(), shard_.end(), std::uint8_t{0});
    std::size_t total = 0;
    for (const std::size_t b : bytes) total += b;
    const double per_param = params ? double(total) / double(params) : 1.0;
    const auto in_bytes = [&](std::size_t n) {
      const double b = double(n) * per_param;
      return b >= 1e18 ? std::size_t(1e18) : static_cast<std::size_t>(b);
    };
    opt_.prefetch_numel = in_bytes(stage3.prefetch_numel);
    // The live cap: no more than the other ranks' slices, since a window larger than those
    // would have a rank hold more than the replicated base (the plan gathers a block anew for
    // each of its non-consecutive uses, so a prefetch bucket larger than the model would hold
    // some blocks twice); and at least the largest block, the least a pass needs.
    std::size_t largest = 0;
    for (std::size_t l = 0; l < layout_.layers(); ++l) largest = std::max(largest, layout_.layer_padded_numel(l));
    const std::size_t others = layout_.padded_total() - layout_.shard_total();
    opt_.max_live_numel = std::max(std::min(in_bytes(stage3.max_live_numel), others), largest);
    opt_.persistence_threshold = 0;  // numel 0: kept whole by its op
  }

  const loom::sched::layer_layout& layout() const noexcept { return layout_; }
  /// Bytes this rank keeps: its slice of every partitioned projection.
  std::size_t shard_bytes() const noexcept { return shard_.bytes(); }
  /// Bytes of the current plan's gather arena (the gathered window).
  std::size_t arena_bytes() const noexcept { return gather_ ? gather_->plan().arena_numel : 0; }

  /// Keeps this rank's slice of projection p's packed bytes (given whole, bytes[p] of them).
  void store(std::size_t p, std::span<const std::uint8_t> packed) {
    LOOM_CHECK(packed.size() == layout_.numel(p), "llama3d::partitioned_base: projection ", p, " has ", layout_.numel(p),
               " packed bytes, ", packed.size(), " given");
    const std::size_t s = layout_.shard_numel(p), first = static_cast<std::size_t>(comm_->rank()) * s;
    for (std::size_t i = 0; i < s; ++i) shard_[layout_.shard_offset(p) + i] = first + i < packed.size() ? packed[first + i] : 0;
  }

  /// The order in which the passes use the blocks from the next acquire on (a step's, or a
  /// forward-only evaluation's); re-plans the gathers. Only between whole traces.
  void set_trace(std::vector<loom::sched::trace_step> trace) {
    LOOM_CHECK(!in_block_ && cursor_ == 0, "llama3d::partitioned_base::set_trace: called inside a trace (step ", cursor_, ")");
    gather_.reset();  // its arena goes back before the new one is taken
    gather_ = std::make_unique<loom::sched::all_gather_scheduler<std::uint8_t, C>>(
        *comm_, layout_, loom::sched::plan_all_gather(layout_, std::move(trace), opt_), *mr_);
    ptrs_.assign(layout_.params(), nullptr);
  }

  /// Block b's partitioned projections gathered (b must be the trace's next block): bytes(p)
  /// is projection p's packed copy until release(b).
  void acquire(std::size_t b) {
    LOOM_CHECK(gather_ && !in_block_ && gather_->plan().trace[cursor_].layer == b, "llama3d::partitioned_base: block ", b,
               " asked for at step ", cursor_, " of the gather trace",
               gather_ ? ", which expects block " + std::to_string(gather_->plan().trace[cursor_].layer) : std::string(" (no trace set)"));
    in_block_ = true;
    gather_->acquire(cursor_, std::span<const std::uint8_t>(shard_.span()), std::span<std::uint8_t*>(ptrs_));
  }
  std::span<const std::uint8_t> bytes(std::size_t p) const noexcept { return {ptrs_[p], layout_.numel(p)}; }
  /// Ends the use of block b (its gathered copy is dropped after its last consecutive use).
  void release(std::size_t b) {
    LOOM_CHECK(in_block_ && gather_->plan().trace[cursor_].layer == b, "llama3d::partitioned_base: block ", b, " was not acquired");
    in_block_ = false;
    gather_->release(cursor_);
    gather_->progress();
    cursor_ = cursor_ + 1 == gather_->plan().trace.size() ? 0 : cursor_ + 1;
  }

  /// Projection p's packed bytes whole, outside the passes (collective over dp).
  std::vector<std::uint8_t> gather(std::size_t p) {
    std::vector<std::uint8_t> all(layout_.padded_numel(p));
    comm_->all_gather(std::span<const std::uint8_t>(shard_.data() + layout_.shard_offset(p), layout_.shard_numel(p)),
                      std::span<std::uint8_t>(all));
    all.resize(layout_.numel(p));
    return all;
  }

 private:
  C* comm_;
  loom::memory_resource* mr_;
  loom::sched::layer_layout layout_;  // layers: the stage's blocks; elements: bytes
  loom::sched::all_gather_options opt_;
  loom::buffer<std::uint8_t> shard_;  // this rank's slice of every partitioned projection
  std::unique_ptr<loom::sched::all_gather_scheduler<std::uint8_t, C>> gather_;
  std::vector<std::uint8_t*> ptrs_;  // projection -> its gathered copy while its block is acquired
  std::size_t cursor_ = 0;
  bool in_block_ = false;
};

}  // namespace llama3d
