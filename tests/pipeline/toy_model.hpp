#pragma once
// The executor tests' toy model and its oracle.
//
// p*v virtual stages, each y = W_k x applied to every row of a [rows, d] activation; the loss
// of a step is the sum of squares of the last stage's outputs over all micro-batches. The
// reference runs the whole model in one process, in double, with plain loops; the pipelined
// model (float) accumulates dW over the micro-batches of a step, as a real stage would.
#include <loom/pipeline/executor.hpp>

#include <cmath>
#include <span>
#include <vector>

namespace toy {

struct sizes {
  int p = 2, m = 4, v = 1;
  int rows = 2, d = 3;
  int virtual_stages() const { return p * v; }
  std::size_t activation() const { return static_cast<std::size_t>(rows * d); }
};

// W_k[i][j] and micro-batch mb's input x[r][j]: fixed, well-conditioned values.
inline double weight(int k, int i, int j) { return 0.35 * std::sin(7.0 * k + 3.0 * i + j + 1.0) + (i == j ? 0.6 : 0.0); }
inline double input(int mb, int r, int j) { return std::cos(1.3 * mb + 0.7 * r + 0.4 * j); }

struct reference {
  double loss = 0;
  std::vector<std::vector<double>> dW;  // [virtual stage] -> [d * d]
};

/// One process, double precision: forward and backward of every micro-batch, summed.
inline reference run_reference(const sizes& z) {
  const int V = z.virtual_stages(), d = z.d;
  reference out;
  out.dW.assign(static_cast<std::size_t>(V), std::vector<double>(static_cast<std::size_t>(d * d), 0.0));
  for (int mb = 0; mb < z.m; ++mb)
    for (int r = 0; r < z.rows; ++r) {
      std::vector<std::vector<double>> xs(static_cast<std::size_t>(V + 1), std::vector<double>(static_cast<std::size_t>(d)));
      for (int j = 0; j < d; ++j) xs[0][static_cast<std::size_t>(j)] = input(mb, r, j);
      for (int k = 0; k < V; ++k)
        for (int i = 0; i < d; ++i) {
          double y = 0;
          for (int j = 0; j < d; ++j) y += weight(k, i, j) * xs[static_cast<std::size_t>(k)][static_cast<std::size_t>(j)];
          xs[static_cast<std::size_t>(k + 1)][static_cast<std::size_t>(i)] = y;
        }
      std::vector<double> g(static_cast<std::size_t>(d));
      for (int i = 0; i < d; ++i) {
        const double y = xs[static_cast<std::size_t>(V)][static_cast<std::size_t>(i)];
        out.loss += y * y;
        g[static_cast<std::size_t>(i)] = 2 * y;
      }
      for (int k = V - 1; k >= 0; --k) {
        std::vector<double> gin(static_cast<std::size_t>(d), 0.0);
        for (int i = 0; i < d; ++i)
          for (int j = 0; j < d; ++j) {
            out.dW[static_cast<std::size_t>(k)][static_cast<std::size_t>(i * d + j)] +=
                g[static_cast<std::size_t>(i)] * xs[static_cast<std::size_t>(k)][static_cast<std::size_t>(j)];
            gin[static_cast<std::size_t>(j)] += weight(k, i, j) * g[static_cast<std::size_t>(i)];
          }
        g = gin;
      }
    }
  return out;
}

/// The chunks of one stage, in float, as the executor drives them.
struct stage {
  sizes z;
  int s = 0;
  double loss = 0;
  std::vector<std::vector<float>> W, dW;  // [local chunk] -> [d * d]
  int optimizer_steps = 0;

  stage(const sizes& zz, int stage_index) : z(zz), s(stage_index) {
    for (int c = 0; c < z.v; ++c) {
      std::vector<float> w(static_cast<std::size_t>(z.d * z.d));
      for (int i = 0; i < z.d; ++i)
        for (int j = 0; j < z.d; ++j) w[static_cast<std::size_t>(i * z.d + j)] = static_cast<float>(weight(k(c), i, j));
      W.push_back(w);
      dW.emplace_back(w.size(), 0.0f);
    }
  }
  int k(int chunk) const { return chunk * z.p + s; }

  // x: [rows, d] input of (mb, chunk): the received activation, or the data on virtual stage 0.
  std::vector<float> x_of(int mb, int chunk, std::span<const float> in) const {
    std::vector<float> x(z.activation());
    for (int r = 0; r < z.rows; ++r)
      for (int j = 0; j < z.d; ++j)
        x[static_cast<std::size_t>(r * z.d + j)] =
            k(chunk) == 0 ? static_cast<float>(input(mb, r, j)) : in[static_cast<std::size_t>(r * z.d + j)];
    return x;
  }
  std::vector<float> apply(int chunk, const std::vector<float>& x) const {
    std::vector<float> y(z.activation(), 0.0f);
    for (int r = 0; r < z.rows; ++r)
      for (int i = 0; i < z.d; ++i)
        for (int j = 0; j < z.d; ++j)
          y[static_cast<std::size_t>(r * z.d + i)] += W[static_cast<std::size_t>(chunk)][static_cast<std::size_t>(i * z.d + j)] *
                                                      x[static_cast<std::size_t>(r * z.d + j)];
    return y;
  }

  void forward(int mb, int chunk, std::span<const float> in, std::span<float> out) {
    const std::vector<float> y = apply(chunk, x_of(mb, chunk, in));
    if (k(chunk) + 1 == z.virtual_stages()) {
      for (float e : y) loss += double(e) * e;
    } else {
      std::copy(y.begin(), y.end(), out.begin());
    }
  }

  void backward(int mb, int chunk, std::span<const float> in, std::span<const float> grad_out, std::span<float> grad_in) {
    const std::vector<float> x = x_of(mb, chunk, in);
    std::vector<float> g(z.activation());
    if (k(chunk) + 1 == z.virtual_stages()) {
      const std::vector<float> y = apply(chunk, x);
      for (std::size_t e = 0; e < g.size(); ++e) g[e] = 2 * y[e];
    } else {
      std::copy(grad_out.begin(), grad_out.end(), g.begin());
    }
    auto& w = W[static_cast<std::size_t>(chunk)];
    auto& dw = dW[static_cast<std::size_t>(chunk)];
    if (!grad_in.empty()) std::fill(grad_in.begin(), grad_in.end(), 0.0f);
    for (int r = 0; r < z.rows; ++r)
      for (int i = 0; i < z.d; ++i)
        for (int j = 0; j < z.d; ++j) {
          const float gi = g[static_cast<std::size_t>(r * z.d + i)];
          dw[static_cast<std::size_t>(i * z.d + j)] += gi * x[static_cast<std::size_t>(r * z.d + j)];
          if (!grad_in.empty()) grad_in[static_cast<std::size_t>(r * z.d + j)] += w[static_cast<std::size_t>(i * z.d + j)] * gi;
        }
  }

  void optimizer_step() { ++optimizer_steps; }
};

static_assert(loom::pipeline::stage_model<stage, float>);

}  // namespace toy
