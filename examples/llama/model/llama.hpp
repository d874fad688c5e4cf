#pragma once
// A LLaMA (Meta's llama 2/3 architecture) built from loom parts, trained on the host.
//
// Why it is written this way: every layer has an explicit forward and backward (no tape), all
// parameters live in one flat buffer (what ZeRO partitions and the optimizer steps), and the
// model is a readable example a user copies and changes, not a library type.
//
// ---- Interface (what a trainer codes against) ----------------------------------------------
//
//   llama::config cfg{.dim = 288, .n_layers = 6, .n_heads = 6, .n_kv_heads = 6, .hidden_dim = 768,
//                     .vocab = 32000, .seq_len = 256};      // + norm_eps, rope_theta, tied_output
//   cfg.validate();                                        // loom::error naming a bad value
//   llama::model<P, T> m(cfg);       // P: parameter storage (float, loom::bfloat16, loom::half);
//                                    // T: compute and gradient type (float; double for tests)
//   m.init(seed);                    // element i of the flat buffer = f(seed, i) (counter RNG)
//   m.set_checkpointing(true);       // optional: recompute each block's activations in backward
//   T loss = m.forward(tokens, targets);   // tokens, targets: [batch, seq] int32 views;
//                                          // targets == -100 are ignored (mean over the rest)
//   m.logits();                      // [batch, seq, vocab] of the last forward
//   m.zero_grad();                   // grads are ADDED by backward (gradient accumulation)
//   m.backward();                    // d(loss)/d(params) into m.grads(); backward(s) scales by s
//   m.params(), m.grads()            // std::span over the flat buffers (same layout)
//   m.layout().entries()             // (name, offset, shape, numel) of every parameter
//   m.flops_per_token(seq)           // model FLOPs of one training token (forward + backward)
//
// Parameter names follow Meta's checkpoints: tok_embeddings.weight, layers.{i}.attention_norm
// .weight, layers.{i}.attention.{wq,wk,wv,wo}.weight, layers.{i}.ffn_norm.weight,
// layers.{i}.feed_forward.{w1,w2,w3}.weight, norm.weight, output.weight (absent when tied:
// the output projection then reads tok_embeddings.weight). Rotary embeddings use Meta's
// interleaved-pair convention unless config.rope says half_split (Hugging Face checkpoints).
// A bad token id (>= vocab or < 0) or target is a loom::error naming the value.
//
// Block:  h = x + attention(rmsnorm(x)),  out = h + swiglu_mlp(rmsnorm(h)).
// Init: weights ~ N(0, 0.02), the two residual projections (wo, w2) N(0, 0.02 / sqrt(2 L)),
// norm weights 1.

#include <loom/core/buffer.hpp>
#include <loom/core/random.hpp>
#include <loom/nn/attention.hpp>
#include <loom/nn/checkpoint.hpp>
#include <loom/nn/cross_entropy.hpp>
#include <loom/nn/embedding.hpp>
#include <loom/nn/linear.hpp>
#include <loom/nn/mlp.hpp>
#include <loom/nn/norm.hpp>
#include <loom/nn/parameters.hpp>
#include <loom/nn/workspace.hpp>

#include <cmath>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

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

template <class P = float, loom::ops::compute_type T = float>
class model {
  template <class E>
  using view2 = loom::tensor_view<E, loom::host, 2>;
  template <class E>
  using view3 = loom::tensor_view<E, loom::host, 3>;

  struct block {
    loom::nn::rmsnorm<T> attention_norm;
    loom::nn::attention<T> attention;
    loom::nn::rmsnorm<T> ffn_norm;
    loom::nn::swiglu_mlp<T> feed_forward;
  };
  struct block_acts {
    loom::buffer<T> xn1, rstd1;  // [n, dim], [n]: attention_norm(x)
    typename loom::nn::attention<T>::activations attn;
    loom::buffer<T> h;           // [n, dim]: x + attention
    loom::buffer<T> xn2, rstd2;  // ffn_norm(h)
    typename loom::nn::swiglu_mlp<T>::activations mlp;
  };

 public:
  using param_type = P;
  using compute_type = T;

  explicit model(const config& c, loom::memory_resource& mr = loom::default_resource<loom::host>())
      : cfg_((c.validate(), c)), mr_(&mr), store_(declare(c), mr), ws_(0, mr) {}

  model(const model&) = delete;
  model& operator=(const model&) = delete;

  const config& cfg() const noexcept { return cfg_; }
  const loom::nn::param_layout& layout() const noexcept { return store_.layout(); }
  std::span<P> params() noexcept { return store_.params(); }
  std::span<const P> params() const noexcept { return store_.params(); }
  std::span<T> grads() noexcept { return store_.grads(); }
  std::span<const T> grads() const noexcept { return store_.grads(); }
  loom::nn::param_store<P, T>& store() noexcept { return store_; }
  void zero_grad() { store_.zero_grad(); }
  std::size_t parameter_count() const noexcept { return layout().parameter_count(); }
  double flops_per_token(index_t seq) const noexcept { return cfg_.flops_per_token(seq); }

  /// Fills the flat parameter buffer from the counter RNG: element i depends on (seed, i) only.
  void init(std::uint64_t seed, float std = 0.02f) {
    const loom::counter_rng rng(seed);
    auto p = params();
    std::fill(p.begin(), p.end(), P(0.f));
    const float resid_std = std / std::sqrt(2.f * float(cfg_.n_layers));
    for (const auto& e : layout().entries()) {
      auto dst = p.subspan(e.offset, e.numel);
      if (ends_with(e.name, "norm.weight")) {
        std::fill(dst.begin(), dst.end(), P(1.f));
      } else {
        const bool resid = ends_with(e.name, "attention.wo.weight") || ends_with(e.name, "feed_forward.w2.weight");
        rng.fill_normal(dst, e.offset, 0.f, resid ? resid_std : std);
      }
    }
  }

  /// Recompute each block's activations during backward instead of keeping them.
  void set_checkpointing(bool on) {
    if (on != checkpoint_) acts_ = {}, batch_ = seq_ = 0;
    checkpoint_ = on;
  }
  bool checkpointing() const noexcept { return checkpoint_; }

  /// Logits of `tokens` [batch, seq]; no loss (backward is not available after this).
  void forward(loom::tensor_view<const std::int32_t, loom::host, 2> tokens) { run_forward(tokens); }

  /// Mean cross-entropy of predicting `targets` [batch, seq] (entries -100 are ignored); its
  /// gradient with respect to the logits is made in the same pass over them, for backward.
  T forward(loom::tensor_view<const std::int32_t, loom::host, 2> tokens,
            loom::tensor_view<const std::int32_t, loom::host, 2> targets) {
    LOOM_CHECK(targets.shape() == tokens.shape(), "llama::model::forward: targets are [", targets.extent(0), ", ",
               targets.extent(1), "], tokens are [", tokens.extent(0), ", ", tokens.extent(1), "]");
    run_forward(tokens);
    std::copy_n(targets.data(), n_, targets_.data());
    has_targets_ = true;
    return loss_.forward_backward(logits2(), targets_view(), loom::make_view(dlogits_.data(), n_, cfg_.vocab));
  }

  /// [batch, seq, vocab] logits of the last forward.
  view3<const T> logits() const { return {logits_.data(), loom::extents<3>{batch_, seq_, cfg_.vocab}}; }

  /// Adds d(dloss * loss)/d(params) of the last forward into grads().
  void backward(T dloss = T(1)) {
    LOOM_CHECK(has_targets_, "llama::model::backward: call forward(tokens, targets) first");
    const index_t n = n_, d = cfg_.dim;
    std::span<P> p = params();
    std::span<T> g = grads();
    ws_.reset();
    auto dxf = ws_.take(n * d);  // dlogits (made by forward) hold d(loss)/d(logits): dloss is the GEMMs' alpha
    output_.backward(p, g, xf_.view(n, d), loom::make_view(std::as_const(dlogits_).data(), n, cfg_.vocab),
                     loom::make_view(dxf.data(), n, d), ws_, /*accumulate=*/false, dloss);
    loom::ops::fill(loom::host{}, dresid_.view(), T(0));
    norm_.backward(p, g, loom::make_view(dxf.data(), n, d), resid(cfg_.n_layers), rstdf_.view(), dresid_.view(n, d));
    for (index_t l = cfg_.n_layers; l-- > 0;) {
      block_acts& a = acts_.for_backward(l, [&](block_acts& s) { run_block(l, s); });
      ws_.reset();
      block_backward(l, a);
    }
    tok_embeddings_.backward(g, tokens_view(), dresid_.view(n, d));
  }

 private:
  static bool ends_with(const std::string& s, std::string_view suffix) {
    return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
  }

  loom::nn::param_layout declare(const config& c) {
    loom::nn::param_layout L;
    const T eps = T(c.norm_eps);
    tok_embeddings_ = loom::nn::embedding<T>(L, "tok_embeddings", c.vocab, c.dim);
    const loom::nn::attention_config ac{c.dim, c.n_heads, c.n_kv_heads, c.seq_len, c.rope_theta, c.rope, {}, false};
    for (index_t l = 0; l < c.n_layers; ++l) {
      const std::string pre = "layers." + std::to_string(l) + ".";
      blocks_.push_back({loom::nn::rmsnorm<T>(L, pre + "attention_norm", c.dim, eps),
                         loom::nn::attention<T>(L, pre + "attention", ac),
                         loom::nn::rmsnorm<T>(L, pre + "ffn_norm", c.dim, eps),
                         loom::nn::swiglu_mlp<T>(L, pre + "feed_forward", c.dim, c.hidden_dim)});
    }
    norm_ = loom::nn::rmsnorm<T>(L, "norm", c.dim, eps);
    output_ = c.tied_output ? loom::nn::linear<T>(tok_embeddings_.weight())
                            : loom::nn::linear<T>(L, "output", c.dim, c.vocab);
    return L;
  }

  /// (Re)allocates activations when the batch shape changes; nothing is allocated otherwise.
  void plan(index_t b, index_t s) {
    if (b == batch_ && s == seq_ && acts_.blocks() == cfg_.n_layers) return;
    const index_t n = b * s, d = cfg_.dim;
    auto& mr = *mr_;
    resid_ = loom::buffer<T>(static_cast<std::size_t>((cfg_.n_layers + 1) * n * d), mr);
    acts_ = loom::nn::block_activations<block_acts>(cfg_.n_layers, checkpoint_, [&] {
      return block_acts{loom::buffer<T>(n * d, mr), loom::buffer<T>(n, mr), blocks_[0].attention.make_activations(b, s, mr),
                        loom::buffer<T>(n * d, mr), loom::buffer<T>(n * d, mr), loom::buffer<T>(n, mr),
                        blocks_[0].feed_forward.make_activations(n, mr)};
    });
    xf_ = loom::buffer<T>(n * d, mr);
    rstdf_ = loom::buffer<T>(n, mr);
    logits_ = loom::buffer<T>(n * cfg_.vocab, mr);
    dlogits_ = loom::buffer<T>(n * cfg_.vocab, mr);
    dresid_ = loom::buffer<T>(n * d, mr);
    tokens_ = loom::buffer<std::int32_t>(n, mr);
    targets_ = loom::buffer<std::int32_t>(n, mr);
    batch_ = b, seq_ = s, n_ = n;
  }

  void run_forward(loom::tensor_view<const std::int32_t, loom::host, 2> tokens) {
    const index_t b = tokens.extent(0), s = tokens.extent(1);
    LOOM_CHECK(b > 0 && s > 0, "llama::model::forward: empty batch [", b, ", ", s, "]");
    LOOM_CHECK(s <= cfg_.seq_len, "llama::model::forward: sequence length ", s, " exceeds config seq_len=", cfg_.seq_len);
    LOOM_CHECK(tokens.is_contiguous(), "llama::model::forward: tokens must be contiguous");
    plan(b, s);
    has_targets_ = false;
    std::copy_n(tokens.data(), n_, tokens_.data());
    const index_t n = n_, d = cfg_.dim;
    std::span<P> p = params();
    tok_embeddings_.forward(p, tokens_view(), resid(0));
    for (index_t l = 0; l < cfg_.n_layers; ++l) run_block(l, acts_.for_forward(l));
    norm_.forward(p, resid(cfg_.n_layers), xf_.view(n, d), rstdf_.view());
    ws_.reset();
    output_.forward(p, xf_.view(n, d), loom::make_view(logits_.data(), n, cfg_.vocab), ws_);
  }

  /// Block l: resid(l) -> resid(l + 1), filling its activations a.
  void run_block(index_t l, block_acts& a) {
    const index_t n = n_, d = cfg_.dim;
    const block& blk = blocks_[l];
    std::span<P> p = params();
    ws_.reset();
    auto x = resid(l), out = resid(l + 1);
    blk.attention_norm.forward(p, x, a.xn1.view(n, d), a.rstd1.view());
    blk.attention.forward(p, a.xn1.view(batch_, seq_, d), a.attn, a.h.view(batch_, seq_, d), ws_);
    add(a.h.data(), x.data(), n * d);
    blk.ffn_norm.forward(p, a.h.view(n, d), a.xn2.view(n, d), a.rstd2.view());
    blk.feed_forward.forward(p, a.xn2.view(n, d), a.mlp, out, ws_);
    add(out.data(), a.h.data(), n * d);
  }

  /// dresid_ holds dL/d(resid(l + 1)) on entry and dL/d(resid(l)) on return, updated in place
  /// (each term is added once the branch that reads the old value is done); parameter grads added.
  void block_backward(index_t l, block_acts& a) {
    const index_t n = n_, d = cfg_.dim;
    const block& blk = blocks_[l];
    std::span<P> p = params();
    std::span<T> g = grads();
    auto dr = dresid_.view(n, d);
    // out = h + mlp(ffn_norm(h)):  dh = dout + ffn_norm'(mlp'(dout))
    auto dxn2 = ws_.take(n * d);  // written by the branch's backward, not added into
    blk.feed_forward.backward(p, g, a.xn2.view(n, d), a.mlp, dr, loom::make_view(dxn2.data(), n, d), ws_, false);
    blk.ffn_norm.backward(p, g, loom::make_view(dxn2.data(), n, d), a.h.view(n, d), a.rstd2.view(), dr);
    // h = x + attention(attention_norm(x)):  dx = dh + attention_norm'(attention'(dh))
    auto dxn1 = ws_.take(n * d);
    blk.attention.backward(p, g, a.xn1.view(batch_, seq_, d), a.attn, dresid_.view(batch_, seq_, d),
                           loom::make_view(dxn1.data(), batch_, seq_, d), ws_, false);
    blk.attention_norm.backward(p, g, loom::make_view(dxn1.data(), n, d), resid(l), a.rstd1.view(), dr);
  }

  static void add(T* LOOM_RESTRICT y, const T* LOOM_RESTRICT x, index_t n) {
    loom::ops::detail::parallel_rows(n, loom::ops::detail::min_part_elements, [&](index_t i0, index_t i1) {
      LOOM_SIMD
      for (index_t i = i0; i < i1; ++i) y[i] += x[i];
    });
  }
  view2<T> resid(index_t l) { return loom::make_view(resid_.data() + l * n_ * cfg_.dim, n_, cfg_.dim); }
  view2<const T> logits2() const { return loom::make_view(logits_.data(), n_, cfg_.vocab); }
  loom::tensor_view<const std::int32_t, loom::host, 1> tokens_view() const { return loom::make_view(tokens_.data(), n_); }
  loom::tensor_view<const std::int32_t, loom::host, 1> targets_view() const { return loom::make_view(targets_.data(), n_); }

  config cfg_;
  loom::memory_resource* mr_;
  loom::nn::embedding<T> tok_embeddings_;
  std::vector<block> blocks_;
  loom::nn::rmsnorm<T> norm_;
  loom::nn::linear<T> output_;
  loom::nn::param_store<P, T> store_;
  loom::nn::workspace<T> ws_;
  loom::nn::cross_entropy<T> loss_;
  bool checkpoint_ = false, has_targets_ = false;
  index_t batch_ = 0, seq_ = 0, n_ = 0;
  loom::nn::block_activations<block_acts> acts_;
  loom::buffer<T> resid_;  // [n_layers + 1, n, dim]: the input of every block, and the last output
  loom::buffer<T> xf_, rstdf_, logits_, dlogits_;
  loom::buffer<T> dresid_;  // backward: the gradient of the residual stream, from the top block down
  loom::buffer<std::int32_t> tokens_, targets_;
};

}  // namespace llama
