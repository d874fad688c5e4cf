#pragma once
// A LLaMA (Meta's llama 2/3 architecture) on one rank: the decoder of model3d/llama3d.hpp at
// tensor-parallel size 1 and one pipeline stage, on a comm::self_comm, driven one batch at a
// time. One definition of the model serves every mesh (design.md section 6); this class only
// gives the single-rank interface a trainer, a test or a benchmark codes against.
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

#include <llama/model/config.hpp>
#include <llama/model3d/llama3d.hpp>

#include <loom/comm/self_comm.hpp>
#include <loom/core/memory.hpp>
#include <loom/nn/parameters.hpp>

#include <cstdint>
#include <span>

namespace llama {

template <class P = float, loom::ops::compute_type T = float>
class model {
 public:
  using param_type = P;
  using compute_type = T;

  explicit model(const config& c, loom::memory_resource& mr = loom::default_resource<loom::host>())
      : stage_(c, self_, 0, 1, mr) {}

  model(const model&) = delete;
  model& operator=(const model&) = delete;

  const config& cfg() const noexcept { return stage_.cfg(); }
  const loom::nn::param_layout& layout() const noexcept { return stage_.layout(); }
  std::span<P> params() noexcept { return stage_.params(); }
  std::span<const P> params() const noexcept { return stage_.params(); }
  std::span<T> grads() noexcept { return stage_.grads(); }
  std::span<const T> grads() const noexcept { return stage_.grads(); }
  void zero_grad() { stage_.zero_grad(); }
  std::size_t parameter_count() const noexcept { return layout().parameter_count(); }
  double flops_per_token(index_t seq) const noexcept { return cfg().flops_per_token(seq); }
  /// The one-stage model itself (the mesh trainer's type at tp = pp = 1).
  llama3d::stage_model<P, T, loom::comm::self_comm>& stage() noexcept { return stage_; }

  /// Fills the flat parameter buffer from the counter RNG: element i depends on (seed, i) only.
  void init(std::uint64_t seed, float std = 0.02f) { stage_.init(seed, std); }

  /// Recompute each block's activations during backward instead of keeping them.
  void set_checkpointing(bool on) {
    release();
    stage_.set_checkpointing(on);
  }
  bool checkpointing() const noexcept { return stage_.checkpointing(); }

  /// Logits of `tokens` [batch, seq]; no loss (backward is not available after this).
  void forward(loom::tensor_view<const std::int32_t, loom::host, 2> tokens) {
    start(tokens);
    stage_.forward(0, tokens);
  }

  /// Mean cross-entropy of predicting `targets` [batch, seq] (entries -100 are ignored); its
  /// gradient with respect to the logits is made in the same pass over them, for backward.
  T forward(loom::tensor_view<const std::int32_t, loom::host, 2> tokens,
            loom::tensor_view<const std::int32_t, loom::host, 2> targets) {
    start(tokens);
    return stage_.forward(0, tokens, targets);
  }

  /// [batch, seq, vocab] logits of the last forward.
  loom::tensor_view<const T, loom::host, 3> logits() {
    const auto l = stage_.logits(0);
    return {l.data(), loom::extents<3>{batch_, l.extent(0) / batch_, l.extent(1)}};
  }

  /// Adds d(dloss * loss)/d(params) of the last forward into grads().
  void backward(T dloss = T(1)) {
    LOOM_CHECK(stage_.in_flight(0), "llama::model::backward: call forward(tokens, targets) first");
    stage_.backward(0, dloss);
  }

 private:
  // A new batch reuses the previous one's activations (no allocation when its shape is the same).
  void start(loom::tensor_view<const std::int32_t, loom::host, 2> tokens) {
    release();
    batch_ = tokens.extent(0);
  }
  void release() {
    if (stage_.in_flight(0)) stage_.release(0);
  }

  loom::comm::self_comm self_;
  llama3d::stage_model<P, T, loom::comm::self_comm> stage_;
  index_t batch_ = 1;
};

}  // namespace llama
