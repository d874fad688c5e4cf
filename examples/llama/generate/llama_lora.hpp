#pragma once
// Several LoRA adapters over one base in one continuous batch (the scheme of S-LoRA and
// punica): every row of a step goes through the base's GEMMs together; then, after each
// projection, the rows of each adapter present in the step are gathered and get
//
//   y[rows] += scaling * (x[rows] A^T) B^T        A: [r, in], B: [out, r]
//
// for the projections that adapter targets. Rows of the base (adapter 0) get nothing.
//
// Why unmerged: a merged adapter (W + scaling B A) needs its own copy of every adapted weight
// and serves one adapter per copy; unmerged, the base is held once and shared by every request,
// and an adapter costs r (in + out) multiply-adds per row and projection. Why gathered rather
// than per sequence: a step's decode rows are one per sequence, interleaved across adapters;
// gathering makes one pair of GEMMs per adapter and projection instead of one per sequence.
//
// A and B are packed once (ops::packed_weight) like the base's weights, so each row's result
// does not depend on which rows share its step: a request gives the same tokens alone as in
// any batch (tests/serve/lora_test.cpp).
//
// Fused tensors (ChatGLM's query_key_value [Q | K | V], dense_h_to_4h [gate | up]): the
// decoder runs their parts as separate projections, so B's rows are cut the same way and A is
// shared by the parts (packed once per part).

#include <llama/train3d/peft_folder.hpp>

#include <loom/core/buffer.hpp>
#include <loom/core/error.hpp>
#include <loom/kv/scheduler.hpp>
#include <loom/nn/projection_hook.hpp>
#include <loom/ops/host/packed_weight.hpp>

#include <algorithm>
#include <array>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace llama {

/// HF's name of projection p (the name target_modules use on a LLaMA).
inline const char* projection_name(loom::nn::projection p) {
  static constexpr std::array<const char*, loom::nn::num_projections> names{"q_proj",    "k_proj",  "v_proj",   "o_proj",
                                                                             "gate_proj", "up_proj", "down_proj"};
  return names[static_cast<std::size_t>(p)];
}

/// One LoRA adapter as the engine serves it: A and B of every adapted projection of every
/// layer, packed for the GEMMs, and its scaling (lora_alpha / r, or / sqrt(r) with rsLoRA).
class served_adapter {
 public:
  struct low_rank {
    loom::ops::packed_weight a, b;  // A [r, in], B [out, r]
  };

  /// The factors of `f` (by loom's names, in the base's row order: llama3d::read_lora_peft)
  /// on a base of config c, served under `name`.
  served_adapter(std::string name, const llama3d::lora_folder& f, const llama::config& c)
      : name_(std::move(name)), cfg_(f.cfg), scaling_(static_cast<float>(f.cfg.scaling())), n_layers_(c.n_layers),
        parts_(static_cast<std::size_t>(c.n_layers * loom::nn::num_projections)) {
    using loom::nn::projection;
    LOOM_CHECK(!name_.empty(), "served_adapter: the adapter's name is empty");
    const index_t r = f.cfg.r, hd = c.head_dim(), q_rows = c.n_heads * hd, kv_rows = c.n_kv_heads * hd, F = c.hidden_dim;
    // The projections a decoder tensor feeds, each as (projection, first row of B, rows).
    auto parts = [&](const std::string& t) -> std::vector<std::tuple<projection, index_t, index_t>> {
      if (t == "attention.wq") return {{projection::q, 0, q_rows}};
      if (t == "attention.wk") return {{projection::k, 0, kv_rows}};
      if (t == "attention.wv") return {{projection::v, 0, kv_rows}};
      if (t == "attention.wqkv") return {{projection::q, 0, q_rows}, {projection::k, q_rows, kv_rows}, {projection::v, q_rows + kv_rows, kv_rows}};
      if (t == "attention.wo") return {{projection::o, 0, c.dim}};
      if (t == "feed_forward.w1") return {{projection::gate, 0, F}};
      if (t == "feed_forward.w3") return {{projection::up, 0, F}};
      if (t == "feed_forward.w13") return {{projection::gate, 0, F}, {projection::up, F, F}};
      if (t == "feed_forward.w2") return {{projection::down, 0, c.dim}};
      LOOM_THROW("served_adapter '", name_, "': no projection of the decoder is called '", t, "'");
    };
    for (const auto& [n, a] : f.tensors) {
      const auto id = llama3d::detail::parse_lora_name(n);
      if (id.factor != 'A') continue;
      const std::string base = n.substr(0, n.size() - std::string(".lora_A.weight").size());
      const auto bit = f.tensors.find(base + ".lora_B.weight");
      LOOM_CHECK(bit != f.tensors.end(), "served_adapter '", name_, "': '", base, ".lora_B.weight' is missing");
      LOOM_CHECK(id.layer >= 0 && id.layer < c.n_layers, "served_adapter '", name_, "': '", n, "' is for layer ", id.layer,
                 ", the base has ", c.n_layers);
      const auto& b = bit->second;
      LOOM_CHECK(!a.empty() && a.size() % static_cast<std::size_t>(r) == 0 && b.size() % static_cast<std::size_t>(r) == 0,
                 "served_adapter '", name_, "': '", base, "' factors of ", a.size(), " and ", b.size(),
                 " elements are not [r, in] and [out, r] with r=", r);
      const auto in = static_cast<index_t>(a.size()) / r, out = static_cast<index_t>(b.size()) / r;
      const auto ps = parts(id.tensor);
      index_t rows = 0;
      for (const auto& [p, row0, m] : ps) rows += m;
      LOOM_CHECK(rows == out, "served_adapter '", name_, "': '", base, ".lora_B.weight' has ", out, " rows, the base's ",
                 id.tensor, " has ", rows);
      for (const auto& [p, row0, m] : ps) {
        auto& slot = parts_[static_cast<std::size_t>(id.layer * loom::nn::num_projections + static_cast<index_t>(p))];
        slot.emplace(low_rank{loom::ops::packed_weight(loom::make_view(a.data(), r, in)),
                              loom::ops::packed_weight(loom::make_view(b.data() + row0 * r, m, r))});
      }
    }
  }
  /// The PEFT folder `dir` read against the base (llama3d::read_lora_peft: an adapter that
  /// does not fit is refused naming the folder and what does not fit), served under `name`.
  static served_adapter from_peft(std::string name, const std::string& dir, const llama::config& c) {
    return served_adapter(std::move(name), llama3d::read_lora_peft(dir, c), c);
  }

  const std::string& name() const noexcept { return name_; }
  const loom::lora::config& config() const noexcept { return cfg_; }
  float scaling() const noexcept { return scaling_; }
  index_t rank() const noexcept { return cfg_.r; }
  index_t layers() const noexcept { return n_layers_; }
  /// A and B of projection p of layer l, or nullptr where the adapter leaves it alone.
  const low_rank* find(std::size_t l, loom::nn::projection p) const {
    const auto& s = parts_[l * loom::nn::num_projections + static_cast<std::size_t>(p)];
    return s ? &*s : nullptr;
  }

 private:
  std::string name_;
  loom::lora::config cfg_;
  float scaling_ = 1.f;
  index_t n_layers_ = 0;
  std::vector<std::optional<low_rank>> parts_;  // [layer * num_projections + projection]
};

/// The rows of one step grouped by adapter, and the low-rank terms they get.
class lora_batch {
 public:
  /// Scratch for up to `tokens` rows of up to `width` features and ranks up to `rank`.
  void reserve(std::int32_t tokens, index_t width, index_t rank) {
    const auto T = static_cast<std::size_t>(tokens);
    x_ = loom::buffer<float>(T * static_cast<std::size_t>(width));
    d_ = loom::buffer<float>(T * static_cast<std::size_t>(width));
    h_ = loom::buffer<float>(T * static_cast<std::size_t>(std::max<index_t>(rank, 1)));
    rows_.reserve(T);
    width_ = width, rank_ = rank;
  }
  /// Groups the rows of `plan` by their sequence's adapter (the base's rows left out).
  void plan(const loom::kv::step_plan& plan) {
    ids_.clear(), rows_.clear(), begin_.clear();
    for (const auto& c : plan.chunks)
      if (c.adapter != 0 && std::find(ids_.begin(), ids_.end(), c.adapter) == ids_.end()) ids_.push_back(c.adapter);
    std::sort(ids_.begin(), ids_.end());
    for (const std::int32_t a : ids_) {
      begin_.push_back(rows_.size());
      for (std::size_t b = 0; b < plan.chunks.size(); ++b)
        if (plan.chunks[b].adapter == a)
          for (index_t r = plan.qo_indptr[b]; r < plan.qo_indptr[b + 1]; ++r) rows_.push_back(r);
    }
    begin_.push_back(rows_.size());
  }
  /// y[rows of a] += scaling_a (x[rows of a] A^T) B^T for each adapter a of the step that
  /// adapts projection p of layer l (adapter a is adapters[a - 1]). x [tokens, in], y [tokens, out].
  void apply(std::span<const served_adapter> adapters, std::size_t l, loom::nn::projection p,
             loom::tensor_view<const float, loom::host, 2> x, loom::tensor_view<float, loom::host, 2> y) {
    using loom::host;
    using loom::make_view;
    for (std::size_t g = 0; g < ids_.size(); ++g) {
      const served_adapter& ad = adapters[static_cast<std::size_t>(ids_[g] - 1)];
      const served_adapter::low_rank* lr = ad.find(l, p);
      if (!lr) continue;
      const auto rows = std::span(rows_).subspan(begin_[g], begin_[g + 1] - begin_[g]);
      const auto n = static_cast<index_t>(rows.size()), in = x.extent(1), out = y.extent(1), r = ad.rank();
      LOOM_CHECK(in <= width_ && out <= width_ && r <= rank_, "lora_batch: a projection of [", out, ", ", in, "] at r=", r,
                 " exceeds the scratch reserved for width ", width_, " and rank ", rank_);
      for (index_t i = 0; i < n; ++i) std::copy_n(&x(rows[static_cast<std::size_t>(i)], 0), in, x_.data() + i * in);
      loom::ops::gemm(host{}, make_view(static_cast<const float*>(x_.data()), n, in), lr->a, make_view(h_.data(), n, r));
      loom::ops::gemm(host{}, make_view(static_cast<const float*>(h_.data()), n, r), lr->b, make_view(d_.data(), n, out),
                      ad.scaling());
      for (index_t i = 0; i < n; ++i) {
        float* yr = &y(rows[static_cast<std::size_t>(i)], 0);
        const float* dr = d_.data() + i * out;
        for (index_t j = 0; j < out; ++j) yr[j] += dr[j];
      }
    }
  }
  bool empty() const noexcept { return ids_.empty(); }

 private:
  std::vector<std::int32_t> ids_;  // the adapters of this step's rows, ascending
  std::vector<index_t> rows_;      // their rows, grouped by adapter
  std::vector<std::size_t> begin_; // group g's rows: rows_[begin_[g], begin_[g + 1])
  loom::buffer<float> x_, h_, d_;  // [rows, in] gathered inputs, [rows, r], [rows, out] the terms
  index_t width_ = 0, rank_ = 0;
};

}  // namespace llama
