// 3D training (dp x tp x pp, ZeRO 0-3, GPipe / 1F1B) reproduces the (1,1,1) run: 20 steps of
// losses within 1e-5 relative and the consolidated fp32 master weights equal. Computation in
// double so that only the order of summation differs between meshes.
#include "train3d_suite.hpp"

#include <llama/model/llama.hpp>

#include <limits>

using loom::comm::any_comm;
using trainer_t = llama3d::trainer<double, double, any_comm>;
using namespace train3d_suite;

namespace {
void counting(std::int64_t step, int g, std::span<std::int32_t> tok, std::span<std::int32_t> tgt) {
  llama3d::counting_batch(7, step, g, 2, 8, 32, tok, tgt);
}
}  // namespace



TEST_CASE("3D meshes x ZeRO stages x schedules reproduce the (1,1,1) run") {
  const int m = 2;
  const run_result base1 = run({1, 1, 1}, 0, "1f1b", m, false), base2 = run({1, 1, 1}, 0, "1f1b", 2 * m, false);
  // the baseline learns (the test would be weak on a flat curve)
  CHECK(base1.losses.back() < base1.losses.front() - 0.1);
  for (auto mesh : {loom::comm::mesh_shape{1, 2, 1}, {1, 1, 2}, {2, 2, 1}, {2, 1, 2}, {1, 2, 2}, {2, 2, 2}}) {
    for (int zero = 0; zero <= 3; ++zero) {
      for (const char* sched : {"gpipe", "1f1b"}) {
        if (mesh.pp == 1 && std::string(sched) == "gpipe") continue;  // one stage: the schedules coincide
        CAPTURE(mesh.dp);
        CAPTURE(mesh.tp);
        CAPTURE(mesh.pp);
        CAPTURE(zero);
        CAPTURE(sched);
        compare(run(mesh, zero, sched, m, false), mesh.dp == 1 ? base1 : base2);
      }
    }
  }
}

TEST_CASE("tied embeddings stay synchronised across the first and last stage") {
  const int m = 2;
  const run_result base1 = run({1, 1, 1}, 0, "1f1b", m, true), base2 = run({1, 1, 1}, 0, "1f1b", 2 * m, true);
  for (auto mesh : {loom::comm::mesh_shape{1, 1, 2}, {2, 2, 2}}) {
    for (int zero : {0, 3}) {
      CAPTURE(mesh.dp);
      CAPTURE(mesh.pp);
      CAPTURE(zero);
      compare(run(mesh, zero, "1f1b", m, true), mesh.dp == 1 ? base1 : base2);
    }
  }
}

TEST_CASE("the interleaved schedule (2 chunks per stage) reproduces the (1,1,1) run") {
  const int m = 2;
  for (bool tied : {false, true}) {
    const run_result base1 = run({1, 1, 1}, 0, "1f1b", m, tied, 4), base2 = run({1, 1, 1}, 0, "1f1b", 2 * m, tied, 4);
    for (auto mesh : {loom::comm::mesh_shape{1, 1, 2}, {2, 2, 2}})
      for (int zero : {0, 1, 3}) {
        CAPTURE(tied);
        CAPTURE(mesh.dp);
        CAPTURE(mesh.pp);
        CAPTURE(zero);
        compare(run(mesh, zero, "interleaved", m, tied, 4, 2), mesh.dp == 1 ? base1 : base2);
      }
  }
}

TEST_CASE("ZeRO divides model states over dp") {
  llama3d::train_options o;
  o.mesh = {2, 2, 2};
  o.micro_batches = 2;
  o.seq = 8;
  o.stage3.persistence_threshold = 0;  // nothing kept gathered: parameters / dp exactly
  const auto cfg = tiny(false);
  std::vector<std::size_t> state(4, 0);
  for (int zero = 0; zero <= 3; ++zero) {
    o.zero_stage = zero;
    train3d_suite::run_ranks(8, [&](any_comm& world) {
      loom::host_memory_resource mr("rank");
      trainer_t t(world, cfg, o, mr);
      const auto b = t.bytes();
      const std::size_t n = t.model().size();
      if (world.rank() == 0) state[static_cast<std::size_t>(zero)] = b.parameters + b.gradients + b.optimizer;
      // stage >= 1: optimizer / 2, >= 2: gradients / 2, 3: parameters / 2
      CHECK(b.optimizer == 3 * n * sizeof(float) / (zero >= 1 ? 2 : 1));
      CHECK(b.gradients == n * sizeof(double) / (zero >= 2 ? 2 : 1));
      CHECK(b.parameters == n * sizeof(double) / (zero == 3 ? 2 : 1));
      if (zero == 3) {  // the gather / drop cycle of a stage-3 step
        auto st = t.step([&](std::int64_t step, int g, std::span<std::int32_t> tok, std::span<std::int32_t> tgt) {
          llama3d::counting_batch(7, step, g, o.micro_batch_size, o.seq, cfg.vocab, tok, tgt);
        });
        CHECK(!st.skipped);
        CHECK(t.steps() == 1);
      }
    });
  }
  CHECK(state[3] < state[2]);
  CHECK(state[2] < state[1]);
  CHECK(state[1] < state[0]);
}

TEST_CASE("ZeRO-3 gathers unit by unit: peak parameter bytes are the shard plus the gather window, far below the stage") {
  // dp 4, one pipeline stage of 8 blocks. A rank's parameter memory has a resource of its own
  // (the trainer's param_mr), whose peak counts every parameter byte it ever held: ZeRO-0 the
  // whole stage S; ZeRO-3 its shard S/4 plus the gather arena A, where the plan keeps the
  // live gathered elements <= U_max (the unit in use) + W (the prefetch window) and places
  // them first-fit: peak = (S/4 + A) x sizeof(P), A <= 2 U_max + W (one unit of placement
  // slack; docs/zero.md).
  llama::config cfg = tiny(false, 8);
  cfg.dim = 32, cfg.hidden_dim = 64, cfg.vocab = 64;
  std::size_t arena = 0;
  auto run = [&](int zero, std::size_t prefetch, std::size_t* stage_numel, std::size_t* unit_max,
                 std::vector<double>* losses) {
    auto o = options({4, 1, 1}, zero, "1f1b", 2);
    o.stage3.prefetch_numel = prefetch;
    std::size_t peak = 0;
    train3d_suite::run_ranks(4, [&](any_comm& world) {
      loom::host_memory_resource params("parameters");
      trainer_t t(world, cfg, o, loom::default_resource<loom::host>(), &params);
      for (int s = 0; s < 3; ++s) {
        const auto st = t.step(counting);
        if (world.rank() == 0) losses->push_back(st.loss);
      }
      const double eval = t.evaluate(counting, 99);  // forward-only, re-planned gathers
      if (world.rank() == 0) {
        losses->push_back(eval);
        peak = params.peak_bytes();
        arena = t.engine().gather_arena_numel();  // the larger of the training and the evaluation plan's
        *stage_numel = t.model().size();
        const auto& L = t.model().layout();
        *unit_max = 0;
        for (std::size_t u = 0; u < L.units(); ++u) *unit_max = std::max(*unit_max, L.unit_end(u) - L.unit_begin(u));
      }
    });
    return peak;
  };
  std::size_t S = 0, U = 0;
  std::vector<double> l0, l3, l3w;
  const std::size_t full = run(0, 0, &S, &U, &l0);
  CHECK(full == S * sizeof(double));
  for (std::size_t window : {std::size_t{0}, U}) {
    CAPTURE(window);
    std::vector<double>& l = window ? l3w : l3;
    const std::size_t peak = run(3, window, &S, &U, &l);
    CHECK(peak == (S / 4 + arena) * sizeof(double));  // the resource's count is the engine's accounting
    CHECK(arena <= 2 * U + window);
    CHECK(arena >= U + window);                        // the window was used: one unit prefetched ahead
    CHECK(peak < (window ? 0.6 : 0.4) * double(full));
    MESSAGE("ZeRO-3 dp 4, window ", window, ": peak parameter bytes ", peak, " = ", double(peak) / double(full),
            " of the stage's ", full, "; largest unit ", U, " elements");
    REQUIRE(l.size() == l0.size());
    for (std::size_t i = 0; i < l.size(); ++i) CHECK(std::abs(l[i] - l0[i]) <= 1e-9 * std::abs(l0[i]));
  }
}

TEST_CASE("an inf/NaN gradient on one rank makes every rank skip the step") {
  llama3d::train_options o;
  o.mesh = {2, 2, 2};
  o.micro_batches = 2;
  o.seq = 8;
  const auto cfg = tiny(false);
  for (int zero : {0, 2}) {
    std::vector<int> skipped(8, 0), taken(8, -1);
    train3d_suite::run_ranks(8, [&](any_comm& world) {
      trainer_t t(world, cfg, o, loom::default_resource<loom::host>());
      if (world.rank() == 5) t.model().params()[3] = std::numeric_limits<double>::quiet_NaN();
      auto st = t.step([&](std::int64_t step, int g, std::span<std::int32_t> tok, std::span<std::int32_t> tgt) {
        llama3d::counting_batch(7, step, g, o.micro_batch_size, o.seq, cfg.vocab, tok, tgt);
      });
      skipped[static_cast<std::size_t>(world.rank())] = st.skipped;
      taken[static_cast<std::size_t>(world.rank())] = static_cast<int>(t.steps());
    });
    for (int r = 0; r < 8; ++r) {
      CAPTURE(zero);
      CAPTURE(r);
      CHECK(skipped[static_cast<std::size_t>(r)] == 1);
      CHECK(taken[static_cast<std::size_t>(r)] == 0);
    }
  }
}

// ---- loss scaling and low-precision parameter storage (the seed's fp16 ds_config) ----

TEST_CASE("a dynamic loss scale (powers of two) trains exactly as no scale, growing every window on all ranks") {
  // Scaling the loss by 2^k scales every gradient by exactly 2^k in binary floating point, and
  // the step divides it out before the norm, the clipping and AdamW: losses, gradient norms
  // and master weights must be the (1,1,1) unscaled run's (1e-5: only the mesh's summation
  // order differs), and the scale must follow DeepSpeed's rule: x2 after every
  // `scale_window` steps without overflow. Clipping at 0.85 is active in some steps only.
  const int m = 2;
  struct result {
    run_result run;
    std::vector<double> norms;
    std::vector<float> scales;
  };
  auto train = [&](loom::comm::mesh_shape mesh, int zero, int micro, loom::amp::any_loss_scaler scaler) {
    auto o = options(mesh, zero, "1f1b", micro);
    o.gradient_clipping = 0.85f;
    o.loss_scaler = scaler;
    result out;
    train3d_suite::run_ranks(mesh.size(), [&](any_comm& world) {
      trainer_t t(world, tiny(false), o, loom::default_resource<loom::host>());
      result r;
      for (int s = 0; s < steps; ++s) {
        const auto st = t.step(counting);
        CHECK(!st.skipped);
        r.run.losses.push_back(st.loss);
        r.norms.push_back(st.grad_norm);
        r.scales.push_back(st.loss_scale);
      }
      r.run.master = t.consolidated_master();
      if (world.rank() == 0) out = r;
    });
    return out;
  };
  const result base = train({1, 1, 1}, 0, 2 * m, loom::amp::static_loss_scaler(1.f));
  int clipped = 0;
  for (double nrm : base.norms) clipped += nrm > 0.85;
  CHECK(clipped > 0);
  CHECK(clipped < steps);
  for (int zero : {0, 3}) {
    CAPTURE(zero);
    const result got = train({2, 2, 2}, zero, m, loom::amp::dynamic_loss_scaler({.initial_scale = 1024.f, .scale_window = 3}));
    compare(got.run, base.run);
    for (int s = 0; s < steps; ++s) {
      CAPTURE(s);
      CHECK(std::abs(got.norms[std::size_t(s)] - base.norms[std::size_t(s)]) <= 1e-5 * base.norms[std::size_t(s)]);
      CHECK(got.scales[std::size_t(s)] == std::ldexp(1024.f, s / 3));
    }
  }
}

TEST_CASE("an overflow on one rank halves every rank's scale after the hysteresis; at the minimum scale every rank throws") {
  // A NaN parameter on rank 5 makes every step's gradient non-finite. DeepSpeed's rule with
  // hysteresis 2: the first overflow only uses up the hysteresis, each later one halves the
  // scale, and an overflow at min_scale is an error.
  auto o = options({2, 2, 2}, 2, "1f1b", 2);
  o.loss_scaler = loom::amp::dynamic_loss_scaler({.initial_scale = 16.f, .hysteresis = 2, .min_scale = 1.f});
  const std::vector<float> want = {16, 16, 8, 4, 2, 1};  // the scale each skipped step ran with
  std::vector<std::vector<float>> seen(8);
  std::vector<int> threw(8, 0);
  CHECK_THROWS_WITH_AS(train3d_suite::run_ranks(8,
                                             [&](any_comm& world) {
                                               trainer_t t(world, tiny(false), o, loom::default_resource<loom::host>());
                                               if (world.rank() == 5) t.model().params()[3] = std::nan("");
                                               auto& mine = seen[std::size_t(world.rank())];
                                               try {
                                                 for (int s = 0; s < 10; ++s) {
                                                   const auto st = t.step(counting);
                                                   CHECK(st.skipped);
                                                   mine.push_back(st.loss_scale);
                                                 }
                                               } catch (const loom::error&) {
                                                 threw[std::size_t(world.rank())] = 1;
                                                 CHECK(t.steps() == 0);
                                                 throw;
                                               }
                                             }),
                       doctest::Contains("loss scale already at its minimum"), loom::error);
  for (int r = 0; r < 8; ++r) {
    CAPTURE(r);
    CHECK(threw[std::size_t(r)] == 1);
    CHECK(seen[std::size_t(r)] == std::vector<float>(want.begin(), want.end() - 1));
  }
}

namespace {
/// (1,1,1) fp32 or a (2,2,2) run with parameters stored as P: losses of 20 steps.
template <class P>
std::vector<double> losses_with(loom::comm::mesh_shape mesh, int zero, loom::amp::any_loss_scaler scaler) {
  auto o = options(mesh, zero, "1f1b", mesh.dp == 1 ? 4 : 2);
  o.loss_scaler = scaler;
  std::vector<double> out;
  train3d_suite::run_ranks(mesh.size(), [&](any_comm& world) {
    llama3d::trainer<P, float, any_comm> t(world, tiny(false), o, loom::default_resource<loom::host>());
    std::vector<double> l;
    for (int s = 0; s < steps; ++s) l.push_back(t.step(counting).loss);
    if (world.rank() == 0) out = l;
  });
  return out;
}
}  // namespace

TEST_CASE("bfloat16 and half parameter storage (fp32 master, dynamic scale for half) track the fp32 run on (2,2,2)") {
  const auto ref = losses_with<float>({1, 1, 1}, 0, loom::amp::static_loss_scaler(1.f));
  REQUIRE(ref.size() == std::size_t(steps));
  CHECK(ref.back() < ref.front() - 0.1);
  for (int zero : {0, 3}) {
    CAPTURE(zero);
    const auto bf = losses_with<loom::bfloat16>({2, 2, 2}, zero, loom::amp::static_loss_scaler(1.f));
    const auto h = losses_with<loom::half>({2, 2, 2}, zero, loom::amp::dynamic_loss_scaler{});
    for (int s = 0; s < steps; ++s) {
      CAPTURE(s);
      CHECK(std::abs(bf[std::size_t(s)] - ref[std::size_t(s)]) <= 2e-2 * ref[std::size_t(s)]);
      CHECK(std::abs(h[std::size_t(s)] - ref[std::size_t(s)]) <= 1e-2 * ref[std::size_t(s)]);
    }
    // and they are not the fp32 run itself: storage rounding shows in the losses
    CHECK(bf.back() != ref.back());
  }
}

TEST_CASE("activation checkpointing in the 3D trainer: the same run, bit for bit, with fewer activation bytes") {
  // 8 layers over 2 stages, 1F1B with 4 micro-batches: stage 0 keeps up to 2 in flight.
  auto o = options({1, 2, 2}, 3, "1f1b", 4);
  const auto cfg = tiny(false, 8);
  auto run_ckpt = [&](bool ckpt, std::vector<std::size_t>& peak) {
    run_result out;
    o.checkpointing = ckpt;
    peak.assign(4, 0);
    train3d_suite::run_ranks(4, [&](any_comm& world) {
      loom::host_memory_resource mr("rank");
      trainer_t t(world, cfg, o, mr);
      run_result r;
      for (int s = 0; s < 5; ++s)
        r.losses.push_back(t.step([&](std::int64_t step, int g, std::span<std::int32_t> tok, std::span<std::int32_t> tgt) {
                              llama3d::counting_batch(7, step, g, o.micro_batch_size, o.seq, cfg.vocab, tok, tgt);
                            }).loss);
      r.master = t.consolidated_master();
      peak[static_cast<std::size_t>(world.rank())] = mr.peak_bytes();
      if (world.rank() == 0) out = r;
    });
    return out;
  };
  std::vector<std::size_t> peak_full, peak_ckpt;
  const run_result full = run_ckpt(false, peak_full), ckpt = run_ckpt(true, peak_ckpt);
  CHECK(ckpt.losses == full.losses);  // recomputation repeats the same arithmetic
  CHECK(ckpt.master == full.master);
  for (std::size_t r = 0; r < 4; ++r) {
    CAPTURE(r);
    CHECK(peak_ckpt[r] < peak_full[r]);
  }
}

TEST_CASE("forward-only evaluation under ZeRO-3 on every mesh: the mean loss of llama::model on the trained weights; training unchanged") {
  // Oracle: the single-rank model with the consolidated fp32 master (the trainer's double
  // parameters are that master) run over the same held-out micro-batches.
  const int m = 2;
  const auto cfg = tiny(false);
  const std::int64_t held_out = 1000;  // a step index the training never reads
  struct result {
    double eval = 0;
    std::vector<double> losses;  // 2 steps, evaluate, 2 more steps
    std::vector<float> master;   // after the first 2 steps
  };
  auto run_eval = [&](loom::comm::mesh_shape mesh, int mm, bool with_eval) {
    auto o = options(mesh, 3, "1f1b", mm);
    result out;
    train3d_suite::run_ranks(mesh.size(), [&](any_comm& world) {
      trainer_t t(world, cfg, o, loom::default_resource<loom::host>());
      auto data = [&](std::int64_t step, int g, std::span<std::int32_t> tok, std::span<std::int32_t> tgt) {
        llama3d::counting_batch(7, step, g, o.micro_batch_size, o.seq, cfg.vocab, tok, tgt);
      };
      result r;
      for (int s = 0; s < 2; ++s) r.losses.push_back(t.step(data).loss);
      r.master = t.consolidated_master();
      if (with_eval) r.eval = t.evaluate(data, held_out);
      for (int s = 0; s < 2; ++s) r.losses.push_back(t.step(data).loss);
      if (world.rank() == 0) out = r;
    });
    return out;
  };
  const result base = run_eval({1, 1, 1}, 2 * m, true), plain = run_eval({1, 1, 1}, 2 * m, false);
  CHECK(base.losses == plain.losses);  // evaluation changes nothing of the training
  llama::model<double, double> ref(cfg);
  REQUIRE(ref.params().size() == base.master.size());
  for (std::size_t i = 0; i < base.master.size(); ++i) ref.params()[i] = double(base.master[i]);
  double want = 0;
  const auto o1 = options({1, 1, 1}, 3, "1f1b", 2 * m);
  std::vector<std::int32_t> tok(std::size_t(o1.micro_batch_size * o1.seq)), tgt(tok.size());
  for (int g = 0; g < 2 * m; ++g) {
    llama3d::counting_batch(7, held_out, g, o1.micro_batch_size, o1.seq, cfg.vocab, tok, tgt);
    want += ref.forward(loom::make_view(static_cast<const std::int32_t*>(tok.data()), o1.micro_batch_size, o1.seq),
                        loom::make_view(static_cast<const std::int32_t*>(tgt.data()), o1.micro_batch_size, o1.seq)) /
            double(2 * m);
  }
  CHECK(base.eval == doctest::Approx(want).epsilon(1e-10));
  for (auto mesh : {loom::comm::mesh_shape{2, 2, 2}, {1, 2, 2}, {2, 1, 1}}) {
    CAPTURE(mesh.dp);
    CAPTURE(mesh.tp);
    CAPTURE(mesh.pp);
    const result r = run_eval(mesh, 2 * m / mesh.dp, true);
    CHECK(r.eval == doctest::Approx(base.eval).epsilon(1e-10));
  }
}
