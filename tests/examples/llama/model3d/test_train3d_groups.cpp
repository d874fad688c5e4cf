// Parameter groups and progressive unfreezing in the mesh trainer (train_options::groups).
// Oracles: optim::trainable_at (tested against its closed form in tests/optim) for which
// tensors may change at each step, compared bit for bit with the consolidated master; the
// closed form of AdamW's first step of a parameter (bias-corrected, weight decay 0: each
// element moves by lr * g / (|g| + eps), so the largest move is lr to within eps) for each
// group's learning rate, its schedule scaling and its own step count; the (1,1,1) run for
// the (2,2,1) ZeRO-3 mesh.
#include "train3d_suite.hpp"

#include <llama/model3d/llama3d.hpp>

#include <loom/optim/param_groups.hpp>

#include <loom/comm/any_comm.hpp>
#include <loom/comm/thread_comm.hpp>

#include <support/error_of.hpp>

#ifdef LOOM_HAS_JSON
#include <llama/train3d/checkpoint.hpp>
#endif

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <string>
#include <vector>

using loom::comm::any_comm;

namespace {

// The seed's recipe on the tiny model: the head first, then the top layer too, then all.
loom::optim::param_groups unfreeze_30_40_30(std::optional<float> head_lr = std::nullopt) {
  loom::optim::param_groups g;
  g.groups.push_back({"head", {"output.weight", "norm.weight"}, {}, {}, head_lr, 0.f});
  g.groups.push_back({"top", {}, -1, {}, {}, {}});
  g.phases = {{0.3, {"head"}}, {0.7, {"head", "top"}}, {1.0, {"head", "top", "base"}}};
  return g;
}

struct groups_run {
  std::vector<double> losses;
  std::vector<std::vector<float>> masters;  // after each step
  std::vector<std::int64_t> group_steps;    // each group's AdamW t at the end (rank 0)
};

using groups_trainer = llama3d::trainer<double, double, any_comm>;

// n_steps of the schedule (steps from the trainer's own count up to `stop`, -1: to the end);
// hook(t, false) after construction, hook(t, true) at the end (a checkpoint's load and save).
groups_run groups_train(loom::comm::mesh_shape mesh, int zero, const loom::optim::param_groups& g, int n_steps,
                        const std::vector<float>& lrs = {}, int stop = -1,
                        const std::function<void(groups_trainer&, bool)>& hook = {}) {
  const auto cfg = train3d_suite::tiny(false);
  auto o = train3d_suite::options(mesh, zero, "1f1b", 4 / mesh.dp);
  o.groups = g;
  o.total_steps = n_steps;
  o.adamw.weight_decay = 0.f;
  o.gradient_clipping = 0.f;
  groups_run out;
  train3d_suite::run_ranks(mesh.size(), [&](any_comm& world) {
    groups_trainer t(world, cfg, o, loom::default_resource<loom::host>());
    if (hook) hook(t, false);
    groups_run r;
    r.masters.push_back(t.consolidated_master());
    for (int s = static_cast<int>(t.steps()); s < (stop < 0 ? n_steps : stop); ++s) {
      if (!lrs.empty()) t.set_lr(lrs[static_cast<std::size_t>(s)]);
      r.losses.push_back(t.step([&](std::int64_t step, int gm, std::span<std::int32_t> tok, std::span<std::int32_t> tgt) {
                           llama3d::counting_batch(7, step, gm, o.micro_batch_size, o.seq, cfg.vocab, tok, tgt);
                         }).loss);
      r.masters.push_back(t.consolidated_master());
    }
    for (std::size_t k = 0; k < t.groups().groups.size(); ++k) r.group_steps.push_back(t.engine().group_steps(k));
    if (hook) hook(t, true);
    if (world.rank() == 0) out = r;
  });
  return out;
}

// Which tensors of the single-rank layout changed from master a to b (name, changed).
std::vector<std::pair<std::string, bool>> changed_tensors(const std::vector<float>& a, const std::vector<float>& b) {
  std::vector<std::pair<std::string, bool>> out;
  const auto layout = llama3d::full_layout(train3d_suite::tiny(false));
  for (const auto& e : layout.entries())
    out.emplace_back(e.name, std::memcmp(a.data() + e.offset, b.data() + e.offset, e.numel * sizeof(float)) != 0);
  return out;
}

// The largest |b - a| over the tensors of group `group` (by the trainer's group_of).
double largest_move(const std::vector<float>& a, const std::vector<float>& b, const loom::optim::param_groups& g,
                    const std::string& group) {
  double m = 0;
  const auto layout = llama3d::full_layout(train3d_suite::tiny(false));
  for (const auto& e : layout.entries()) {
    if (g.groups[loom::optim::group_of(g, e.name, 2)].name != group) continue;
    for (std::size_t i = e.offset; i < e.offset + e.numel; ++i) m = std::max(m, double(std::abs(b[i] - a[i])));
  }
  return m;
}

void check_schedule(const groups_run& r, loom::optim::param_groups g, int n_steps) {
  loom::optim::check(g);
  std::vector<std::int64_t> t(g.groups.size(), 0);
  for (int s = 0; s < n_steps; ++s) {
    const auto on = loom::optim::trainable_at(g, s, n_steps);
    for (std::size_t k = 0; k < on.size(); ++k) t[k] += on[k] ? 1 : 0;
    for (const auto& [name, changed] : changed_tensors(r.masters[static_cast<std::size_t>(s)], r.masters[static_cast<std::size_t>(s) + 1])) {
      const auto k = loom::optim::group_of(g, name, 2);
      INFO("step ", s, " tensor ", name, " group ", g.groups[k].name);
      CHECK(changed == on[k]);  // frozen: bit for bit; trainable: moved
    }
  }
  CHECK(r.group_steps == t);
}

}  // namespace

TEST_CASE("progressive unfreezing: each step changes exactly the groups the schedule says, on (1,1,1) and (2,2,1) ZeRO-3") {
  const auto g = unfreeze_30_40_30(1e-2f);
  const auto one = groups_train({1, 1, 1}, 0, g, 10);
  check_schedule(one, g, 10);
  const auto mesh = groups_train({2, 2, 1}, 3, g, 10);
  check_schedule(mesh, g, 10);
  // the same run on the mesh (losses and every step's master)
  train3d_suite::compare({mesh.losses, mesh.masters.back()}, {one.losses, one.masters.back()});
  for (std::size_t s = 0; s < one.masters.size(); ++s) {
    double w = 0;
    for (std::size_t i = 0; i < one.masters[s].size(); ++i) w = std::max(w, double(std::abs(mesh.masters[s][i] - one.masters[s][i])));
    CHECK(w < 1e-5);
  }
  // and on a pipeline of 2 stages under ZeRO-1 (the groups of a stage's chunk only)
  check_schedule(groups_train({1, 1, 2}, 1, g, 10), g, 10);
}

TEST_CASE("progressive unfreezing: a group's Adam moments are allocated when it unfreezes, on ZeRO 0-3; the run equals the up-front one bit for bit") {
  // Per rank, with N its fp32 master elements (stage 0: the padded layout; 1-3: its slice of
  // each unit), n_g the elements of group g among them and n_0 those in no group (padding):
  //   optimizer bytes after step s = 4 N + 8 (n_0 + sum of n_g over the groups trained at a step <= s)
  // (before the first step: no group yet), measured by the memory resource the trainer puts
  // the optimizer state in, and by the engine's own accounting. Up front: 12 N throughout.
  const auto cfg = train3d_suite::tiny(false);
  const auto g = unfreeze_30_40_30(1e-2f);
  const int n = 10;
  for (const auto& [mesh, zero] : {std::pair{loom::comm::mesh_shape{1, 1, 1}, 0}, {loom::comm::mesh_shape{2, 1, 1}, 1},
                                   {loom::comm::mesh_shape{2, 1, 1}, 2}, {loom::comm::mesh_shape{2, 2, 1}, 3}}) {
    CAPTURE(mesh.dp);
    CAPTURE(mesh.tp);
    CAPTURE(zero);
    auto o = train3d_suite::options(mesh, zero, "1f1b", 4 / mesh.dp);
    o.groups = g;
    o.total_steps = n;
    std::vector<double> losses[2];
    std::vector<float> master[2];
    for (const bool lazy : {true, false}) {
      CAPTURE(lazy);
      o.lazy_group_state = lazy;
      std::vector<int> ok(static_cast<std::size_t>(mesh.size()), 0), grew(ok);
      train3d_suite::run_ranks(mesh.size(), [&](any_comm& world) {
        loom::host_memory_resource opt_mr("optimizer state");
        groups_trainer t(world, cfg, o, loom::default_resource<loom::host>(), nullptr, &opt_mr);
        // n_g on this rank from the layout's sizes and the tensors' groups
        const auto& sz = t.engine().layout().sizes();
        const auto groups = t.groups().groups.size();
        const std::size_t rank = static_cast<std::size_t>(t.mesh().coord().dp);
        std::vector<std::size_t> in_group(groups, 0);
        std::size_t N = 0;
        for (std::size_t p = 0; p < sz.params(); ++p) {
          const std::size_t s = sz.shard_numel(p);
          const std::size_t b = zero == 0 ? sz.offset(p) : sz.offset(p) + rank * s, e = zero == 0 ? sz.offset(p) + sz.padded_numel(p) : b + s;
          N += e - b;
          for (const auto& sh : t.model().shards()) {
            const std::size_t lo = std::max(b, sh.local_offset), hi = std::min(e, sh.local_offset + std::size_t(sh.rows * sh.cols));
            if (lo < hi) in_group[t.group_of(sh.name)] += hi - lo;
          }
        }
        std::size_t rest = N;
        for (std::size_t k = 0; k < groups; ++k) rest -= in_group[k];
        std::vector<bool> trained(groups, false);
        auto expected = [&] {
          std::size_t b = 4 * N + 8 * rest;
          for (std::size_t k = 0; k < groups; ++k) b += trained[k] ? 8 * in_group[k] : 0;
          return lazy ? b : 12 * N;
        };
        bool good = opt_mr.current_bytes() == expected() && t.bytes().optimizer == expected();
        std::size_t before_top = 0;
        std::vector<double> l;
        for (int s = 0; s < n; ++s) {
          const auto on = t.trainable_now();
          for (std::size_t k = 0; k < groups; ++k) trained[k] = trained[k] || on[k];
          if (s == 3) before_top = opt_mr.current_bytes();  // "top" unfreezes at step 3 (30% of 10)
          l.push_back(t.step([&](std::int64_t step, int gm, std::span<std::int32_t> tok, std::span<std::int32_t> tgt) {
                         llama3d::counting_batch(7, step, gm, o.micro_batch_size, o.seq, cfg.vocab, tok, tgt);
                       }).loss);
          good = good && opt_mr.current_bytes() == expected() && t.bytes().optimizer == expected();
          if (s == 3) {
            const std::size_t top = 1;  // unfreeze_30_40_30's second group
            grew[static_cast<std::size_t>(world.rank())] = opt_mr.current_bytes() - before_top == (lazy ? 8 * in_group[top] : 0) &&
                                                           in_group[top] > 0;
          }
        }
        ok[static_cast<std::size_t>(world.rank())] = good;
        auto m = t.consolidated_master();
        if (world.rank() == 0) losses[lazy ? 0 : 1] = l, master[lazy ? 0 : 1] = std::move(m);
      });
      for (int r = 0; r < mesh.size(); ++r) {
        CAPTURE(r);
        CHECK(ok[static_cast<std::size_t>(r)]);
        CHECK(grew[static_cast<std::size_t>(r)]);
      }
    }
    CHECK(losses[0] == losses[1]);
    CHECK(master[0] == master[1]);
  }
}

TEST_CASE("per-group lr, its schedule scaling and its own bias correction against AdamW's first step") {
  // 4 steps: [0, 2) the head alone at its lr 1e-2, then everything at the run's lr 3e-3; the
  // schedule halves the lr at step 0 (the head's scales with it)
  loom::optim::param_groups g;
  g.groups.push_back({"head", {"output.weight", "norm.weight"}, {}, {}, 1e-2f, {}});
  g.phases = {{0.5, {"head"}}, {1.0, {"head", "base"}}};
  const float lr = 3e-3f;
  const auto r = groups_train({2, 1, 1}, 2, g, 4, {0.5f * lr, lr, lr, lr});
  loom::optim::param_groups gc = g;
  loom::optim::check(gc);
  const auto near = [](double got, double want) { return got <= want * (1 + 1e-4) && got >= want * 0.99; };
  CHECK(near(largest_move(r.masters[0], r.masters[1], gc, "head"), 0.5 * 1e-2));  // t = 1, lr_head * lr(0) / lr0
  CHECK(largest_move(r.masters[0], r.masters[1], gc, "base") == 0.0);
  CHECK(largest_move(r.masters[1], r.masters[2], gc, "base") == 0.0);
  // the base's first step is step 2: its own t = 1, so its largest move is lr, not the
  // 0.55 lr a bias correction at the run's t = 3 would give
  CHECK(near(largest_move(r.masters[2], r.masters[3], gc, "base"), lr));
  // the head at its t = 3 (no closed form past the first step) still steps at its own rate
  const double head3 = largest_move(r.masters[2], r.masters[3], gc, "head");
  CHECK(head3 > 2 * lr);
  CHECK(head3 < 1.5 * 1e-2);
  CHECK(r.group_steps == std::vector<std::int64_t>{4, 2});
}

TEST_CASE("parameter groups: a group's lr equal to the run's gives the run without groups") {
  loom::optim::param_groups g;
  g.groups.push_back({"top", {}, -1, {}, 3e-3f, 0.f});
  const auto grouped = groups_train({1, 2, 1}, 1, g, 3);
  const auto plain = groups_train({1, 2, 1}, 1, {}, 3);
  CHECK(grouped.losses == plain.losses);
  CHECK(grouped.masters.back() == plain.masters.back());
}

TEST_CASE("parameter groups: bad input is a loom::error naming it") {
  const auto cfg = train3d_suite::tiny(false);
  auto o = train3d_suite::options({1, 1, 1}, 0, "1f1b", 2);
  o.groups.groups.push_back({"top", {}, -1, {}, 1e-3f, {}});
  o.groups.phases = {{1.0, {"base"}}};
  o.total_steps = 4;
  // one thread rank (the group's trainer instantiation; a self_comm one would cost a compile)
  const auto error = [&] {
    std::string e;
    train3d_suite::run_ranks(1, [&](any_comm& world) {
      e = loom::test::error_of([&] { llama3d::trainer<double, double, any_comm> t(world, cfg, o, loom::default_resource<loom::host>()); });
    });
    return e;
  };
  CHECK(error().find("group \"top\" is frozen in every phase but is given lr=") != std::string::npos);
  o.groups.groups[0].lr.reset();
  o.total_steps = 0;
  CHECK(error().find("progressive_unfreezing needs total_steps >= 1") != std::string::npos);
  // LoRA merged with a phase that trains the base under ZeRO-3: the merged path keeps the
  // base's weights resident (the unmerged default reads them gathered)
  o.total_steps = 4;
  o.lora.emplace();
  o.lora->r = 2;
  o.lora_merged = true;
  o.zero_stage = 3;
  CHECK(error().find("lora_merged with progressive_unfreezing training base tensor") != std::string::npos);
  CHECK(error().find("needs ZeRO stage <= 2") != std::string::npos);
}

TEST_CASE("parameter groups under LoRA: the adapters of the top layer first, then all, on (2,1,1) ZeRO-3") {
  // PEFT-like names of the factors: layers.1.attention.wq.lora_A.weight; B starts at zero, so
  // A's first gradient is zero: a trainable B must move, a frozen factor must not
  const auto cfg = train3d_suite::tiny(false);
  auto o = train3d_suite::options({2, 1, 1}, 3, "1f1b", 2);
  o.lora.emplace();
  o.lora->r = 2, o.lora->lora_alpha = 4;
  o.lora->target_modules = {"q_proj", "v_proj", "down_proj"};
  o.groups.groups.push_back({"lora_top", {"*.lora_?.weight"}, -1, {}, 1e-2f, {}});
  o.groups.groups.push_back({"lora", {"*.lora_?.weight"}, {}, {}, {}, {}});
  o.groups.phases = {{0.5, {"lora_top"}}, {1.0, {"lora_top", "lora"}}};
  o.total_steps = 4;
  o.adamw.weight_decay = 0.f;
  std::vector<std::vector<float>> adapters;
  train3d_suite::run_ranks(2, [&](any_comm& world) {
    llama3d::trainer<double, double, any_comm> t(world, cfg, o, loom::default_resource<loom::host>());
    std::vector<std::vector<float>> a{t.consolidated_lora()};
    for (int s = 0; s < 4; ++s) {
      t.step([&](std::int64_t step, int gm, std::span<std::int32_t> tok, std::span<std::int32_t> tgt) {
        llama3d::counting_batch(7, step, gm, o.micro_batch_size, o.seq, cfg.vocab, tok, tgt);
      });
      a.push_back(t.consolidated_lora());
    }
    if (world.rank() == 0) adapters = a;
  });
  loom::optim::param_groups g = o.groups;
  loom::optim::check(g);
  const auto layout = llama3d::lora_full_layout(*o.lora, cfg);
  for (int s = 0; s < 4; ++s) {
    const auto on = loom::optim::trainable_at(g, s, 4);
    for (const auto& e : layout.entries()) {
      const auto& a = adapters[static_cast<std::size_t>(s)];
      const auto& b = adapters[static_cast<std::size_t>(s) + 1];
      const bool changed = std::memcmp(a.data() + e.offset, b.data() + e.offset, e.numel * sizeof(float)) != 0;
      const auto k = loom::optim::group_of(g, e.name, cfg.n_layers);
      INFO("step ", s, " factor ", e.name, " group ", g.groups[k].name);
      CHECK(g.groups[k].name != "base");
      if (!on[k]) CHECK_FALSE(changed);
      else if (e.name.find("lora_B") != std::string::npos) CHECK(changed);
    }
  }
}

#ifdef LOOM_HAS_JSON
TEST_CASE("progressive unfreezing: a run resumed mid-phase from a sharded checkpoint equals the uninterrupted run") {
  // 5 of 10 steps on (2,1,1) ZeRO-2 (the top group has trained 2 of them), saved; the last 5
  // on (1,1,1): each group's AdamW t comes back from the schedule, so the runs agree
  const auto g = unfreeze_30_40_30(1e-2f);
  const auto whole = groups_train({1, 1, 1}, 0, g, 10);
  const std::string root = "train3d_groups_resume.ckpt";
  std::filesystem::remove_all(root);
  std::string dir;
  groups_train({2, 1, 1}, 2, g, 10, {}, 5, [&](groups_trainer& t, bool end) {
    if (!end) return;
    const std::string d = llama3d::save_checkpoint(t, root);
    if (t.mesh().world().rank() == 0) dir = d;
  });
  const auto tail = groups_train({1, 1, 1}, 0, g, 10, {}, -1, [&](groups_trainer& t, bool end) {
    if (!end) llama3d::load_checkpoint(t, dir);
  });
  CHECK(tail.group_steps == whole.group_steps);
  REQUIRE(tail.losses.size() == 5);
  for (std::size_t i = 0; i < 5; ++i) CHECK(std::abs(tail.losses[i] - whole.losses[i + 5]) < 1e-5 * std::abs(whole.losses[i + 5]));
  double w = 0;
  for (std::size_t i = 0; i < whole.masters.back().size(); ++i)
    w = std::max(w, double(std::abs(tail.masters.back()[i] - whole.masters.back()[i])));
  CHECK(w < 1e-5);
  std::filesystem::remove_all(root);
}
#endif

namespace {
struct hybrid_run {
  std::vector<double> losses;
  double eval = 0;  // evaluate() after the last step
  std::vector<std::vector<double>> bases;  // the base after each step (base_params, tp = pp = 1)
  std::vector<float> adapters;
  std::vector<loom::nn::param_info> tensors;
};

// The seed's recipe under LoRA on the tiny model: the adapters, then the top layer's base
// tensors too, then everything (groups: empty = a LoRA-only run).
// Steps from the trainer's own count up to `stop`; hook(t, false) after construction, hook(t,
// true) at the end (a checkpoint's load and save); `dropout` on the adapters.
hybrid_run hybrid_train(loom::comm::mesh_shape mesh, int zero, bool grouped, bool merged = false, bool checkpointing = false,
                        int stop = 10, const std::function<void(groups_trainer&, bool)>& hook = {}, double dropout = 0) {
  const auto cfg = train3d_suite::tiny(false);
  auto o = train3d_suite::options(mesh, zero, "1f1b", 4 / mesh.dp);
  o.checkpointing = checkpointing;
  o.lora.emplace();
  o.lora_merged = merged;
  o.lora->r = 2, o.lora->lora_alpha = 4;
  o.lora->target_modules = {"q_proj", "v_proj", "down_proj"};
  o.lora->lora_dropout = dropout;
  if (grouped) {
    o.groups.groups.push_back({"lora", {"*.lora_?.weight"}, {}, {}, {}, {}});
    o.groups.groups.push_back({"top", {}, -1, {}, {}, {}});
    o.groups.phases = {{0.3, {"lora"}}, {0.7, {"lora", "top"}}, {1.0, {"lora", "top", "base"}}};
    o.total_steps = 10;
  }
  hybrid_run out;
  train3d_suite::run_ranks(mesh.size(), [&](any_comm& world) {
    groups_trainer t(world, cfg, o, loom::default_resource<loom::host>());
    if (hook) hook(t, false);
    hybrid_run r;
    r.bases.push_back(t.base_params());
    for (int s = static_cast<int>(t.steps()); s < stop; ++s) {
      r.losses.push_back(t.step([&](std::int64_t step, int gm, std::span<std::int32_t> tok, std::span<std::int32_t> tgt) {
                           llama3d::counting_batch(7, step, gm, o.micro_batch_size, o.seq, cfg.vocab, tok, tgt);
                         }).loss);
      r.bases.push_back(t.base_params());
    }
    if (hook) hook(t, true);
    r.adapters = t.consolidated_lora();
    r.eval = t.evaluate([&](std::int64_t step, int gm, std::span<std::int32_t> tok, std::span<std::int32_t> tgt) {
      llama3d::counting_batch(7, step, gm, o.micro_batch_size, o.seq, cfg.vocab, tok, tgt);
    }, 99);
    for (const auto& e : t.model().layout().entries()) r.tensors.push_back(e);
    if (world.rank() == 0) out = r;
  });
  return out;
}

// Each base tensor of `r` changed at a step exactly when the seed's recipe trains its group.
void check_hybrid_schedule(const hybrid_run& r) {
  loom::optim::param_groups g;
  g.groups.push_back({"lora", {"*.lora_?.weight"}, {}, {}, {}, {}});
  g.groups.push_back({"top", {}, -1, {}, {}, {}});
  g.phases = {{0.3, {"lora"}}, {0.7, {"lora", "top"}}, {1.0, {"lora", "top", "base"}}};
  loom::optim::check(g);
  REQUIRE(r.bases.size() == 11);
  for (int s = 0; s < 10; ++s) {
    const auto on = loom::optim::trainable_at(g, s, 10);
    const auto& a = r.bases[static_cast<std::size_t>(s)];
    const auto& b = r.bases[static_cast<std::size_t>(s) + 1];
    for (const auto& e : r.tensors) {
      const auto k = loom::optim::group_of(g, e.name, 2);
      INFO("step ", s, " base tensor ", e.name, " group ", g.groups[k].name);
      const bool changed = std::memcmp(a.data() + e.offset, b.data() + e.offset, e.numel * sizeof(double)) != 0;
      CHECK(changed == on[k]);
    }
  }
}
// Losses, evaluation, the last base (tp = pp = 1 layouts) and the adapters within 1e-5.
void check_same_run(const hybrid_run& got, const hybrid_run& want) {
  REQUIRE(got.losses.size() == want.losses.size());
  for (std::size_t i = 0; i < want.losses.size(); ++i) CHECK(std::abs(got.losses[i] - want.losses[i]) < 1e-5 * want.losses[i]);
  CHECK(std::abs(got.eval - want.eval) < 1e-5 * want.eval);
  std::map<std::string, std::size_t> at;  // the tensors' offsets in got's layout (padded to its dp)
  for (const auto& e : got.tensors) at[e.name] = e.offset;
  double w = 0;
  for (const auto& e : want.tensors)
    for (std::size_t i = 0; i < e.numel; ++i)
      w = std::max(w, std::abs(got.bases.back()[at.at(e.name) + i] - want.bases.back()[e.offset + i]));
  for (std::size_t i = 0; i < want.adapters.size(); ++i) w = std::max(w, double(std::abs(got.adapters[i] - want.adapters[i])));
  CHECK(w < 1e-5);
}
}  // namespace

TEST_CASE("progressive unfreezing under LoRA: adapters, then the top layer's base, then all, on (1,1,1), (2,1,1) ZeRO-2 and ZeRO-3") {
  const auto one = hybrid_train({1, 1, 1}, 0, true);
  check_hybrid_schedule(one);
  // while the base is frozen the run is the LoRA-only run (its base in fp32 master here, in
  // the model's double buffer there)
  const auto lora_only = hybrid_train({1, 1, 1}, 0, false);
  for (std::size_t i = 0; i < 3; ++i) CHECK(std::abs(one.losses[i] - lora_only.losses[i]) < 1e-5 * lora_only.losses[i]);
  CHECK(std::abs(one.losses[5] - lora_only.losses[5]) > 1e-6 * lora_only.losses[5]);  // the top layer trains from step 3
  // the merged path (lora_merged: W0 + s B A written into the base engine's weights for the
  // passes, the base's and the adapters' gradients from the weights' G) is the same run
  const auto merged = hybrid_train({1, 1, 1}, 0, true, true);
  for (std::size_t i = 0; i < 10; ++i) CHECK(std::abs(merged.losses[i] - one.losses[i]) < 1e-5 * one.losses[i]);
  double wm = 0;
  for (std::size_t i = 0; i < one.bases.back().size(); ++i) wm = std::max(wm, std::abs(merged.bases.back()[i] - one.bases.back()[i]));
  for (std::size_t i = 0; i < one.adapters.size(); ++i) wm = std::max(wm, double(std::abs(merged.adapters[i] - one.adapters[i])));
  CHECK(wm < 1e-5);
  // the mesh: dp 2 under ZeRO-2 (both engines partitioned)
  check_same_run(hybrid_train({2, 1, 1}, 2, true), one);
  // ZeRO-3: the base engine partitions the base too; the frozen ops read each unit gathered
  // (with activation checkpointing: the recompute gathers again), the engine's fp32 master is
  // the base (base_params gathers it)
  for (const bool ckpt : {false, true}) {
    CAPTURE(ckpt);
    const auto z3 = hybrid_train({2, 1, 1}, 3, true, false, ckpt);
    check_hybrid_schedule(z3);
    check_same_run(z3, one);
  }
}

#ifdef LOOM_HAS_JSON
TEST_CASE("a LoRA run's sharded checkpoint: saved mid-phase on (2,1,1) ZeRO-3, resumed on (1,1,1), equals the uninterrupted run; another r or no LoRA refused") {
  // the seed's recipe with LoRA dropout: after 5 of 10 steps the top layer's base has trained
  // 2 steps (its moments and step count in the base engine), the adapters 5 (theirs in the
  // adapters' engine); the resumed run must continue both, and the dropout masks (keyed by step)
  for (const bool grouped : {true, false}) {
    CAPTURE(grouped);
    const auto whole = hybrid_train({1, 1, 1}, 0, grouped, false, false, 10, {}, 0.1);
    const std::string root = "train3d_lora_resume.ckpt";
    std::filesystem::remove_all(root);
    std::string dir;
    hybrid_train({2, 1, 1}, 3, grouped, false, false, 5, [&](groups_trainer& t, bool end) {
      if (!end) return;
      const std::string d = llama3d::save_checkpoint(t, root);
      if (t.mesh().world().rank() == 0) dir = d;
    }, 0.1);
    const auto tail = hybrid_train({1, 1, 1}, 0, grouped, false, false, 10, [&](groups_trainer& t, bool end) {
      if (!end) llama3d::load_checkpoint(t, dir);
    }, 0.1);
    REQUIRE(tail.losses.size() == 5);
    for (std::size_t i = 0; i < 5; ++i) CHECK(std::abs(tail.losses[i] - whole.losses[i + 5]) < 1e-5 * whole.losses[i + 5]);
    CHECK(std::abs(tail.eval - whole.eval) < 1e-5 * whole.eval);
    double w = 0;
    for (std::size_t i = 0; i < whole.bases.back().size(); ++i) w = std::max(w, std::abs(tail.bases.back()[i] - whole.bases.back()[i]));
    for (std::size_t i = 0; i < whole.adapters.size(); ++i) w = std::max(w, double(std::abs(tail.adapters[i] - whole.adapters[i])));
    CHECK(w < 1e-5);
    if (!grouped) {
      // the checkpoint into a run with another r, and into one without LoRA: refused naming it
      const auto cfg = train3d_suite::tiny(false);
      auto o = train3d_suite::options({1, 1, 1}, 0, "1f1b", 4);
      o.lora.emplace();
      o.lora->r = 4, o.lora->lora_alpha = 4;
      o.lora->target_modules = {"q_proj", "v_proj", "down_proj"};
      std::string other_r, no_lora;
      train3d_suite::run_ranks(1, [&](any_comm& world) {
        groups_trainer t(world, cfg, o, loom::default_resource<loom::host>());
        other_r = loom::test::error_of([&] { llama3d::load_checkpoint(t, dir); });
        auto full = o;
        full.lora.reset();
        groups_trainer f(world, cfg, full, loom::default_resource<loom::host>());
        no_lora = loom::test::error_of([&] { llama3d::load_checkpoint(f, dir); });
      });
      CHECK(other_r.find("its LoRA adapters have r=2, this run's have r=4") != std::string::npos);
      CHECK(no_lora.find("was saved by a LoRA run") != std::string::npos);
      // a hostile manifest: a 100 kB r, and a "lora" that is no object: named, quoted bounded
      const std::string mpath = dir + "/manifest.json";
      nlohmann::json m;
      std::ifstream(mpath) >> m;
      const auto load_with = [&](const nlohmann::json& lora) {
        nlohmann::json h = m;
        h["lora"] = lora;
        std::ofstream(mpath) << h.dump();
        std::string e;
        train3d_suite::run_ranks(1, [&](any_comm& world) {
          o.lora->r = 2;
          groups_trainer t(world, cfg, o, loom::default_resource<loom::host>());
          e = loom::test::error_of([&] { llama3d::load_checkpoint(t, dir); });
        });
        return e;
      };
      nlohmann::json long_r = m["lora"];
      long_r["r"] = std::string(100000, 'x');
      const std::string e1 = load_with(long_r), e2 = load_with(7);
      CHECK(e1.find("its LoRA adapters have r=\"xxx") != std::string::npos);
      CHECK(e1.size() < 2000);
      CHECK(e2.find("its LoRA adapters have lora_alpha=(none)") != std::string::npos);  // the first field checked
      std::ofstream(mpath) << m.dump();
    }
    std::filesystem::remove_all(root);
  }
}
#endif
