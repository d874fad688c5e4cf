#pragma once
// Device tags: empty types that select kernel overloads and memory resources at compile time.
//
// `ops::gemm(loom::host{}, ...)` and `ops::gemm(loom::cuda{}, ...)` are the same function name
// overloaded on the tag (as Thrust's execution policies); a view's Device parameter tells
// whether the host may dereference it.

#include <loom/core/config.hpp>

#include <concepts>
#include <string_view>

namespace loom {

/// Host memory and CPU execution.
struct host {
  static constexpr std::string_view name = "host";
  static constexpr bool host_accessible = true;
};

/// CUDA device memory and execution on the current CUDA device.
struct cuda {
  static constexpr std::string_view name = "cuda";
  static constexpr bool host_accessible = false;
};

/// Requires: D is loom::host or loom::cuda.
template <class D>
concept device_tag = std::same_as<D, host> || std::same_as<D, cuda>;

}  // namespace loom
