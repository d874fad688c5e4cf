#pragma once
// Multi-head self-attention with grouped-query heads (GQA; MQA when n_kv_heads == 1),
// rotary positions and a causal (optionally prefix-LM) mask, as in LLaMA 2/3, on any
// tensor-parallel size (Megatron-LM's split; tp = 1 is the whole layer on one rank):
//
//   q = x Wq^T, k = x Wk^T, v = x Wv^T     // [batch, seq, heads|kv_heads, head_dim], local heads
//   q, k = rope(q), rope(k)
//   a = softmax(q k^T / sqrt(head_dim) + mask) v
//   y = all_reduce_tp(a Wo^T)
//
//   rank r of tp: query heads [r*H/tp, (r+1)*H/tp) -> wq rows (column-parallel), wo columns
//   (row-parallel); key/value heads:
//     KV >= tp: KV/tp heads per rank, the ones its query heads attend to (KV % tp == 0);
//     KV <  tp: (tp % KV == 0) each rank holds a replica of the ONE key/value head its query
//               heads use; the tp/KV replicas' partial gradients are summed in backward so
//               the replicas stay identical. Other splits are refused with a loom::error.
//   forward:  f (identity), local q/k/v, rope, attention over the local heads, local wo,
//             g (all-reduce of y); backward: g' (identity), local backward, f' (all-reduce of dx)
//
// One class for every tp (design.md section 6): the single-rank model calls it with a
// comm::self_comm (or the overloads without a communicator), whose reductions are no-ops,
// so the one-rank and the tensor-parallel model run the same code and cannot drift.
//
// Inference runs the same layer forward only (forward_cached): the projections packed once,
// the same rotary, and the attention over a key/value cache the caller keeps (kv/: paged).
//
// Parameters `<name>.wq/wk/wv/wo.weight` (Meta's names). The activations backward needs
// (rotated q, k, v, the attention probabilities, a) live in an `activations` object the
// caller owns: one per layer normally, one shared by all layers under activation
// checkpointing (the block's forward is re-run before its backward).

#include <loom/comm/communicator.hpp>
#include <loom/comm/self_comm.hpp>
#include <loom/core/buffer.hpp>
#include <loom/nn/linear.hpp>
#include <loom/nn/rotary.hpp>
#include <loom/nn/tp/shard.hpp>
#include <loom/nn/workspace.hpp>
#include <loom/ops/host/attention.hpp>
#include <loom/ops/host/packed_weight.hpp>

#include <algorithm>
#include <concepts>
#include <cstdint>
#include <span>
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

/// How the heads of an attention_config are split over tp ranks (throws naming a bad split).
struct head_split {
  index_t heads = 0, kv_heads = 0;  ///< local counts
  index_t first_head = 0, first_kv_head = 0;
  int kv_replicas = 1;              ///< ranks holding the same key/value head (KV < tp)
  int tp_size = 1;                  ///< the tensor group this split was made for

  static head_split make(const attention_config& c, tp::tp_rank t) {
    t.validate();
    LOOM_CHECK(c.n_heads % t.size == 0, "nn::attention: n_heads (", c.n_heads,
               ") must be divisible by the tensor-parallel size tp=", t.size);
    head_split s;
    s.tp_size = t.size;
    s.heads = c.n_heads / t.size;
    s.first_head = s.heads * t.rank;
    if (c.n_kv_heads >= t.size) {
      LOOM_CHECK(c.n_kv_heads % t.size == 0, "nn::attention: n_kv_heads (", c.n_kv_heads,
                 ") must be divisible by the tensor-parallel size tp=", t.size, " (or divide it, to be replicated)");
      s.kv_heads = c.n_kv_heads / t.size;
      s.first_kv_head = s.kv_heads * t.rank;
    } else {
      LOOM_CHECK(t.size % c.n_kv_heads == 0, "nn::attention: n_kv_heads (", c.n_kv_heads,
                 ") < tp=", t.size, " must divide tp so each rank replicates one key/value head");
      s.kv_heads = 1;
      s.kv_replicas = t.size / int(c.n_kv_heads);
      s.first_kv_head = t.rank / s.kv_replicas;
    }
    return s;
  }
};

template <compute_type T>
class attention {
 public:
  /// Saved by forward for backward; sized for one (batch, seq) and this rank's heads.
  struct activations {
    index_t batch = 0, seq = 0;
    buffer<T> q, k, v;  // [batch, seq, heads | kv_heads, head_dim], after rope
    buffer<T> probs;    // [batch, heads, seq, seq]
    buffer<T> out;      // [batch, seq, heads * head_dim], input of wo
  };

  attention() = default;
  /// This rank's part of the layer: t is its place in the tensor group ({0, 1}: the whole
  /// layer); shards, when given, records which rectangle of each full weight it holds.
  /// Biases (c.bias) need tp = 1 (a row-parallel wo bias would be added tp times).
  attention(param_layout& layout, const std::string& name, const attention_config& c, tp::tp_rank t = {},
            tp::shard_list* shards = nullptr)
      : cfg_((c.validate(), c)), split_(head_split::make(c, t)) {
    LOOM_CHECK(!c.bias || t.size == 1, "nn::attention: biases need tensor-parallel size 1, got tp=", t.size);
    const index_t hd = c.head_dim(), d = c.dim;
    wq_ = linear<T>(layout, name + ".wq", d, split_.heads * hd, c.bias);
    wk_ = linear<T>(layout, name + ".wk", d, split_.kv_heads * hd, c.bias);
    wv_ = linear<T>(layout, name + ".wv", d, split_.kv_heads * hd, c.bias);
    wo_ = linear<T>(layout, name + ".wo", split_.heads * hd, d, c.bias);
    tp::record(shards, name + ".wq.weight", wq_.weight(), c.n_heads * hd, d, split_.first_head * hd, 0);
    const int replica = t.rank % split_.kv_replicas;
    tp::record(shards, name + ".wk.weight", wk_.weight(), c.n_kv_heads * hd, d, split_.first_kv_head * hd, 0, replica);
    tp::record(shards, name + ".wv.weight", wv_.weight(), c.n_kv_heads * hd, d, split_.first_kv_head * hd, 0, replica);
    tp::record(shards, name + ".wo.weight", wo_.weight(), d, c.n_heads * hd, 0, split_.first_head * hd);
    rope_ = rotary<T>(c.max_seq, hd, c.rope_theta, c.rope);
  }

  const attention_config& config() const noexcept { return cfg_; }
  const head_split& split() const noexcept { return split_; }

  activations make_activations(index_t batch, index_t seq, memory_resource& mr = default_resource<host>()) const {
    const index_t n = batch * seq, hd = cfg_.head_dim();
    return {batch, seq, buffer<T>(n * split_.heads * hd, mr), buffer<T>(n * split_.kv_heads * hd, mr),
            buffer<T>(n * split_.kv_heads * hd, mr), buffer<T>(batch * split_.heads * seq * seq, mr),
            buffer<T>(n * split_.heads * hd, mr)};
  }

  /// y [batch, seq, dim] = attention(x [batch, seq, dim]) summed over the tensor group tp;
  /// y is overwritten (contiguous).
  template <comm::communicator C, ops::param_type P>
  void forward(C& tp, std::span<P> params, in_view<T, 3> x, activations& a, tensor_view<T, host, 3> y,
               workspace<T>& ws) const {
    const index_t b = x.extent(0), s = x.extent(1), n = b * s;
    check(tp, x, a);
    auto x2 = x.template reshape<2>({n, cfg_.dim});
    linear<T>::forward_all(params, x2,
                           {{&wq_, a.q.view(n, wq_.out_features())},
                            {&wk_, a.k.view(n, wk_.out_features())},
                            {&wv_, a.v.view(n, wv_.out_features())}},
                           ws);
    rope_.forward(q4(a));
    rope_.forward(kv4(a, a.k));
    ops::attention_forward(host{}, q4(a), kv4(a, a.k), kv4(a, a.v), a.out.view(b, s, split_.heads, cfg_.head_dim()),
                           a.probs.view(b, split_.heads, s, s), cfg_.mask);
    wo_.forward(params, a.out.view(n, wo_.in_features()), y.template reshape<2>({n, cfg_.dim}), ws);
    tp::reduce_from_tensor_parallel_forward(tp, std::span<T>(y.data(), static_cast<std::size_t>(y.numel())));
  }
  /// The whole layer on one rank.
  template <ops::param_type P>
  void forward(std::span<P> params, in_view<T, 3> x, activations& a, tensor_view<T, host, 3> y, workspace<T>& ws) const {
    comm::self_comm self;
    forward(self, params, x, a, y, ws);
  }

  /// dx += d/dx summed over the group (dx = d/dx when !accumulate); this rank's parameter
  /// gradients added into `grads`.
  template <comm::communicator C, ops::param_type P>
  void backward(C& tp, std::span<P> params, std::span<T> grads, in_view<T, 3> x, const activations& a, in_view<T, 3> dy,
                tensor_view<T, host, 3> dx, workspace<T>& ws, bool accumulate = true) const {
    const index_t b = x.extent(0), s = x.extent(1), n = b * s, hd = cfg_.head_dim();
    check(tp, x, a);
    auto x2 = x.template reshape<2>({n, cfg_.dim});
    // replicated key/value heads: remember the gradients so far, sum only this call's part
    const std::size_t kvn = wk_.weight().numel();
    std::span<T> kv_before;
    if (split_.kv_replicas > 1) {
      kv_before = ws.take(2 * kvn);
      std::copy_n(wk_.weight().in(grads).data(), kvn, kv_before.data());
      std::copy_n(wv_.weight().in(grads).data(), kvn, kv_before.data() + kvn);
    }
    auto dout = ws.take(n * split_.heads * hd);  // every gradient buffer here is written, not added into
    wo_.backward(params, grads, make_view(a.out.data(), n, wo_.in_features()), dy.template reshape<2>({n, cfg_.dim}),
                 make_view(dout.data(), n, wo_.in_features()), ws, /*accumulate=*/false);
    auto dq = ws.take(a.q.size()), dk = ws.take(a.k.size()), dv = ws.take(a.v.size());
    auto scratch = ws.take(s * s);
    auto dq4 = make_view(dq.data(), b, s, split_.heads, hd), dk4 = make_view(dk.data(), b, s, split_.kv_heads, hd);
    ops::attention_backward(host{}, make_view(dout.data(), b, s, split_.heads, hd), q4(a), kv4(a, a.k), kv4(a, a.v),
                            make_view(a.probs.data(), b, split_.heads, s, s), dq4, dk4,
                            make_view(dv.data(), b, s, split_.kv_heads, hd), make_view(scratch.data(), s, s), cfg_.mask,
                            /*accumulate=*/false);
    rope_.backward(dq4);
    rope_.backward(dk4);
    const auto dx2 = dx.template reshape<2>({n, cfg_.dim});
    const auto target = tp::input_grad_target(tp, dx2, ws);
    linear<T>::backward_all(params, grads, x2,
                            {{&wq_, make_view(as_const(dq).data(), n, wq_.out_features())},
                             {&wk_, make_view(as_const(dk).data(), n, wk_.out_features())},
                             {&wv_, make_view(as_const(dv).data(), n, wv_.out_features())}},
                            target, ws, tp::input_grad_accumulates(tp, accumulate));
    if (split_.kv_replicas > 1) sum_kv_replicas(tp, grads, kv_before, ws);
    tp::finish_input_grad(tp, target, dx2, accumulate);
  }
  /// The whole layer on one rank.
  template <ops::param_type P>
  void backward(std::span<P> params, std::span<T> grads, in_view<T, 3> x, const activations& a, in_view<T, 3> dy,
                tensor_view<T, host, 3> dx, workspace<T>& ws, bool accumulate = true) const {
    comm::self_comm self;
    backward(self, params, grads, x, a, dy, dx, ws, accumulate);
  }

  // ---- forward only, over a key/value cache (inference) ----------------------------------
  /// The projections packed once for the GEMMs that read them (ops::packed_weight), from
  /// this layer's parameters in `params` (fp32). Layers with biases are refused (none of the
  /// decoders run this way has them yet).
  struct packed {
    ops::packed_weight wq, wk, wv, wo;
  };
  packed pack(std::span<const float> params) const
    requires std::same_as<T, float>
  {
    LOOM_CHECK(!cfg_.bias, "nn::attention::pack: the forward-only path has no biases, and this layer has bias=true");
    auto p = [&](const linear<T>& l) { return ops::packed_weight(l.weight().in(params)); };
    return {p(wq_), p(wk_), p(wv_), p(wo_)};
  }

  /// y [n, dim] = this layer for n new tokens x [n, dim] at `positions` (each token's place
  /// in its sequence), summed over the tensor group tp; y is overwritten. Where the keys and
  /// values of the tokens before them live is the caller's: `attend(q, k, v, out)` gets the
  /// rotated q [n, heads, head_dim] and k, v [n, kv_heads, head_dim] of this rank's heads,
  /// stores k and v with their sequences (a paged KV cache) and writes each query's
  /// attention over its sequence into out [n, heads, head_dim]. Scratch comes from ws; y may
  /// be x's buffer (x is read only before y is written).
  template <comm::communicator C, class Attend>
    requires std::same_as<T, float>
  void forward_cached(C& tp, const packed& w, in_view<T, 2> x, std::span<const std::int64_t> positions, Attend&& attend,
                      tensor_view<T, host, 2> y, workspace<T>& ws) const {
    const index_t n = x.extent(0), hd = cfg_.head_dim(), h = split_.heads, kv = split_.kv_heads;
    LOOM_CHECK(tp.size() == split_.tp_size, "nn::attention: built for tensor-parallel size ", split_.tp_size,
               ", called on a group of ", tp.size());
    LOOM_CHECK(x.extent(1) == cfg_.dim, "nn::attention: input has ", x.extent(1), " features, expected dim=", cfg_.dim);
    auto q = ws.take(n * h * hd), k = ws.take(n * kv * hd), v = ws.take(n * kv * hd), out = ws.take(n * h * hd);
    ops::gemm(host{}, x, w.wq, make_view(q.data(), n, h * hd));
    ops::gemm(host{}, x, w.wk, make_view(k.data(), n, kv * hd));
    ops::gemm(host{}, x, w.wv, make_view(v.data(), n, kv * hd));
    rope_.forward(make_view(q.data(), n, h, hd), positions);
    rope_.forward(make_view(k.data(), n, kv, hd), positions);
    attend(make_view(as_const(q).data(), n, h, hd), make_view(as_const(k).data(), n, kv, hd),
           make_view(as_const(v).data(), n, kv, hd), make_view(out.data(), n, h, hd));
    ops::gemm(host{}, make_view(as_const(out).data(), n, h * hd), w.wo, y);
    tp::reduce_from_tensor_parallel_forward(tp, std::span<T>(y.data(), static_cast<std::size_t>(y.numel())));
  }

 private:
  // Every rank puts this call's wk/wv gradient into its head's slot of [KV, 2, kvn], the
  // group sums, and each rank adds back its head's total: replicas get the same gradient.
  template <comm::communicator C>
  void sum_kv_replicas(C& tp, std::span<T> grads, std::span<const T> before, workspace<T>& ws) const {
    const std::size_t kvn = wk_.weight().numel(), KV = static_cast<std::size_t>(cfg_.n_kv_heads);
    auto all = ws.take_zeroed(KV * 2 * kvn);
    T* gk = wk_.weight().in(grads).data();
    T* gv = wv_.weight().in(grads).data();
    T* mine = all.data() + static_cast<std::size_t>(split_.first_kv_head) * 2 * kvn;
    for (std::size_t i = 0; i < kvn; ++i) mine[i] = gk[i] - before[i], mine[kvn + i] = gv[i] - before[kvn + i];
    tp.all_reduce(std::span<const T>(all.data(), KV * 2 * kvn), all.subspan(0, KV * 2 * kvn), comm::reduce_op::sum);
    for (std::size_t i = 0; i < kvn; ++i) gk[i] = before[i] + mine[i], gv[i] = before[kvn + i] + mine[kvn + i];
  }
  template <comm::communicator C>
  void check(const C& tp, const in_view<T, 3>& x, const activations& a) const {
    LOOM_CHECK(tp.size() == split_.tp_size, "nn::attention: built for tensor-parallel size ", split_.tp_size,
               ", called on a group of ", tp.size());
    LOOM_CHECK(x.extent(2) == cfg_.dim, "nn::attention: input has ", x.extent(2), " features, expected dim=", cfg_.dim);
    LOOM_CHECK(x.extent(0) == a.batch && x.extent(1) == a.seq, "nn::attention: input is [", x.extent(0), ", ",
               x.extent(1), ", ...] but the activations were made for batch=", a.batch, ", seq=", a.seq);
    LOOM_CHECK(a.seq <= rope_.max_seq(), "nn::attention: seq=", a.seq, " exceeds max_seq=", rope_.max_seq());
  }
  template <class A>  // activations or const activations
  auto q4(A& a) const {
    return make_view(a.q.data(), a.batch, a.seq, split_.heads, cfg_.head_dim());
  }
  template <class A, class B>
  auto kv4(A& a, B& kv) const {
    return make_view(kv.data(), a.batch, a.seq, split_.kv_heads, cfg_.head_dim());
  }

  attention_config cfg_{};
  head_split split_{};
  linear<T> wq_, wk_, wv_, wo_;
  rotary<T> rope_;
};

}  // namespace loom::nn
