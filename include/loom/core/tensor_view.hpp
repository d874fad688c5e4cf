#pragma once
// tensor_view<T, Device, Rank>: a non-owning strided view of memory.
//
// Why: kernels, layers and collectives take views, never owning containers, so the same
// code runs on a slice of a flat ZeRO buffer, a block of the KV pool or a whole activation.
// Shape and strides are in elements, int64 (negative extents are rejected, not wrapped).
// Element access from the host is only allowed for host-accessible devices (a compile-time
// check); `at()` is bounds-checked and throws loom::error naming the index and the extent.

#include <loom/core/config.hpp>
#include <loom/core/device.hpp>
#include <loom/core/error.hpp>

#include <array>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <ostream>
#include <type_traits>

namespace loom {

using index_t = std::int64_t;

template <std::size_t Rank>
using extents = std::array<index_t, Rank>;

template <std::size_t Rank>
constexpr extents<Rank> row_major_strides(const extents<Rank>& shape) noexcept {
  extents<Rank> s{};
  index_t step = 1;
  for (std::size_t i = Rank; i-- > 0;) {
    s[i] = step;
    step *= shape[i];
  }
  return s;
}

template <class T, device_tag Device = host, std::size_t Rank = 1>
class tensor_view {
 public:
  using element_type = T;
  using value_type = std::remove_cv_t<T>;
  using device_type = Device;
  static constexpr std::size_t rank = Rank;

  tensor_view() = default;

  /// Contiguous row-major view of `shape`.
  tensor_view(T* data, const extents<Rank>& shape) : tensor_view(data, shape, row_major_strides(shape)) {}

  tensor_view(T* data, const extents<Rank>& shape, const extents<Rank>& strides)
      : data_(data), shape_(shape), strides_(strides) {
    for (std::size_t d = 0; d < Rank; ++d)
      LOOM_CHECK(shape[d] >= 0, "tensor_view: extent of dimension ", d, " must be >= 0, got extent=", shape[d]);
    LOOM_CHECK(data != nullptr || numel() == 0, "tensor_view: null data for a view of ", numel(), " elements");
  }

  /// A view of a mutable tensor converts to a view of const elements.
  template <class U>
    requires(std::is_same_v<const U, T> && !std::is_same_v<U, T>)
  tensor_view(const tensor_view<U, Device, Rank>& other)  // NOLINT: implicit by design
      : data_(other.data()), shape_(other.shape()), strides_(other.strides()) {}

  T* data() const noexcept { return data_; }
  const extents<Rank>& shape() const noexcept { return shape_; }
  const extents<Rank>& strides() const noexcept { return strides_; }
  index_t extent(std::size_t d) const { return shape_[check_dim(d)]; }
  index_t stride(std::size_t d) const { return strides_[check_dim(d)]; }
  index_t numel() const noexcept {
    index_t n = 1;
    for (auto e : shape_) n *= e;
    return n;
  }
  bool empty() const noexcept { return numel() == 0; }
  std::size_t bytes() const noexcept { return static_cast<std::size_t>(numel()) * sizeof(T); }

  /// True when elements are laid out densely in row-major order.
  bool is_contiguous() const noexcept {
    index_t expect = 1;
    for (std::size_t i = Rank; i-- > 0;) {
      if (shape_[i] != 1 && strides_[i] != expect) return false;
      expect *= shape_[i];
    }
    return true;
  }

  /// Unchecked element access (host-accessible devices only).
  template <std::integral... I>
    requires(sizeof...(I) == Rank)
  T& operator()(I... idx) const noexcept {
    static_assert(Device::host_accessible, "tensor_view: elements of a device view cannot be accessed from the host");
    return data_[offset_of({static_cast<index_t>(idx)...})];
  }

  /// Bounds-checked element access: throws loom::error naming the dimension, index and extent.
  template <std::integral... I>
    requires(sizeof...(I) == Rank)
  T& at(I... idx) const {
    static_assert(Device::host_accessible, "tensor_view: elements of a device view cannot be accessed from the host");
    const extents<Rank> i{static_cast<index_t>(idx)...};
    for (std::size_t d = 0; d < Rank; ++d)
      LOOM_CHECK(i[d] >= 0 && i[d] < shape_[d], "tensor_view::at: index ", i[d], " out of range for dimension ", d,
                 " of extent ", shape_[d]);
    return data_[offset_of(i)];
  }

  /// Elements [begin, end) along dimension d; same rank.
  tensor_view slice(std::size_t d, index_t begin, index_t end) const {
    check_dim(d);
    LOOM_CHECK(0 <= begin && begin <= end && end <= shape_[d], "tensor_view::slice: range [", begin, ", ", end,
               ") out of bounds for dimension ", d, " of extent ", shape_[d]);
    tensor_view v = *this;
    v.data_ = data_ + begin * strides_[d];
    v.shape_[d] = end - begin;
    return v;
  }

  /// Fixes dimension d at index i; one rank less.
  tensor_view<T, Device, Rank - 1> select(std::size_t d, index_t i) const
    requires(Rank >= 1)
  {
    check_dim(d);
    LOOM_CHECK(0 <= i && i < shape_[d], "tensor_view::select: index ", i, " out of range for dimension ", d,
               " of extent ", shape_[d]);
    extents<Rank - 1> sh{}, st{};
    for (std::size_t k = 0, j = 0; k < Rank; ++k)
      if (k != d) sh[j] = shape_[k], st[j++] = strides_[k];
    return {data_ + i * strides_[d], sh, st};
  }
  tensor_view<T, Device, Rank - 1> operator[](index_t i) const
    requires(Rank >= 1)
  {
    return select(0, i);
  }

  /// Swaps two dimensions (no copy).
  tensor_view transpose(std::size_t a, std::size_t b) const {
    check_dim(a), check_dim(b);
    tensor_view v = *this;
    std::swap(v.shape_[a], v.shape_[b]);
    std::swap(v.strides_[a], v.strides_[b]);
    return v;
  }

  /// Same elements with a new shape; the view must be contiguous and the element count equal.
  template <std::size_t NewRank>
  tensor_view<T, Device, NewRank> reshape(const extents<NewRank>& shape) const {
    LOOM_CHECK(is_contiguous(), "tensor_view::reshape: view is not contiguous");
    index_t n = 1;
    for (auto e : shape) {
      LOOM_CHECK(e >= 0, "tensor_view::reshape: negative extent=", e);
      n *= e;
    }
    LOOM_CHECK(n == numel(), "tensor_view::reshape: new shape has ", n, " elements, view has ", numel());
    return {data_, shape};
  }
  tensor_view<T, Device, 1> flatten() const { return reshape<1>({numel()}); }

 private:
  std::size_t check_dim(std::size_t d) const {
    LOOM_CHECK(d < Rank, "tensor_view: dimension ", d, " out of range for a rank-", Rank, " view");
    return d;
  }
  index_t offset_of(const extents<Rank>& i) const noexcept {
    index_t o = 0;
    for (std::size_t d = 0; d < Rank; ++d) o += i[d] * strides_[d];
    return o;
  }

  T* data_ = nullptr;
  extents<Rank> shape_{};
  extents<Rank> strides_{};
};

/// Contiguous view of `shape` over `data`: make_view(p, 2, 3) is a [2, 3] view.
template <device_tag Device = host, class T, std::integral... E>
tensor_view<T, Device, sizeof...(E)> make_view(T* data, E... shape) {
  return {data, extents<sizeof...(E)>{static_cast<index_t>(shape)...}};
}

/// Views `bytes` bytes at `data` as elements of T. Throws if the size is not a multiple of
/// sizeof(T) or the address is not aligned for T.
template <class T, device_tag Device = host, class Byte>
  requires(sizeof(Byte) == 1)
tensor_view<T, Device, 1> view_bytes_as(Byte* data, std::size_t bytes) {
  LOOM_CHECK(bytes % sizeof(T) == 0, "view_bytes_as: size in bytes=", bytes, " is not a multiple of the element size ",
             sizeof(T));
  LOOM_CHECK(reinterpret_cast<std::uintptr_t>(data) % alignof(T) == 0, "view_bytes_as: address ",
             static_cast<const void*>(data), " is not aligned to ", alignof(T), " bytes");
  return {reinterpret_cast<T*>(data), extents<1>{static_cast<index_t>(bytes / sizeof(T))}};
}

template <std::size_t Rank>
std::ostream& operator<<(std::ostream& os, const extents<Rank>& e) {
  os << '[';
  for (std::size_t i = 0; i < Rank; ++i) os << (i ? ", " : "") << e[i];
  return os << ']';
}

}  // namespace loom
