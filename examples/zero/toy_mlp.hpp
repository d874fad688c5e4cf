#pragma once
// A toy layered model, the smallest zero::layered_model: L tanh layers y = tanh(W x + b) (the
// last one linear), width D, loss 0.5 * mean over samples of |y - target|^2. Forward and
// backward are written out by hand; the ZeRO tests check its gradient against finite
// differences and train it on every stage; loom-bench-zero times it. Data come from the counter-based RNG by global sample index, so any
// data-parallel split sees the same global batch.

#include <loom/core/random.hpp>
#include <loom/zero/flat_layout.hpp>

#include <cmath>
#include <cstddef>
#include <span>
#include <string>
#include <vector>

namespace examples {

namespace zero = loom::zero;
using loom::counter_rng;
using loom::index_t;

class toy_mlp {
 public:
  toy_mlp(std::size_t layers, std::size_t width) : L_(layers), D_(width), acts_(layers + 1) {}

  static std::vector<zero::param_spec> specs(std::size_t layers, std::size_t width) {
    std::vector<zero::param_spec> s;
    for (std::size_t l = 0; l < layers; ++l) {
      s.push_back({"layer" + std::to_string(l) + ".weight", {index_t(width), index_t(width)}, l});  // [out, in]
      s.push_back({"layer" + std::to_string(l) + ".bias", {index_t(width)}, l});
    }
    return s;
  }
  /// Initial value of element `first + k` of parameter p.
  static void init(std::size_t width, std::size_t p, std::size_t first, std::span<float> out) {
    const counter_rng rng(7, p);
    const float scale = p % 2 == 0 ? 1.2f / std::sqrt(float(width)) : 0.1f;
    for (std::size_t k = 0; k < out.size(); ++k) out[k] = scale * rng.normal(first + k);
  }

  /// Loads samples [first, first + count) of training step `step`.
  void set_batch(std::size_t step, std::size_t first, std::size_t count) {
    B_ = count;
    x_.assign(B_ * D_, 0.f);
    t_.assign(B_ * D_, 0.f);
    const counter_rng rng(11, step);
    for (std::size_t b = 0; b < B_; ++b)
      for (std::size_t j = 0; j < D_; ++j) x_[b * D_ + j] = rng.normal((first + b) * D_ + j);
    for (std::size_t b = 0; b < B_; ++b)
      for (std::size_t j = 0; j < D_; ++j)
        t_[b * D_ + j] = std::tanh(0.7f * x_[b * D_ + j] - 0.3f * x_[b * D_ + (j + 1) % D_]);
  }
  float loss() const { return loss_; }

  template <class T>
  void forward(std::size_t l, const zero::layer_params<const T>& p) {
    const std::vector<float>& in = l == 0 ? x_ : acts_[l];
    std::vector<float>& out = acts_[l + 1];
    out.assign(B_ * D_, 0.f);
    auto W = p.template view<2>(0);
    auto bias = p.span(1);
    for (std::size_t b = 0; b < B_; ++b)
      for (std::size_t o = 0; o < D_; ++o) {
        float z = static_cast<float>(bias[o]);
        for (std::size_t i = 0; i < D_; ++i) z += static_cast<float>(W(o, i)) * in[b * D_ + i];
        out[b * D_ + o] = l + 1 < L_ ? std::tanh(z) : z;
      }
    if (l + 1 == L_) {
      loss_ = 0.f;
      dy_.assign(B_ * D_, 0.f);
      for (std::size_t k = 0; k < B_ * D_; ++k) {
        const float d = out[k] - t_[k];
        loss_ += 0.5f * d * d / float(B_);
        dy_[k] = d / float(B_);
      }
    }
  }

  template <class T>
  void backward(std::size_t l, const zero::layer_params<const T>& p, const zero::layer_params<T>& g) {
    const std::vector<float>& in = l == 0 ? x_ : acts_[l];
    const std::vector<float>& out = acts_[l + 1];
    std::vector<float> dz(B_ * D_);
    for (std::size_t k = 0; k < B_ * D_; ++k) dz[k] = l + 1 < L_ ? dy_[k] * (1.f - out[k] * out[k]) : dy_[k];
    auto W = p.template view<2>(0);
    auto gW = g.template view<2>(0);
    auto gb = g.span(1);
    for (std::size_t o = 0; o < D_; ++o) {
      float sb = 0.f;
      for (std::size_t b = 0; b < B_; ++b) sb += dz[b * D_ + o];
      gb[o] = static_cast<T>(sb);
      for (std::size_t i = 0; i < D_; ++i) {
        float s = 0.f;
        for (std::size_t b = 0; b < B_; ++b) s += dz[b * D_ + o] * in[b * D_ + i];
        gW(o, i) = static_cast<T>(s);
      }
    }
    std::vector<float> dx(B_ * D_, 0.f);
    for (std::size_t b = 0; b < B_; ++b)
      for (std::size_t i = 0; i < D_; ++i) {
        float s = 0.f;
        for (std::size_t o = 0; o < D_; ++o) s += static_cast<float>(W(o, i)) * dz[b * D_ + o];
        dx[b * D_ + i] = s;
      }
    dy_ = std::move(dx);
  }

 private:
  std::size_t L_, D_, B_ = 0;
  std::vector<float> x_, t_, dy_;
  std::vector<std::vector<float>> acts_;  // acts_[l]: input of layer l (l >= 1), [B, D]
  float loss_ = 0.f;
};

}  // namespace examples
