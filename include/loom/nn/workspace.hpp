#pragma once
// A scratch arena for the temporaries of forward and backward (gradients of intermediate
// activations, fp32 copies of 16-bit weights, attention's [seq, seq] tile).
//
// Why: layers need short-lived buffers whose sizes depend on the batch; allocating them per
// call would put the allocator in the hot loop. Spans taken from the arena stay valid until
// `reset()`. If the arena runs out it adds a chunk (old spans stay valid); the next `reset()`
// merges the chunks into one, so after the first step of a fixed shape nothing is allocated.

#include <loom/core/buffer.hpp>
#include <loom/core/memory.hpp>
#include <loom/nn/context.hpp>

#include <algorithm>
#include <cstddef>
#include <span>
#include <vector>

namespace loom::nn {

/// Scratch in D's memory, and D's context (nn/context.hpp): the layers that take a workspace
/// run their ops through ws.context(), so a rank's workspace says where its layers run.
template <class T, class D = host>
class workspace {
 public:
  /// A host workspace.
  explicit workspace(std::size_t capacity = 0, memory_resource& resource = default_resource<host>())
    requires std::same_as<D, host>
      : workspace(host_context(), capacity, resource) {}
  /// A workspace whose layers run on `context` (a CUDA one: on its stream), which must outlive it.
  explicit workspace(const device_context<D>& context, std::size_t capacity = 0,
                     memory_resource& resource = default_resource<D>())
      : context_(&context), resource_(&resource) {
    if (capacity) chunks_.emplace_back(capacity, *resource_);
  }

  const device_context<D>& context() const noexcept { return *context_; }

  /// n uninitialised elements, valid until reset(); 64-byte aligned (16 floats) starts.
  std::span<T> take(std::size_t n) {
    n = (n + 15) / 16 * 16;
    if (chunks_.empty() || used_ + n > chunks_.back().size()) {
      chunks_.emplace_back(std::max<std::size_t>(n, 1 << 16), *resource_);
      used_ = 0;
    }
    std::span<T> s(chunks_.back().data() + used_, n);
    used_ += n;
    high_ += n;
    peak_ = std::max(peak_, high_);
    return s;
  }
  /// n zero elements.
  std::span<T> take_zeroed(std::size_t n) {
    auto s = take(n);
    context_->fill(tensor_view<T, D, 1>(s.data(), extents<1>{static_cast<index_t>(n)}), T(0));
    return s;
  }
  /// Releases every span; merges the chunks into one sized for the largest use so far.
  void reset() {
    if (chunks_.size() > 1) {
      chunks_.clear();
      chunks_.emplace_back(peak_, *resource_);
    }
    used_ = 0;
    high_ = 0;
  }
  std::size_t capacity() const noexcept {
    std::size_t c = 0;
    for (const auto& b : chunks_) c += b.size();
    return c;
  }

 private:
  const device_context<D>* context_;
  memory_resource* resource_;
  std::vector<buffer<T, D>> chunks_;
  std::size_t used_ = 0, high_ = 0, peak_ = 0;
};

}  // namespace loom::nn
