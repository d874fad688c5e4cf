#pragma once
// LoRA adapters on one stage model of the mesh trainer (loom::lora::adapter per adapted
// projection of every block this rank holds), run unmerged: a frozen_projection (below) behind
// each projection computes y = x W^T + s (dropout(x) A^T) B^T and its backward, adding the
// adapters' gradients into their engine's accumulation buffer; the base's weight gradient only
// where an engine trains the base. The base is the fp32 weights' own slot in the model's flat
// buffer, or quantised (train_options::lora_base bf16 / nf4, QLoRA: dequantised in the GEMMs).
//
// train_options::lora_merged (fp32, no dropout) runs the same adapters as a merged weight:
//
//   before a step's passes   W_eff = W0 + scaling * B A     (W0: the frozen base, kept aside)
//   the passes               the decoder as it is, reading W_eff; its backward gives
//                            G = dL/dW_eff for every weight as it always does
//   after them               dA = scaling * B^T G, dB = scaling * G A^T
//                            (adapter::backward_from_weight_grad; the replicated factor
//                            summed over the tensor group)
//
// y = x W_eff^T is exactly the unmerged x W0^T + scaling * (x A^T) B^T, and the gradients
// above are exactly the unmerged layer's (dL/dB = scaling G A^T, dL/dA = scaling B^T G), by
// other arithmetic: the tests' oracle of the unmerged path. It was the first path, as it needs
// no LoRA branch in the layers; it holds the adapted weights twice (W0 and W_eff) and a
// gradient buffer of the base's size and computes every projection's weight gradient, which
// made it twice the memory and 1.6-1.9x the step time of the unmerged run (docs/benchmarks.md),
// and it cannot express dropout on the LoRA branch alone.
//
// Layout: one unit per block of the stage (the blocks' adapters in the order of the config's
// target modules), each padded to the data-parallel size, so ZeRO's engine partitions and
// gathers the adapters unit by unit as it does the model's blocks. Shards name the full
// tensors `layers.{i}.<tensor>.lora_A.weight` [r, in] / `.lora_B.weight` [out, r], <tensor>
// the base's (attention.wq, feed_forward.w13, ...); B's row rectangles follow the base
// weight's (fused q/k/v and gate/up are split by parts).

#include "../model3d/llama3d.hpp"

#include <loom/lora/adapter.hpp>
#include <loom/lora/config.hpp>
#include <loom/quant/frozen_weight.hpp>
#include <loom/quant/host/gemm.hpp>
#include <loom/quant/nf4.hpp>

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <variant>
#include <vector>

namespace llama3d {

/// How a LoRA run holds its frozen base's projections (train_options::lora_base).
///   fp32: in the model's flat buffer, run unmerged by a frozen_projection over that buffer
///   (or, train_options::lora_merged, the adapters merged into them each step: below);
///   bf16, nf4: outside it, as quant::bf16_matrix / quant::nf4_matrix (QLoRA), each layer run
///   unmerged by a frozen_projection: y = x deq(W)^T + s (x A^T) B^T.
enum class lora_base { fp32, bf16, nf4 };
inline const char* to_string(lora_base b) noexcept { return b == lora_base::fp32 ? "fp32" : b == lora_base::bf16 ? "bf16" : "nf4"; }
inline lora_base parse_lora_base(const std::string& s) {
  if (s == "fp32") return lora_base::fp32;
  if (s == "bf16") return lora_base::bf16;
  if (s == "nf4") return lora_base::nf4;
  LOOM_THROW("lora_base must be fp32, bf16 or nf4, got lora_base='", s, "'");
}

/// The decoder tensor an HF module name adapts, and how tensor parallelism splits it.
struct lora_target {
  std::string tensor;  ///< e.g. "attention.wq"
  loom::lora::split split;
};
/// Refuses a module the model does not have (a LLaMA module on ChatGLM, q_proj on fused q/k/v).
inline lora_target lora_target_of(const llama::config& c, const std::string& m) {
  using loom::lora::split;
  const bool glm = c.model_type == "chatglm";
  if (!glm && !c.fused_qkv && (m == "q_proj" || m == "k_proj" || m == "v_proj"))
    return {std::string("attention.w") + m[0], split::column};
  if (!glm && m == "o_proj") return {"attention.wo", split::row};
  if (!glm && !c.fused_gate_up && m == "gate_proj") return {"feed_forward.w1", split::column};
  if (!glm && !c.fused_gate_up && m == "up_proj") return {"feed_forward.w3", split::column};
  if (!glm && m == "down_proj") return {"feed_forward.w2", split::row};
  if (c.fused_qkv && m == "query_key_value") return {"attention.wqkv", split::column};
  if (glm && m == "dense") return {"attention.wo", split::row};
  if (c.fused_gate_up && m == "dense_h_to_4h") return {"feed_forward.w13", split::column};
  if (glm && m == "dense_4h_to_h") return {"feed_forward.w2", split::row};
  LOOM_THROW("lora: target module '", m, "' is not a layer of this ", c.model_type, " model (fused_qkv=", c.fused_qkv,
             ", fused_gate_up=", c.fused_gate_up, ")");
}

/// A 32-bit FNV-1a of an adapter's name (layers.{i}.<tensor>): its own stretch of the counter
/// RNG for the init of A, its own stream for the dropout masks.
inline std::uint64_t lora_key(const std::string& name) noexcept {
  std::uint64_t key = 2166136261u;
  for (const char ch : name) key = ((key ^ static_cast<unsigned char>(ch)) * 16777619u) & 0xffffffffu;
  return key;
}

/// The dropout of adapter `name` (layers.{i}.<tensor>) at optimizer step `step`, for input rows
/// that are the tokens first_token, first_token + 1, ... of that step's global batch (global
/// micro-batch g, micro-batch of b rows of s tokens: first_token = g * b * s), the adapter's
/// input `in_features` wide (the full tensor's): element (token t, feature j) is kept when the
/// counter RNG (seed, stream (step, name)) draws >= p at t * in_features + j
/// (loom::lora::dropout_mask / dropout_apply; PEFT's nn.Dropout scaling 1 / (1 - p)).
/// Why these keys: a tensor-parallel rank holding columns [c0, c1) of the input draws exactly
/// those columns of the mask, replicas of an input draw the same mask, and neither dp, tp, pp
/// nor the schedule changes any token's mask, so a run's losses do not depend on the mesh; a
/// recompute (activation checkpointing) draws it again. The parts of a fused tensor share it
/// (PEFT's one dropout on the fused layer's input); separate targets (q_proj, k_proj) do not.
inline loom::lora::dropout lora_dropout_at(double p, std::uint64_t seed, std::int64_t step, const std::string& name,
                                           std::int64_t first_token, index_t in_features) {
  LOOM_CHECK(p >= 0.0 && p < 1.0, "lora: lora_dropout must be in [0, 1), got lora_dropout=", p);
  LOOM_CHECK(step >= 0 && first_token >= 0, "lora: dropout at step ", step, ", first token ", first_token, " (both >= 0)");
  return {p, seed, static_cast<std::uint64_t>(first_token) * static_cast<std::uint64_t>(in_features),
          (static_cast<std::uint64_t>(step) << 32) | lora_key(name)};
}

/// The adapters of one stage model (see the file comment).
template <loom::ops::param_type P, loom::ops::compute_type T>
class stage_lora {
 public:
  struct item {
    index_t layer = 0;
    std::string name;  ///< layers.{i}.<tensor>
    loom::lora::adapter<T> ad;
    std::size_t unit = 0;
    std::size_t base_offset = 0;  ///< the base weight's first element in the model's flat buffer
    std::size_t frozen_offset = 0;
    index_t rows = 0, cols = 0;   ///< the base weight's local shape
  };

  /// For the stage model with layout `base`, shards `base_shards` and blocks [range); units
  /// padded to pad_to (the data-parallel size).
  stage_lora(const loom::lora::config& lc, const llama::config& c, const loom::nn::param_layout& base,
             const tp::shard_list& base_shards, stage_range range, tp::tp_rank t, std::size_t pad_to = 1)
      : cfg_((lc.validate(), lc)), scaling_(static_cast<T>(lc.scaling())) {
    std::size_t frozen = 0;
    for (index_t l = range.first; l < range.last; ++l) {
      const std::size_t u = layout_.begin_unit(pad_to);
      for (const std::string& m : lc.target_modules) {
        const lora_target tg = lora_target_of(c, m);
        if ((tg.tensor == "attention.wk" || tg.tensor == "attention.wv" || tg.tensor == "attention.wqkv") && t.size > c.n_kv_heads)
          LOOM_THROW("lora: target module '", m, "' with n_kv_heads (", c.n_kv_heads, ") < tp (", t.size,
                     "): replicated key/value heads are not supported for adapters");
        item it;
        it.layer = l, it.name = "layers." + std::to_string(l) + "." + tg.tensor, it.unit = u;
        const std::string wname = it.name + ".weight";
        const auto& info = base.find(wname);
        it.rows = info.shape[0], it.cols = info.shape[1];
        it.base_offset = info.offset;
        it.frozen_offset = frozen;
        frozen += static_cast<std::size_t>(it.rows * it.cols);
        // full [out, in] of the base weight, from its shards
        index_t full_out = 0, full_in = 0;
        for (const auto& s : base_shards)
          if (s.name == wname) full_out = s.full_rows, full_in = s.full_cols;
        it.ad = loom::lora::adapter<T>(layout_, it.name, full_in, full_out, lc.r, tg.split, t);
        LOOM_CHECK(it.ad.out_features() == it.rows && it.ad.in_features() == it.cols, "lora: ", wname, " is [", it.rows,
                   ", ", it.cols, "] on this rank, the adapter's split gives [", it.ad.out_features(), ", ",
                   it.ad.in_features(), "]");
        record_shards(it, base_shards, wname, t);
        items_.push_back(std::move(it));
      }
    }
    frozen_size_ = frozen;
  }

  const loom::lora::config& config() const noexcept { return cfg_; }
  const loom::nn::param_layout& layout() const noexcept { return layout_; }
  const tp::shard_list& shards() const noexcept { return shards_; }
  const std::vector<item>& items() const noexcept { return items_; }
  std::size_t units() const noexcept { return layout_.units(); }
  std::size_t frozen_size() const noexcept { return frozen_size_; }

  /// A from the counter RNG (kaiming-uniform, at each element's index in the full tensor:
  /// the same adapters on every mesh), B zero; `lora` is this stage's flat buffer.
  void init(std::span<P> lora, std::uint64_t seed) const {
    // each (layer, tensor) its own stretch of the RNG's stream
    for (const item& it : items_) it.ad.init(layout_.unit(lora, it.unit), seed, lora_key(it.name) << 31);
  }
  /// Keeps the adapted base weights of `base` (the model's parameters) aside: the frozen W0.
  void capture(std::span<const P> base, std::span<P> frozen) const {
    for (const item& it : items_)
      std::copy_n(base.begin() + static_cast<std::ptrdiff_t>(it.base_offset), it.rows * it.cols,
                  frozen.begin() + static_cast<std::ptrdiff_t>(it.frozen_offset));
  }
  /// The base weights of unit u's adapters in `base` := W0 + scaling * B A.
  void merge(std::size_t u, std::span<const P> unit_params, std::span<const P> frozen, std::span<P> base) const {
    for (const item& it : items_) {
      if (it.unit != u) continue;
      auto w = base.subspan(it.base_offset, static_cast<std::size_t>(it.rows * it.cols));
      std::copy_n(frozen.begin() + static_cast<std::ptrdiff_t>(it.frozen_offset), w.size(), w.begin());
      it.ad.merge(w, loom::nn::param_slot<2>{0, {it.rows, it.cols}}, unit_params, static_cast<double>(scaling_));
    }
  }
  /// Unit u's adapter gradients (added into unit_grads) from the model's weight gradients.
  template <loom::comm::communicator C>
  void backward(C& tp_comm, std::size_t u, std::span<P> unit_params, std::span<T> unit_grads, std::span<const T> base_grads,
                loom::nn::workspace<T>& ws) const {
    for (const item& it : items_) {
      if (it.unit != u) continue;
      ws.reset();
      it.ad.backward_from_weight_grad(tp_comm, unit_params, unit_grads,
                                      loom::make_view(base_grads.data() + it.base_offset, it.rows, it.cols), ws, scaling_);
    }
  }

 private:
  // A: replicated on a column split (replica = tp rank), split by columns on a row split; B:
  // the base weight's row rectangles (fused tensors: one per part), r columns each.
  void record_shards(const item& it, const tp::shard_list& base_shards, const std::string& wname, tp::tp_rank t) {
    const std::size_t ub = layout_.unit_begin(it.unit);
    const auto& a = it.ad.a();
    const bool column = it.ad.parallel() == loom::lora::split::column;
    shards_.push_back({it.name + ".lora_A.weight", ub + a.offset, a.shape[0], a.shape[1], a.shape[0],
                       column ? a.shape[1] : a.shape[1] * t.size, 0, it.ad.first_input(), column ? t.rank : 0});
    const auto& b = it.ad.b();
    for (const auto& s : base_shards) {
      if (s.name != wname) continue;
      const auto local_row = static_cast<index_t>((s.local_offset - it.base_offset) / static_cast<std::size_t>(it.cols));
      shards_.push_back({it.name + ".lora_B.weight", ub + b.offset + static_cast<std::size_t>(local_row * b.shape[1]), s.rows,
                         b.shape[1], s.full_rows, b.shape[1], s.row0, 0, column ? s.replica : t.rank});
    }
  }

  loom::lora::config cfg_;
  T scaling_;
  loom::nn::param_layout layout_;
  tp::shard_list shards_;
  std::vector<item> items_;
  std::size_t frozen_size_ = 0;
};

/// One projection of a frozen base, and the LoRA adapter on it if it is a target: the
/// nn::frozen_op behind the model's linear layer. The weight is either quantised once from
/// this rank's shard (QLoRA: lora_base bf16 / nf4), its packed bytes held here or, under
/// ZeRO-3, partitioned over dp and read from the block's gathered copy during each use
/// (partitioned_base.hpp); or resident: the fp32 base's own slot in the model's flat buffer
/// (lora_base fp32, unless train_options::lora_merged).
///   forward   y = x W^T + s (u A^T) B^T,            u = dropout(x)
///   backward  dx (+)= dy W + s ((dy B) A) * mask,  dA += s (dy B)^T u,  dB += s dy^T (u A^T),
///             and, resident with a weight gradient wanted (an unfrozen base), dW += dy^T x
/// A quantised W is never whole in fp32: the dequantising GEMMs (quant/host/gemm.hpp) work one
/// tile at a time. The LoRA term is the adapter's partial form (adapter::forward_partial): the
/// decoder's own all-reduces around each column/row pair sum it, and the trainer sums the
/// replicated factor's gradient over the tensor group once per step. The dropout mask is drawn
/// in each pass from the step's context (adapter_state; lora_dropout_at), never kept.
template <loom::ops::param_type P, loom::ops::compute_type T>
class frozen_projection final : public loom::nn::frozen_op<T> {
 public:
  /// Where the attached adapter reads its parameters and adds its gradients during a step:
  /// flat buffers in the stage's adapter layout (the trainer fills `params` before the passes);
  /// and the dropout's context, which the trainer sets before each pass of a micro-batch.
  struct adapter_state {
    const loom::nn::param_layout* layout = nullptr;
    std::span<P> params;
    std::span<T> grads;
    T scaling = T(1);
    double dropout = 0.0;  ///< lora_dropout
    std::uint64_t seed = 0;
    std::int64_t step = 0, first_token = 0;
    bool training = true;  ///< false: evaluation, no dropout (PEFT's eval mode)
  };

  /// A quantised copy of w (bf16 or nf4), held by this op (the base replicated over dp).
  frozen_projection(lora_base kind, loom::tensor_view<const float, loom::host, 2> w, const loom::quant::nf4_options& o,
                    loom::memory_resource& mr)
      : kind_(kind), nf4_(o), mr_(&mr), rows_(w.extent(0)), cols_(w.extent(1)) {
    set_weight(w);
  }
  /// A quantised weight [rows, cols] this op does not hold: its packed bytes are partitioned
  /// over dp (ZeRO-3) and the trainer points the op at them while they are gathered (use_bytes).
  frozen_projection(lora_base kind, index_t rows, index_t cols, const loom::quant::nf4_options& o)
      : kind_(kind), nf4_(o), rows_(rows), cols_(cols) {
    LOOM_CHECK(kind != lora_base::fp32, "llama3d::frozen_projection: lora_base fp32 keeps the base in the model's buffer");
  }
  /// The resident fp32 weight [rows, cols] at `offset` in the model's flat `params`; its
  /// gradient added at the same offset of `grads` (empty: none wanted, the base is frozen).
  /// params empty: the weight is in no resident buffer (a base trained under ZeRO-3: its
  /// engine gathers the weight's unit), and the trainer points the op at the gathered unit for
  /// each use (use_unit).
  frozen_projection(std::span<P> params, std::span<T> grads, std::size_t offset, index_t rows, index_t cols)
      : kind_(lora_base::fp32), rows_(rows), cols_(cols), params_(params), grads_(grads), slot_{offset, {rows, cols}},
        wslot_(slot_) {
    const std::size_t end = offset + static_cast<std::size_t>(rows * cols);
    LOOM_CHECK(params.empty() || end <= params.size(), "llama3d::frozen_projection: [", rows, ", ", cols, "] at ", offset,
               " is past the model's ", params.size(), " parameters");
    LOOM_CHECK(grads.empty() || end <= grads.size(), "llama3d::frozen_projection: [", rows, ", ", cols, "] at ", offset,
               " is past the model's ", grads.size(), " gradients");
  }
  /// A resident fp32 weight read from a gathered unit: its parameters `unit`, which start at
  /// `unit_begin` of the model's layout (the weight must lie inside it); empty: none (between
  /// the uses of the unit).
  void use_unit(std::span<P> unit, std::size_t unit_begin) {
    LOOM_CHECK(kind_ == lora_base::fp32, "llama3d::frozen_projection: use_unit is for an fp32 base, this one is ",
               to_string(kind_));
    if (unit.empty()) {
      params_ = {};
      return;
    }
    LOOM_CHECK(slot_.offset >= unit_begin && slot_.offset - unit_begin + static_cast<std::size_t>(rows_ * cols_) <= unit.size(),
               "llama3d::frozen_projection: the [", rows_, ", ", cols_, "] weight at ", slot_.offset,
               " is not inside the unit at ", unit_begin, " of ", unit.size(), " elements");
    params_ = unit;
    wslot_.offset = slot_.offset - unit_begin;
  }
  /// The packed bytes of a quantised [rows, cols] (quant::nf4_view / bf16_view: what one
  /// all-gather moves when the base is partitioned).
  static std::size_t packed_bytes(lora_base kind, index_t rows, index_t cols, const loom::quant::nf4_options& o) {
    return kind == lora_base::nf4 ? loom::quant::nf4_bytes(rows, cols, o) : static_cast<std::size_t>(rows * cols) * 2;
  }
  /// w quantised (bf16 or nf4) into its packed bytes `out`.
  static void pack(lora_base kind, loom::tensor_view<const float, loom::host, 2> w, const loom::quant::nf4_options& o,
                   std::span<std::uint8_t> out) {
    if (kind == lora_base::nf4) loom::quant::nf4_matrix(w, o).pack(out);
    else loom::quant::bf16_matrix(w).pack(out);
  }
  /// (Re)quantises the weight this op holds from fp32 values (a pretrained base read in).
  void set_weight(loom::tensor_view<const float, loom::host, 2> w) {
    LOOM_CHECK(kind_ != lora_base::fp32 && mr_, "llama3d::frozen_projection: the weight is not held here (lora_base ",
               to_string(kind_), mr_ ? ")" : ", partitioned over dp)");
    LOOM_CHECK(w.extent(0) == rows_ && w.extent(1) == cols_, "llama3d::frozen_projection: a [", w.extent(0), ", ", w.extent(1),
               "] weight for a [", rows_, ", ", cols_, "] projection");
    own_ = loom::buffer<std::uint8_t>(packed_bytes(kind_, rows_, cols_, nf4_), *mr_);
    pack(kind_, w, nf4_, own_.span());
    use_bytes(own_.span());
  }
  /// Reads the weight from packed bytes (its own, or a gathered copy while it is gathered);
  /// empty: none (a partitioned weight between its uses).
  void use_bytes(std::span<const std::uint8_t> packed) {
    if (packed.empty()) w_ = std::monostate{};
    else if (kind_ == lora_base::nf4) w_ = loom::quant::nf4_view(rows_, cols_, nf4_, packed);
    else w_ = loom::quant::bf16_view(rows_, cols_, packed);
  }
  /// Whether this op holds its weight (false: partitioned over dp, or resident fp32).
  bool holds_weight() const noexcept { return !own_.empty(); }
  index_t rows() const noexcept { return rows_; }
  index_t cols() const noexcept { return cols_; }
  /// The adapter `ad` (named `name`, for its dropout's stream) in unit `unit`; b_row0: where
  /// this layer's rows start in ad's B (a part of a fused tensor; 0 otherwise).
  void attach(const loom::lora::adapter<T>* ad, std::size_t unit, const adapter_state* st, std::string name = {},
              index_t b_row0 = 0) {
    ad_ = ad, unit_ = unit, st_ = st, name_ = std::move(name), b_row0_ = b_row0;
  }
  /// Bytes the quantised weight this op holds takes (its memory resource's share; 0 resident
  /// or partitioned).
  std::size_t bytes() const noexcept { return own_.bytes(); }
  /// W dequantised whole (tests): from the bytes it reads now.
  std::vector<float> dequantized() const {
    LOOM_CHECK(kind_ != lora_base::fp32, "llama3d::frozen_projection: a resident fp32 weight is the model's own");
    std::vector<float> out(static_cast<std::size_t>(rows_ * cols_));
    visit_weight([&](const auto& w) { w.dequantize(0, rows_, 0, cols_, out.data(), cols_); });
    return out;
  }

  void forward(loom::tensor_view<const T, loom::host, 2> x, loom::tensor_view<T, loom::host, 2> y,
               loom::nn::workspace<T>& ws) const override {
    if (kind_ == lora_base::fp32) {
      check_resident();
      loom::ops::gemm(loom::host{}, x, loom::nn::weights_as<T>(wslot_, params_, ws).transpose(0, 1), y);
    } else if constexpr (std::is_same_v<T, float>) {
      visit_weight([&](const auto& w) { loom::quant::dequant_gemm_forward(loom::host{}, x, w, y, 0.f); });
    } else {
      LOOM_THROW("llama3d::frozen_projection: a quantised base computes in float, not in ", sizeof(T) * 8, "-bit floats");
    }
    if (ad_) ad_->forward_partial(params(), x, y, ws, st_->scaling, mask_of(), b_row0_);
  }
  void backward(loom::tensor_view<const T, loom::host, 2> x, loom::tensor_view<const T, loom::host, 2> dy,
                loom::tensor_view<T, loom::host, 2> dx, bool accumulate, loom::nn::workspace<T>& ws) const override {
    const T beta = accumulate ? T(1) : T(0);
    if (kind_ == lora_base::fp32) {
      if (!dx.empty()) check_resident(), loom::ops::gemm(loom::host{}, dy, loom::nn::weights_as<T>(wslot_, params_, ws), dx, T(1), beta);
      if (!grads_.empty()) loom::ops::gemm(loom::host{}, dy.transpose(0, 1), x, slot_.in(grads_), T(1), T(1));
    } else if constexpr (std::is_same_v<T, float>) {
      if (!dx.empty())
        visit_weight([&](const auto& w) { loom::quant::dequant_gemm_backward(loom::host{}, dy, w, dx, beta); });
    } else {
      LOOM_THROW("llama3d::frozen_projection: a quantised base computes in float, not in ", sizeof(T) * 8, "-bit floats");
    }
    if (ad_)
      ad_->backward_partial(params(), st_->layout->unit(st_->grads, unit_), x, dy, dx, ws, st_->scaling, mask_of(),
                            b_row0_);
  }

 private:
  // f(view) over the quantised weight's bytes; refused between the uses of a partitioned one
  template <class F>
  void visit_weight(F&& f) const {
    LOOM_CHECK(w_.index() != 0, "llama3d::frozen_projection: the [", rows_, ", ", cols_,
               "] weight is partitioned over dp and not gathered now (a pass outside its block's acquire)");
    if (const auto* n = std::get_if<loom::quant::nf4_view>(&w_)) f(*n);
    else f(std::get<loom::quant::bf16_view>(w_));
  }
  void check_resident() const {
    LOOM_CHECK(!params_.empty(), "llama3d::frozen_projection: the [", rows_, ", ", cols_, "] fp32 weight at ", slot_.offset,
               " is partitioned over dp and not gathered now (a pass outside its unit's acquire)");
  }
  std::span<P> params() const { return st_->layout->unit(st_->params, unit_); }
  loom::lora::dropout mask_of() const {
    if (!st_->training || st_->dropout == 0.0) return {};
    return lora_dropout_at(st_->dropout, st_->seed, st_->step, name_, st_->first_token, ad_->full_in_features());
  }

  lora_base kind_;
  loom::quant::nf4_options nf4_;
  loom::memory_resource* mr_ = nullptr;  // where a weight held here lives (none: partitioned)
  index_t rows_ = 0, cols_ = 0;
  loom::buffer<std::uint8_t> own_;  // the packed weight, when held here
  std::variant<std::monostate, loom::quant::nf4_view, loom::quant::bf16_view> w_;  // what the GEMMs read
  std::span<P> params_;  // resident: the model's parameters (or the gathered unit) and gradients
  std::span<T> grads_;
  loom::nn::param_slot<2> slot_{};   // the weight in the model's flat layout: grads_
  loom::nn::param_slot<2> wslot_{};  // the weight in params_ (slot_, or its place in the gathered unit)
  const loom::lora::adapter<T>* ad_ = nullptr;
  std::size_t unit_ = 0;
  const adapter_state* st_ = nullptr;
  std::string name_;
  index_t b_row0_ = 0;
};

/// The adapters of the single-rank model (tp = 1, pp = 1), and their layout: where each full
/// LoRA tensor lives when a mesh's shards are consolidated (consolidated_lora).
inline stage_lora<float, float> lora_full(const loom::lora::config& lc, const llama::config& c) {
  const stage_layers<float> base(c, {}, split_layers(c.n_layers, 1, 0), true, true);
  return stage_lora<float, float>(lc, c, base.layout, base.shards, split_layers(c.n_layers, 1, 0), {});
}
inline loom::nn::param_layout lora_full_layout(const loom::lora::config& lc, const llama::config& c) {
  return lora_full(lc, c).layout();
}

}  // namespace llama3d
