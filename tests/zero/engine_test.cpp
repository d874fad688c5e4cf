// The ZeRO engine on thread ranks: every stage x data-parallel size trains the toy model for
// 20 steps and must reproduce a naive single-rank trainer (own forward/backward loop and
// own AdamW, no engine) within 1e-5; the model's gradient is checked against finite
// differences; per-rank model-state memory, measured by the memory resources, must match
// the ZeRO formulas; optimizer offload to cpu and to an nvme file gives the same losses, and
// with optimizer groups each group's moments are created (in memory or a file) when it first trains.
#include <loom/zero/engine.hpp>

#include <loom/comm/thread_comm.hpp>
#include "support/engine_check.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <filesystem>
#include <vector>

using namespace loom;
using test::toy_mlp;

namespace {

using namespace loom::test;

template <class Stage, class T>
run_result engine_run(int world, const zero::engine_options& o, std::size_t L = kLayers, std::size_t D = kWidth,
                      std::size_t steps = kSteps) {
  run_result out;
  comm::run_ranks(world, [&](comm::thread_comm& c) {
    run_result r = rank_run<Stage, T>(c, o, L, D, steps);
    if (c.rank() == 0) out = r;
  });
  return out;
}

}  // namespace

TEST_CASE("toy model gradient matches finite differences") {
  const std::size_t L = 3, D = 5, B = 4;
  const auto specs = toy_mlp::specs(L, D);
  zero::flat_layout lay(specs, 1);
  std::vector<std::vector<double>> dummy;
  std::vector<std::vector<float>> w(specs.size()), g(specs.size());
  std::vector<float*> wp, gp;
  for (std::size_t p = 0; p < specs.size(); ++p) {
    w[p].resize(specs[p].numel());
    toy_mlp::init(D, p, 0, w[p]);
    g[p].resize(w[p].size());
    wp.push_back(w[p].data());
    gp.push_back(g[p].data());
  }
  toy_mlp model(L, D);
  model.set_batch(0, 0, B);
  auto loss = [&] {
    for (std::size_t l = 0; l < L; ++l) model.forward<float>(l, zero::layer_params<const float>(lay, l, wp.data()));
    return double(model.loss());
  };
  loss();
  for (std::size_t l = L; l-- > 0;)
    model.backward<float>(l, zero::layer_params<const float>(lay, l, wp.data()), zero::layer_params<float>(lay, l, gp.data()));
  for (std::size_t p = 0; p < specs.size(); ++p)
    for (std::size_t i = 0; i < w[p].size(); i += 3) {
      const float keep = w[p][i], h = 1e-2f;
      w[p][i] = keep + h;
      const double up = loss();
      w[p][i] = keep - h;
      const double down = loss();
      w[p][i] = keep;
      INFO(specs[p].name, "[", i, "]");
      CHECK(g[p][i] == doctest::Approx((up - down) / (2 * h)).epsilon(2e-2).scale(1e-2));
    }
}

TEST_CASE("stages 0-3 x dp 1, 2, 4 reproduce the single-rank trainer (20 steps, 1e-5)") {
  const run_result ref = reference_run(kLayers, kWidth, kBatch, kSteps, kAdam);
  CHECK(ref.losses.back() < ref.losses.front());  // it trains
  const zero::engine_options o = small_options();
  for (int world : {1, 2, 4}) {
    INFO("dp=", world);
    SUBCASE("stage 0") { check_close(engine_run<zero::stage0, float>(world, o), ref, 1e-5); }
    SUBCASE("stage 1") { check_close(engine_run<zero::stage1, float>(world, o), ref, 1e-5); }
    SUBCASE("stage 2") { check_close(engine_run<zero::stage2, float>(world, o), ref, 1e-5); }
    SUBCASE("stage 3") { check_close(engine_run<zero::stage3, float>(world, o), ref, 1e-5); }
  }
}

TEST_CASE("scheduler knobs do not change the result") {
  const run_result ref = reference_run(kLayers, kWidth, kBatch, kSteps, kAdam);
  zero::engine_options o = small_options();
  SUBCASE("no contiguous gradients, no overlap") {
    o.contiguous_gradients = false;
    o.overlap_comm = false;
    check_close(engine_run<zero::stage2, float>(4, o), ref, 1e-5);
    check_close(engine_run<zero::stage3, float>(2, o), ref, 1e-5);
  }
  SUBCASE("one bucket per layer, no prefetch, nothing persistent") {
    o.reduce_bucket_numel = 1;
    o.stage3 = {0, 156, 0};
    check_close(engine_run<zero::stage3, float>(4, o), ref, 1e-5);
  }
  SUBCASE("everything in one bucket, all persistent") {
    o.reduce_bucket_numel = 1 << 20;
    o.stage3 = {1 << 20, 1 << 20, 1 << 20};
    check_close(engine_run<zero::stage3, float>(2, o), ref, 1e-5);
  }
}

TEST_CASE("gradient clipping by global norm matches the reference") {
  const run_result ref = reference_run(kLayers, kWidth, kBatch, kSteps, kAdam, 0.05);
  CHECK_FALSE(ref.final_master == reference_run(kLayers, kWidth, kBatch, kSteps, kAdam).final_master);
  zero::engine_options o = small_options();
  o.gradient_clipping = 0.05f;
  check_close(engine_run<zero::stage0, float>(2, o), ref, 1e-5);
  check_close(engine_run<zero::stage1, float>(4, o), ref, 1e-5);
  check_close(engine_run<zero::stage3, float>(4, o), ref, 1e-5);
}

namespace {
// A model whose gradient on rank 1 is infinite (an fp16 overflow on one rank).
struct overflowing_model {
  int rank;
  template <class T> void forward(std::size_t, const zero::layer_params<const T>&) {}
  template <class T>
  void backward(std::size_t, const zero::layer_params<const T>&, const zero::layer_params<T>& g) {
    for (std::size_t k = 0; k < g.size(); ++k)
      for (auto& x : g.span(k)) x = rank == 1 ? T(INFINITY) : T(1.f);
  }
};
}  // namespace

TEST_CASE("an overflow on one rank skips the step on every rank") {
  comm::run_ranks(2, [](comm::thread_comm& c) {
    host_memory_resource states("states"), scratch("scratch"), host("host");
    zero::engine<zero::stage2, float, comm::thread_comm> e(
        c, zero::flat_layout(toy_mlp::specs(2, 4), 2), small_options(), {&states, &scratch, &host},
        [](std::size_t p, std::size_t first, std::span<float> v) { toy_mlp::init(4, p, first, v); });
    const std::vector<float> before = e.gather_master();
    overflowing_model m{c.rank()};
    e.forward(m);
    e.backward(m);
    CHECK_FALSE(e.step());
    CHECK(e.steps_taken() == 0);
    CHECK(e.gather_master() == before);
  });
}

TEST_CASE("half parameters and gradients track the fp32 run") {
  const run_result ref = reference_run(kLayers, kWidth, kBatch, kSteps, kAdam);
  const run_result h = engine_run<zero::stage3, half>(4, small_options());
  for (std::size_t s = 0; s < kSteps; ++s) CHECK(std::abs(h.losses[s] - ref.losses[s]) <= 2e-2 * ref.losses[s]);
}

TEST_CASE("per-rank model-state memory matches the ZeRO formulas") {
  // Ψ = 4 layers x (64x64 + 64); half parameters and gradients, fp32 Adam (12 bytes)
  const std::size_t L = 4, D = 64;
  const double psi = double(L * (D * D + D));
  zero::engine_options o = small_options();
  o.reduce_bucket_numel = 5000;
  o.stage3 = {5000, 10000, D};  // biases persistent
  for (int world : {2, 4}) {
    const double n = world;
    auto check = [&](const run_result& r, double formula, const char* what) {
      INFO(std::string(what), " dp=", world, " measured=", r.states_current, " formula=", formula, " persistent=", r.persistent_bytes);
      MESSAGE(std::string(what), " dp=", world, ": measured ", r.states_current, " B, formula ", formula, " B, persistent ", r.persistent_bytes, " B");
      CHECK(std::abs(double(r.states_current) - formula) <= 0.05 * formula + double(r.persistent_bytes));
      CHECK(r.states_current == r.bytes.parameters + r.bytes.persistent + r.bytes.gradients + r.bytes.optimizer);
    };
    check(engine_run<zero::stage0, half>(world, o, L, D, 1), 16 * psi, "stage 0");
    check(engine_run<zero::stage1, half>(world, o, L, D, 1), 4 * psi + 12 * psi / n, "stage 1");
    check(engine_run<zero::stage2, half>(world, o, L, D, 1), 2 * psi + 14 * psi / n, "stage 2");
    check(engine_run<zero::stage3, half>(world, o, L, D, 1), 16 * psi / n, "stage 3");
  }
}

TEST_CASE("optimizer offload to cpu and nvme: same losses, state off the device, file removed") {
  const zero::engine_options base = small_options();
  const run_result in_memory = engine_run<zero::stage3, float>(2, base);
  zero::engine_options cpu = base;
  cpu.offload_optimizer = zero::offload_device::cpu;
  const run_result on_cpu = engine_run<zero::stage3, float>(2, cpu);
  CHECK(on_cpu.losses == in_memory.losses);
  CHECK(on_cpu.final_master == in_memory.final_master);
  CHECK(on_cpu.host_current == on_cpu.bytes.optimizer);
  CHECK(on_cpu.states_current == on_cpu.bytes.parameters + on_cpu.bytes.persistent + on_cpu.bytes.gradients);

  const auto dir = std::filesystem::temp_directory_path() / "loom_zero_engine_nvme";
  std::filesystem::create_directories(dir);
  zero::engine_options nvme = base;
  nvme.offload_optimizer = zero::offload_device::nvme;
  nvme.nvme_path = dir.string();
  const run_result on_nvme = engine_run<zero::stage2, float>(4, nvme);
  const run_result stage2_mem = engine_run<zero::stage2, float>(4, base);
  CHECK(on_nvme.losses == stage2_mem.losses);
  CHECK(on_nvme.final_master == stage2_mem.final_master);
  CHECK(on_nvme.host_current == 0);
  CHECK(std::filesystem::is_empty(dir));
  std::filesystem::remove(dir);
}

namespace {
// Two optimizer groups over the toy model (group 0: its first parameter, group 1: its last,
// the others in no group), group 1 frozen until step `unfreeze`. Returns the run and, per
// step, the optimizer bytes the engine reports, the formula's, and the bytes of the files
// in `dir` (nvme; empty: not looked at).
struct grouped_run {
  run_result r;
  std::vector<std::size_t> engine_bytes, file_bytes, expected;
};
template <class Stage>
grouped_run run_grouped(int world, const zero::engine_options& o, std::size_t unfreeze, const std::filesystem::path& dir) {
  grouped_run out;
  const std::size_t L = kLayers, D = kWidth;
  comm::run_ranks(world, [&](comm::thread_comm& c) {
    const std::size_t w = std::size_t(c.size()), rank = std::size_t(c.rank());
    host_memory_resource states("states"), scratch("scratch"), host("host");
    toy_mlp model(L, D);
    const zero::flat_layout lay(toy_mlp::specs(L, D), w);
    const auto& sz = lay.sizes();
    zero::engine<Stage, float, comm::thread_comm> e(c, lay, o, {&states, &scratch, &host},
                                                    [D](std::size_t p, std::size_t first, std::span<float> v) { toy_mlp::init(D, p, first, v); });
    // group 0: the first parameter; group 1: the last; the others in no group
    const std::size_t last = sz.params() - 1;
    e.set_groups({{sz.offset(0), sz.offset(0) + sz.padded_numel(0), 0}, {sz.offset(last), sz.offset(last) + sz.padded_numel(last), 1}}, 2);
    e.set_group(1, o.adamw, false);
    // this rank's elements per group, from the layout (stage 0: the whole padded layout)
    std::size_t N = 0, n[3] = {0, 0, 0};
    for (std::size_t p = 0; p < sz.params(); ++p) {
      const std::size_t mine = Stage::shards_optimizer::value ? sz.shard_numel(p) : sz.padded_numel(p);
      N += mine;
      n[p == 0 ? 0 : p == last ? 1 : 2] += mine;
    }
    grouped_run g;
    const std::size_t local = kBatch / w;
    for (std::size_t s = 0; s < kSteps; ++s) {
      if (s == unfreeze) e.set_group(1, o.adamw, true);
      model.set_batch(s, rank * local, local);
      e.forward(model);
      float loss = model.loss();
      c.all_reduce(std::span<const float>(&loss, 1), std::span<float>(&loss, 1), comm::reduce_op::avg);
      g.r.losses.push_back(loss);
      e.backward(model);
      e.step();
      g.engine_bytes.push_back(e.bytes().optimizer);
      g.expected.push_back(4 * N + 8 * (n[0] + n[2] + (s >= unfreeze ? n[1] : 0)));
      c.barrier();
      if (rank == 0 && !dir.empty()) {
        std::size_t files = 0;
        for (const auto& f : std::filesystem::directory_iterator(dir)) files += std::filesystem::file_size(f.path());
        g.file_bytes.push_back(files);
      }
      c.barrier();
    }
    g.r.final_master = e.gather_master();
    if (rank == 0) out = std::move(g);
  });
  return out;
}
}  // namespace

TEST_CASE("lazy group moments with nvme offload: each group's file is created when it first trains; same bits as in memory") {
  // Per rank, with N its fp32 master elements and n_g its elements of group g (n_none: in no
  // group): optimizer bytes after step s = 4 N + 8 (n_0 + n_none + [s >= unfreeze] n_1), in
  // the engine's accounting and, with nvme offload, in the files under nvme_path.
  const auto dir = std::filesystem::temp_directory_path() / "loom_zero_engine_nvme_groups";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  zero::engine_options mem = small_options(), nvme = mem;
  nvme.offload_optimizer = zero::offload_device::nvme;
  nvme.nvme_path = dir.string();
  const std::size_t unfreeze = 5;
  const auto check = [&](const grouped_run& on_nvme, const grouped_run& in_memory, int world) {
    INFO("world=", world);
    CHECK(on_nvme.r.losses == in_memory.r.losses);
    CHECK(on_nvme.r.final_master == in_memory.r.final_master);
    CHECK(on_nvme.engine_bytes == on_nvme.expected);
    CHECK(in_memory.engine_bytes == on_nvme.expected);
    // every rank's files are in dir: world times rank 0's figure (the toy layout divides evenly)
    REQUIRE(on_nvme.file_bytes.size() == on_nvme.expected.size());
    for (std::size_t s = 0; s < on_nvme.expected.size(); ++s) {
      INFO("step ", s);
      CHECK(on_nvme.file_bytes[s] == std::size_t(world) * on_nvme.expected[s]);
    }
    CHECK(on_nvme.expected[unfreeze] > on_nvme.expected[unfreeze - 1]);
    CHECK(std::filesystem::is_empty(dir));
  };
  check(run_grouped<zero::stage0>(1, nvme, unfreeze, dir), run_grouped<zero::stage0>(1, mem, unfreeze, {}), 1);
  check(run_grouped<zero::stage2>(2, nvme, unfreeze, dir), run_grouped<zero::stage2>(2, mem, unfreeze, {}), 2);
  check(run_grouped<zero::stage3>(2, nvme, unfreeze, dir), run_grouped<zero::stage3>(2, mem, unfreeze, {}), 2);
  std::filesystem::remove(dir);
}

TEST_CASE("engine: bad configuration is a clear error") {
  comm::run_ranks(2, [](comm::thread_comm& c) {
    host_memory_resource states("states"), scratch("scratch"), host("host");
    auto init = [](std::size_t, std::size_t, std::span<float>) {};
    CHECK_THROWS_WITH_AS((zero::engine<zero::stage3, float, comm::thread_comm>(
                             c, zero::flat_layout(toy_mlp::specs(2, 8), 4), {}, {&states, &scratch, &host}, init)),
                         doctest::Contains("world=4"), loom::error);
    zero::engine_options o;
    o.stage3 = {10, 10, 0};
    CHECK_THROWS_WITH_AS((zero::engine<zero::stage3, float, comm::thread_comm>(
                             c, zero::flat_layout(toy_mlp::specs(2, 8), 2), o, {&states, &scratch, &host}, init)),
                         doctest::Contains("stage3_max_live_parameters=10"), loom::error);
  });
}

namespace {
// The toy model driven through the engine's phases, as a pipeline stage drives it: layers
// acquired in the gather trace's order, gradients assigned into accumulation(), then
// reduce_accumulated, this rank's slices for the norm, apply.
template <class Stage>
run_result phases_run(int world) {
  run_result out;
  comm::run_ranks(world, [&](comm::thread_comm& c) {
    host_memory_resource states("states"), scratch("scratch"), host("host");
    const std::size_t L = kLayers, D = kWidth;
    toy_mlp model(L, D);
    zero::engine<Stage, float, comm::thread_comm> e(
        c, zero::flat_layout(toy_mlp::specs(L, D), std::size_t(world)), small_options(), {&states, &scratch, &host},
        [D](std::size_t p, std::size_t first, std::span<float> v) { toy_mlp::init(D, p, first, v); });
    const auto& sz = e.layout().sizes();
    std::vector<float*> ptrs(sz.params()), gptrs(sz.params());
    run_result r;
    const std::size_t local = kBatch / std::size_t(world);
    for (std::size_t s = 0; s < kSteps; ++s) {
      model.set_batch(s, std::size_t(c.rank()) * local, local);
      auto use = [&](std::size_t l, auto&& fn) {
        e.acquire_layer(l);
        for (std::size_t p = sz.layer_begin(l); p < sz.layer_end(l); ++p) {
          ptrs[p] = e.parameter(p).data();
          gptrs[p] = e.accumulation().data() + sz.offset(p);
        }
        fn(zero::layer_params<const float>(e.layout(), l, ptrs.data()), zero::layer_params<float>(e.layout(), l, gptrs.data()));
        e.release_layer(l);
      };
      for (std::size_t l = 0; l < L; ++l) use(l, [&](const auto& p, const auto&) { model.forward(l, p); });
      float loss = model.loss();
      c.all_reduce(std::span<const float>(&loss, 1), std::span<float>(&loss, 1), comm::reduce_op::avg);
      r.losses.push_back(loss);
      for (std::size_t l = L; l-- > 0;) use(l, [&](const auto& p, const auto& g) { model.backward(l, p, g); });
      e.reduce_accumulated();
      double sq = 0;
      std::size_t counted = 0;
      e.for_each_gradient_slice([&](std::size_t, std::span<const float> g) {
        for (float x : g) sq += double(x) * x;
        counted += g.size();
      });
      c.all_reduce(std::span<const std::size_t>(&counted, 1), std::span<std::size_t>(&counted, 1), comm::reduce_op::sum);
      CHECK(counted == sz.padded_total());  // the slices of the ranks partition the gradient
      e.apply(1.f / float(world));
    }
    // A driver of the phases holds none of backward()'s bucket buffers: its scratch is the
    // accumulation buffer (ZeRO-2/3: stages 0-1 accumulate into the gradients) and stage 3's
    // gather arena, nothing else.
    std::size_t want = 0;
    if constexpr (Stage::shards_gradients::value) want += sz.padded_total() * sizeof(float);
    if constexpr (Stage::shards_parameters::value) want += e.gatherer()->plan().arena_numel * sizeof(float);
    CHECK(scratch.current_bytes() == want);
    r.final_master = e.gather_master();
    if (c.rank() == 0) out = r;
  });
  return out;
}
}  // namespace

TEST_CASE("engine phases (acquire/release, accumulation, reduce, slices, apply) reproduce forward/backward/step") {
  for (int world : {1, 2, 4}) {
    CAPTURE(world);
    check_close(phases_run<zero::stage0>(world), engine_run<zero::stage0, float>(world, small_options()), 1e-6);
    check_close(phases_run<zero::stage1>(world), engine_run<zero::stage1, float>(world, small_options()), 1e-6);
    check_close(phases_run<zero::stage2>(world), engine_run<zero::stage2, float>(world, small_options()), 1e-6);
    check_close(phases_run<zero::stage3>(world), engine_run<zero::stage3, float>(world, small_options()), 1e-6);
  }
}

TEST_CASE("engine phases: a layer asked for out of the gather trace's order is an error naming both") {
  comm::run_ranks(2, [](comm::thread_comm& c) {
    host_memory_resource states("states"), scratch("scratch"), host("host");
    zero::engine<zero::stage3, float, comm::thread_comm> e(
        c, zero::flat_layout(toy_mlp::specs(2, 4), 2), small_options(), {&states, &scratch, &host},
        [](std::size_t p, std::size_t first, std::span<float> v) { toy_mlp::init(4, p, first, v); });
    CHECK_THROWS_WITH_AS(e.acquire_layer(1), doctest::Contains("layer 1 asked for at step 0 of the gather trace, which expects layer 0"),
                         loom::error);
    e.acquire_layer(0);
    CHECK_THROWS_WITH_AS(e.release_layer(1), doctest::Contains("layer 1 was not acquired"), loom::error);
    e.release_layer(0);
    CHECK_THROWS_WITH_AS(e.set_gather_trace({}), doctest::Contains("only between traces"), loom::error);
  });
}
