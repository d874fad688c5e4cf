#pragma once
// Parameter storage: every parameter (and its gradient) of a model lives in ONE flat buffer;
// layers hold named slots (offset + shape) into it.
//
// Why flat: ZeRO partitions, all-reduces, clips, casts and checkpoints whole buffers, and the
// optimizer runs over one span. A `param_layout` is built once while the model declares its
// layers (name, shape, in declaration order, each tensor starting on an `align`-element
// boundary so kernels see aligned rows); its `entries()` — (name, offset, shape, numel) — is
// what ZeRO and checkpoint writers read. A layout may be cut into *units* (begin_unit): the
// pieces ZeRO-3 gathers one at a time (an embedding, a decoder block, the head). A slot's
// offset is relative to the start of its unit, so a layer reads its parameters from the
// unit's span wherever that span lives: a piece of the whole flat buffer, or a gathered copy
// in a ZeRO-3 arena. Entries keep offsets in the whole buffer. A layout that never begins a
// unit is one unit starting at 0 (slot offsets are then offsets in the whole buffer).
// A `param_store<P, G>` owns the parameter buffer
// (stored as P: float, bfloat16, half) and the gradient buffer (G, the compute type) of one
// layout. Padding elements between tensors are zero and get zero gradients.

#include <loom/core/buffer.hpp>
#include <loom/core/dtype.hpp>
#include <loom/core/error.hpp>
#include <loom/core/memory.hpp>
#include <loom/core/tensor_view.hpp>
#include <loom/ops/host/common.hpp>
#include <loom/ops/host/fill.hpp>

#include <algorithm>
#include <cstddef>
#include <numeric>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

namespace loom::nn {

using ops::compute_type;
using ops::in_view;

/// The flat buffer as a span of const elements.
template <ops::param_type P>
inline std::span<const std::remove_const_t<P>> as_const(std::span<P> s) noexcept {
  return {s.data(), s.size()};
}

/// One named tensor inside a flat buffer.
struct param_info {
  std::string name;
  std::size_t offset = 0;      ///< first element in the flat buffer
  std::vector<index_t> shape;  ///< row-major
  std::size_t numel = 0;
};

/// Where a parameter of rank R lives in the flat buffer; views it in any buffer of the layout.
template <std::size_t R>
struct param_slot {
  std::size_t offset = 0;
  extents<R> shape{};

  std::size_t numel() const noexcept {
    std::size_t n = 1;
    for (auto e : shape) n *= static_cast<std::size_t>(e);
    return n;
  }
  /// This parameter's elements in `flat` (a parameter, gradient or optimizer-state buffer), on
  /// device D (a span of device memory: its elements are only passed on, never read here).
  template <class D = host, class E>
  tensor_view<E, D, R> in(std::span<E> flat) const {
    LOOM_CHECK(offset + numel() <= flat.size(), "param_slot: flat buffer of ", flat.size(),
               " elements is too small for a parameter at offset ", offset, " with ", numel(), " elements");
    return {flat.data() + offset, shape};
  }
};

class param_layout {
 public:
  /// `align`: every tensor starts at a multiple of this many elements (1: packed).
  explicit param_layout(std::size_t align = 16) : align_(align) {
    LOOM_CHECK(align >= 1, "param_layout: align must be >= 1, got align=", align);
  }

  /// Appends a parameter to the current unit; names must be unique. The slot's offset is
  /// relative to the unit's start.
  template <std::size_t R>
  param_slot<R> add(std::string name, const extents<R>& shape) {
    LOOM_CHECK(!contains(name), "param_layout: duplicate parameter name '", name, "'");
    for (auto e : shape) LOOM_CHECK(e > 0, "param_layout: parameter '", name, "' has an extent ", e, " (must be > 0)");
    const std::size_t at = round_up(size_);
    param_slot<R> slot{at - unit_begin_.back(), shape};
    entries_.push_back({std::move(name), at, std::vector<index_t>(shape.begin(), shape.end()), slot.numel()});
    size_ = at + slot.numel();
    return slot;
  }

  /// Starts a new unit at the next multiple of lcm(align, multiple) elements (so units whose
  /// sizes are multiples of a data-parallel size split evenly over it). Returns its index.
  /// A unit holds at least one parameter before the next begins.
  std::size_t begin_unit(std::size_t multiple = 1) {
    LOOM_CHECK(multiple >= 1, "param_layout::begin_unit: multiple must be >= 1, got multiple=", multiple);
    if (entries_.empty()) {  // the first unit starts at 0
      unit_multiple_ = std::lcm(unit_multiple_, lcm(multiple));
      return 0;
    }
    LOOM_CHECK(entries_.back().offset + entries_.back().numel > unit_begin_.back(),
               "param_layout::begin_unit: unit ", unit_begin_.size() - 1, " has no parameter");
    unit_multiple_ = std::lcm(unit_multiple_, lcm(multiple));
    size_ = (size_ + unit_multiple_ - 1) / unit_multiple_ * unit_multiple_;
    unit_begin_.push_back(size_);
    return unit_begin_.size() - 1;
  }
  std::size_t units() const noexcept { return unit_begin_.size(); }
  /// Unit u is [unit_begin(u), unit_end(u)) of the flat buffer; the last unit ends at size().
  std::size_t unit_begin(std::size_t u) const noexcept { return unit_begin_[u]; }
  std::size_t unit_end(std::size_t u) const noexcept { return u + 1 < unit_begin_.size() ? unit_begin_[u + 1] : size(); }
  /// Unit u's elements in a flat buffer of this layout.
  template <class E>
  std::span<E> unit(std::span<E> flat, std::size_t u) const {
    LOOM_CHECK(u < units() && unit_end(u) <= flat.size(), "param_layout::unit: unit ", u, " of ", units(),
               " does not fit a flat buffer of ", flat.size(), " elements");
    return flat.subspan(unit_begin(u), unit_end(u) - unit_begin(u));
  }

  const std::vector<param_info>& entries() const noexcept { return entries_; }
  /// Elements in the flat buffer, padding included (rounded up to `align`, and to the unit
  /// multiple once units were begun).
  std::size_t size() const noexcept {
    const std::size_t m = unit_multiple_;
    return (round_up(size_) + m - 1) / m * m;
  }
  /// Elements that belong to parameters (padding excluded).
  std::size_t parameter_count() const noexcept {
    std::size_t n = 0;
    for (const auto& e : entries_) n += e.numel;
    return n;
  }
  std::size_t align() const noexcept { return align_; }
  bool contains(std::string_view name) const noexcept {
    return std::any_of(entries_.begin(), entries_.end(), [&](const param_info& e) { return e.name == name; });
  }
  const param_info& find(std::string_view name) const {
    for (const auto& e : entries_)
      if (e.name == name) return e;
    LOOM_THROW("param_layout: no parameter named '", name, "'");
  }

 private:
  std::size_t round_up(std::size_t n) const noexcept { return (n + align_ - 1) / align_ * align_; }
  std::size_t lcm(std::size_t m) const noexcept { return std::lcm(align_, m); }
  std::size_t align_;
  std::size_t size_ = 0;
  std::size_t unit_multiple_ = 1;
  std::vector<std::size_t> unit_begin_{0};
  std::vector<param_info> entries_;
};

/// The parameters (type P) and gradients (type G) of one layout, each in one flat buffer.
template <floating_element P, floating_element G = float>
class param_store {
 public:
  using param_type = P;
  using grad_type = G;

  explicit param_store(param_layout layout, memory_resource& resource = default_resource<host>())
      : layout_(std::move(layout)), params_(layout_.size(), resource), grads_(layout_.size(), resource) {}

  const param_layout& layout() const noexcept { return layout_; }
  std::span<P> params() noexcept { return params_.span(); }
  std::span<const P> params() const noexcept { return params_.span(); }
  std::span<G> grads() noexcept { return grads_.span(); }
  std::span<const G> grads() const noexcept { return grads_.span(); }
  void zero_grad() { ops::fill(host{}, grads_.view(), G(0)); }

  /// Named access (slow: a search by name; layers keep slots instead).
  std::span<P> param(std::string_view name) {
    const auto& e = layout_.find(name);
    return params().subspan(e.offset, e.numel);
  }
  std::span<G> grad(std::string_view name) {
    const auto& e = layout_.find(name);
    return grads().subspan(e.offset, e.numel);
  }

 private:
  param_layout layout_;
  buffer<P> params_;
  buffer<G> grads_;
};

}  // namespace loom::nn
