#pragma once
// Shared by the ZeRO engine tests (thread ranks and MPI): the toy model's naive single-rank
// trainer (the oracle), one rank's engine run on any communicator, and the comparison.

#include <loom/comm/communicator.hpp>
#include <loom/zero/engine.hpp>

#include <zero/toy_mlp.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace loom::test {

using examples::toy_mlp;

constexpr std::size_t kLayers = 3, kWidth = 12, kBatch = 8, kSteps = 20;
const zero::adamw_config kAdam{0.01f, 0.9f, 0.999f, 1e-8f, 0.01f};

struct run_result {
  std::vector<float> losses;       // global mean loss per step
  std::vector<float> final_master;  // unpadded fp32 master
  zero::state_bytes bytes;
  std::size_t states_current = 0, host_current = 0, persistent_bytes = 0;
};

// Naive oracle: full batch on one rank, plain vectors, AdamW written out in double.
run_result reference_run(std::size_t L, std::size_t D, std::size_t B, std::size_t steps, const zero::adamw_config& c,
                         double clip = 0) {
  const auto specs = toy_mlp::specs(L, D);
  zero::flat_layout lay(specs, 1);
  std::vector<std::vector<float>> w(specs.size()), g(specs.size()), m(specs.size()), v(specs.size());
  std::vector<float*> wp, gp;
  for (std::size_t p = 0; p < specs.size(); ++p) {
    w[p].resize(specs[p].numel());
    toy_mlp::init(D, p, 0, w[p]);
    g[p].resize(w[p].size());
    m[p].resize(w[p].size());
    v[p].resize(w[p].size());
    wp.push_back(w[p].data());
    gp.push_back(g[p].data());
  }
  toy_mlp model(L, D);
  run_result r;
  for (std::size_t s = 0; s < steps; ++s) {
    model.set_batch(s, 0, B);
    for (std::size_t l = 0; l < L; ++l) model.forward<float>(l, zero::layer_params<const float>(lay, l, wp.data()));
    r.losses.push_back(model.loss());
    for (std::size_t l = L; l-- > 0;)
      model.backward<float>(l, zero::layer_params<const float>(lay, l, wp.data()), zero::layer_params<float>(lay, l, gp.data()));
    const double t = double(s + 1);
    double norm = 0;
    for (auto& gv : g)
      for (float x : gv) norm += double(x) * x;
    norm = std::sqrt(norm);
    const double factor = clip > 0 && norm > clip ? clip / norm : 1.0;
    for (std::size_t p = 0; p < specs.size(); ++p)
      for (std::size_t i = 0; i < w[p].size(); ++i) {
        const double gi = g[p][i] * factor;
        m[p][i] = float(c.beta1 * double(m[p][i]) + (1 - c.beta1) * gi);
        v[p][i] = float(c.beta2 * double(v[p][i]) + (1 - c.beta2) * gi * gi);
        const double mh = m[p][i] / (1 - std::pow(double(c.beta1), t)), vh = v[p][i] / (1 - std::pow(double(c.beta2), t));
        w[p][i] = float(double(w[p][i]) * (1 - double(c.lr) * c.weight_decay) - c.lr * mh / (std::sqrt(vh) + c.eps));
      }
  }
  for (auto& x : w) r.final_master.insert(r.final_master.end(), x.begin(), x.end());
  return r;
}

// One rank's run of the engine on any communicator (thread ranks or MPI processes).
template <class Stage, class T, class C>
run_result rank_run(C& c, const zero::engine_options& o, std::size_t L = kLayers, std::size_t D = kWidth,
                    std::size_t steps = kSteps) {
  const std::size_t world = std::size_t(c.size());
  host_memory_resource states("states"), scratch("scratch"), host("host");
  toy_mlp model(L, D);
  run_result r;
  {
    zero::engine<Stage, T, C> e(c, zero::flat_layout(toy_mlp::specs(L, D), world), o, {&states, &scratch, &host},
                                [D](std::size_t p, std::size_t first, std::span<float> v) { toy_mlp::init(D, p, first, v); });
    r.bytes = e.bytes();
    r.states_current = states.current_bytes();
    r.host_current = host.current_bytes();
    if constexpr (Stage::shards_parameters::value) r.persistent_bytes = e.gatherer()->plan().persistent_numel * sizeof(T);
    const std::size_t local = kBatch / world;
    for (std::size_t s = 0; s < steps; ++s) {
      model.set_batch(s, std::size_t(c.rank()) * local, local);
      e.forward(model);
      float loss = model.loss();
      c.all_reduce(std::span<const float>(&loss, 1), std::span<float>(&loss, 1), comm::reduce_op::avg);
      r.losses.push_back(loss);
      e.backward(model);
      e.step();
    }
    r.final_master = e.gather_master();
    CHECK(states.current_bytes() == r.states_current);  // a step allocates no model state
  }
  CHECK(states.current_bytes() == 0);
  CHECK(scratch.current_bytes() == 0);
  return r;
}

void check_close(const run_result& got, const run_result& want, double tol) {
  REQUIRE(got.losses.size() == want.losses.size());
  for (std::size_t s = 0; s < want.losses.size(); ++s) {
    INFO("step ", s);
    CHECK(std::abs(got.losses[s] - want.losses[s]) <= tol * std::abs(want.losses[s]));
  }
  REQUIRE(got.final_master.size() == want.final_master.size());
  double worst = 0;
  for (std::size_t i = 0; i < want.final_master.size(); ++i)
    worst = std::max(worst, std::abs(double(got.final_master[i]) - want.final_master[i]) /
                                std::max(1.0, std::abs(double(want.final_master[i]))));
  CHECK(worst <= tol);
}

zero::engine_options small_options() {
  zero::engine_options o;
  o.adamw = kAdam;
  o.reduce_bucket_numel = 200;  // several buckets
  o.stage3 = {200, 400, kWidth};  // biases persistent, prefetch one layer ahead
  return o;
}

}  // namespace loom::test
