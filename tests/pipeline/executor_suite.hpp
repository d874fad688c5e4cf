#pragma once
// The executor check shared by the thread-rank and the MPI tests: each rank runs the toy model
// (toy_model.hpp) under a schedule and compares its own loss and weight gradients with the
// one-process reference, which every rank computes for itself.
#include "toy_model.hpp"

#include <loom/comm/communicator.hpp>
#include <loom/pipeline/executor.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <string>

namespace toy {

inline loom::pipeline::schedule make(const std::string& kind, const sizes& z) {
  if (kind == "gpipe") return loom::pipeline::gpipe(z.p, z.m);
  if (kind == "1f1b") return loom::pipeline::one_f_one_b(z.p, z.m);
  return loom::pipeline::interleaved_one_f_one_b(z.p, z.m, z.v);
}

struct rank_result {
  bool has_loss = false;  // the rank holding the last virtual stage
  double loss = 0, loss_ref = 0;
  double grad_error = 0;  // max |dW - steps * dW_ref| / max(1, |steps * dW_ref|)
  int optimizer_steps = 0;
};

/// Runs `steps` steps of `plan` (gradients accumulate: no update in between) on this rank.
template <loom::comm::communicator C>
rank_result run_rank(C& comm, const loom::pipeline::schedule& plan, const sizes& z, int steps = 1) {
  const reference ref = run_reference(z);
  loom::pipeline::executor<float, C> ex(plan, comm, z.activation());
  stage model(z, comm.rank());
  for (int i = 0; i < steps; ++i) ex.run(model);
  rank_result r;
  r.has_loss = comm.rank() == z.p - 1;
  r.loss = model.loss;
  r.loss_ref = steps * ref.loss;
  r.optimizer_steps = model.optimizer_steps;
  for (int c = 0; c < z.v; ++c) {
    const auto& got = model.dW[static_cast<std::size_t>(c)];
    const auto& want = ref.dW[static_cast<std::size_t>(model.k(c))];
    for (std::size_t e = 0; e < want.size(); ++e)
      r.grad_error = std::max(r.grad_error, std::abs(got[e] - steps * want[e]) / std::max(1.0, std::abs(steps * want[e])));
  }
  return r;
}

/// The same for the generated schedule `kind` (gpipe, 1f1b, interleaved).
template <loom::comm::communicator C>
rank_result run_rank(C& comm, const std::string& kind, const sizes& z, int steps = 1) {
  return run_rank(comm, make(kind, z), z, steps);
}

/// `tolerance` bounds the gradients' relative error: float sums of many terms need more.
inline void check(const rank_result& r, int steps = 1, double tolerance = 1e-4) {
  if (r.has_loss) CHECK(r.loss == doctest::Approx(r.loss_ref).epsilon(10 * tolerance));
  CHECK(r.grad_error < tolerance);
  CHECK(r.optimizer_steps == steps);
}

}  // namespace toy
