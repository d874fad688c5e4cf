// Schedules as data: argument checks name the values; the generated orders are the published
// ones (hand-written below from the figures of Narayanan et al. 2021, 0-based).
#include <loom/pipeline/schedule.hpp>

#include <doctest/doctest.h>

#include <string>
#include <vector>

namespace lp = loom::pipeline;

namespace {

std::string error_of(auto&& f) {
  try {
    f();
  } catch (const loom::error& e) {
    return e.what();
  }
  return "no error";
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// The compute ops of one stage as "F3" / "B3" (chunk suffix ".c" when v > 1).
std::vector<std::string> compute_order(const lp::schedule& s, int stage) {
  std::vector<std::string> out;
  for (const auto& o : s.ops[static_cast<std::size_t>(stage)]) {
    if (o.kind != lp::op_kind::forward && o.kind != lp::op_kind::backward) continue;
    std::string t(1, o.kind == lp::op_kind::forward ? 'F' : 'B');
    t += std::to_string(o.microbatch);
    if (s.chunks > 1) t.append(".").append(std::to_string(o.chunk));
    out.push_back(t);
  }
  return out;
}

std::vector<std::string> words(const std::string& text) {
  std::vector<std::string> out;
  std::string w;
  for (char c : text + " ") {
    if (c == ' ') {
      if (!w.empty()) out.push_back(w);
      w.clear();
    } else {
      w += c;
    }
  }
  return out;
}

}  // namespace

TEST_CASE("invalid arguments raise loom::error naming the values") {
  CHECK(contains(error_of([] { lp::gpipe(0, 4); }), "p=0"));
  CHECK(contains(error_of([] { lp::gpipe(2, 0); }), "m=0"));
  CHECK(contains(error_of([] { lp::one_f_one_b(-1, 3); }), "p=-1"));
  CHECK(contains(error_of([] { lp::one_f_one_b(3, -2); }), "m=-2"));
  const std::string not_multiple = error_of([] { lp::interleaved_one_f_one_b(4, 6, 2); });
  CHECK(contains(not_multiple, "m=6"));
  CHECK(contains(not_multiple, "p=4"));
  CHECK(contains(error_of([] { lp::interleaved_one_f_one_b(4, 8, 0); }), "v=0"));
  CHECK(contains(error_of([] { lp::interleaved_one_f_one_b(0, 8, 2); }), "p=0"));
  CHECK_NOTHROW(lp::interleaved_one_f_one_b(4, 8, 2));
}

TEST_CASE("GPipe p=2 m=2 is the hand-written op list") {
  using K = lp::op_kind;
  const lp::schedule s = lp::gpipe(2, 2);
  CHECK(s.stages == 2);
  CHECK(s.microbatches == 2);
  CHECK(s.chunks == 1);
  const std::vector<lp::op> stage0 = {
      {K::forward, 0, 0, -1},         {K::send_activation, 0, 0, 1}, {K::forward, 1, 0, -1},
      {K::send_activation, 1, 0, 1},  {K::recv_gradient, 0, 0, 1},   {K::backward, 0, 0, -1},
      {K::recv_gradient, 1, 0, 1},    {K::backward, 1, 0, -1},       {K::optimizer_step, -1, 0, -1}};
  const std::vector<lp::op> stage1 = {
      {K::recv_activation, 0, 0, 0}, {K::forward, 0, 0, -1},       {K::recv_activation, 1, 0, 0},
      {K::forward, 1, 0, -1},        {K::backward, 0, 0, -1},      {K::send_gradient, 0, 0, 0},
      {K::backward, 1, 0, -1},       {K::send_gradient, 1, 0, 0},  {K::optimizer_step, -1, 0, -1}};
  CHECK(s.ops[0] == stage0);
  CHECK(s.ops[1] == stage1);
}

TEST_CASE("1F1B p=4 m=8 runs the order of the PipeDream-Flush figure") {
  // Narayanan et al. 2021, figure 4 (top), devices 1 and 4, micro-batches renumbered from 0.
  const lp::schedule s = lp::one_f_one_b(4, 8);
  CHECK(compute_order(s, 0) == words("F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7"));
  CHECK(compute_order(s, 1) == words("F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 B6 B7"));
  CHECK(compute_order(s, 3) == words("F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7"));
  // More stages than micro-batches: all forwards, then all backwards.
  CHECK(compute_order(lp::one_f_one_b(4, 2), 0) == words("F0 F1 B0 B1"));
}

TEST_CASE("interleaved p=4 m=8 v=2 walks micro-batches in groups of p per chunk") {
  // Forwards: mb 0-3 on chunk 0, mb 0-3 on chunk 1, mb 4-7 on chunk 0, mb 4-7 on chunk 1;
  // backwards the same groups with the chunks reversed; warm-up of p-s-1 + (v-1)p forwards.
  const lp::schedule s = lp::interleaved_one_f_one_b(4, 8, 2);
  CHECK(s.chunks == 2);
  CHECK(compute_order(s, 0) == words("F0.0 F1.0 F2.0 F3.0 F0.1 F1.1 F2.1 "
                                     "F3.1 B0.1 F4.0 B1.1 F5.0 B2.1 F6.0 B3.1 F7.0 B0.0 "
                                     "F4.1 B1.0 F5.1 B2.0 F6.1 B3.0 F7.1 B4.1 "
                                     "B5.1 B6.1 B7.1 B4.0 B5.0 B6.0 B7.0"));
  CHECK(compute_order(s, 3) == words("F0.0 F1.0 F2.0 F3.0 F0.1 B0.1 F1.1 B1.1 F2.1 B2.1 F3.1 B3.1 "
                                     "F4.0 B0.0 F5.0 B1.0 F6.0 B2.0 F7.0 B3.0 "
                                     "F4.1 B4.1 F5.1 B5.1 F6.1 B6.1 F7.1 B7.1 B4.0 B5.0 B6.0 B7.0"));
  // Chunk c of stage s is virtual stage c*p + s: stage 3 chunk 0 sends to stage 0 chunk 1.
  bool wraps = false;
  for (const auto& o : s.ops[3])
    if (o.kind == lp::op_kind::send_activation && o.chunk == 0) wraps = wraps || o.peer == 0;
  CHECK(wraps);
}

TEST_CASE("interleaved with v = 1 is 1F1B; a single stage needs no transfers") {
  for (int p : {1, 2, 3, 4})
    for (int m = p; m <= 4 * p; m += p) CHECK(lp::interleaved_one_f_one_b(p, m, 1).ops == lp::one_f_one_b(p, m).ops);
  const lp::schedule one = lp::interleaved_one_f_one_b(1, 3, 3);
  for (const auto& o : one.ops[0]) CHECK(lp::is_compute(o.kind));
  CHECK(one.ops[0].size() == 3 * 3 * 2 + 1);
}

TEST_CASE("ops print readably") {
  CHECK(lp::to_string({lp::op_kind::send_activation, 3, 1, 2}) == "send_activation(mb 3, chunk 1, to stage 2)");
  CHECK(lp::to_string({lp::op_kind::recv_gradient, 0, 0, 1}) == "recv_gradient(mb 0, chunk 0, from stage 1)");
  CHECK(lp::to_string({lp::op_kind::optimizer_step, -1, 0, -1}) == "optimizer_step");
}
