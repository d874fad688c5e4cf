#pragma once
// The hook the forward-only layers (nn::attention::forward_cached, nn::swiglu_mlp::forward)
// call after each of their projections: hook(which, x, y) with the projection's input
// x [rows, in] and its output y [rows, out] (this rank's part, bias added, before the tensor
// group's sum and before rotary), which the hook may add to.
//
// Why a hook rather than adapters inside the layers: what is added depends on each row, not
// on the layer (a server's continuous batch holds sequences of several LoRA adapters, and
// each row gets its own sequence's low-rank term), so the caller, which knows the rows,
// adds it; the layers keep one forward for every use. no_projection_hook is the layers as
// they are.

#include <loom/core/tensor_view.hpp>

namespace loom::nn {

/// A decoder block's projections, by what they compute (HF's names: q/k/v/o_proj,
/// gate/up/down_proj; a fused q/k/v or gate/up tensor is called once per part).
enum class projection { q, k, v, o, gate, up, down };
inline constexpr int num_projections = 7;

/// Adds nothing.
struct no_projection_hook {
  template <class X, class Y>
  void operator()(projection, const X&, const Y&) const noexcept {}
};

}  // namespace loom::nn
