#pragma once
// fp32 master weights for half / bfloat16 parameters, and the casts between them.
//
// Why: an Adam update (lr * m / sqrt(v)) is often below half's or bfloat16's resolution
// around the weight; applied to a 16-bit weight it would round away. Mixed-precision
// training therefore keeps an fp32 "master" copy that the optimizer updates, and writes the
// rounded result back to the 16-bit model copy used by forward and backward. Gradients come
// out of backward in the model's type, multiplied by the loss scale; they are unscaled while
// being widened into an fp32 gradient buffer.
//
// Everything here works on spans, so the same calls serve a whole flat parameter buffer
// (one rank) and one rank's ZeRO shard of it. Float-to-16-bit casts round to nearest even
// (loom::half / loom::bfloat16 conversions).

#include <loom/core/buffer.hpp>
#include <loom/core/dtype.hpp>
#include <loom/core/error.hpp>
#include <loom/core/memory.hpp>

#include <cstddef>
#include <span>

namespace loom::amp {

/// out[i] = To(in[i]) (round to nearest even when narrowing).
template <floating_element From, floating_element To>
inline void cast(std::span<const From> in, std::span<To> out) {
  LOOM_CHECK(in.size() == out.size(), "amp::cast: sizes differ, in.size()=", in.size(), " out.size()=", out.size());
  const std::size_t n = in.size();
  for (std::size_t i = 0; i < n; ++i) out[i] = To(static_cast<float>(in[i]));
}

/// master_grads[i] = float(grads[i]) * inv_scale  (widen and unscale in one pass).
template <floating_element T>
inline void unscale_to_master(std::span<const T> grads, std::span<float> master_grads, float inv_scale) {
  LOOM_CHECK(grads.size() == master_grads.size(), "amp::unscale_to_master: sizes differ, grads.size()=", grads.size(),
             " master_grads.size()=", master_grads.size());
  const std::size_t n = grads.size();
  for (std::size_t i = 0; i < n; ++i) master_grads[i] = static_cast<float>(grads[i]) * inv_scale;
}

/// An fp32 copy of (a shard of) a model's parameters of element type T.
template <floating_element T>
class master_weights {
 public:
  master_weights() = default;
  /// Copies `model` (widening to fp32) into a buffer from `resource`.
  explicit master_weights(std::span<const T> model, memory_resource& resource = default_resource<host>())
      : master_(model.size(), resource) {
    cast(model, master_.span());
  }
  std::span<float> span() noexcept { return master_.span(); }
  std::span<const float> span() const noexcept { return master_.span(); }
  std::size_t size() const noexcept { return master_.size(); }
  /// Writes the (updated) master values back into the model's copy, rounding to T.
  void copy_to(std::span<T> model) const { cast(std::span<const float>(master_.span()), model); }
  /// Reloads the master values from a model copy (e.g. after loading 16-bit weights).
  void copy_from(std::span<const T> model) { cast(model, master_.span()); }

 private:
  buffer<float> master_;
};

}  // namespace loom::amp
