// QLoRA in the mesh trainer: LoRA over a frozen base whose projections are quantised (NF4 as
// bitsandbytes stores it, or bf16) and run unmerged (train_options::lora_base,
// lora3d.hpp's frozen_projection). Oracles: the merged fp32 LoRA path (lora_merged) on one rank whose
// projections were overwritten with the dequantised values the mesh's ranks hold (losses and
// adapters within 1e-4; the update is made linear in the gradient, see qlora_options); the
// closed form nf4_bytes() / 2 bytes per shard for the base's bytes as the trainer's memory
// resource measures them, under ZeRO-3 a 1/dp slice of each shard's bytes plus one block's
// gathered bytes; the engine's accounting (12 bytes of optimizer state and 4 of gradient per
// adapter element, over dp) for the trainable states. The base partitioned over dp (ZeRO-3)
// against the same run with the base kept whole on every rank (the persistence threshold
// above every projection): the same losses and adapters, bit for bit. A run that keeps no
// gradient for its frozen base (every unmerged run: quantised or fp32): each rank's bytes as its
// memory resources count them against the sum of what it holds (the formula above that case),
// the merged fp32 run's with its gradient buffer.
#include "qlora_suite.hpp"

#include <loom/comm/any_comm.hpp>
#include <loom/comm/thread_comm.hpp>
#include <loom/core/memory.hpp>
#include <loom/quant/nf4.hpp>

#include <support/error_of.hpp>

#include <algorithm>
#include <cmath>
#include <map>
#include <mutex>
#include <ranges>
#include <string>
#include <vector>

using loom::comm::any_comm;
using namespace qlora_suite;

namespace {

qlora_result qlora_run(const llama::config& cfg, const llama3d::train_options& o, int n) {
  qlora_result out;
  const auto full = llama3d::full_layout(cfg);
  out.base.assign(full.size(), 0.f);
  out.quantised.assign(full.size(), 0);
  std::mutex mu;
  train3d_suite::run_ranks(o.mesh.size(), [&](any_comm& world) {
    qlora_result r = qlora_rank(world, cfg, o, n, [&](const auto& m, const auto& s, const std::vector<float>& v) {
      const std::lock_guard lock(mu);
      for (loom::index_t i = 0; i < s.rows; ++i)
        for (loom::index_t c = 0; c < s.cols; ++c) {
          const std::size_t at = m.full_offset(s.name) + static_cast<std::size_t>((s.row0 + i) * s.full_cols + s.col0 + c);
          out.base[at] = v[static_cast<std::size_t>(i * s.cols + c)];
          out.quantised[at] = 1;
        }
    });
    if (world.rank() == 0) out.losses = r.losses, out.adapters = std::move(r.adapters), out.eval = r.eval, out.partitioned = r.partitioned;
  });
  return out;
}

// The oracle: one rank, fp32 base merged each step, its projections := q.base.
qlora_result merged_oracle(const llama::config& cfg, const qlora_result& q, int n,
                           const loom::lora::config& adapters = qlora_adapters()) {
  auto o = qlora_options({1, 1, 1}, 0, llama3d::lora_base::fp32);
  o.lora = adapters;
  o.lora_merged = true;
  qlora_result out;
  double moved = 0;
  train3d_suite::run_ranks(1, [&](any_comm& world) {
    qlora_trainer t(world, cfg, o, loom::default_resource<loom::host>());
    auto p = t.model().params();  // one rank: the single-rank layout itself
    REQUIRE(p.size() >= q.base.size());
    for (std::size_t i = 0; i < q.base.size(); ++i)
      if (q.quantised[i]) moved = std::max(moved, double(std::abs(p[i] - q.base[i]))), p[i] = q.base[i];
    set_biases(t);
    t.lora_capture_base();
    qlora_steps(t, cfg, o, n, out.losses);
    out.adapters = t.consolidated_lora();
  });
  CHECK(moved > 0);  // the quantised base is not the fp32 one: the oracle was really given it
  return out;
}

void check_equal(const qlora_result& got, const qlora_result& want) {
  REQUIRE(got.losses.size() == want.losses.size());
  for (std::size_t s = 0; s < want.losses.size(); ++s) {
    CAPTURE(s);
    CHECK(std::abs(got.losses[s] - want.losses[s]) <= 1e-4 * std::max(1.0, std::abs(want.losses[s])));
  }
  REQUIRE(got.adapters.size() == want.adapters.size());
  double worst = 0, b_moved = 0;
  for (std::size_t i = 0; i < want.adapters.size(); ++i) {
    worst = std::max(worst, double(std::abs(got.adapters[i] - want.adapters[i])));
    b_moved = std::max(b_moved, double(std::abs(want.adapters[i])));
  }
  CHECK(worst <= 1e-4);
  CHECK(b_moved > 0);
}

}  // namespace

TEST_CASE("QLoRA: the unmerged NF4 / bf16 path on (1,1,1), (2,2,1) ZeRO-3 and (1,2,2) equals the merged fp32 path over the dequantised base") {
  const llama::config cfg = train3d_suite::tiny(false);
  constexpr int n = 4;
  for (const auto base : {llama3d::lora_base::nf4, llama3d::lora_base::bf16}) {
    for (const auto& mz : std::vector<std::pair<loom::comm::mesh_shape, int>>{{{1, 1, 1}, 0}, {{2, 2, 1}, 3}, {{1, 2, 2}, 1}}) {
      const std::string what = std::string(llama3d::to_string(base)) + " on (" + std::to_string(mz.first.dp) + "," +
                               std::to_string(mz.first.tp) + "," + std::to_string(mz.first.pp) + ")";
      CAPTURE(what);
      const qlora_result q = qlora_run(cfg, qlora_options(mz.first, mz.second, base), n);
      check_equal(q, merged_oracle(cfg, q, n));
    }
  }
}

TEST_CASE("QLoRA on ChatGLM (fused, biased query_key_value; packed dense_h_to_4h): NF4 on (1,1,1) and (2,2,1) ZeRO-3 equals the merged fp32 path") {
  auto glm = llama::config::chatglm();
  glm.dim = 16, glm.n_layers = 2, glm.n_heads = 4, glm.n_kv_heads = 2, glm.hidden_dim = 32, glm.vocab = 32, glm.seq_len = 8;
  REQUIRE(glm.qkv_bias);  // the bias stays in the model's buffer, nonzero here (set_biases)
  auto lc = qlora_adapters();
  lc.target_modules = {"query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"};
  constexpr int n = 4;
  for (const auto& mz : std::vector<std::pair<loom::comm::mesh_shape, int>>{{{1, 1, 1}, 0}, {{2, 2, 1}, 3}}) {
    const std::string what = "(" + std::to_string(mz.first.dp) + "," + std::to_string(mz.first.tp) + ",1)";
    CAPTURE(what);
    auto o = qlora_options(mz.first, mz.second, llama3d::lora_base::nf4);
    o.lora = lc;
    const qlora_result q = qlora_run(glm, o, n);
    check_equal(q, merged_oracle(glm, q, n, lc));
  }
}

TEST_CASE("QLoRA under ZeRO-3: the base partitioned over dp gives the run with the base whole on every rank, bit for bit") {
  const llama::config cfg = train3d_suite::tiny(false);
  constexpr int n = 3;
  struct mesh_case {
    loom::comm::mesh_shape mesh;
    llama3d::lora_base base;
    bool checkpointing;
  };
  for (const auto& mc : std::vector<mesh_case>{{{2, 2, 1}, llama3d::lora_base::nf4, false},
                                               {{4, 1, 1}, llama3d::lora_base::nf4, false},
                                               {{2, 1, 2}, llama3d::lora_base::nf4, true},
                                               {{4, 1, 1}, llama3d::lora_base::bf16, true}}) {
    const std::string what = std::string(llama3d::to_string(mc.base)) + " on (" + std::to_string(mc.mesh.dp) + "," +
                             std::to_string(mc.mesh.tp) + "," + std::to_string(mc.mesh.pp) + ")" +
                             (mc.checkpointing ? " with checkpointing" : "");
    CAPTURE(what);
    auto o = qlora_options(mc.mesh, 3, mc.base);
    o.checkpointing = mc.checkpointing;
    const qlora_result part = qlora_run(cfg, o, n);  // persistence threshold 0: every projection partitioned
    o.stage3.persistence_threshold = std::size_t(1) << 40;  // every projection kept whole on every rank
    const qlora_result whole = qlora_run(cfg, o, n);
    CHECK(part.partitioned > 0);  // the first run really held slices of the base ...
    CHECK(whole.partitioned == 0);  // ... and the second none
    CHECK(part.base == whole.base);
    CHECK(part.losses == whole.losses);
    CHECK(part.eval == whole.eval);
    CHECK(part.adapters == whole.adapters);
  }
}

TEST_CASE("QLoRA under ZeRO-3: a base read in (set_frozen_weight, as init_from_hf does) is re-packed into the partition") {
  const llama::config cfg = train3d_suite::tiny(false);
  constexpr int n = 2;
  auto o = qlora_options({2, 2, 1}, 3, llama3d::lora_base::nf4);
  qlora_result runs[2];  // the base partitioned, then whole on every rank
  for (const int whole : {0, 1}) {
    o.stage3.persistence_threshold = whole ? std::size_t(1) << 40 : 0;
    train3d_suite::run_ranks(o.mesh.size(), [&](any_comm& world) {
      qlora_trainer t(world, cfg, o, loom::default_resource<loom::host>());
      const auto& m = t.model();
      bool same = true;
      for (std::size_t k = 0; k < m.frozen_shards().size(); ++k) {
        const auto& s = m.frozen_shards()[k];
        // new values by the element's index in the full tensor (what an HF folder would give)
        std::vector<float> w(static_cast<std::size_t>(s.rows * s.cols));
        for (loom::index_t r = 0; r < s.rows; ++r)
          for (loom::index_t c = 0; c < s.cols; ++c)
            w[static_cast<std::size_t>(r * s.cols + c)] = 0.05f * std::sin(0.37f * float((s.row0 + r) * s.full_cols + s.col0 + c));
        const auto v = loom::make_view(static_cast<const float*>(w.data()), s.rows, s.cols);
        t.set_frozen_weight(0, k, v);
        // the oracle: the same values quantised by the format's own matrix
        const loom::quant::nf4_matrix q(v, o.nf4);
        std::vector<float> want(w.size());
        q.dequantize(0, s.rows, 0, s.cols, want.data(), s.cols);
        same = same && t.frozen_values(k) == want;
      }
      CHECK(same);
      std::vector<double> losses;
      qlora_steps(t, cfg, o, n, losses);
      auto adapters = t.consolidated_lora();
      if (world.rank() == 0) runs[whole].losses = losses, runs[whole].adapters = std::move(adapters);
    });
  }
  CHECK(runs[0].losses == runs[1].losses);
  CHECK(runs[0].adapters == runs[1].adapters);
}

TEST_CASE("QLoRA memory on dp 4, LoRA r 16 on q_proj and v_proj: the base's bytes as measured = nf4_bytes per shard (ZeRO-2), its 1/dp slices + one block gathered (ZeRO-3); trainable states = formula") {
  const llama::config cfg = train3d_suite::tiny(false);
  const auto full = llama3d::full_layout(cfg);
  const std::size_t projections = projection_numel(full);
  for (const int zero : {2, 3})
    for (const auto base : {llama3d::lora_base::nf4, llama3d::lora_base::bf16}) {
      const std::string what = std::string(llama3d::to_string(base)) + " ZeRO-" + std::to_string(zero);
      CAPTURE(what);
      auto o = qlora_options({4, 1, 1}, zero, base);
      o.lora->r = 16;
      o.lora->target_modules = {"q_proj", "v_proj"};
      o.stage3.prefetch_numel = 0;  // ZeRO-3: the block in use is the only one gathered
      const auto bytes_of = [&](loom::index_t rows, loom::index_t cols) {
        return base == llama3d::lora_base::nf4 ? loom::quant::nf4_bytes(rows, cols, o.nf4) : 2 * static_cast<std::size_t>(rows * cols);
      };
      std::vector<std::size_t> measured(4), expected(4), parts(4), model(4);
      std::vector<loom::zero::state_bytes> states(4);
      std::size_t adapters = 0;
      train3d_suite::run_ranks(4, [&](any_comm& world) {
        const auto r = static_cast<std::size_t>(world.rank());
        qlora_trainer t(world, cfg, o, loom::default_resource<loom::host>());
        measured[r] = t.frozen_base_bytes();
        // ZeRO-2: each shard whole; ZeRO-3: each shard's bytes cut into 4 equal slices (the last
        // padded), and the largest block's slices gathered back (4 slices each)
        std::map<std::string, std::size_t> block_bytes;
        for (std::size_t k = 0; k < t.model().frozen_shards().size(); ++k) {
          const auto& s = t.model().frozen_shards()[k];
          const std::size_t b = bytes_of(s.rows, s.cols), slice = (b + 3) / 4;
          expected[r] += zero == 3 ? slice : b;
          block_bytes[s.name.substr(0, s.name.find('.', 7))] += 4 * slice;
          parts[r] += t.frozen_weight(k).bytes();
        }
        if (zero == 3)
          expected[r] += std::ranges::max(block_bytes | std::views::values);
        model[r] = t.model().size();
        states[r] = t.bytes();
        if (r == 0) adapters = t.lora()->layout().size();
      });
      // the adapters: per layer r (in + out) for q [16, 16] and v [8, 16], each unit padded to dp
      CHECK(adapters >= static_cast<std::size_t>(cfg.n_layers * 16 * (16 + 16 + 16 + 8)));
      CHECK(adapters % 4 == 0);
      std::size_t whole = 0;  // the base's bytes over the whole model (tp = pp = 1: every rank's shards are whole tensors)
      for (const auto& e : full.entries())
        if (is_projection(e.name)) whole += bytes_of(e.shape[0], e.shape[1]);
      for (int r = 0; r < 4; ++r) {
        CAPTURE(r);
        CHECK(measured[r] == expected[r]);
        // the ops hold the whole base (ZeRO-2), none of it (ZeRO-3: the partition does)
        CHECK(parts[r] == (zero == 3 ? 0 : whole));
        if (zero == 3) CHECK(measured[r] < whole);  // a quarter, and one block of the two gathered
        // the model's flat buffer holds the rest of the base only (embedding, norms, output)
        CHECK(model[r] == full.size() - projections);
        if (zero != 3) continue;
        // ZeRO-3 over dp 4: parameters, gradients, fp32 master + two moments, each a quarter
        CHECK(states[r].parameters == sizeof(float) * adapters / 4);
        CHECK(states[r].gradients == sizeof(float) * adapters / 4);
        CHECK(states[r].optimizer == 3 * sizeof(float) * adapters / 4);
      }
      if (zero != 3) continue;
      // a prefetch bucket larger than the model: the live window is capped by the other ranks'
      // slices, so a rank holds no more than the whole base, as a replicated one does
      o.stage3.prefetch_numel = std::size_t(1) << 40;
      std::vector<std::size_t> greedy(4);
      train3d_suite::run_ranks(4, [&](any_comm& world) {
        greedy[static_cast<std::size_t>(world.rank())] = qlora_trainer(world, cfg, o, loom::default_resource<loom::host>()).frozen_base_bytes();
      });
      for (const std::size_t g : greedy) CHECK(g <= whole);
    }
}

// What each rank holds after construction, on dp 4 under ZeRO-1 (parameters and gradients of
// the adapters whole, their optimizer state a quarter) and ZeRO-2 (the gradients a quarter as
// well), P = T = float, n the adapters' padded elements, S the model's flat buffer, b x s a
// micro-batch:
//   4 S                     the model's parameters (the frozen base: the rest outside a quantised one)
//   + 4 S + 4 W0            merged fp32 only: the model's gradient buffer (the adapted weights' G)
//                           and the adapted weights as they were (W0)
//   + 4 n + 4 n + 12 n / 4  ZeRO-1, the engine: parameters, gradients (its accumulation buffer),
//                           fp32 master and two moments of its slice
//   + 4 n + (4 n / 4 + 4 n) + 12 n / 4
//                           ZeRO-2: the gradient shard and the accumulation buffer (which the
//                           merged run takes at its first step: it makes the adapters' gradients
//                           from G then); none of the reduce scheduler's bucket buffers, which
//                           the trainer does not use
//   + 4 n                   unmerged only: the adapters' step copy the frozen ops read
//   + 8 b s                 the micro-batch's tokens and targets
//   + base                  quantised: sum of nf4_bytes (or 2 x elements for bf16) over the projections
// An unmerged run keeps no gradient for the frozen base: 4 S less than the buffer it held before.
TEST_CASE("LoRA run unmerged (QLoRA NF4 / bf16, fp32 with and without dropout) keeps no gradient for the frozen base: each rank's bytes on dp 4 ZeRO-1 and -2 = formula; the merged run holds its gradient buffer") {
  const llama::config cfg = train3d_suite::tiny(false);
  const auto full = llama3d::full_layout(cfg);
  const std::size_t projections = projection_numel(full);
  // the adapters, r 16 on q_proj [dim, dim] and v_proj [kv, dim]: A [r, dim] and B [out, r] each on
  // a 16-element boundary (param_layout's alignment), each block's unit a multiple of 16 (and of dp)
  constexpr std::size_t r = 16;
  const auto aligned = [](std::size_t e) { return (e + 15) / 16 * 16; };
  const auto d = static_cast<std::size_t>(cfg.dim), kv = static_cast<std::size_t>(cfg.n_kv_heads * (cfg.dim / cfg.n_heads));
  const std::size_t n =
      static_cast<std::size_t>(cfg.n_layers) * aligned(aligned(r * d) + aligned(d * r) + aligned(r * d) + aligned(kv * r));
  const std::size_t w0 = static_cast<std::size_t>(cfg.n_layers) * (d * d + kv * d);
  struct mode {
    const char* what;
    llama3d::lora_base base;
    double dropout;
    bool merged;
  };
  for (const int zero : {1, 2})
  for (const mode& md : {mode{"nf4", llama3d::lora_base::nf4, 0.0, false}, mode{"bf16", llama3d::lora_base::bf16, 0.0, false},
                         mode{"fp32", llama3d::lora_base::fp32, 0.0, false},
                         mode{"fp32, dropout 0.1", llama3d::lora_base::fp32, 0.1, false},
                         mode{"fp32 merged", llama3d::lora_base::fp32, 0.0, true}}) {
    const std::string what = std::string(md.what) + ", ZeRO-" + std::to_string(zero);
    CAPTURE(what);
    auto o = qlora_options({4, 1, 1}, zero, md.base);
    o.lora->r = static_cast<loom::index_t>(r);
    o.lora->target_modules = {"q_proj", "v_proj"};
    o.lora->lora_dropout = md.dropout;
    o.lora_merged = md.merged;
    const bool quantised = md.base != llama3d::lora_base::fp32, merged = md.merged;
    std::size_t base = 0;  // tp = pp = 1: every rank's projection shards are the whole tensors
    for (const auto& e : full.entries())
      if (quantised && is_projection(e.name))
        base += md.base == llama3d::lora_base::nf4 ? loom::quant::nf4_bytes(e.shape[0], e.shape[1], o.nf4)
                                                   : 2 * static_cast<std::size_t>(e.shape[0] * e.shape[1]);
    const std::size_t S = quantised ? full.size() - projections : full.size();
    std::vector<std::size_t> measured(4), grads(4), size(4), adapters(4), left(4);
    std::vector<std::string> refused(4);
    train3d_suite::run_ranks(4, [&](any_comm& world) {
      const auto k = static_cast<std::size_t>(world.rank());
      loom::host_memory_resource mr("rank " + std::to_string(k));
      {
        qlora_trainer t(world, cfg, o, mr);
        measured[k] = mr.current_bytes() + t.frozen_base_bytes();
        grads[k] = t.model().grads().size();
        size[k] = t.model().size();
        adapters[k] = t.lora()->layout().size();
        std::vector<float> out(full.size());
        refused[k] = loom::test::error_of([&] { t.model().store_grads(std::span<float>(out)); });
      }
      left[k] = mr.current_bytes();
    });
    const std::size_t want = 4 * S + (merged ? 4 * S + 4 * w0 : 0) + 4 * n + (zero == 1 ? 4 * n : 4 * n / 4 + (merged ? 0 : 4 * n)) + 12 * n / 4 + (merged ? 0 : 4 * n) +
                             8 * static_cast<std::size_t>(o.micro_batch_size * o.seq) + base;
    for (std::size_t k = 0; k < 4; ++k) {
      CAPTURE(k);
      CHECK(adapters[k] == n);
      CHECK(size[k] == S);
      CHECK(grads[k] == (merged ? S : 0));  // no gradient buffer unless the adapters are made from G
      CHECK(measured[k] == want);
      CHECK(left[k] == 0);
      if (!merged) CHECK(refused[k].find("keeps no gradients (built with gradients=false)") != std::string::npos);
    }
  }
}

TEST_CASE("QLoRA refuses what a quantised base cannot do, naming the option") {
  const llama::config cfg = train3d_suite::tiny(false);
  train3d_suite::run_ranks(1, [&](any_comm& world) {
    auto o = qlora_options({1, 1, 1}, 0, llama3d::lora_base::nf4);
    o.groups.groups.push_back({"lora", {"*lora_*"}, {}, {}, {}, {}});
    o.groups.phases = {{0.5, {"lora"}}, {1.0, {"lora", "base"}}};
    o.total_steps = 4;
    CHECK(loom::test::error_of([&] { qlora_trainer(world, cfg, o, loom::default_resource<loom::host>()); })
              .find("lora_base=nf4 is frozen and quantised, but progressive_unfreezing trains base tensor") != std::string::npos);
    auto d = qlora_options({1, 1, 1}, 0, llama3d::lora_base::bf16);
    CHECK(loom::test::error_of([&] { llama3d::trainer<double, double, any_comm>(world, cfg, d, loom::default_resource<loom::host>()); })
              .find("lora_base=bf16 dequantises into float GEMMs") != std::string::npos);
    auto b = qlora_options({1, 1, 1}, 0, llama3d::lora_base::nf4);
    b.nf4.block_size = 64;
    CHECK(loom::test::error_of([&] { qlora_trainer(world, cfg, b, loom::default_resource<loom::host>()); }).find("block_size=64") !=
          std::string::npos);
  });
  CHECK(loom::test::error_of([] { llama3d::parse_lora_base("int8"); }).find("lora_base must be fp32, bf16 or nf4, got lora_base='int8'") !=
        std::string::npos);
}
