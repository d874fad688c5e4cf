#pragma once
// reduce_scatter_scheduler: reduces gradients bucket by bucket while backward still runs.
//
// Backward produces gradients layer by layer, last layer first. The layers are grouped (in
// that order) into buckets of about reduce_bucket_size elements (bucket_plan.hpp); a bucket
// is reduced as soon as its last layer's backward is done -- asynchronously when
// overlap_comm is on, so the collective runs behind the next layers' backward. Two modes:
//  * all_reduce (ZeRO stage 0 and 1): gradients live in a full buffer owned by the caller;
//    a bucket is all-reduced in place (its layers are contiguous in the full layout).
//  * reduce_scatter (stage 2 and 3): only bucket-sized staging buffers exist (two, used in
//    turn, so one can fill while the other is being reduced); rank r receives slice r of
//    every parameter directly into its gradient shard. With contiguous_gradients the bucket
//    is first packed rank-major (slice r of each parameter side by side) so the whole bucket
//    is one reduce_scatter; without it, each parameter is its own reduce_scatter (no copy,
//    more collectives).
// Reductions are sums; the caller divides by the world size where it needs a mean.
// Plan at construction, run with no allocation: staging, packing buffers and work handles
// are sized from the plan.

#include <loom/comm/communicator.hpp>
#include <loom/core/buffer.hpp>
#include <loom/core/dtype.hpp>
#include <loom/core/error.hpp>
#include <loom/core/memory.hpp>
#include <loom/sched/bucket_plan.hpp>
#include <loom/sched/layer_layout.hpp>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <span>
#include <vector>

namespace loom::sched {

enum class reduce_mode { all_reduce, reduce_scatter };

struct reduce_options {
  std::size_t bucket_numel = 500'000'000;  ///< reduce_bucket_size
  bool overlap_comm = true;
  bool contiguous_gradients = true;
  reduce_mode mode = reduce_mode::reduce_scatter;
};

/// One launched bucket, for instrumentation: launched after the backward of `after_layer`.
struct reduce_event {
  std::size_t bucket = 0;
  std::size_t after_layer = 0;
  std::size_t numel = 0;
  std::size_t collectives = 0;
};

template <element T, comm::communicator C>
class reduce_scatter_scheduler {
 public:
  /// full_grads: [layout.padded_total()] in all_reduce mode, else empty.
  /// grad_shard: [layout.shard_total()] in reduce_scatter mode, else empty.
  reduce_scatter_scheduler(C& comm, const layer_layout& layout, const reduce_options& opt, memory_resource& scratch,
                           std::span<T> full_grads, std::span<T> grad_shard)
      : comm_(&comm), layout_(&layout), opt_(opt), full_(full_grads), shard_(grad_shard) {
    LOOM_CHECK(static_cast<std::size_t>(comm.size()) == layout.world(), "reduce_scatter_scheduler: communicator size ",
               comm.size(), " differs from the layout's world=", layout.world());
    const std::size_t L = layout.layers();
    std::vector<std::size_t> sizes(L);
    for (std::size_t i = 0; i < L; ++i) sizes[i] = layout.layer_padded_numel(L - 1 - i);  // backward order
    plan_ = plan_buckets(sizes, opt.bucket_numel);
    if (opt.mode == reduce_mode::all_reduce) {
      LOOM_CHECK(full_grads.size() == layout.padded_total(), "reduce_scatter_scheduler: all_reduce mode needs full_grads of ",
                 layout.padded_total(), " elements, got ", full_grads.size());
    } else {
      LOOM_CHECK(grad_shard.size() == layout.shard_total(), "reduce_scatter_scheduler: reduce_scatter mode needs grad_shard of ",
                 layout.shard_total(), " elements, got ", grad_shard.size());
      for (auto& s : staging_) s = buffer<T>(plan_.max_bucket_numel, scratch);
      if (opt.contiguous_gradients)
        for (auto& s : packed_) s = buffer<T>(plan_.max_bucket_numel, scratch);
    }
    std::size_t most = 1;
    for (const bucket& b : plan_.buckets)
      most = std::max(most, opt.contiguous_gradients || opt.mode == reduce_mode::all_reduce ? std::size_t{1}
                                                                                              : params_in(b));
    for (auto& w : works_) w.resize(most);
    events_.reserve(plan_.buckets.size());
  }
  reduce_scatter_scheduler(const reduce_scatter_scheduler&) = delete;
  reduce_scatter_scheduler& operator=(const reduce_scatter_scheduler&) = delete;
  ~reduce_scatter_scheduler() {
    for (auto& ws : works_)
      for (comm::work& w : ws) try {
          w.wait();
        } catch (...) {
        }
  }

  const bucket_plan& plan() const noexcept { return plan_; }
  /// Buckets launched in the current (or last) backward, in order.
  const std::vector<reduce_event>& events() const noexcept { return events_; }
  /// Seconds spent blocked on reductions (the communication backward did not hide).
  double wait_seconds() const noexcept { return wait_seconds_; }

  /// Where backward writes layer l's gradients: its padded parameters, concatenated
  /// [layer_padded_numel(l)]. Backward assigns every real element; padding is zero.
  /// Call once per layer, in backward order (L-1 down to 0).
  std::span<T> layer_gradients(std::size_t l) {
    LOOM_CHECK(l < layout_->layers(), "reduce_scatter_scheduler: layer=", l, " out of range (", layout_->layers(), " layers)");
    if (l + 1 == layout_->layers()) events_.clear();
    if (opt_.mode == reduce_mode::all_reduce) return full_.subspan(layout_->layer_offset(l), layout_->layer_padded_numel(l));
    const std::size_t b = bucket_of_layer(l);
    const bucket& bk = plan_.buckets[b];
    if (first_layer_of(bk) == l) wait_slot(b % 2);  // the slot's previous bucket must be done with it
    const std::size_t base = layout_->layer_offset(lowest_layer_of(bk));
    std::span<T> region = std::span<T>(staging_[b % 2].data(), bk.numel)
                              .subspan(layout_->layer_offset(l) - base, layout_->layer_padded_numel(l));
    for (std::size_t p = layout_->layer_begin(l); p < layout_->layer_end(l); ++p)  // the slot held another bucket
      std::fill(region.begin() + (layout_->offset(p) - layout_->layer_offset(l)) + layout_->numel(p),
                region.begin() + (layout_->offset(p) - layout_->layer_offset(l)) + layout_->padded_numel(p), T{});
    return region;
  }

  /// Backward of layer l is done: launch its bucket if l completes it.
  void layer_done(std::size_t l) {
    const std::size_t b = bucket_of_layer(l);
    const bucket& bk = plan_.buckets[b];
    if (lowest_layer_of(bk) != l) return;
    launch(b, l);
    if (!opt_.overlap_comm) wait_slot(b % 2);
  }

  /// Polls the reductions in flight (Open MPI progresses non-blocking collectives only
  /// inside MPI calls): call between layers.
  void progress() {
    for (auto& ws : works_)
      for (comm::work& w : ws) w.test();
  }

  /// Waits for every launched bucket: gradients are reduced after this returns.
  void finish() {
    wait_slot(0);
    wait_slot(1);
  }

 private:
  std::size_t bucket_of_layer(std::size_t l) const { return plan_.bucket_of[layout_->layers() - 1 - l]; }
  std::size_t first_layer_of(const bucket& b) const { return layout_->layers() - 1 - b.first; }   // highest layer
  std::size_t lowest_layer_of(const bucket& b) const { return layout_->layers() - b.last; }
  std::size_t params_in(const bucket& b) const {
    return layout_->layer_end(first_layer_of(b)) - layout_->layer_begin(lowest_layer_of(b));
  }

  void launch(std::size_t b, std::size_t after_layer) {
    const bucket& bk = plan_.buckets[b];
    const std::size_t lo = layout_->layer_begin(lowest_layer_of(bk)), hi = layout_->layer_end(first_layer_of(bk));
    const std::size_t base = layout_->offset(lo), world = layout_->world();
    wait_slot(b % 2);  // two buckets in flight at most; the slot's previous one must be done
    auto& ws = works_[b % 2];
    std::size_t n = 0;
    if (opt_.mode == reduce_mode::all_reduce) {
      std::span<T> region = full_.subspan(base, bk.numel);
      ws[n++] = comm_->all_reduce_async(std::span<const T>(region), region, comm::reduce_op::sum);
    } else if (opt_.contiguous_gradients) {
      // [numel] param-major (each param [world, shard]) -> [world, bucket shard] rank-major
      const T* src = staging_[b % 2].data();
      T* dst = packed_[b % 2].data();
      const std::size_t bucket_shard = bk.numel / world;
      for (std::size_t p = lo; p < hi; ++p) {
        const std::size_t s = layout_->shard_numel(p), from = layout_->offset(p) - base,
                          to = layout_->shard_offset(p) - layout_->shard_offset(lo);
        for (std::size_t r = 0; r < world; ++r)
          std::copy_n(src + from + r * s, s, dst + r * bucket_shard + to);
      }
      ws[n++] = comm_->reduce_scatter_async(std::span<const T>(dst, bk.numel),
                                            shard_.subspan(layout_->shard_offset(lo), bucket_shard), comm::reduce_op::sum);
    } else {
      const T* src = staging_[b % 2].data();
      for (std::size_t p = lo; p < hi; ++p)
        ws[n++] = comm_->reduce_scatter_async(std::span<const T>(src + layout_->offset(p) - base, layout_->padded_numel(p)),
                                              shard_.subspan(layout_->shard_offset(p), layout_->shard_numel(p)),
                                              comm::reduce_op::sum);
    }
    events_.push_back({b, after_layer, bk.numel, n});
  }

  void wait_slot(std::size_t slot) {
    const auto t0 = std::chrono::steady_clock::now();
    for (comm::work& w : works_[slot]) w.wait();
    wait_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }

  C* comm_;
  const layer_layout* layout_;
  reduce_options opt_;
  bucket_plan plan_;
  std::span<T> full_, shard_;
  buffer<T> staging_[2];  // [max bucket] param-major, filled by backward
  buffer<T> packed_[2];   // [max bucket] rank-major (contiguous_gradients)
  std::vector<comm::work> works_[2];
  std::vector<reduce_event> events_;
  double wait_seconds_ = 0;
};

}  // namespace loom::sched
