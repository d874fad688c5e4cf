// loom::lora against independent oracles: the adapter's forward and backward against the
// formula in plain loops (dropout included); every tensor-parallel split (column / row, tp =
// 2, 4 on thread ranks) against tp = 1; merge against the unmerged forward; the PEFT folder
// against a PyTorch transcription of PEFT's LoRA layer that reads it by PEFT's names (LLaMA
// names with the q/k row permutation, ChatGLM names); and the bad inputs, each a loom::error
// naming the field, tensor or value.
#include <loom/comm/thread_comm.hpp>
#include <loom/core/random.hpp>
#include <loom/lora/adapter.hpp>
#include <loom/lora/config.hpp>
#include <loom/lora/peft.hpp>

#include <support/error_of.hpp>
#include <support/rel_err.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <unistd.h>
#include <vector>

namespace lora = loom::lora;
namespace tp = loom::nn::tp;
using loom::index_t;
using T = double;

namespace {

// normal values rounded to float, so that a float file (safetensors F32) holds them exactly
std::vector<T> lora_randn(std::size_t n, std::uint64_t seed, float std = 1.f) {
  std::vector<float> v(n);
  loom::counter_rng(seed).fill_normal(std::span<float>(v), 0, 0.f, std);
  return {v.begin(), v.end()};
}

double lora_max_diff(const std::vector<T>& a, const std::vector<T>& b) {
  REQUIRE(a.size() == b.size());
  return loom::test::max_abs_diff(a.data(), b.data(), a.size());
}

// The formula in loops: u = x * mask, h = u A^T, y = s h B^T; dB = s dy^T h, dh = s dy B,
// dA = dh^T u, dx = (dh A) * mask.
struct lora_oracle {
  std::vector<T> y, dx, dA, dB;
  lora_oracle(const std::vector<T>& x, const std::vector<T>& mask, const std::vector<T>& A, const std::vector<T>& B,
              const std::vector<T>& dy, T s, index_t n, index_t in, index_t out, index_t r)
      : y(n * out, 0), dx(n * in, 0), dA(r * in, 0), dB(out * r, 0) {
    std::vector<T> u(n * in), h(n * r, 0), dh(n * r, 0);
    for (index_t i = 0; i < n * in; ++i) u[i] = x[i] * mask[i];
    for (index_t i = 0; i < n; ++i)
      for (index_t k = 0; k < r; ++k)
        for (index_t j = 0; j < in; ++j) h[i * r + k] += u[i * in + j] * A[k * in + j];
    for (index_t i = 0; i < n; ++i)
      for (index_t o = 0; o < out; ++o)
        for (index_t k = 0; k < r; ++k) {
          y[i * out + o] += s * h[i * r + k] * B[o * r + k];
          dB[o * r + k] += s * dy[i * out + o] * h[i * r + k];
          dh[i * r + k] += s * dy[i * out + o] * B[o * r + k];
        }
    for (index_t i = 0; i < n; ++i)
      for (index_t k = 0; k < r; ++k)
        for (index_t j = 0; j < in; ++j) {
          dA[k * in + j] += dh[i * r + k] * u[i * in + j];
          dx[i * in + j] += dh[i * r + k] * A[k * in + j] * mask[i * in + j];
        }
  }
};

// columns [c0, c0 + w) of a row-major [rows, cols] matrix
std::vector<T> lora_columns(const std::vector<T>& m, index_t rows, index_t cols, index_t c0, index_t w) {
  std::vector<T> out(static_cast<std::size_t>(rows * w));
  for (index_t r = 0; r < rows; ++r)
    for (index_t c = 0; c < w; ++c) out[r * w + c] = m[r * cols + c0 + c];
  return out;
}

std::vector<T> full_mask(const lora::dropout& d, index_t n, index_t in) {
  std::vector<T> m(n * in, 1.0);
  if (d.active()) lora::dropout_mask(d, 0, in, loom::make_view(m.data(), n, in));
  return m;
}

}  // namespace

TEST_CASE("lora::config: PEFT's defaults, scaling, and bad values named") {
  lora::config c;
  CHECK(c.r == 8);
  CHECK(c.lora_alpha == 8.0);
  CHECK(c.target_modules == std::vector<std::string>{"q_proj", "v_proj"});
  c.r = 16, c.lora_alpha = 32;
  CHECK(c.scaling() == 2.0);
  c.use_rslora = true;
  CHECK(c.scaling() == 8.0);  // 32 / sqrt(16)
  using loom::test::error_of;
  auto bad = [](auto edit) {
    lora::config b;
    edit(b);
    return error_of([&] { b.validate(); });
  };
  CHECK(bad([](auto& b) { b.r = 0; }).find("r=0") != std::string::npos);
  CHECK(bad([](auto& b) { b.r = -3; }).find("r=-3") != std::string::npos);
  CHECK(bad([](auto& b) { b.lora_alpha = INFINITY; }).find("lora_alpha=inf") != std::string::npos);
  CHECK(bad([](auto& b) { b.lora_dropout = 1.0; }).find("lora_dropout=1") != std::string::npos);
  CHECK(bad([](auto& b) { b.target_modules = {"q_proj", "qproj"}; }).find("'qproj'") != std::string::npos);
  CHECK(bad([](auto& b) { b.target_modules = {"q_proj", "q_proj"}; }).find("listed twice") != std::string::npos);
  CHECK(bad([](auto& b) { b.target_modules.clear(); }).find("target_modules is empty") != std::string::npos);
  CHECK(lora::parse_targets("q_proj,v_proj,dense") == std::vector<std::string>{"q_proj", "v_proj", "dense"});
  CHECK(error_of([] { lora::parse_targets("q_proj,,v_proj"); }).find("empty module name") != std::string::npos);
  loom::nn::param_layout L;
  CHECK(error_of([&] { lora::adapter<T>(L, "m", 4, 4, 0, lora::split::column); }).find("r=0") != std::string::npos);
}

TEST_CASE("lora::adapter forward and backward equal the formula, dropout included") {
  const index_t n = 7, in = 10, out = 6, r = 3;
  for (double p : {0.0, 0.3}) {
    CAPTURE(p);
    loom::nn::param_layout L;
    lora::adapter<T> ad(L, "m", in, out, r, lora::split::column);
    std::vector<T> params = lora_randn(L.size(), 11, 0.5f), grads(L.size(), 0);
    const std::vector<T> x = lora_randn(n * in, 12), dy = lora_randn(n * out, 13), y0 = lora_randn(n * out, 14);
    const lora::dropout d{p, 5, 100};
    const T s = 1.75;
    const std::vector<T> A(params.begin() + ad.a().offset, params.begin() + ad.a().offset + r * in);
    const std::vector<T> B(params.begin() + ad.b().offset, params.begin() + ad.b().offset + out * r);
    const lora_oracle o(x, full_mask(d, n, in), A, B, dy, s, n, in, out, r);
    loom::nn::workspace<T> ws;
    auto act = ad.make_activations(n, d.active());
    std::vector<T> y = y0, dx(n * in, 0.5);
    ad.forward(std::span<T>(params), loom::make_view(x.data(), n, in), act, loom::make_view(y.data(), n, out), ws, s, d);
    ws.reset();
    ad.backward(std::span<T>(params), std::span<T>(grads), loom::make_view(x.data(), n, in), act,
                loom::make_view(dy.data(), n, out), loom::make_view(dx.data(), n, in), ws, s, d);
    for (index_t i = 0; i < n * out; ++i) CHECK(y[i] - y0[i] == doctest::Approx(o.y[i]).epsilon(1e-12));
    for (index_t i = 0; i < n * in; ++i) CHECK(dx[i] - 0.5 == doctest::Approx(o.dx[i]).epsilon(1e-12));
    for (index_t i = 0; i < r * in; ++i) CHECK(grads[ad.a().offset + i] == doctest::Approx(o.dA[i]).epsilon(1e-12));
    for (index_t i = 0; i < out * r; ++i) CHECK(grads[ad.b().offset + i] == doctest::Approx(o.dB[i]).epsilon(1e-12));
  }
  // the mask keeps about 1 - p of the elements, scaled by 1 / (1 - p)
  const auto m = full_mask({0.25, 9, 0}, 100, 100);
  const auto kept = std::count_if(m.begin(), m.end(), [](T v) { return v != 0; });
  CHECK(kept > 7200);
  CHECK(kept < 7800);
  CHECK(*std::max_element(m.begin(), m.end()) == doctest::Approx(1 / 0.75));
}

TEST_CASE("lora::adapter on tp = 2, 4 (column and row split) equals tp = 1; init is split-independent") {
  const index_t n = 5, in = 8, out = 12, r = 4;
  const lora::dropout d{0.2, 3, 7};
  const T s = 0.5;
  for (lora::split sp : {lora::split::column, lora::split::row}) {
    loom::nn::param_layout FL;
    lora::adapter<T> full(FL, "m", in, out, r, lora::split::column);
    std::vector<T> fp(FL.size(), 0), fg(FL.size(), 0);
    full.init(std::span<T>(fp), 21, 1000);
    const auto b = lora_randn(out * r, 22, 0.3f);  // a trained B (init's is zero)
    std::copy(b.begin(), b.end(), fp.begin() + full.b().offset);
    const auto x = lora_randn(n * in, 23), dy = lora_randn(n * out, 24);
    std::vector<T> fy(n * out, 0), fdx(n * in, 0);
    {
      loom::nn::workspace<T> ws;
      auto act = full.make_activations(n, true);
      full.forward(std::span<T>(fp), loom::make_view(x.data(), n, in), act, loom::make_view(fy.data(), n, out), ws, s, d);
      full.backward(std::span<T>(fp), std::span<T>(fg), loom::make_view(x.data(), n, in), act,
                    loom::make_view(dy.data(), n, out), loom::make_view(fdx.data(), n, in), ws, s, d);
    }
    for (int t : {1, 2, 4}) {
      CAPTURE(t);
      CAPTURE(sp == lora::split::row);
      std::vector<double> err(t, 1.0);
      loom::comm::run_ranks(t, [&](loom::comm::thread_comm& c) {
        const int rk = c.rank();
        loom::nn::param_layout L;
        tp::shard_list shards;
        lora::adapter<T> ad(L, "m", in, out, r, sp, {rk, t}, &shards);
        auto off = [&](const std::string& name) { return FL.find(name).offset; };
        std::vector<T> p(L.size(), 0), g(L.size(), 0), pinit(L.size(), 0), want(L.size(), 0);
        tp::load_shards(shards, std::span<const T>(fp), std::span<T>(p), off);
        ad.init(std::span<T>(pinit), 21, 1000);
        double e = 0;  // A as the full init drew it
        for (index_t i = 0; i < static_cast<index_t>(ad.a().numel()); ++i)
          e = std::max(e, std::abs(pinit[ad.a().offset + i] - p[ad.a().offset + i]));
        const index_t il = ad.in_features(), ol = ad.out_features();
        const auto xl = lora_columns(x, n, in, ad.first_input(), il);
        const auto dyl = lora_columns(dy, n, out, ad.first_output(), ol);
        std::vector<T> y(n * ol, 0), dx(n * il, 0);
        loom::nn::workspace<T> ws;
        auto act = ad.make_activations(n, true);
        ad.forward(c, std::span<T>(p), loom::make_view(xl.data(), n, il), act, loom::make_view(y.data(), n, ol), ws, s, d);
        ws.reset();
        ad.backward(c, std::span<T>(p), std::span<T>(g), loom::make_view(xl.data(), n, il), act,
                    loom::make_view(dyl.data(), n, ol), loom::make_view(dx.data(), n, il), ws, s, d);
        e = std::max(e, lora_max_diff(y, lora_columns(fy, n, out, ad.first_output(), ol)));
        e = std::max(e, lora_max_diff(dx, lora_columns(fdx, n, in, ad.first_input(), il)));
        tp::load_shards(shards, std::span<const T>(fg), std::span<T>(want), off);  // replicas too: they must stay equal
        e = std::max(e, lora_max_diff(g, want));
        // merging is local: each rank's merged shard is the fully merged weight's rectangle
        std::vector<T> W = lora_randn(out * in, 25), Wl = lora_columns(W, out, in, ad.first_input(), il);
        Wl = std::vector<T>(Wl.begin() + ad.first_output() * il, Wl.begin() + (ad.first_output() + ol) * il);
        const loom::nn::param_slot<2> wfull{0, {out, in}}, wl{0, {ol, il}};
        full.merge(std::span<T>(W), wfull, std::span<const T>(fp), s);
        ad.merge(std::span<T>(Wl), wl, std::span<const T>(p), s);
        auto Wm = lora_columns(W, out, in, ad.first_input(), il);
        Wm = std::vector<T>(Wm.begin() + ad.first_output() * il, Wm.begin() + (ad.first_output() + ol) * il);
        e = std::max(e, lora_max_diff(Wl, Wm));
        err[rk] = e;
      });
      for (double e : err) CHECK(e < 1e-12);
    }
  }
}

TEST_CASE("lora::adapter::backward_from_weight_grad (merged base's dW) equals backward, on tp = 1, 2, 4") {
  const index_t n = 6, in = 8, out = 12, r = 2;
  const T s = 1.5;
  for (lora::split sp : {lora::split::column, lora::split::row}) {
    loom::nn::param_layout FL;
    lora::adapter<T> full(FL, "m", in, out, r, lora::split::column);
    std::vector<T> fp = lora_randn(FL.size(), 41, 0.4f), fg(FL.size(), 0);
    const auto x = lora_randn(n * in, 42), dy = lora_randn(n * out, 43);
    std::vector<T> y(n * out, 0), G(out * in, 0);
    loom::nn::workspace<T> ws0;
    auto act = full.make_activations(n, false);
    full.forward(std::span<T>(fp), loom::make_view(x.data(), n, in), act, loom::make_view(y.data(), n, out), ws0, s);
    full.backward(std::span<T>(fp), std::span<T>(fg), loom::make_view(x.data(), n, in), act, loom::make_view(dy.data(), n, out),
                  loom::tensor_view<T, loom::host, 2>{}, ws0, s);
    for (index_t o = 0; o < out; ++o)  // G = dy^T x: the merged base weight's gradient
      for (index_t j = 0; j < in; ++j)
        for (index_t i = 0; i < n; ++i) G[o * in + j] += dy[i * out + o] * x[i * in + j];
    for (int t : {1, 2, 4}) {
      CAPTURE(t);
      std::vector<double> err(t, 1.0);
      loom::comm::run_ranks(t, [&](loom::comm::thread_comm& c) {
        loom::nn::param_layout L;
        tp::shard_list shards;
        lora::adapter<T> ad(L, "m", in, out, r, sp, {c.rank(), t}, &shards);
        auto off = [&](const std::string& name) { return FL.find(name).offset; };
        std::vector<T> p(L.size(), 0), g(L.size(), 0), want(L.size(), 0);
        tp::load_shards(shards, std::span<const T>(fp), std::span<T>(p), off);
        tp::load_shards(shards, std::span<const T>(fg), std::span<T>(want), off);
        auto Gl = lora_columns(G, out, in, ad.first_input(), ad.in_features());
        Gl = std::vector<T>(Gl.begin() + ad.first_output() * ad.in_features(),
                            Gl.begin() + (ad.first_output() + ad.out_features()) * ad.in_features());
        loom::nn::workspace<T> ws;
        ad.backward_from_weight_grad(c, std::span<T>(p), std::span<T>(g),
                                     loom::make_view(static_cast<const T*>(Gl.data()), ad.out_features(), ad.in_features()), ws, s);
        err[c.rank()] = lora_max_diff(g, want);
      });
      for (double e : err) CHECK(e < 1e-12);
    }
  }
}

TEST_CASE("lora::adapter::merge: merged forward == unmerged forward; unmerge gives the base back") {
  const index_t n = 6, in = 32, out = 24, r = 8;
  loom::nn::param_layout L;
  lora::adapter<float> ad(L, "m", in, out, r, lora::split::column);
  std::vector<float> p(L.size()), W(out * in), x(n * in);
  loom::counter_rng(31).fill_normal(std::span<float>(p), 0, 0.f, 0.2f);
  loom::counter_rng(32).fill_normal(std::span<float>(W), 0, 0.f, 0.2f);
  loom::counter_rng(33).fill_normal(std::span<float>(x), 0, 0.f, 1.f);
  const float s = 2.f;
  const loom::nn::param_slot<2> w{0, {out, in}};
  std::vector<float> y(n * out), ym(n * out);
  loom::nn::workspace<float> ws;
  auto act = ad.make_activations(n, false);
  loom::ops::gemm(loom::host{}, loom::make_view(x.data(), n, in), loom::make_view(static_cast<const float*>(W.data()), out, in).transpose(0, 1),
                  loom::make_view(y.data(), n, out));
  ad.forward(std::span<float>(p), loom::make_view(x.data(), n, in), act, loom::make_view(y.data(), n, out), ws, s);
  const auto W0 = W;
  ad.merge(std::span<float>(W), w, std::span<const float>(p), s);
  loom::ops::gemm(loom::host{}, loom::make_view(x.data(), n, in), loom::make_view(static_cast<const float*>(W.data()), out, in).transpose(0, 1),
                  loom::make_view(ym.data(), n, out));
  double e = 0;
  for (index_t i = 0; i < n * out; ++i) e = std::max(e, double(std::abs(y[i] - ym[i])));
  CHECK(e < 1e-5);
  ad.merge(std::span<float>(W), w, std::span<const float>(p), s, -1);
  e = 0;
  for (index_t i = 0; i < out * in; ++i) e = std::max(e, double(std::abs(W[i] - W0[i])));
  CHECK(e < 1e-6);
  using loom::test::error_of;
  CHECK(error_of([&] { ad.merge(std::span<float>(W), loom::nn::param_slot<2>{0, {out, in / 2}}, std::span<const float>(p), s); })
            .find("base weight is [24, 16]") != std::string::npos);
}

namespace {

// One adapted module of the PEFT test: the base weight (loom's row order), the adapter's A
// and B, its input, output gradient and dropout mask, and what loom computed.
struct peft_module {
  std::string family, module;
  index_t layer = 0, in = 0, out = 0, head_dim = 0;  // head_dim > 0: LLaMA q/k rows, permuted on export
  std::vector<T> W, A, B, x, dy, mask, y, dx, dA, dB, y_merged;  // y_merged: x (W + s B A)^T, loom's merge
};

// HF's row of loom's row o (interleaved pairs -> half split), written out here as the oracle
// of lora::interleaved_to_half_split_rows.
index_t hf_row(index_t o, index_t hd) {
  if (hd == 0) return o;
  const index_t h = o / hd, i = (o % hd) / 2, p = o % 2;
  return h * hd + p * hd / 2 + i;
}

loom::io::named_tensor as_tensor(const std::vector<T>& v, std::vector<std::int64_t> shape) {
  loom::io::named_tensor t{std::move(shape), loom::buffer<float>(v.size())};
  std::copy(v.begin(), v.end(), t.data.begin());
  return t;
}

// Runs loom's adapter (base + LoRA, forward and backward) on m; rows of W and B in loom's order.
void run_module(peft_module& m, const lora::config& c, std::uint64_t seed) {
  const index_t n = 5, in = m.in, out = m.out, r = c.r;
  loom::nn::param_layout L;
  lora::adapter<T> ad(L, m.module, in, out, r, lora::split::column);
  std::vector<T> p(L.size(), 0), g(L.size(), 0);
  ad.init(std::span<T>(p), seed, 0);
  const auto b = lora_randn(out * r, seed + 1, 0.2f);
  std::copy(b.begin(), b.end(), p.begin() + ad.b().offset);
  for (auto& v : p) v = static_cast<float>(v);  // what an F32 file holds
  m.W = lora_randn(out * in, seed + 2, 0.3f), m.x = lora_randn(n * in, seed + 3), m.dy = lora_randn(n * out, seed + 4);
  const lora::dropout d{c.lora_dropout, seed + 5, 0};
  m.mask = full_mask(d, n, in);
  for (auto& v : m.mask) v = static_cast<float>(v);
  m.A.assign(p.begin() + ad.a().offset, p.begin() + ad.a().offset + r * in);
  m.B.assign(p.begin() + ad.b().offset, p.begin() + ad.b().offset + out * r);
  m.y.assign(n * out, 0), m.dx.assign(n * in, 0);
  for (index_t i = 0; i < n; ++i)  // the base, in loops
    for (index_t o = 0; o < out; ++o)
      for (index_t j = 0; j < in; ++j) {
        m.y[i * out + o] += m.x[i * in + j] * m.W[o * in + j];
        m.dx[i * in + j] += m.dy[i * out + o] * m.W[o * in + j];
      }
  loom::nn::workspace<T> ws;
  auto act = ad.make_activations(n, d.active());
  ad.forward(std::span<T>(p), loom::make_view(m.x.data(), n, in), act, loom::make_view(m.y.data(), n, out), ws, c.scaling(), d);
  ad.backward(std::span<T>(p), std::span<T>(g), loom::make_view(m.x.data(), n, in), act, loom::make_view(m.dy.data(), n, out),
              loom::make_view(m.dx.data(), n, in), ws, c.scaling(), d);
  std::vector<T> Wm = m.W;
  ad.merge(std::span<T>(Wm), loom::nn::param_slot<2>{0, {out, in}}, std::span<const T>(p), c.scaling());
  m.y_merged.assign(n * out, 0);
  for (index_t i = 0; i < n; ++i)
    for (index_t o = 0; o < out; ++o)
      for (index_t j = 0; j < in; ++j) m.y_merged[i * out + o] += m.x[i * in + j] * Wm[o * in + j];
  m.dA.assign(g.begin() + ad.a().offset, g.begin() + ad.a().offset + r * in);
  m.dB.assign(g.begin() + ad.b().offset, g.begin() + ad.b().offset + out * r);
}

// loom's tensors of m in PEFT's names and HF's row order (the export).
void export_module(const peft_module& m, index_t r, loom::io::tensor_map& out) {
  auto B = as_tensor(m.B, {m.out, r});
  if (m.head_dim) lora::interleaved_to_half_split_rows(B.data.span(), r, m.head_dim);
  out[lora::peft_tensor_name(m.family, m.layer, m.module, 'A')] = as_tensor(m.A, {r, m.in});
  out[lora::peft_tensor_name(m.family, m.layer, m.module, 'B')] = std::move(B);
}

std::vector<peft_module> peft_modules(const std::string& family, const lora::config& c) {
  std::vector<peft_module> ms;
  std::uint64_t seed = 100;
  for (index_t l = 0; l < 2; ++l) {
    auto add = [&](const char* module, index_t in, index_t out, index_t hd) {
      peft_module m;
      m.family = family, m.module = module, m.layer = l, m.in = in, m.out = out, m.head_dim = hd;
      ms.push_back(std::move(m));
    };
    if (family == "llama") {  // dim 8, 2 heads of 4, 1 kv head, hidden 12
      add("q_proj", 8, 8, 4);
      add("k_proj", 8, 4, 4);
      add("down_proj", 12, 8, 0);
    } else {  // dim 8, qkv rows 8 + 2 * 4, ffn 6: dense_h_to_4h [12, 8]
      add("query_key_value", 8, 16, 0);
      add("dense_h_to_4h", 8, 12, 0);
    }
  }
  for (auto& m : ms) run_module(m, c, seed += 10);
  return ms;
}

}  // namespace

TEST_CASE("PEFT layout: export then import gives the same tensors; bad adapters named") {
  namespace fs = std::filesystem;
  using loom::test::error_of;
  const fs::path dir = fs::temp_directory_path() / ("loom_lora_rt_" + std::to_string(::getpid()));
  lora::config c;
  c.r = 4, c.lora_alpha = 16, c.lora_dropout = 0.1, c.use_rslora = true, c.target_modules = {"q_proj", "k_proj", "down_proj"};
  const auto ms = peft_modules("llama", c);
  loom::io::tensor_map t;
  for (const auto& m : ms) export_module(m, c.r, t);
  CHECK(t.contains("base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"));
  CHECK(t.contains("base_model.model.model.layers.0.mlp.down_proj.lora_B.weight"));
  CHECK(lora::peft_tensor_name("chatglm", 3, "query_key_value", 'B') ==
        "base_model.model.transformer.encoder.layers.3.self_attention.query_key_value.lora_B.weight");
  CHECK(lora::peft_tensor_name("chatglm", 0, "dense_4h_to_h", 'A') ==
        "base_model.model.transformer.encoder.layers.0.mlp.dense_4h_to_h.lora_A.weight");
  lora::save_peft(dir.string(), c, t, "tiny-llama");
  const auto back = lora::load_peft(dir.string());
  CHECK(back.cfg.r == 4);
  CHECK(back.cfg.lora_alpha == 16);
  CHECK(back.cfg.lora_dropout == 0.1);
  CHECK(back.cfg.use_rslora);
  CHECK(back.cfg.target_modules == c.target_modules);
  const std::map<std::string, lora::module_shape> shapes{{"q_proj", {8, 8}}, {"k_proj", {8, 4}}, {"down_proj", {12, 8}}};
  lora::check_adapter(back.cfg, back.tensors, "llama", 2, shapes, "adapter");
  for (const auto& m : ms) {  // imported (B's rows permuted back) == what loom had, bit for bit
    const auto& Bf = back.tensors.at(lora::peft_tensor_name("llama", m.layer, m.module, 'B')).data;
    std::vector<float> B(Bf.begin(), Bf.end());
    if (m.head_dim) lora::interleaved_to_half_split_rows(std::span<float>(B), c.r, m.head_dim, /*inverse=*/true);
    const auto& A = back.tensors.at(lora::peft_tensor_name("llama", m.layer, m.module, 'A'));
    CHECK(std::equal(m.B.begin(), m.B.end(), B.begin(), B.end()));
    CHECK(std::equal(m.A.begin(), m.A.end(), A.data.begin()));
    for (index_t o = 0; o < m.out; ++o)  // and the permutation is HF's
      CHECK(back.tensors.at(lora::peft_tensor_name("llama", m.layer, m.module, 'B')).data[hf_row(o, m.head_dim) * c.r] ==
            static_cast<float>(m.B[o * c.r]));
  }
  // shapes or targets that do not fit the base
  auto wrong = shapes;
  wrong["down_proj"] = {16, 8};
  CHECK(error_of([&] { lora::check_adapter(back.cfg, back.tensors, "llama", 2, wrong, "adapter"); })
            .find("'base_model.model.model.layers.0.mlp.down_proj.lora_A.weight' has shape [4,12], the base model with r=4 "
                  "needs [4,16]") != std::string::npos);
  CHECK(error_of([&] { lora::check_adapter(back.cfg, back.tensors, "llama", 3, shapes, "adapter"); })
            .find("layers.2.self_attn.q_proj.lora_A.weight' is missing") != std::string::npos);
  auto fewer = back.cfg;
  fewer.target_modules = {"q_proj", "k_proj"};
  CHECK(error_of([&] { lora::check_adapter(fewer, back.tensors, "llama", 2, shapes, "adapter"); })
            .find("down_proj.lora_A.weight' matches no target module") != std::string::npos);
  auto glm = back.cfg;
  glm.target_modules = {"query_key_value"};
  CHECK(error_of([&] { lora::check_adapter(glm, back.tensors, "llama", 2, shapes, "adapter"); })
            .find("'query_key_value' is not a layer of the llama base model") != std::string::npos);
  // adapter_config.json with bad values
  auto cfg_error = [&](const std::string& key, const nlohmann::json& v) {
    nlohmann::json j = lora::adapter_config_json(c);
    j[key] = v;
    return error_of([&] { lora::config_from_adapter_json(j, "cfg.json"); });
  };
  CHECK(cfg_error("r", 0).find("cfg.json: r must be >= 1, got 0") != std::string::npos);
  CHECK(cfg_error("r", "eight").find("r must be an integer, got \"eight\"") != std::string::npos);
  // held by the JSON as unsigned: named as written, not wrapped to -1
  CHECK(cfg_error("r", std::uint64_t(-1)).find("got 18446744073709551615") != std::string::npos);
  CHECK(cfg_error("r", 2.5).find("r must be an integer, got 2.5") != std::string::npos);
  CHECK(cfg_error("lora_alpha", "x").find("lora_alpha must be a number") != std::string::npos);
  CHECK(cfg_error("lora_dropout", 1.5).find("lora_dropout must be <= 1, got 1.5") != std::string::npos);
  CHECK(cfg_error("lora_dropout", 1.0).find("lora_dropout=1") != std::string::npos);  // validate(): [0, 1)
  CHECK(cfg_error("peft_type", "IA3").find("peft_type is \"IA3\"") != std::string::npos);
  CHECK(cfg_error("target_modules", nlohmann::json::array({"q_proj", "wq"})).find("'wq'") != std::string::npos);
  CHECK(cfg_error("bias", "all").find("bias is \"all\"") != std::string::npos);
  fs::remove_all(dir);
}

#ifdef LOOM_TORCH_PYTHON
TEST_CASE("PyTorch's transcription of PEFT's LoRA layer reads loom's PEFT folder and agrees (LLaMA and ChatGLM names)") {
  namespace fs = std::filesystem;
  for (const std::string family : {"llama", "chatglm"}) {
    CAPTURE(family);
    const fs::path dir = fs::temp_directory_path() / ("loom_lora_peft_" + family + std::to_string(::getpid()));
    lora::config c;
    c.r = 4, c.lora_alpha = 8, c.lora_dropout = 0.25, c.use_rslora = family == "chatglm";
    c.target_modules = family == "llama" ? std::vector<std::string>{"q_proj", "k_proj", "down_proj"}
                                         : std::vector<std::string>{"query_key_value", "dense_h_to_4h"};
    const auto ms = peft_modules(family, c);
    loom::io::tensor_map adapter, inputs;
    nlohmann::json modules = nlohmann::json::object();
    for (std::size_t k = 0; k < ms.size(); ++k) {
      const auto& m = ms[k];
      export_module(m, c.r, adapter);
      const std::string key = "m" + std::to_string(k);
      auto W = as_tensor(m.W, {m.out, m.in});  // the base as the HF export has it
      if (m.head_dim) lora::interleaved_to_half_split_rows(W.data.span(), m.in, m.head_dim);
      inputs[key + ".weight"] = std::move(W);
      inputs[key + ".x"] = as_tensor(m.x, {5, m.in});
      inputs[key + ".dy"] = as_tensor(m.dy, {5, m.out});  // loom's dy, columns put in HF's order below
      for (index_t i = 0; i < 5; ++i)
        for (index_t o = 0; o < m.out; ++o) inputs[key + ".dy"].data[i * m.out + hf_row(o, m.head_dim)] = static_cast<float>(m.dy[i * m.out + o]);
      inputs[key + ".mask"] = as_tensor(m.mask, {5, m.in});
      modules[key] = lora::peft_module_path(family, m.layer, m.module);
    }
    lora::save_peft(dir.string(), c, adapter);
    loom::io::write_safetensors((dir / "inputs.safetensors").string(), inputs);
    std::ofstream(dir / "modules.json") << modules.dump();
    const std::string cmd = LOOM_TORCH_PYTHON " " LOOM_TEST_DIR "/peft_lora_reference.py " + dir.string();
    REQUIRE_MESSAGE(std::system(cmd.c_str()) == 0, "the oracle failed: ", cmd);
    const auto got = loom::io::read_safetensors((dir / "outputs.safetensors").string());
    for (std::size_t k = 0; k < ms.size(); ++k) {
      const auto& m = ms[k];
      const std::string key = "m" + std::to_string(k);
      CAPTURE(key);
      CAPTURE(m.module);
      double ey = 0, em = 0, edx = 0, eda = 0, edb = 0;
      for (index_t i = 0; i < 5; ++i)
        for (index_t o = 0; o < m.out; ++o) {
          const index_t h = i * m.out + hf_row(o, m.head_dim);
          ey = std::max(ey, std::abs(got.at(key + ".y").data[h] - m.y[i * m.out + o]));
          em = std::max(em, std::abs(got.at(key + ".y_merged").data[h] - m.y_merged[i * m.out + o]));
        }
      for (index_t i = 0; i < 5 * m.in; ++i) edx = std::max(edx, std::abs(got.at(key + ".dx").data[i] - m.dx[i]));
      for (index_t i = 0; i < c.r * m.in; ++i) eda = std::max(eda, std::abs(got.at(key + ".dA").data[i] - m.dA[i]));
      for (index_t o = 0; o < m.out; ++o)
        for (index_t j = 0; j < c.r; ++j)
          edb = std::max(edb, std::abs(got.at(key + ".dB").data[hf_row(o, m.head_dim) * c.r + j] - m.dB[o * c.r + j]));
      CHECK(ey < 1e-5);
      CHECK(em < 1e-5);
      CHECK(edx < 1e-5);
      CHECK(eda < 1e-5);
      CHECK(edb < 1e-5);
    }
    fs::remove_all(dir);
  }
}
#endif
