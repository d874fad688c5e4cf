#pragma once
// Multi-head self-attention with grouped-query heads (GQA; MQA when n_kv_heads == 1),
// rotary positions and a causal (optionally prefix-LM) mask, as in LLaMA 2/3:
//
//   q = x Wq^T, k = x Wk^T, v = x Wv^T     // [batch, seq, heads|kv_heads, head_dim]
//   q, k = rope(q), rope(k)
//   a = softmax(q k^T / sqrt(head_dim) + mask) v
//   y = a Wo^T
//
// Parameters `<name>.wq/wk/wv/wo.weight` (Meta's names). The activations backward needs
// (rotated q, k, v, the attention probabilities, a) live in an `activations` object the
// caller owns: one per layer normally, one shared by all layers under activation
// checkpointing (the block's forward is re-run before its backward).

#include <loom/core/buffer.hpp>
#include <loom/nn/linear.hpp>
#include <loom/nn/rotary.hpp>
#include <loom/nn/workspace.hpp>
#include <loom/ops/host/attention.hpp>

#include <algorithm>
#include <string>

namespace loom::nn {

struct attention_config {
  index_t dim = 0, n_heads = 0, n_kv_heads = 0, max_seq = 0;
  double rope_theta = 10000.0;
  ops::rope_style rope = ops::rope_style::interleaved;
  ops::attention_mask mask{};
  bool bias = false;  ///< biases on q/k/v/o projections (GPT-style); LLaMA has none

  index_t head_dim() const noexcept { return n_heads ? dim / n_heads : 0; }
  void validate() const {
    LOOM_CHECK(dim > 0, "attention: dim must be > 0, got dim=", dim);
    LOOM_CHECK(n_heads > 0 && dim % n_heads == 0, "attention: dim (", dim, ") must be divisible by n_heads (", n_heads,
               ")");
    LOOM_CHECK(n_kv_heads > 0 && n_heads % n_kv_heads == 0, "attention: n_heads (", n_heads,
               ") must be divisible by n_kv_heads (", n_kv_heads, ")");
    LOOM_CHECK(head_dim() % 2 == 0, "attention: head_dim (", head_dim(), ") must be even for rotary embeddings");
    LOOM_CHECK(max_seq > 0, "attention: max_seq must be > 0, got max_seq=", max_seq);
  }
};

template <compute_type T>
class attention {
 public:
  /// Saved by forward for backward; sized for one (batch, seq).
  struct activations {
    index_t batch = 0, seq = 0;
    buffer<T> q, k, v;  // [batch, seq, heads | kv_heads, head_dim], after rope
    buffer<T> probs;    // [batch, heads, seq, seq]
    buffer<T> out;      // [batch, seq, heads * head_dim], input of wo
  };

  attention() = default;
  attention(param_layout& layout, const std::string& name, const attention_config& c)
      : cfg_((c.validate(), c)),
        wq_(layout, name + ".wq", c.dim, c.n_heads * c.head_dim(), c.bias),
        wk_(layout, name + ".wk", c.dim, c.n_kv_heads * c.head_dim(), c.bias),
        wv_(layout, name + ".wv", c.dim, c.n_kv_heads * c.head_dim(), c.bias),
        wo_(layout, name + ".wo", c.n_heads * c.head_dim(), c.dim, c.bias),
        rope_(c.max_seq, c.head_dim(), c.rope_theta, c.rope) {}

  const attention_config& config() const noexcept { return cfg_; }

  activations make_activations(index_t batch, index_t seq, memory_resource& mr = default_resource<host>()) const {
    const index_t n = batch * seq, hd = cfg_.head_dim();
    return {batch, seq, buffer<T>(n * cfg_.n_heads * hd, mr), buffer<T>(n * cfg_.n_kv_heads * hd, mr),
            buffer<T>(n * cfg_.n_kv_heads * hd, mr), buffer<T>(batch * cfg_.n_heads * seq * seq, mr),
            buffer<T>(n * cfg_.n_heads * hd, mr)};
  }

  /// y [batch, seq, dim] = attention(x [batch, seq, dim]); y is overwritten.
  template <ops::param_type P>
  void forward(std::span<P> params, in_view<T, 3> x, activations& a, tensor_view<T, host, 3> y, workspace<T>& ws) const {
    const index_t b = x.extent(0), s = x.extent(1), n = b * s;
    check(x, a);
    auto x2 = x.template reshape<2>({n, cfg_.dim});
    linear<T>::forward_all(params, x2,
                           {{&wq_, a.q.view(n, wq_.out_features())},
                            {&wk_, a.k.view(n, wk_.out_features())},
                            {&wv_, a.v.view(n, wv_.out_features())}},
                           ws);
    rope_.forward(q4(a));
    rope_.forward(kv4(a, a.k));
    ops::attention_forward(host{}, q4(a), kv4(a, a.k), kv4(a, a.v), a.out.view(b, s, cfg_.n_heads, cfg_.head_dim()),
                           a.probs.view(b, cfg_.n_heads, s, s), cfg_.mask);
    wo_.forward(params, a.out.view(n, wo_.in_features()), y.template reshape<2>({n, cfg_.dim}), ws);
  }

  /// dx += d/dx (dx = d/dx when !accumulate); parameter gradients added into `grads`.
  template <ops::param_type P>
  void backward(std::span<P> params, std::span<T> grads, in_view<T, 3> x, const activations& a, in_view<T, 3> dy,
                tensor_view<T, host, 3> dx, workspace<T>& ws, bool accumulate = true) const {
    const index_t b = x.extent(0), s = x.extent(1), n = b * s, hd = cfg_.head_dim();
    check(x, a);
    auto x2 = x.template reshape<2>({n, cfg_.dim});
    auto dout = ws.take(n * cfg_.n_heads * hd);  // every gradient buffer here is written, not added into
    wo_.backward(params, grads, make_view(a.out.data(), n, wo_.in_features()), dy.template reshape<2>({n, cfg_.dim}),
                 make_view(dout.data(), n, wo_.in_features()), ws, /*accumulate=*/false);
    auto dq = ws.take(a.q.size()), dk = ws.take(a.k.size()), dv = ws.take(a.v.size());
    auto scratch = ws.take(s * s);
    auto dq4 = make_view(dq.data(), b, s, cfg_.n_heads, hd), dk4 = make_view(dk.data(), b, s, cfg_.n_kv_heads, hd);
    ops::attention_backward(host{}, make_view(dout.data(), b, s, cfg_.n_heads, hd), q4(a), kv4(a, a.k), kv4(a, a.v),
                            make_view(a.probs.data(), b, cfg_.n_heads, s, s), dq4, dk4,
                            make_view(dv.data(), b, s, cfg_.n_kv_heads, hd), make_view(scratch.data(), s, s), cfg_.mask,
                            /*accumulate=*/false);
    rope_.backward(dq4);
    rope_.backward(dk4);
    auto dx2 = dx.template reshape<2>({n, cfg_.dim});
    linear<T>::backward_all(params, grads, x2,
                            {{&wq_, make_view(as_const(dq).data(), n, wq_.out_features())},
                             {&wk_, make_view(as_const(dk).data(), n, wk_.out_features())},
                             {&wv_, make_view(as_const(dv).data(), n, wv_.out_features())}},
                            dx2, ws, accumulate);
  }

 private:
  void check(const in_view<T, 3>& x, const activations& a) const {
    LOOM_CHECK(x.extent(2) == cfg_.dim, "nn::attention: input has ", x.extent(2), " features, expected dim=", cfg_.dim);
    LOOM_CHECK(x.extent(0) == a.batch && x.extent(1) == a.seq, "nn::attention: input is [", x.extent(0), ", ",
               x.extent(1), ", ...] but the activations were made for batch=", a.batch, ", seq=", a.seq);
    LOOM_CHECK(a.seq <= rope_.max_seq(), "nn::attention: seq=", a.seq, " exceeds max_seq=", rope_.max_seq());
  }
  template <class A>  // activations or const activations
  auto q4(A& a) const {
    return make_view(a.q.data(), a.batch, a.seq, cfg_.n_heads, cfg_.head_dim());
  }
  template <class A, class B>
  auto kv4(A& a, B& kv) const {
    return make_view(kv.data(), a.batch, a.seq, cfg_.n_kv_heads, cfg_.head_dim());
  }

  attention_config cfg_{};
  linear<T> wq_, wk_, wv_, wo_;
  rotary<T> rope_;
};

}  // namespace loom::nn
