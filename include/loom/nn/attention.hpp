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
// Parameters `<name>.wq/wk/wv/wo.weight` (Meta's names), or with fused_qkv one tensor
// `<name>.wqkv.weight` [(H + 2 KV) head_dim, dim] whose rows are [all Q | K | V] (ChatGLM's
// query_key_value): the q/k/v projections are views of its row ranges, so tensor parallelism
// still splits Q, K and V each by heads (a rank's part of the fused tensor is three
// rectangles). qkv_bias adds biases to the q/k/v projections only (ChatGLM2/3), at any tp.
// Partial rotary (rotary_dim < head_dim) rotates the leading channels of each head only.
// The activations backward needs
// (rotated q, k, v, the attention probabilities, a) live in an `activations` object the
// caller owns: one per layer normally, one shared by all layers under activation
// checkpointing (the block's forward is re-run before its backward).

#include <loom/comm/communicator.hpp>
#include <loom/comm/self_comm.hpp>
#include <loom/core/buffer.hpp>
#include <loom/nn/linear.hpp>
#include <loom/ops/host/fill.hpp>
#include <loom/nn/projection_hook.hpp>
#include <loom/nn/rotary.hpp>
#include <loom/nn/tp/shard.hpp>
#include <loom/nn/workspace.hpp>
#include <loom/ops/host/attention.hpp>
#include <loom/ops/host/packed_weight.hpp>

#include <algorithm>
#include <concepts>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

namespace loom::nn {

struct attention_config {
  index_t dim = 0, n_heads = 0, n_kv_heads = 0, max_seq = 0;
  double rope_theta = 10000.0;
  ops::rope_style rope = ops::rope_style::interleaved;
  ops::attention_mask mask{};
  bool bias = false;  ///< biases on q/k/v/o projections (GPT-style); LLaMA has none
  bool qkv_bias = false;   ///< biases on the q/k/v projections only (ChatGLM2/3), any tp
  bool fused_qkv = false;  ///< q/k/v stored as one tensor `<name>.wqkv` with rows [Q | K | V]
  index_t rotary_dim = 0;  ///< the leading channels of each head that rotate (0: all)

  index_t head_dim() const noexcept { return n_heads ? dim / n_heads : 0; }
  void validate() const {
    LOOM_CHECK(dim > 0, "attention: dim must be > 0, got dim=", dim);
    LOOM_CHECK(n_heads > 0 && dim % n_heads == 0, "attention: dim (", dim, ") must be divisible by n_heads (", n_heads,
               ")");
    LOOM_CHECK(n_kv_heads > 0 && n_heads % n_kv_heads == 0, "attention: n_heads (", n_heads,
               ") must be divisible by n_kv_heads (", n_kv_heads, ")");
    LOOM_CHECK(head_dim() % 2 == 0, "attention: head_dim (", head_dim(), ") must be even for rotary embeddings");
    LOOM_CHECK(max_seq > 0, "attention: max_seq must be > 0, got max_seq=", max_seq);
    LOOM_CHECK(rotary_dim >= 0 && rotary_dim <= head_dim() && rotary_dim % 2 == 0, "attention: rotary_dim (", rotary_dim,
               ") must be even and at most head_dim (", head_dim(), ")");
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
  /// Saved by forward for backward; sized for one (batch, seq) and this rank's heads, in
  /// device D's memory. What the attention core keeps differs: the host its probabilities,
  /// the GPU each query row's log-sum-exp (FlashAttention's, no [seq, seq] matrix).
  template <class D = host>
  struct activations_on {
    index_t batch = 0, seq = 0;
    buffer<T, D> q, k, v;  // [batch, seq, heads | kv_heads, head_dim], after rope
    buffer<T, D> probs;    // host: [batch, heads, seq, seq], the softmax transposed (ops::attention_forward)
    buffer<T, D> out;      // [batch, seq, heads * head_dim], input of wo
    buffer<T, D> lse;      // cuda: [batch, heads, seq]
  };
  using activations = activations_on<>;

  attention() = default;
  /// This rank's part of the layer: t is its place in the tensor group ({0, 1}: the whole
  /// layer); shards, when given, records which rectangle of each full weight it holds.
  /// Biases (c.bias) need tp = 1 (a row-parallel wo bias would be added tp times).
  /// bias_layout (and bias_shards), when given: where the q/k/v biases are declared (and
  /// recorded) instead of with the weights -- a frozen base whose weights are held outside the
  /// flat buffer (quantised) keeps its biases in it.
  attention(param_layout& layout, const std::string& name, const attention_config& c, tp::tp_rank t = {},
            tp::shard_list* shards = nullptr, param_layout* bias_layout = nullptr, tp::shard_list* bias_shards = nullptr)
      : cfg_((c.validate(), c)), split_(head_split::make(c, t)) {
    LOOM_CHECK(!c.bias || t.size == 1, "nn::attention: biases need tensor-parallel size 1, got tp=", t.size);
    const index_t hd = c.head_dim(), d = c.dim, qn = split_.heads * hd, kn = split_.kv_heads * hd;
    const bool qkv_bias = c.bias || c.qkv_bias;
    param_layout& bl = bias_layout ? *bias_layout : layout;
    tp::shard_list* bsh = bias_layout ? bias_shards : shards;
    // this rank's first Q row and first K (V) row within Q (K, V), and the K (V) rows of the whole layer
    const index_t q0 = split_.first_head * hd, k0 = split_.first_kv_head * hd, kv_rows = c.n_kv_heads * hd;
    const int replica = t.rank % split_.kv_replicas;
    struct part {
      const char* name;
      linear<T>* layer;
      index_t full_rows, row0;
      int replica;
    };
    if (c.fused_qkv) {
      const index_t rows = c.n_heads * hd + 2 * kv_rows;
      const auto w = layout.add(name + ".wqkv.weight", extents<2>{qn + 2 * kn, d});
      std::optional<param_slot<1>> b;
      if (qkv_bias) b = bl.add(name + ".wqkv.bias", extents<1>{qn + 2 * kn});
      const auto view = [&](index_t r0, index_t r) {
        return linear<T>(param_slot<2>{w.offset + static_cast<std::size_t>(r0 * d), {r, d}},
                         b ? std::optional(param_slot<1>{b->offset + static_cast<std::size_t>(r0), {r}}) : std::nullopt);
      };
      wq_ = view(0, qn), wk_ = view(qn, kn), wv_ = view(qn + kn, kn);
      const part parts[] = {{"wqkv", &wq_, rows, q0, 0}, {"wqkv", &wk_, rows, c.n_heads * hd + k0, replica},
                            {"wqkv", &wv_, rows, c.n_heads * hd + kv_rows + k0, replica}};
      for (const bool bias : {false, true})  // in the flat buffer's order: the weight's rows, then the bias's
        for (const part& p : parts)
          record_projection(bias ? bsh : shards, name, p.name, *p.layer, p.full_rows, p.row0, p.replica, bias);
    } else {
      // each weight followed by its bias in one layout; with a bias layout, the biases there
      const auto separate = [&](const char* n, index_t out) {
        if (!bias_layout) return linear<T>(layout, name + "." + n, d, out, qkv_bias);
        const auto w = layout.add(name + "." + n + ".weight", extents<2>{out, d});
        return linear<T>(w, qkv_bias ? std::optional(bl.add(name + "." + n + ".bias", extents<1>{out})) : std::nullopt);
      };
      wq_ = separate("wq", qn), wk_ = separate("wk", kn), wv_ = separate("wv", kn);
      for (const part& p : {part{"wq", &wq_, c.n_heads * hd, q0, 0}, part{"wk", &wk_, kv_rows, k0, replica},
                            part{"wv", &wv_, kv_rows, k0, replica}})
        for (const bool bias : {false, true})
          record_projection(bias ? bsh : shards, name, p.name, *p.layer, p.full_rows, p.row0, p.replica, bias);
    }
    wo_ = linear<T>(layout, name + ".wo", qn, d, c.bias);
    tp::record(shards, name + ".wo.weight", wo_.weight(), d, c.n_heads * hd, 0, split_.first_head * hd);
    if (c.bias) tp::record(shards, name + ".wo.bias", *wo_.bias(), d, 1, 0, 0);
    rope_ = rotary<T>(c.max_seq, hd, c.rope_theta, c.rope, c.rotary_dim);
  }

  const attention_config& config() const noexcept { return cfg_; }
  const head_split& split() const noexcept { return split_; }
  /// f(name, layer) for each projection ("wq", "wk", "wv", "wo"; fused q/k/v: three views of
  /// wqkv): how a trainer puts a frozen op behind one (linear::set_frozen).
  template <class F>
  void for_each_linear(F&& f) {
    f("wq", wq_), f("wk", wk_), f("wv", wv_), f("wo", wo_);
  }

  template <class D = host>
  activations_on<D> make_activations(index_t batch, index_t seq, memory_resource& mr = default_resource<D>()) const {
    const index_t n = batch * seq, hd = cfg_.head_dim();
    const bool on_host = std::is_same_v<D, host>;
    return {batch,
            seq,
            buffer<T, D>(n * split_.heads * hd, mr),
            buffer<T, D>(n * split_.kv_heads * hd, mr),
            buffer<T, D>(n * split_.kv_heads * hd, mr),
            buffer<T, D>(on_host ? batch * split_.heads * seq * seq : 0, mr),
            buffer<T, D>(n * split_.heads * hd, mr),
            buffer<T, D>(on_host ? 0 : batch * split_.heads * seq, mr)};
  }

  /// y [batch, seq, dim] = attention(x [batch, seq, dim]) summed over the tensor group tp;
  /// y is overwritten (contiguous). On the workspace's device (the activations' too).
  template <comm::communicator C, ops::param_type P, class D>
  void forward(C& tp, std::span<P> params, in_view_on<T, D, 3> x, activations_on<D>& a, view_on<T, D, 3> y,
               workspace<T, D>& ws) const {
    const index_t b = x.extent(0), s = x.extent(1), n = b * s;
    const auto& ctx = ws.context();
    check(tp, x, a);
    auto x2 = x.template reshape<2>({n, cfg_.dim});
    linear<T>::forward_all(params, x2,
                           {{&wq_, a.q.view(n, wq_.out_features())},
                            {&wk_, a.k.view(n, wk_.out_features())},
                            {&wv_, a.v.view(n, wv_.out_features())}},
                           ws);
    rope_.forward(ctx, q4(a));
    rope_.forward(ctx, kv4(a, a.k));
    const auto out4 = a.out.view(b, s, split_.heads, cfg_.head_dim());
    if constexpr (std::is_same_v<D, host>)
      ops::attention_forward(host{}, q4(a), kv4(a, a.k), kv4(a, a.v), out4, a.probs.view(b, split_.heads, s, s), cfg_.mask);
    else
      ctx.attention_forward(q4(a), kv4(a, a.k), kv4(a, a.v), out4, a.lse.view(b, split_.heads, s), cfg_.mask);
    wo_.forward(params, a.out.view(n, wo_.in_features()), y.template reshape<2>({n, cfg_.dim}), ws);
    tp::reduce_from_tensor_parallel_forward(tp, std::span<T>(y.data(), static_cast<std::size_t>(y.numel())));
  }
  /// The whole layer on one rank.
  template <ops::param_type P, class D>
  void forward(std::span<P> params, in_view_on<T, D, 3> x, activations_on<D>& a, view_on<T, D, 3> y,
               workspace<T, D>& ws) const {
    comm::self_comm self;
    forward(self, params, x, a, y, ws);
  }

  /// dx += d/dx summed over the group (dx = d/dx when !accumulate); this rank's parameter
  /// gradients added into `grads` (empty: the weights are frozen, dx only; nn::linear).
  template <comm::communicator C, ops::param_type P, class D>
  void backward(C& tp, std::span<P> params, std::span<T> grads, in_view_on<T, D, 3> x, const activations_on<D>& a,
                in_view_on<T, D, 3> dy, view_on<T, D, 3> dx, workspace<T, D>& ws, bool accumulate = true) const {
    const index_t b = x.extent(0), s = x.extent(1), n = b * s, hd = cfg_.head_dim();
    const auto& ctx = ws.context();
    check(tp, x, a);
    auto x2 = x.template reshape<2>({n, cfg_.dim});
    // replicated key/value heads: remember the gradients so far, sum only this call's part
    std::span<T> kv_before;
    const bool kv_sum = split_.kv_replicas > 1 && !grads.empty();
    if constexpr (std::is_same_v<D, host>) {  // replicas need tp > 1, which check() refuses on a device
      if (kv_sum) {
        kv_before = ws.take(kv_grad_size());
        auto out = kv_before.begin();
        for (std::span<T> g : kv_grads(grads)) out = std::copy(g.begin(), g.end(), out);
      }
    }
    auto dout = ws.take(n * split_.heads * hd);  // every gradient buffer here is written, not added into
    wo_.backward(params, grads, make_view<D>(a.out.data(), n, wo_.in_features()), dy.template reshape<2>({n, cfg_.dim}),
                 make_view<D>(dout.data(), n, wo_.in_features()), ws, /*accumulate=*/false);
    auto dq = ws.take(a.q.size()), dk = ws.take(a.k.size()), dv = ws.take(a.v.size());
    auto dq4 = make_view<D>(dq.data(), b, s, split_.heads, hd), dk4 = make_view<D>(dk.data(), b, s, split_.kv_heads, hd);
    const auto dout4 = make_view<D>(as_const(dout).data(), b, s, split_.heads, hd);
    const auto dv4 = make_view<D>(dv.data(), b, s, split_.kv_heads, hd);
    if constexpr (std::is_same_v<D, host>) {
      auto scratch = ws.take(s * s);
      ops::attention_backward(host{}, dout4, q4(a), kv4(a, a.k), kv4(a, a.v), make_view(a.probs.data(), b, split_.heads, s, s),
                              dq4, dk4, dv4, make_view(scratch.data(), s, s), cfg_.mask, /*accumulate=*/false);
    } else {
      ctx.attention_backward(dout4, q4(a), kv4(a, a.k), kv4(a, a.v),
                             make_view<D>(a.out.data(), b, s, split_.heads, hd),
                             make_view<D>(a.lse.data(), b, split_.heads, s), dq4, dk4, dv4, cfg_.mask, /*accumulate=*/false);
    }
    rope_.backward(ctx, dq4);
    rope_.backward(ctx, dk4);
    const auto dx2 = dx.template reshape<2>({n, cfg_.dim});
    const auto target = tp::input_grad_target(tp, dx2, ws);
    linear<T>::backward_all(params, grads, x2,
                            {{&wq_, make_view<D>(as_const(dq).data(), n, wq_.out_features())},
                             {&wk_, make_view<D>(as_const(dk).data(), n, wk_.out_features())},
                             {&wv_, make_view<D>(as_const(dv).data(), n, wv_.out_features())}},
                            target, ws, tp::input_grad_accumulates(tp, accumulate));
    if constexpr (std::is_same_v<D, host>)
      if (kv_sum) sum_kv_replicas(tp, grads, kv_before, ws);
    tp::finish_input_grad(tp, target, dx2, accumulate, ctx);
  }
  /// The whole layer on one rank.
  template <ops::param_type P, class D>
  void backward(std::span<P> params, std::span<T> grads, in_view_on<T, D, 3> x, const activations_on<D>& a,
                in_view_on<T, D, 3> dy, view_on<T, D, 3> dx, workspace<T, D>& ws, bool accumulate = true) const {
    comm::self_comm self;
    backward(self, params, grads, x, a, dy, dx, ws, accumulate);
  }

  // ---- forward only, over a key/value cache (inference) ----------------------------------
  /// The projections packed once for the GEMMs that read them (ops::packed_weight), from
  /// this layer's parameters in `params` (fp32), and the q/k/v biases (views of params; empty
  /// when the layer has none). The packed copies come from `mr`. An output bias (bias=true)
  /// is refused: no decoder run this way has one.
  struct packed {
    ops::packed_weight wq, wk, wv, wo;
    std::span<const float> bq, bk, bv;
  };
  packed pack(std::span<const float> params, memory_resource& mr = default_resource<host>()) const
    requires std::same_as<T, float>
  {
    LOOM_CHECK(!cfg_.bias, "nn::attention::pack: the forward-only path has no output bias, and this layer has bias=true");
    auto p = [&](const linear<T>& l) { return ops::packed_weight(l.weight().in(params), ops::host_sgemm_kernel(), mr); };
    auto b = [&](const linear<T>& l) {
      return l.bias() ? std::span<const float>(l.bias()->in(params).data(), l.bias()->numel()) : std::span<const float>{};
    };
    return {p(wq_), p(wk_), p(wv_), p(wo_), b(wq_), b(wk_), b(wv_)};
  }
  /// Bytes pack() takes from its resource (a memory plan made before the weights are read).
  std::size_t packed_bytes() const {
    std::size_t n = 0;
    for (const linear<T>* l : {&wq_, &wk_, &wv_, &wo_}) n += ops::packed_weight::bytes_for(l->out_features(), l->in_features());
    return n;
  }

  /// y [n, dim] = this layer for n new tokens x [n, dim] at `positions` (each token's place
  /// in its sequence), summed over the tensor group tp; y is overwritten. Where the keys and
  /// values of the tokens before them live is the caller's: `attend(q, k, v, out)` gets the
  /// rotated q [n, heads, head_dim] and k, v [n, kv_heads, head_dim] of this rank's heads,
  /// stores k and v with their sequences (a paged KV cache) and writes each query's
  /// attention over its sequence into out [n, heads, head_dim]. Scratch comes from ws; y may
  /// be x's buffer (x is read only before y is written). `hook(projection, in, out)` runs
  /// after each projection (projection_hook.hpp): q, k, v before rotary, o before the sum.
  template <comm::communicator C, class Attend, class Hook = no_projection_hook>
    requires std::same_as<T, float>
  void forward_cached(C& tp, const packed& w, in_view<T, 2> x, std::span<const std::int64_t> positions, Attend&& attend,
                      tensor_view<T, host, 2> y, workspace<T>& ws, Hook&& hook = {}) const {
    const index_t n = x.extent(0), hd = cfg_.head_dim(), h = split_.heads, kv = split_.kv_heads;
    LOOM_CHECK(tp.size() == split_.tp_size, "nn::attention: built for tensor-parallel size ", split_.tp_size,
               ", called on a group of ", tp.size());
    LOOM_CHECK(x.extent(1) == cfg_.dim, "nn::attention: input has ", x.extent(1), " features, expected dim=", cfg_.dim);
    auto q = ws.take(n * h * hd), k = ws.take(n * kv * hd), v = ws.take(n * kv * hd), out = ws.take(n * h * hd);
    for (auto [pw, bias, out, m, which] :
         {std::tuple{&w.wq, w.bq, q, h * hd, projection::q}, std::tuple{&w.wk, w.bk, k, kv * hd, projection::k},
          std::tuple{&w.wv, w.bv, v, kv * hd, projection::v}}) {
      ops::gemm(host{}, x, *pw, make_view(out.data(), n, m));
      if (!bias.empty()) ops::add_bias(host{}, make_view(out.data(), n, m), make_view(bias.data(), m));
      hook(which, x, make_view(out.data(), n, m));
    }
    rope_.forward(make_view(q.data(), n, h, hd), positions);
    rope_.forward(make_view(k.data(), n, kv, hd), positions);
    attend(make_view(as_const(q).data(), n, h, hd), make_view(as_const(k).data(), n, kv, hd),
           make_view(as_const(v).data(), n, kv, hd), make_view(out.data(), n, h, hd));
    ops::gemm(host{}, make_view(as_const(out).data(), n, h * hd), w.wo, y);
    hook(projection::o, make_view(as_const(out).data(), n, h * hd), y);
    tp::reduce_from_tensor_parallel_forward(tp, std::span<T>(y.data(), static_cast<std::size_t>(y.numel())));
  }

 private:
  // The k and v projections' parameter gradients (weights, then biases when there are).
  std::vector<std::span<T>> kv_grads(std::span<T> grads) const {
    std::vector<std::span<T>> g;
    for (const linear<T>* l : {&wk_, &wv_}) g.emplace_back(l->weight().in(grads).data(), l->weight().numel());
    for (const linear<T>* l : {&wk_, &wv_})
      if (l->bias()) g.emplace_back(l->bias()->in(grads).data(), l->bias()->numel());
    return g;
  }
  std::size_t kv_grad_size() const {
    const std::size_t b = wk_.bias() ? wk_.bias()->numel() : 0;
    return 2 * (wk_.weight().numel() + b);
  }
  // Every rank puts this call's k/v gradients into its head's slot of [KV, m] (m: their
  // elements), the group sums, and each rank adds back its head's total: replicas get the
  // same gradient.
  template <comm::communicator C>
  void sum_kv_replicas(C& tp, std::span<T> grads, std::span<const T> before, workspace<T>& ws) const {
    const std::size_t m = kv_grad_size(), KV = static_cast<std::size_t>(cfg_.n_kv_heads);
    auto all = ws.take_zeroed(KV * m);
    T* mine = all.data() + static_cast<std::size_t>(split_.first_kv_head) * m;
    const auto parts = kv_grads(grads);
    std::size_t at = 0;
    for (std::span<T> g : parts)
      for (std::size_t i = 0; i < g.size(); ++i, ++at) mine[at] = g[i] - before[at];
    tp.all_reduce(std::span<const T>(all.data(), KV * m), all.subspan(0, KV * m), comm::reduce_op::sum);
    at = 0;
    for (std::span<T> g : parts)
      for (std::size_t i = 0; i < g.size(); ++i, ++at) g[i] = before[at] + mine[at];
  }
  // A q/k/v projection's weight (or its bias, if it has one) as the rows [row0, row0 + its
  // rows) of the full `<name>.<tensor>` of full_rows rows.
  static void record_projection(tp::shard_list* shards, const std::string& name, const char* tensor, const linear<T>& l,
                                index_t full_rows, index_t row0, int replica, bool bias) {
    const std::string base = name + "." + tensor;
    if (!bias) tp::record(shards, base + ".weight", l.weight(), full_rows, l.in_features(), row0, 0, replica);
    else if (l.bias()) tp::record(shards, base + ".bias", *l.bias(), full_rows, 1, row0, 0, replica);
  }
  template <comm::communicator C, class D>
  void check(const C& tp, const tensor_view<const T, D, 3>& x, const activations_on<D>& a) const {
    tp::require_one_rank_on<D>(tp, "nn::attention");
    LOOM_CHECK(tp.size() == split_.tp_size, "nn::attention: built for tensor-parallel size ", split_.tp_size,
               ", called on a group of ", tp.size());
    LOOM_CHECK(x.extent(2) == cfg_.dim, "nn::attention: input has ", x.extent(2), " features, expected dim=", cfg_.dim);
    LOOM_CHECK(x.extent(0) == a.batch && x.extent(1) == a.seq, "nn::attention: input is [", x.extent(0), ", ",
               x.extent(1), ", ...] but the activations were made for batch=", a.batch, ", seq=", a.seq);
    LOOM_CHECK(a.seq <= rope_.max_seq(), "nn::attention: seq=", a.seq, " exceeds max_seq=", rope_.max_seq());
  }
  template <class A>  // activations or const activations, on the device of their buffers
  auto q4(A& a) const {
    using D = typename decltype(a.q)::device_type;
    return make_view<D>(a.q.data(), a.batch, a.seq, split_.heads, cfg_.head_dim());
  }
  template <class A, class B>
  auto kv4(A& a, B& kv) const {
    using D = typename std::remove_cvref_t<B>::device_type;
    return make_view<D>(kv.data(), a.batch, a.seq, split_.kv_heads, cfg_.head_dim());
  }

  attention_config cfg_{};
  head_split split_{};
  linear<T> wq_, wk_, wv_, wo_;
  rotary<T> rope_;
};

}  // namespace loom::nn
