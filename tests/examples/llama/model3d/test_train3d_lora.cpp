// LoRA through the mesh trainer (train_options::lora, lora3d.hpp) on the tiny LLaMA and
// ChatGLM. Oracles: central finite differences in double of the decoder's loss for the
// adapters' gradients (the merged-weight path's dA, dB); the merged run (lora_merged) for the
// unmerged one, the trainer's default; the (1,1,1) run for tp 2, dp 2
// ZeRO-3, pp 2 and (2,2,2) meshes (losses and consolidated adapters within 1e-5); the base
// parameters captured before training, bit for bit, for the frozen base; and PyTorch
// (lora_decoder_reference.py: hf_init_reference's HF LLaMA and ChatGLM3 with every adapted
// projection a transcribed PEFT LoRA layer reading loom's PEFT folder) for logits, loss, dA
// and dB.
#include "train3d_suite.hpp"

#include <llama/generate/llama_loader.hpp>
#include <llama/train3d/lora_peft.hpp>

#include <loom/comm/any_comm.hpp>
#include <loom/comm/thread_comm.hpp>

#include <loom/io/safetensors.hpp>

#include <support/error_of.hpp>
#include <support/rel_err.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <unistd.h>
#include <vector>

using loom::comm::any_comm;

namespace {

llama::config lora_tiny_glm() {
  llama::config c = llama::config::chatglm();
  c.dim = 16, c.n_layers = 2, c.n_heads = 4, c.n_kv_heads = 2, c.hidden_dim = 32, c.vocab = 32, c.seq_len = 8;
  return c;
}

loom::lora::config lora_cfg(const llama::config& c) {
  loom::lora::config l;
  l.r = 4, l.lora_alpha = 8;
  l.target_modules = c.model_type == "chatglm"
                         ? std::vector<std::string>{"query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"}
                         : std::vector<std::string>{"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"};
  return l;
}

struct lora_run {
  std::vector<double> losses;
  std::vector<float> adapters;
  bool base_unchanged = true;  // on every rank
};

lora_run lora_train(const llama::config& cfg, loom::comm::mesh_shape mesh, int zero, int n_steps, double dropout = 0,
                    bool checkpointing = false, bool merged = false) {
  auto o = train3d_suite::options(mesh, zero, "1f1b", 4 / mesh.dp);
  o.lora = lora_cfg(cfg);
  o.lora_merged = merged;
  o.lora->lora_dropout = dropout;
  o.checkpointing = checkpointing;
  o.adamw.lr = 1e-2f;
  lora_run out;
  std::vector<int> unchanged(static_cast<std::size_t>(mesh.size()), 0);
  train3d_suite::run_ranks(mesh.size(), [&](any_comm& world) {
    llama3d::trainer<double, double, any_comm> t(world, cfg, o, loom::default_resource<loom::host>());
    const std::vector<double> base0 = t.base_params();
    lora_run r;
    for (int s = 0; s < n_steps; ++s)
      r.losses.push_back(t.step([&](std::int64_t step, int g, std::span<std::int32_t> tok, std::span<std::int32_t> tgt) {
                           llama3d::counting_batch(7, step, g, o.micro_batch_size, o.seq, cfg.vocab, tok, tgt);
                         }).loss);
    r.adapters = t.consolidated_lora();
    const std::vector<double> base1 = t.base_params();
    unchanged[static_cast<std::size_t>(world.rank())] =
        base0.size() == base1.size() && std::memcmp(base0.data(), base1.data(), base0.size() * sizeof(double)) == 0;
    if (world.rank() == 0) out = r;
  });
  for (int u : unchanged) out.base_unchanged = out.base_unchanged && u;
  return out;
}

using lora_model = llama3d::stage_model<double, double, any_comm>;
using lora_adapters = llama3d::stage_lora<double, double>;

// Every adapted weight of m := W0 (frozen) + scaling B A (lp: the adapters' flat buffer).
void lora_merge_all(const lora_adapters& lo, const std::vector<double>& lp, const std::vector<double>& frozen, lora_model& m) {
  for (std::size_t u = 0; u < lo.units(); ++u)
    lo.merge(u, lo.layout().unit(std::span<const double>(lp), u), std::span<const double>(frozen), m.params());
}
// lg += the adapters' gradients from m's weight gradients.
void lora_grads_all(const lora_adapters& lo, any_comm& self, std::vector<double>& lp, std::vector<double>& lg, lora_model& m) {
  loom::nn::workspace<double> ws;
  for (std::size_t u = 0; u < lo.units(); ++u)
    lo.backward(self, u, lo.layout().unit(std::span<double>(lp), u), lo.layout().unit(std::span<double>(lg), u),
                std::span<const double>(m.grads()), ws);
}

// The oracle of the dropout path: one adapted layer (a part of a fused tensor: its rows of B)
// in dense loops, y = x W^T + s B A (mask * x) and its backward, the mask drawn from the
// public lora_dropout_at / lora::dropout_mask; dA, dB added into a full-layout buffer.
struct naive_lora final : loom::nn::frozen_op<double> {
  const double* w = nullptr;  // W [rows, cols] in the model's buffer
  const float* a = nullptr;   // A [r, cols]
  const float* b = nullptr;   // this layer's rows of B [rows, r]
  double *da = nullptr, *db = nullptr;
  loom::index_t rows = 0, cols = 0, r = 0;
  double s = 1, p = 0;
  std::string name;
  std::uint64_t seed = 0;
  std::int64_t step = 0, first_token = 0;

  std::vector<double> mask(loom::index_t n) const {
    std::vector<double> m(static_cast<std::size_t>(n * cols));
    loom::lora::dropout_mask(llama3d::lora_dropout_at(p, seed, step, name, first_token, cols), 0, cols,
                             loom::make_view(m.data(), n, cols));
    return m;
  }
  // h [n, r] = (mask * x) A^T
  std::vector<double> h_of(loom::tensor_view<const double, loom::host, 2> x, const std::vector<double>& m) const {
    const loom::index_t n = x.extent(0);
    std::vector<double> h(static_cast<std::size_t>(n * r), 0.0);
    for (loom::index_t i = 0; i < n; ++i)
      for (loom::index_t k = 0; k < r; ++k)
        for (loom::index_t j = 0; j < cols; ++j) h[i * r + k] += double(a[k * cols + j]) * m[i * cols + j] * x(i, j);
    return h;
  }
  void forward(loom::tensor_view<const double, loom::host, 2> x, loom::tensor_view<double, loom::host, 2> y,
               loom::nn::workspace<double>&) const override {
    const loom::index_t n = x.extent(0);
    const auto h = h_of(x, mask(n));
    for (loom::index_t i = 0; i < n; ++i)
      for (loom::index_t o = 0; o < rows; ++o) {
        double base = 0, low = 0;
        for (loom::index_t j = 0; j < cols; ++j) base += x(i, j) * w[o * cols + j];
        for (loom::index_t k = 0; k < r; ++k) low += double(b[o * r + k]) * h[i * r + k];
        y(i, o) = base + s * low;
      }
  }
  void backward(loom::tensor_view<const double, loom::host, 2> x, loom::tensor_view<const double, loom::host, 2> dy,
                loom::tensor_view<double, loom::host, 2> dx, bool accumulate, loom::nn::workspace<double>&) const override {
    const loom::index_t n = x.extent(0);
    const auto m = mask(n);
    const auto h = h_of(x, m);
    std::vector<double> dh(static_cast<std::size_t>(n * r), 0.0);  // s dy B
    for (loom::index_t i = 0; i < n; ++i)
      for (loom::index_t k = 0; k < r; ++k)
        for (loom::index_t o = 0; o < rows; ++o) dh[i * r + k] += s * dy(i, o) * double(b[o * r + k]);
    for (loom::index_t o = 0; o < rows; ++o)
      for (loom::index_t k = 0; k < r; ++k)
        for (loom::index_t i = 0; i < n; ++i) db[o * r + k] += s * dy(i, o) * h[i * r + k];
    for (loom::index_t k = 0; k < r; ++k)
      for (loom::index_t j = 0; j < cols; ++j)
        for (loom::index_t i = 0; i < n; ++i) da[k * cols + j] += dh[i * r + k] * m[i * cols + j] * x(i, j);
    if (dx.empty()) return;
    for (loom::index_t i = 0; i < n; ++i)
      for (loom::index_t j = 0; j < cols; ++j) {
        double v = 0, low = 0;
        for (loom::index_t o = 0; o < rows; ++o) v += dy(i, o) * w[o * cols + j];
        for (loom::index_t k = 0; k < r; ++k) low += dh[i * r + k] * double(a[k * cols + j]);
        dx(i, j) = (accumulate ? dx(i, j) : 0.0) + v + m[i * cols + j] * low;
      }
  }
};

struct dropout_reference {
  double loss = 0;
  std::vector<double> grads;  // in the single-rank adapter layout
};

// The loss and the adapters' mean gradient of step `step` of a run with options o, adapters
// `adapters` (single-rank layout), from the stage model with naive_lora behind every adapted layer.
dropout_reference dropout_reference_step(any_comm& self, const llama::config& cfg, const llama3d::train_options& o,
                                         const std::vector<float>& adapters, std::int64_t step) {
  const auto full = llama3d::lora_full_layout(*o.lora, cfg);
  dropout_reference out;
  out.grads.assign(full.size(), 0.0);
  lora_model m(cfg, self, 0, 1);
  m.init(o.seed);
  std::vector<std::unique_ptr<naive_lora>> ops;
  m.for_each_frozen_linear([&](std::size_t offset, loom::nn::linear<double>& l) {
    for (const auto& e : full.entries()) {
      if (!e.name.ends_with(".lora_A.weight")) continue;
      const std::string name = e.name.substr(0, e.name.size() - std::strlen(".lora_A.weight"));
      const auto& wi = m.layout().find(name + ".weight");
      if (offset < wi.offset || offset >= wi.offset + wi.numel) continue;
      const auto& bi = full.find(name + ".lora_B.weight");
      auto op = std::make_unique<naive_lora>();
      op->rows = l.out_features(), op->cols = l.in_features(), op->r = o.lora->r;
      const auto row0 = static_cast<loom::index_t>((offset - wi.offset) / static_cast<std::size_t>(op->cols));
      op->w = m.params().data() + offset;
      op->a = adapters.data() + e.offset, op->b = adapters.data() + bi.offset + row0 * op->r;
      op->da = out.grads.data() + e.offset, op->db = out.grads.data() + bi.offset + row0 * op->r;
      op->s = o.lora->scaling(), op->p = o.lora->lora_dropout, op->name = name, op->seed = o.seed, op->step = step;
      l.set_frozen(op.get());
      ops.push_back(std::move(op));
    }
  });
  const loom::index_t b = o.micro_batch_size, s = o.seq;
  std::vector<std::int32_t> tok(b * s), tgt(b * s);
  for (int g = 0; g < o.micro_batches; ++g) {
    llama3d::counting_batch(7, step, g, b, s, cfg.vocab, tok, tgt);
    for (auto& op : ops) op->first_token = std::int64_t(g) * b * s;
    m.zero_grad();
    out.loss += m.forward(0, loom::make_view(static_cast<const std::int32_t*>(tok.data()), b, s),
                          loom::make_view(static_cast<const std::int32_t*>(tgt.data()), b, s)) /
                o.micro_batches;
    m.backward(0, 1.0 / o.micro_batches);
    m.release(0);
  }
  return out;
}

void lora_compare(const lora_run& got, const lora_run& want) {
  REQUIRE(got.losses.size() == want.losses.size());
  for (std::size_t i = 0; i < want.losses.size(); ++i) CHECK(std::abs(got.losses[i] - want.losses[i]) < 1e-5 * want.losses[i]);
  REQUIRE(got.adapters.size() == want.adapters.size());
  double e = 0;
  for (std::size_t i = 0; i < want.adapters.size(); ++i) e = std::max(e, double(std::abs(got.adapters[i] - want.adapters[i])));
  CHECK(e < 1e-5);
  CHECK(got.base_unchanged);
}

}  // namespace

TEST_CASE("LoRA gradients (merged-weight path) equal finite differences of the decoder's loss (LLaMA, ChatGLM)") {
  for (const llama::config& cfg : {train3d_suite::tiny(false), lora_tiny_glm()}) {
    CAPTURE(cfg.model_type);
    train3d_suite::run_ranks(1, [&](any_comm& self) {
      lora_model m(cfg, self, 0, 1);
      m.init(5);
      lora_adapters lo(lora_cfg(cfg), cfg, m.layout(), m.shards(), m.layers(), {});
      std::vector<double> lp(lo.layout().size(), 0), lg(lo.layout().size(), 0), frozen(lo.frozen_size());
      lo.init(std::span<double>(lp), 9);
      loom::counter_rng(10).fill_normal(std::span<double>(lp), 0, 0.f, 0.2f);  // a trained B (and A): both nonzero
      lo.capture(m.params(), std::span<double>(frozen));
      const loom::index_t b = 2, s = 8;
      std::vector<std::int32_t> tok(b * s), tgt(b * s);
      llama3d::counting_batch(3, 0, 0, b, s, cfg.vocab, tok, tgt);
      auto loss = [&] {
        lora_merge_all(lo, lp, frozen, m);
        const double l = m.forward(0, loom::make_view(static_cast<const std::int32_t*>(tok.data()), b, s),
                                   loom::make_view(static_cast<const std::int32_t*>(tgt.data()), b, s));
        return l;
      };
      m.zero_grad();
      loss();
      m.backward(0);
      m.release(0);
      lora_grads_all(lo, self, lp, lg, m);
      double worst = 0;
      int checked = 0;
      for (const auto& it : lo.items())
        for (const auto* slot : {&it.ad.a(), &it.ad.b()})
          for (std::size_t k = 0; k < slot->numel(); k += 7) {  // every 7th element of every factor
            const std::size_t at = lo.layout().unit_begin(it.unit) + slot->offset + k;
            const double keep = lp[at], h = 1e-5;
            lp[at] = keep + h;
            const double up = loss();
            m.release(0);
            lp[at] = keep - h;
            const double down = loss();
            m.release(0);
            lp[at] = keep;
            const double fd = (up - down) / (2 * h);
            worst = std::max(worst, std::abs(fd - lg[at]) / std::max(1e-3, std::abs(fd)));
            ++checked;
          }
      CHECK(checked > 100);
      CHECK(worst < 1e-4);
    });
  }
}

// What an unmerged LoRA run's model is (train3d.hpp: a quantised base, or dropout): the last
// of two pipeline stages (a block, the final norm, the output head; tied: its copy of the
// embedding) with no gradient buffer against the same stage with one: the same loss and the
// same gradient of its input, bit for bit, and no parameter gradient anywhere.
TEST_CASE("A stage model built without gradients (a frozen base) gives the loss and input gradient of one with them, bit for bit, and holds none") {
  for (const llama::config& cfg : {train3d_suite::tiny(true), lora_tiny_glm()}) {
    CAPTURE(cfg.model_type);
    train3d_suite::run_ranks(1, [&](any_comm& self) {
      lora_model with(cfg, self, 1, 2), without(cfg, self, 1, 2, loom::default_resource<loom::host>(), 1, false, false);
      const loom::index_t b = 2, s = 8, n = b * s;
      std::vector<std::int32_t> tok(n), tgt(n);
      llama3d::counting_batch(3, 0, 0, b, s, cfg.vocab, tok, tgt);
      std::vector<double> x(static_cast<std::size_t>(n * cfg.dim));
      for (std::size_t i = 0; i < x.size(); ++i) x[i] = 0.5 * std::sin(0.37 * double(i) + 1.0);
      const auto pass = [&](lora_model& m, std::vector<double>& din) {
        m.init(5);
        for (auto& v : m.params()) v += 0.01;  // norms off 1, biases off 0: every term of dx in play
        std::ranges::copy(x, m.input(0, b, s).begin());
        const double loss = m.forward(0, loom::make_view(static_cast<const std::int32_t*>(tok.data()), b, s),
                                      loom::make_view(static_cast<const std::int32_t*>(tgt.data()), b, s));
        m.backward(0);
        din.assign(m.input_grad(0).begin(), m.input_grad(0).end());
        m.release(0);
        return loss;
      };
      std::vector<double> din_with, din_without;
      const double loss_with = pass(with, din_with), loss_without = pass(without, din_without);
      CHECK(loss_without == loss_with);
      CHECK(din_without == din_with);
      CHECK(std::ranges::any_of(din_with, [](double g) { return g != 0.0; }));
      CHECK(std::ranges::any_of(with.grads(), [](double g) { return g != 0.0; }));  // the oracle did compute weight gradients
      CHECK(without.grads().empty());
      CHECK(without.tied_grad().empty());
      CHECK((!cfg.tied_output || with.tied_grad().size() > 0));
    });
  }
}

TEST_CASE("LoRA on a frozen base: the unmerged run equals the merged one (lora_merged); tp 2, dp 2 ZeRO-3, pp 2 and (2,2,2) reproduce the (1,1,1) run; the base is unchanged bit for bit") {
  for (const llama::config& cfg : {train3d_suite::tiny(false), lora_tiny_glm()}) {
    CAPTURE(cfg.model_type);
    const int n = 6;
    const lora_run ref = lora_train(cfg, {1, 1, 1}, 0, n);
    CHECK(ref.base_unchanged);
    // the merged path (W0 + s B A written into the weights, dA and dB from the weights' G):
    // the same run by other arithmetic, on one rank and on (2,2,1) ZeRO-2
    const lora_run merged = lora_train(cfg, {1, 1, 1}, 0, n, 0, false, true);
    CHECK(merged.base_unchanged);
    lora_compare(merged, ref);
    lora_compare(lora_train(cfg, {2, 2, 1}, 2, n, 0, false, true), ref);
    CHECK(ref.losses.back() < ref.losses.front());  // the adapters learn
    double b_norm = 0;  // B left zero, init's value: trained
    const auto full = llama3d::lora_full_layout(lora_cfg(cfg), cfg);
    for (const auto& e : full.entries())
      if (e.name.ends_with(".lora_B.weight"))
        for (std::size_t i = 0; i < e.numel; ++i) b_norm += std::abs(ref.adapters[e.offset + i]);
    CHECK(b_norm > 1e-3);
    for (const auto& [mesh, zero] : {std::pair{loom::comm::mesh_shape{1, 2, 1}, 1}, {loom::comm::mesh_shape{2, 1, 1}, 3},
                                     {loom::comm::mesh_shape{1, 1, 2}, 2}, {loom::comm::mesh_shape{2, 2, 2}, 3}}) {
      CAPTURE(mesh.dp);
      CAPTURE(mesh.tp);
      CAPTURE(mesh.pp);
      CAPTURE(zero);
      lora_compare(lora_train(cfg, mesh, zero, n), ref);
    }
  }
}

TEST_CASE("LoRA dropout in the trainer: loss, dA and dB equal dense loops drawing the mask from lora_dropout_at (LLaMA, ChatGLM; checkpointing)") {
  for (const llama::config& cfg : {train3d_suite::tiny(false), lora_tiny_glm()}) {
    CAPTURE(cfg.model_type);
    auto o = train3d_suite::options({1, 1, 1}, 0, "1f1b", 2);
    o.lora = lora_cfg(cfg);
    o.lora->lora_dropout = 0.3;
    o.adamw.lr = 1e-2f;
    o.checkpointing = true;  // the recompute draws the forward's masks again
    train3d_suite::run_ranks(1, [&](any_comm& world) {
      llama3d::trainer<double, double, any_comm> t(world, cfg, o, loom::default_resource<loom::host>());
      auto data = [&](std::int64_t step, int g, std::span<std::int32_t> tok, std::span<std::int32_t> tgt) {
        llama3d::counting_batch(7, step, g, o.micro_batch_size, o.seq, cfg.vocab, tok, tgt);
      };
      t.step(data);  // B trained away from zero: dA and the LoRA term are not zero
      const std::vector<float> adapters = t.consolidated_lora();
      const double loss = t.step(data).loss;
      const std::span<const double> got = t.engine().accumulation();  // stage 0: the mean gradient, kept after the step
      const dropout_reference want = dropout_reference_step(world, cfg, o, adapters, 1);
      CHECK(std::abs(loss - want.loss) <= 1e-4 * std::abs(want.loss));
      REQUIRE(got.size() >= want.grads.size());
      double worst = 0, norm = 0;
      for (std::size_t i = 0; i < want.grads.size(); ++i)
        worst = std::max(worst, std::abs(got[i] - want.grads[i])), norm = std::max(norm, std::abs(want.grads[i]));
      CHECK(norm > 1e-4);
      CHECK(worst <= 1e-4 * norm);
      // the dropout acted: without it the same adapters give another loss
      auto o0 = o;
      o0.lora->lora_dropout = 0;
      CHECK(std::abs(dropout_reference_step(world, cfg, o0, adapters, 1).loss - want.loss) > 1e-6);
    });
  }
  // the mask: keep rate about 1 - p, kept elements scaled by 1 / (1 - p), a new mask per step and token
  std::vector<double> m0(64 * 32), m1(64 * 32), m2(64 * 32);
  loom::lora::dropout_mask(llama3d::lora_dropout_at(0.25, 3, 0, "layers.0.attention.wq", 0, 32), 0, 32, loom::make_view(m0.data(), 64, 32));
  loom::lora::dropout_mask(llama3d::lora_dropout_at(0.25, 3, 1, "layers.0.attention.wq", 0, 32), 0, 32, loom::make_view(m1.data(), 64, 32));
  loom::lora::dropout_mask(llama3d::lora_dropout_at(0.25, 3, 0, "layers.0.attention.wq", 32, 32), 0, 32, loom::make_view(m2.data(), 32, 32));
  int kept = 0;
  for (double v : m0) {
    CHECK((v == 0.0 || std::abs(v - 1 / 0.75) < 1e-12));
    kept += v != 0.0;
  }
  CHECK(std::abs(kept / double(m0.size()) - 0.75) < 0.05);
  CHECK(m0 != m1);
  CHECK(std::equal(m2.begin(), m2.begin() + 32 * 32, m0.begin() + 32 * 32));  // token 32's row is token 32's row
}

TEST_CASE("LoRA dropout 0.2: tp 2, dp 2 ZeRO-3 and pp 2 with checkpointing reproduce the (1,1,1) run (LLaMA, ChatGLM)") {
  for (const llama::config& cfg : {train3d_suite::tiny(false), lora_tiny_glm()}) {
    CAPTURE(cfg.model_type);
    const int n = 4;
    const lora_run ref = lora_train(cfg, {1, 1, 1}, 0, n, 0.2);
    CHECK(ref.losses.back() < ref.losses.front());
    for (const auto& [mesh, zero] : {std::pair{loom::comm::mesh_shape{1, 2, 1}, 1}, {loom::comm::mesh_shape{2, 1, 1}, 3},
                                     {loom::comm::mesh_shape{1, 1, 2}, 2}}) {
      CAPTURE(mesh.dp);
      CAPTURE(mesh.tp);
      CAPTURE(mesh.pp);
      lora_compare(lora_train(cfg, mesh, zero, n, 0.2, mesh.pp > 1), ref);
    }
  }
}

TEST_CASE("LoRA in the trainer refuses targets the model lacks, a dropout outside [0, 1), r <= 0, naming them") {
  using loom::test::error_of;
  train3d_suite::run_ranks(1, [&](any_comm& world) {
    auto make = [&](const llama::config& cfg, auto edit) {
      auto o = train3d_suite::options({1, 1, 1}, 0, "1f1b", 2);
      o.lora = lora_cfg(cfg);
      edit(*o.lora);
      return error_of([&] { llama3d::trainer<double, double, any_comm> t(world, cfg, o, loom::default_resource<loom::host>()); });
    };
    CHECK(make(lora_tiny_glm(), [](auto& l) { l.target_modules = {"q_proj"}; })
              .find("target module 'q_proj' is not a layer of this chatglm model") != std::string::npos);
    CHECK(make(train3d_suite::tiny(false), [](auto& l) { l.target_modules = {"dense"}; })
              .find("target module 'dense' is not a layer of this llama model") != std::string::npos);
    for (const double p : {-0.1, 1.0, std::nan("")}) {
      CAPTURE(p);
      CHECK(make(train3d_suite::tiny(false), [&](auto& l) { l.lora_dropout = p; }).find("lora_dropout=") != std::string::npos);
    }
    CHECK(make(train3d_suite::tiny(false), [](auto& l) { l.r = 0; }).find("r=0") != std::string::npos);
  });
}

namespace {

// loom's logits, loss and the adapters' gradients (merged path: dA, dB from the merged
// weights' gradients) for `model` (llama: the HF LLaMA with GQA, all seven projections,
// rsLoRA; chatglm: the ChatGLM3 with fused, biased query_key_value and packed dense_h_to_4h,
// its four, plain alpha / r) against lora_decoder_reference.py, PyTorch's unmerged PEFT
// layers reading the PEFT folder loom wrote.
void torch_lora_parity(const std::string& model) {
  namespace fs = std::filesystem;
  const std::string py = LOOM_TORCH_PYTHON;
  if (std::system((py + " -c 'import torch, numpy' 2>/dev/null").c_str()) != 0) {
    MESSAGE("skipped: " << py << " cannot import torch");
    return;
  }
  const bool glm = model == "chatglm";
  const fs::path dir = fs::temp_directory_path() / ("loom_lora_decoder_" + model + "_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  REQUIRE(std::system((py + " " + LOOM_INIT_HF_REFERENCE + " make " + dir.string()).c_str()) == 0);
  // LLaMA half-split: HF's rows as they are; ChatGLM: fused q/k/v and gate/up as HF holds them
  const llama::config cfg = llama::config_from_hf((dir / (glm ? "glm" : "llama")).string());
  REQUIRE(cfg.model_type == (glm ? "chatglm" : "llama"));
  loom::lora::config lc = lora_cfg(cfg);
  if (!glm) lc.lora_alpha = 16, lc.use_rslora = true;
  nlohmann::json expected;
  std::ifstream(dir / (glm ? "glm_batch.json" : "llama_expected.json")) >> expected;
  const loom::index_t b = expected["batch"].get<loom::index_t>(), s = expected["seq"].get<loom::index_t>();
  const auto tokens = expected["tokens"].get<std::vector<std::int32_t>>(), targets = expected["targets"].get<std::vector<std::int32_t>>();
  train3d_suite::run_ranks(1, [&](any_comm& self) {
    lora_model m(cfg, self, 0, 1);
    // Meta's names (the layout's); LLaMA's q/k rows in HF's order
    const auto meta = loom::io::read_safetensors((dir / (glm ? "glm_meta.safetensors" : "llama_meta_half.safetensors")).string());
    for (const auto& e : m.layout().entries()) {
      const auto& t = meta.at(e.name).data;
      REQUIRE(t.size() == e.numel);
      std::copy(t.begin(), t.end(), m.params().begin() + static_cast<std::ptrdiff_t>(e.offset));
    }
    lora_adapters lo(lc, cfg, m.layout(), m.shards(), m.layers(), {});
    std::vector<double> lp(lo.layout().size(), 0), lg(lo.layout().size(), 0), frozen(lo.frozen_size());
    lo.init(std::span<double>(lp), 21);
    std::vector<float> bf(lp.size());  // a trained B: small normal values (float, as the file holds them)
    loom::counter_rng(22).fill_normal(std::span<float>(bf), 0, 0.f, 0.05f);
    loom::io::tensor_map peft;
    for (const auto& e : lo.layout().entries()) {
      if (e.name.ends_with(".lora_B.weight"))
        for (std::size_t i = 0; i < e.numel; ++i) lp[e.offset + i] = bf[e.offset + i];
      for (std::size_t i = 0; i < e.numel; ++i) lp[e.offset + i] = static_cast<float>(lp[e.offset + i]);
      loom::io::named_tensor t{std::vector<std::int64_t>(e.shape.begin(), e.shape.end()), loom::buffer<float>(e.numel)};
      std::copy_n(lp.begin() + static_cast<std::ptrdiff_t>(e.offset), e.numel, t.data.begin());
      peft[llama3d::detail::peft_name_of(cfg, lc, e.name)] = std::move(t);
    }
    loom::lora::save_peft((dir / "peft").string(), lc, peft);
    lo.capture(m.params(), std::span<double>(frozen));
    lora_merge_all(lo, lp, frozen, m);
    m.zero_grad();
    const double loss = m.forward(0, loom::make_view(tokens.data(), b, s), loom::make_view(targets.data(), b, s));
    std::vector<double> logits(m.logits(0).data(), m.logits(0).data() + b * s * cfg.vocab);
    m.backward(0);
    m.release(0);
    lora_grads_all(lo, self, lp, lg, m);
    const std::string out = (dir / "torch.safetensors").string();
    const std::string ref_script = (fs::path(LOOM_INIT_HF_REFERENCE).parent_path() / "lora_decoder_reference.py").string();
    REQUIRE(std::system((py + " " + ref_script + " " + dir.string() + " " + (dir / "peft").string() + " " + out + " " + model)
                            .c_str()) == 0);
    const auto want = loom::io::read_safetensors(out);
    CHECK(std::abs(loss - want.at("loss").data[0]) <= 1e-4 * std::abs(want.at("loss").data[0]));
    REQUIRE(want.at("logits").data.size() == logits.size());
    CHECK(loom::test::rel_err(logits.data(), want.at("logits").data.data(), logits.size()) <= 1e-4);
    int n = 0;
    for (const auto& e : lo.layout().entries()) {
      const std::string name = llama3d::detail::peft_name_of(cfg, lc, e.name);
      INFO("gradient of " << name);
      const auto& g = want.at(name).data;
      REQUIRE(g.size() == e.numel);
      CHECK(loom::test::rel_err(lg.data() + e.offset, g.data(), e.numel) <= 1e-4);
      ++n;
    }
    CHECK(n == 2 * (glm ? 4 : 7) * 2);  // A and B of every target in two layers
  });
  fs::remove_all(dir);
}

}  // namespace

TEST_CASE("LoRA on the HF LLaMA: loom's logits, loss, dA and dB equal PyTorch's transcription of PEFT reading loom's PEFT folder") {
  torch_lora_parity("llama");
}

TEST_CASE("LoRA on the HF ChatGLM3 (fused, biased query_key_value; packed dense_h_to_4h): loom's logits, loss, dA and dB equal PyTorch's transcription of PEFT") {
  torch_lora_parity("chatglm");
}

TEST_CASE("a LoRA run's PEFT folder: exported on (2,2,1) ZeRO-3, imported on (1,1,2) ZeRO-1 and (1,1,1), the same adapters bit for bit; a folder that does not fit is refused") {
  namespace fs = std::filesystem;
  using loom::test::error_of;
  const llama::config cfg = train3d_suite::tiny(false);  // interleaved rotary: q/k B rows are permuted in the file
  const fs::path dir = fs::temp_directory_path() / ("loom_lora_peft3d_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  auto opts = [&](loom::comm::mesh_shape mesh, int zero) {
    auto o = train3d_suite::options(mesh, zero, "1f1b", 2);
    o.lora = lora_cfg(cfg);
    return o;
  };
  std::vector<float> exported;
  train3d_suite::run_ranks(4, [&](any_comm& world) {
    llama3d::trainer<double, double, any_comm> t(world, cfg, opts({2, 2, 1}, 3), loom::default_resource<loom::host>());
    for (int s = 0; s < 3; ++s)
      t.step([&](std::int64_t step, int g, std::span<std::int32_t> tok, std::span<std::int32_t> tgt) {
        llama3d::counting_batch(7, step, g, 2, 8, cfg.vocab, tok, tgt);
      });
    llama3d::export_lora_peft(t, dir.string(), "tiny-llama");
    auto a = t.consolidated_lora();
    if (world.rank() == 0) exported = std::move(a);
  });
  // in the file: PEFT's names, and B of q_proj in HF's half-split row order
  const auto file = loom::lora::load_peft(dir.string());
  CHECK(file.tensors.size() == 2 * 7 * 2);
  const auto full = llama3d::lora_full_layout(lora_cfg(cfg), cfg);
  const auto& qb = full.find("layers.1.attention.wq.lora_B.weight");
  const auto& fq = file.tensors.at("base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight").data;
  const loom::index_t hd = cfg.head_dim(), r = lora_cfg(cfg).r;
  bool permuted = true;
  for (loom::index_t o = 0; o < qb.shape[0]; ++o) {
    const loom::index_t hf = o / hd * hd + (o % 2) * hd / 2 + (o % hd) / 2;
    for (loom::index_t j = 0; j < r; ++j) permuted = permuted && fq[hf * r + j] == exported[qb.offset + o * r + j];
  }
  CHECK(permuted);
  for (const auto& [mesh, zero] : {std::pair{loom::comm::mesh_shape{1, 1, 2}, 1}, {loom::comm::mesh_shape{1, 1, 1}, 0}}) {
    CAPTURE(mesh.pp);
    std::vector<float> got;
    train3d_suite::run_ranks(mesh.size(), [&](any_comm& world) {
      llama3d::trainer<double, double, any_comm> t(world, cfg, opts(mesh, zero), loom::default_resource<loom::host>());
      llama3d::import_lora_peft(t, dir.string());
      auto a = t.consolidated_lora();
      if (world.rank() == 0) got = std::move(a);
    });
    CHECK(got == exported);
  }
  // refused, naming what does not fit: another r; a tensor of another shape
  train3d_suite::run_ranks(1, [&](any_comm& world) {
    auto o = opts({1, 1, 1}, 0);
    o.lora->r = 8;
    llama3d::trainer<double, double, any_comm> t8(world, cfg, o, loom::default_resource<loom::host>());
    CHECK(error_of([&] { llama3d::import_lora_peft(t8, dir.string()); }).find("r=4 lora_alpha=8 use_rslora=0, this run has r=8") !=
          std::string::npos);
    loom::io::tensor_map bad;
    for (const auto& [name, t] : file.tensors) {
      const bool cut = name == "base_model.model.model.layers.0.mlp.up_proj.lora_A.weight";
      loom::io::named_tensor c{cut ? std::vector<std::int64_t>{r, t.shape[1] - 1} : t.shape,
                               loom::buffer<float>(static_cast<std::size_t>(cut ? r * (t.shape[1] - 1) : t.numel()))};
      std::copy_n(t.data.begin(), c.data.size(), c.data.begin());
      bad[name] = std::move(c);
    }
    loom::lora::save_peft((dir / "bad").string(), file.cfg, bad);
    llama3d::trainer<double, double, any_comm> t(world, cfg, opts({1, 1, 1}, 0), loom::default_resource<loom::host>());
    CHECK(error_of([&] { llama3d::import_lora_peft(t, (dir / "bad").string()); })
              .find("tensor 'base_model.model.model.layers.0.mlp.up_proj.lora_A.weight' has shape [4,15]") != std::string::npos);
  });
  fs::remove_all(dir);
}

TEST_CASE("LoRA under ZeRO-2 on dp 2: gradients and optimizer state exist for the adapters only, split over dp") {
  const llama::config cfg = train3d_suite::tiny(false);
  auto o = train3d_suite::options({2, 1, 1}, 2, "1f1b", 2);
  std::vector<loom::zero::state_bytes> full(2), lora(2);
  std::size_t n_lora = 0;
  train3d_suite::run_ranks(2, [&](any_comm& world) {
    llama3d::trainer<double, double, any_comm> base(world, cfg, o, loom::default_resource<loom::host>());
    auto lo = o;
    lo.lora = lora_cfg(cfg);
    llama3d::trainer<double, double, any_comm> t(world, cfg, lo, loom::default_resource<loom::host>());
    full[static_cast<std::size_t>(world.rank())] = base.bytes();
    lora[static_cast<std::size_t>(world.rank())] = t.bytes();
    if (world.rank() == 0) n_lora = t.lora()->layout().size();
  });
  for (int r = 0; r < 2; ++r) {
    CAPTURE(r);
    // the adapters' elements (padded to dp), halved by ZeRO-2: fp32 master + two moments, double gradients
    CHECK(lora[r].optimizer == 3 * sizeof(float) * n_lora / 2);
    CHECK(lora[r].gradients == sizeof(double) * n_lora / 2);
    CHECK(lora[r].optimizer < full[r].optimizer);  // r = 4 on a 16-wide model is a quarter of its width: less, not few
  }
}
