#pragma once
// The decoder's configuration, shared by every way the one model (model3d/llama3d.hpp) is
// run: one rank (llama.hpp), a (dp, tp, pp) mesh, the paged-KV engine, and the checkpoint
// readers that fill it. The defaults are Meta's LLaMA 2/3; ChatGLM2/3 is the same decoder
// with q/k/v biases, rotary on half of each head, and q/k/v and gate/up each stored as one
// tensor (chatglm(): docs/decoder.md). ChatGLM-6B v1 is not a member of the family (2D
// positions, GeLU, post-norm), and the HF reader refuses it.

#include <loom/core/error.hpp>
#include <loom/core/tensor_view.hpp>
#include <loom/ops/host/rope.hpp>

#include <cmath>
#include <string>

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
  // Beyond LLaMA (HF config.json names where there is one):
  bool qkv_bias = false;               ///< add_qkv_bias: biases on the q/k/v projections
  double partial_rotary_factor = 1.0;  ///< the leading fraction of each head's channels that rotate
  bool fused_qkv = false;      ///< q/k/v as one tensor `attention.wqkv` with rows [Q | K | V] (query_key_value)
  bool fused_gate_up = false;  ///< gate/up as one tensor `feed_forward.w13` with rows [gate | up] (dense_h_to_4h)
  std::string model_type = "llama";  ///< the HF family whose names and config.json the HF writer uses: llama, chatglm

  index_t head_dim() const noexcept { return n_heads > 0 ? dim / n_heads : 0; }
  /// Channels of each head that rotate (head_dim * partial_rotary_factor).
  index_t rotary_dim() const noexcept { return static_cast<index_t>(std::llround(double(head_dim()) * partial_rotary_factor)); }

  /// ChatGLM2/3 as a configuration of the decoder (its config.json names in the comments);
  /// set the sizes after: dim (hidden_size), n_layers (num_layers), n_heads
  /// (num_attention_heads), n_kv_heads (multi_query_group_num), hidden_dim (ffn_hidden_size),
  /// vocab (padded_vocab_size), seq_len (seq_length), rope_theta (10000 * rope_ratio).
  static config chatglm() {
    config c;
    c.norm_eps = 1e-5;  // layernorm_epsilon
    c.rope = loom::ops::rope_style::interleaved;
    c.partial_rotary_factor = 0.5;
    c.qkv_bias = true;
    c.fused_qkv = c.fused_gate_up = true;
    c.tied_output = false;
    c.model_type = "chatglm";
    return c;
  }

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
    const double rot = double(head_dim()) * partial_rotary_factor;
    LOOM_CHECK(partial_rotary_factor > 0 && partial_rotary_factor <= 1 && std::abs(rot - double(rotary_dim())) < 1e-9 &&
                   rotary_dim() % 2 == 0,
               "llama::config: partial_rotary_factor (", partial_rotary_factor, ") times head_dim (", head_dim(),
               ") must be an even number of channels in (0, head_dim]");
    LOOM_CHECK(model_type == "llama" || model_type == "chatglm", "llama::config: model_type must be llama or chatglm, got '",
               model_type.substr(0, 32), "'");
    LOOM_CHECK(model_type != "chatglm" || (fused_qkv && fused_gate_up && rope == loom::ops::rope_style::interleaved),
               "llama::config: model_type chatglm stores q/k/v and gate/up fused (fused_qkv, fused_gate_up) and rotates "
               "interleaved pairs");
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
