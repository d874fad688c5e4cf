// Samplers against closed forms: greedy is the argmax; the frequencies of many draws match
// the temperature / top-k / top-p distribution computed here independently; the penalty
// follows the HF rule; a draw depends only on (seed, position).
#include <doctest/doctest.h>

#include <loom/kv/sampler.hpp>

#include <cmath>
#include <map>
#include <vector>

using namespace loom::kv;

namespace {

// Expected distribution: softmax(logits / T), restricted to top-k then top-p, renormalised.
std::vector<double> expected(const std::vector<float>& logits, float t, int k, float top_p) {
  const int n = static_cast<int>(logits.size());
  std::vector<int> order(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i) order[static_cast<std::size_t>(i)] = i;
  // selection sort, descending (an independent, obviously correct ordering)
  for (int i = 0; i < n; ++i)
    for (int j = i + 1; j < n; ++j)
      if (logits[static_cast<std::size_t>(order[static_cast<std::size_t>(j)])] > logits[static_cast<std::size_t>(order[static_cast<std::size_t>(i)])])
        std::swap(order[static_cast<std::size_t>(i)], order[static_cast<std::size_t>(j)]);
  const int keep_k = k > 0 ? std::min(k, n) : n;
  std::vector<double> p(static_cast<std::size_t>(n), 0.0);
  double z = 0;
  for (int i = 0; i < keep_k; ++i) z += std::exp(double(logits[static_cast<std::size_t>(order[static_cast<std::size_t>(i)])]) / t);
  double cum = 0;
  int keep = 0;
  for (int i = 0; i < keep_k; ++i) {
    cum += std::exp(double(logits[static_cast<std::size_t>(order[static_cast<std::size_t>(i)])]) / t) / z;
    ++keep;
    if (cum >= top_p) break;
  }
  double z2 = 0;
  for (int i = 0; i < keep; ++i) z2 += std::exp(double(logits[static_cast<std::size_t>(order[static_cast<std::size_t>(i)])]) / t);
  for (int i = 0; i < keep; ++i)
    p[static_cast<std::size_t>(order[static_cast<std::size_t>(i)])] = std::exp(double(logits[static_cast<std::size_t>(order[static_cast<std::size_t>(i)])]) / t) / z2;
  return p;
}

}  // namespace

TEST_CASE("greedy picks the argmax, lowest index on ties") {
  sampler s;
  std::vector<float> l{0.1f, 2.f, -1.f, 2.f, 1.9f};
  CHECK(s.sample(l, {}, {}, 0) == 1);
}

TEST_CASE("draw frequencies match temperature / top-k / top-p distributions") {
  const std::vector<float> logits{1.0f, 2.5f, 0.3f, 2.0f, -1.0f, 1.7f, 0.0f, 2.2f};
  struct cfg {
    float t;
    int k;
    float p;
  };
  for (cfg c : {cfg{1.f, 0, 1.f}, cfg{0.7f, 0, 1.f}, cfg{1.f, 3, 1.f}, cfg{1.f, 0, 0.6f}, cfg{1.5f, 5, 0.8f}}) {
    sampler s;
    sampling_params sp;
    sp.temperature = c.t, sp.top_k = c.k, sp.top_p = c.p, sp.seed = 99;
    const int draws = 40000;
    std::vector<double> freq(logits.size(), 0.0);
    for (int i = 0; i < draws; ++i) {
      auto l = logits;
      freq[static_cast<std::size_t>(s.sample(l, sp, {}, i))] += 1.0 / draws;
    }
    auto e = expected(logits, c.t, c.k, c.p);
    CAPTURE(c.t);
    CAPTURE(c.k);
    CAPTURE(c.p);
    for (std::size_t i = 0; i < e.size(); ++i) {
      if (e[i] == 0.0)
        CHECK(freq[i] == 0.0);  // filtered tokens are never drawn
      else
        CHECK(std::abs(freq[i] - e[i]) < 0.012);
    }
  }
}

TEST_CASE("repetition penalty divides positive and multiplies negative logits of seen tokens") {
  sampler s;
  sampling_params sp;
  sp.repetition_penalty = 2.f;
  std::vector<float> l{3.0f, 2.0f, -0.5f, 1.6f};
  std::vector<token_id> hist{0, 0, 2};
  CHECK(s.sample(l, sp, hist, 5) == 1);  // 3.0 -> 1.5 < 2.0
  CHECK(l[0] == doctest::Approx(1.5f));  // applied once despite two occurrences
  CHECK(l[2] == doctest::Approx(-1.0f));
  CHECK(l[3] == doctest::Approx(1.6f));
}

TEST_CASE("a draw depends only on seed and position") {
  sampler a, b;
  sampling_params sp;
  sp.temperature = 1.f, sp.seed = 5;
  std::vector<float> logits(50);
  for (int i = 0; i < 50; ++i) logits[static_cast<std::size_t>(i)] = std::sin(float(i));
  std::vector<token_id> first;
  for (int pos = 0; pos < 100; ++pos) {
    auto l = logits;
    first.push_back(a.sample(l, sp, {}, pos));
  }
  int same = 0, differ = 0;
  for (int pos = 99; pos >= 0; --pos) {  // another sampler, another order
    auto l = logits;
    CHECK(b.sample(l, sp, {}, pos) == first[static_cast<std::size_t>(pos)]);
    sp.seed = 6;
    auto l2 = logits;
    (b.sample(l2, sp, {}, pos) == first[static_cast<std::size_t>(pos)] ? same : differ)++;
    sp.seed = 5;
  }
  CHECK(differ > 50);  // another seed gives another stream
}

TEST_CASE("bad sampling parameters are rejected") {
  sampling_params sp;
  sp.top_p = 0.f;
  CHECK_THROWS_AS(sp.validate(), loom::error);
  sp = {};
  sp.temperature = -1.f;
  CHECK_THROWS_AS(sp.validate(), loom::error);
  sp = {};
  sp.top_k = -2;
  CHECK_THROWS_AS(sp.validate(), loom::error);
  sp = {};
  sp.repetition_penalty = 0.f;
  CHECK_THROWS_AS(sp.validate(), loom::error);
}
