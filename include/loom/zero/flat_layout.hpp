#pragma once
// flat_layout: a model's parameters as (name, shape, layer), laid out flat for ZeRO.
//
// Every model that the ZeRO engine trains describes its parameters this way, in the order
// its layers run forward. The layout pads each parameter to a multiple of the
// data-parallel size (sched::layer_layout: rank r owns slice r of every parameter), so the
// flat buffers (parameters, gradients, fp32 master, Adam moments) of any stage are one
// allocation per element type, and a parameter moves between ranks with one collective.
// layer_params is what a model's forward/backward receives: views of one layer's
// parameters (or gradients), wherever the stage keeps them.

#include <loom/core/device.hpp>
#include <loom/core/error.hpp>
#include <loom/core/tensor_view.hpp>
#include <loom/sched/layer_layout.hpp>

#include <cstddef>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace loom::zero {

struct param_spec {
  std::string name;
  std::vector<index_t> shape;  // e.g. [out, in] for a linear weight
  std::size_t layer = 0;       // forward order; 0, 0, 1, 1, 2, ... (no layer skipped)
  std::size_t numel() const noexcept {
    std::size_t n = 1;
    for (index_t e : shape) n *= static_cast<std::size_t>(e);
    return n;
  }
};

class flat_layout {
 public:
  flat_layout(std::vector<param_spec> specs, std::size_t world) : specs_(std::move(specs)) {
    std::vector<std::size_t> numel, layer;
    for (const param_spec& s : specs_) {
      for (index_t e : s.shape)
        LOOM_CHECK(e > 0, "flat_layout: parameter '", s.name, "' has a non-positive extent=", e);
      numel.push_back(s.numel());
      layer.push_back(s.layer);
    }
    sizes_ = sched::layer_layout(numel, layer, world);
  }

  const sched::layer_layout& sizes() const noexcept { return sizes_; }
  const param_spec& spec(std::size_t p) const noexcept { return specs_[p]; }
  std::span<const param_spec> specs() const noexcept { return specs_; }
  std::size_t params() const noexcept { return specs_.size(); }
  std::size_t layers() const noexcept { return sizes_.layers(); }
  std::size_t world() const noexcept { return sizes_.world(); }
  /// Index of the parameter called `name`; throws naming it when there is none.
  std::size_t find(std::string_view name) const {
    for (std::size_t p = 0; p < specs_.size(); ++p)
      if (specs_[p].name == name) return p;
    LOOM_THROW("flat_layout: no parameter named '", name, "'");
  }

 private:
  std::vector<param_spec> specs_;
  sched::layer_layout sizes_;
};

/// The parameters (or gradients) of one layer, as a model's forward/backward sees them.
/// T is `const X` for parameters, `X` for gradients.
template <class T>
class layer_params {
 public:
  /// ptrs[p]: where parameter p of the model is (only this layer's entries are read).
  layer_params(const flat_layout& layout, std::size_t layer, T* const* ptrs)
      : layout_(&layout), layer_(layer), ptrs_(ptrs) {}

  std::size_t layer() const noexcept { return layer_; }
  std::size_t size() const noexcept { return layout_->sizes().layer_end(layer_) - layout_->sizes().layer_begin(layer_); }
  const param_spec& spec(std::size_t k) const { return layout_->spec(index(k)); }
  /// The model-wide parameter number of the layer's parameter k.
  std::size_t global_index(std::size_t k) const { return index(k); }
  /// Parameter k of the layer (k = 0 is its first), numel elements.
  std::span<T> span(std::size_t k) const {
    const std::size_t p = index(k);
    return {ptrs_[p], layout_->sizes().numel(p)};
  }
  /// Parameter k as a row-major tensor of its declared shape (Rank must match).
  template <std::size_t Rank>
  tensor_view<T, host, Rank> view(std::size_t k) const {
    const param_spec& s = spec(k);
    LOOM_CHECK(s.shape.size() == Rank, "layer_params::view: parameter '", s.name, "' has rank ", s.shape.size(),
               ", asked for Rank=", Rank);
    extents<Rank> e{};
    for (std::size_t d = 0; d < Rank; ++d) e[d] = s.shape[d];
    return tensor_view<T, host, Rank>(ptrs_[index(k)], e);
  }

 private:
  std::size_t index(std::size_t k) const {
    LOOM_CHECK(k < size(), "layer_params: parameter k=", k, " out of range, layer ", layer_, " has ", size());
    return layout_->sizes().layer_begin(layer_) + k;
  }
  const flat_layout* layout_;
  std::size_t layer_;
  T* const* ptrs_;  // [params] indexed by global parameter number
};

}  // namespace loom::zero
