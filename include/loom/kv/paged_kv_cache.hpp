#pragma once
// paged_kv_cache<T, Device>: the preallocated pool of key/value blocks of every layer.
//
// Why: the whole KV memory is one allocation made at start-up (vLLM's gpu_memory_utilization
// budget); sequences only ever borrow block ids from a block_allocator. Per layer the layout
// is FlashInfer's NHD paged layout with K and V side by side in each page:
//   [num_blocks, 2, block_size, num_kv_heads, head_dim]   (index 0: keys, 1: values)
// so that a host kernel, a CUDA kernel and FlashInfer read the same bytes.

#include <loom/core/buffer.hpp>
#include <loom/core/device.hpp>
#include <loom/core/dtype.hpp>
#include <loom/core/error.hpp>
#include <loom/core/memory.hpp>
#include <loom/core/tensor_view.hpp>
#include <loom/kv/block_allocator.hpp>

#include <cstdint>
#include <cstring>

namespace loom::kv {

struct kv_cache_shape {
  std::int32_t num_layers = 1;
  std::int32_t num_blocks = 1;
  std::int32_t block_size = 16;
  std::int32_t num_kv_heads = 1;
  std::int32_t head_dim = 1;

  /// Elements of one block of one layer (keys and values).
  std::int64_t block_elems() const noexcept { return 2ll * block_size * num_kv_heads * head_dim; }
  std::int64_t layer_elems() const noexcept { return block_elems() * num_blocks; }
  void validate() const {
    LOOM_CHECK(num_layers > 0, "kv_cache_shape: num_layers must be > 0, got ", num_layers);
    LOOM_CHECK(num_blocks > 0, "kv_cache_shape: num_blocks must be > 0, got ", num_blocks);
    LOOM_CHECK(block_size > 0, "kv_cache_shape: block_size must be > 0, got ", block_size);
    LOOM_CHECK(num_kv_heads > 0, "kv_cache_shape: num_kv_heads must be > 0, got ", num_kv_heads);
    LOOM_CHECK(head_dim > 0, "kv_cache_shape: head_dim must be > 0, got ", head_dim);
  }
};

/// Requires: T is a storage element loom can convert to and from float.
template <class T>
concept kv_element = floating_element<T>;

template <kv_element T, device_tag Device = host>
class paged_kv_cache {
 public:
  using layer_view = tensor_view<T, Device, 5>;  // [num_blocks, 2, block_size, num_kv_heads, head_dim]

  explicit paged_kv_cache(const kv_cache_shape& shape, memory_resource& resource = default_resource<Device>())
      : shape_((shape.validate(), shape)), pool_(static_cast<std::size_t>(shape.layer_elems() * shape.num_layers), resource) {}

  const kv_cache_shape& shape() const noexcept { return shape_; }
  std::size_t bytes() const noexcept { return pool_.bytes(); }

  layer_view layer(std::int32_t l) {
    LOOM_CHECK(l >= 0 && l < shape_.num_layers, "paged_kv_cache::layer: layer ", l, " out of range [0, ",
               shape_.num_layers, ")");
    return {pool_.data() + static_cast<std::int64_t>(l) * shape_.layer_elems(),
            extents<5>{shape_.num_blocks, 2, shape_.block_size, shape_.num_kv_heads, shape_.head_dim}};
  }

  /// Copy-on-write: block `src` to block `dst` in every layer.
  void copy_block(block_id src, block_id dst)
    requires(Device::host_accessible)
  {
    LOOM_CHECK(src >= 0 && src < shape_.num_blocks && dst >= 0 && dst < shape_.num_blocks,
               "paged_kv_cache::copy_block: src=", src, " dst=", dst, " out of range for num_blocks=", shape_.num_blocks);
    const std::int64_t n = shape_.block_elems();
    for (std::int32_t l = 0; l < shape_.num_layers; ++l) {
      T* base = pool_.data() + static_cast<std::int64_t>(l) * shape_.layer_elems();
      std::memcpy(base + dst * n, base + src * n, static_cast<std::size_t>(n) * sizeof(T));
    }
  }

 private:
  kv_cache_shape shape_;
  buffer<T, Device> pool_;
};

}  // namespace loom::kv
