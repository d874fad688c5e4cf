#pragma once
// The stage-3 all-gather plan: which layer's parameters are gathered when, where they live,
// and when they are released, for one forward + backward pass.
//
// Why a plan: the order in which ZeRO-3 needs parameters is known before training (forward
// through the layers, then backward in reverse), so every decision DeepSpeed's runtime
// makes on the fly -- prefetch, release, where to put a gathered buffer -- is made here
// once, on the host, and checked. The executor (all_gather_scheduler.hpp) then only issues
// the collectives the plan lists, into a preallocated arena, with no allocation.
//
// Rules (DeepSpeed's stage3_* knobs, all counted in elements like ds_config.json):
//  * a parameter with numel <= persistence_threshold is persistent: gathered once, kept
//    (not in this plan; the engine owns those copies);
//  * the trace is forward 0..L-1 then backward L-1..0, or any order of layer uses a caller
//    gives (a pipeline stage's passes); consecutive steps of the same layer (the last layer's
//    forward then backward) share one gathered copy: an *instance*;
//  * before computing step t its instance is ready (gathered now if it was not prefetched),
//    then later instances are prefetched in trace order while the elements gathered ahead
//    of use stay <= prefetch_numel and the live gathered elements stay <= max_live_numel;
//  * an instance is released right after its last step.
// Instances are issued and released in trace order, so the arena (first fit) stays small.

#include <loom/core/error.hpp>
#include <loom/sched/layer_layout.hpp>

#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

namespace loom::sched {

enum class pass : std::uint8_t { forward, backward };

constexpr std::string_view pass_name(pass p) noexcept { return p == pass::forward ? "forward" : "backward"; }

struct all_gather_options {
  std::size_t prefetch_numel = 50'000'000;       ///< stage3_prefetch_bucket_size
  std::size_t max_live_numel = 1'000'000'000;    ///< stage3_max_live_parameters
  std::size_t persistence_threshold = 100'000;   ///< stage3_param_persistence_threshold
};

struct trace_step {
  std::size_t layer = 0;
  pass phase = pass::forward;
};

/// One gathered copy of a layer's non-persistent parameters, used by steps [first_step, last_step].
struct gather_instance {
  std::size_t layer = 0;
  std::size_t first_step = 0;
  std::size_t last_step = 0;
  std::size_t numel = 0;         ///< gathered (padded) elements
  std::size_t arena_offset = 0;  ///< where in the arena, elements
  std::size_t issue_step = 0;    ///< the step whose acquire issues it
  bool prefetched = false;       ///< issued ahead of its first step
};

struct all_gather_plan {
  std::vector<trace_step> trace;                ///< 2 * layers steps
  std::vector<gather_instance> instances;       ///< in trace (= issue = release) order
  std::vector<std::ptrdiff_t> instance_at;      ///< step -> instance, -1 when the layer is all persistent
  std::vector<std::size_t> issued_by;           ///< step -> instances issued by the end of its acquire
  std::vector<unsigned char> persistent;        ///< parameter -> kept gathered
  std::vector<std::size_t> local_offset;        ///< parameter -> offset inside its layer's gathered copy
  std::vector<std::size_t> layer_gather_numel;  ///< layer -> elements gathered per instance
  std::size_t arena_numel = 0;                  ///< arena the executor allocates
  std::size_t peak_live_numel = 0;              ///< most gathered elements live at once
  std::size_t persistent_numel = 0;             ///< padded elements of persistent parameters
  all_gather_options options;
};

/// The plan for one forward 0..L-1 and one backward L-1..0 (a model trained one batch a step).
inline all_gather_plan plan_all_gather(const layer_layout& layout, const all_gather_options& opt);

/// The plan for any order of use: `trace` lists the layers in the order a step reads them
/// (a pipeline stage reads its layers once per micro-batch pass, in the order its schedule
/// runs the passes); a layer used at consecutive steps keeps one gathered copy.
inline all_gather_plan plan_all_gather(const layer_layout& layout, std::vector<trace_step> trace,
                                       const all_gather_options& opt) {
  all_gather_plan plan;
  plan.options = opt;
  const std::size_t L = layout.layers();
  plan.persistent.resize(layout.params());
  plan.local_offset.resize(layout.params());
  plan.layer_gather_numel.resize(L, 0);
  for (std::size_t l = 0; l < L; ++l)
    for (std::size_t p = layout.layer_begin(l); p < layout.layer_end(l); ++p) {
      plan.persistent[p] = layout.numel(p) <= opt.persistence_threshold;
      if (plan.persistent[p]) {
        plan.persistent_numel += layout.padded_numel(p);
      } else {
        plan.local_offset[p] = plan.layer_gather_numel[l];
        plan.layer_gather_numel[l] += layout.padded_numel(p);
      }
    }
  for (std::size_t l = 0; l < L; ++l)
    LOOM_CHECK(plan.layer_gather_numel[l] <= opt.max_live_numel, "stage3_max_live_parameters=", opt.max_live_numel,
               " is smaller than layer ", l, ", which gathers ", plan.layer_gather_numel[l],
               " elements; raise it to at least the largest layer");

  LOOM_CHECK(!trace.empty(), "plan_all_gather: the trace of layer uses is empty");
  for (const trace_step& st : trace)
    LOOM_CHECK(st.layer < L, "plan_all_gather: the trace uses layer ", st.layer, " of a model with ", L, " layers");
  plan.trace = std::move(trace);
  const std::size_t T = plan.trace.size();
  plan.instance_at.assign(T, -1);
  for (std::size_t t = 0; t < T; ++t) {
    const std::size_t l = plan.trace[t].layer;
    if (plan.layer_gather_numel[l] == 0) continue;
    if (t > 0 && plan.trace[t - 1].layer == l && plan.instance_at[t - 1] >= 0) {
      plan.instance_at[t] = plan.instance_at[t - 1];
      plan.instances.back().last_step = t;
    } else {
      plan.instance_at[t] = static_cast<std::ptrdiff_t>(plan.instances.size());
      plan.instances.push_back({l, t, t, plan.layer_gather_numel[l], 0, 0, false});
    }
  }

  // Simulate the run: first-fit arena, live and ahead-of-use accounting.
  struct live_block { std::size_t offset, numel, instance; };
  std::vector<live_block> live;  // sorted by offset
  std::size_t live_numel = 0, next = 0;
  auto issue = [&](std::size_t k, std::size_t t, bool prefetched) {
    gather_instance& g = plan.instances[k];
    std::size_t off = 0, pos = 0;
    for (; pos < live.size(); ++pos) {
      if (live[pos].offset >= off + g.numel) break;
      off = live[pos].offset + live[pos].numel;
    }
    live.insert(live.begin() + static_cast<std::ptrdiff_t>(pos), live_block{off, g.numel, k});
    g.arena_offset = off;
    g.issue_step = t;
    g.prefetched = prefetched;
    live_numel += g.numel;
    if (off + g.numel > plan.arena_numel) plan.arena_numel = off + g.numel;
    if (live_numel > plan.peak_live_numel) plan.peak_live_numel = live_numel;
  };
  plan.issued_by.resize(T);
  for (std::size_t t = 0; t < T; ++t) {
    const std::ptrdiff_t k = plan.instance_at[t];
    if (k >= 0 && plan.instances[k].first_step == t && next <= static_cast<std::size_t>(k)) {
      issue(static_cast<std::size_t>(k), t, false);  // on demand: nothing is ahead of it, so it fits
      next = static_cast<std::size_t>(k) + 1;
    }
    std::size_t ahead = 0;  // issued, not yet started
    for (std::size_t j = (k >= 0 ? static_cast<std::size_t>(k) + 1 : 0); j < next; ++j)
      if (plan.instances[j].first_step > t) ahead += plan.instances[j].numel;
    while (next < plan.instances.size()) {
      const std::size_t n = plan.instances[next].numel;
      if (ahead + n > opt.prefetch_numel || live_numel + n > opt.max_live_numel) break;
      issue(next, t, true);
      ahead += n;
      ++next;
    }
    plan.issued_by[t] = next;
    if (k >= 0 && plan.instances[k].last_step == t) {
      for (std::size_t pos = 0; pos < live.size(); ++pos)
        if (live[pos].instance == static_cast<std::size_t>(k)) {
          live_numel -= live[pos].numel;
          live.erase(live.begin() + static_cast<std::ptrdiff_t>(pos));
          break;
        }
    }
  }
  return plan;
}

inline all_gather_plan plan_all_gather(const layer_layout& layout, const all_gather_options& opt) {
  std::vector<trace_step> trace;
  for (std::size_t l = 0; l < layout.layers(); ++l) trace.push_back({l, pass::forward});
  for (std::size_t l = layout.layers(); l-- > 0;) trace.push_back({l, pass::backward});
  return plan_all_gather(layout, std::move(trace), opt);
}

}  // namespace loom::sched
