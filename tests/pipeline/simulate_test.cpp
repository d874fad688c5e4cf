// The simulator against closed forms derived on paper (never from the simulator):
//   GPipe, 1F1B with forward f and backward b per stage: every stage is busy m(f+b) and the
//   step takes (m+p-1)(f+b), so idle/total = (p-1)/(m+p-1) on every stage.
//   Interleaved with v chunks (each costs f/v, b/v): the bubble is (p-1)(f+b)/v, so
//   idle/busy = (p-1)/(v m) = (1F1B's idle/busy) / v and idle/total = (p-1)/(v m + p-1).
//   Peak in-flight activations: GPipe m; 1F1B min(p-s, m) (p-s-1 warm-up forwards + 1);
//   interleaved min(v p - s, v m) chunk activations.
// And deliberately broken schedules, which must be reported (never hang).
#include <loom/pipeline/simulate.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <string>
#include <utility>

namespace lp = loom::pipeline;

namespace {

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

bool any_problem_contains(const lp::simulation& r, const std::string& part) {
  return std::any_of(r.problems.begin(), r.problems.end(), [&](const std::string& p) { return contains(p, part); });
}

std::size_t index_of(const std::vector<lp::op>& ops, const lp::op& o) {
  const auto it = std::find(ops.begin(), ops.end(), o);
  REQUIRE(it != ops.end());
  return static_cast<std::size_t>(it - ops.begin());
}

}  // namespace

TEST_CASE("GPipe and 1F1B: bubble (p-1)/(m+p-1) on every stage, for p in 1..8 and m in 1..32") {
  for (int p = 1; p <= 8; ++p)
    for (int m = 1; m <= 32; ++m)
      for (const lp::schedule& s : {lp::gpipe(p, m), lp::one_f_one_b(p, m)}) {
        CAPTURE(s.name);
        CAPTURE(p);
        CAPTURE(m);
        const lp::simulation r = lp::simulate(s, {.forward = 1, .backward = 2});
        REQUIRE(r.ok());
        const double expected = double(p - 1) / double(m + p - 1);
        CHECK(r.total_time == doctest::Approx(3.0 * (m + p - 1)));
        for (int st = 0; st < p; ++st) {
          CHECK(r.bubble_fraction(st) == doctest::Approx(expected).epsilon(1e-12));
          CHECK(r.per_stage[static_cast<std::size_t>(st)].busy == doctest::Approx(3.0 * m));
        }
        CHECK(r.bubble_ratio() == doctest::Approx(double(p - 1) / m).epsilon(1e-12));
      }
}

TEST_CASE("interleaved: the 1F1B bubble divided by v, for p in 1..8, m in 1..32 (multiples of p), v in 1..4") {
  for (int p = 1; p <= 8; ++p)
    for (int m = p; m <= 32; m += p) {
      const lp::simulation base = lp::simulate(lp::one_f_one_b(p, m));
      REQUIRE(base.ok());
      for (int v = 1; v <= 4; ++v) {
        CAPTURE(p);
        CAPTURE(m);
        CAPTURE(v);
        const lp::simulation r = lp::simulate(lp::interleaved_one_f_one_b(p, m, v), {.forward = 1, .backward = 2});
        REQUIRE(r.ok());
        // Narayanan et al.: bubble time / ideal time = (1/v) (p-1)/m.
        CHECK(r.bubble_ratio() == doctest::Approx(double(p - 1) / m / v).epsilon(1e-12));
        CHECK(r.bubble_ratio() == doctest::Approx(base.bubble_ratio() / v).epsilon(1e-12));
        CHECK(r.total_time == doctest::Approx(3.0 * m + 3.0 * (p - 1) / v).epsilon(1e-12));
        for (int st = 0; st < p; ++st)
          CHECK(r.bubble_fraction(st) == doctest::Approx(double(p - 1) / (double(v) * m + p - 1)).epsilon(1e-12));
      }
    }
}

TEST_CASE("the closed forms hold for other costs too") {
  // f = 2, b = 3 (ratio 1.5): GPipe/1F1B total (m+p-1)(f+b).
  for (const auto& [p, m] : {std::pair{3, 5}, std::pair{5, 2}, std::pair{6, 12}}) {
    const lp::op_costs c{.forward = 2, .backward = 3};
    CHECK(lp::simulate(lp::gpipe(p, m), c).total_time == doctest::Approx(5.0 * (m + p - 1)));
    CHECK(lp::simulate(lp::one_f_one_b(p, m), c).total_time == doctest::Approx(5.0 * (m + p - 1)));
  }
}

TEST_CASE("peak in-flight activations: GPipe m, 1F1B min(p-s, m), interleaved min(vp-s, vm)") {
  for (int p = 1; p <= 8; ++p)
    for (int m = 1; m <= 32; ++m) {
      CAPTURE(p);
      CAPTURE(m);
      const lp::simulation g = lp::simulate(lp::gpipe(p, m));
      const lp::simulation f = lp::simulate(lp::one_f_one_b(p, m));
      for (int s = 0; s < p; ++s) {
        CHECK(g.per_stage[static_cast<std::size_t>(s)].peak_in_flight == m);
        CHECK(f.per_stage[static_cast<std::size_t>(s)].peak_in_flight <= std::min(p - s, m));
        CHECK(f.per_stage[static_cast<std::size_t>(s)].peak_in_flight == std::min(p - s, m));
      }
      if (m % p != 0) continue;
      for (int v = 2; v <= 4; ++v) {
        const lp::simulation r = lp::simulate(lp::interleaved_one_f_one_b(p, m, v));
        for (int s = 0; s < p; ++s)
          CHECK(r.per_stage[static_cast<std::size_t>(s)].peak_in_flight == std::min(v * p - s, v * m));
      }
    }
}

TEST_CASE("communication cost: both stages are busy for a rendezvous transfer") {
  // p=2, m=1, f=1, b=2, transfer 0.5: F0 [0,1], send [1,1.5], F1 [1.5,2.5], B1 [2.5,4.5],
  // send [4.5,5], B0 [5,7]. Stage 0 is busy 3 of 7, stage 1 busy 3 of 7.
  const lp::simulation r = lp::simulate(lp::gpipe(2, 1), {.forward = 1, .backward = 2, .communication = 0.5});
  REQUIRE(r.ok());
  CHECK(r.total_time == doctest::Approx(7.0));
  CHECK(r.bubble_fraction(0) == doctest::Approx(4.0 / 7.0));
  CHECK(r.bubble_fraction(1) == doctest::Approx(4.0 / 7.0));
  const auto& t1 = r.per_stage[1].timeline;
  REQUIRE(t1.size() == 5);
  CHECK(t1[0].o.kind == lp::op_kind::recv_activation);
  CHECK(t1[0].start == doctest::Approx(1.0));
  CHECK(t1[0].end == doctest::Approx(1.5));
  CHECK(t1[1].start == doctest::Approx(1.5));
}

TEST_CASE("a dropped recv is reported, not hung") {
  using K = lp::op_kind;
  lp::schedule s = lp::one_f_one_b(2, 4);
  auto& ops1 = s.ops[1];
  ops1.erase(ops1.begin() + static_cast<std::ptrdiff_t>(index_of(ops1, {K::recv_activation, 2, 0, 0})));
  const lp::simulation r = lp::simulate(s);
  CHECK_FALSE(r.ok());
  CHECK(r.deadlock);
  // Stage 1 forwards mb 2 without its input, then both stages try to send to each other.
  CHECK(any_problem_contains(r, "stage 1, op #8 forward(mb 2, chunk 0): runs before its input activation was received"));
  REQUIRE(r.stuck.size() == 2);
  CHECK(r.stuck[0].stage == 0);
  CHECK(r.stuck[0].o == lp::op{K::send_activation, 2, 0, 1});
  CHECK(r.stuck[1].stage == 1);
  CHECK(r.stuck[1].o == lp::op{K::send_gradient, 2, 0, 0});
  const std::string report = r.report();
  CHECK(contains(report, "DEADLOCK"));
  CHECK(contains(report, "deadlock: stage 0 is stuck at op #8 send_activation(mb 2, chunk 0, to stage 1); stage 1 is at op #"));
  CHECK_THROWS_AS(lp::prove(s), loom::error);
}

TEST_CASE("a swapped send/recv order is reported as a deadlock with the stuck op of every stage") {
  using K = lp::op_kind;
  lp::schedule s = lp::one_f_one_b(2, 4);
  auto& ops0 = s.ops[0];
  const std::size_t a = index_of(ops0, {K::recv_gradient, 1, 0, 1}), b = index_of(ops0, {K::send_activation, 2, 0, 1});
  std::swap(ops0[a], ops0[b]);  // stage 0 now sends mb 2 before it takes the gradient of mb 1
  const lp::simulation r = lp::simulate(s);
  CHECK(r.deadlock);
  REQUIRE(r.stuck.size() == 2);
  CHECK(r.stuck[0].o == lp::op{K::send_activation, 2, 0, 1});
  CHECK(r.stuck[0].index == std::min(a, b));
  CHECK(r.stuck[1].o == lp::op{K::send_gradient, 1, 0, 0});
  // A larger pipeline: stage 2 of 4 swaps two receives; everything upstream and downstream stops.
  lp::schedule g = lp::gpipe(4, 3);
  auto& ops2 = g.ops[2];
  std::swap(ops2[index_of(ops2, {K::recv_activation, 0, 0, 1})], ops2[index_of(ops2, {K::recv_activation, 1, 0, 1})]);
  const lp::simulation rg = lp::simulate(g);
  CHECK(rg.deadlock);
  REQUIRE(rg.stuck.size() == 4);
  CHECK(rg.stuck[2].o == lp::op{K::recv_activation, 1, 0, 1});
  CHECK(rg.stuck[1].o == lp::op{K::send_activation, 0, 0, 2});
  CHECK(rg.stuck[3].o == lp::op{K::recv_activation, 0, 0, 2});
}

TEST_CASE("wrong dependency order, duplicates and missing ops are reported") {
  using K = lp::op_kind;
  {  // backward before forward on a single stage
    lp::schedule s = lp::gpipe(1, 2);
    std::swap(s.ops[0][0], s.ops[0][2]);  // B0 F1 F0 B1
    const lp::simulation r = lp::simulate(s);
    CHECK_FALSE(r.deadlock);
    CHECK(any_problem_contains(r, "backward(mb 0, chunk 0): runs before the forward of this micro-batch"));
  }
  {  // a micro-batch forwarded twice and another never
    lp::schedule s = lp::gpipe(1, 2);
    s.ops[0][1] = {K::forward, 0, 0, -1};
    const lp::simulation r = lp::simulate(s);
    CHECK(any_problem_contains(r, "forwarded a second time"));
    CHECK(any_problem_contains(r, "micro-batch 1, chunk 0 is never forwarded"));
  }
  {  // no optimizer step; an optimizer step before the last backward
    lp::schedule s = lp::gpipe(1, 2);
    s.ops[0].pop_back();
    CHECK(any_problem_contains(lp::simulate(s), "stage 0 never runs the optimizer step"));
    lp::schedule t = lp::gpipe(1, 2);
    std::swap(t.ops[0][3], t.ops[0][4]);
    CHECK(any_problem_contains(lp::simulate(t), "optimizer_step: runs before backward(mb 1, chunk 0)"));
  }
  {  // structure: a wrong peer, an out-of-range micro-batch, a send past the last stage
    lp::schedule s = lp::gpipe(3, 2);
    s.ops[0][1].peer = 2;
    s.ops[1][1].microbatch = 7;
    s.ops[2].insert(s.ops[2].begin(), lp::op{K::send_activation, 0, 0, 0});
    const lp::simulation r = lp::simulate(s);
    CHECK(r.per_stage.empty());  // not simulated: nothing to measure
    CHECK(r.bubble_fraction() == 0.0);
    CHECK_THROWS_AS(r.bubble_fraction(0), loom::error);
    CHECK(any_problem_contains(r, "stage 0, op #1 send_activation(mb 0, chunk 0, to stage 2): peer should be stage 1"));
    CHECK(any_problem_contains(r, "micro-batch out of range [0, 2)"));
    CHECK(any_problem_contains(r, "virtual stage 2 has no next virtual stage"));
  }
  {  // a sender that sends before its forward ran
    lp::schedule s = lp::gpipe(2, 1);
    std::swap(s.ops[0][0], s.ops[0][1]);
    CHECK(any_problem_contains(lp::simulate(s), "sends an activation its forward has not produced"));
  }
}

TEST_CASE("prove() passes sound schedules; bad costs are refused by name") {
  CHECK(lp::prove(lp::interleaved_one_f_one_b(4, 8, 2)).ok());
  CHECK_THROWS_WITH_AS(lp::simulate(lp::gpipe(2, 2), {.forward = -1}), doctest::Contains("forward=-1"), loom::error);
  CHECK_THROWS_WITH_AS(lp::simulate(lp::gpipe(2, 2), {.communication = std::nan("")}), doctest::Contains("communication"),
                       loom::error);
}

TEST_CASE("forward-only (evaluation) schedules: sound for p in 1..6, m in 1..8, v in 1..3, only forwards and activations, (m + p - 1) f for v = 1; a backward refused") {
  // Closed form (v = 1): the last stage starts after the p - 1 forwards of the pipeline fill
  // and then runs its m forwards back to back: (m + p - 1) f.
  for (int p = 1; p <= 6; ++p)
    for (int m = 1; m <= 8; ++m)
      for (int v = 1; v <= 3; ++v) {
        CAPTURE(p);
        CAPTURE(m);
        CAPTURE(v);
        const auto s = lp::forward_only(p, m, v);
        CHECK(s.forward_only);
        const auto r = lp::simulate(s, {1.0 / v, 2.0, 0.0, 0.0});
        CHECK_MESSAGE(r.ok(), r.report());
        for (const auto& ops : s.ops)
          for (const auto& o : ops)
            CHECK((o.kind == lp::op_kind::forward || o.kind == lp::op_kind::send_activation ||
                   o.kind == lp::op_kind::recv_activation));
        if (v == 1) CHECK(r.total_time == doctest::Approx(double(m + p - 1)));
      }
  auto bad = lp::forward_only(2, 2);
  bad.ops[1].push_back(lp::op{lp::op_kind::backward, 0, 0, -1});
  CHECK(any_problem_contains(lp::simulate(bad), "forward-only"));
  auto dropped = lp::forward_only(2, 2);
  dropped.ops[0].erase(dropped.ops[0].begin());  // stage 0 never forwards micro-batch 0
  CHECK_FALSE(lp::simulate(dropped).ok());
}
