// Learning-rate schedules against closed-form points and a plain-Python transcription of
// DeepSpeed's documented rules (ds_lr_schedules.py, run with /usr/bin/python3).
#include <loom/optim/lr_schedule.hpp>

#include <doctest/doctest.h>

#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

namespace {
std::vector<double> oracle(const std::string& args) {
  std::string cmd = "/usr/bin/python3 " LOOM_TEST_DIR "/ds_lr_schedules.py " + args;
  std::unique_ptr<FILE, int (*)(FILE*)> p(popen(cmd.c_str(), "r"), pclose);
  REQUIRE(p);
  std::vector<double> v;
  double x;
  while (std::fscanf(p.get(), "%lf", &x) == 1) v.push_back(x);
  return v;
}
template <class S>
void compare(const S& s, const std::string& args, int n) {
  auto ref = oracle(args);
  REQUIRE_MESSAGE(ref.size() == static_cast<std::size_t>(n), "oracle failed: ", args);
  for (int i = 0; i < n; ++i) REQUIRE(s.lr(i) == doctest::Approx(ref[i]).epsilon(1e-6));
}
}  // namespace

TEST_CASE("WarmupCosineLR: closed-form points") {
  loom::optim::warmup_cosine_lr s{.base_lr = 0.01f, .total_num_steps = 100, .warmup_min_ratio = 0.1f, .warmup_num_steps = 10,
                                  .cos_min_ratio = 0.01f, .type = loom::optim::warmup_type::linear};
  CHECK(s.lr(0) == doctest::Approx(0.001));                  // min ratio at the first step
  CHECK(s.lr(5) == doctest::Approx(0.01 * (0.1 + 0.5 * 0.9)));
  CHECK(s.lr(10) == doctest::Approx(0.01 * (0.01 + 0.99 * (1 + std::cos(M_PI / 90)) / 2)));
  CHECK(s.lr(54) == doctest::Approx(0.01 * (0.01 + 0.99 * 0.5)));  // k = 45 of 90: cos(pi / 2) = 0
  CHECK(s.lr(99) == doctest::Approx(0.01 * 0.01));          // cos(pi) at the last step
  CHECK(s.lr(-1) == 0.f);
}

TEST_CASE("WarmupDecayLR and WarmupLR: closed-form points") {
  loom::optim::warmup_decay_lr d{.total_num_steps = 50, .warmup_min_lr = 0.f, .warmup_max_lr = 1.f, .warmup_num_steps = 10,
                                 .type = loom::optim::warmup_type::log};
  CHECK(d.lr(0) == 0.f);                                   // ln(1) = 0
  CHECK(d.lr(9) == doctest::Approx(1.0));                  // ln(10) / ln(10)
  CHECK(d.lr(10) == doctest::Approx(40.0 / 40.0));
  CHECK(d.lr(30) == doctest::Approx(20.0 / 40.0));
  CHECK(d.lr(50) == 0.f);
  CHECK(d.lr(70) == 0.f);
  loom::optim::warmup_lr w{.warmup_min_lr = 0.5f, .warmup_max_lr = 1.5f, .warmup_num_steps = 1,
                           .type = loom::optim::warmup_type::linear};
  CHECK(w.warmup_steps() == 2);  // DeepSpeed clamps to 2
  CHECK(w.lr(1) == doctest::Approx(1.0));
  CHECK(w.lr(2) == doctest::Approx(1.5));
}

TEST_CASE("schedules equal DeepSpeed's rules at every iteration") {
  using loom::optim::warmup_type;
  compare(loom::optim::warmup_cosine_lr{.base_lr = 3e-4f, .total_num_steps = 200, .warmup_min_ratio = 0.f, .warmup_num_steps = 20,
                                        .cos_min_ratio = 1e-4f, .type = warmup_type::log},
          "WarmupCosineLR 200 base_lr=3e-4 total_num_steps=200 warmup_num_steps=20 cos_min_ratio=1e-4 warmup_type=log", 200);
  compare(loom::optim::warmup_cosine_lr{.base_lr = 1e-3f, .total_num_steps = 120, .warmup_min_ratio = 0.2f, .warmup_num_steps = 7,
                                        .cos_min_ratio = 0.05f, .type = warmup_type::linear},
          "WarmupCosineLR 150 base_lr=1e-3 total_num_steps=120 warmup_min_ratio=0.2 warmup_num_steps=7 cos_min_ratio=0.05 "
          "warmup_type=linear",
          150);
  compare(loom::optim::warmup_decay_lr{.total_num_steps = 100, .warmup_min_lr = 1e-5f, .warmup_max_lr = 1e-3f,
                                       .warmup_num_steps = 15, .type = warmup_type::log},
          "WarmupDecayLR 130 total_num_steps=100 warmup_min_lr=1e-5 warmup_max_lr=1e-3 warmup_num_steps=15 warmup_type=log", 130);
  compare(loom::optim::warmup_lr{.warmup_min_lr = 0.f, .warmup_max_lr = 2e-3f, .warmup_num_steps = 30, .type = warmup_type::linear},
          "WarmupLR 60 warmup_min_lr=0 warmup_max_lr=2e-3 warmup_num_steps=30 warmup_type=linear", 60);
}

TEST_CASE("bad schedules are refused naming the value") {
  CHECK_THROWS_WITH_AS(loom::optim::parse_warmup_type("exp"), doctest::Contains("warmup_type=\"exp\""), loom::error);
  CHECK_THROWS_WITH_AS(loom::optim::check_schedule(loom::optim::warmup_cosine_lr{.total_num_steps = 5, .warmup_num_steps = 10}),
                       doctest::Contains("total_num_steps (5)"), loom::error);
  loom::optim::any_lr_schedule a{loom::optim::warmup_decay_lr{.total_num_steps = 10, .warmup_max_lr = 1.f, .warmup_num_steps = 2,
                                                              .type = loom::optim::warmup_type::linear}};
  CHECK(a.lr(1) == doctest::Approx(0.5));
}
