// The executor on thread ranks: the toy model of p*v linear stages under GPipe, 1F1B and
// interleaved 1F1B gives the loss and every stage's weight gradient of the one-process
// reference (tests/pipeline/toy_model.hpp), on thread_comm (buffered sends) and on a mock
// communicator whose sends are rendezvous (mock_comm.hpp).
#include "executor_suite.hpp"
#include "mock_comm.hpp"

#include <loom/comm/thread_comm.hpp>

#include <loom/pipeline/executor.hpp>

#include <doctest/doctest.h>

#include <exception>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace lp = loom::pipeline;
using mock_executor = lp::executor<float, mock::comm>;

namespace {

// Runs f(comm) on `n` mock ranks; rethrows the first exception of any rank.
void on_mock_ranks(int n, const std::function<void(mock::comm&)>& f) {
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

// Runs the toy model on p thread ranks of both communicators and checks every rank.
void check_schedule(const std::string& kind, const toy::sizes& z, int steps = 1) {
  CAPTURE(kind);
  CAPTURE(z.p);
  CAPTURE(z.m);
  CAPTURE(z.v);
  std::vector<toy::rank_result> on_thread(static_cast<std::size_t>(z.p)), on_mock(static_cast<std::size_t>(z.p));
  loom::comm::run_ranks(z.p, [&](loom::comm::thread_comm& c) {
    on_thread[static_cast<std::size_t>(c.rank())] = toy::run_rank(c, kind, z, steps);
  });
  on_mock_ranks(z.p, [&](mock::comm& c) { on_mock[static_cast<std::size_t>(c.rank())] = toy::run_rank(c, kind, z, steps); });
  for (const auto& r : on_thread) toy::check(r, steps);
  for (const auto& r : on_mock) toy::check(r, steps);
}

}  // namespace

TEST_CASE("every schedule reproduces the one-process loss and gradients") {
  for (int p : {1, 2, 3, 4})
    for (int m : {1, 3, 8}) {
      check_schedule("gpipe", {.p = p, .m = m});
      check_schedule("1f1b", {.p = p, .m = m});
    }
  for (int p : {1, 2, 3, 4})
    for (int v : {1, 2, 3}) check_schedule("interleaved", {.p = p, .m = 2 * p, .v = v});
}

TEST_CASE("gradients accumulate over steps; buffers are reused without corruption") {
  check_schedule("1f1b", {.p = 3, .m = 7, .rows = 3, .d = 5}, 3);
  check_schedule("interleaved", {.p = 2, .m = 4, .v = 2}, 2);
  check_schedule("gpipe", {.p = 4, .m = 5, .rows = 1, .d = 2}, 2);
}

TEST_CASE("any schedule the simulator proves, hand-modified or not, runs and gives the reference result") {
  // Random adjacent swaps of ops in generated schedules: each result is either refused by the
  // simulator or, when proven, runs on rendezvous ranks to the reference loss and gradients.
  std::mt19937 rng(20210401);
  int proven = 0, refused = 0;
  for (int trial = 0; trial < 60; ++trial) {
    const toy::sizes z{.p = 3, .m = 3, .v = trial % 2 == 0 ? 1 : 2};
    lp::schedule s = z.v == 1 ? lp::one_f_one_b(3, 3) : lp::interleaved_one_f_one_b(3, 3, 2);
    for (int swaps = 0; swaps < 1 + trial % 4; ++swaps) {
      auto& ops = s.ops[rng() % 3];
      const std::size_t i = rng() % (ops.size() - 2);  // never moves the optimizer step
      std::swap(ops[i], ops[i + 1]);
    }
    if (!lp::simulate(s).ok()) {
      ++refused;
      continue;
    }
    ++proven;
    std::vector<toy::rank_result> results(3);
    on_mock_ranks(3, [&](mock::comm& c) { results[static_cast<std::size_t>(c.rank())] = toy::run_rank(c, s, z); });
    for (const auto& r : results) toy::check(r);
  }
  CHECK(proven > 5);  // both outcomes occur
  CHECK(refused > 5);
}

TEST_CASE("1F1B holds fewer boundary tensors than GPipe") {
  std::vector<int> gpipe_slots(4), f1b_slots(4);
  on_mock_ranks(4, [&](mock::comm& c) {
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
  on_mock_ranks(2, [&](mock::comm& c) {
    CHECK_THROWS_WITH_AS(mock_executor(lp::gpipe(3, 2), c, 4), doctest::Contains("size=2"),
                         loom::error);
    CHECK_THROWS_WITH_AS(mock_executor(lp::gpipe(2, 2), c, 0),
                         doctest::Contains("activation_elements=0"), loom::error);
    // 2 * m * p * v = 32768 tags would pass MPI's guaranteed 32767.
    CHECK_THROWS_WITH_AS(mock_executor(lp::interleaved_one_f_one_b(2, 4096, 2), c, 4), doctest::Contains("m=4096"),
                         loom::error);
    CHECK_NOTHROW(mock_executor(lp::interleaved_one_f_one_b(2, 4094, 2), c, 4));
    lp::schedule broken = lp::one_f_one_b(2, 4);
    std::swap(broken.ops[0][7], broken.ops[0][8]);
    CHECK_THROWS_WITH_AS(mock_executor(broken, c, 4), doctest::Contains("DEADLOCK"), loom::error);
  });
}
