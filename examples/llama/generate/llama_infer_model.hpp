#pragma once
// LLaMA for inference: configuration and fp32 weights as the checkpoint loaders fill them. The
// forward is llama_engine's, on the training model's host kernels (ops/host) and GEMMs with
// the weights packed once (ops::packed_weight); this file keeps no kernel of its own.
// (Still to come: one config and one weight layout with the training model, so that the
// engine runs the decoder's layers themselves; docs/decoder.md.)
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

}  // namespace llama
