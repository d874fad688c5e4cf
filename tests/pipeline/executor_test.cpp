// The executor on thread ranks: the toy model of p*v linear stages under GPipe, 1F1B and
// interleaved 1F1B gives the loss and every stage's weight gradient of the one-process
// reference (tests/pipeline/toy_model.hpp).
#include "mock_comm.hpp"
#include "toy_model.hpp"

#include <loom/pipeline/executor.hpp>

#include <doctest/doctest.h>

#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

namespace lp = loom::pipeline;
using mock_executor = lp::executor<float, mock::comm>;

namespace {

// Runs f(comm) on `n` thread ranks; rethrows the first exception of any rank.
void on_ranks(int n, const std::function<void(mock::comm&)>& f) {
  auto w = std::make_shared<mock::world>(n);
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      mock::comm c(w, r);
      try {
        f(c);
      } catch (...) {
        errors[static_cast<std::size_t>(r)] = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

lp::schedule make(const std::string& kind, const toy::sizes& z) {
  if (kind == "gpipe") return lp::gpipe(z.p, z.m);
  if (kind == "1f1b") return lp::one_f_one_b(z.p, z.m);
  return lp::interleaved_one_f_one_b(z.p, z.m, z.v);
}

// Runs `steps` training steps of schedule `kind` and checks loss and gradients against the
// reference (accumulated over the steps: no optimizer update in between).
void check_against_reference(const std::string& kind, toy::sizes z, int steps = 1) {
  CAPTURE(kind);
  CAPTURE(z.p);
  CAPTURE(z.m);
  CAPTURE(z.v);
  const toy::reference ref = toy::run_reference(z);
  std::vector<double> losses(static_cast<std::size_t>(z.p));
  std::vector<std::vector<std::vector<float>>> grads(static_cast<std::size_t>(z.p));
  std::vector<int> optimizer_steps(static_cast<std::size_t>(z.p));
  on_ranks(z.p, [&](mock::comm& c) {
    mock_executor ex(make(kind, z), c, z.activation());
    toy::stage model(z, c.rank());
    for (int i = 0; i < steps; ++i) ex.run(model);
    losses[static_cast<std::size_t>(c.rank())] = model.loss;
    grads[static_cast<std::size_t>(c.rank())] = model.dW;
    optimizer_steps[static_cast<std::size_t>(c.rank())] = model.optimizer_steps;
  });
  // The loss lives on the stage of the last virtual stage, p - 1.
  CHECK(losses[static_cast<std::size_t>(z.p - 1)] == doctest::Approx(steps * ref.loss).epsilon(1e-5));
  for (int s = 0; s < z.p; ++s) {
    CHECK(optimizer_steps[static_cast<std::size_t>(s)] == steps);
    for (int c = 0; c < z.v; ++c) {
      const auto& got = grads[static_cast<std::size_t>(s)][static_cast<std::size_t>(c)];
      const auto& want = ref.dW[static_cast<std::size_t>(c * z.p + s)];
      for (std::size_t e = 0; e < want.size(); ++e) CHECK(got[e] == doctest::Approx(steps * want[e]).epsilon(1e-4));
    }
  }
}

}  // namespace

TEST_CASE("every schedule reproduces the one-process loss and gradients") {
  for (int p : {1, 2, 3, 4})
    for (int m : {1, 3, 8}) {
      check_against_reference("gpipe", {.p = p, .m = m});
      check_against_reference("1f1b", {.p = p, .m = m});
    }
  for (int p : {1, 2, 3, 4})
    for (int v : {1, 2, 3}) check_against_reference("interleaved", {.p = p, .m = 2 * p, .v = v});
}

TEST_CASE("gradients accumulate over steps; buffers are reused without corruption") {
  check_against_reference("1f1b", {.p = 3, .m = 7, .rows = 3, .d = 5}, 3);
  check_against_reference("interleaved", {.p = 2, .m = 4, .v = 2}, 2);
}

TEST_CASE("1F1B holds fewer boundary tensors than GPipe") {
  std::vector<int> gpipe_slots(4), f1b_slots(4);
  on_ranks(4, [&](mock::comm& c) {
    gpipe_slots[static_cast<std::size_t>(c.rank())] = mock_executor(lp::gpipe(4, 16), c, 6).slots();
    f1b_slots[static_cast<std::size_t>(c.rank())] = mock_executor(lp::one_f_one_b(4, 16), c, 6).slots();
  });
  for (int s = 1; s < 4; ++s) {
    CAPTURE(s);
    CHECK(gpipe_slots[static_cast<std::size_t>(s)] >= 16);  // all m inputs are held until the backwards
    CHECK(f1b_slots[static_cast<std::size_t>(s)] <= 2 * (4 - s) + 2);
  }
}

TEST_CASE("bad plans and mismatched groups are refused before any communication") {
  on_ranks(2, [&](mock::comm& c) {
    CHECK_THROWS_WITH_AS(mock_executor(lp::gpipe(3, 2), c, 4), doctest::Contains("size=2"),
                         loom::error);
    CHECK_THROWS_WITH_AS(mock_executor(lp::gpipe(2, 2), c, 0),
                         doctest::Contains("activation_elements=0"), loom::error);
    lp::schedule broken = lp::one_f_one_b(2, 4);
    std::swap(broken.ops[0][7], broken.ops[0][8]);
    CHECK_THROWS_WITH_AS(mock_executor(broken, c, 4), doctest::Contains("DEADLOCK"), loom::error);
  });
}
