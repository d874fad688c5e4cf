#pragma once
// ZeRO stages as policy types.
//
// What each stage partitions across the N data-parallel ranks (Rajbhandari et al., 2020),
// with Ψ parameters, 2-byte parameters/gradients and fp32 Adam (12 bytes: master, m, v):
//   stage<0>  nothing: plain data parallel, gradients all-reduced     16Ψ       per rank
//   stage<1>  optimizer state (P_os)                                  4Ψ + 12Ψ/N
//   stage<2>  + gradients, reduce-scattered in buckets (P_os+g)       2Ψ + 14Ψ/N
//   stage<3>  + parameters, gathered per layer on demand (P_os+g+p)   16Ψ/N (+ persistent)
// The engine branches on the three std::bool_constant members with `if constexpr`; any
// other stage number fails to compile with a message.

#include <loom/core/error.hpp>

#include <concepts>
#include <type_traits>

namespace loom::zero {

template <int N>
struct stage {
  static_assert(N >= 0 && N <= 3, "loom::zero::stage<N>: ZeRO stage must be 0, 1, 2 or 3");
  static constexpr int level = N;
  using shards_optimizer = std::bool_constant<(N >= 1)>;
  using shards_gradients = std::bool_constant<(N >= 2)>;
  using shards_parameters = std::bool_constant<(N >= 3)>;
};

using stage0 = stage<0>;
using stage1 = stage<1>;
using stage2 = stage<2>;
using stage3 = stage<3>;

/// Requires: S says which model states it partitions (see loom::zero::stage).
template <class S>
concept stage_policy = requires {
  { S::level } -> std::convertible_to<int>;
  requires std::derived_from<typename S::shards_optimizer, std::bool_constant<S::shards_optimizer::value>>;
  requires std::derived_from<typename S::shards_gradients, std::bool_constant<S::shards_gradients::value>>;
  requires std::derived_from<typename S::shards_parameters, std::bool_constant<S::shards_parameters::value>>;
};

/// Calls fn(stage<N>{}) for a stage number read at run time (from ds_config.json).
template <class Fn>
decltype(auto) dispatch_stage(int level, Fn&& fn) {
  switch (level) {
    case 0: return fn(stage0{});
    case 1: return fn(stage1{});
    case 2: return fn(stage2{});
    case 3: return fn(stage3{});
  }
  LOOM_THROW("zero_optimization.stage=", level, " is not supported (expected 0, 1, 2 or 3)");
}
}  // namespace loom::zero
