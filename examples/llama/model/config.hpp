#pragma once
// The LLaMA decoder's configuration (Meta's llama 2/3 architecture), shared by every way the
// one model (model3d/llama3d.hpp) is run: one rank (llama.hpp), a (dp, tp, pp) mesh, the
// paged-KV engine, and the checkpoint readers that fill it.

#include <loom/core/error.hpp>
#include <loom/core/tensor_view.hpp>
#include <loom/ops/host/rope.hpp>

namespace llama {

using loom::index_t;

struct config {
  index_t dim = 288;
  index_t n_layers = 6;
  index_t n_heads = 6;
  index_t n_kv_heads = 6;
  index_t hidden_dim = 768;
  index_t vocab = 32000;
  index_t seq_len = 256;
  double norm_eps = 1e-5;
  double rope_theta = 10000.0;
  bool tied_output = false;
  loom::ops::rope_style rope = loom::ops::rope_style::interleaved;

  index_t head_dim() const noexcept { return n_heads > 0 ? dim / n_heads : 0; }

  /// Throws loom::error naming the first bad value.
  void validate() const {
    LOOM_CHECK(dim > 0, "llama::config: dim must be > 0, got dim=", dim);
    LOOM_CHECK(n_layers > 0, "llama::config: n_layers must be > 0, got n_layers=", n_layers);
    LOOM_CHECK(n_heads > 0, "llama::config: n_heads must be > 0, got n_heads=", n_heads);
    LOOM_CHECK(dim % n_heads == 0, "llama::config: dim (", dim, ") must be divisible by n_heads (", n_heads, ")");
    LOOM_CHECK(n_kv_heads > 0, "llama::config: n_kv_heads must be > 0, got n_kv_heads=", n_kv_heads);
    LOOM_CHECK(n_heads % n_kv_heads == 0, "llama::config: n_heads (", n_heads, ") must be divisible by n_kv_heads (",
               n_kv_heads, ")");
    LOOM_CHECK(head_dim() % 2 == 0, "llama::config: head_dim = dim / n_heads (", head_dim(),
               ") must be even for rotary embeddings");
    LOOM_CHECK(hidden_dim > 0, "llama::config: hidden_dim must be > 0, got hidden_dim=", hidden_dim);
    LOOM_CHECK(vocab > 0, "llama::config: vocab must be > 0, got vocab=", vocab);
    LOOM_CHECK(seq_len > 0, "llama::config: seq_len must be > 0, got seq_len=", seq_len);
    LOOM_CHECK(norm_eps > 0, "llama::config: norm_eps must be > 0, got norm_eps=", norm_eps);
    LOOM_CHECK(rope_theta > 0, "llama::config: rope_theta must be > 0, got rope_theta=", rope_theta);
  }

  /// Meta's FFN width: 2/3 of 4 dim, rounded up to a multiple of `multiple_of`.
  static index_t default_hidden_dim(index_t dim, index_t multiple_of = 32) {
    const index_t h = 2 * (4 * dim) / 3;
    return (h + multiple_of - 1) / multiple_of * multiple_of;
  }

  /// Parameters that take part in matrix products (all but norms; the output projection
  /// counts whether or not it is tied).
  double matmul_params() const noexcept {
    const double d = double(dim), hd = double(head_dim());
    const double per_layer = d * n_heads * hd * 2 + d * n_kv_heads * hd * 2 + 3.0 * d * double(hidden_dim);
    return double(n_layers) * per_layer + double(vocab) * d;
  }
  /// Model FLOPs of one token of a training step (forward + backward) at sequence length
  /// `seq`: 6 per matmul parameter, plus the attention products as executed (q k^T and
  /// p v over the full seq x seq tile: 12 * layers * seq * dim).
  double flops_per_token(index_t seq) const noexcept {
    return 6.0 * matmul_params() + 12.0 * double(n_layers) * double(seq) * double(n_heads * head_dim());
  }
};

}  // namespace llama
