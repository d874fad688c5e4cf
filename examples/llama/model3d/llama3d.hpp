#pragma once
// The LLaMA decoder, one definition for every mesh: what ONE rank of a (dp, tp, pp) mesh holds
// and runs. The single-rank model (llama::model, model/llama.hpp) is this class at tp = 1,
// pp = 1 on a comm::self_comm; the trainer's mesh ranks run it on their tensor group and
// pipeline stage. There is no second forward to keep in step (design.md section 6).
//
// Layers: nn::attention and nn::swiglu_mlp split their heads / hidden units over the tensor
// group (one all-reduce each in forward and backward), the vocab-parallel embedding and
// output projection split the vocabulary, and this stage holds the layers [first, last) of
// the pipeline split. Parameters carry the single-rank model's names, every shard is
// initialised with the counter-RNG values of the same elements of the full flat buffer, and
// store_params / store_grads write a rank's shards back into the single-rank layout.
//
// ---- Interface -----------------------------------------------------------------------------
//
//   llama3d::stage_model<P, T, C> m(cfg, tp_comm, stage, stages, memory);
//   llama3d::stage_model<P, T, C, loom::cuda> g(ctx, cfg, tp_comm, 0, 1);  // on a GPU: ctx is a
//                                       // loom::nn::device_context<cuda> (one rank's whole model)
//   m.init(seed);                       // element i of the full flat buffer = f(seed, i)
//   m.set_checkpointing(true);          // optional: keep block inputs only, recompute in backward
//   per micro-batch mb (any order a pipeline schedule gives, several in flight):
//     m.forward(mb, tokens, targets)    // [batch, seq]; first stage embeds tokens, the others
//                                       // read m.input(mb) (filled by a recv); last stage
//                                       // returns the micro-batch's mean loss (others 0) and
//                                       // makes the logits' gradient in the same pass
//     m.forward(mb, tokens)             // logits only (last stage: m.logits(mb))
//     m.output(mb)                      // [batch*seq, dim] to send to the next stage
//     m.output_grad(mb)                 // where a recv puts d(loss)/d(output) (non-last stages)
//     m.backward(mb, dloss)             // grads ADDED (accumulate over micro-batches)
//     m.input_grad(mb)                  // d/d(input) to send to the previous stage
//     m.release(mb)                     // after the last use of mb: its activation slot is reused
//   m.params(), m.grads(), m.zero_grad(), m.shards(), m.store_params(full), m.store_grads(full)
//   m.units(), m.forward_units(), m.backward_units(): the pieces ZeRO-3 gathers, in pass order
//   m.set_param_source(src)            // layers read each unit from src (a ZeRO engine) instead
//
// A model built with gradients = false holds no gradient buffer (grads() is empty until
// use_storage gives one): nothing in its flat buffer trains (a frozen base whose adapters keep
// their gradients elsewhere), so backward computes every input gradient and no weight, bias,
// norm or embedding gradient (the layers take an empty gradient span as frozen).
//
// Layers are split over pp stages as evenly as possible (the first L % pp stages get one
// more); the embedding lives on the first stage, the final norm and output projection on the
// last. With tied embeddings and pp > 1 the last stage holds a copy of its vocabulary shard
// of tok_embeddings.weight (replica 1); the trainer sums the two copies' gradients so they
// stay equal. Activation memory is one slot per micro-batch in flight (GPipe: m, 1F1B: at
// most pp - stage), taken at forward and given back by release(); under checkpointing a slot
// keeps the block inputs and one block's activations, recomputed block by block in backward.
//
// Block:  h = x + attention(rmsnorm(x)),  out = h + swiglu_mlp(rmsnorm(h)). Backward updates
// the residual stream's gradient in place (each branch's term is added once the branch that
// reads the old value is done), and every branch writes its own gradient buffers rather
// than zeroing and adding.

#include <llama/model/config.hpp>

#include <loom/comm/communicator.hpp>
#include <loom/core/buffer.hpp>
#include <loom/core/random.hpp>
#include <loom/nn/attention.hpp>
#include <loom/nn/checkpoint.hpp>
#include <loom/nn/context.hpp>
#include <loom/nn/cross_entropy.hpp>
#include <loom/nn/mlp.hpp>
#include <loom/nn/norm.hpp>
#include <loom/nn/parameters.hpp>
#include <loom/nn/tp/cross_entropy.hpp>
#include <loom/nn/tp/embedding.hpp>
#include <loom/nn/tp/linear.hpp>
#include <loom/nn/tp/shard.hpp>
#include <loom/nn/workspace.hpp>
#include <loom/ops/host/fill.hpp>

#include <cmath>
#include <cstdint>
#include <map>
#include <memory>
#include <utility>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

namespace llama3d {

using loom::index_t;
namespace tp = loom::nn::tp;

/// The layers [first, last) of stage `stage` of `stages`, split as evenly as possible.
struct stage_range {
  index_t first = 0, last = 0;
  index_t layers() const noexcept { return last - first; }
};
inline stage_range split_layers(index_t n_layers, int stages, int stage) {
  LOOM_CHECK(stages >= 1, "llama3d: pp must be >= 1, got pp=", stages);
  LOOM_CHECK(n_layers >= stages, "llama3d: n_layers (", n_layers, ") must be >= pp (", stages,
             "): every pipeline stage needs a layer");
  LOOM_CHECK(stage >= 0 && stage < stages, "llama3d: stage ", stage, " outside [0, ", stages, ")");
  const index_t base = n_layers / stages, extra = n_layers % stages;
  const index_t first = stage * base + std::min<index_t>(stage, extra);
  return {first, first + base + (stage < extra ? 1 : 0)};
}

/// Refuses a model that cannot be split over tp with a loom::error naming the value.
inline void check_tensor_split(const llama::config& c, int tp) {
  c.validate();
  LOOM_CHECK(tp >= 1, "llama3d: tp must be >= 1, got tp=", tp);
  LOOM_CHECK(c.n_heads % tp == 0, "llama3d: n_heads (", c.n_heads, ") must be divisible by tp (", tp, ")");
  LOOM_CHECK(c.n_kv_heads % tp == 0 || tp % c.n_kv_heads == 0, "llama3d: n_kv_heads (", c.n_kv_heads,
             ") must be divisible by tp (", tp, ") or divide it (replicated key/value heads)");
  LOOM_CHECK(c.hidden_dim % tp == 0, "llama3d: hidden_dim (", c.hidden_dim, ") must be divisible by tp (", tp, ")");
  LOOM_CHECK(c.vocab % tp == 0, "llama3d: vocab (", c.vocab, ") must be divisible by tp (", tp, ")");
}

template <loom::ops::compute_type T>
struct block {
  loom::nn::rmsnorm<T> attention_norm;
  loom::nn::attention<T> attention;
  loom::nn::rmsnorm<T> ffn_norm;
  loom::nn::swiglu_mlp<T> feed_forward;

  /// Where forward's intermediates live, each [n, dim] (rstd: [n]). xn1 and xn2, rstd1 and
  /// rstd2 may be the same buffers when nothing keeps them; out may be x's buffer (x is last
  /// read before the MLP branch writes out).
  template <class D = loom::host>
  struct buffers_on {
    loom::tensor_view<const T, D, 2> x;
    loom::tensor_view<T, D, 2> xn1;
    loom::tensor_view<T, D, 1> rstd1;
    loom::tensor_view<T, D, 2> h, xn2;
    loom::tensor_view<T, D, 1> rstd2;
    loom::tensor_view<T, D, 2> out;
  };
  using buffers = buffers_on<>;
  /// The block's one data flow, which training (stage_model: the layers' forward keeping
  /// activations) and inference (llama_engine: attention over a paged KV cache, no kept
  /// activations) both run:
  ///   h = x + attention(attention_norm(x)),  out = h + feed_forward(ffn_norm(h))
  /// `attend(xn, y)` and `mlp(xn, y)` are the two branches: each writes y [n, dim] from xn.
  /// On ctx's device (the buffers' too).
  template <class D, class P, class Attend, class Mlp>
  void forward(const loom::nn::device_context<D>& ctx, std::span<P> p, const buffers_on<D>& b, Attend&& attend,
               Mlp&& mlp) const {
    using in2 = loom::tensor_view<const T, D, 2>;
    attention_norm.forward(ctx, p, b.x, b.xn1, b.rstd1);
    attend(in2(b.xn1), b.h);
    add(ctx, b.h, b.x);
    ffn_norm.forward(ctx, p, in2(b.h), b.xn2, b.rstd2);
    mlp(in2(b.xn2), b.out);
    add(ctx, b.out, in2(b.h));
  }
  template <class P, class Attend, class Mlp>
  void forward(std::span<P> p, const buffers& b, Attend&& attend, Mlp&& mlp) const {
    forward(loom::nn::host_context(), p, b, std::forward<Attend>(attend), std::forward<Mlp>(mlp));
  }

 private:
  // y += x, the residual add (both contiguous)
  template <class D>
  static void add(const loom::nn::device_context<D>& ctx, loom::tensor_view<T, D, 2> y, loom::tensor_view<const T, D, 2> x) {
    ctx.add(loom::make_view<D>(y.data(), y.numel()), loom::make_view<D>(x.data(), x.numel()));
  }
};

/// The layers one rank holds, declared into its flat layout in the single-rank model's order
/// (tok_embeddings, layers.{i}.*, norm, output), with each shard's place in the full tensor.
/// The layout is cut into units, the pieces ZeRO-3 gathers one at a time: the embedding
/// (first stage), each block, and the head (last stage: norm, and output unless it is tied to
/// this rank's embedding). Every unit's size is a multiple of `pad_to` (the data-parallel
/// size), so each splits evenly over the data-parallel ranks.
template <loom::ops::compute_type T>
struct stage_layers {
  loom::nn::param_layout layout;
  tp::shard_list shards;                           // local_offset: in the whole flat buffer
  tp::vocab_parallel_embedding<T> tok_embeddings;  // first stage
  std::vector<block<T>> blocks;                    // layers [range.first, range.last)
  loom::nn::rmsnorm<T> norm;                       // last stage
  tp::column_parallel_linear<T> output;            // last stage (tied: over tok_embeddings)
  static constexpr std::size_t none = ~std::size_t{0};
  std::size_t embedding_unit = none, head_unit = none, output_unit = none;  // output_unit: the head, or the embedding when tied on this rank
  std::size_t first_block_unit = 0;
  std::size_t tied_copy_offset = none;  ///< tied, pp > 1: where this rank's copy of its embedding shard starts
  /// frozen_projections: the blocks' attention and MLP projections declared here instead of
  /// in `layout` (a frozen base held elsewhere, e.g. quantised: their slots are never read
  /// from the flat buffer, so it does not hold them); shards' offsets are this layout's.
  loom::nn::param_layout frozen_layout;
  tp::shard_list frozen_shards;

  stage_layers(const llama::config& c, tp::tp_rank t, stage_range range, bool first, bool last, std::size_t pad_to = 1,
               bool frozen_projections = false) {
    auto& L = layout;
    auto* sh = &shards;
    const T eps = T(c.norm_eps);
    // a unit's slots are relative to its start; its shards are moved to whole-buffer offsets
    auto unit = [&](auto&& declare) {
      const std::size_t u = L.begin_unit(pad_to), recorded = shards.size();
      declare();
      for (std::size_t k = recorded; k < shards.size(); ++k) shards[k].local_offset += L.unit_begin(u);
      return u;
    };
    auto replicated = [&](const std::string& name, const loom::nn::param_slot<1>& s) {
      tp::record(sh, name, s, s.shape[0], 1, 0, 0, t.rank);
    };
    if (first)
      embedding_unit = unit([&] { tok_embeddings = tp::vocab_parallel_embedding<T>(L, "tok_embeddings", c.vocab, c.dim, t, sh); });
    const loom::nn::attention_config ac{.dim = c.dim,
                                        .n_heads = c.n_heads,
                                        .n_kv_heads = c.n_kv_heads,
                                        .max_seq = c.seq_len,
                                        .rope_theta = c.rope_theta,
                                        .rope = c.rope,
                                        .qkv_bias = c.qkv_bias,
                                        .fused_qkv = c.fused_qkv,
                                        .rotary_dim = c.rotary_dim()};
    for (index_t l = range.first; l < range.last; ++l) {
      const std::size_t u = unit([&] {
        const std::string pre = "layers." + std::to_string(l) + ".";
        block<T> b;
        b.attention_norm = loom::nn::rmsnorm<T>(L, pre + "attention_norm", c.dim, eps);
        replicated(pre + "attention_norm.weight", b.attention_norm.weight());
        auto& PL = frozen_projections ? frozen_layout : L;
        auto* psh = frozen_projections ? &frozen_shards : sh;
        // a frozen base held outside keeps its q/k/v biases (ChatGLM) in the flat buffer
        b.attention = loom::nn::attention<T>(PL, pre + "attention", ac, t, psh, frozen_projections ? &L : nullptr,
                                             frozen_projections ? sh : nullptr);
        b.ffn_norm = loom::nn::rmsnorm<T>(L, pre + "ffn_norm", c.dim, eps);
        replicated(pre + "ffn_norm.weight", b.ffn_norm.weight());
        b.feed_forward = loom::nn::swiglu_mlp<T>(PL, pre + "feed_forward", c.dim, c.hidden_dim, t, psh, c.fused_gate_up);
        blocks.push_back(std::move(b));
      });
      if (l == range.first) first_block_unit = u;
    }
    if (last) {
      head_unit = unit([&] {
        norm = loom::nn::rmsnorm<T>(L, "norm", c.dim, eps);
        replicated("norm.weight", norm.weight());
        if (!c.tied_output) {
          output = tp::column_parallel_linear<T>(L, "output", c.dim, c.vocab, t, sh);
        } else if (!first) {  // the last stage's copy of its tok_embeddings shard
          output = tp::column_parallel_linear<T>(L, "tok_embeddings", c.dim, c.vocab, t, nullptr);
          tp::record(sh, "tok_embeddings.weight", output.local().weight(), c.vocab, c.dim, output.first_output(), 0, 1);
        }
      });
      if (c.tied_output && first) output = tp::column_parallel_linear<T>(tok_embeddings.weight(), tok_embeddings.first_token());
      output_unit = c.tied_output && first ? embedding_unit : head_unit;
      if (c.tied_output && !first) tied_copy_offset = L.unit_begin(head_unit) + output.local().weight().offset;
    }
  }

  /// The units one forward pass of a micro-batch reads, in order (the head reads norm, then
  /// the output projection, which may live in the embedding's unit).
  std::vector<std::size_t> forward_units() const {
    std::vector<std::size_t> u;
    if (embedding_unit != none) u.push_back(embedding_unit);
    for (std::size_t b = 0; b < blocks.size(); ++b) u.push_back(first_block_unit + b);
    if (head_unit != none) {
      u.push_back(head_unit);
      if (output_unit != head_unit) u.push_back(output_unit);
    }
    return u;
  }
  /// The units one backward pass reads, in order (a checkpointed block recomputes inside its
  /// own unit's turn).
  std::vector<std::size_t> backward_units() const {
    std::vector<std::size_t> u;
    if (head_unit != none) {
      if (output_unit != head_unit) u.push_back(output_unit);
      u.push_back(head_unit);
    }
    for (std::size_t b = blocks.size(); b-- > 0;) u.push_back(first_block_unit + b);
    return u;  // the embedding's backward reads no parameter
  }
};

/// The single-rank model's flat layout (names, offsets): the one stage of tp = 1, pp = 1.
inline loom::nn::param_layout full_layout(const llama::config& c) {
  c.validate();
  return stage_layers<float>(c, {}, split_layers(c.n_layers, 1, 0), true, true).layout;
}

/// Where a stage model's layers read their parameters when they are not in its own flat
/// buffer: ZeRO-3 gathers a unit on acquire and may drop it on release. Calls come in the
/// order of forward_units() / backward_units() of each pass.
template <class P>
struct param_source {
  virtual ~param_source() = default;
  virtual std::span<P> acquire(std::size_t unit) = 0;
  virtual void release(std::size_t unit) = 0;
};

template <loom::ops::param_type P, loom::ops::compute_type T, loom::comm::communicator C, class D = loom::host>
class stage_model {
  static constexpr bool on_host = std::is_same_v<D, loom::host>;
  template <class E>
  using view2 = loom::tensor_view<E, D, 2>;
  template <class E>
  using buf = loom::buffer<E, D>;

  struct block_acts {
    buf<T> xn1, rstd1;  // [n, dim], [n]: attention_norm(x)
    typename loom::nn::attention<T>::template activations_on<D> attn;
    buf<T> h;           // [n, dim]: x + attention
    buf<T> xn2, rstd2;  // ffn_norm(h)
    typename loom::nn::swiglu_mlp<T>::template activations_on<D> mlp;
  };
  // The loss over the logits: vocab-parallel on the host (any tp); the whole row on a device (tp = 1).
  using loss_type = std::conditional_t<on_host, tp::vocab_parallel_cross_entropy<T>, loom::nn::cross_entropy<T, D>>;
  // Everything one micro-batch in flight keeps between its forward and its backward.
  struct slot {
    index_t batch = 0, seq = 0;
    bool has_targets = false;
    buf<std::int32_t> tokens, targets;  // [n]
    buf<T> resid;                       // [layers + 1, n, dim]: stage input .. output
    loom::nn::block_activations<block_acts> acts;
    buf<T> xf, rstdf, logits, dlogits;  // last stage: [n, dim], [n], [n, vocab/tp] x 2
    std::unique_ptr<loss_type> loss;
    buf<T> dout, din;                   // [n, dim]: gradient of the output / input
  };

 public:
  using param_type = P;
  using compute_type = T;

  /// pad_to: the flat buffers are sized to a multiple of it (the data-parallel size, so ZeRO
  /// cuts them into equal slices).
  /// frozen_projections: the blocks' projections are not in the flat buffers (stage_layers);
  /// a frozen op must back each of them (for_each_frozen_linear) before the first pass.
  /// gradients false: no gradient buffer and no parameter gradient computed (see the file
  /// comment); use_storage may give one later.
  stage_model(const llama::config& c, C& tp_comm, int stage, int stages,
              loom::memory_resource& mr = loom::default_resource<loom::host>(), std::size_t pad_to = 1,
              bool frozen_projections = false, bool gradients = true)
    requires on_host
      : stage_model(loom::nn::host_context(), c, tp_comm, stage, stages, mr, pad_to, frozen_projections, gradients) {}
  /// On ctx's device (loom::nn::device_context; a CUDA one must outlive the model): its flat
  /// buffers, activations and workspace in D's memory (mr), its layers' ops on ctx's stream.
  /// A device other than the host runs one rank's whole model for now (tp = 1, pp = 1).
  stage_model(const loom::nn::device_context<D>& ctx, const llama::config& c, C& tp_comm, int stage, int stages,
              loom::memory_resource& mr = loom::default_resource<D>(), std::size_t pad_to = 1,
              bool frozen_projections = false, bool gradients = true)
      : cfg_((check_tensor_split(c, tp_comm.size()), check_device(tp_comm.size(), stages), c)), ctx_(&ctx), tp_(&tp_comm),
        stage_(stage), stages_(stages), range_(split_layers(c.n_layers, stages, stage)), mr_(&mr),
        layers_(c, tp::tp_rank::of(tp_comm), range_, stage == 0, stage == stages - 1, pad_to, frozen_projections),
        size_((layers_.layout.size() + pad_to - 1) / pad_to * pad_to), params_(size_, mr), grads_(gradients ? size_ : 0, mr),
        ws_(ctx, 0, mr), dresid_(0, mr) {
    const auto full = stages == 1 && tp_comm.size() == 1 && !frozen_projections ? layers_.layout : full_layout(c);
    for (const auto& s : layers_.shards) full_offset_[s.name] = full.find(s.name).offset;
    for (const auto& s : layers_.frozen_shards) full_offset_[s.name] = full.find(s.name).offset;
    ctx_->fill(params_.view(), P(0.f));
    zero_grad();
  }
  stage_model(const stage_model&) = delete;
  stage_model& operator=(const stage_model&) = delete;

  const llama::config& cfg() const noexcept { return cfg_; }
  bool first_stage() const noexcept { return stage_ == 0; }
  bool last_stage() const noexcept { return stage_ == stages_ - 1; }
  stage_range layers() const noexcept { return range_; }
  std::span<P> params() noexcept { return pview_; }
  std::span<const P> params() const noexcept { return pview_; }
  std::span<T> grads() noexcept { return gview_; }
  std::span<const T> grads() const noexcept { return gview_; }
  const loom::nn::param_layout& layout() const noexcept { return layers_.layout; }
  /// Elements of the flat parameter / gradient buffers (layout size padded to pad_to).
  std::size_t size() const noexcept { return size_; }
  const tp::shard_list& shards() const noexcept { return layers_.shards; }
  /// frozen_projections: the projections' layout and shards (offsets in frozen_layout());
  /// empty otherwise.
  const loom::nn::param_layout& frozen_layout() const noexcept { return layers_.frozen_layout; }
  const tp::shard_list& frozen_shards() const noexcept { return layers_.frozen_shards; }
  /// f(offset, layer) for every projection of this stage's blocks, offset: where its weight
  /// starts in frozen_layout() (frozen_projections) or else in layout() (the whole buffer, not
  /// its unit): where a frozen op is put behind each (nn::linear::set_frozen).
  template <class F>
  void for_each_frozen_linear(F&& f) {
    const bool frozen = frozen_layout().size() > 0;
    for (std::size_t k = 0; k < layers_.blocks.size(); ++k) {
      const std::size_t base = frozen ? 0 : layers_.layout.unit_begin(layers_.first_block_unit + k);
      auto g = [&](const char*, loom::nn::linear<T>& l) { f(base + l.weight().offset, l); };
      layers_.blocks[k].attention.for_each_linear(g);
      layers_.blocks[k].feed_forward.for_each_linear(g);
    }
  }
  void zero_grad() { ctx_->fill(loom::make_view<D>(gview_.data(), static_cast<index_t>(gview_.size())), T(0)); }
  /// Parameters and gradients live elsewhere from now on (a ZeRO engine's buffers, in this
  /// model's layout, size() elements each); the model's own buffers are given back. params
  /// may be empty when a param_source provides every unit (ZeRO-3).
  void use_storage(std::span<P> params, std::span<T> grads) {
    LOOM_CHECK((params.empty() || params.size() == size_) && grads.size() == size_, "llama3d::use_storage: buffers of ",
               params.size(), " and ", grads.size(), " elements for a model of size ", size_);
    params_.release(), grads_.release();
    pview_ = params, gview_ = grads;
  }
  /// Where `name` starts in the single-rank flat buffer.
  std::size_t full_offset(const std::string& name) const { return full_offset_.at(name); }
  /// Activation slots allocated so far (the peak number of micro-batches in flight).
  std::size_t slots() const noexcept { return pool_.size(); }
  /// Whether micro-batch mb holds a slot (between its forward and its release).
  bool in_flight(int mb) const { return live_.count(mb) != 0; }

  /// Keep only each block's input and recompute its activations right before its backward
  /// (one activation set per micro-batch instead of one per layer). Only between steps:
  /// with no micro-batch in flight.
  void set_checkpointing(bool on) {
    if (on == checkpoint_) return;
    LOOM_CHECK(live_.empty(), "llama3d::set_checkpointing: ", live_.size(), " micro-batches are in flight");
    checkpoint_ = on;
    pool_.clear(), free_.clear();
  }
  bool checkpointing() const noexcept { return checkpoint_; }

  /// Only the blocks' projections (attention, MLP; their biases too) get gradients from now on:
  /// the embedding, the norms and the output head compute none, and their part of grads()
  /// stays as zero_grad() left it. For a run whose trainable gradients are made from the
  /// projections' alone (merged LoRA: the adapted weights' G). Only between passes.
  void set_projection_grads_only(bool on) noexcept { projection_grads_only_ = on; }

  /// Tied embeddings over pp > 1: the gradient of this rank's copy of tok_embeddings.weight,
  /// which must stay equal to the other end's copy (empty when there is none, or when the
  /// model keeps no gradients).
  std::span<T> tied_grad() {
    if (!cfg_.tied_output || stages_ == 1 || !(first_stage() || last_stage()) || grads().empty()) return {};
    const auto& w = first_stage() ? layers_.tok_embeddings.weight() : layers_.output.local().weight();
    const std::size_t at = first_stage() ? layers_.layout.unit_begin(layers_.embedding_unit) + w.offset : layers_.tied_copy_offset;
    return grads().subspan(at, w.numel());
  }

  /// The units (pieces of the flat buffer that ZeRO-3 gathers one at a time) and the order
  /// in which a micro-batch's forward / backward reads them.
  std::size_t units() const noexcept { return layers_.layout.units(); }
  std::vector<std::size_t> forward_units() const { return layers_.forward_units(); }
  std::vector<std::size_t> backward_units() const { return layers_.backward_units(); }
  /// The unit of this stage's block l (0 <= l < layers().layers()).
  std::size_t unit_of_block(index_t l) const noexcept { return block_unit(l); }
  /// Layers read their parameters from `src` (a ZeRO-3 gatherer) instead of params(); null:
  /// from params() again. Only between passes.
  void set_param_source(param_source<P>* src) {
    LOOM_CHECK(on_host || !src, "llama3d::set_param_source: a parameter source (ZeRO-3) serves a model on the host only, not on ",
               D::name);
    src_ = src;
  }

  /// Weights ~ N(0, std), the two residual projections (wo, w2) N(0, std / sqrt(2 L)), norm
  /// weights 1, biases 0; element i of the full flat buffer depends on (seed, i) only, so every mesh
  /// initialises the same model.
  void init(std::uint64_t seed, float std = 0.02f) {
    std::vector<P> staged(on_host ? 0 : params().size());  // a device's values are made on the host, then copied
    auto p = on_host ? params() : std::span<P>(staged);
    std::fill(p.begin(), p.end(), P(0.f));
    for (const auto& s : layers_.shards) init_shard(s, p.subspan(s.local_offset, static_cast<std::size_t>(s.rows * s.cols)), seed, std);
    if constexpr (!on_host) ctx_->copy_from_host(staged.data(), params().data(), staged.size());
  }
  /// The values init(seed, std) gives the frozen shard s ([s.rows, s.cols], row-major), for a
  /// holder of the projections outside the flat buffer to take them from.
  template <class F>
  void init_shard(const tp::shard_desc& s, std::span<F> dst, std::uint64_t seed, float std = 0.02f) const {
    const loom::counter_rng rng(seed);
    const float resid_std = std / std::sqrt(2.f * float(cfg_.n_layers));
    const bool norm = ends_with(s.name, "norm.weight"), bias = ends_with(s.name, ".bias");
    const bool resid = ends_with(s.name, "attention.wo.weight") || ends_with(s.name, "feed_forward.w2.weight");
    const std::size_t fo = full_offset(s.name);
    for (index_t r = 0; r < s.rows; ++r) {
      auto row = dst.subspan(static_cast<std::size_t>(r * s.cols), static_cast<std::size_t>(s.cols));
      if (norm || bias) std::fill(row.begin(), row.end(), F(norm ? 1.f : 0.f));
      else rng.fill_normal(row, fo + static_cast<std::size_t>((s.row0 + r) * s.full_cols + s.col0), 0.f, resid ? resid_std : std);
    }
  }

  /// This rank's parameters / gradients (canonical copies only) into a single-rank buffer.
  template <class F>
  void store_params(std::span<F> full) const { store(params(), full); }
  template <class F>
  void store_grads(std::span<F> full) const {
    LOOM_CHECK(!grads().empty(), "llama3d::store_grads: this model keeps no gradients (built with gradients=false)");
    store(grads(), full);
  }

  // ---- per micro-batch -------------------------------------------------------------------
  /// [n, dim] input of this stage for mb (a recv fills it; first stage: the embedding).
  std::span<T> input(int mb, index_t batch, index_t seq) {
    return std::span<T>(acquire(mb, batch, seq).resid.data(), nd(batch, seq));
  }
  std::span<T> output(int mb) {
    slot& s = at(mb);
    return std::span<T>(s.resid.data() + static_cast<std::size_t>(range_.layers()) * nd(s.batch, s.seq), nd(s.batch, s.seq));
  }
  std::span<T> output_grad(int mb) { return std::span<T>(at(mb).dout.data(), at(mb).dout.size()); }
  std::span<T> input_grad(int mb) { return std::span<T>(at(mb).din.data(), at(mb).din.size()); }
  /// Last stage: [n, vocab/tp] logits of mb's last forward (this rank's vocabulary columns).
  view2<const T> logits(int mb) {
    LOOM_CHECK(last_stage(), "llama3d::logits: only the last pipeline stage has logits (this is stage ", stage_, ")");
    slot& s = at(mb);
    return s.logits.view(s.batch * s.seq, layers_.output.local_out_features());
  }

  /// Runs this stage for micro-batch mb; the last stage returns its mean loss over targets
  /// != -100 and keeps the logits' gradient for backward.
  T forward(int mb, loom::tensor_view<const std::int32_t, loom::host, 2> tokens,
            loom::tensor_view<const std::int32_t, loom::host, 2> targets) {
    LOOM_CHECK(targets.shape() == tokens.shape() && targets.is_contiguous(), "llama3d::forward: targets are [",
               targets.extent(0), ", ", targets.extent(1), "], tokens are [", tokens.extent(0), ", ", tokens.extent(1),
               "] (both contiguous)");
    slot& sl = run_forward(mb, tokens);
    const index_t n = sl.batch * sl.seq;
    ctx_->copy_from_host(targets.data(), sl.targets.data(), static_cast<std::size_t>(n));
    sl.has_targets = true;
    if (!last_stage()) return T(0);
    const auto dlogits = sl.dlogits.view(n, layers_.output.local_out_features());
    if constexpr (on_host) return sl.loss->forward_backward(*tp_, view2<const T>(logits_of(sl)), ids(sl.targets, n), dlogits);
    else return sl.loss->forward_backward(view2<const T>(logits_of(sl)), ids(sl.targets, n), dlogits);
  }
  /// Logits only (no loss; backward is not available for mb after this).
  void forward(int mb, loom::tensor_view<const std::int32_t, loom::host, 2> tokens) { run_forward(mb, tokens); }

  /// Adds d(dloss * loss)/d(params) for mb; fills input_grad(mb) on non-first stages.
  void backward(int mb, T dloss = T(1)) {
    slot& sl = at(mb);
    LOOM_CHECK(sl.has_targets, "llama3d::backward: micro-batch ", mb,
               " ran forward without targets: call forward(tokens, targets) first");
    const index_t n = sl.batch * sl.seq, d = cfg_.dim;
    if (dresid_.size() != nd_(n, d)) dresid_ = buf<T>(nd_(n, d), *mr_);
    auto dr = dresid_.view(n, d);
    if (last_stage()) {
      ws_.reset();
      auto dxf = ws_.take(nd_(n, d));  // the logits' gradient (made by forward) is d(loss)/d(logits): dloss is the GEMMs' alpha
      unit_use o(*this, layers_.output_unit);
      layers_.output.backward(*tp_, o.params(), outside_projections(unit_grads(layers_.output_unit)), sl.xf.view(n, d),
                              view2<const T>(sl.dlogits.view(n, layers_.output.local_out_features())),
                              loom::make_view<D>(dxf.data(), n, d), ws_, /*accumulate=*/false, dloss);
      ctx_->fill(dresid_.view(), T(0));
      unit_use h = next_use(o, layers_.head_unit);
      layers_.norm.backward(*ctx_, h.params(), outside_projections(unit_grads(layers_.head_unit)),
                            loom::make_view<D>(static_cast<const T*>(dxf.data()), n, d), resid(sl, range_.layers()),
                            sl.rstdf.view(), dr);
    } else {
      ctx_->copy(sl.dout.data(), dresid_.data(), dresid_.size());
    }
    for (index_t l = range_.layers(); l-- > 0;) {
      unit_use u(*this, block_unit(l));
      block_acts& a = sl.acts.for_backward(l, [&](block_acts& s) { run_block(sl, l, s, u.params()); });
      ws_.reset();
      block_backward(sl, l, a, u.params());
    }
    if (first_stage()) {  // reads no parameter: nothing to acquire
      layers_.tok_embeddings.backward(*ctx_, outside_projections(unit_grads(layers_.embedding_unit)), ids(sl.tokens, n),
                                      view2<const T>(dr));
    } else {
      ctx_->copy(dresid_.data(), sl.din.data(), dresid_.size());
    }
  }

  /// mb's activations are no longer needed (after its backward, and after input_grad was sent).
  void release(int mb) {
    auto it = live_.find(mb);
    LOOM_CHECK(it != live_.end(), "llama3d::release: micro-batch ", mb, " is not in flight");
    free_.push_back(it->second);
    live_.erase(it);
  }

 private:
  static bool ends_with(const std::string& s, std::string_view suffix) {
    return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
  }
  static std::size_t nd_(index_t n, index_t d) { return static_cast<std::size_t>(n * d); }
  static int check_device(int tp_size, int stages) {
    LOOM_CHECK(on_host || (tp_size == 1 && stages == 1), "llama3d::stage_model: on ", D::name,
               " a rank runs the whole model for now (tp = 1, pp = 1), got tp=", tp_size, ", pp=", stages);
    return 0;
  }
  std::size_t nd(index_t b, index_t s) const { return nd_(b * s, cfg_.dim); }

  slot& run_forward(int mb, loom::tensor_view<const std::int32_t, loom::host, 2> tokens) {
    const index_t b = tokens.extent(0), s = tokens.extent(1), n = b * s, d = cfg_.dim;
    LOOM_CHECK(b > 0 && s > 0, "llama3d::forward: empty batch [", b, ", ", s, "]");
    LOOM_CHECK(s <= cfg_.seq_len, "llama3d::forward: sequence length ", s, " exceeds config seq_len=", cfg_.seq_len);
    LOOM_CHECK(tokens.is_contiguous(), "llama3d::forward: tokens must be contiguous");
    slot& sl = acquire(mb, b, s);
    sl.has_targets = false;
    ctx_->copy_from_host(tokens.data(), sl.tokens.data(), static_cast<std::size_t>(n));
    if (first_stage()) {
      unit_use u(*this, layers_.embedding_unit);
      layers_.tok_embeddings.forward(*ctx_, *tp_, u.params(), ids(sl.tokens, n), resid(sl, 0));
    }
    for (index_t l = 0; l < range_.layers(); ++l) {
      unit_use u(*this, block_unit(l));
      run_block(sl, l, sl.acts.for_forward(l), u.params());
    }
    if (last_stage()) {
      unit_use h(*this, layers_.head_unit);
      layers_.norm.forward(*ctx_, h.params(), view2<const T>(resid(sl, range_.layers())), sl.xf.view(n, d), sl.rstdf.view());
      unit_use o = next_use(h, layers_.output_unit);
      ws_.reset();
      layers_.output.forward(*tp_, o.params(), sl.xf.view(n, d), logits_of(sl), ws_);
    }
    return sl;
  }

  template <class E, class F>
  void store(std::span<const E> local, std::span<F> full) const {
    std::vector<E> staged(on_host ? 0 : local.size());  // a device's values are read through a host copy
    if constexpr (!on_host) {
      ctx_->copy_to_host(local.data(), staged.data(), staged.size());
      local = staged;
    }
    tp::shard_list canon;
    for (const auto& s : layers_.shards)
      if (s.replica == 0) canon.push_back(s);
    tp::store_shards(canon, local, full, [&](const std::string& n) { return full_offset(n); });
  }

  slot& at(int mb) {
    auto it = live_.find(mb);
    LOOM_CHECK(it != live_.end(), "llama3d: micro-batch ", mb, " has no activations on stage ", stage_,
               " (forward or input() first)");
    return pool_[it->second];
  }
  // The slot of mb, taking (and if needed sizing) a free one when mb is new.
  slot& acquire(int mb, index_t b, index_t s) {
    if (auto it = live_.find(mb); it != live_.end()) {
      LOOM_CHECK(pool_[it->second].batch == b && pool_[it->second].seq == s, "llama3d: micro-batch ", mb,
                 " changed shape");
      return pool_[it->second];
    }
    std::size_t k;
    if (!free_.empty()) k = free_.back(), free_.pop_back();
    else k = pool_.size(), pool_.emplace_back();
    live_[mb] = k;
    slot& sl = pool_[k];
    if (sl.batch != b || sl.seq != s) make_slot(sl, b, s);
    return sl;
  }
  void make_slot(slot& sl, index_t b, index_t s) {
    auto& mr = *mr_;
    const index_t n = b * s, d = cfg_.dim;
    const auto& blk = layers_.blocks.front();
    sl = slot{};
    sl.batch = b, sl.seq = s;
    sl.tokens = buf<std::int32_t>(n, mr);
    sl.targets = buf<std::int32_t>(n, mr);
    sl.resid = buf<T>(static_cast<std::size_t>(range_.layers() + 1) * nd_(n, d), mr);
    sl.acts = loom::nn::block_activations<block_acts>(range_.layers(), checkpoint_, [&] {
      return block_acts{buf<T>(n * d, mr), buf<T>(n, mr), blk.attention.template make_activations<D>(b, s, mr),
                        buf<T>(n * d, mr), buf<T>(n * d, mr), buf<T>(n, mr),
                        blk.feed_forward.template make_activations<D>(n, mr)};
    });
    if (last_stage()) {
      const index_t vl = layers_.output.local_out_features();
      sl.xf = buf<T>(n * d, mr);
      sl.rstdf = buf<T>(n, mr);
      sl.logits = buf<T>(n * vl, mr);
      sl.dlogits = buf<T>(n * vl, mr);
      if constexpr (on_host)
        sl.loss = std::make_unique<loss_type>(cfg_.vocab, layers_.output.first_output(), loom::ops::cross_entropy_options{}, mr);
      else
        sl.loss = std::make_unique<loss_type>(*ctx_);
    } else {
      sl.dout = buf<T>(n * d, mr);
    }
    if (!first_stage()) sl.din = buf<T>(n * d, mr);
  }

  /// Block l of this stage: resid(l) -> resid(l + 1), filling its activations a; p: its unit.
  void run_block(slot& sl, index_t l, block_acts& a, std::span<P> p) {
    const index_t n = sl.batch * sl.seq, d = cfg_.dim, b = sl.batch, s = sl.seq;
    const auto& blk = layers_.blocks[static_cast<std::size_t>(l)];
    ws_.reset();
    blk.forward(*ctx_, p,
                typename block<T>::template buffers_on<D>{resid(sl, l), a.xn1.view(n, d), a.rstd1.view(), a.h.view(n, d),
                                                          a.xn2.view(n, d), a.rstd2.view(), resid(sl, l + 1)},
                [&](auto xn, auto y) {
                  blk.attention.forward(*tp_, p, xn.template reshape<3>({b, s, d}), a.attn, y.template reshape<3>({b, s, d}), ws_);
                },
                [&](auto xn, auto y) { blk.feed_forward.forward(*tp_, p, xn, a.mlp, y, ws_); });
  }

  /// dresid_ holds dL/d(resid(l + 1)) on entry and dL/d(resid(l)) on return, updated in place;
  /// parameter gradients added.
  void block_backward(slot& sl, index_t l, block_acts& a, std::span<P> p) {
    const index_t n = sl.batch * sl.seq, d = cfg_.dim, b = sl.batch, s = sl.seq;
    const auto& blk = layers_.blocks[static_cast<std::size_t>(l)];
    std::span<T> g = unit_grads(block_unit(l));
    auto dr = dresid_.view(n, d);
    // out = h + mlp(ffn_norm(h)):  dh = dout + ffn_norm'(mlp'(dout))
    auto dxn2 = ws_.take(nd_(n, d));  // written by the branch's backward, not added into
    blk.feed_forward.backward(*tp_, p, g, a.xn2.view(n, d), a.mlp, dr, loom::make_view<D>(dxn2.data(), n, d), ws_, false);
    blk.ffn_norm.backward(*ctx_, p, outside_projections(g), loom::make_view<D>(static_cast<const T*>(dxn2.data()), n, d),
                          a.h.view(n, d), a.rstd2.view(), dr);
    // h = x + attention(attention_norm(x)):  dx = dh + attention_norm'(attention'(dh))
    auto dxn1 = ws_.take(nd_(n, d));
    blk.attention.backward(*tp_, p, g, a.xn1.view(b, s, d), a.attn, dresid_.view(b, s, d),
                           loom::make_view<D>(dxn1.data(), b, s, d), ws_, false);
    blk.attention_norm.backward(*ctx_, p, outside_projections(g), loom::make_view<D>(static_cast<const T*>(dxn1.data()), n, d),
                                resid(sl, l), a.rstd1.view(), dr);
  }

  // The parameters of unit u for one use: a piece of params(), or what the source gathered
  // (given back when the use ends).
  class unit_use {
   public:
    unit_use(stage_model& m, std::size_t u)
        : m_(&m), u_(u), p_(m.src_ ? m.src_->acquire(u) : m.layers_.layout.unit(m.params(), u)) {}
    unit_use(unit_use&& o) noexcept : m_(std::exchange(o.m_, nullptr)), u_(o.u_), p_(o.p_) {}
    unit_use(const unit_use&) = delete;
    unit_use& operator=(const unit_use&) = delete;
    unit_use& operator=(unit_use&&) = delete;
    ~unit_use() {
      try {
        done();
      } catch (...) {  // unwinding from a failed pass: the source reports its own state
      }
    }
    std::size_t unit() const noexcept { return u_; }
    std::span<P> params() const noexcept { return p_; }
    void done() {
      if (m_ && m_->src_) m_->src_->release(u_);
      m_ = nullptr;
    }

   private:
    stage_model* m_;
    std::size_t u_;
    std::span<P> p_;
  };
  /// The use of unit u that follows `cur`: cur itself when it is the same unit, else cur ends first.
  unit_use next_use(unit_use& cur, std::size_t u) {
    if (cur.unit() == u) return std::move(cur);
    cur.done();
    return unit_use(*this, u);
  }
  std::size_t block_unit(index_t l) const noexcept { return layers_.first_block_unit + static_cast<std::size_t>(l); }
  // empty when the model keeps no gradients: the layers then compute none
  std::span<T> unit_grads(std::size_t u) { return grads().empty() ? std::span<T>{} : layers_.layout.unit(grads(), u); }
  // g for the layers outside the blocks' projections (embedding, norms, head): empty when only
  // the projections train (set_projection_grads_only)
  std::span<T> outside_projections(std::span<T> g) const noexcept { return projection_grads_only_ ? std::span<T>{} : g; }

  view2<T> resid(slot& sl, index_t l) {
    const index_t n = sl.batch * sl.seq;
    return loom::make_view<D>(sl.resid.data() + l * n * cfg_.dim, n, cfg_.dim);
  }
  view2<T> logits_of(slot& sl) { return sl.logits.view(sl.batch * sl.seq, layers_.output.local_out_features()); }
  static loom::tensor_view<const std::int32_t, D, 1> ids(const buf<std::int32_t>& b, index_t n) {
    return loom::make_view<D>(b.data(), n);
  }

  llama::config cfg_;
  const loom::nn::device_context<D>* ctx_;
  C* tp_;
  int stage_, stages_;
  stage_range range_;
  loom::memory_resource* mr_;
  stage_layers<T> layers_;
  std::size_t size_;
  buf<P> params_;
  buf<T> grads_;
  std::span<P> pview_{params_.data(), params_.size()};  // params_, or the storage use_storage gave (D's memory)
  std::span<T> gview_{grads_.data(), grads_.size()};
  std::map<std::string, std::size_t> full_offset_;
  loom::nn::workspace<T, D> ws_;
  buf<T> dresid_;  // backward: the gradient of the residual stream, from the top block down
  bool checkpoint_ = false;
  bool projection_grads_only_ = false;
  param_source<P>* src_ = nullptr;
  std::vector<slot> pool_;
  std::vector<std::size_t> free_;
  std::map<int, std::size_t> live_;
};

}  // namespace llama3d
