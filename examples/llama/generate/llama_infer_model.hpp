#pragma once
// LLaMA for inference: configuration, fp32 weights, and the small host kernels of its forward
// (row-wise matmul, RMSNorm, rotary embedding, SwiGLU).
//
// Why its own kernels: the generator must not depend on the training model's layout, and
// paged generation is checked token for token against a contiguous-KV reference. Every kernel
// here computes each output row with a fixed summation order (8 independent partial sums
// combined in a fixed order), so a token's result does not depend on how many other tokens
// share the batch: batched, chunked and one-at-a-time runs agree bit for bit, and the
// comparison can demand equality rather than a tolerance. (When loom's ops/host kernels land,
// the engine can call them instead; they are a drop-in for these.)
//
// Weight layout (as PyTorch / HF / llama2.c store them): matrices are [out, in] row-major.

#include <loom/core/buffer.hpp>
#include <loom/core/error.hpp>
#include <loom/core/random.hpp>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

namespace llama {

struct llama_config {
  std::int32_t dim = 64;
  std::int32_t hidden_dim = 172;
  std::int32_t n_layers = 2;
  std::int32_t n_heads = 4;
  std::int32_t n_kv_heads = 4;
  std::int32_t vocab_size = 256;
  std::int32_t max_seq_len = 256;
  float norm_eps = 1e-5f;
  float rope_theta = 10000.f;
  /// Rotary pairs: true = adjacent (2i, 2i+1) as Meta's and llama2.c's checkpoints;
  /// false = halves (i, i + head_dim/2) as HF transformers' checkpoints.
  bool rope_interleaved = true;
  bool shared_classifier = true;  ///< output projection is the token embedding

  std::int32_t head_dim() const noexcept { return dim / n_heads; }
  std::int32_t kv_dim() const noexcept { return n_kv_heads * head_dim(); }
  void validate() const {
    LOOM_CHECK(dim > 0 && hidden_dim > 0 && n_layers > 0 && vocab_size > 0 && max_seq_len > 0,
               "llama_config: dim=", dim, " hidden_dim=", hidden_dim, " n_layers=", n_layers, " vocab_size=", vocab_size,
               " max_seq_len=", max_seq_len, " must all be > 0");
    LOOM_CHECK(n_heads > 0 && dim % n_heads == 0, "llama_config: dim (", dim, ") must be a multiple of n_heads (",
               n_heads, ")");
    LOOM_CHECK(n_kv_heads > 0 && n_heads % n_kv_heads == 0, "llama_config: n_heads (", n_heads,
               ") must be a multiple of n_kv_heads (", n_kv_heads, ")");
    LOOM_CHECK(head_dim() % 2 == 0, "llama_config: head_dim=", head_dim(), " must be even for rotary embeddings");
  }
};

struct layer_weights {
  loom::buffer<float> attn_norm;  // [dim]
  loom::buffer<float> wq;         // [n_heads * head_dim, dim]
  loom::buffer<float> wk;         // [n_kv_heads * head_dim, dim]
  loom::buffer<float> wv;         // [n_kv_heads * head_dim, dim]
  loom::buffer<float> wo;         // [dim, n_heads * head_dim]
  loom::buffer<float> ffn_norm;   // [dim]
  loom::buffer<float> w1;         // [hidden_dim, dim] gate
  loom::buffer<float> w2;         // [dim, hidden_dim] down
  loom::buffer<float> w3;         // [hidden_dim, dim] up
};

struct llama_weights {
  llama_config config;
  loom::buffer<float> tok_embeddings;  // [vocab, dim]
  std::vector<layer_weights> layers;
  loom::buffer<float> norm;    // [dim]
  loom::buffer<float> output;  // [vocab, dim]; empty when config.shared_classifier

  const float* classifier() const noexcept { return config.shared_classifier ? tok_embeddings.data() : output.data(); }

  /// Zero weights of the right sizes (loaders fill them).
  static llama_weights allocate(const llama_config& c) {
    c.validate();
    llama_weights w;
    w.config = c;
    auto n = [](std::int64_t a, std::int64_t b = 1) { return static_cast<std::size_t>(a * b); };
    w.tok_embeddings = loom::buffer<float>(n(c.vocab_size, c.dim));
    for (int l = 0; l < c.n_layers; ++l) {
      layer_weights L;
      L.attn_norm = loom::buffer<float>(n(c.dim));
      L.wq = loom::buffer<float>(n(c.n_heads * c.head_dim(), c.dim));
      L.wk = loom::buffer<float>(n(c.kv_dim(), c.dim));
      L.wv = loom::buffer<float>(n(c.kv_dim(), c.dim));
      L.wo = loom::buffer<float>(n(c.dim, c.n_heads * c.head_dim()));
      L.ffn_norm = loom::buffer<float>(n(c.dim));
      L.w1 = loom::buffer<float>(n(c.hidden_dim, c.dim));
      L.w2 = loom::buffer<float>(n(c.dim, c.hidden_dim));
      L.w3 = loom::buffer<float>(n(c.hidden_dim, c.dim));
      w.layers.push_back(std::move(L));
    }
    w.norm = loom::buffer<float>(n(c.dim));
    if (!c.shared_classifier) w.output = loom::buffer<float>(n(c.vocab_size, c.dim));
    return w;
  }

  /// Random weights (normal, scaled by 1/sqrt(fan-in); norms around 1) for tests and benchmarks.
  static llama_weights random(const llama_config& c, std::uint64_t seed) {
    llama_weights w = allocate(c);
    loom::counter_rng rng(seed);
    std::uint64_t off = 0;
    auto fill = [&](loom::buffer<float>& b, float std) {
      rng.fill_normal(b.span(), off, 0.f, std);
      off += b.size();
    };
    auto norm = [&](loom::buffer<float>& b) {
      rng.fill_uniform(b.span(), off, 0.8f, 1.2f);
      off += b.size();
    };
    const float sd = 1.f / std::sqrt(static_cast<float>(c.dim)), sh = 1.f / std::sqrt(static_cast<float>(c.hidden_dim));
    fill(w.tok_embeddings, 1.f);
    for (auto& L : w.layers) {
      norm(L.attn_norm), fill(L.wq, sd), fill(L.wk, sd), fill(L.wv, sd), fill(L.wo, sd);
      norm(L.ffn_norm), fill(L.w1, sd), fill(L.w2, sh), fill(L.w3, sd);
    }
    norm(w.norm);
    if (!c.shared_classifier) fill(w.output, sd);
    return w;
  }
};

namespace kernels {

/// dot(a, b) over n elements with 8 partial sums combined in a fixed order (vectorisable
/// without -ffast-math, and independent of the caller's batch).
inline float dot(const float* LOOM_RESTRICT a, const float* LOOM_RESTRICT b, std::int64_t n) noexcept {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  std::int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) acc[j] += a[i + j] * b[i + j];
  for (; i < n; ++i) acc[i & 7] += a[i] * b[i];
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

/// out[t, o] = sum_i x[t, i] * w[o, i]   x: [rows, in], w: [out_dim, in], out: [rows, out_dim]
inline void matmul(const float* x, const float* w, float* out, std::int64_t rows, std::int64_t in, std::int64_t out_dim) {
  constexpr std::int64_t tile = 64;  // rows of w kept hot in cache while all x rows pass
  for (std::int64_t o0 = 0; o0 < out_dim; o0 += tile) {
    const std::int64_t o1 = o0 + tile < out_dim ? o0 + tile : out_dim;
    for (std::int64_t t = 0; t < rows; ++t)
      for (std::int64_t o = o0; o < o1; ++o) out[t * out_dim + o] = dot(x + t * in, w + o * in, in);
  }
}

/// out[t] = x[t] / rms(x[t]) * g     x, out: [rows, n]
inline void rmsnorm(const float* x, const float* g, float* out, std::int64_t rows, std::int64_t n, float eps) {
  for (std::int64_t t = 0; t < rows; ++t) {
    const float ss = dot(x + t * n, x + t * n, n);
    const float r = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
    for (std::int64_t i = 0; i < n; ++i) out[t * n + i] = x[t * n + i] * r * g[i];
  }
}

/// Precomputed cos/sin of every position and frequency: [max_seq_len, head_dim / 2] each.
struct rope_table {
  std::vector<float> cos, sin;
  std::int32_t half = 0;
  rope_table() = default;
  rope_table(std::int32_t max_len, std::int32_t head_dim, float theta) : half(head_dim / 2) {
    cos.resize(static_cast<std::size_t>(max_len) * static_cast<std::size_t>(half));
    sin.resize(cos.size());
    for (std::int32_t p = 0; p < max_len; ++p)
      for (std::int32_t i = 0; i < half; ++i) {
        const double freq = std::pow(static_cast<double>(theta), -2.0 * i / head_dim);
        const double a = p * freq;
        cos[static_cast<std::size_t>(p * half + i)] = static_cast<float>(std::cos(a));
        sin[static_cast<std::size_t>(p * half + i)] = static_cast<float>(std::sin(a));
      }
  }
  /// Rotates every head of x [heads, head_dim] for position p.
  void apply(float* x, std::int32_t heads, std::int64_t p, bool interleaved) const {
    const float* c = cos.data() + p * half;
    const float* s = sin.data() + p * half;
    for (std::int32_t h = 0; h < heads; ++h) {
      float* v = x + static_cast<std::int64_t>(h) * 2 * half;
      for (std::int32_t i = 0; i < half; ++i) {
        float& a = interleaved ? v[2 * i] : v[i];
        float& b = interleaved ? v[2 * i + 1] : v[i + half];
        const float a0 = a, b0 = b;
        a = a0 * c[i] - b0 * s[i];
        b = a0 * s[i] + b0 * c[i];
      }
    }
  }
};

/// h1 = silu(h1) * h3 elementwise.
inline void swiglu(float* h1, const float* h3, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) h1[i] = h1[i] / (1.f + std::exp(-h1[i])) * h3[i];
}

}  // namespace kernels
}  // namespace llama
