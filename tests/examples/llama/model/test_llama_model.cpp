// The reference LLaMA beyond PyTorch parity: finite-difference gradients of the whole model
// in double (a few elements of every parameter), checkpointing gives the same gradients,
// 16-bit parameter storage computes like rounded fp32 weights, init is a function of
// (seed, element), gradients accumulate, a step is bit-identical on 1 and 3 host threads (and
// on the AVX-512 and AVX2 sgemm kernels), and bad configs and tokens are loom::errors.
#include <doctest/doctest.h>
#include <llama/model/llama.hpp>

#include <loom/core/thread_pool.hpp>
#include <support/sgemm_kernels.hpp>

#include <cmath>
#include <string>
#include <tuple>
#include <vector>

using loom::index_t;

namespace {

struct batch_data {
  index_t b, s;
  std::vector<std::int32_t> tokens, targets;
  batch_data(index_t b_, index_t s_, index_t vocab, std::uint64_t seed) : b(b_), s(s_), tokens(b_ * s_), targets(b_ * s_) {
    const loom::counter_rng rng(seed);
    for (index_t i = 0; i < b * s; ++i) {
      tokens[i] = static_cast<std::int32_t>(rng.bits(2 * i) % vocab);
      targets[i] = i % 5 == 2 ? -100 : static_cast<std::int32_t>(rng.bits(2 * i + 1) % vocab);
    }
  }
  auto tok() const { return loom::make_view(tokens.data(), b, s); }
  auto tgt() const { return loom::make_view(targets.data(), b, s); }
};

template <class M>
std::string expect_error(M&& f) {
  try {
    f();
  } catch (const loom::error& e) {
    return e.what();
  }
  return "(no error)";
}

/// max |a - b| / max |b|
double max_rel_diff(std::span<const float> a, std::span<const float> b) {
  double d = 0, r = 0;
  for (std::size_t i = 0; i < a.size(); ++i) d = std::max(d, double(std::abs(a[i] - b[i]))), r = std::max(r, double(std::abs(b[i])));
  return d / r;
}

llama::config tiny(bool tied) {
  return {.dim = 8, .n_layers = 2, .n_heads = 2, .n_kv_heads = 1, .hidden_dim = 12, .vocab = 11, .seq_len = 6,
          .tied_output = tied};
}

}  // namespace

TEST_CASE("finite differences in double: a few elements of every parameter, tied and untied") {
  for (bool tied : {false, true}) {
    CAPTURE(tied);
    llama::model<double, double> m(tiny(tied));
    m.init(7, 0.3f);  // larger weights than the default so every path carries signal
    batch_data data(2, 5, 11, 3);
    m.zero_grad();
    m.forward(data.tok(), data.tgt());
    m.backward();
    auto p = m.params();
    for (const auto& e : m.layout().entries()) {
      for (std::size_t k : {std::size_t(0), e.numel / 2, e.numel - 1}) {
        const std::size_t i = e.offset + k;
        const double keep = p[i], h = 1e-5;
        p[i] = keep + h;
        const double up = m.forward(data.tok(), data.tgt());
        p[i] = keep - h;
        const double down = m.forward(data.tok(), data.tgt());
        p[i] = keep;
        const double numeric = (up - down) / (2 * h);
        INFO(e.name, "[", k, "]: analytic ", m.grads()[i], " numeric ", numeric);
        CHECK(std::abs(m.grads()[i] - numeric) <= 1e-7 * (1 + std::abs(numeric)));
      }
    }
  }
}

TEST_CASE("activation checkpointing gives bit-identical loss and gradients") {
  llama::config c{.dim = 32, .n_layers = 3, .n_heads = 4, .n_kv_heads = 2, .hidden_dim = 48, .vocab = 29, .seq_len = 8};
  batch_data data(2, 8, c.vocab, 5);
  llama::model<float> a(c), b(c);
  a.init(11), b.init(11);
  b.set_checkpointing(true);
  a.zero_grad(), b.zero_grad();
  CHECK(a.forward(data.tok(), data.tgt()) == b.forward(data.tok(), data.tgt()));
  a.backward(), b.backward();
  CHECK(std::equal(a.grads().begin(), a.grads().end(), b.grads().begin()));
}

TEST_CASE("a training step gives bit-identical loss, logits and gradients on 1 and 3 pool threads, and on either of loom's sgemm kernels") {
  // Large enough that attention (batch x kv heads = 8 pairs), SwiGLU and cross-entropy split
  // into 3 parts on the 3-thread pool, and the norms, rotary and residual adds into 2.
  llama::config c{.dim = 64, .n_layers = 2, .n_heads = 4, .n_kv_heads = 2, .hidden_dim = 96, .vocab = 512, .seq_len = 256};
  batch_data data(4, 256, c.vocab, 9);
  auto step = [&](loom::thread_pool& pool) {
    loom::host_pool_scope scope(pool);
    llama::model<float> m(c);
    m.init(13);
    m.zero_grad();
    const float loss = m.forward(data.tok(), data.tgt());
    m.backward();
    const auto logits = m.logits();
    return std::tuple{loss, std::vector<float>(logits.data(), logits.data() + logits.numel()),
                      std::vector<float>(m.grads().begin(), m.grads().end())};
  };
  loom::thread_pool one(1), three(3);
  std::vector<std::tuple<float, std::vector<float>, std::vector<float>>> per_kernel;
  loom::test::for_each_sgemm_kernel("a training step on 1 and 3 threads", [&](loom::ops::host_sgemm kernel) {
    const auto [loss1, logits1, grads1] = step(one);
    const auto [loss3, logits3, grads3] = step(three);
    if (loom::test::split_invariant(kernel)) {
      CHECK(loss1 == loss3);
      CHECK(logits1 == logits3);
      CHECK(grads1 == grads3);
      per_kernel.emplace_back(loss1, logits1, grads1);
    } else {  // BLAS's bits depend on how each GEMM is split: the same step within rounding
      CHECK(loss3 == doctest::Approx(loss1).epsilon(1e-5));
      std::size_t far = 0;
      for (std::size_t i = 0; i < grads1.size(); ++i) far += !(std::abs(grads1[i] - grads3[i]) <= 1e-4f * (1e-3f + std::abs(grads1[i])) + 1e-7f);
      CHECK(far == 0);
    }
  });
  for (std::size_t i = 1; i < per_kernel.size(); ++i) CHECK(per_kernel[i] == per_kernel[0]);  // avx512 == avx2, bit for bit
}

TEST_CASE("bfloat16 and half parameters compute like fp32 copies of the rounded weights") {
  llama::config c{.dim = 16, .n_layers = 2, .n_heads = 2, .n_kv_heads = 2, .hidden_dim = 24, .vocab = 19, .seq_len = 6};
  batch_data data(2, 6, c.vocab, 8);
  llama::model<loom::bfloat16> mb(c);
  llama::model<loom::half> mh(c);
  llama::model<float> f1(c), f2(c);
  mb.init(3), mh.init(3);
  for (std::size_t i = 0; i < f1.params().size(); ++i) {
    f1.params()[i] = static_cast<float>(mb.params()[i]);
    f2.params()[i] = static_cast<float>(mh.params()[i]);
  }
  mb.zero_grad(), f1.zero_grad(), mh.zero_grad(), f2.zero_grad();
  // Not bit for bit: OpenBLAS may round differently for operands at other addresses (the
  // widened weights live in the workspace), so compare at fp32 rounding level.
  CHECK(mb.forward(data.tok(), data.tgt()) == doctest::Approx(f1.forward(data.tok(), data.tgt())).epsilon(1e-6));
  CHECK(mh.forward(data.tok(), data.tgt()) == doctest::Approx(f2.forward(data.tok(), data.tgt())).epsilon(1e-6));
  mb.backward(), f1.backward(), mh.backward(), f2.backward();
  CHECK(max_rel_diff(mb.grads(), f1.grads()) < 1e-5);
  CHECK(max_rel_diff(mh.grads(), f2.grads()) < 1e-5);
}

TEST_CASE("init: element i is a function of (seed, i); norms are one; padding is zero") {
  const auto c = tiny(false);
  llama::model<float> a(c), b(c), d(c);
  a.init(42), b.init(42), d.init(43);
  CHECK(std::equal(a.params().begin(), a.params().end(), b.params().begin()));
  CHECK(!std::equal(a.params().begin(), a.params().end(), d.params().begin()));
  const loom::counter_rng rng(42);
  const auto& wq = a.layout().find("layers.1.attention.wq.weight");
  for (std::size_t k = 0; k < wq.numel; ++k) CHECK(a.params()[wq.offset + k] == 0.02f * rng.normal(wq.offset + k));
  const auto& wo = a.layout().find("layers.0.attention.wo.weight");
  CHECK(a.params()[wo.offset] == 0.02f / std::sqrt(4.f) * rng.normal(wo.offset));
  const auto& nw = a.layout().find("layers.0.ffn_norm.weight");
  for (std::size_t k = 0; k < nw.numel; ++k) CHECK(a.params()[nw.offset + k] == 1.f);
  std::size_t covered = 0;
  for (const auto& e : a.layout().entries()) covered += e.numel;
  CHECK(covered == a.parameter_count());
  CHECK(a.layout().size() % a.layout().align() == 0);
  CHECK(a.layout().contains("output.weight"));
  llama::model<float> t(tiny(true));
  CHECK(!t.layout().contains("output.weight"));
  CHECK(t.parameter_count() + 11 * 8 == a.parameter_count());
}

TEST_CASE("gradients accumulate across backward calls") {
  const auto c = tiny(false);
  llama::model<double, double> m(c);
  m.init(1);
  batch_data data(1, 6, c.vocab, 2);
  m.zero_grad();
  m.forward(data.tok(), data.tgt());
  m.backward();
  std::vector<double> once(m.grads().begin(), m.grads().end());
  m.forward(data.tok(), data.tgt());
  m.backward(0.5);
  for (std::size_t i = 0; i < once.size(); ++i) CHECK(m.grads()[i] == doctest::Approx(1.5 * once[i]).epsilon(1e-12));
}

TEST_CASE("bad configs, tokens and targets are loom::errors naming the value") {
  auto c = tiny(false);
  c.dim = 10, c.n_heads = 4;
  CHECK(expect_error([&] { llama::model<float> m(c); }).find("dim (10) must be divisible by n_heads (4)") !=
        std::string::npos);
  c = tiny(false);
  c.n_heads = 4, c.n_kv_heads = 3;
  CHECK(expect_error([&] { c.validate(); }).find("n_heads (4) must be divisible by n_kv_heads (3)") != std::string::npos);
  c = tiny(false);
  c.vocab = 0;
  CHECK(expect_error([&] { c.validate(); }).find("vocab=0") != std::string::npos);

  llama::model<float> m(tiny(false));
  m.init(1);
  batch_data data(1, 4, 11, 1);
  data.tokens[2] = 11;
  CHECK(expect_error([&] { m.forward(data.tok(), data.tgt()); }).find("token id 11") != std::string::npos);
  data.tokens[2] = 0, data.targets[1] = 12;
  CHECK(expect_error([&] { m.forward(data.tok(), data.tgt()); }).find("target 12") != std::string::npos);
  batch_data longer(1, 7, 11, 1);
  CHECK(expect_error([&] { m.forward(longer.tok(), longer.tgt()); }).find("sequence length 7") != std::string::npos);
  llama::model<float> fresh(tiny(false));
  CHECK(expect_error([&] { fresh.backward(); }).find("forward(tokens, targets) first") != std::string::npos);
}

TEST_CASE("forward without targets gives the same logits; all-ignored targets give loss 0 and zero gradients") {
  const auto c = tiny(true);
  llama::model<float> m(c);
  m.init(9);
  batch_data data(2, 6, c.vocab, 4);
  m.forward(data.tok(), data.tgt());
  const std::vector<float> with_targets(m.logits().data(), m.logits().data() + m.logits().numel());
  m.forward(data.tok());
  CHECK(m.logits().extent(2) == c.vocab);
  CHECK(std::equal(with_targets.begin(), with_targets.end(), m.logits().data()));
  CHECK(expect_error([&] { m.backward(); }).find("forward(tokens, targets) first") != std::string::npos);
  std::fill(data.targets.begin(), data.targets.end(), -100);
  m.zero_grad();
  CHECK(m.forward(data.tok(), data.tgt()) == 0.f);
  m.backward();
  CHECK(std::all_of(m.grads().begin(), m.grads().end(), [](float g) { return g == 0.f; }));
}
