#pragma once
// buffer<T, Device>: an owning, move-only array from a memory_resource.
//
// The one owning container of loom. Views are taken from it for all computation. Host
// buffers are zero-filled on creation (deterministic results beat a memset saved); device
// buffers are not initialised.

#include <loom/core/config.hpp>
#include <loom/core/device.hpp>
#include <loom/core/error.hpp>
#include <loom/core/memory.hpp>
#include <loom/core/tensor_view.hpp>

#include <cstddef>
#include <cstring>
#include <span>
#include <type_traits>
#include <utility>

namespace loom {

/// Requires: T can be copied with memcpy (elements of buffers move between devices and ranks as bytes).
template <class T>
concept trivially_copyable = std::is_trivially_copyable_v<T>;

template <trivially_copyable T, device_tag Device = host>
class buffer {
 public:
  using value_type = T;
  using device_type = Device;

  buffer() = default;
  explicit buffer(std::size_t n, memory_resource& resource = default_resource<Device>())
      : resource_(&resource), size_(n) {
    LOOM_CHECK(!Device::host_accessible || resource.host_accessible(), "buffer: host buffer given resource '",
               resource.name(), "' whose memory the host cannot access");
    LOOM_CHECK(n <= (std::size_t(-1) / 2) / sizeof(T), "buffer: element count n=", n, " is too large");
    data_ = static_cast<T*>(resource.allocate(n * sizeof(T), alignment()));
    if constexpr (Device::host_accessible)
      if (n) std::memset(static_cast<void*>(data_), 0, n * sizeof(T));
  }
  /// Host buffer of n copies of `value`.
  buffer(std::size_t n, const T& value, memory_resource& resource = default_resource<Device>())
    requires(Device::host_accessible)
      : buffer(n, resource) {
    for (std::size_t i = 0; i < n; ++i) data_[i] = value;
  }

  buffer(buffer&& o) noexcept
      : resource_(std::exchange(o.resource_, nullptr)), data_(std::exchange(o.data_, nullptr)),
        size_(std::exchange(o.size_, 0)) {}
  buffer& operator=(buffer&& o) noexcept {
    if (this != &o) {
      release();
      resource_ = std::exchange(o.resource_, nullptr);
      data_ = std::exchange(o.data_, nullptr);
      size_ = std::exchange(o.size_, 0);
    }
    return *this;
  }
  buffer(const buffer&) = delete;
  buffer& operator=(const buffer&) = delete;
  ~buffer() { release(); }

  T* data() noexcept { return data_; }
  const T* data() const noexcept { return data_; }
  std::size_t size() const noexcept { return size_; }
  std::size_t bytes() const noexcept { return size_ * sizeof(T); }
  bool empty() const noexcept { return size_ == 0; }
  memory_resource* resource() const noexcept { return resource_; }

  T& operator[](std::size_t i) noexcept
    requires(Device::host_accessible)
  {
    return data_[i];
  }
  const T& operator[](std::size_t i) const noexcept
    requires(Device::host_accessible)
  {
    return data_[i];
  }
  T* begin() noexcept requires(Device::host_accessible) { return data_; }
  T* end() noexcept requires(Device::host_accessible) { return data_ + size_; }
  const T* begin() const noexcept requires(Device::host_accessible) { return data_; }
  const T* end() const noexcept requires(Device::host_accessible) { return data_ + size_; }
  std::span<T> span() noexcept requires(Device::host_accessible) { return {data_, size_}; }
  std::span<const T> span() const noexcept requires(Device::host_accessible) { return {data_, size_}; }

  tensor_view<T, Device, 1> view() noexcept { return {data_, extents<1>{static_cast<index_t>(size_)}}; }
  tensor_view<const T, Device, 1> view() const noexcept { return {data_, extents<1>{static_cast<index_t>(size_)}}; }
  /// The buffer as a contiguous tensor of the given shape (element counts must agree).
  template <std::integral... E>
  tensor_view<T, Device, sizeof...(E)> view(E... shape) {
    return view().template reshape<sizeof...(E)>({static_cast<index_t>(shape)...});
  }

  /// Frees the memory now; the buffer becomes empty.
  void release() noexcept {
    if (resource_ && data_) resource_->deallocate(data_, size_ * sizeof(T), alignment());
    data_ = nullptr;
    size_ = 0;
  }

 private:
  static constexpr std::size_t alignment() noexcept {
    return alignof(T) > default_alignment ? alignof(T) : default_alignment;
  }
  memory_resource* resource_ = nullptr;
  T* data_ = nullptr;
  std::size_t size_ = 0;
};

}  // namespace loom
