// AdamW against (1) the textbook formula evaluated naively in double, (2) torch.optim.AdamW.
#include <loom/optim/adamw.hpp>

#include <doctest/doctest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <unistd.h>

namespace {

std::vector<float> make(std::size_t n, float a, float b) {
  std::vector<float> x(n);
  for (std::size_t i = 0; i < n; ++i) x[i] = std::sin(a * static_cast<float>(i) + b) * (0.5f + 0.01f * static_cast<float>(i % 7));
  return x;
}

// Loshchilov & Hutter's AdamW, Algorithm 2 with torch's parameterisation (decay scaled by lr).
struct naive_adamw {
  std::vector<double> p, m, v;
  double lr, b1, b2, eps, wd;
  int t = 0;
  void step(const std::vector<float>& g) {
    ++t;
    for (std::size_t i = 0; i < p.size(); ++i) {
      p[i] -= lr * wd * p[i];
      m[i] = b1 * m[i] + (1 - b1) * g[i];
      v[i] = b2 * v[i] + (1 - b2) * double(g[i]) * g[i];
      double mhat = m[i] / (1 - std::pow(b1, t)), vhat = v[i] / (1 - std::pow(b2, t));
      p[i] -= lr * mhat / (std::sqrt(vhat) + eps);
    }
  }
};

}  // namespace

TEST_CASE("adamw matches the naive formula over several steps") {
  const std::size_t n = 1003;
  loom::optim::adamw_options o{.lr = 3e-3f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = 0.1f};
  auto p = make(n, 0.3f, 0.1f);
  naive_adamw ref{{p.begin(), p.end()}, std::vector<double>(n), std::vector<double>(n), o.lr, o.beta1, o.beta2, o.eps, o.weight_decay};
  loom::optim::adamw opt(n, o);
  for (int s = 0; s < 10; ++s) {
    auto g = make(n, 0.7f + 0.1f * s, 0.3f * s);
    opt.step(p, g, o.lr);
    ref.step(g);
  }
  CHECK(opt.step_count() == 10);
  for (std::size_t i = 0; i < n; ++i) REQUIRE(p[i] == doctest::Approx(ref.p[i]).epsilon(2e-6));
}

TEST_CASE("adamw on shards equals adamw on the whole buffer (ZeRO's use)") {
  const std::size_t n = 1000;
  loom::optim::adamw_options o{.lr = 1e-2f};
  auto whole = make(n, 0.2f, 0.0f);
  auto sharded = whole;
  loom::optim::adamw a(n, o);
  // four "ranks", each with moments for its own 250 elements only
  std::vector<loom::optim::adamw> shard;
  for (int r = 0; r < 4; ++r) shard.emplace_back(250, o);
  for (int s = 0; s < 5; ++s) {
    auto g = make(n, 0.9f, float(s));
    a.step(whole, g, o.lr);
    for (int r = 0; r < 4; ++r)
      shard[r].step(std::span<float>(sharded).subspan(250 * r, 250), std::span<const float>(g).subspan(250 * r, 250), o.lr);
  }
  for (std::size_t i = 0; i < n; ++i) REQUIRE(whole[i] == sharded[i]);  // bit for bit
  // groups: update() with per-group weight decay
  loom::optim::adamw b(n, o);
  b.begin_step();
  auto q = make(n, 0.2f, 0.0f);
  auto g = make(n, 0.9f, 0.0f);
  b.update(0, std::span<float>(q).first(500), std::span<const float>(g).first(500), o.lr, 0.f);
  CHECK_THROWS_WITH_AS(b.update(600, std::span<float>(q).first(500), std::span<const float>(g).first(500), o.lr, 0.f),
                       doctest::Contains("offset=600"), loom::error);
}

#ifdef LOOM_TORCH_PYTHON
TEST_CASE("adamw matches torch.optim.AdamW (/usr/bin/python3)") {
  namespace fs = std::filesystem;
  const std::size_t n = 517;
  const int steps = 6;
  loom::optim::adamw_options o{.lr = 2e-3f, .beta1 = 0.85f, .beta2 = 0.98f, .eps = 1e-6f, .weight_decay = 0.05f};
  fs::path dir = fs::temp_directory_path() / ("loom_adamw_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  auto p = make(n, 0.41f, 0.2f);
  std::vector<std::vector<float>> grads;
  for (int s = 0; s < steps; ++s) grads.push_back(make(n, 1.3f + 0.05f * s, 0.7f * s));
  {
    std::ofstream in(dir / "in.f32", std::ios::binary);
    in.write(reinterpret_cast<const char*>(p.data()), n * 4);
    for (auto& g : grads) in.write(reinterpret_cast<const char*>(g.data()), n * 4);
    std::ofstream hp(dir / "hp.txt");
    hp.precision(9);
    hp << n << ' ' << steps << ' ' << o.lr << ' ' << o.beta1 << ' ' << o.beta2 << ' ' << o.eps << ' ' << o.weight_decay << '\n';
  }
  std::string cmd = LOOM_TORCH_PYTHON " " LOOM_TEST_DIR "/torch_adamw.py " + dir.string();
  REQUIRE_MESSAGE(std::system(cmd.c_str()) == 0, "the oracle failed: ", cmd);
  std::vector<float> out(static_cast<std::size_t>(steps) * 3 * n);
  std::ifstream f(dir / "out.f32", std::ios::binary);
  f.read(reinterpret_cast<char*>(out.data()), static_cast<std::streamsize>(out.size() * 4));
  REQUIRE(f.gcount() == static_cast<std::streamsize>(out.size() * 4));
  loom::optim::adamw opt(n, o);
  for (int s = 0; s < steps; ++s) {
    opt.step(p, grads[s], o.lr);
    const float* tp = out.data() + 3 * n * s;
    for (std::size_t i = 0; i < n; ++i) {
      REQUIRE(p[i] == doctest::Approx(tp[i]).epsilon(1e-6));
      REQUIRE(opt.exp_avg()[i] == doctest::Approx(tp[n + i]).epsilon(1e-6));
      REQUIRE(opt.exp_avg_sq()[i] == doctest::Approx(tp[2 * n + i]).epsilon(1e-6));
    }
  }
  fs::remove_all(dir);
}
#endif

TEST_CASE("adamw rejects bad options and sizes, naming the value") {
  CHECK_THROWS_WITH_AS(loom::optim::adamw(4, {.beta1 = 1.f}), doctest::Contains("beta1=1"), loom::error);
  CHECK_THROWS_WITH_AS(loom::optim::adamw(4, {.eps = 0.f}), doctest::Contains("eps=0"), loom::error);
  CHECK_THROWS_WITH_AS(loom::optim::adamw(4, {.weight_decay = -1.f}), doctest::Contains("weight_decay=-1"), loom::error);
  loom::optim::adamw a(4, {});
  std::vector<float> p(3), g(3);
  CHECK_THROWS_WITH_AS(a.step(p, g, 1e-3f), doctest::Contains("params.size()=3"), loom::error);
}
